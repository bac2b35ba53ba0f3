// INT8 GEMM with a scaling epilogue (kernel set nn_gemm_int8, sm_90a only):
//
//   y[m, n] = bf16( float(sum_k x[m, k] w[n, k]) * (x_scale[m] * w_scale[n]) )
//
// x: INT8 [M, K] row-major with one f32 scale a row (a token's), w: INT8 [N, K] row-major with one f32 scale a row
// (an output channel's), y: bf16 [M, N] with a row stride. The int32 sums are exact; each is turned into f32 once,
// scaled and rounded to bf16 in the epilogue, so an INT8 GEMM writes 2 bytes an output element like a bf16 or
// row-wise FP8 one (cuBLASLt 13.1 offers no INT8 form with scales and bf16 output on sm_90).
//
// One CTA computes a 128 x 256 tile of y: warp-specialised like the attention kernels (attention.cuh, whose sm_90
// helpers this file uses), warpgroup 0's first thread loads, through TMA, 128-byte slices of K of x's 128 rows and
// w's 256 rows into a 4-stage ring in the 128-byte swizzle; warpgroups 1 and 2 each take 64 rows of x and issue
// wgmma m64n256k32 s32.s8.s8 on them, four a slice, keeping one slice's MMAs in flight and releasing a stage as
// soon as the MMAs that read it are done. The CTAs are persistent (one an SM, each looping over tiles), so the
// producer loads the next tile while the consumers store one. Tiles run over M fastest within bands of M tiles
// (tile_origin; every kernel's last argument `band` is the band's M tiles): with one band the tiles in flight share
// w's column blocks and all of x stays in L2 while x fits there; a larger x is split into bands whose rows do.
//
// The epilogue stores 16 bytes a lane (8 columns, after a transpose within each quad of lanes) when N and y's row
// stride are multiples of 8, else pairs of columns.
//
// Preconditions (the launcher checks them): K a multiple of 16 and N even, x and w 16-byte aligned rows (K bytes),
// y 16-byte aligned with an even row stride. Rows of x past M, rows of w past N and bytes past K read as zeros (TMA fill), so partial
// tiles and a last partial slice of K need no other care; columns past N and rows past M are not stored.
#include "common/common.cuh"
#include "nn/attention.cuh"

// The q|k|v epilogue's operands (kernels nn_gemm_int8_qkv_*): the GEMM's N = 3 width columns are q, k and v heads
// of 128 channels; q and k are RMS-normed per head (weights q_weight / k_weight, [128] bf16) and rotated by their
// row's RoPE, v stored as it is; each into its own bf16 rows of `stride` (the three may interleave in one matrix).
// The tables are [rows, rope_stride]: f32 for the interleaved RoPE (slot j turning channels 2 j and 2 j + 1), bf16
// for the rotate-half RoPE over the first 96 channels (slot j < 48 turning channels j and j + 48).
struct G8Qkv {
    bf16* q;
    bf16* k;
    bf16* v;
    const bf16* q_weight;
    const bf16* k_weight;
    const void* rope_cos;
    const void* rope_sin;
    int64_t stride;
    int width;
    float eps;
    int rope_stride;
    int reserved;  // zero: the launcher packs the struct as ten 8-byte words
};
static_assert(sizeof(G8Qkv) == 80, "the launcher packs G8Qkv as [u64; 10]");
constexpr int kG8QkvInterleaved = 1;  // the q|k|v epilogue of interleaved RoPE (Qwen-Image)
constexpr int kG8QkvHalf = 2;         // ... of rotate-half RoPE over 96 channels (MiniMax H3)

#if defined(NN_HAS_WGMMA)
namespace {

constexpr int kG8Rows = 128;                       // rows of y a CTA computes, 64 per consumer warpgroup
constexpr int kG8Cols = 256;                       // columns of y a CTA computes
constexpr int kG8Slice = 128;                      // bytes of K a stage holds (one 128-byte swizzle span)
constexpr int kG8Stages = 4;
constexpr int kG8ABytes = kG8Rows * kG8Slice;      // 16 KiB
constexpr int kG8BBytes = kG8Cols * kG8Slice;      // 32 KiB
constexpr int kG8StageBytes = kG8ABytes + kG8BBytes;
constexpr int kG8ProducerRegs = 40;
constexpr int kG8ConsumerRegs = 232;               // 40 * 128 + 232 * 256 <= 65536 registers of the SM
constexpr int kG8ConsumerWarps = 8;                 // arrivals that free a stage: one a consumer warp

#define G8_REGS128 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
    "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, " \
    "%65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, " \
    "%86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, " \
    "%106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, " \
    "%123, %124, %125, %126, %127}"

#define G8_ACC128(T) \
    T(d[0]), T(d[1]), T(d[2]), T(d[3]), T(d[4]), T(d[5]), T(d[6]), T(d[7]), T(d[8]), T(d[9]), T(d[10]), \
        T(d[11]), T(d[12]), T(d[13]), T(d[14]), T(d[15]), T(d[16]), T(d[17]), T(d[18]), T(d[19]), T(d[20]), \
        T(d[21]), T(d[22]), T(d[23]), T(d[24]), T(d[25]), T(d[26]), T(d[27]), T(d[28]), T(d[29]), T(d[30]), \
        T(d[31]), T(d[32]), T(d[33]), T(d[34]), T(d[35]), T(d[36]), T(d[37]), T(d[38]), T(d[39]), T(d[40]), \
        T(d[41]), T(d[42]), T(d[43]), T(d[44]), T(d[45]), T(d[46]), T(d[47]), T(d[48]), T(d[49]), T(d[50]), \
        T(d[51]), T(d[52]), T(d[53]), T(d[54]), T(d[55]), T(d[56]), T(d[57]), T(d[58]), T(d[59]), T(d[60]), \
        T(d[61]), T(d[62]), T(d[63]), T(d[64]), T(d[65]), T(d[66]), T(d[67]), T(d[68]), T(d[69]), T(d[70]), \
        T(d[71]), T(d[72]), T(d[73]), T(d[74]), T(d[75]), T(d[76]), T(d[77]), T(d[78]), T(d[79]), T(d[80]), \
        T(d[81]), T(d[82]), T(d[83]), T(d[84]), T(d[85]), T(d[86]), T(d[87]), T(d[88]), T(d[89]), T(d[90]), \
        T(d[91]), T(d[92]), T(d[93]), T(d[94]), T(d[95]), T(d[96]), T(d[97]), T(d[98]), T(d[99]), T(d[100]), \
        T(d[101]), T(d[102]), T(d[103]), T(d[104]), T(d[105]), T(d[106]), T(d[107]), T(d[108]), T(d[109]), \
        T(d[110]), T(d[111]), T(d[112]), T(d[113]), T(d[114]), T(d[115]), T(d[116]), T(d[117]), T(d[118]), \
        T(d[119]), T(d[120]), T(d[121]), T(d[122]), T(d[123]), T(d[124]), T(d[125]), T(d[126]), T(d[127])

#define G8_INT(x) "+r"(x)

// d (+)= A * B for one m64n256k32 step: INT8 operands from shared memory (K-major descriptors), int32 sums.
__device__ __forceinline__ void wgmma_s8_m64n256k32(int32_t (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                    int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k32.s32.s8.s8 " G8_REGS128 ", %128, %129, p;\n}\n"
                 : G8_ACC128(G8_INT)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

#define G8_FLOAT(x) "+f"(x)

// d (+)= A * B for one m64n256k16 step: bf16 operands from shared memory (K-major descriptors), f32 sums.
__device__ __forceinline__ void wgmma_bf16_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                      int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " G8_REGS128 ", %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : G8_ACC128(G8_FLOAT)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// The operands of one kernel of the set: INT8 codes with scales (int32 sums), or bf16 (f32 sums, no scales). Both
// read 128 bytes of K a stage and step 32 bytes of it an MMA (k32 of INT8, k16 of bf16).
template <bool kBf16>
struct G8Operands {
    using Acc = int32_t;
    static constexpr int kSliceElems = kG8Slice;  // K elements a stage holds
    __device__ __forceinline__ static void mma(Acc (&d)[128], uint64_t a, uint64_t b, int accumulate) {
        wgmma_s8_m64n256k32(d, a, b, accumulate);
    }
};
template <>
struct G8Operands<true> {
    using Acc = float;
    static constexpr int kSliceElems = kG8Slice / 2;
    __device__ __forceinline__ static void mma(Acc (&d)[128], uint64_t a, uint64_t b, int accumulate) {
        wgmma_bf16_m64n256k16(d, a, b, accumulate);
    }
};

// The epilogues' view of one accumulator: the product the plain GEMM stores, in f32 (INT8: the int32 sum scaled by
// its row's and column's scales, rounded to bf16; bf16: the f32 sum rounded to bf16), and f32 values kept in the
// accumulator registers between an epilogue's passes (INT8 keeps their bits in the int32 registers).
__device__ __forceinline__ float g8_product(int32_t a, float row_scale, float col_scale) {
    return nn::round_bf16(static_cast<float>(a) * (row_scale * col_scale));
}
__device__ __forceinline__ float g8_product(float a, float, float) { return nn::round_bf16(a); }
__device__ __forceinline__ void g8_keep(int32_t& slot, float v) { slot = __float_as_int(v); }
__device__ __forceinline__ void g8_keep(float& slot, float v) { slot = v; }
__device__ __forceinline__ float g8_kept(int32_t slot) { return __int_as_float(slot); }
__device__ __forceinline__ float g8_kept(float slot) { return slot; }

// Whether an accumulator type is the bf16 GEMM's (f32 sums, no scales).
template <typename Acc>
struct G8Float {
    static constexpr bool value = false;
};
template <>
struct G8Float<float> {
    static constexpr bool value = true;
};

// The scales of columns col and col + 1 (INT8), or ones (bf16, which has none).
template <typename Acc>
__device__ __forceinline__ float2 g8_col_scales(const float* __restrict__ w_scale, int col) {
    if constexpr (G8Float<Acc>::value) {
        return make_float2(1.0f, 1.0f);
    } else {
        return *reinterpret_cast<const float2*>(w_scale + col);
    }
}

// A row's scale (INT8; 0 past M, where nothing is stored), or one (bf16).
template <typename Acc>
__device__ __forceinline__ float g8_row_scale(const float* __restrict__ x_scale, int row, int m) {
    if constexpr (G8Float<Acc>::value) {
        return 1.0f;
    } else {
        return row < m ? x_scale[row] : 0.0f;
    }
}

// The first row and column of output tile `tile` of an m_tiles x n_tiles grid (tile_cols columns a tile). Tiles are
// numbered in bands of `band` M tiles (the last band may hold fewer; band <= 0 or >= m_tiles: one band), each band's
// tiles M-fastest. One band is plain M-fastest order, in which every wave of CTAs reads all of x: from memory again
// each wave once x outgrows L2. In a band the CTAs in flight share few enough rows of x (and of w) to keep them in
// L2 while the band sweeps w's columns (the host picks the band, `Int8GemmShape::band_tiles`).
__device__ __forceinline__ int2 tile_origin(int tile, int m_tiles, int n_tiles, int band, int tile_cols) {
    const int rows = (band > 0 && band < m_tiles) ? band : m_tiles;
    const int per_band = rows * n_tiles;
    const int b = tile / per_band;
    const int first = b * rows;
    const int in_band = min(rows, m_tiles - first);
    const int local = tile - b * per_band;
    return make_int2((first + local % in_band) * kG8Rows, (local / in_band) * tile_cols);
}

// The four lanes of quad q (lane & 3) each hold one packed column pair of four 8-column blocks (v[t]: block t);
// two xor-shuffle rounds leave lane q holding all four pairs (8 columns) of block q, for one 16-byte store.
__device__ __forceinline__ void g8_transpose_quad(uint32_t (&v)[4], int q) {
    const bool odd = (q & 1) != 0;
    const uint32_t r0 = __shfl_xor_sync(0xffffffffu, odd ? v[0] : v[1], 1);
    const uint32_t r1 = __shfl_xor_sync(0xffffffffu, odd ? v[2] : v[3], 1);
    if (odd) {
        v[0] = r0;
        v[2] = r1;
    } else {
        v[1] = r0;
        v[3] = r1;
    }
    const bool high = (q & 2) != 0;
    const uint32_t r2 = __shfl_xor_sync(0xffffffffu, high ? v[0] : v[2], 2);
    const uint32_t r3 = __shfl_xor_sync(0xffffffffu, high ? v[1] : v[3], 2);
    if (high) {
        v[0] = r2;
        v[1] = r3;
    } else {
        v[2] = r2;
        v[3] = r3;
    }
}

// One TMA copy of a box at (byte col, row) of a 2-D INT8 map (kept 3-D with one batch entry) into dst.
__device__ __forceinline__ void tma_box_2d(uint32_t dst, const TmaMap* map, int col, int row, uint32_t bar) {
    tma_box(dst, map, col, row, 0, bar);
}

// The stage ring of every kernel in this file: kStages stages of kStageBytes in the dynamic shared memory (its base
// rounded up to 1024 bytes for the swizzled tiles; the launch asks 1 KiB more), each the A tile then, kABytes in,
// the B tile(s); a `full` barrier a stage (the producer's one arrival, with the TMA bytes) and an `empty` one (one
// arrival a consumer warp). Slices are counted over every tile of the CTA (`it`), so stage and parity run on across
// tiles and the producer fills the next tile's first stages while the consumers store the last one.
template <int kStages, int kStageBytes, int kABytes>
struct G8Ring {
    uint32_t smem;
    uint32_t bars;
    __device__ __forceinline__ G8Ring(const uint8_t* dynamic, const uint64_t* barriers)
        : smem((static_cast<uint32_t>(__cvta_generic_to_shared(dynamic)) + 1023u) & ~1023u),
          bars(static_cast<uint32_t>(__cvta_generic_to_shared(barriers))) {}
    __device__ __forceinline__ uint32_t full(int s) const { return bars + 8u * s; }
    __device__ __forceinline__ uint32_t empty(int s) const { return bars + 8u * (kStages + s); }
    __device__ __forceinline__ uint32_t a_tile(int s) const { return smem + s * kStageBytes; }
    __device__ __forceinline__ uint32_t b_tile(int s) const { return smem + s * kStageBytes + kABytes; }
    // Thread 0 sets up the barriers; the whole CTA waits for it.
    __device__ __forceinline__ void init() const {
        if (threadIdx.x == 0) {
            for (int s = 0; s < kStages; ++s) {
                mbar_init(full(s), 1);
                mbar_init(empty(s), kG8ConsumerWarps);
            }
            mbar_fence_init();
        }
        __syncthreads();
    }
    // The producer's stage for slice `it`, once every consumer warp released what slice it - kStages left there.
    __device__ __forceinline__ int acquire(int it) const {
        const int s = it % kStages;
        if (it >= kStages) mbar_wait(empty(s), static_cast<uint32_t>(((it / kStages) - 1) & 1));
        return s;
    }
    // A consumer's stage for slice `it`, once its data landed.
    __device__ __forceinline__ int wait_full(int it) const {
        const int s = it % kStages;
        mbar_wait(full(s), static_cast<uint32_t>((it / kStages) & 1));
        return s;
    }
    // Frees stage `s` once this warp's MMAs that read it are done (the wgmma wait before it is warp-wide): one
    // arrival a warp, so a stage costs the barrier 8 arrivals instead of 256.
    __device__ __forceinline__ void release(int s, int lane) const {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty(s));
    }
};

}  // namespace
#endif

#if defined(NN_HAS_WGMMA)
namespace {

// --- The TMA-store epilogue (kernels *_tma) ---
//
// Instead of each thread storing its values to y, a consumer warpgroup writes its 64 rows in boxes of 64 columns
// into its own 16 KiB staging area after the ring, two boxes used in turn, each 64 x 128 bytes in the 128-byte
// swizzle (row r's 16-byte chunk c at chunk c ^ (r % 8): each warp's 4-byte writes hit 32 banks), and one thread
// hands each box to the TMA unit (cp.async.bulk.tensor, the y map's bounds clip rows past M and columns past N).
// Before a box is written again, that thread waits until the copy that last read it has done so, while the copy of
// the other box may still run, so the next box's arithmetic overlaps the previous box's copy; the consumers go on to
// the next tile's MMAs while the copy engine writes y. The values are the plain epilogue's, only the way they reach y
// differs, so the outputs are bit-equal.
constexpr int kG8BoxCols = 64;                           // output columns a staging box holds
constexpr int kG8BoxBytes = 64 * kG8BoxCols * 2;         // 8 KiB
constexpr int kG8StagingBytes = 2 * kG8BoxBytes;         // a consumer warpgroup's area: 16 KiB

struct G8Staging {
    uint32_t base;  // this warpgroup's area (1024-byte aligned)
    int consumer;   // 0 or 1: its named barrier is 1 + consumer
    int boxes = 0;  // boxes this warpgroup has stored (the same in all its threads): the next is box boxes % 2
    __device__ __forceinline__ uint32_t box() const { return base + (boxes & 1) * kG8BoxBytes; }
    // Waits until the next box may be written (the elected thread: every copy but the latest has read its box),
    // then the warpgroup meets.
    __device__ __forceinline__ void begin() const {
        if (threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
        named_barrier_sync(1 + consumer, 128);
    }
    // One packed bf16 pair at warpgroup row `row` (0..63), column `col` (even, 0..63) of the next box.
    __device__ __forceinline__ void put(int row, int col, uint32_t pair) const {
        const uint32_t at = box() + row * 128 + ((((col >> 3) & 7) ^ (row & 7)) << 4) + (col & 7) * 2;
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(pair) : "memory");
    }
    // Hands the box to the TMA unit, at y's (col0, row0).
    __device__ __forceinline__ void store(const TmaMap* tm_y, int col0, int row0) {
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        named_barrier_sync(1 + consumer, 128);
        if (threadIdx.x % 128 == 0) {
            asm volatile(
                "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
                    reinterpret_cast<uint64_t>(tm_y)),
                "r"(col0), "r"(row0), "r"(0), "r"(box())
                : "memory");
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        }
        ++boxes;
    }
    // At the kernel's end: the elected thread waits for every copy to finish before the CTA's shared memory goes.
    __device__ __forceinline__ void drain() const {
        if (threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
};

// The SwiGLU tile's epilogue. acc holds, as in the plain epilogue, rows row0 and row0 + 8 and in block j the columns
// 8 j + 2 (lane % 4) and + 1: blocks 0..15 are gate rows, 16..31 the value rows of the same hidden columns. Each
// product is rounded to bf16 as the plain GEMM stores it (g8_product), then silu(gate) * value in f32 is rounded to
// bf16: bf16 rows of n (the hidden width, a multiple of 128; y's row stride a multiple of 8) at columns origin.y ..
// + 127, 16 bytes a lane after the quad transpose. silu is the one the separate SwiGLU after that GEMM runs: the
// INT8 path's quantizing SwiGLU (nn::silu_fast), nn_act's x / (1 + exp(-x)) after a bf16 GEMM.
// With a staging area (the _tma kernels) the pairs go to its boxes unshuffled, each handed to the TMA unit.
template <typename Acc>
__device__ __forceinline__ void swiglu_epilogue(const Acc (&acc)[128], const float* __restrict__ x_scale,
                                                const float* __restrict__ w_scale, bf16* __restrict__ y,
                                                int64_t y_row_stride, int m, int n, int2 origin, int2 bases,
                                                int lane, G8Staging* staging = nullptr,
                                                const TmaMap* tm_y = nullptr, int2 stage_origin = int2{}) {
    const int row_a = origin.x;
    const int row_b = row_a + 8;
    const float scale_a = g8_row_scale<Acc>(x_scale, row_a, m);
    const float scale_b = g8_row_scale<Acc>(x_scale, row_b, m);
    const int q = lane & 3;
    const int c0 = origin.y + 2 * q;
    auto silu = [](float x) {
        if constexpr (G8Float<Acc>::value) {
            return x / (1.0f + expf(-x));
        } else {
            return nn::silu_fast(x);
        }
    };
    auto h_pair = [&](Acc g0, Acc g1, Acc v0, Acc v1, float row_scale, float2 wg, float2 wv) {
        const float ga = g8_product(g0, row_scale, wg.x);
        const float gb = g8_product(g1, row_scale, wg.y);
        const float va = g8_product(v0, row_scale, wv.x);
        const float vb = g8_product(v1, row_scale, wv.y);
        const __nv_bfloat162 h = __floats2bfloat162_rn(silu(ga) * va, silu(gb) * vb);
        return *reinterpret_cast<const uint32_t*>(&h);
    };
    if (staging != nullptr) {
        // stage_origin: this thread's first row within its warpgroup's 64, and the warpgroup's first row of y. Two
        // boxes of 64 hidden columns: a tile's two boxes need no wait between them (the box the second one reuses
        // was the previous tile's), so each pair goes to the box as it is made.
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            staging->begin();
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
                const int j = 8 * b + jj;
                const int col = c0 + 8 * j;
                const float2 wg = g8_col_scales<Acc>(w_scale, bases.x + col);
                const float2 wv = g8_col_scales<Acc>(w_scale, bases.y + col);
                staging->put(stage_origin.x, 8 * jj + 2 * q,
                             h_pair(acc[4 * j], acc[4 * j + 1], acc[4 * (j + 16)], acc[4 * (j + 16) + 1], scale_a,
                                    wg, wv));
                staging->put(stage_origin.x + 8, 8 * jj + 2 * q,
                             h_pair(acc[4 * j + 2], acc[4 * j + 3], acc[4 * (j + 16) + 2], acc[4 * (j + 16) + 3],
                                    scale_b, wg, wv));
            }
            staging->store(tm_y, origin.y + kG8BoxCols * b, stage_origin.y);
        }
        return;
    }
#pragma unroll
    for (int g = 0; g < 4; ++g) {
        uint32_t va[4], vb[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int j = 4 * g + t;
            const int col = c0 + 8 * j;  // < n: n is a multiple of 128
            const float2 wg = g8_col_scales<Acc>(w_scale, bases.x + col);
            const float2 wv = g8_col_scales<Acc>(w_scale, bases.y + col);
            va[t] = h_pair(acc[4 * j], acc[4 * j + 1], acc[4 * (j + 16)], acc[4 * (j + 16) + 1], scale_a, wg, wv);
            vb[t] = h_pair(acc[4 * j + 2], acc[4 * j + 3], acc[4 * (j + 16) + 2], acc[4 * (j + 16) + 3], scale_b,
                           wg, wv);
        }
        g8_transpose_quad(va, q);
        g8_transpose_quad(vb, q);
        const int block_col = origin.y + 8 * (4 * g + q);
        if (row_a < m) {
            *reinterpret_cast<uint4*>(y + static_cast<int64_t>(row_a) * y_row_stride + block_col) =
                make_uint4(va[0], va[1], va[2], va[3]);
        }
        if (row_b < m) {
            *reinterpret_cast<uint4*>(y + static_cast<int64_t>(row_b) * y_row_stride + block_col) =
                make_uint4(vb[0], vb[1], vb[2], vb[3]);
        }
    }
    (void)n;
}


// Row r's entries of a [rows, stride] table of T (row 0's for a row past M, whose outputs are not stored).
template <typename T>
__device__ __forceinline__ const T* g8_table_row(const void* table, int row, int m, int stride) {
    return static_cast<const T*>(table) + static_cast<int64_t>(row < m ? row : 0) * stride;
}

// The q|k|v epilogues' first pass over a tile of two heads (acc laid out as in the plain epilogue): each product
// dequantized and rounded to bf16 as the plain GEMM stores it, in place as f32 bits, and each row's and head's
// 1 / RMS, rsqrt(mean(x^2) + eps), the sum of squares the quad's (its four lanes hold a head's 128 columns).
template <typename Acc>
__device__ __forceinline__ void g8_products_and_inv_rms(Acc (&acc)[128], float2 scales,
                                                        const float* __restrict__ w_scale, int n0, int q, float eps,
                                                        float4& r) {
    float sq_a0 = 0.0f, sq_a1 = 0.0f, sq_b0 = 0.0f, sq_b1 = 0.0f;
#pragma unroll
    for (int j = 0; j < kG8Cols / 8; ++j) {
        const float2 ws = g8_col_scales<Acc>(w_scale, n0 + 8 * j + 2 * q);
        const float a0 = g8_product(acc[4 * j], scales.x, ws.x);
        const float a1 = g8_product(acc[4 * j + 1], scales.x, ws.y);
        const float b0 = g8_product(acc[4 * j + 2], scales.y, ws.x);
        const float b1 = g8_product(acc[4 * j + 3], scales.y, ws.y);
        g8_keep(acc[4 * j], a0);
        g8_keep(acc[4 * j + 1], a1);
        g8_keep(acc[4 * j + 2], b0);
        g8_keep(acc[4 * j + 3], b1);
        if (j < 16) {
            sq_a0 += a0 * a0 + a1 * a1;
            sq_b0 += b0 * b0 + b1 * b1;
        } else {
            sq_a1 += a0 * a0 + a1 * a1;
            sq_b1 += b0 * b0 + b1 * b1;
        }
    }
    auto inv_rms = [&](float v) {
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        return rsqrtf(v * (1.0f / 128.0f) + eps);
    };
    r = make_float4(inv_rms(sq_a0), inv_rms(sq_a1), inv_rms(sq_b0), inv_rms(sq_b1));
}

// Where a q or k tile of the q|k|v epilogues goes and how it is normed: its output (q or k), norm weights, first
// output column, and the rows' 1 / RMS per head after g8_products_and_inv_rms (which it runs on acc).
struct G8QkvHead {
    bf16* __restrict__ out;
    const bf16* __restrict__ norm_w;
    int out_col0;
    float4 r;  // x row_a head 0, y row_a head 1, z row_b head 0, w row_b head 1
};
template <typename Acc>
__device__ __forceinline__ G8QkvHead g8_qkv_head(Acc (&acc)[128], float2 scales, const float* __restrict__ w_scale,
                                                 const G8Qkv& p, int region, int n0, int q) {
    G8QkvHead h;
    h.out = region == 0 ? p.q : p.k;
    h.norm_w = region == 0 ? p.q_weight : p.k_weight;
    h.out_col0 = n0 - region * p.width;
    g8_products_and_inv_rms(acc, scales, w_scale, n0, q, p.eps, h.r);
    return h;
}

// The RoPE table rows (entries of T) of rows row_a and row_b = row_a + 8.
template <typename T>
struct G8RopeRows {
    const T* __restrict__ cos_a;
    const T* __restrict__ sin_a;
    const T* __restrict__ cos_b;
    const T* __restrict__ sin_b;
};
template <typename T>
__device__ __forceinline__ G8RopeRows<T> g8_rope_rows(const G8Qkv& p, int row_a, int m) {
    return {g8_table_row<T>(p.rope_cos, row_a, m, p.rope_stride), g8_table_row<T>(p.rope_sin, row_a, m, p.rope_stride),
            g8_table_row<T>(p.rope_cos, row_a + 8, m, p.rope_stride),
            g8_table_row<T>(p.rope_sin, row_a + 8, m, p.rope_stride)};
}

// 16 bytes of row `row` (if < m) at column col of out.
__device__ __forceinline__ void g8_store16(bf16* __restrict__ out, int64_t stride, int row, int m, int col,
                                           const uint32_t (&v)[4]) {
    if (row < m) {
        *reinterpret_cast<uint4*>(out + static_cast<int64_t>(row) * stride + col) = make_uint4(v[0], v[1], v[2], v[3]);
    }
}

// The q and k tiles' epilogue: a tile's 256 columns are two heads (blocks 0..15 and 16..31 of acc, laid out as in
// the plain epilogue). Each product is dequantized and rounded to bf16 as the plain GEMM stores it, then
// nn_qk_norm_rope_interleaved's arithmetic runs on it: n = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * weight), and
// the pair (n0, n1) of slot j leaves as bf16(n0 cos - n1 sin), bf16(n0 sin + n1 cos). A head's sum of squares is
// the quad's (its four lanes hold the head's 128 columns of the row). scales: the rows' x scales; rows.x: row_a
// (row_b = row_a + 8), rows.y: M.
template <typename Acc>
__device__ __forceinline__ void qkv_norm_rope_epilogue(Acc (&acc)[128], float2 scales,
                                                       const float* __restrict__ w_scale, const G8Qkv& p,
                                                       int region, int n0, int2 rows, int lane) {
    const int q = lane & 3;
    const int row_a = rows.x;
    const int row_b = rows.x + 8;
    const G8QkvHead head = g8_qkv_head(acc, scales, w_scale, p, region, n0, q);
    const float r_a0 = head.r.x, r_a1 = head.r.y, r_b0 = head.r.z, r_b1 = head.r.w;
    const G8RopeRows<float> tab = g8_rope_rows<float>(p, row_a, rows.y);
    // One rotated pair: n = bf16(bf16(x r) w) for both channels, then the complex product with (cos, sin).
    auto rotated = [](float x0, float x1, float r, float2 nw, float cs, float sn) {
        const float n_0 = nn::round_bf16(nn::round_bf16(x0 * r) * nw.x);
        const float n_1 = nn::round_bf16(nn::round_bf16(x1 * r) * nw.y);
        const __nv_bfloat162 o = __floats2bfloat162_rn(n_0 * cs - n_1 * sn, n_0 * sn + n_1 * cs);
        return *reinterpret_cast<const uint32_t*>(&o);
    };
#pragma unroll
    for (int g = 0; g < kG8Cols / 32; ++g) {
        uint32_t va[4], vb[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int j = 4 * g + t;
            const int channel = 8 * (j % 16) + 2 * q;  // within the head; RoPE slot channel / 2
            const float2 nw = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(head.norm_w + channel));
            const int slot = channel / 2;
            va[t] = rotated(g8_kept(acc[4 * j]), g8_kept(acc[4 * j + 1]), j < 16 ? r_a0 : r_a1, nw,
                            tab.cos_a[slot], tab.sin_a[slot]);
            vb[t] = rotated(g8_kept(acc[4 * j + 2]), g8_kept(acc[4 * j + 3]), j < 16 ? r_b0 : r_b1, nw,
                            tab.cos_b[slot], tab.sin_b[slot]);
        }
        g8_transpose_quad(va, q);
        g8_transpose_quad(vb, q);
        const int block_col = head.out_col0 + 8 * (4 * g + q);
        g8_store16(head.out, p.stride, row_a, rows.y, block_col, va);
        g8_store16(head.out, p.stride, row_b, rows.y, block_col, vb);
    }
}

// The rotate-half form (MiniMax H3's h3_qk_norm_rope arithmetic on the bf16 products): n = x * r * weight in f32;
// channels c < 48 leave as bf16(n[c] cos - n[c + 48] sin), 48 <= c < 96 as bf16(n[c] cos + n[c - 48] sin), with
// the bf16 table entries of slot c mod 48; channels 96.. as bf16(n). A head's partner channels lie 6 blocks of 8
// away in the same thread's accumulators.
template <typename Acc>
__device__ __forceinline__ void qkv_norm_rope_half_epilogue(Acc (&acc)[128], float2 scales,
                                                            const float* __restrict__ w_scale, const G8Qkv& p,
                                                            int region, int n0, int2 rows, int lane) {
    constexpr int kHalfBlocks = 6;  // 48 channels
    const int q = lane & 3;
    const int row_a = rows.x;
    const int row_b = rows.x + 8;
    const G8QkvHead head = g8_qkv_head(acc, scales, w_scale, p, region, n0, q);
    const float4 r = head.r;
    // n in place: x * r * weight.
#pragma unroll
    for (int j = 0; j < kG8Cols / 8; ++j) {
        const float2 nw =
            __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(head.norm_w + 8 * (j % 16) + 2 * q));
        const float ra = j < 16 ? r.x : r.y;
        const float rb = j < 16 ? r.z : r.w;
        g8_keep(acc[4 * j], g8_kept(acc[4 * j]) * ra * nw.x);
        g8_keep(acc[4 * j + 1], g8_kept(acc[4 * j + 1]) * ra * nw.y);
        g8_keep(acc[4 * j + 2], g8_kept(acc[4 * j + 2]) * rb * nw.x);
        g8_keep(acc[4 * j + 3], g8_kept(acc[4 * j + 3]) * rb * nw.y);
    }
    const G8RopeRows<bf16> tab = g8_rope_rows<bf16>(p, row_a, rows.y);
#pragma unroll
    for (int g = 0; g < kG8Cols / 32; ++g) {
        uint32_t v[2][4];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int j = 4 * g + t;
            const int jj = j % 16;  // block within the head
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // row_a, row_b
                float o0 = g8_kept(acc[4 * j + 2 * h]);
                float o1 = g8_kept(acc[4 * j + 2 * h + 1]);
                if (jj < 2 * kHalfBlocks) {
                    const bool first = jj < kHalfBlocks;
                    const int pj = first ? j + kHalfBlocks : j - kHalfBlocks;
                    const float sign = first ? -1.0f : 1.0f;
                    const float p0 = sign * g8_kept(acc[4 * pj + 2 * h]);
                    const float p1 = sign * g8_kept(acc[4 * pj + 2 * h + 1]);
                    const int slot = 8 * (first ? jj : jj - kHalfBlocks) + 2 * q;
                    const bf16* __restrict__ cos_row = h == 0 ? tab.cos_a : tab.cos_b;
                    const bf16* __restrict__ sin_row = h == 0 ? tab.sin_a : tab.sin_b;
                    const float2 c = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(cos_row + slot));
                    const float2 sn = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(sin_row + slot));
                    o0 = o0 * c.x + p0 * sn.x;
                    o1 = o1 * c.y + p1 * sn.y;
                }
                const __nv_bfloat162 o = __floats2bfloat162_rn(o0, o1);
                v[h][t] = *reinterpret_cast<const uint32_t*>(&o);
            }
        }
        g8_transpose_quad(v[0], q);
        g8_transpose_quad(v[1], q);
        const int block_col = head.out_col0 + 8 * (4 * g + q);
        g8_store16(head.out, p.stride, row_a, rows.y, block_col, v[0]);
        g8_store16(head.out, p.stride, row_b, rows.y, block_col, v[1]);
    }
}

// The GEMM of either operand kind (G8Operands): the kernels below are its instances. x_scale and w_scale are read
// only for INT8. With kSwiglu a tile's 256 columns of w are 128 gate rows from gate_base and the 128
// value rows at the same offset from value_base (two TMA boxes of 128 rows), and the tile stores the 128 columns
// silu(gate) * value: n is then the hidden width (the output's columns), a multiple of 128.
// kQkv: 0 the plain epilogue, kG8QkvInterleaved or kG8QkvHalf the q|k|v epilogues. kTma: the plain or SwiGLU
// epilogue through the staging areas and the TMA unit (G8Staging, y through tm_y; kG8Stages * 48 + 32 + 1 KiB of
// dynamic shared memory).
template <bool kBf16, bool kSwiglu = false, int kQkv = 0, bool kTma = false>
__device__ __forceinline__ void gemm_tiles(const TmaMap& tm_x, const TmaMap& tm_w, const float* __restrict__ x_scale,
                                           const float* __restrict__ w_scale, bf16* __restrict__ y,
                                           int64_t y_row_stride, int m, int n, int k, int band,
                                           int gate_base = 0, int value_base = 0, const G8Qkv* qkv = nullptr,
                                           const TmaMap* tm_y = nullptr) {
    static_assert(kQkv == 0 || !kSwiglu, "a tile runs one epilogue");
    static_assert(kQkv == 0 || !kTma, "the q|k|v epilogues store directly");
    // Output columns a tile stores.
    constexpr int kTileCols = kSwiglu ? kG8Cols / 2 : kG8Cols;
    using Ops = G8Operands<kBf16>;
    using Acc = typename Ops::Acc;
    extern __shared__ uint8_t g8_smem[];
    __shared__ __align__(8) uint64_t barriers[2 * kG8Stages];  // full[s], then empty[s]
    const G8Ring<kG8Stages, kG8StageBytes, kG8ABytes> ring(g8_smem, barriers);
    const int m_tiles = (m + kG8Rows - 1) / kG8Rows;
    const int n_tiles = (n + kTileCols - 1) / kTileCols;
    const int tiles = m_tiles * n_tiles;
    const int slices = (k + Ops::kSliceElems - 1) / Ops::kSliceElems;
    const int warpgroup = threadIdx.x / 128;
    ring.init();

    // Tiles in M-fastest order, CTA b taking b, b + gridDim.x, ...
    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kG8ProducerRegs));
        if (threadIdx.x == 0) {
            int it = 0;
            for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
                const int2 origin = tile_origin(tile, m_tiles, n_tiles, band, kTileCols);
                for (int t = 0; t < slices; ++t, ++it) {
                    const int s = ring.acquire(it);
                    const uint32_t full = ring.full(s);
                    const uint32_t b_tile = ring.b_tile(s);
                    mbar_expect_bytes(full, kG8StageBytes);
                    tma_box_2d(ring.a_tile(s), &tm_x, t * Ops::kSliceElems, origin.x, full);
                    if constexpr (kSwiglu) {
                        // Gate rows, then value rows, of this tile's 128 hidden columns (a 16 KiB offset keeps
                        // the swizzle's 1024-byte blocks).
                        const int hidden0 = origin.y;
                        tma_box_2d(b_tile, &tm_w, t * Ops::kSliceElems, gate_base + hidden0, full);
                        tma_box_2d(b_tile + kTileCols * kG8Slice, &tm_w, t * Ops::kSliceElems, value_base + hidden0,
                                   full);
                    } else {
                        tma_box_2d(b_tile, &tm_w, t * Ops::kSliceElems, origin.y, full);
                    }
                }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kG8ConsumerRegs));
    const int consumer = warpgroup - 1;  // rows 64 * consumer .. + 63 of each tile
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    G8Staging staging{ring.smem + kG8Stages * kG8StageBytes + consumer * kG8StagingBytes, consumer};
    Acc acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = Acc(0);
    int it = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int2 origin = tile_origin(tile, m_tiles, n_tiles, band, kTileCols);
        const int m0 = origin.x;
        const int n0 = origin.y;
        for (int t = 0; t < slices; ++t, ++it) {
            const int s = ring.wait_full(it);
            wgmma_fence();
            const uint32_t a = ring.a_tile(s) + consumer * (64 * kG8Slice);
            const uint32_t b = ring.b_tile(s);
#pragma unroll
            for (int kk = 0; kk < kG8Slice / 32; ++kk) {
                // The tile's first MMA overwrites the accumulators (the previous tile's are stored by then).
                Ops::mma(acc, smem_desc(a + kk * 32, 16, 1024), smem_desc(b + kk * 32, 16, 1024),
                         (t > 0 || kk > 0) ? 1 : 0);
            }
            wgmma_commit();
            // Slice t's MMAs may still run; slice t - 1's are done: release its stage.
            wgmma_wait<1>();
            if (t > 0) ring.release((it - 1) % kG8Stages, lane);
        }
        wgmma_wait<0>();
        // The tile's last stage is free too: the producer may refill it while this tile is stored.
        ring.release((it - 1) % kG8Stages, lane);
#pragma unroll
        for (int i = 0; i < 128; ++i) {
            if constexpr (kBf16) {
                asm volatile("" : "+f"(acc[i])::"memory");
            } else {
                asm volatile("" : "+r"(acc[i])::"memory");
            }
        }

        if constexpr (kSwiglu) {
            swiglu_epilogue(acc, x_scale, w_scale, y, y_row_stride, m, n,
                            make_int2(m0 + consumer * 64 + warp * 16 + lane / 4, n0),
                            make_int2(gate_base, value_base), lane, kTma ? &staging : nullptr, tm_y,
                            make_int2(warp * 16 + lane / 4, m0 + consumer * 64));
            continue;
        }
        // Epilogue: thread (warp w, lane l) holds rows 16 w + l / 4 and + 8 of its warpgroup's 64, and in each
        // 8-column block j the columns 8 j + 2 (l % 4) and + 1 (acc[4 j + e]: e < 2 the first row, e >= 2 the
        // second).
        const int row_a = m0 + consumer * 64 + warp * 16 + lane / 4;
        const int row_b = row_a + 8;
        const float scale_a = g8_row_scale<Acc>(x_scale, row_a, m);
        const float scale_b = g8_row_scale<Acc>(x_scale, row_b, m);
        // Where the plain epilogue stores: y from column n0 (the q|k|v epilogue's value tiles: v, at n0 - 2 width).
        bf16* __restrict__ y_tile = y;
        int n_tile = n;
        int n0_tile = n0;
        if constexpr (kQkv != 0) {
            const int region = n0 / qkv->width;  // 0 q, 1 k, 2 v: tiles never straddle (width % 256 == 0)
            if (region < 2) {
                if constexpr (kQkv == kG8QkvInterleaved) {
                    qkv_norm_rope_epilogue(acc, make_float2(scale_a, scale_b), w_scale, *qkv, region, n0,
                                           make_int2(row_a, m), lane);
                } else {
                    qkv_norm_rope_half_epilogue(acc, make_float2(scale_a, scale_b), w_scale, *qkv, region, n0,
                                                make_int2(row_a, m), lane);
                }
                continue;
            }
            y_tile = qkv->v;
            n_tile = qkv->width;
            n0_tile = n0 - 2 * qkv->width;
        }
        const int col0 = n0_tile + 2 * (lane % 4);
        // Two adjacent columns of one row, scaled (INT8) and rounded to bf16. The two scales multiply first, as
        // nn_swiglu_i32gate_fp8 dequantizes cuBLASLt's int32 products, so either INT8 path gives the same values.
        auto scaled = [&](Acc a, Acc b, float row_scale, float2 ws) {
            __nv_bfloat162 v;
            if constexpr (kBf16) {
                v = __floats2bfloat162_rn(a, b);
            } else {
                v = __floats2bfloat162_rn(static_cast<float>(a) * (row_scale * ws.x),
                                          static_cast<float>(b) * (row_scale * ws.y));
            }
            return *reinterpret_cast<const uint32_t*>(&v);
        };
        auto w_scales = [&](int col) {
            if constexpr (kBf16) {
                return make_float2(1.0f, 1.0f);
            } else {
                return col < n_tile ? *reinterpret_cast<const float2*>(w_scale + (col - n0_tile + n0)) : make_float2(0.0f, 0.0f);
            }
        };
        if constexpr (kTma) {
            // The tile's 64-column boxes through the staging area (a box wholly past N is skipped), each box's
            // pairs made before the wait for its staging box.
            const int wrow = warp * 16 + lane / 4;
#pragma unroll
            for (int b = 0; b < kG8Cols / kG8BoxCols; ++b) {
                if (n0 + kG8BoxCols * b >= n) break;
                uint32_t pa[kG8BoxCols / 8], pb[kG8BoxCols / 8];
#pragma unroll
                for (int jj = 0; jj < kG8BoxCols / 8; ++jj) {
                    const int j = (kG8BoxCols / 8) * b + jj;
                    const float2 ws = w_scales(col0 + 8 * j);
                    pa[jj] = scaled(acc[4 * j], acc[4 * j + 1], scale_a, ws);
                    pb[jj] = scaled(acc[4 * j + 2], acc[4 * j + 3], scale_b, ws);
                }
                staging.begin();
#pragma unroll
                for (int jj = 0; jj < kG8BoxCols / 8; ++jj) {
                    staging.put(wrow, 8 * jj + 2 * (lane % 4), pa[jj]);
                    staging.put(wrow + 8, 8 * jj + 2 * (lane % 4), pb[jj]);
                }
                staging.store(tm_y, n0 + kG8BoxCols * b, m0 + consumer * 64);
            }
            continue;
        }
        if (((n_tile | static_cast<int>(y_row_stride)) & 7) == 0) {
            // Whole 16-byte blocks: the quad's four lanes transpose their pairs of four blocks (two xor-shuffle
            // rounds), so lane q holds all 8 columns of block 4 g + q and a warp stores 64 contiguous bytes a row
            // (y is 16-byte aligned, checked by the launcher). A block is wholly inside N or wholly past it.
            const int q = lane & 3;
#pragma unroll
            for (int g = 0; g < kG8Cols / 32; ++g) {
                uint32_t va[4], vb[4];
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    const int j = 4 * g + t;
                    const float2 ws = w_scales(col0 + 8 * j);
                    va[t] = scaled(acc[4 * j], acc[4 * j + 1], scale_a, ws);
                    vb[t] = scaled(acc[4 * j + 2], acc[4 * j + 3], scale_b, ws);
                }
                g8_transpose_quad(va, q);
                g8_transpose_quad(vb, q);
                const int block_col = n0_tile + 8 * (4 * g + q);
                if (block_col < n_tile) {
                    if (row_a < m) {
                        *reinterpret_cast<uint4*>(y_tile + static_cast<int64_t>(row_a) * y_row_stride + block_col) =
                            make_uint4(va[0], va[1], va[2], va[3]);
                    }
                    if (row_b < m) {
                        *reinterpret_cast<uint4*>(y_tile + static_cast<int64_t>(row_b) * y_row_stride + block_col) =
                            make_uint4(vb[0], vb[1], vb[2], vb[3]);
                    }
                }
            }
        } else {
            // Pairs of columns (N even): rows past M and columns past N are not stored.
#pragma unroll
            for (int j = 0; j < kG8Cols / 8; ++j) {
                const int col = col0 + 8 * j;
                if (col >= n_tile) continue;
                const float2 ws = w_scales(col);
                if (row_a < m) {
                    *reinterpret_cast<uint32_t*>(y_tile + static_cast<int64_t>(row_a) * y_row_stride + col) =
                        scaled(acc[4 * j], acc[4 * j + 1], scale_a, ws);
                }
                if (row_b < m) {
                    *reinterpret_cast<uint32_t*>(y_tile + static_cast<int64_t>(row_b) * y_row_stride + col) =
                        scaled(acc[4 * j + 2], acc[4 * j + 3], scale_b, ws);
                }
            }
        }
    }
    if constexpr (kTma) staging.drain();
}

}  // namespace
#endif

// The INT8 GEMM above. tm_x: x as {K bytes, M rows, 1}, boxes of 128 bytes x 128 rows; tm_w: w as {K bytes, N rows,
// 1}, boxes of 128 bytes x 256 rows; both 128-byte swizzle, zero fill. Persistent: a 1-D grid of at most one CTA
// an SM (each loops over tiles), 384 threads, kG8Stages * 48 KiB + 1 KiB of dynamic shared memory. band: M tiles
// a band of the tile order (tile_origin; 0 for one band).
extern "C" __global__ void __launch_bounds__(384, 1) nn_gemm_int8_scaled_bf16(
    const __grid_constant__ TmaMap tm_x, const __grid_constant__ TmaMap tm_w, const float* __restrict__ x_scale,
    const float* __restrict__ w_scale, bf16* __restrict__ y, int64_t y_row_stride, int m, int n, int k, int band) {
#if defined(NN_HAS_WGMMA)
    gemm_tiles<false>(tm_x, tm_w, x_scale, w_scale, y, y_row_stride, m, n, k, band);
#else
    __trap();
#endif
}

// The same GEMM over bf16 operands, y = bf16(x . w^T) with f32 sums and no scales. tm_x: x as {K, M, 1} bf16,
// boxes of 64 elements (128 bytes) x 128 rows; tm_w: w as {K, N, 1} bf16, boxes of 64 x 256 rows; K a multiple of
// 8 (16-byte rows). Same grid, threads and shared memory as the INT8 kernel.
extern "C" __global__ void __launch_bounds__(384, 1) nn_gemm_bf16(const __grid_constant__ TmaMap tm_x,
                                                                  const __grid_constant__ TmaMap tm_w,
                                                                  bf16* __restrict__ y, int64_t y_row_stride, int m,
                                                                  int n, int k, int band) {
#if defined(NN_HAS_WGMMA)
    gemm_tiles<true>(tm_x, tm_w, nullptr, nullptr, y, y_row_stride, m, n, k, band);
#else
    __trap();
#endif
}

// The two kernels above with the TMA-store epilogue (G8Staging): tm_y is y as a bf16 map {N, M, 1} with y's row
// stride (a multiple of 8), boxes of 64 columns x 64 rows in the 128-byte swizzle; the rest as above, with kG8Stages
// * 48 + 32 + 1 KiB of dynamic shared memory. Outputs bit-equal to the kernels above.
extern "C" __global__ void __launch_bounds__(384, 1) nn_gemm_int8_scaled_bf16_tma(
    const __grid_constant__ TmaMap tm_x, const __grid_constant__ TmaMap tm_w, const __grid_constant__ TmaMap tm_y,
    const float* __restrict__ x_scale, const float* __restrict__ w_scale, bf16* __restrict__ y, int64_t y_row_stride,
    int m, int n, int k, int band) {
#if defined(NN_HAS_WGMMA)
    gemm_tiles<false, false, 0, true>(tm_x, tm_w, x_scale, w_scale, y, y_row_stride, m, n, k, band, 0, 0, nullptr,
                                      &tm_y);
#else
    __trap();
#endif
}
extern "C" __global__ void __launch_bounds__(384, 1) nn_gemm_bf16_tma(const __grid_constant__ TmaMap tm_x,
                                                                      const __grid_constant__ TmaMap tm_w,
                                                                      const __grid_constant__ TmaMap tm_y,
                                                                      bf16* __restrict__ y, int64_t y_row_stride,
                                                                      int m, int n, int k, int band) {
#if defined(NN_HAS_WGMMA)
    gemm_tiles<true, false, 0, true>(tm_x, tm_w, nullptr, nullptr, y, y_row_stride, m, n, k, band, 0, 0, nullptr,
                                     &tm_y);
#else
    __trap();
#endif
}

// The SwiGLU kernels' parameters, and their body for operands B (true: bf16).
#define G8_SWIGLU_PARAMS                                                                                            \
    const __grid_constant__ TmaMap tm_x, const __grid_constant__ TmaMap tm_w, const float *__restrict__ x_scale, \
        const float *__restrict__ w_scale, bf16 *__restrict__ y, int64_t y_row_stride, int m, int hidden, int k,  \
        int gate_base, int value_base, int band
#define G8_SWIGLU_TMA_PARAMS                                                                                        \
    const __grid_constant__ TmaMap tm_x, const __grid_constant__ TmaMap tm_w, const __grid_constant__ TmaMap tm_y, \
        const float *__restrict__ x_scale, const float *__restrict__ w_scale, bf16 *__restrict__ y,                 \
        int64_t y_row_stride, int m, int hidden, int k, int gate_base, int value_base, int band
#if defined(NN_HAS_WGMMA)
#define G8_SWIGLU_BODY(B) \
    gemm_tiles<B, true>(tm_x, tm_w, x_scale, w_scale, y, y_row_stride, m, hidden, k, band, gate_base, value_base)
#define G8_SWIGLU_TMA_BODY(B)                                                                                    \
    gemm_tiles<B, true, 0, true>(tm_x, tm_w, x_scale, w_scale, y, y_row_stride, m, hidden, k, band, gate_base, \
                                 value_base, nullptr, &tm_y)
#else
#define G8_SWIGLU_BODY(B) __trap()
#define G8_SWIGLU_TMA_BODY(B) __trap()
#endif

// The INT8 GEMM of a SwiGLU's two halves with silu(gate) * value in its epilogue: y[m, c] = bf16(silu(g) * v) with
// g and v the bf16 products nn_gemm_int8_scaled_bf16 would store for weight rows gate_base + c and value_base + c
// (one weight [2 hidden, K] holding both halves, either order). tm_x as for the INT8 GEMM; tm_w: w as {K bytes, 2
// hidden rows, 1}, boxes of 128 bytes x 128 rows. hidden a multiple of 128, y's row stride a multiple of 8. Same
// grid, threads and shared memory as the INT8 GEMM (hidden / 128 column tiles).
extern "C" __global__ void __launch_bounds__(384, 1) nn_gemm_int8_swiglu_bf16(G8_SWIGLU_PARAMS) {
    G8_SWIGLU_BODY(false);
}

// The same over bf16 operands (f32 sums rounded to bf16 as nn_gemm_bf16 stores them, then nn_act's SwiGLU
// arithmetic): tm_x and tm_w bf16 maps as for nn_gemm_bf16, but w's boxes 64 x 128 rows. x_scale and w_scale are
// not read (null). Same grid, threads and shared memory.
extern "C" __global__ void __launch_bounds__(384, 1) nn_gemm_bf16_swiglu(G8_SWIGLU_PARAMS) {
    G8_SWIGLU_BODY(true);
}

// The two SwiGLU kernels with the TMA-store epilogue (G8Staging): tm_y is y as a bf16 map {hidden, M, 1} with y's
// row stride, boxes of 64 columns x 64 rows in the 128-byte swizzle; shared memory as nn_gemm_int8_scaled_bf16_tma.
extern "C" __global__ void __launch_bounds__(384, 1) nn_gemm_int8_swiglu_bf16_tma(G8_SWIGLU_TMA_PARAMS) {
    G8_SWIGLU_TMA_BODY(false);
}
extern "C" __global__ void __launch_bounds__(384, 1) nn_gemm_bf16_swiglu_tma(G8_SWIGLU_TMA_PARAMS) {
    G8_SWIGLU_TMA_BODY(true);
}

// The q|k|v kernels' parameters, and their body for operands B (true: bf16) and epilogue form F (kG8QkvInterleaved
// or kG8QkvHalf).
#define G8_QKV_PARAMS                                                                                               \
    const __grid_constant__ TmaMap tm_x, const __grid_constant__ TmaMap tm_w, const float *__restrict__ x_scale, \
        const float *__restrict__ w_scale, const __grid_constant__ G8Qkv qkv, int m, int k, int band
#if defined(NN_HAS_WGMMA)
#define G8_QKV_BODY(B, F) \
    gemm_tiles<B, false, F>(tm_x, tm_w, x_scale, w_scale, qkv.v, qkv.stride, m, 3 * qkv.width, k, band, 0, 0, &qkv)
#else
#define G8_QKV_BODY(B, F) __trap()
#endif

// The INT8 GEMM of a fused q|k|v projection with the per-head QK RMSNorm and interleaved RoPE in its epilogue
// (G8Qkv): y's N = 3 width columns go to q (normed, rotated), k (normed, rotated) and v (as they are), each bf16 rows
// of qkv.stride. width a multiple of 256 (a tile never straddles two of them), stride a multiple of 8, the rope
// tables hold M rows. tm_x, tm_w, grid, threads and shared memory as for the INT8 GEMM.
extern "C" __global__ void __launch_bounds__(384, 1) nn_gemm_int8_qkv_bf16(G8_QKV_PARAMS) {
    G8_QKV_BODY(false, kG8QkvInterleaved);
}

// The same GEMM with MiniMax H3's QK norm (n = x * rsqrt(mean(x^2) + eps) * weight in f32) and rotate-half RoPE
// over the first 96 channels of each head (bf16 tables [M, rope_stride], 48 used columns) in its epilogue; q, k and
// v may be the three parts of one q|k|v matrix (stride 3 width), normed and rotated in place.
extern "C" __global__ void __launch_bounds__(384, 1) nn_gemm_int8_qkv_half_bf16(G8_QKV_PARAMS) {
    G8_QKV_BODY(false, kG8QkvHalf);
}

// The two q|k|v kernels over bf16 operands (maps as for nn_gemm_bf16; x_scale and w_scale not read, null): the
// f32 sums rounded to bf16 as nn_gemm_bf16 stores them, then the same epilogue.
extern "C" __global__ void __launch_bounds__(384, 1) nn_gemm_bf16_qkv(G8_QKV_PARAMS) {
    G8_QKV_BODY(true, kG8QkvInterleaved);
}
extern "C" __global__ void __launch_bounds__(384, 1) nn_gemm_bf16_qkv_half(G8_QKV_PARAMS) {
    G8_QKV_BODY(true, kG8QkvHalf);
}

// --- Implicit-GEMM 3x3 convolution (kernels nn_conv3x3_bf16_n144, nn_conv3x3_bf16_n256) ---
//
//   y[p, o] = bf16( sum_{tap, c} x[p + shift(tap), c] * w[o, tap * cin + c] + bias[o] (+ y[p, o]) )
//
// (or in f32, bias and y both f32)
//
// over an NHWC bf16 map x [h, w, cin] with zero padding of one pixel, w the tap-major weight matrix [n, 9 cin]
// (tap = 3 dy + dx), y NHWC bf16 [h, w, n]. The same warp-specialised pipeline as the GEMM above, but the column
// matrix an im2col pass would write is never made: for K slice (tap, c0) the producer loads x's box of 64 channels
// at pixel (y0 + dy - 1, x0 + dx - 1) through a 3-D tensor map {cin, w, h}, whose zero fill outside the map is the
// convolution's padding. An M tile is 128 pixels: 128 of one row (w >= 128; a row's last tile hangs over its end)
// or 128 / w whole rows (w < 128 dividing 128). The slice's channels past cin read as zeros, so the weight columns
// the slice reads past its tap (the next tap's first ones) multiply zeros, and no per-tap padding of w is needed.
#if defined(NN_HAS_WGMMA)
namespace {

#define CV_REGS72 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
    "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, " \
    "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, " \
    "%54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71}"
#define CV_ACC72 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71])

// d (+)= A * B for one m64n144k16 step: bf16 operands from shared memory (K-major descriptors), f32 sums.
__device__ __forceinline__ void wgmma_bf16_m64n144k16(float (&d)[72], uint64_t desc_a, uint64_t desc_b,
                                                      int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %74, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n144k16.f32.bf16.bf16 " CV_REGS72 ", %72, %73, p, 1, 1, 0, 0;\n}\n"
                 : CV_ACC72
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

constexpr int kCvAccumulate = 1;  // flags: y += the conv (else y = the conv)
constexpr int kCvF32 = 2;         // flags: f32 bias and output (else bf16)

// The conv kernel's tile width: the MMA of a warpgroup's 64 x kCols block, its accumulator count.
template <int kCols>
struct CvTile;
template <>
struct CvTile<144> {
    __device__ __forceinline__ static void mma(float (&d)[72], uint64_t a, uint64_t b, int accumulate) {
        wgmma_bf16_m64n144k16(d, a, b, accumulate);
    }
};
template <>
struct CvTile<256> {
    __device__ __forceinline__ static void mma(float (&d)[128], uint64_t a, uint64_t b, int accumulate) {
        wgmma_bf16_m64n256k16(d, a, b, accumulate);
    }
};

// Pipeline stages of `stage_bytes` each: as many as fit in 227 KiB with the 1 KiB alignment slack, at most six.
constexpr int cv_stages(int stage_bytes) {
    return (227 * 1024 - 1024) / stage_bytes < 6 ? (227 * 1024 - 1024) / stage_bytes : 6;
}

// The pixel geometry of the M tiles of `pixels` (128 or 256) pixels: `box_w` pixels of `rows_per_tile` rows each.
struct CvGeometry {
    int h, w, box_w, rows_per_tile, tiles_per_row, m_tiles;
    __device__ __forceinline__ CvGeometry(int h_, int w_, int box_w_, int pixels)
        : h(h_), w(w_), box_w(box_w_), rows_per_tile(pixels / box_w_),
          tiles_per_row((w_ + box_w_ - 1) / box_w_),
          m_tiles(((h_ + pixels / box_w_ - 1) / (pixels / box_w_)) * ((w_ + box_w_ - 1) / box_w_)) {}
    // The first pixel (x, y) of M tile `mt`.
    __device__ __forceinline__ int2 origin(int mt) const {
        return make_int2((mt % tiles_per_row) * box_w, (mt / tiles_per_row) * rows_per_tile);
    }
    // The pixel index of the tile's row `i`, or -1 past the map.
    __device__ __forceinline__ int pixel(int2 o, int i) const {
        const int px = o.x + i % box_w;
        const int py = o.y + i / box_w;
        return (px < w && py < h) ? py * w + px : -1;
    }
};

// kRowReuse (128-pixel tiles of one row only): a stage holds one input row slice of 130 pixels (the tile's 128 and
// one each side) and the weight slices of that row's three horizontal taps; the taps' A descriptors start 0, 1 and 2
// rows into it, so each input row is loaded
// once instead of three times. The descriptors of the taps one and two rows in carry no base offset: the swizzle
// phase follows the shared-memory address, as the TMA that wrote the rows applied it (a base offset of the rows'
// phase gave wrong products, on an H100).
template <int kRows, int kCols, bool kRowReuse = false>
__device__ __forceinline__ void conv3x3_tiles(const TmaMap& tm_x, const TmaMap& tm_w, const void* __restrict__ bias,
                                              void* __restrict__ y, int h, int w, int cin, int n, int box_w,
                                              int flags) {
    using Tile = CvTile<kCols>;
    static_assert(!kRowReuse || kRows == 128, "row reuse runs 128-pixel tiles");
    constexpr int kTaps = kRowReuse ? 3 : 1;  // taps a stage's A slice serves
    constexpr int kABox = (kRowReuse ? kRows + 2 : kRows) * kG8Slice;
    constexpr int kABytes = (kABox + 1023) / 1024 * 1024;
    constexpr int kBBytes = kCols * kG8Slice;
    constexpr int kStageBytes = kABytes + kTaps * kBBytes;
    constexpr int kStages = cv_stages(kStageBytes);
    // 64-row blocks each consumer warpgroup computes (one wgmma each a K step, sharing the B operand).
    constexpr int kBlocks = kRows / 128;
    static_assert(kStageBytes % 1024 == 0, "stages keep the swizzle's 1024-byte alignment");
    constexpr int kAcc = kCols / 2;
    constexpr int kSliceElems = kG8Slice / 2;  // 64 channels
    extern __shared__ uint8_t g8_smem[];
    __shared__ __align__(8) uint64_t barriers[2 * kStages];
    const G8Ring<kStages, kStageBytes, kABytes> ring(g8_smem, barriers);
    const CvGeometry geo(h, w, box_w, kRows);
    const int tiles = geo.m_tiles * ((n + kCols - 1) / kCols);
    const int c_slices = (cin + kSliceElems - 1) / kSliceElems;
    const int slices = (9 / kTaps) * c_slices;
    const int warpgroup = threadIdx.x / 128;
    ring.init();

    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kG8ProducerRegs));
        if (threadIdx.x == 0) {
            int it = 0;
            for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
                const int2 o = geo.origin(tile % geo.m_tiles);
                const int n0 = (tile / geo.m_tiles) * kCols;
                for (int t = 0; t < slices; ++t, ++it) {
                    const int s = ring.acquire(it);
                    if constexpr (kRowReuse) {
                        const int dy = t / c_slices;
                        const int c0 = (t - dy * c_slices) * kSliceElems;
                        mbar_expect_bytes(ring.full(s), kABox + 3 * kBBytes);
                        tma_box(ring.a_tile(s), &tm_x, c0, o.x - 1, o.y + dy - 1, ring.full(s));
#pragma unroll
                        for (int dx = 0; dx < 3; ++dx) {
                            tma_box_2d(ring.b_tile(s) + dx * kBBytes, &tm_w, (3 * dy + dx) * cin + c0, n0,
                                       ring.full(s));
                        }
                    } else {
                        const int tap = t / c_slices;
                        const int c0 = (t - tap * c_slices) * kSliceElems;
                        mbar_expect_bytes(ring.full(s), kStageBytes);
                        tma_box(ring.a_tile(s), &tm_x, c0, o.x + tap % 3 - 1, o.y + tap / 3 - 1, ring.full(s));
                        tma_box_2d(ring.b_tile(s), &tm_w, tap * cin + c0, n0, ring.full(s));
                    }
                }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kG8ConsumerRegs));
    const int consumer = warpgroup - 1;
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    float acc[kBlocks][kAcc];
#pragma unroll
    for (int r = 0; r < kBlocks; ++r) {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) acc[r][i] = 0.0f;
    }
    int it = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int2 o = geo.origin(tile % geo.m_tiles);
        const int n0 = (tile / geo.m_tiles) * kCols;
        for (int t = 0; t < slices; ++t, ++it) {
            const int s = ring.wait_full(it);
            wgmma_fence();
            const uint32_t a = ring.a_tile(s) + consumer * kBlocks * (64 * kG8Slice);
            const uint32_t b = ring.b_tile(s);
            if constexpr (kRowReuse) {
#pragma unroll
                for (int dx = 0; dx < 3; ++dx) {
#pragma unroll
                    for (int kk = 0; kk < kG8Slice / 32; ++kk) {
                        Tile::mma(acc[0], smem_desc(a + dx * kG8Slice + kk * 32, 16, 1024),
                                  smem_desc(b + dx * kBBytes + kk * 32, 16, 1024), (t > 0 || dx > 0 || kk > 0) ? 1 : 0);
                    }
                }
            } else {
#pragma unroll
                for (int kk = 0; kk < kG8Slice / 32; ++kk) {
#pragma unroll
                    for (int r = 0; r < kBlocks; ++r) {
                        Tile::mma(acc[r], smem_desc(a + r * (64 * kG8Slice) + kk * 32, 16, 1024),
                                  smem_desc(b + kk * 32, 16, 1024), (t > 0 || kk > 0) ? 1 : 0);
                    }
                }
            }
            wgmma_commit();
            wgmma_wait<1>();
            if (t > 0) ring.release((it - 1) % kStages, lane);
        }
        wgmma_wait<0>();
        ring.release((it - 1) % kStages, lane);
#pragma unroll
        for (int r = 0; r < kBlocks; ++r) {
#pragma unroll
            for (int i = 0; i < kAcc; ++i) asm volatile("" : "+f"(acc[r][i])::"memory");
        }
        const int col0 = n0 + 2 * (lane % 4);
        const bool accumulate = (flags & kCvAccumulate) != 0;
        const bool f32_out = (flags & kCvF32) != 0;
        auto store = [&](int pixel, int col, float v0, float v1) {
            const int64_t at = static_cast<int64_t>(pixel) * n + col;
            if (f32_out) {
                const float2 b2 = *reinterpret_cast<const float2*>(static_cast<const float*>(bias) + col);
                float2* dst = reinterpret_cast<float2*>(static_cast<float*>(y) + at);
                float2 v = make_float2(v0 + b2.x, v1 + b2.y);
                if (accumulate) {
                    const float2 old = *dst;
                    v.x += old.x;
                    v.y += old.y;
                }
                *dst = v;
                return;
            }
            const __nv_bfloat162 b2 = *reinterpret_cast<const __nv_bfloat162*>(static_cast<const bf16*>(bias) + col);
            __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(y) + at);
            v0 += __bfloat162float(b2.x);
            v1 += __bfloat162float(b2.y);
            if (accumulate) {
                const __nv_bfloat162 old = *dst;
                v0 += __bfloat162float(old.x);
                v1 += __bfloat162float(old.y);
            }
            *dst = __floats2bfloat162_rn(v0, v1);
        };
        // Thread (warp, lane) holds, in each of its warpgroup's 64-row blocks r, rows 16 warp + lane / 4 and + 8, and
        // in each 8-column block j the columns 8 j + 2 (lane % 4) and + 1 (acc[r][4 j + e]: e < 2 the first row).
#pragma unroll
        for (int r = 0; r < kBlocks; ++r) {
            const int i_a = (consumer * kBlocks + r) * 64 + warp * 16 + lane / 4;
            const int pixel_a = geo.pixel(o, i_a);
            const int pixel_b = geo.pixel(o, i_a + 8);
#pragma unroll
            for (int j = 0; j < kCols / 8; ++j) {
                const int col = col0 + 8 * j;
                if (col >= n) continue;
                if (pixel_a >= 0) store(pixel_a, col, acc[r][4 * j], acc[r][4 * j + 1]);
                if (pixel_b >= 0) store(pixel_b, col, acc[r][4 * j + 2], acc[r][4 * j + 3]);
            }
        }
    }
}

}  // namespace
#endif

// The implicit-GEMM 3x3 convolution above, for output tiles of 144 or 256 channels. tm_x: x as {cin, w, h} bf16,
// boxes of 64 channels x box_w pixels x (128 / box_w) rows; tm_w: w as {9 cin, n, 1} bf16, boxes of 64 x kCols
// rows; both 128-byte swizzle, zero fill. bias: [n], y: [h w, n], both bf16, or both f32 with flags & kCvF32; y is
// added to with flags & kCvAccumulate. cin a
// multiple of 8, n even; box_w = 128 when w >= 128, else w (which then divides 128). Persistent grid of at most one
// CTA an SM, 384 threads, kStages * (16 KiB + kCols * 128 B) + 1 KiB of dynamic shared memory.
#if defined(NN_HAS_WGMMA)
#define CV_BODY(ROWS, COLS, REUSE) conv3x3_tiles<ROWS, COLS, REUSE>(tm_x, tm_w, bias, y, h, w, cin, n, box_w, flags)
#else
#define CV_BODY(ROWS, COLS, REUSE) __trap()
#endif
#define CV_PARAMS                                                                                                   \
    const __grid_constant__ TmaMap tm_x, const __grid_constant__ TmaMap tm_w, const void *__restrict__ bias,     \
        void *__restrict__ y, int h, int w, int cin, int n, int box_w, int flags
extern "C" __global__ void __launch_bounds__(384, 1) nn_conv3x3_bf16_n144(CV_PARAMS) { CV_BODY(128, 144, false); }
extern "C" __global__ void __launch_bounds__(384, 1) nn_conv3x3_bf16_n256(CV_PARAMS) { CV_BODY(128, 256, false); }
extern "C" __global__ void __launch_bounds__(384, 1) nn_conv3x3_bf16_m256_n144(CV_PARAMS) { CV_BODY(256, 144, false); }
// Row reuse (above): tm_x's boxes are 64 channels x 130 pixels x 1 row; w at least 128 (box_w 128).
extern "C" __global__ void __launch_bounds__(384, 1) nn_conv3x3_bf16_rows_n144(CV_PARAMS) { CV_BODY(128, 144, true); }
