// Flash attention forward: bf16 q/k/v/o, f32 online softmax. The kernel bodies, shared by the production set
// (attention.cu: nn_attention) and the benchmark-only tiles (attention_bench.cu: nn_attention_bench). The mma.sync
// kernel takes the head dim D (64 or 128) as a template parameter; the wgmma kernels are head dim 128.
//
// Layout: token-major rows, heads side by side: q[b][row][head * D + d] with element strides between
// rows and batches (the layout the fused-qkv kernel writes, and the one the output projection reads). Keys
// are `prefix_len` cached rows (k_prefix/v_prefix) followed by `num_keys - prefix_len` current rows (k/v):
// the cached prefix is read in place, never copied. Grouped-query attention: query head h reads kv head
// h / (num_heads / num_kv_heads).
//
// Masks, both optional:
//   key_limit[b * key_limit_batch_stride + q] (int32): query q sees keys k < key_limit (causal: q+1 with
//     q counted in keys; block-causal: the end of q's image block; null: all keys).
//   key_pad[2 * b], key_pad[2 * b + 1] (int32): keys in [begin, end) are padding and never seen.
// A query that sees no key gets a zero output row.
//
// Scheme (FlashAttention-2 style): one CTA per (128 or 64 query rows, head, batch), 16 query rows per warp
// kept in registers, keys in tiles of 64 through a cp.async ring of STAGES tiles in XOR-swizzled shared
// memory, mma.sync m16n8k16 bf16 with ldmatrix, exp2 with the scale folded into log2 units. Tiles entirely
// inside every row's window skip per-score masking; tiles past every row's limit are not visited. The
// reduction order is fixed (keys ascending, quad butterflies), so results are bit-identical run to run.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "common/async_copy.cuh"

namespace {

using bf16 = __nv_bfloat16;

constexpr int kHeadDim = 128;                                 // the wgmma kernels' head dim
constexpr int kKeysPerTile = 64;
// Bytes of one head row (D = 128: 256 bytes = 16 chunks of 16 bytes), and of one K or V tile (D = 128: 16 KiB).
template <int D>
constexpr int kRowBytesOf = D * 2;
template <int D>
constexpr int kTileBytesOf = kKeysPerTile * kRowBytesOf<D>;
#define kNegInf (-__int_as_float(0x7f800000))

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled [rows][D] bf16 tile: the chunk index is XORed
// with the row's low 3 bits so that 8 rows read at one logical chunk hit 8 different bank groups.
template <int D>
__device__ __forceinline__ uint32_t swizzle(int row, int chunk) {
    return static_cast<uint32_t>(row * kRowBytesOf<D> + ((chunk ^ (row & 7)) << 4));
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
    const int bytes = valid ? 16 : 0;  // 0: the 16 destination bytes are zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// d += a * b for one m16n8k16 tile (bf16 inputs, f32 accumulators).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x with the hardware unit (relative error ~2^-22, far below the bf16 rounding of P); exp2(-inf) = 0.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
// One thread's scores of a 64-row x 128-key wgmma tile: s[4 j + e] is row a (e < 2) or b, key
// key0 + 8 j + 2 quad + (e & 1). Sets to -inf the scores of keys at or past `valid` in the tile, at or past the
// row's limit, or in [pad_begin, pad_end).
__device__ __forceinline__ void mask_wgmma_scores(float (&s)[64], int key0, int quad, int valid, int limit_a,
                                                  int limit_b, int pad_begin, int pad_end) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = j * 8 + quad * 2 + (e & 1);
            const int key = key0 + row;
            const int limit = e < 2 ? limit_a : limit_b;
            const bool seen = row < valid && key < limit && (key < pad_begin || key >= pad_end);
            if (!seen) s[4 * j + e] = kNegInf;
        }
    }
}

// The maxima of rows a and b over this thread's scores of a wgmma tile (before the quad's reduction).
__device__ __forceinline__ void wgmma_tile_max(const float (&s)[64], float& max_a, float& max_b) {
    max_a = kNegInf;
    max_b = kNegInf;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        max_a = fmaxf(max_a, fmaxf(s[4 * j], s[4 * j + 1]));
        max_b = fmaxf(max_b, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// The key window of this thread's two query rows (key limit per row, clamped; rows past the end get the CTA's
// widest window so they never produce NaN work), the CTA's narrowest and widest windows (through `window`, two
// ints of shared memory; every thread of the CTA must call this), and the sample's padding range.
struct KeyWindows {
    int limit_a, limit_b, window_min, window_max, pad_begin, pad_end;
};

__device__ __forceinline__ KeyWindows key_windows(int row_a, int row_b, int batch, int num_queries, int num_keys,
                                                  const int* __restrict__ key_limit, int64_t key_limit_batch_stride,
                                                  const int* __restrict__ key_pad, int* window) {
    const int tid = threadIdx.x;
    int limit_a = num_keys;
    int limit_b = num_keys;
    if (key_limit != nullptr) {
        const int* lim = key_limit + batch * key_limit_batch_stride;
        if (row_a < num_queries) limit_a = min(max(lim[row_a], 0), num_keys);
        if (row_b < num_queries) limit_b = min(max(lim[row_b], 0), num_keys);
    }
    int window_min = num_keys;
    int window_max = num_keys;
    if (key_limit != nullptr) {
        if (tid == 0) {
            window[0] = num_keys;
            window[1] = 0;
        }
        __syncthreads();
        if (row_a < num_queries) {
            atomicMin(&window[0], limit_a);
            atomicMax(&window[1], limit_a);
        }
        if (row_b < num_queries) {
            atomicMin(&window[0], limit_b);
            atomicMax(&window[1], limit_b);
        }
        __syncthreads();
        window_min = window[0];
        window_max = window[1];
        // Rows past the end are not stored; give them a window that can never produce NaN work.
        if (row_a >= num_queries) limit_a = window_max;
        if (row_b >= num_queries) limit_b = window_max;
    }
    int pad_begin = 0;
    int pad_end = 0;
    if (key_pad != nullptr) {
        pad_begin = max(key_pad[2 * batch], 0);
        pad_end = min(key_pad[2 * batch + 1], num_keys);
        if (pad_end <= pad_begin) pad_begin = pad_end = 0;
    }
    return KeyWindows{limit_a, limit_b, window_min, window_max, pad_begin, pad_end};
}

// Normalises this thread's two rows by their softmax sums, stages the warp's 16 rows (from `warp_row0` of the CTA's
// tile) in the Q tile through `swz` (the tile's swizzle; the warp's reads of those rows are complete), then stores
// them as 16-byte chunks. acc(n, e): element e of column block n, as the mma.sync and wgmma accumulators both lay
// out a thread's two rows (e < 2: row a, else row b + 8). D is the head dim: D / 8 column blocks, D / 8 chunks a row.
template <int D, typename Acc, typename Swizzle>
__device__ __forceinline__ void store_output_rows(Acc acc, Swizzle swz, float sum_a, float sum_b, uint32_t smem_q,
                                                  int warp_row0, int lane, int q0, int num_queries, bf16* o_base,
                                                  int o_row_stride) {
    const float total_a = quad_sum(sum_a);
    const float total_b = quad_sum(sum_b);
    const float inv_a = total_a > 0.0f ? 1.0f / total_a : 0.0f;
    const float inv_b = total_b > 0.0f ? 1.0f / total_b : 0.0f;
    const int local_a = warp_row0 + (lane >> 2);
    const uint32_t in_chunk = (lane & 3) * 4;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        const uint32_t lo = pack_bf16(acc(n, 0) * inv_a, acc(n, 1) * inv_a);
        const uint32_t hi = pack_bf16(acc(n, 2) * inv_b, acc(n, 3) * inv_b);
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(smem_q + swz(local_a, n) + in_chunk), "r"(lo));
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(smem_q + swz(local_a + 8, n) + in_chunk), "r"(hi));
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
        const int idx = lane + i * 32;
        const int r = warp_row0 + (idx >> (D == 128 ? 4 : 3));
        const int c = idx & (D / 8 - 1);
        const int row = q0 + r;
        if (row < num_queries) {
            uint4 v4;
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(v4.x), "=r"(v4.y), "=r"(v4.z), "=r"(v4.w)
                         : "r"(smem_q + swz(r, c)));
            *reinterpret_cast<uint4*>(o_base + static_cast<int64_t>(row) * o_row_stride + c * 8) = v4;
        }
    }
}

template <int WARPS, int STAGES, int D>
__device__ __forceinline__ void attention_tile(
    const bf16* __restrict__ q, int64_t q_batch_stride, int q_row_stride, const bf16* __restrict__ k_prefix,
    const bf16* __restrict__ v_prefix, int64_t prefix_batch_stride, int prefix_row_stride, int prefix_len,
    const bf16* __restrict__ k, const bf16* __restrict__ v, int64_t kv_batch_stride, int kv_row_stride,
    bf16* __restrict__ o, int64_t o_batch_stride, int o_row_stride, int num_queries, int num_keys, int num_heads,
    int num_kv_heads, const int* __restrict__ key_limit, int64_t key_limit_batch_stride,
    const int* __restrict__ key_pad, float scale_log2) {
    constexpr int kThreads = WARPS * 32;
    constexpr int kRows = WARPS * 16;
    constexpr int kChunks = D / 8;                    // 16-byte chunks per row (a power of two)
    constexpr int kChunkShift = kChunks == 16 ? 4 : 3;  // log2(kChunks): D is 128 or 64
    static_assert(D == 128 || D == 64, "the mma.sync attention kernel is built for head dims 64 and 128");
    constexpr int kRowBytes = kRowBytesOf<D>;
    constexpr int kTileBytes = kTileBytesOf<D>;
    extern __shared__ __align__(128) uint8_t smem[];
    __shared__ int window[2];  // [min, max] of the key limits of this CTA's rows

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int group = lane >> 2;  // row within an 8-row half of the warp's 16 rows
    const int quad = lane & 3;
    const int q0 = blockIdx.x * kRows;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int kv_head = head / (num_heads / num_kv_heads);

    const bf16* q_base = q + batch * q_batch_stride + head * D;
    const bf16* kp_base = k_prefix + batch * prefix_batch_stride + kv_head * D;
    const bf16* vp_base = v_prefix + batch * prefix_batch_stride + kv_head * D;
    const bf16* k_base = k + batch * kv_batch_stride + kv_head * D;
    const bf16* v_base = v + batch * kv_batch_stride + kv_head * D;
    bf16* o_base = o + batch * o_batch_stride + head * D;

    const uint32_t smem_q = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    const uint32_t smem_kv = smem_q + kRows * kRowBytes;

    // This thread's two rows and their key windows.
    const int row_a = q0 + warp * 16 + group;
    const int row_b = row_a + 8;
    const KeyWindows kw = key_windows(row_a, row_b, batch, num_queries, num_keys, key_limit,
                                      key_limit_batch_stride, key_pad, window);
    const int limit_a = kw.limit_a;
    const int limit_b = kw.limit_b;
    const int window_min = kw.window_min;
    const int window_max = kw.window_max;
    const int pad_begin = kw.pad_begin;
    const int pad_end = kw.pad_end;
    const int num_tiles = (window_max + kKeysPerTile - 1) / kKeysPerTile;

    // Q: kRows x kChunks chunks; K and V: 64 x kChunks chunks each per tile.
    auto load_q = [&]() {
#pragma unroll
        for (int i = 0; i < kRows * kChunks / kThreads; ++i) {
            const int idx = tid + i * kThreads;
            const int r = idx >> kChunkShift;
            const int c = idx & (kChunks - 1);
            const int row = q0 + r;
            const bool valid = row < num_queries;
            const bf16* src = q_base + (valid ? static_cast<int64_t>(row) * q_row_stride + c * 8 : 0);
            cp_async_16(smem_q + swizzle<D>(r, c), src, valid);
        }
    };
    auto load_kv = [&](int tile, int stage) {
        const uint32_t k_dst = smem_kv + stage * 2 * kTileBytes;
        const uint32_t v_dst = k_dst + kTileBytes;
#pragma unroll
        for (int i = 0; i < kKeysPerTile * kChunks / kThreads; ++i) {
            const int idx = tid + i * kThreads;
            const int r = idx >> kChunkShift;
            const int c = idx & (kChunks - 1);
            const int key = tile * kKeysPerTile + r;
            const bf16* k_src = k_base;
            const bf16* v_src = v_base;
            bool valid = true;
            if (key < prefix_len) {
                const int64_t off = static_cast<int64_t>(key) * prefix_row_stride + c * 8;
                k_src = kp_base + off;
                v_src = vp_base + off;
            } else if (key < num_keys) {
                const int64_t off = static_cast<int64_t>(key - prefix_len) * kv_row_stride + c * 8;
                k_src = k_base + off;
                v_src = v_base + off;
            } else {
                valid = false;  // zero-filled: masked scores times zero values stay finite
            }
            cp_async_16(k_dst + swizzle<D>(r, c), k_src, valid);
            cp_async_16(v_dst + swizzle<D>(r, c), v_src, valid);
        }
    };

    load_q();
    if (num_tiles > 0) load_kv(0, 0);
    cp_async_commit();
#pragma unroll
    for (int s = 1; s < STAGES - 1; ++s) {
        if (s < num_tiles) load_kv(s, s);
        cp_async_commit();
    }

    uint32_t q_frag[D / 16][4];
    float acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float max_a = kNegInf, max_b = kNegInf;  // running row maxima (raw scores)
    float sum_a = 0.0f, sum_b = 0.0f;        // this thread's partial row sums of P

    for (int tile = 0; tile < num_tiles; ++tile) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (tile == 0) {
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const int r = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                ldmatrix_x4(q_frag[kk], smem_q + swizzle<D>(r, 2 * kk + (lane >> 4)));
            }
        }
        {
            const int next = tile + STAGES - 1;
            if (next < num_tiles) load_kv(next, next % STAGES);
            cp_async_commit();
        }
        const uint32_t k_tile = smem_kv + (tile % STAGES) * 2 * kTileBytes;
        const uint32_t v_tile = k_tile + kTileBytes;

        // S = Q K^T for 16 rows x 64 keys.
        float s[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int jp = 0; jp < 4; ++jp) {
                uint32_t b[4];
                const int r = jp * 16 + (lane & 7) + ((lane >> 4) << 3);
                ldmatrix_x4(b, k_tile + swizzle<D>(r, 2 * kk + ((lane >> 3) & 1)));
                mma_bf16(s[2 * jp], q_frag[kk], b[0], b[1]);
                mma_bf16(s[2 * jp + 1], q_frag[kk], b[2], b[3]);
            }
        }

        const int key0 = tile * kKeysPerTile;
        const bool full = key0 + kKeysPerTile <= window_min &&
                          (key0 + kKeysPerTile <= pad_begin || key0 >= pad_end);
        if (!full) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = key0 + j * 8 + quad * 2 + (e & 1);
                    const int limit = e < 2 ? limit_a : limit_b;
                    const bool seen = key < limit && (key < pad_begin || key >= pad_end);
                    if (!seen) s[j][e] = kNegInf;
                }
            }
        }

        // Online softmax in log2 units.
        float tile_max_a = kNegInf, tile_max_b = kNegInf;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            tile_max_a = fmaxf(tile_max_a, fmaxf(s[j][0], s[j][1]));
            tile_max_b = fmaxf(tile_max_b, fmaxf(s[j][2], s[j][3]));
        }
        const float new_max_a = fmaxf(max_a, quad_max(tile_max_a));
        const float new_max_b = fmaxf(max_b, quad_max(tile_max_b));
        const float base_a = new_max_a == kNegInf ? 0.0f : new_max_a * scale_log2;
        const float base_b = new_max_b == kNegInf ? 0.0f : new_max_b * scale_log2;
        // An unchanged maximum rescales by exactly 1, so key tiles a row cannot see (visited because another
        // row of the CTA can) leave its accumulators bit-for-bit unchanged, whatever the tile shape.
        const float corr_a = new_max_a == max_a ? 1.0f : exp2_approx(max_a * scale_log2 - base_a);
        const float corr_b = new_max_b == max_b ? 1.0f : exp2_approx(max_b * scale_log2 - base_b);
        max_a = new_max_a;
        max_b = new_max_b;
        float tile_sum_a = 0.0f, tile_sum_b = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            s[j][0] = exp2_approx(fmaf(s[j][0], scale_log2, -base_a));
            s[j][1] = exp2_approx(fmaf(s[j][1], scale_log2, -base_a));
            s[j][2] = exp2_approx(fmaf(s[j][2], scale_log2, -base_b));
            s[j][3] = exp2_approx(fmaf(s[j][3], scale_log2, -base_b));
            tile_sum_a += s[j][0] + s[j][1];
            tile_sum_b += s[j][2] + s[j][3];
        }
        sum_a = fmaf(sum_a, corr_a, tile_sum_a);
        sum_b = fmaf(sum_b, corr_b, tile_sum_b);
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            acc[n][0] *= corr_a;
            acc[n][1] *= corr_a;
            acc[n][2] *= corr_b;
            acc[n][3] *= corr_b;
        }

        // O += P V: the score accumulators of key tiles 2kk and 2kk+1 are the A fragment of keys 16kk..+16.
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            uint32_t p[4];
            p[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
            p[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
            p[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            p[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int mp = 0; mp < D / 16; ++mp) {
                uint32_t b[4];
                const int r = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                ldmatrix_x4_trans(b, v_tile + swizzle<D>(r, 2 * mp + (lane >> 4)));
                mma_bf16(acc[2 * mp], p, b[0], b[1]);
                mma_bf16(acc[2 * mp + 1], p, b[2], b[3]);
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    // Stage this warp's 16 rows in its own slice of the Q buffer, then store them.
    store_output_rows<D>([&](int n, int e) { return acc[n][e]; }, [](int r, int c) { return swizzle<D>(r, c); }, sum_a,
                      sum_b, smem_q, warp * 16, lane, q0, num_queries, o_base, o_row_stride);
}

// ---------------------------------------------------------------------------------------------------------------
// sm_90a kernels: warpgroup MMA (wgmma). Consumer warpgroups own 64 query rows each (128 rows per CTA); keys come in
// tiles of 128. S = Q K^T reads Q and K from shared memory through 128-byte-swizzled K-major descriptors; O += P V
// takes P from registers (the S accumulators rounded to bf16 are already in the A-operand layout) and V through a
// transposed (MN-major) descriptor, so nothing is transposed by hand. Masks, the prefix cache, GQA and the fixed
// reduction order (keys ascending) are as in attention_tile; the key tile is twice as wide, so results differ from
// the mma.sync kernels in rounding only. The sm90 and sm90_ws kernels are bit-identical to each other; sm90_tma is
// too unless a cached prefix ends inside a key tile (it tiles the prefix on its own). Compiled to a trap on other
// targets: the host selects them on compute capability 9.0 only.
//
//   nn_attention_d128_sm90      two warpgroups; every thread loads through a 2-stage cp.async ring, one
//                               __syncthreads per key tile, and each warpgroup runs scores, softmax, values in turn.
//   nn_attention_d128_sm90_ws   warp-specialised: a producer warpgroup fills a 3-stage ring with cp.async (mbarriers
//                               count what landed and what was released), and the two consumer warpgroups take
//                               turns issuing tensor-core work (named barriers), so one's softmax overlaps the
//                               other's GEMMs; a turn is P V of the previous key tile then S of this one.
//   nn_attention_d128_sm90_tma  sm90_ws with one producer thread loading 128-row boxes through TMA tensor maps: the
//                               loads no longer cost instructions or registers, and land in the swizzled layout.
// ---------------------------------------------------------------------------------------------------------------
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define NN_HAS_WGMMA 1
#endif

// A TMA tensor map as the driver encodes it (cuTensorMapEncodeTiled): 128 opaque bytes, passed by value.
struct alignas(64) TmaMap {
    unsigned long long words[16];
};

#if defined(NN_HAS_WGMMA)
constexpr int kSm90Rows = 128;                           // query rows per CTA, 64 per consumer warpgroup
constexpr int kSm90Keys = 128;                           // keys per tile
constexpr int kSm90Half = 128 * 128;                     // bytes of one 64-column half of a 128-row tile
constexpr int kSm90TileBytes = 2 * kSm90Half;            // 32 KiB

// Byte offset of 16-byte chunk `chunk` (0..15) of row `row` in a 128-row tile kept as two 64-column halves, each
// in the 128-byte swizzle the wgmma descriptors name: the chunk's low three bits XOR the row's low three bits.
__device__ __forceinline__ uint32_t sw128(int row, int chunk) {
    return static_cast<uint32_t>((chunk >> 3) * kSm90Half + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// A wgmma shared-memory descriptor with 128-byte swizzle (the tile bases are 1024-byte aligned).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t leading_bytes, uint32_t stride_bytes) {
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(leading_bytes >> 4) << 16) |
           (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d (+)= A * B for one m64n128k16 step of a warpgroup: A and B from shared memory (K-major descriptors).
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// d += A * B with A (bf16 pairs) in registers and B from shared memory, MN-major (transposed) descriptor.
__device__ __forceinline__ void wgmma_m64n128k16_rs_tb(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// Keeps the compiler from moving accesses of the accumulators across wgmma issue and wait.
__device__ __forceinline__ void fence_accumulators(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// --- named barriers (the mbarriers are in common/async_copy.cuh) ---

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Where one CTA reads and writes: the bases of this (batch, head) in q, the cached prefix, the current keys and o.
struct Sm90Operands {
    const bf16* q;
    const bf16* k_prefix;
    const bf16* v_prefix;
    const bf16* k;
    const bf16* v;
    bf16* o;
    int q_row_stride, prefix_row_stride, kv_row_stride, o_row_stride;
    int prefix_len, num_queries, num_keys;
    int head, kv_head, batch;  // for TMA coordinates
};

// Issues the cp.async copies of the CTA's 128 query rows into the Q tile; `thread` of `threads` copy a share.
template <int THREADS, int UNROLL>
__device__ __forceinline__ void sm90_load_q(const Sm90Operands& op, int q0, uint32_t smem_q, int thread) {
#pragma unroll UNROLL
    for (int i = 0; i < kSm90Rows * 16 / THREADS; ++i) {
        const int idx = thread + i * THREADS;
        const int r = idx >> 4;
        const int c = idx & 15;
        const int row = q0 + r;
        const bool valid = row < op.num_queries;
        const bf16* src = op.q + (valid ? static_cast<int64_t>(row) * op.q_row_stride + c * 8 : 0);
        cp_async_16(smem_q + sw128(r, c), src, valid);
    }
}

// Issues the cp.async copies of key tile `tile`: its K and V rows from the prefix or the current keys (zero past
// the end), one address computation for both. UNROLL: the kernel without a producer unrolls fully (these copies
// sit between the tile barrier and the next GEMM); the producer warpgroup keeps a loop to fit its 40 registers.
template <int THREADS, int UNROLL>
__device__ __forceinline__ void sm90_load_kv(const Sm90Operands& op, int tile, uint32_t k_dst, uint32_t v_dst,
                                             int thread) {
#pragma unroll UNROLL
    for (int i = 0; i < kSm90Keys * 16 / THREADS; ++i) {
        const int idx = thread + i * THREADS;
        const int r = idx >> 4;
        const int c = idx & 15;
        const int key = tile * kSm90Keys + r;
        const bf16* k_src = op.k;
        const bf16* v_src = op.v;
        bool valid = true;
        if (key < op.prefix_len) {
            const int64_t off = static_cast<int64_t>(key) * op.prefix_row_stride + c * 8;
            k_src = op.k_prefix + off;
            v_src = op.v_prefix + off;
        } else if (key < op.num_keys) {
            const int64_t off = static_cast<int64_t>(key - op.prefix_len) * op.kv_row_stride + c * 8;
            k_src = op.k + off;
            v_src = op.v + off;
        } else {
            valid = false;
        }
        cp_async_16(k_dst + sw128(r, c), k_src, valid);
        cp_async_16(v_dst + sw128(r, c), v_src, valid);
    }
}

// One consumer warpgroup's state and steps: 64 query rows, the O accumulators, and the online softmax. Each thread
// holds rows a and b (8 apart) of its warp's 16 rows.
struct Sm90Rows {
    float acc[64];
    float max_a, max_b, sum_a, sum_b;
    int limit_a, limit_b, window_min, pad_begin, pad_end;
    int quad;
    float scale_log2;

    __device__ __forceinline__ void init(const KeyWindows& kw, int lane, float scale) {
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
        max_a = max_b = kNegInf;
        sum_a = sum_b = 0.0f;
        limit_a = kw.limit_a;
        limit_b = kw.limit_b;
        window_min = kw.window_min;
        pad_begin = kw.pad_begin;
        pad_end = kw.pad_end;
        quad = lane & 3;
        scale_log2 = scale;
    }

    // Issues S = Q K^T for one key tile: 64 rows x 128 keys, eight k16 steps over the head dim.
    static __device__ __forceinline__ void issue_scores(float (&s)[64], uint32_t q_rows, uint32_t k_tile) {
#pragma unroll
        for (int i = 0; i < 64; ++i) s[i] = 0.0f;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            const uint32_t step = (kk >> 2) * kSm90Half + (kk & 3) * 32;
            wgmma_m64n128k16_ss(s, smem_desc(q_rows + step, 16, 1024), smem_desc(k_tile + step, 16, 1024),
                                kk > 0 ? 1 : 0);
        }
        wgmma_commit();
    }

    // Issues O += P V for one key tile. V (keys x head dim, head dim contiguous) is B through an MN-major
    // descriptor: 8-key groups 1024 bytes apart, 64-column halves kSm90Half apart.
    __device__ __forceinline__ void issue_values(const uint32_t (&p)[8][4], uint32_t v_tile) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            wgmma_m64n128k16_rs_tb(acc, p[kk], smem_desc(v_tile + kk * 2048, kSm90Half, 1024));
        }
        wgmma_commit();
    }

    // Masks the scores of the key tile starting at key0, updates the running maxima and sums, and leaves exp2 of
    // the scores (relative to the new maxima) in s. Returns the factors that rescale what was accumulated before.
    // s[4 j + e]: row a (e < 2) or b, key 8 j + 2 quad + (e & 1) of the tile.
    // `valid`: the tile's rows past it hold no key (a partial tile of the cached prefix).
    __device__ __forceinline__ void softmax_tile(float (&s)[64], int key0, float& corr_a, float& corr_b,
                                                 int valid = kSm90Keys) {
        const bool full = valid == kSm90Keys && key0 + kSm90Keys <= window_min &&
                          (key0 + kSm90Keys <= pad_begin || key0 >= pad_end);
        if (!full) mask_wgmma_scores(s, key0, quad, valid, limit_a, limit_b, pad_begin, pad_end);
        float tile_max_a, tile_max_b;
        wgmma_tile_max(s, tile_max_a, tile_max_b);
        const float new_max_a = fmaxf(max_a, quad_max(tile_max_a));
        const float new_max_b = fmaxf(max_b, quad_max(tile_max_b));
        const float base_a = new_max_a == kNegInf ? 0.0f : new_max_a * scale_log2;
        const float base_b = new_max_b == kNegInf ? 0.0f : new_max_b * scale_log2;
        corr_a = new_max_a == max_a ? 1.0f : exp2_approx(max_a * scale_log2 - base_a);
        corr_b = new_max_b == max_b ? 1.0f : exp2_approx(max_b * scale_log2 - base_b);
        max_a = new_max_a;
        max_b = new_max_b;
        float tile_sum_a = 0.0f, tile_sum_b = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            s[4 * j] = exp2_approx(fmaf(s[4 * j], scale_log2, -base_a));
            s[4 * j + 1] = exp2_approx(fmaf(s[4 * j + 1], scale_log2, -base_a));
            s[4 * j + 2] = exp2_approx(fmaf(s[4 * j + 2], scale_log2, -base_b));
            s[4 * j + 3] = exp2_approx(fmaf(s[4 * j + 3], scale_log2, -base_b));
            tile_sum_a += s[4 * j] + s[4 * j + 1];
            tile_sum_b += s[4 * j + 2] + s[4 * j + 3];
        }
        sum_a = fmaf(sum_a, corr_a, tile_sum_a);
        sum_b = fmaf(sum_b, corr_b, tile_sum_b);
    }

    __device__ __forceinline__ void rescale(float corr_a, float corr_b) {
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            acc[4 * n] *= corr_a;
            acc[4 * n + 1] *= corr_a;
            acc[4 * n + 2] *= corr_b;
            acc[4 * n + 3] *= corr_b;
        }
    }

    // Key blocks 2 kk and 2 kk + 1 of S form the A fragment of keys 16 kk .. 16 kk + 15.
    static __device__ __forceinline__ void pack_probabilities(const float (&s)[64], uint32_t (&p)[8][4]) {
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            p[kk][0] = pack_bf16(s[8 * kk], s[8 * kk + 1]);
            p[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
            p[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
            p[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
        }
    }

    // Normalises, stages this warp's 16 rows (first row `warp_row0` of the CTA tile) in the same rows of the Q tile
    // (this warpgroup's reads of them are complete), then stores 16-byte chunks.
    __device__ __forceinline__ void store(const Sm90Operands& op, uint32_t smem_q, int q0, int warp_row0, int lane) {
        store_output_rows<kHeadDim>([&](int n, int e) { return acc[4 * n + e]; }, [](int r, int c) { return sw128(r, c); },
                          sum_a, sum_b, smem_q, warp_row0, lane, q0, op.num_queries, op.o, op.o_row_stride);
    }
};

__device__ __forceinline__ Sm90Operands sm90_operands(
    const bf16* q, int64_t q_batch_stride, int q_row_stride, const bf16* k_prefix, const bf16* v_prefix,
    int64_t prefix_batch_stride, int prefix_row_stride, int prefix_len, const bf16* k, const bf16* v,
    int64_t kv_batch_stride, int kv_row_stride, bf16* o, int64_t o_batch_stride, int o_row_stride, int num_queries,
    int num_keys, int num_heads, int num_kv_heads) {
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int kv_head = head / (num_heads / num_kv_heads);
    Sm90Operands op;
    op.q = q + batch * q_batch_stride + head * kHeadDim;
    op.k_prefix = k_prefix + batch * prefix_batch_stride + kv_head * kHeadDim;
    op.v_prefix = v_prefix + batch * prefix_batch_stride + kv_head * kHeadDim;
    op.k = k + batch * kv_batch_stride + kv_head * kHeadDim;
    op.v = v + batch * kv_batch_stride + kv_head * kHeadDim;
    op.o = o + batch * o_batch_stride + head * kHeadDim;
    op.q_row_stride = q_row_stride;
    op.prefix_row_stride = prefix_row_stride;
    op.kv_row_stride = kv_row_stride;
    op.o_row_stride = o_row_stride;
    op.prefix_len = prefix_len;
    op.num_queries = num_queries;
    op.num_keys = num_keys;
    op.head = head;
    op.kv_head = kv_head;
    op.batch = batch;
    return op;
}

// The tiles start at the first 1024-byte boundary of dynamic shared memory (the swizzle pattern repeats every 1024).
__device__ __forceinline__ uint32_t sm90_smem_base() {
    extern __shared__ __align__(128) uint8_t smem[];
    const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    return (raw + 1023u) & ~1023u;
}

// Two warpgroups, every thread loads, 2 stages, one key tile after the other.
__device__ __forceinline__ void attention_sm90(const Sm90Operands& op, int batch, const int* __restrict__ key_limit,
                                               int64_t key_limit_batch_stride, const int* __restrict__ key_pad,
                                               float scale_log2) {
    constexpr int kThreads = 256;
    constexpr int kStages = 2;
    __shared__ int window[2];
    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int warpgroup = warp >> 2;
    const int q0 = blockIdx.x * kSm90Rows;
    const uint32_t smem_q = sm90_smem_base();
    const uint32_t smem_kv = smem_q + kSm90TileBytes;
    const int warp_row0 = warpgroup * 64 + (warp & 3) * 16;
    const int row_a = q0 + warp_row0 + (lane >> 2);
    const KeyWindows kw = key_windows(row_a, row_a + 8, batch, op.num_queries, op.num_keys, key_limit,
                                      key_limit_batch_stride, key_pad, window);
    const int num_tiles = (kw.window_max + kSm90Keys - 1) / kSm90Keys;
    Sm90Rows rows;
    rows.init(kw, lane, scale_log2);
    const uint32_t q_rows = smem_q + warpgroup * 64 * 128;
    auto k_tile_of = [&](int tile) { return smem_kv + (tile % kStages) * 2 * kSm90TileBytes; };

    sm90_load_q<kThreads, kSm90Rows * 16 / kThreads>(op, q0, smem_q, tid);
    if (num_tiles > 0) sm90_load_kv<kThreads, kSm90Keys * 16 / kThreads>(op, 0, k_tile_of(0), k_tile_of(0) + kSm90TileBytes, tid);
    cp_async_commit();
    // Each tile: scores, softmax, values, one after the other in a warpgroup (the other warpgroup's work is what
    // overlaps).
    for (int tile = 0; tile < num_tiles; ++tile) {
        cp_async_wait<0>();
        fence_proxy_async();  // cp.async wrote through the generic proxy; wgmma reads through the async one
        __syncthreads();      // every thread's copies landed, and the stage loaded next is no longer read
        if (tile + 1 < num_tiles) {
            const uint32_t next = k_tile_of(tile + 1);
            sm90_load_kv<kThreads, kSm90Keys * 16 / kThreads>(op, tile + 1, next, next + kSm90TileBytes, tid);
        }
        cp_async_commit();
        float s[64];
        Sm90Rows::issue_scores(s, q_rows, k_tile_of(tile));
        wgmma_wait<0>();
        fence_accumulators(s);
        float corr_a, corr_b;
        rows.softmax_tile(s, tile * kSm90Keys, corr_a, corr_b);
        rows.rescale(corr_a, corr_b);
        uint32_t p[8][4];
        Sm90Rows::pack_probabilities(s, p);
        rows.issue_values(p, k_tile_of(tile) + kSm90TileBytes);
        wgmma_wait<0>();
        fence_accumulators(rows.acc);
    }
    cp_async_wait<0>();
    rows.store(op, smem_q, q0, warp_row0, lane);
}

// One TMA copy of a 128-row x 64-column box at (col, row, batch) into dst (128-byte swizzle), counted on bar.
__device__ __forceinline__ void tma_box(uint32_t dst, const TmaMap* map, int col, int row, int batch, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
            dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(batch), "r"(bar)
        : "memory");
}

// A 128-row tile of 128 columns: two boxes, one per 64-column half (the halves the wgmma descriptors name).
__device__ __forceinline__ void tma_tile(uint32_t dst, const TmaMap* map, int col, int row, int batch, uint32_t bar) {
    mbar_expect_bytes(bar, kSm90TileBytes);
    tma_box(dst, map, col, row, batch, bar);
    tma_box(dst + kSm90Half, map, col + 64, row, batch, bar);
}

// Where key tile `t` comes from. With TMA the cached prefix and the current keys are tiled separately (a box reads
// one tensor): prefix tiles first, the last one partial, then current tiles from the current keys' row 0. Without
// TMA, tiles are 128 consecutive keys and each row picks its tensor.
struct KeyTile {
    int key0;   // key index of the tile's row 0
    int valid;  // rows holding keys
    int row;    // first row in the source tensor (TMA)
    bool prefix;
};

__device__ __forceinline__ KeyTile key_tile(int t, int prefix_tiles, int prefix_len, int num_keys, bool separate) {
    if (!separate) return KeyTile{t * kSm90Keys, kSm90Keys, 0, false};
    if (t < prefix_tiles) {
        const int key0 = t * kSm90Keys;
        return KeyTile{key0, min(kSm90Keys, prefix_len - key0), key0, true};
    }
    const int row = (t - prefix_tiles) * kSm90Keys;
    return KeyTile{prefix_len + row, min(kSm90Keys, num_keys - prefix_len - row), row, false};
}

// Warp-specialised: warpgroup 0 loads, warpgroups 1 and 2 compute. Shared memory: the Q tile, then kWsStages K tiles,
// then kWsStages V tiles. mbarriers per stage: full_k / full_v complete when the stage's K (with Q, for the first
// tile, under cp.async) / V has landed (cp.async: each producer thread's arrival counts once; TMA: one arrival and
// the bytes it expects); empty_k / empty_v complete when every consumer warp has finished reading it. K is released
// as soon as its scores are done, one step before V. Named barriers 1 and 2 pass the turn to issue tensor-core work
// between the consumers.
// Registers: ptxas allocates every role to the 168 per thread of a 384-thread CTA; setmaxnreg then hands the
// producer's unused share to the consumers at run time.
constexpr int kWsStages = 3;
constexpr int kWsProducerRegs = 40;
constexpr int kWsConsumerRegs = 232;  // 40 * 128 + 232 * 256 <= 65536 registers of the SM

// Ends the producer's threads with PTX `exit` rather than a return: a return joins the consumers' path at the
// function's end, and ptxas then allocates the consumers' code to the launch's 168 registers instead of their
// setmaxnreg budget (spills, and wgmma serialized with warning C7512).
__device__ __forceinline__ void exit_thread() { asm volatile("exit;\n" ::: "memory"); }

// Keeps the compiler from reusing the registers of a wgmma A operand before the wgmma that reads them is done.
__device__ __forceinline__ void fence_fragment(uint32_t (&p)[8][4]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(p[i][j])::"memory");
    }
}

// TMA: one producer thread loads with TMA boxes through the tensor maps (q, k, v, k prefix, v prefix); else the
// producer warpgroup copies with cp.async.
template <bool TMA>
__device__ __forceinline__ void attention_sm90_ws(const Sm90Operands& op, int batch, const int* __restrict__ key_limit,
                                                  int64_t key_limit_batch_stride, const int* __restrict__ key_pad,
                                                  float scale_log2, const TmaMap* tm_q = nullptr,
                                                  const TmaMap* tm_k = nullptr, const TmaMap* tm_v = nullptr,
                                                  const TmaMap* tm_kp = nullptr, const TmaMap* tm_vp = nullptr) {
    constexpr int kProducerThreads = 128;
    constexpr int kConsumerThreads = 256;
    __shared__ int window[2];
    __shared__ __align__(8) uint64_t barriers[4 * kWsStages + 1];  // + the Q barrier (TMA)
    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    // 0: producer; 1, 2: consumers. Broadcast from lane 0 so the compiler knows it is warp-uniform (it then
    // allocates each role's registers to the budget its setmaxnreg names).
    const int warpgroup = __shfl_sync(0xffffffffu, tid / 128, 0);
    const int q0 = blockIdx.x * kSm90Rows;
    const uint32_t smem_q = sm90_smem_base();
    const uint32_t smem_k = smem_q + kSm90TileBytes;
    const uint32_t smem_v = smem_k + kWsStages * kSm90TileBytes;
    const uint32_t bar_base = static_cast<uint32_t>(__cvta_generic_to_shared(barriers));
    // Barrier `kind` (0 full_k, 1 full_v, 2 empty_k, 3 empty_v) of the stage that holds key tile `tile`.
    auto bar = [&](int kind, int tile) { return bar_base + 8u * (kind * kWsStages + tile % kWsStages); };
    const uint32_t q_bar = bar_base + 8u * (4 * kWsStages);
    if (tid == 0) {
        // cp.async: each producer thread's arrival counts; TMA: one arrival plus the bytes it expects.
        const uint32_t full_count = TMA ? 1 : kProducerThreads;
        mbar_init(q_bar, 1);
        for (int s = 0; s < kWsStages; ++s) {
            mbar_init(bar(0, s), full_count);
            mbar_init(bar(1, s), full_count);
            mbar_init(bar(2, s), kConsumerThreads / 32);
            mbar_init(bar(3, s), kConsumerThreads / 32);
        }
    }
    // Producer threads take no part in the key windows: give them rows past the end.
    const int warp_row0 = (warpgroup - 1) * 64 + (warp & 3) * 16;
    const int row_a = warpgroup == 0 ? op.num_queries : q0 + warp_row0 + (lane >> 2);
    const KeyWindows kw = key_windows(row_a, row_a + 8, batch, op.num_queries, op.num_keys, key_limit,
                                      key_limit_batch_stride, key_pad, window);
    __syncthreads();  // the barriers are initialised (key_windows only syncs when there are key limits)
    // Key tiles: with TMA the prefix is tiled on its own (see key_tile).
    const int P = op.prefix_len;
    int prefix_tiles = 0;
    int num_tiles = (kw.window_max + kSm90Keys - 1) / kSm90Keys;
    if (TMA && P > 0) {
        if (kw.window_max <= P) {
            prefix_tiles = num_tiles;
        } else {
            prefix_tiles = (P + kSm90Keys - 1) / kSm90Keys;
            num_tiles = prefix_tiles + (kw.window_max - P + kSm90Keys - 1) / kSm90Keys;
        }
    }
    auto tile_at = [&](int t) { return key_tile(t, prefix_tiles, P, op.num_keys, TMA); };
    // Phase parity of the n-th use of a stage: tiles 0..2 use phase 0, 3..5 phase 1, ...
    auto parity = [](int tile) { return static_cast<uint32_t>((tile / kWsStages) & 1); };

    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kWsProducerRegs));
        if constexpr (TMA) {
            if (tid != 0 || num_tiles == 0) exit_thread();
            const int kv_col = op.kv_head * kHeadDim;
            tma_tile(smem_q, tm_q, op.head * kHeadDim, q0, op.batch, q_bar);
            for (int tile = 0; tile < num_tiles; ++tile) {
                const uint32_t offset = (tile % kWsStages) * kSm90TileBytes;
                if (tile >= kWsStages) {
                    mbar_wait(bar(2, tile), parity(tile) ^ 1u);
                    mbar_wait(bar(3, tile), parity(tile) ^ 1u);
                }
                const KeyTile kt = tile_at(tile);
                tma_tile(smem_k + offset, kt.prefix ? tm_kp : tm_k, kv_col, kt.row, op.batch, bar(0, tile));
                tma_tile(smem_v + offset, kt.prefix ? tm_vp : tm_v, kv_col, kt.row, op.batch, bar(1, tile));
            }
            exit_thread();
        } else {
            for (int tile = 0; tile < num_tiles; ++tile) {
                const uint32_t offset = (tile % kWsStages) * kSm90TileBytes;
                // The stage was last used by tile - kWsStages: wait for that use's release.
                if (tile >= kWsStages) {
                    mbar_wait(bar(2, tile), parity(tile) ^ 1u);
                    mbar_wait(bar(3, tile), parity(tile) ^ 1u);
                }
                if (tile == 0) sm90_load_q<kProducerThreads, 2>(op, q0, smem_q, tid);
                sm90_load_kv<kProducerThreads, 2>(op, tile, smem_k + offset, smem_v + offset, tid);
                // Both arrivals track every copy issued so far: K and V of this tile land together.
                mbar_arrive_on_copies(bar(0, tile));
                mbar_arrive_on_copies(bar(1, tile));
            }
            cp_async_wait<0>();  // leave no copy in flight behind an exited thread
            exit_thread();
        }
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kWsConsumerRegs));
    const int consumer = warpgroup - 1;
    const int my_turn = 1 + consumer;
    const int other_turn = 2 - consumer;
    Sm90Rows rows;
    rows.init(kw, lane, scale_log2);
    const uint32_t q_rows = smem_q + consumer * 64 * 128;
    // Issue points: the scores of tile 0, then (values t - 1, scores t) for each later t, then the values of the last
    // tile: num_tiles + 1 in all. The warpgroups alternate, consumer 0 first; every bar.sync of one is matched by a
    // bar.arrive of the other (consumer 1 opens consumer 0's first turn and skips its own last hand-over).
    const int issue_points = num_tiles > 0 ? num_tiles + 1 : 0;
    int point = 0;
    auto take_turn = [&]() { named_barrier_sync(my_turn, kConsumerThreads); };
    auto pass_turn = [&]() {
        if (!(consumer == 1 && point == issue_points - 1)) named_barrier_arrive(other_turn, kConsumerThreads);
        ++point;
    };
    auto wait_landed = [&](int kind, int tile) {
        mbar_wait(bar(kind, tile), parity(tile));
        // cp.async writes through the generic proxy and wgmma reads through the async one; TMA writes through
        // the async proxy already.
        if (!TMA) fence_proxy_async();
    };
    auto release = [&](int kind, int tile) {
        if (lane == 0) mbar_arrive(bar(kind, tile));
    };
    auto k_tile = [&](int tile) { return smem_k + (tile % kWsStages) * kSm90TileBytes; };
    auto v_tile = [&](int tile) { return smem_v + (tile % kWsStages) * kSm90TileBytes; };
    if (consumer == 1 && issue_points > 0) named_barrier_arrive(other_turn, kConsumerThreads);

    // A turn: S = Q K^T of this tile, then O += P V of the previous one, issued back to back. The softmax of this
    // tile then runs while the previous tile's P V is still on the tensor cores (and while the other warpgroup
    // issues its own turn); O is rescaled once that P V is done. S, P and O are all live at once: the consumers'
    // setmaxnreg budget holds them.
    uint32_t p[8][4];
    if (num_tiles > 0) {
        if (TMA) mbar_wait(q_bar, 0);
        wait_landed(0, 0);
        float s[64];
        take_turn();
        Sm90Rows::issue_scores(s, q_rows, k_tile(0));
        pass_turn();
        wgmma_wait<0>();
        fence_accumulators(s);
        release(2, 0);
        float corr_a, corr_b;
        const KeyTile kt = tile_at(0);
        rows.softmax_tile(s, kt.key0, corr_a, corr_b, kt.valid);  // acc is zero: nothing to rescale
        Sm90Rows::pack_probabilities(s, p);
    }
    for (int tile = 1; tile < num_tiles; ++tile) {
        wait_landed(0, tile);
        wait_landed(1, tile - 1);
        float s[64];
        take_turn();
        Sm90Rows::issue_scores(s, q_rows, k_tile(tile));
        rows.issue_values(p, v_tile(tile - 1));
        pass_turn();
        wgmma_wait<1>();  // the scores (committed first) are done; P V may still run
        fence_accumulators(s);
        release(2, tile);
        float corr_a, corr_b;
        const KeyTile kt = tile_at(tile);
        rows.softmax_tile(s, kt.key0, corr_a, corr_b, kt.valid);
        wgmma_wait<0>();
        fence_accumulators(rows.acc);
        fence_fragment(p);
        release(3, tile - 1);
        rows.rescale(corr_a, corr_b);
        Sm90Rows::pack_probabilities(s, p);
    }
    if (num_tiles > 0) {
        wait_landed(1, num_tiles - 1);
        take_turn();
        rows.issue_values(p, v_tile(num_tiles - 1));
        pass_turn();
        wgmma_wait<0>();
        fence_accumulators(rows.acc);
        fence_fragment(p);
        release(3, num_tiles - 1);
    }
    rows.store(op, smem_q, q0, warp_row0, lane);
}
#endif  // NN_HAS_WGMMA
}  // namespace

// Dynamic shared memory: (16 * WARPS + 2 * 64 * STAGES) * 2 * D bytes; grid (ceil(num_queries / (16 *
// WARPS)), num_heads, batch); block 32 * WARPS threads. See attention_tile for the arguments.
#define NN_ATTENTION_KERNEL(NAME, WARPS, STAGES, D, MIN_BLOCKS)                                                  \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS) NAME(                                \
        const bf16* __restrict__ q, int64_t q_batch_stride, int q_row_stride, const bf16* __restrict__ k_prefix, \
        const bf16* __restrict__ v_prefix, int64_t prefix_batch_stride, int prefix_row_stride, int prefix_len, \
        const bf16* __restrict__ k, const bf16* __restrict__ v, int64_t kv_batch_stride, int kv_row_stride,   \
        bf16* __restrict__ o, int64_t o_batch_stride, int o_row_stride, int num_queries, int num_keys,          \
        int num_heads, int num_kv_heads, const int* __restrict__ key_limit, int64_t key_limit_batch_stride,   \
        const int* __restrict__ key_pad, float scale_log2) {                                                  \
        attention_tile<WARPS, STAGES, D>(q, q_batch_stride, q_row_stride, k_prefix, v_prefix, prefix_batch_stride, \
                                      prefix_row_stride, prefix_len, k, v, kv_batch_stride, kv_row_stride, o,   \
                                      o_batch_stride, o_row_stride, num_queries, num_keys, num_heads,          \
                                      num_kv_heads, key_limit, key_limit_batch_stride, key_pad, scale_log2);   \
    }

// sm_90a kernels. nn_attention_d128_sm90: block 256, dynamic shared memory (1 + 2 * 2) * 32 KiB + 1 KiB (alignment).
// nn_attention_d128_sm90_ws: block 384, (1 + 2 * 3) * 32 KiB + 1 KiB. Grid (ceil(num_queries / 128), num_heads, batch).
#if defined(NN_HAS_WGMMA)
#define NN_SM90_BODY(FN)                                                                                      \
    FN(sm90_operands(q, q_batch_stride, q_row_stride, k_prefix, v_prefix, prefix_batch_stride, prefix_row_stride, \
                     prefix_len, k, v, kv_batch_stride, kv_row_stride, o, o_batch_stride, o_row_stride,           \
                     num_queries, num_keys, num_heads, num_kv_heads),                                              \
       blockIdx.z, key_limit, key_limit_batch_stride, key_pad, scale_log2);
#else
#define NN_SM90_BODY(FN) __trap();
#endif
#define NN_ATTENTION_SM90_KERNEL(NAME, THREADS, FN)                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME(                                             \
        const bf16* __restrict__ q, int64_t q_batch_stride, int q_row_stride, const bf16* __restrict__ k_prefix, \
        const bf16* __restrict__ v_prefix, int64_t prefix_batch_stride, int prefix_row_stride, int prefix_len, \
        const bf16* __restrict__ k, const bf16* __restrict__ v, int64_t kv_batch_stride, int kv_row_stride,   \
        bf16* __restrict__ o, int64_t o_batch_stride, int o_row_stride, int num_queries, int num_keys,          \
        int num_heads, int num_kv_heads, const int* __restrict__ key_limit, int64_t key_limit_batch_stride,   \
        const int* __restrict__ key_pad, float scale_log2) {                                                  \
        NN_SM90_BODY(FN)                                                                                      \
    }
