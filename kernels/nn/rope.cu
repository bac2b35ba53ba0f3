// Qwen3-VL text path (the Qwen-Image 2.1 text encoder): embedding gather, RMSNorm, per-head QK RMSNorm with
// rotate-half RoPE for grouped-query attention, and a seeded device-side weight fill for benchmarks.
//
// Storage is bf16, arithmetic f32. Rounding follows the reference model run in bf16 (transformers' Qwen3
// RMSNorm rounds the normalised row before the weight multiply; its RoPE multiplies bf16 tensors by bf16
// cos/sin tables and adds the bf16 products), so the GPU path tracks a bf16 run of the reference closely.
// Reductions run in a fixed order: results are bit-identical from run to run. No fast-math.
//
// Row kernels need 16-byte aligned rows: pointers aligned to 16 bytes, row strides and column counts
// multiples of 8 elements. qt_rms_norm holds a row in registers: cols <= QT_ROW_THREADS * 8 * QT_ROW_CHUNKS.
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"

#define QT_ROW_THREADS 256
#define QT_ROW_CHUNKS 4

using qi::bf16;

// Copies embedding rows: out[r, :] = table[ids[r], :] for r < rows. An id outside [0, vocab) writes a zero
// row (the host validates ids first; this only keeps a bad id from reading out of bounds).
// Grid: (rows, ceil(cols / 8 / QT_ROW_THREADS)).
extern "C" __global__ void __launch_bounds__(QT_ROW_THREADS)
    qt_embed_gather(const bf16* __restrict__ table, int vocab, int cols, const int* __restrict__ ids, int rows,
                    bf16* __restrict__ out, int out_stride) {
    const int row = blockIdx.x;
    const int col = (blockIdx.y * QT_ROW_THREADS + threadIdx.x) * 8;
    if (row >= rows || col >= cols) return;
    const int id = ids[row];
    qi::Bf16x8* dst = reinterpret_cast<qi::Bf16x8*>(out + static_cast<int64_t>(row) * out_stride + col);
    if (id < 0 || id >= vocab) {
        const float zeros[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        qi::store8(reinterpret_cast<bf16*>(dst), zeros);
        return;
    }
    *dst = *reinterpret_cast<const qi::Bf16x8*>(table + static_cast<int64_t>(id) * cols + col);
}

// Qwen3 RMSNorm: n = bf16(x * rsqrt(mean(x^2) + eps)); y = bf16(weight * n). Statistics in f32.
// Grid: `rows` blocks of QT_ROW_THREADS threads.
extern "C" __global__ void __launch_bounds__(QT_ROW_THREADS)
    qt_rms_norm(const bf16* __restrict__ x, int x_stride, bf16* __restrict__ y, int y_stride,
                const bf16* __restrict__ weight, int rows, int cols, float eps) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const bf16* in_row = x + static_cast<int64_t>(row) * x_stride;
    float v[QT_ROW_CHUNKS][8];
    float sq = 0.0f;
#pragma unroll
    for (int c = 0; c < QT_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * QT_ROW_THREADS) * 8;
        if (col < cols) {
            qi::load8(in_row + col, v[c]);
#pragma unroll
            for (int i = 0; i < 8; ++i) sq += v[c][i] * v[c][i];
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) v[c][i] = 0.0f;
        }
    }
    const float ms = qi::block_sum(sq, scratch) / static_cast<float>(cols);
    const float r = rsqrtf(ms + eps);
    bf16* out_row = y + static_cast<int64_t>(row) * y_stride;
#pragma unroll
    for (int c = 0; c < QT_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * QT_ROW_THREADS) * 8;
        if (col < cols) {
            float w[8];
            qi::load8(weight + col, w);
            float o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = w[i] * qi::round_bf16(v[c][i] * r);
            qi::store8(out_row + col, o);
        }
    }
}

// Per-head QK RMSNorm and rotate-half RoPE, in place on the q and k columns of a fused q|k|v GEMM output.
//
// qkv row r holds q_heads query heads, then kv_heads key heads, then kv_heads value heads, 128 channels each.
// For each of the q_heads + kv_heads q/k heads of a row:
//   n = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * weight)        (q_weight for queries, k_weight for keys)
//   for j < 64, with c = bf16(cos[r, j]), s = bf16(sin[r, j]):
//     out[j]      = bf16(bf16(n[j] * c)      + bf16(-n[j + 64] * s))
//     out[j + 64] = bf16(bf16(n[j + 64] * c) + bf16( n[j] * s))
// Value heads are left as they are. cos/sin: f32 [rows, 64] with row stride rope_stride.
// One warp per (row, head): lane l holds channels 4l .. 4l+3, its rotation partner is lane l ^ 16.
// Grid: ceil(rows * (q_heads + kv_heads) / 8) blocks of 256 threads.
extern "C" __global__ void __launch_bounds__(256)
    qt_qk_norm_rope_half(bf16* __restrict__ qkv, int qkv_stride, int rows, int q_heads, int kv_heads,
                         const bf16* __restrict__ q_weight, const bf16* __restrict__ k_weight, float eps,
                         const float* __restrict__ rope_cos, const float* __restrict__ rope_sin, int rope_stride) {
    const int lane = threadIdx.x & 31;
    const int heads = q_heads + kv_heads;
    const int64_t item = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
    if (item >= static_cast<int64_t>(rows) * heads) return;
    const int row = static_cast<int>(item / heads);
    const int head = static_cast<int>(item - static_cast<int64_t>(row) * heads);
    const int dim = lane * 4;
    bf16* at = qkv + static_cast<int64_t>(row) * qkv_stride + head * 128 + dim;
    const bf16* w = (head < q_heads ? q_weight : k_weight) + dim;

    const uint2 raw = *reinterpret_cast<const uint2*>(at);
    const float2 x01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 x23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    const uint2 wraw = *reinterpret_cast<const uint2*>(w);
    const float2 w01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wraw.x));
    const float2 w23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wraw.y));
    const float sq = qi::warp_sum(x01.x * x01.x + x01.y * x01.y + x23.x * x23.x + x23.y * x23.y);
    const float r = rsqrtf(sq * (1.0f / 128.0f) + eps);
    float n[4];
    n[0] = qi::round_bf16(qi::round_bf16(x01.x * r) * w01.x);
    n[1] = qi::round_bf16(qi::round_bf16(x01.y * r) * w01.y);
    n[2] = qi::round_bf16(qi::round_bf16(x23.x * r) * w23.x);
    n[3] = qi::round_bf16(qi::round_bf16(x23.y * r) * w23.y);
    float partner[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) partner[i] = __shfl_xor_sync(0xffffffffu, n[i], 16);

    // Channel dim + i rotates with frequency slot (dim + i) mod 64; the first half pairs with -partner.
    const bool first_half = lane < 16;
    const int slot = dim & 63;
    const float4 cs = *reinterpret_cast<const float4*>(rope_cos + static_cast<int64_t>(row) * rope_stride + slot);
    const float4 sn = *reinterpret_cast<const float4*>(rope_sin + static_cast<int64_t>(row) * rope_stride + slot);
    const float c[4] = {cs.x, cs.y, cs.z, cs.w};
    const float s[4] = {sn.x, sn.y, sn.z, sn.w};
    float o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float rotated = first_half ? -partner[i] : partner[i];
        o[i] = qi::round_bf16(n[i] * qi::round_bf16(c[i])) + qi::round_bf16(rotated * qi::round_bf16(s[i]));
    }
    const __nv_bfloat162 o01 = __floats2bfloat162_rn(o[0], o[1]);
    const __nv_bfloat162 o23 = __floats2bfloat162_rn(o[2], o[3]);
    uint2 packed;
    packed.x = *reinterpret_cast<const uint32_t*>(&o01);
    packed.y = *reinterpret_cast<const uint32_t*>(&o23);
    *reinterpret_cast<uint2*>(at) = packed;
}

namespace {

// SplitMix64: a full-period mix of a 64-bit counter.
__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

}  // namespace

// Seeded fill for benchmarks and tests: out[i] = bf16(offset + scale * u_i), u_i uniform in [-1, 1) from
// splitmix64(seed * 2^32 + i)'s top 24 bits. Deterministic for a given (seed, i) whatever the grid.
// Grid-stride over elements; any n.
extern "C" __global__ void __launch_bounds__(256)
    qt_fill_uniform(bf16* __restrict__ out, int64_t n, uint64_t seed, float offset, float scale) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const uint64_t bits = splitmix64((seed << 32) + static_cast<uint64_t>(i));
        const float u = static_cast<float>(bits >> 40) * (1.0f / 8388608.0f) - 1.0f;
        out[i] = __float2bfloat16_rn(offset + scale * u);
    }
}
