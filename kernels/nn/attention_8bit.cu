// Flash attention in 8 bits (kernel set nn_attention_8bit, sm_90a only): an option beside the bf16 kernels of
// attention.cu, never selected by default. SageAttention2's scheme on our warp-specialised wgmma kernel:
//
//   S = Q K^T     Q in INT8 with one scale per query row (the softmax scale and log2(e) folded in), K in INT8 with
//                 one scale per 128-key block after smoothing (the per-(sample, kv head) mean of K over every key is
//                 subtracted first: q.(k - m) = q.k - q.m shifts a query's scores by one constant, which the softmax
//                 ignores, and it centres K so that a block's amax no longer carries the channels' common offset);
//                 wgmma m64n128k32 s32.s8.s8, exact int32 sums (|S| <= 127^2 * 128 < 2^24, exact in f32 too),
//                 dequantized by the two scales.
//   softmax       online, f32, exp2; P relative to the running row maximum is scaled by 448 (e4m3's largest value),
//                 so P in [0, 448] uses e4m3's full range; the row sums add the same scaled values, so the 448
//                 cancels in the normalisation.
//   O += P V      P in FP8 e4m3 from registers, V in FP8 e4m3 with one scale per channel (amax / 448 over every key of
//                 the sample and kv head); wgmma m64n128k32 f32.e4m3.e4m3, f32 accumulators; V's scale is applied
//                 with the normalisation, the output is bf16.
//
// 8-bit wgmma reads both operands K-major from shared memory, so V is stored transposed, [head dim][keys], by the
// quantizing pass; and the S accumulators (thread t of a quad holds keys 2t, 2t + 1, 8 + 2t, 9 + 2t, ... of each 32)
// are not in the A-operand layout of an 8-bit wgmma (keys 4t .. 4t + 3 and 16 + 4t .. 16 + 4t + 3). Rather than
// permuting bytes across threads, the quantizing pass stores the keys of each group of 16 in the order
// 0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15 along V^T's rows: the k-th byte of the A operand and the k-th
// row of B then belong to the same key, and a thread packs its own P values with no shuffle. The contraction over
// keys does not care about their order.
//
// Passes (the launcher in crates/tf-engines/src/nn/gpu/attention_8bit.rs sizes one workspace for them):
//   nn_attention_8bit_kv_stats     per 128-key block: per-channel sums of K and amax of V (fixed order).
//   nn_attention_8bit_kv_finalize  per (sample, kv head): K's mean and V's scale per channel (blocks in order).
//   nn_attention_8bit_quantize_kv  per 128-key block: K - mean to INT8 (one scale), V to e4m3 transposed.
//   nn_attention_8bit_quantize_q   per query row: Q to INT8 (one scale).
//   nn_attention_8bit_d128         the attention: warp-specialised as nn_attention_d128_sm90_tma (a producer
//                                  thread, two consumer warpgroups taking turns on the tensor cores, each turn
//                                  S of one key tile then P V of the previous, the softmax running while P V
//                                  does), loading each 16 KiB tile with one bulk copy: the quantizing passes
//                                  already wrote every tile in the 128-byte swizzle the wgmma descriptors name,
//                                  zero-padded to 128 rows.
//
// Workspace tiles, each 128 rows x 128 bytes (16 KiB), row r's 16-byte chunk c at r * 128 + ((c ^ (r & 7)) << 4):
//   q8 [batch][head][query tile]    rows: queries, bytes: head dim (INT8)
//   k8 [batch][kv head][key tile]   rows: keys, bytes: head dim (INT8)
//   v8 [batch][kv head][key tile]   rows: head-dim channels, bytes: the tile's 128 keys in the order above (e4m3)
// and f32: qs [batch][head][query tiles * 128], ks [batch][kv head][key tiles], kv_params [batch][kv head][3][128]
// (K's mean, V's scale, its inverse), partial [batch][kv head][key tiles][2][128] (sums of K, amax of V).
//
// Inputs and masks are those of nn_attention_d128_*: token-major bf16 rows, a cached prefix read in place, GQA,
// per-query key limits and one key-padding range per sample. Padded keys take part in K's mean and V's amax
// (they are real rows of the tensors) but are never seen by a query.
#include <cuda_fp8.h>

#include "common/common.cuh"
#include "nn/attention.cuh"

namespace {

constexpr int kA8Rows = 128;          // query rows per tile and per CTA
constexpr int kA8Keys = 128;          // keys per tile
constexpr int kA8TileBytes = 16384;   // one 128 x 128-byte tile
constexpr int kA8Stages = 4;
// The Q region is 32 KiB: the INT8 Q tile uses the first half; the output is staged through all of it as bf16.
constexpr int kA8QRegion = 32768;
constexpr float kLog2Fp8Max = 8.807354922057604f;  // log2(448)

// Byte offset of byte `col` (0..127) of row `row` in a swizzled 128 x 128-byte tile.
__device__ __forceinline__ uint32_t a8_swizzle(int row, int col) {
    return static_cast<uint32_t>(row * 128 + ((((col >> 4) ^ (row & 7)) & 7) << 4) + (col & 15));
}

// Where key `key` of a tile sits along V^T's rows (see the file comment): within each group of 16, key 8h + 2t + j
// goes to position 4t + 2h + j.
__device__ __forceinline__ int a8_key_position(int key) {
    const int k16 = key & 15;
    return (key & ~15) | (((k16 >> 1) & 3) << 2) | (((k16 >> 3) & 1) << 1) | (k16 & 1);
}

// Row `key` of K (or V) of this (batch, kv head): the cached prefix, then the current keys.
__device__ __forceinline__ const bf16* a8_key_row(const bf16* prefix, int64_t prefix_batch_stride,
                                                  int prefix_row_stride, int prefix_len, const bf16* current,
                                                  int64_t kv_batch_stride, int kv_row_stride, int batch, int kv_head,
                                                  int key) {
    if (key < prefix_len)
        return prefix + batch * prefix_batch_stride + static_cast<int64_t>(key) * prefix_row_stride + kv_head * 128;
    return current + batch * kv_batch_stride + static_cast<int64_t>(key - prefix_len) * kv_row_stride +
           kv_head * 128;
}

__device__ __forceinline__ int8_t to_int8(float x, float inv) {
    const int r = __float2int_rn(x * inv);
    return static_cast<int8_t>(max(-127, min(127, r)));
}

}  // namespace

#define A8_KV_ARGS                                                                                               \
    const bf16 *__restrict__ k_prefix, const bf16 *__restrict__ v_prefix, int64_t prefix_batch_stride,           \
        int prefix_row_stride, int prefix_len, const bf16 *__restrict__ k, const bf16 *__restrict__ v,          \
        int64_t kv_batch_stride, int kv_row_stride, int num_keys, int num_kv_heads, int key_tiles
#define A8_ROW(base, pbase, key)                                                                                 \
    a8_key_row(pbase, prefix_batch_stride, prefix_row_stride, prefix_len, base, kv_batch_stride, kv_row_stride,  \
               batch, kv_head, key)

// Grid (key_tiles, num_kv_heads, batch), block 128: thread c sums channel c of K and takes the amax of channel c of
// V over the block's keys, in key order. partial[((batch * num_kv_heads + kv_head) * key_tiles + tile) * 256 + c]:
// the sum; + 128: the amax.
extern "C" __global__ void __launch_bounds__(128) nn_attention_8bit_kv_stats(A8_KV_ARGS, float* __restrict__ partial) {
    const int tile = blockIdx.x;
    const int kv_head = blockIdx.y;
    const int batch = blockIdx.z;
    const int c = threadIdx.x;
    float sum = 0.0f;
    float amax = 0.0f;
    const int end = min(num_keys, (tile + 1) * kA8Keys);
    for (int key = tile * kA8Keys; key < end; ++key) {
        sum += __bfloat162float(A8_ROW(k, k_prefix, key)[c]);
        amax = fmaxf(amax, fabsf(__bfloat162float(A8_ROW(v, v_prefix, key)[c])));
    }
    float* out = partial + ((static_cast<int64_t>(batch) * num_kv_heads + kv_head) * key_tiles + tile) * 256;
    out[c] = sum;
    out[128 + c] = amax;
}

// Grid (num_kv_heads, batch), block 128: for channel c = threadIdx.x, K's mean (the block sums added in block order,
// divided by num_keys), V's scale (amax / 448) and its inverse (448 / amax; both 1 for an all-zero channel), in
// params[(batch * num_kv_heads + kv_head) * 384 + {0, 128, 256} + c].
extern "C" __global__ void __launch_bounds__(128)
    nn_attention_8bit_kv_finalize(const float* __restrict__ partial, int num_keys, int num_kv_heads, int key_tiles,
                                  float* __restrict__ params) {
    const int kv_head = blockIdx.x;
    const int batch = blockIdx.y;
    const int c = threadIdx.x;
    const int64_t bh = static_cast<int64_t>(batch) * num_kv_heads + kv_head;
    const float* in = partial + bh * key_tiles * 256;
    float sum = 0.0f;
    float amax = 0.0f;
    for (int t = 0; t < key_tiles; ++t) {
        sum += in[t * 256 + c];
        amax = fmaxf(amax, in[t * 256 + 128 + c]);
    }
    float* out = params + bh * 384;
    out[c] = sum / static_cast<float>(num_keys);
    out[128 + c] = amax > 0.0f ? amax / 448.0f : 1.0f;
    out[256 + c] = amax > 0.0f ? 448.0f / amax : 1.0f;
}

// Grid (key_tiles, num_kv_heads, batch), block 256: the block's 128 keys. Thread i holds channels 8 (i & 15) ..
// + 7 of keys (i >> 4) + 16 j, j < 8. K: k - mean, one scale for the block (amax / 127, 1 when all zero), codes
// round(x * (127 / amax)) clamped to +-127. V: codes e4m3(v * inverse scale) per channel (see kv_finalize),
// transposed through shared memory. Keys past num_keys are zero.
extern "C" __global__ void __launch_bounds__(256)
    nn_attention_8bit_quantize_kv(A8_KV_ARGS, const float* __restrict__ params, int8_t* __restrict__ k8, float* __restrict__ k_scale, uint8_t* __restrict__ v8) {
    __shared__ __align__(16) uint8_t vt[kA8TileBytes];
    __shared__ float warp_amax[8];
    const int tile = blockIdx.x;
    const int kv_head = blockIdx.y;
    const int batch = blockIdx.z;
    const int tid = threadIdx.x;
    const int chunk = tid & 15;
    const int64_t bh = static_cast<int64_t>(batch) * num_kv_heads + kv_head;
    float m[8], inv_v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        m[i] = params[bh * 384 + chunk * 8 + i];
        inv_v[i] = params[bh * 384 + 256 + chunk * 8 + i];
    }
    float kx[8][8];
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int r = (tid >> 4) + 16 * j;
        const int key = tile * kA8Keys + r;
        float kv[8], vv[8];
        if (key < num_keys) {
            nn::load8(A8_ROW(k, k_prefix, key) + chunk * 8, kv);
            nn::load8(A8_ROW(v, v_prefix, key) + chunk * 8, vv);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                kx[j][i] = kv[i] - m[i];
                amax = fmaxf(amax, fabsf(kx[j][i]));
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) kx[j][i] = vv[i] = 0.0f;
        }
        const int pos = a8_key_position(r);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const __nv_fp8_storage_t code = __nv_cvt_float_to_fp8(vv[i] * inv_v[i], __NV_SATFINITE, __NV_E4M3);
            vt[a8_swizzle(chunk * 8 + i, pos)] = code;
        }
    }
    amax = nn::warp_max(amax);
    if ((tid & 31) == 0) warp_amax[tid >> 5] = amax;
    __syncthreads();
    amax = 0.0f;
#pragma unroll
    for (int w = 0; w < 8; ++w) amax = fmaxf(amax, warp_amax[w]);
    const float inv = amax > 0.0f ? 127.0f / amax : 1.0f;
    const int64_t tile_index = bh * key_tiles + tile;
    if (tid == 0) k_scale[tile_index] = amax > 0.0f ? amax / 127.0f : 1.0f;
    int8_t* k_tile = k8 + tile_index * kA8TileBytes;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int r = (tid >> 4) + 16 * j;
        uint32_t lo = 0, hi = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            lo |= static_cast<uint32_t>(static_cast<uint8_t>(to_int8(kx[j][i], inv))) << (8 * i);
            hi |= static_cast<uint32_t>(static_cast<uint8_t>(to_int8(kx[j][4 + i], inv))) << (8 * i);
        }
        *reinterpret_cast<uint2*>(k_tile + a8_swizzle(r, chunk * 8)) = make_uint2(lo, hi);
    }
    // V^T: the shared tile is already in its final (swizzled, permuted) layout; copy it out 16 bytes a thread.
    uint8_t* v_tile = v8 + tile_index * kA8TileBytes;
#pragma unroll
    for (int i = 0; i < kA8TileBytes / (256 * 16); ++i) {
        const int off = (tid + i * 256) * 16;
        *reinterpret_cast<uint4*>(v_tile + off) = *reinterpret_cast<const uint4*>(vt + off);
    }
}

// Grid (query_tiles * 16, num_heads, batch), block 256: warp w quantizes query row blockIdx.x * 8 + w of one head,
// four channels a lane. Scale amax / 127 (1 when all zero), codes round(x * (127 / amax)) clamped to +-127; the
// stored scale is multiplied by scale_log2 (softmax scale * log2 e). Rows past num_queries are zero.
extern "C" __global__ void __launch_bounds__(256)
    nn_attention_8bit_quantize_q(const bf16* __restrict__ q, int64_t q_batch_stride, int q_row_stride,
                                 int num_queries, int num_heads, int query_tiles, float scale_log2,
                                 int8_t* __restrict__ q8, float* __restrict__ q_scale) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (row < num_queries) {
        const bf16* src = q + batch * q_batch_stride + static_cast<int64_t>(row) * q_row_stride + head * 128 + lane * 4;
        const uint2 raw = *reinterpret_cast<const uint2*>(src);
        const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
        const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
        x[0] = a.x;
        x[1] = a.y;
        x[2] = b.x;
        x[3] = b.y;
    }
    float amax = fmaxf(fmaxf(fabsf(x[0]), fabsf(x[1])), fmaxf(fabsf(x[2]), fabsf(x[3])));
    amax = nn::warp_max(amax);
    const float inv = amax > 0.0f ? 127.0f / amax : 1.0f;
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) packed |= static_cast<uint32_t>(static_cast<uint8_t>(to_int8(x[i], inv))) << (8 * i);
    const int64_t bh = static_cast<int64_t>(batch) * num_heads + head;
    const int tile = row / kA8Rows;
    const int r = row % kA8Rows;
    int8_t* dst = q8 + (bh * query_tiles + tile) * kA8TileBytes + a8_swizzle(r, lane * 4);
    *reinterpret_cast<uint32_t*>(dst) = packed;
    if (lane == 0) q_scale[bh * query_tiles * kA8Rows + row] = (amax > 0.0f ? amax / 127.0f : 1.0f) * scale_log2;
}

#if defined(NN_HAS_WGMMA)
namespace {

#define A8_ACC64(T)                                                                                              \
    T(d[0]), T(d[1]), T(d[2]), T(d[3]), T(d[4]), T(d[5]), T(d[6]), T(d[7]), T(d[8]), T(d[9]), T(d[10]), T(d[11]), \
        T(d[12]), T(d[13]), T(d[14]), T(d[15]), T(d[16]), T(d[17]), T(d[18]), T(d[19]), T(d[20]), T(d[21]),        \
        T(d[22]), T(d[23]), T(d[24]), T(d[25]), T(d[26]), T(d[27]), T(d[28]), T(d[29]), T(d[30]), T(d[31]),        \
        T(d[32]), T(d[33]), T(d[34]), T(d[35]), T(d[36]), T(d[37]), T(d[38]), T(d[39]), T(d[40]), T(d[41]),        \
        T(d[42]), T(d[43]), T(d[44]), T(d[45]), T(d[46]), T(d[47]), T(d[48]), T(d[49]), T(d[50]), T(d[51]),        \
        T(d[52]), T(d[53]), T(d[54]), T(d[55]), T(d[56]), T(d[57]), T(d[58]), T(d[59]), T(d[60]), T(d[61]),        \
        T(d[62]), T(d[63])
#define A8_INT(x) "+r"(x)
#define A8_FLT(x) "+f"(x)
#define A8_REGS64                                                                                                \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "  \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "   \
    "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// d (+)= A * B for one m64n128k32 step, INT8 operands from shared memory (K-major descriptors), int32 sums.
__device__ __forceinline__ void wgmma_s8_m64n128k32(int32_t (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                    int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 " A8_REGS64 ", %64, %65, p;\n}\n"
                 : A8_ACC64(A8_INT)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// d += A * B for one m64n128k32 step: A (e4m3, four bytes a register) from registers, B (e4m3) from shared memory
// through a K-major descriptor, f32 accumulators.
__device__ __forceinline__ void wgmma_e4m3_m64n128k32_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " A8_REGS64
                 ", {%64, %65, %66, %67}, %68, 1, 1, 1;\n"
                 : A8_ACC64(A8_FLT)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

__device__ __forceinline__ void fence_int_accumulators(int32_t (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+r"(d[i])::"memory");
}
__device__ __forceinline__ void fence_fp8_fragment(uint32_t (&p)[4][4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(p[i][j])::"memory");
    }
}

// 1.5 * 2^23 and its bits.
constexpr float kIntBias = 12582912.0f;
constexpr int32_t kIntBiasBits = 0x4B400000;

// The exact f32 value of an int32 score sum |x| < 2^22 (here |S| <= 127^2 * 128 < 2^21) without a conversion
// instruction: the integer added to the bits of 1.5 * 2^23 lands in the mantissa of a float whose unit is 1, and
// subtracting 1.5 * 2^23 again is exact. IADD and FADD issue on the full-rate pipes; the conversion does not.
__device__ __forceinline__ float int_sum_to_float(int32_t x) {
    return __int_as_float(x + kIntBiasBits) - kIntBias;
}

// A masked score's integer, below every real sum (|S| < 2^21).
constexpr int32_t kMaskedScore = -(1 << 22);

__device__ __forceinline__ int quad_max_int(int v) {
    v = max(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return max(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
    return lo | (hi << 16);
}

// The CTA's masks for the consumers: window_min, pad_begin, pad_end, and each consumer thread's two row limits.
__shared__ int a8_masks[3];
__shared__ int2 a8_row_limits[256];

// One consumer warpgroup's rows: 64 queries, O in f32, the online softmax in log2 units (the Q scales carry the
// softmax scale and log2 e). Thread rows a and b are 8 apart, as in Sm90Rows.
struct A8Rows {
    float acc[64];
    float max_a, max_b, sum_a, sum_b;
    float qs_a, qs_b;
    // The masks live in shared memory (a8_masks, a8_row_limits), read only for the tiles that need them: with
    // them in registers, the scores, O and P in flight together exceed what ptxas gives the consumers.

    // S = Q K^T of one key tile: four k32 steps over the head dim.
    static __device__ __forceinline__ void issue_scores(int32_t (&s)[64], uint32_t q_rows, uint32_t k_tile) {
#pragma unroll
        for (int i = 0; i < 64; ++i) s[i] = 0;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma_s8_m64n128k32(s, smem_desc(q_rows + kk * 32, 16, 1024), smem_desc(k_tile + kk * 32, 16, 1024),
                                kk > 0 ? 1 : 0);
        wgmma_commit();
    }

    // O += P V^T of one key tile: four k32 steps over the keys (V^T's rows are the head-dim channels).
    __device__ __forceinline__ void issue_values(const uint32_t (&p)[4][4], uint32_t v_tile) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_e4m3_m64n128k32_rs(acc, p[kk], smem_desc(v_tile + kk * 32, 16, 1024));
        wgmma_commit();
    }

    // The softmax of the int32 scores of the tile at key0 (k_scale: the tile's K scale), in place: updates the
    // running maxima and sums and leaves P * 448 = 2^(s - max + log2 448) in sv as f32 bits. The maxima are taken on
    // the integers (the dequantizing factor is positive), and each score becomes its exponent in one IADD and one
    // FFMA: x + 1.5 * 2^23 (exact, see int_sum_to_float) times the factor, less 1.5 * 2^23 times the factor and the
    // base, folded into one constant per row (its rounding is ~1e-6 of the tile's largest exponent). O is not
    // touched: the previous tile's P V may still accumulate into it; returns the factors for rescale().
    __device__ __forceinline__ void softmax_tile(int32_t (&sv)[64], float k_scale, int key0, float& corr_a,
                                                 float& corr_b) {
        const float fa = qs_a * k_scale;
        const float fb = qs_b * k_scale;
        const bool full = tile_is_full(key0);
        if (!full) mask_int_scores(sv, key0);
        int tile_max_a = kMaskedScore, tile_max_b = kMaskedScore;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            tile_max_a = max(tile_max_a, max(sv[4 * j], sv[4 * j + 1]));
            tile_max_b = max(tile_max_b, max(sv[4 * j + 2], sv[4 * j + 3]));
        }
        tile_max_a = quad_max_int(tile_max_a);
        tile_max_b = quad_max_int(tile_max_b);
        const float new_max_a = fmaxf(max_a, tile_max_a == kMaskedScore ? kNegInf : int_sum_to_float(tile_max_a) * fa);
        const float new_max_b = fmaxf(max_b, tile_max_b == kMaskedScore ? kNegInf : int_sum_to_float(tile_max_b) * fb);
        // P = 2^(s - max) * 448 = 2^(s - (max - log2 448)).
        const float base_a = new_max_a == kNegInf ? 0.0f : new_max_a - kLog2Fp8Max;
        const float base_b = new_max_b == kNegInf ? 0.0f : new_max_b - kLog2Fp8Max;
        corr_a = new_max_a == max_a ? 1.0f : exp2_approx(max_a - new_max_a);
        corr_b = new_max_b == max_b ? 1.0f : exp2_approx(max_b - new_max_b);
        max_a = new_max_a;
        max_b = new_max_b;
        const float off_a = fmaf(-kIntBias, fa, -base_a);
        const float off_b = fmaf(-kIntBias, fb, -base_b);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float x = __int_as_float(sv[4 * j + e] + kIntBiasBits);
                sv[4 * j + e] = __float_as_int(exp2_approx(e < 2 ? fmaf(x, fa, off_a) : fmaf(x, fb, off_b)));
            }
        }
        if (!full) zero_masked(sv, key0);
        float tile_sum_a = 0.0f, tile_sum_b = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            tile_sum_a += __int_as_float(sv[4 * j]) + __int_as_float(sv[4 * j + 1]);
            tile_sum_b += __int_as_float(sv[4 * j + 2]) + __int_as_float(sv[4 * j + 3]);
        }
        sum_a = fmaf(sum_a, corr_a, tile_sum_a);
        sum_b = fmaf(sum_b, corr_b, tile_sum_b);
    }

    // Whether every key of the tile at key0 is seen by every row of the CTA (no masking needed).
    static __device__ __forceinline__ bool tile_is_full(int key0) {
        const volatile int* m = a8_masks;
        const int end = key0 + kA8Keys;
        return end <= m[0] && (end <= m[1] || key0 >= m[2]);
    }
    // Whether this thread's score e of column block j is seen by its row (the masks of mask_wgmma_scores).
    static __device__ __forceinline__ bool seen(int key0, int j, int e) {
        const volatile int* m = a8_masks;
        const int2 limits = a8_row_limits[threadIdx.x - 128];
        const int key = key0 + j * 8 + (threadIdx.x & 3) * 2 + (e & 1);
        const int limit = e < 2 ? limits.x : limits.y;
        return key < limit && (key < m[1] || key >= m[2]);
    }
    __device__ __forceinline__ void mask_int_scores(int32_t (&sv)[64], int key0) const {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (!seen(key0, j, e)) sv[4 * j + e] = kMaskedScore;
        }
    }
    __device__ __forceinline__ void zero_masked(int32_t (&sv)[64], int key0) const {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (!seen(key0, j, e)) sv[4 * j + e] = 0;
        }
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

    // Packs P (left in sv by softmax_tile) as e4m3 in the A-operand order of issue_values. Keys 32 kk .. 32 kk + 31:
    // column blocks 4 kk .. 4 kk + 3 of S; registers 0 and 2 take blocks 4 kk, 4 kk + 1 (rows a, b), registers 1
    // and 3 blocks 4 kk + 2, 4 kk + 3.
    static __device__ __forceinline__ void pack_probabilities(const int32_t (&sv)[64], uint32_t (&p)[4][4]) {
        auto s = [&](int i) { return __int_as_float(sv[i]); };
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const int j = 16 * kk;
            p[kk][0] = pack_e4m3x4(s(j), s(j + 1), s(j + 4), s(j + 5));
            p[kk][1] = pack_e4m3x4(s(j + 2), s(j + 3), s(j + 6), s(j + 7));
            p[kk][2] = pack_e4m3x4(s(j + 8), s(j + 9), s(j + 12), s(j + 13));
            p[kk][3] = pack_e4m3x4(s(j + 10), s(j + 11), s(j + 14), s(j + 15));
        }
    }
};

// The attention of one (query tile, head, batch): warpgroup 0 loads (one thread, bulk copies), warpgroups 1 and 2
// compute 64 query rows each, taking turns on the tensor cores as in attention_sm90_ws.
__device__ __forceinline__ void attention_8bit(const int8_t* __restrict__ q8, const float* __restrict__ q_scale,
                                               const int8_t* __restrict__ k8, const float* __restrict__ k_scale,
                                               const uint8_t* __restrict__ v8, const float* __restrict__ kv_params,
                                               bf16* __restrict__ o, int64_t o_batch_stride, int o_row_stride,
                                               int num_queries, int num_keys, int num_heads, int num_kv_heads,
                                               int query_tiles, int key_tiles, const int* __restrict__ key_limit,
                                               int64_t key_limit_batch_stride, const int* __restrict__ key_pad) {
    constexpr int kConsumerThreads = 256;
    __shared__ int window[2];
    __shared__ __align__(8) uint64_t barriers[4 * kA8Stages + 1];
    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int warpgroup = __shfl_sync(0xffffffffu, tid / 128, 0);
    const int q_tile = blockIdx.x;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int kv_head = head / (num_heads / num_kv_heads);
    const int q0 = q_tile * kA8Rows;
    const int64_t bh = static_cast<int64_t>(batch) * num_heads + head;
    const int64_t bkv = static_cast<int64_t>(batch) * num_kv_heads + kv_head;
    const uint32_t smem_q = sm90_smem_base();
    const uint32_t smem_k = smem_q + kA8QRegion;
    const uint32_t smem_v = smem_k + kA8Stages * kA8TileBytes;
    const uint32_t bar_base = static_cast<uint32_t>(__cvta_generic_to_shared(barriers));
    auto bar = [&](int kind, int tile) { return bar_base + 8u * (kind * kA8Stages + tile % kA8Stages); };
    const uint32_t q_bar = bar_base + 8u * (4 * kA8Stages);
    if (tid == 0) {
        mbar_init(q_bar, 1);
        for (int s = 0; s < kA8Stages; ++s) {
            mbar_init(bar(0, s), 1);
            mbar_init(bar(1, s), 1);
            mbar_init(bar(2, s), kConsumerThreads / 32);
            mbar_init(bar(3, s), kConsumerThreads / 32);
        }
    }
    const int warp_row0 = (warpgroup - 1) * 64 + (warp & 3) * 16;
    const int row_a = warpgroup == 0 ? num_queries : q0 + warp_row0 + (lane >> 2);
    const KeyWindows kw = key_windows(row_a, row_a + 8, batch, num_queries, num_keys, key_limit,
                                      key_limit_batch_stride, key_pad, window);
    __syncthreads();
    const int num_tiles = min((kw.window_max + kA8Keys - 1) / kA8Keys, key_tiles);
    auto parity = [](int tile) { return static_cast<uint32_t>((tile / kA8Stages) & 1); };

    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kWsProducerRegs));
        if (tid != 0 || num_tiles == 0) exit_thread();
        mbar_expect_bytes(q_bar, kA8TileBytes);
        bulk_copy(smem_q, q8 + (bh * query_tiles + q_tile) * kA8TileBytes, kA8TileBytes, q_bar);
        for (int tile = 0; tile < num_tiles; ++tile) {
            const uint32_t offset = (tile % kA8Stages) * kA8TileBytes;
            if (tile >= kA8Stages) {
                mbar_wait(bar(2, tile), parity(tile) ^ 1u);
                mbar_wait(bar(3, tile), parity(tile) ^ 1u);
            }
            const int64_t t = (bkv * key_tiles + tile) * kA8TileBytes;
            mbar_expect_bytes(bar(0, tile), kA8TileBytes);
            bulk_copy(smem_k + offset, k8 + t, kA8TileBytes, bar(0, tile));
            mbar_expect_bytes(bar(1, tile), kA8TileBytes);
            bulk_copy(smem_v + offset, v8 + t, kA8TileBytes, bar(1, tile));
        }
        exit_thread();
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kWsConsumerRegs));
    const int consumer = warpgroup - 1;
    const int my_turn = 1 + consumer;
    const int other_turn = 2 - consumer;
    A8Rows rows;
#pragma unroll
    for (int i = 0; i < 64; ++i) rows.acc[i] = 0.0f;
    rows.max_a = rows.max_b = kNegInf;
    rows.sum_a = rows.sum_b = 0.0f;
    a8_row_limits[tid - 128] = make_int2(kw.limit_a, kw.limit_b);
    if (tid == 128) {
        a8_masks[0] = kw.window_min;
        a8_masks[1] = kw.pad_begin;
        a8_masks[2] = kw.pad_end;
    }
    named_barrier_sync(3, kConsumerThreads);  // the masks are written before any consumer reads them
    const float* qs = q_scale + bh * query_tiles * kA8Rows + q0 + warp_row0 + (lane >> 2);
    rows.qs_a = qs[0];
    rows.qs_b = qs[8];
    const float* ks = k_scale + bkv * key_tiles;
    const uint32_t q_rows = smem_q + consumer * 64 * 128;
    // Issue points: tile 0's scores, then one per later tile, then the last tile's values (num_tiles + 1 in all).
    int point = 0;
    auto take_turn = [&]() { named_barrier_sync(my_turn, kConsumerThreads); };
    auto pass_turn = [&]() {
        if (!(consumer == 1 && point == num_tiles)) named_barrier_arrive(other_turn, kConsumerThreads);
        ++point;
    };
    auto release = [&](int kind, int tile) {
        if (lane == 0) mbar_arrive(bar(kind, tile));
    };
    auto k_tile = [&](int tile) { return smem_k + (tile % kA8Stages) * kA8TileBytes; };
    auto v_tile = [&](int tile) { return smem_v + (tile % kA8Stages) * kA8TileBytes; };
    if (consumer == 1 && num_tiles > 0) named_barrier_arrive(other_turn, kConsumerThreads);

    // A turn: S = Q K^T of this tile, then O += P V of the previous one, issued back to back. The softmax of this
    // tile runs while the previous tile's P V is still on the tensor cores (and while the other warpgroup issues
    // its turn); O is rescaled once that P V is done, then this tile's P is packed.
    uint32_t p[4][4];
    if (num_tiles > 0) {
        mbar_wait(q_bar, 0);
        mbar_wait(bar(0, 0), parity(0));
        const float kscale = ks[0];
        int32_t s[64];
        take_turn();
        A8Rows::issue_scores(s, q_rows, k_tile(0));
        pass_turn();
        wgmma_wait<0>();
        fence_int_accumulators(s);
        release(2, 0);
        float corr_a, corr_b;
        rows.softmax_tile(s, kscale, 0, corr_a, corr_b);  // O is zero: nothing to rescale
        A8Rows::pack_probabilities(s, p);
    }
    for (int tile = 1; tile < num_tiles; ++tile) {
        mbar_wait(bar(0, tile), parity(tile));
        mbar_wait(bar(1, tile - 1), parity(tile - 1));
        const float kscale = ks[tile];
        int32_t s[64];
        take_turn();
        A8Rows::issue_scores(s, q_rows, k_tile(tile));
        rows.issue_values(p, v_tile(tile - 1));
        pass_turn();
        wgmma_wait<1>();  // the scores (committed first) are done; P V may still run
        fence_int_accumulators(s);
        release(2, tile);
        float corr_a, corr_b;
        rows.softmax_tile(s, kscale, tile * kA8Keys, corr_a, corr_b);
        wgmma_wait<0>();
        fence_accumulators(rows.acc);
        fence_fp8_fragment(p);
        release(3, tile - 1);
        rows.rescale(corr_a, corr_b);
        A8Rows::pack_probabilities(s, p);
    }
    if (num_tiles > 0) {
        mbar_wait(bar(1, num_tiles - 1), parity(num_tiles - 1));
        take_turn();
        rows.issue_values(p, v_tile(num_tiles - 1));
        pass_turn();
        wgmma_wait<0>();
        fence_accumulators(rows.acc);
        fence_fp8_fragment(p);
        release(3, num_tiles - 1);
    }
    // Normalise with V's per-channel scale folded in: column 8 n + 2 quad + (e & 1).
    const float* vs = kv_params + bkv * 384 + 128 + 2 * (lane & 3);
    bf16* o_base = o + batch * o_batch_stride + head * kHeadDim;
    store_output_rows<kHeadDim>(
        [&](int n, int e) { return rows.acc[4 * n + e] * vs[8 * n + (e & 1)]; },
        [](int r, int c) { return sw128(r, c); }, rows.sum_a, rows.sum_b, smem_q, warp_row0, lane, q0, num_queries,
        o_base, o_row_stride);
}

}  // namespace
#endif  // NN_HAS_WGMMA

// Grid (query_tiles, num_heads, batch), block 384, dynamic shared memory kA8QRegion + 2 * kA8Stages * 16 KiB + 1 KiB
// (alignment) = 161 KiB.
extern "C" __global__ void __launch_bounds__(384, 1)
    nn_attention_8bit_d128(const int8_t* __restrict__ q8, const float* __restrict__ q_scale,
                           const int8_t* __restrict__ k8, const float* __restrict__ k_scale,
                           const uint8_t* __restrict__ v8, const float* __restrict__ kv_params, bf16* __restrict__ o,
                           int64_t o_batch_stride, int o_row_stride, int num_queries, int num_keys, int num_heads,
                           int num_kv_heads, int query_tiles, int key_tiles, const int* __restrict__ key_limit,
                           int64_t key_limit_batch_stride, const int* __restrict__ key_pad) {
#if defined(NN_HAS_WGMMA)
    attention_8bit(q8, q_scale, k8, k_scale, v8, kv_params, o, o_batch_stride, o_row_stride, num_queries, num_keys,
                   num_heads, num_kv_heads, query_tiles, key_tiles, key_limit, key_limit_batch_stride, key_pad);
#else
    __trap();
#endif
}
