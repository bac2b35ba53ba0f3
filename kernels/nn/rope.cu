// QK RMSNorm + RoPE of a fused q|k|v GEMM output: interleaved pairs (the Qwen-Image DiT layout, out of place into
// the attention layout), rotate-half over the whole head (Qwen3 text), and rotate-half over a rotated width that
// may be smaller than the head dim (partial RoPE) with an optional RMSNorm. Kernel set nn_rope.
//
// Storage is bf16, arithmetic f32. Rounding follows the reference models run in bf16 (see each kernel).
// Reductions run in a fixed order: results are bit-identical from run to run. No fast-math.
#include <cuda_bf16.h>
#include <stdint.h>

#include "common/common.cuh"

#define NN_ROW_THREADS 256
#define NN_ROW_CHUNKS 4

using nn::bf16;

// Per-head QK RMSNorm and 3-axis interleaved RoPE, reading a fused q|k|v GEMM output and writing q, k, v in
// the attention layout ([rows, heads * 128], any row strides).
//
// qkv row r: q at columns [0, heads*128), k at [heads*128, 2*heads*128), v after. For q and k of head h:
//   n = bf16(x * rsqrt(mean(x^2) + eps)); n = bf16(n * weight)  (the reference model's rounding points)
//   pair p = (n[2p], n[2p+1]) rotated by the angle of (r, p): cos/sin tables [rows, 64] f32 with row stride
//   rope_stride; result rounded to bf16.
// v is copied unchanged. One warp per (row, head), 8 warps per block: grid ceil(rows * heads / 8), 256
// threads.
extern "C" __global__ void __launch_bounds__(256)
    nn_qk_norm_rope_interleaved(const bf16* __restrict__ qkv, int qkv_stride, int rows, int heads,
                    const bf16* __restrict__ q_weight, const bf16* __restrict__ k_weight, float eps,
                    const float* __restrict__ rope_cos, const float* __restrict__ rope_sin, int rope_stride,
                    bf16* __restrict__ q_out, int q_stride, bf16* __restrict__ k_out, int k_stride,
                    bf16* __restrict__ v_out, int v_stride) {
    const int lane = threadIdx.x & 31;
    const int64_t item = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
    if (item >= static_cast<int64_t>(rows) * heads) return;
    const int row = static_cast<int>(item / heads);
    const int head = static_cast<int>(item - static_cast<int64_t>(row) * heads);
    const int width = heads * 128;
    const int dim = lane * 4;  // this lane: channels dim .. dim+3 = pairs 2*lane, 2*lane+1
    const bf16* in_row = qkv + static_cast<int64_t>(row) * qkv_stride + head * 128 + dim;

    const float2 cs = *reinterpret_cast<const float2*>(rope_cos + static_cast<int64_t>(row) * rope_stride + 2 * lane);
    const float2 sn = *reinterpret_cast<const float2*>(rope_sin + static_cast<int64_t>(row) * rope_stride + 2 * lane);

#pragma unroll
    for (int which = 0; which < 2; ++which) {
        const bf16* src = in_row + which * width;
        const bf16* w = (which == 0 ? q_weight : k_weight) + dim;
        const uint2 raw = *reinterpret_cast<const uint2*>(src);
        const float2 x01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
        const float2 x23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
        const uint2 wraw = *reinterpret_cast<const uint2*>(w);
        const float2 w01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wraw.x));
        const float2 w23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wraw.y));
        const float sq = nn::warp_sum(x01.x * x01.x + x01.y * x01.y + x23.x * x23.x + x23.y * x23.y);
        const float r = rsqrtf(sq * (1.0f / 128.0f) + eps);
        const float n0 = nn::round_bf16(nn::round_bf16(x01.x * r) * w01.x);
        const float n1 = nn::round_bf16(nn::round_bf16(x01.y * r) * w01.y);
        const float n2 = nn::round_bf16(nn::round_bf16(x23.x * r) * w23.x);
        const float n3 = nn::round_bf16(nn::round_bf16(x23.y * r) * w23.y);
        // (a + ib)(cos + i sin) = (a cos - b sin) + i (a sin + b cos)
        const __nv_bfloat162 o01 = __floats2bfloat162_rn(n0 * cs.x - n1 * sn.x, n0 * sn.x + n1 * cs.x);
        const __nv_bfloat162 o23 = __floats2bfloat162_rn(n2 * cs.y - n3 * sn.y, n2 * sn.y + n3 * cs.y);
        uint2 packed;
        packed.x = *reinterpret_cast<const uint32_t*>(&o01);
        packed.y = *reinterpret_cast<const uint32_t*>(&o23);
        bf16* dst = which == 0 ? q_out + static_cast<int64_t>(row) * q_stride
                               : k_out + static_cast<int64_t>(row) * k_stride;
        *reinterpret_cast<uint2*>(dst + head * 128 + dim) = packed;
    }
    const uint2 vraw = *reinterpret_cast<const uint2*>(in_row + 2 * width);
    *reinterpret_cast<uint2*>(v_out + static_cast<int64_t>(row) * v_stride + head * 128 + dim) = vraw;
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
    nn_qk_norm_rope_half(bf16* __restrict__ qkv, int qkv_stride, int rows, int q_heads, int kv_heads,
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
    const float sq = nn::warp_sum(x01.x * x01.x + x01.y * x01.y + x23.x * x23.x + x23.y * x23.y);
    const float r = rsqrtf(sq * (1.0f / 128.0f) + eps);
    float n[4];
    n[0] = nn::round_bf16(nn::round_bf16(x01.x * r) * w01.x);
    n[1] = nn::round_bf16(nn::round_bf16(x01.y * r) * w01.y);
    n[2] = nn::round_bf16(nn::round_bf16(x23.x * r) * w23.x);
    n[3] = nn::round_bf16(nn::round_bf16(x23.y * r) * w23.y);
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
        o[i] = nn::round_bf16(n[i] * nn::round_bf16(c[i])) + nn::round_bf16(rotated * nn::round_bf16(s[i]));
    }
    const __nv_bfloat162 o01 = __floats2bfloat162_rn(o[0], o[1]);
    const __nv_bfloat162 o23 = __floats2bfloat162_rn(o[2], o[3]);
    uint2 packed;
    packed.x = *reinterpret_cast<const uint32_t*>(&o01);
    packed.y = *reinterpret_cast<const uint32_t*>(&o23);
    *reinterpret_cast<uint2*>(at) = packed;
}

namespace {

// E consecutive bf16 values moved as one load or store (the launcher checks 16-byte aligned rows).
template <int E>
struct Bf16Pack;
template <>
struct Bf16Pack<4> {
    using T = uint2;
};
template <>
struct Bf16Pack<2> {
    using T = uint32_t;
};

// (row, head) items one warp handles. All of a warp's loads are issued before its first reduction: with one
// 256-byte item per warp too few bytes were in flight to cover the memory latency (about 1.4 TB/s on the H200).
constexpr int ROPE_ITEMS_PER_WARP = 4;

// One warp per ROPE_ITEMS_PER_WARP consecutive (row, q or k head) items of a fused q|k|v row (q_heads query
// heads, then kv_heads key heads, then kv_heads value heads, D channels each); lane l holds channels
// E*l .. E*l + E - 1 (E = D / 32) of each item.
//   norm 0: n = x        norm 1: n = bf16(x * rsqrt(mean(x^2) + eps))        norm 2: n = bf16(bf16(...) * weight)
//   for j < R/2, with c = bf16(cos[r, j]), s = bf16(sin[r, j]) (T = float tables are rounded, bf16 ones are as is):
//     out[j]       = bf16(bf16(n[j] * c)       + bf16(-n[j + R/2] * s))
//     out[j + R/2] = bf16(bf16(n[j + R/2] * c) + bf16( n[j] * s))
//   channels R .. D pass through as n.
// With D = R = 128, f32 tables and norm 2 this is nn_qk_norm_rope_half's arithmetic.
template <int D, typename T>
__device__ __forceinline__ void rope_half_partial(bf16* __restrict__ qkv, int qkv_stride, int rows, int q_heads,
                                                  int kv_heads, const bf16* __restrict__ q_weight,
                                                  const bf16* __restrict__ k_weight, float eps, int norm,
                                                  const T* __restrict__ rope_cos, const T* __restrict__ rope_sin,
                                                  int rope_stride, int rotated) {
    constexpr int E = D / 32;
    constexpr int K = ROPE_ITEMS_PER_WARP;
    using Pack = typename Bf16Pack<E>::T;
    // One row of partners per item, so no item waits for another's readers (the shared-memory path only).
    __shared__ float staged[8][K][D];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int heads = q_heads + kv_heads;
    const int dim = lane * E;
    nn::WarpHeadItems<K, D, Pack> items;
    items.load(qkv, qkv_stride, rows, heads, dim);

    const int half = rotated / 2;
    // Partners by shuffle and vector table loads where the widths allow (every model's do); shared memory else.
    const bool by_shuffle = nn::rotates_by_shuffle<E>(half);
    const bool vector_tables = by_shuffle && nn::table_vectors_aligned<E>(rope_cos, rope_stride) &&
                               nn::table_vectors_aligned<E>(rope_sin, rope_stride);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        if (k >= items.count) break;  // the items past the end are the last ones
        const bf16* x = reinterpret_cast<const bf16*>(&items.raw[k]);
        float n[E];
#pragma unroll
        for (int i = 0; i < E; ++i) n[i] = __bfloat162float(x[i]);
        if (norm != 0) {
            float sq = 0.0f;
#pragma unroll
            for (int i = 0; i < E; ++i) sq += n[i] * n[i];
            const float r = rsqrtf(nn::warp_sum(sq) * (1.0f / D) + eps);
#pragma unroll
            for (int i = 0; i < E; ++i) n[i] = nn::round_bf16(n[i] * r);
            if (norm == 2) {  // the weights are null pointers for the other norms: never read them there
                const Pack wraw =
                    *reinterpret_cast<const Pack*>((items.head[k] < q_heads ? q_weight : k_weight) + dim);
                const bf16* w = reinterpret_cast<const bf16*>(&wraw);
#pragma unroll
                for (int i = 0; i < E; ++i) n[i] = nn::round_bf16(n[i] * __bfloat162float(w[i]));
            }
        }
        const int64_t table_row = static_cast<int64_t>(items.row[k]) * rope_stride;
        Pack out;
        bf16* o = reinterpret_cast<bf16*>(&out);
        if (by_shuffle) {
            float partner[E];
            nn::rotate_half_partners<E>(n, lane, half, partner);
            const int off = half / E;
            if (lane < 2 * off) {
                const int64_t slot = table_row + E * (lane < off ? lane : lane - off);
                const nn::TableEntries<E> c = nn::load_table<E>(rope_cos, slot, vector_tables);
                const nn::TableEntries<E> s = nn::load_table<E>(rope_sin, slot, vector_tables);
#pragma unroll
                for (int i = 0; i < E; ++i) {
                    const float v = nn::round_bf16(n[i] * nn::round_bf16(c.v[i])) +
                                    nn::round_bf16(partner[i] * nn::round_bf16(s.v[i]));
                    o[i] = __float2bfloat16_rn(v);
                }
            } else {
#pragma unroll
                for (int i = 0; i < E; ++i) o[i] = __float2bfloat16_rn(n[i]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < E; ++i) staged[warp][k][dim + i] = n[i];
            __syncwarp();
#pragma unroll
            for (int i = 0; i < E; ++i) {
                const int ch = dim + i;
                float v = n[i];
                if (ch < rotated) {
                    const bool first_half = ch < half;
                    const int slot = first_half ? ch : ch - half;
                    const float partner = first_half ? -staged[warp][k][ch + half] : staged[warp][k][ch - half];
                    const float c = nn::round_bf16(nn::table_entry(rope_cos, table_row + slot));
                    const float s = nn::round_bf16(nn::table_entry(rope_sin, table_row + slot));
                    v = nn::round_bf16(n[i] * c) + nn::round_bf16(partner * s);
                }
                o[i] = __float2bfloat16_rn(v);
            }
        }
        *reinterpret_cast<Pack*>(items.at(k)) = out;
    }
}

}  // namespace

// Per-head QK RMSNorm (none, plain, or affine) and rotate-half RoPE over the first `rotated` channels of each head
// (even, 2 <= rotated <= D), in place on the q and k heads of a fused q|k|v GEMM output; value heads are left as
// they are. cos/sin: [rows, rotated / 2] tables (f32 or bf16, row stride rope_stride). See rope_half_partial.
// Grid: ceil(rows * (q_heads + kv_heads) / (8 * ROPE_ITEMS_PER_WARP)) blocks of 256 threads.
#define NN_ROPE_HALF_PARTIAL(NAME, D, T)                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                         \
        NAME(bf16* __restrict__ qkv, int qkv_stride, int rows, int q_heads, int kv_heads,                     \
             const bf16* __restrict__ q_weight, const bf16* __restrict__ k_weight, float eps, int norm,        \
             const T* __restrict__ rope_cos, const T* __restrict__ rope_sin, int rope_stride, int rotated) {  \
        rope_half_partial<D, T>(qkv, qkv_stride, rows, q_heads, kv_heads, q_weight, k_weight, eps, norm,      \
                                rope_cos, rope_sin, rope_stride, rotated);                                    \
    }

NN_ROPE_HALF_PARTIAL(nn_rope_half_partial_d128_f32, 128, float)
NN_ROPE_HALF_PARTIAL(nn_rope_half_partial_d128_bf16, 128, bf16)
NN_ROPE_HALF_PARTIAL(nn_rope_half_partial_d64_f32, 64, float)
NN_ROPE_HALF_PARTIAL(nn_rope_half_partial_d64_bf16, 64, bf16)
