// MiniMax H3 DiT kernels (kernel set minimax_h3_dit, symbols h3_*): the gated residual fused with the next
// RMSNorm and its adaLN modulation (per-row table rows from an index), the per-head QK RMSNorm with rotate-half RoPE
// over the first `rotated` channels (bf16 tables), the f32 linear layers of the modules the reference keeps in
// f32 (input projections, time embedder, output heads), with row gather and scatter, and the weight-only FP8
// linear layer of the adaLN projections over the few timestep rows.
//
// Storage is bf16 (activations, modulation tables) or f32 (the f32 modules), arithmetic f32. Reductions run in a
// fixed order (warp butterflies, then warp totals in ascending order; GEMM sums in ascending k), so results are
// bit-identical from run to run. No fast-math. Row offsets are computed in 64 bits (rows x columns exceeds 2^31 at
// long sequences). The row kernels need 16-byte aligned rows: pointers aligned to 16 bytes, row strides and column
// counts multiples of 8 elements.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "common/async_copy.cuh"
#include "common/codes8.cuh"
#include "common/common.cuh"

#define H3_ROW_THREADS 256
#define H3_ROW_CHUNKS 4

using nn::bf16;

namespace {

__device__ __forceinline__ float silu_f32(float x) { return x / (1.0f + expf(-x)); }

}  // namespace

// Gated residual, then RMSNorm with its weight and an optional adaLN modulation, for one row per block:
//   residual (y != null):  v = bf16(x[r] + g * y[r]), stored back into x; g = gate[gate_index[r]] (the gate table's
//                          row, already offset to the gate columns), or 1 when gate is null
//   no residual:           v = x[r]
//   n = v * rsqrt(sum(v^2) * inv_norm_cols + eps) * weight
//   modulated (mod != null): n = n * (1 + mod[m, scale_offset + c]) (+ mod[m, shift_offset + c] when shift_offset >= 0)
//                          with m = mod_index[r]
//   out[o] = bf16(n), o = out_index[r] when out_index is given (rows outside [0, out_rows) are not written), else r.
// `cols` is the padded row width (columns past the model's width hold zeros in x, y, weight and the tables);
// `inv_norm_cols` is 1 / the model's width, so the padding does not change the mean square. The statistics are those
// of the stored (bf16) v, so the fused kernel equals the residual followed by the norm. Table indices are clamped to
// their tables (the host checks them). Grid: `rows` blocks of H3_ROW_THREADS threads; cols <= 8192.
extern "C" __global__ void __launch_bounds__(H3_ROW_THREADS)
    h3_residual_norm(bf16* __restrict__ x, int x_stride, const bf16* __restrict__ y, int y_stride, int rows, int cols,
                     float inv_norm_cols, float eps, const bf16* __restrict__ weight, const bf16* __restrict__ gate,
                     int gate_stride, int gate_rows, const int* __restrict__ gate_index, const bf16* __restrict__ mod,
                     int mod_stride, int mod_rows, const int* __restrict__ mod_index, int scale_offset,
                     int shift_offset, bf16* __restrict__ out, int out_stride, const int* __restrict__ out_index,
                     int out_rows) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    bf16* x_row = x + static_cast<int64_t>(row) * x_stride;
    // Every load that does not depend on another is issued first (the table indices, x and y), so a block waits
    // on one memory latency before its arithmetic rather than on one per operand.
    const int gate_row = (y != nullptr && gate != nullptr) ? min(max(gate_index[row], 0), gate_rows - 1) : 0;
    const int mod_row = mod != nullptr ? min(max(mod_index[row], 0), mod_rows - 1) : 0;
    const int64_t o = out_index != nullptr ? static_cast<int64_t>(out_index[row]) : row;
    // The row is held as the bf16 values it is stored as (v is rounded to bf16 before the norm): half the
    // registers of f32, so more blocks share an SM and one block's reduction overlaps another's loads.
    nn::Bf16x8 v[H3_ROW_CHUNKS];
    nn::Bf16x8 yraw[H3_ROW_CHUNKS];
    const bf16* y_row = y != nullptr ? y + static_cast<int64_t>(row) * y_stride : nullptr;
#pragma unroll
    for (int c = 0; c < H3_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * H3_ROW_THREADS) * 8;
        if (col < cols) {
            v[c] = *reinterpret_cast<const nn::Bf16x8*>(x_row + col);
            if (y_row != nullptr) yraw[c] = *reinterpret_cast<const nn::Bf16x8*>(y_row + col);
        } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) v[c].pairs[i] = __floats2bfloat162_rn(0.0f, 0.0f);
        }
    }
    if (y_row != nullptr) {
        const bf16* g_row = gate != nullptr ? gate + static_cast<int64_t>(gate_row) * gate_stride : nullptr;
#pragma unroll
        for (int c = 0; c < H3_ROW_CHUNKS; ++c) {
            const int col = (threadIdx.x + c * H3_ROW_THREADS) * 8;
            if (col < cols) {
                float xv[8];
                nn::unpack8(v[c], xv);
                float yv[8];
                nn::unpack8(yraw[c], yv);
                float gv[8] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f};
                if (g_row != nullptr) nn::load8(g_row + col, gv);
#pragma unroll
                for (int i = 0; i < 8; ++i) xv[i] = xv[i] + gv[i] * yv[i];
                nn::store8(x_row + col, xv);
                v[c] = nn::pack8(xv);
            }
        }
    }
    float sq = 0.0f;
#pragma unroll
    for (int c = 0; c < H3_ROW_CHUNKS; ++c) {
        float vv[8];
        nn::unpack8(v[c], vv);
#pragma unroll
        for (int i = 0; i < 8; ++i) sq += vv[i] * vv[i];
    }
    const float rstd = rsqrtf(nn::block_sum(sq, scratch) * inv_norm_cols + eps);
    const bf16* m_row = mod != nullptr ? mod + static_cast<int64_t>(mod_row) * mod_stride : nullptr;
    if (out_index != nullptr && (o < 0 || o >= out_rows)) return;
    bf16* out_row = out + o * out_stride;
#pragma unroll
    for (int c = 0; c < H3_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * H3_ROW_THREADS) * 8;
        if (col < cols) {
            float vv[8];
            nn::unpack8(v[c], vv);
            float w[8];
            nn::load8(weight + col, w);
            float n[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) n[i] = vv[i] * rstd * w[i];
            if (m_row != nullptr) {
                float s[8];
                nn::load8(m_row + scale_offset + col, s);
#pragma unroll
                for (int i = 0; i < 8; ++i) n[i] *= 1.0f + s[i];
                if (shift_offset >= 0) {
                    float h[8];
                    nn::load8(m_row + shift_offset + col, h);
#pragma unroll
                    for (int i = 0; i < 8; ++i) n[i] += h[i];
                }
            }
            nn::store8(out_row + col, n);
        }
    }
}

// (row, q or k head) items one warp of h3_qk_norm_rope handles: each half-warp takes one item per slot, 16 lanes of
// 8 channels (16-byte accesses), and a warp issues the loads of all its slots (and their cos/sin entries) before its
// first reduction. Measured inside the H3 step (50 calls, H100): 8-byte accesses with four items a warp 9.78 ms, two
// slots 8.8 ms, four slots 10.6 ms (116 registers: two blocks an SM).
#define H3_QK_SLOTS 2
#define H3_QK_ITEMS_PER_WARP (2 * H3_QK_SLOTS)

// Per-head QK RMSNorm and rotate-half RoPE, in place on the q and k heads of a fused q|k|v GEMM output (heads query
// heads, then heads key heads, then heads value heads, 128 channels each; value heads are left as they are):
//   n = x * rsqrt(sum(x^2) * inv_norm_dim + eps) * weight     (q_weight for queries, k_weight for keys; f32)
//   for channel j < rotated / 2, with c = cos[r, j], s = sin[r, j] (bf16 tables, row stride table_stride):
//     out[j]              = bf16(n[j] * c + (-n[j + rotated/2]) * s)
//     out[j + rotated/2]  = bf16(n[j + rotated/2] * c + n[j] * s)
//   channels rotated .. 128 (and every channel when cos is null): out = bf16(n).
// Heads narrower than 128 are zero-padded to 128 (weights included); inv_norm_dim is 1 / the true head dim.
// Items (row, head) in row-major order; warp w of block b takes items (8 b + w) * H3_QK_ITEMS_PER_WARP + 2 k + h for
// slot k and half-warp h, lane l of a half holding channels 8 (l & 15) .. + 7. The sum of squares adds the lanes'
// partial sums by a 16-lane butterfly (fixed order). The rotation partner comes through a shuffle within the half
// when rotated / 2 is a multiple of 8 (the model's 48), through shared memory else.
// Grid: ceil(rows * 2 * heads / (8 * H3_QK_ITEMS_PER_WARP)) blocks of 256 threads.
// The body of h3_qk_norm_rope; SHUFFLE: the caller guarantees RoPE tables with rotated / 2 a multiple of 8,
// 16-byte table vectors (nn::table_vectors_aligned<8>) and rows * 2 * heads items within an int, so only the shuffle
// path is compiled, with 32-bit item arithmetic (the _shuffle entry point, in fewer registers: four blocks an SM
// rather than three).
template <bool SHUFFLE>
__device__ __forceinline__ void qk_norm_rope_body(bf16* __restrict__ qkv, int qkv_stride, int rows, int heads,
                                                  const bf16* __restrict__ q_weight, const bf16* __restrict__ k_weight,
                                                  float inv_norm_dim, float eps, const bf16* __restrict__ rope_cos,
                                                  const bf16* __restrict__ rope_sin, int table_stride, int rotated) {
    constexpr int K = H3_QK_SLOTS;
    // The shared-memory partners (other widths): one head per half-warp, reused slot after slot.
    __shared__ float staged[8][2][128];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int half_id = lane >> 4;
    const int l16 = lane & 15;
    const int dim = l16 * 8;
    const int qk_heads = 2 * heads;
    const int64_t items = static_cast<int64_t>(rows) * qk_heads;
    const int64_t first = (static_cast<int64_t>(blockIdx.x) * 8 + warp) * H3_QK_ITEMS_PER_WARP + half_id;
    const bool rope = SHUFFLE || (rope_cos != nullptr && rotated > 0);
    const int half = rotated / 2;
    const bool by_shuffle = SHUFFLE || (rope && nn::rotates_by_shuffle<8>(half));
    const bool vector_tables = SHUFFLE || (by_shuffle && nn::table_vectors_aligned<8>(rope_cos, table_stride) &&
                                           nn::table_vectors_aligned<8>(rope_sin, table_stride));
    const int off = half / 8;  // lanes per rotated half (shuffle path)
    const bool rotates = by_shuffle && l16 < 2 * off;
    const int slot = 8 * (l16 < off ? l16 : l16 - off);

    int row[K], head[K];
    bool live[K];
    uint4 raw[K];
    uint4 cos_raw[K], sin_raw[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int64_t item = first + 2 * k;
        live[k] = item < items;
        row[k] = 0;
        head[k] = 0;
        raw[k] = make_uint4(0, 0, 0, 0);
        if (live[k]) {
            if constexpr (SHUFFLE) {
                // The _shuffle entry point's items fit an int (its launcher checks), so 32-bit division.
                const int it = static_cast<int>(item);
                row[k] = it / qk_heads;
                head[k] = it - row[k] * qk_heads;
            } else {
                const int64_t r = item / qk_heads;
                row[k] = static_cast<int>(r);  // r < rows, an int
                head[k] = static_cast<int>(item - r * qk_heads);
            }
            raw[k] = *reinterpret_cast<const uint4*>(qkv + static_cast<int64_t>(row[k]) * qkv_stride + head[k] * 128 +
                                                     dim);
        }
    }
    if (vector_tables) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (live[k] && rotates) {
                const int64_t at = static_cast<int64_t>(row[k]) * table_stride + slot;
                cos_raw[k] = *reinterpret_cast<const uint4*>(rope_cos + at);
                sin_raw[k] = *reinterpret_cast<const uint4*>(rope_sin + at);
            }
        }
    }

#pragma unroll
    for (int k = 0; k < K; ++k) {
        float x[8];
        nn::unpack8(*reinterpret_cast<const nn::Bf16x8*>(&raw[k]), x);
        const uint4 wraw = *reinterpret_cast<const uint4*>((head[k] < heads ? q_weight : k_weight) + dim);
        float w[8];
        nn::unpack8(*reinterpret_cast<const nn::Bf16x8*>(&wraw), w);
        float sq = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) sq += x[i] * x[i];
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
        const float r = rsqrtf(sq * inv_norm_dim + eps);
        float n[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) n[i] = x[i] * r * w[i];
        float out[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = n[i];
        if (by_shuffle) {
            // Partner lane within the half: l + off for the first rotated half (negated), l - off for the second.
            const int src = (half_id << 4) + (l16 < off ? l16 + off : (l16 < 2 * off ? l16 - off : l16));
            float partner[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float p = __shfl_sync(0xffffffffu, n[i], src);
                partner[i] = l16 < off ? -p : p;
            }
            if (rotates && live[k]) {  // the table registers hold entries for live items only
                float c[8], s[8];
                if (vector_tables) {
                    nn::unpack8(*reinterpret_cast<const nn::Bf16x8*>(&cos_raw[k]), c);
                    nn::unpack8(*reinterpret_cast<const nn::Bf16x8*>(&sin_raw[k]), s);
                } else {
                    const int64_t at = static_cast<int64_t>(row[k]) * table_stride + slot;
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        c[i] = __bfloat162float(rope_cos[at + i]);
                        s[i] = __bfloat162float(rope_sin[at + i]);
                    }
                }
#pragma unroll
                for (int i = 0; i < 8; ++i) out[i] = n[i] * c[i] + partner[i] * s[i];
            }
        } else if (!SHUFFLE && rope) {
            __syncwarp();  // the previous slot's partners are read
#pragma unroll
            for (int i = 0; i < 8; ++i) staged[warp][half_id][dim + i] = n[i];
            __syncwarp();
            const int64_t table_row = static_cast<int64_t>(row[k]) * table_stride;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int ch = dim + i;
                if (ch < rotated) {
                    const bool first_half = ch < half;
                    const int t = first_half ? ch : ch - half;
                    const float partner =
                        first_half ? -staged[warp][half_id][ch + half] : staged[warp][half_id][ch - half];
                    const float c = __bfloat162float(rope_cos[table_row + t]);
                    const float s = __bfloat162float(rope_sin[table_row + t]);
                    out[i] = n[i] * c + partner * s;
                }
            }
        }
        if (live[k]) {
            nn::store8(qkv + static_cast<int64_t>(row[k]) * qkv_stride + head[k] * 128 + dim, out);
        }
    }
}

#define H3_QK_NORM_ROPE_ARGS                                                                                     \
    bf16 *__restrict__ qkv, int qkv_stride, int rows, int heads, const bf16 *__restrict__ q_weight,             \
        const bf16 *__restrict__ k_weight, float inv_norm_dim, float eps, const bf16 *__restrict__ rope_cos,     \
        const bf16 *__restrict__ rope_sin, int table_stride, int rotated
#define H3_QK_NORM_ROPE_PASS \
    qkv, qkv_stride, rows, heads, q_weight, k_weight, inv_norm_dim, eps, rope_cos, rope_sin, table_stride, rotated

extern "C" __global__ void __launch_bounds__(256) h3_qk_norm_rope(H3_QK_NORM_ROPE_ARGS) {
    qk_norm_rope_body<false>(H3_QK_NORM_ROPE_PASS);
}

// h3_qk_norm_rope where RoPE rotates by shuffles from 16-byte table vectors (MiniMax H3's 48-channel halves): the
// same results, four blocks an SM.
extern "C" __global__ void __launch_bounds__(256, 4) h3_qk_norm_rope_shuffle(H3_QK_NORM_ROPE_ARGS) {
    qk_norm_rope_body<true>(H3_QK_NORM_ROPE_PASS);
}

namespace {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_out(bf16* p, float v) { *p = __float2bfloat16_rn(v); }

// Row `r` of the operand: row index[r] when an index is given (a row outside [0, limit) reads as absent), else r.
__device__ __forceinline__ int64_t indexed_row(const int* __restrict__ index, int r, int limit) {
    if (index == nullptr) return r;
    const int v = index[r];
    return (v < 0 || v >= limit) ? -1 : v;
}

constexpr int kTileM = 64;
constexpr int kTileN = 64;
constexpr int kTileK = 16;

// y[yr(r), c] = act(sum_k x[xr(r), k] * w[c, k] + bias[c]) in f32 (k ascending, one FMA chain per output), for
// r < m, c < n; w is [n, k] f32 row-major, x rows of x_stride elements (f32 or bf16), y rows of y_stride (f32 or
// bf16). xr / yr gather and scatter rows through x_index / y_index (null: the identity); an x row out of range reads
// as zeros, a y row out of range is not written. act 1: SiLU.
// 64x64 output tiles, 16-deep k steps through shared memory, 256 threads of 4x4 outputs each.
// Grid: (ceil(n / 64), ceil(m / 64)).
template <typename XT, typename YT>
__device__ __forceinline__ void linear_f32_tile(const XT* __restrict__ x, int x_stride, const int* __restrict__ x_index,
                                                int x_rows, const float* __restrict__ w, int k,
                                                const float* __restrict__ bias, YT* __restrict__ y, int y_stride,
                                                const int* __restrict__ y_index, int y_rows, int m, int n, int act) {
    __shared__ __align__(16) float xs[kTileK][kTileM + 4];
    __shared__ __align__(16) float ws[kTileK][kTileN + 4];
    const int tid = threadIdx.x;
    const int tx = tid & 15;
    const int ty = tid >> 4;
    const int m0 = blockIdx.y * kTileM;
    const int n0 = blockIdx.x * kTileN;
    // This thread loads column kk = tx of rows ty, ty + 16, ty + 32, ty + 48 of both tiles.
    int64_t x_off[4];
    int64_t w_off[4];
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const int r = m0 + ty + 16 * l;
        const int64_t src = r < m ? indexed_row(x_index, r, x_rows) : -1;
        x_off[l] = src < 0 ? -1 : src * x_stride;
        const int c = n0 + ty + 16 * l;
        w_off[l] = c < n ? static_cast<int64_t>(c) * k : -1;
    }
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    }
    for (int k0 = 0; k0 < k; k0 += kTileK) {
        const int kk = k0 + tx;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            xs[tx][ty + 16 * l] = (x_off[l] >= 0 && kk < k) ? to_f32(x[x_off[l] + kk]) : 0.0f;
            ws[tx][ty + 16 * l] = (w_off[l] >= 0 && kk < k) ? w[w_off[l] + kk] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int q = 0; q < kTileK; ++q) {
            const float4 a = *reinterpret_cast<const float4*>(&xs[q][ty * 4]);
            const float4 b = *reinterpret_cast<const float4*>(&ws[q][tx * 4]);
            const float av[4] = {a.x, a.y, a.z, a.w};
            const float bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = m0 + ty * 4 + i;
        if (r >= m) continue;
        const int64_t dst = indexed_row(y_index, r, y_rows);
        if (dst < 0) continue;
        YT* y_row = y + dst * y_stride;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int c = n0 + tx * 4 + j;
            if (c < n) {
                float v = acc[i][j] + (bias != nullptr ? bias[c] : 0.0f);
                if (act == 1) v = silu_f32(v);
                store_out(y_row + c, v);
            }
        }
    }
}

// The same layer for a few rows (the timestep rows): one warp per output column c and 4 rows, lanes striding k,
// per-row sums combined by a warp butterfly. Grid: (ceil(n / 8), ceil(m / 4)), 256 threads.
template <typename XT, typename YT>
__device__ __forceinline__ void linear_f32_rows(const XT* __restrict__ x, int x_stride, const int* __restrict__ x_index,
                                                int x_rows, const float* __restrict__ w, int k,
                                                const float* __restrict__ bias, YT* __restrict__ y, int y_stride,
                                                const int* __restrict__ y_index, int y_rows, int m, int n, int act) {
    const int lane = threadIdx.x & 31;
    const int c = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (c >= n) return;
    const int r0 = blockIdx.y * 4;
    int64_t x_off[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = r0 + i;
        const int64_t src = r < m ? indexed_row(x_index, r, x_rows) : -1;
        x_off[i] = src < 0 ? -1 : src * x_stride;
    }
    const float* w_row = w + static_cast<int64_t>(c) * k;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int kk = lane; kk < k; kk += 32) {
        const float wv = w_row[kk];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (x_off[i] >= 0) acc[i] = fmaf(to_f32(x[x_off[i] + kk]), wv, acc[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = nn::warp_sum(acc[i]);
    if (lane != 0) return;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = r0 + i;
        if (r >= m) continue;
        const int64_t dst = indexed_row(y_index, r, y_rows);
        if (dst < 0) continue;
        float v = acc[i] + (bias != nullptr ? bias[c] : 0.0f);
        if (act == 1) v = silu_f32(v);
        store_out(y + dst * y_stride + c, v);
    }
}

}  // namespace

// f32 linear layers: `tile` for many rows, `rows` for a few; x in f32 (xf) or bf16 (xb), y in f32 (yf) or bf16 (yb);
// the step uses f32 -> f32 (time embedder), f32 -> bf16 (input projections, SiLU(temb)) and bf16 -> f32 (heads).
// Arguments: (x, x_stride, x_index, x_rows, w, k, bias, y, y_stride, y_index, y_rows, m, n, act); see
// linear_f32_tile.
#define H3_LINEAR_F32(NAME, BODY, XT, YT, THREADS)                                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                            \
        NAME(const XT* __restrict__ x, int x_stride, const int* __restrict__ x_index, int x_rows,                    \
             const float* __restrict__ w, int k, const float* __restrict__ bias, YT* __restrict__ y, int y_stride,  \
             const int* __restrict__ y_index, int y_rows, int m, int n, int act) {                                   \
        BODY<XT, YT>(x, x_stride, x_index, x_rows, w, k, bias, y, y_stride, y_index, y_rows, m, n, act);           \
    }

H3_LINEAR_F32(h3_linear_f32_tile_xf_yf, linear_f32_tile, float, float, 256)
H3_LINEAR_F32(h3_linear_f32_tile_xf_yb, linear_f32_tile, float, bf16, 256)
H3_LINEAR_F32(h3_linear_f32_tile_xb_yf, linear_f32_tile, bf16, float, 256)
H3_LINEAR_F32(h3_linear_f32_rows_xf_yf, linear_f32_rows, float, float, 256)
H3_LINEAR_F32(h3_linear_f32_rows_xf_yb, linear_f32_rows, float, bf16, 256)
H3_LINEAR_F32(h3_linear_f32_rows_xb_yf, linear_f32_rows, bf16, float, 256)

namespace {

// Rows of x one CTA takes, 4 at a time, and the weight chunks a lane holds in registers: a lane loads its 16-byte
// chunks of its warp's columns once, all before the first use (k <= 32 * 16 * H3_LINEAR_W8_CHUNKS), and
// reuses them for every row, so the weights cross HBM once per H3_LINEAR_W8_ROWS rows (a request's whole timestep
// schedule is ~100 rows) and each x row read from L1 serves the warp's columns.
#define H3_LINEAR_W8_ROWS 32
#define H3_LINEAR_W8_CHUNKS 6

// The 16-byte code chunks lane `lane` holds of the COLS columns from c0 (a missing last column repeats its
// neighbour, never stored): the chunks at (lane + 32 j) * 16 of each column.
template <int COLS>
__device__ __forceinline__ void load_w8_codes(uint4 (&raw)[COLS][H3_LINEAR_W8_CHUNKS], const uint8_t* __restrict__ w,
                                              int c0, int k, int n, int lane) {
#pragma unroll
    for (int col = 0; col < COLS; ++col) {
        const int c = min(c0 + col, n - 1);
        const uint8_t* w_row = w + static_cast<int64_t>(c) * k;
#pragma unroll
        for (int j = 0; j < H3_LINEAR_W8_CHUNKS; ++j) {
            const int k0 = (lane + 32 * j) * 16;
            raw[col][j] = k0 < k ? *reinterpret_cast<const uint4*>(w_row + k0) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// Where linear_w8_columns reads a warp's codes: codes(col, j) is lane `lane`'s chunk j of column col, the 16 codes at
// (lane + 32 j) * 16 (asked only for chunks inside k). RegisterCodes: the chunks load_w8_codes put in registers.
template <int COLS>
struct RegisterCodes {
    const uint4 (&raw)[COLS][H3_LINEAR_W8_CHUNKS];
    __device__ __forceinline__ uint4 operator()(int col, int j) const { return raw[col][j]; }
};

// SharedCodes: the rows of a ring stage in shared memory (column `first + col` of the stage's `cols`, a missing
// last column repeating its neighbour as load_w8_codes does), read where they are used.
struct SharedCodes {
    const uint8_t* stage;
    int k, first, cols, lane;
    __device__ __forceinline__ uint4 operator()(int col, int j) const {
        const int c = min(first + col, cols - 1);
        return *reinterpret_cast<const uint4*>(stage + c * k + (lane + 32 * j) * 16);
    }
};

// The outputs of the COLS columns from c0 over this CTA's rows, from the codes a warp holds: each column's sum is
// its lanes' partial sums in k order, then the warp butterfly, scaled once.
template <int COLS, void (*DECODE)(const uint4&, float (&)[16]), typename Codes>
__device__ __forceinline__ void linear_w8_columns(const Codes& codes,
                                                  const bf16* __restrict__ x, int x_stride,
                                                  const float* __restrict__ w_scale, int k,
                                                  const bf16* __restrict__ bias, bf16* __restrict__ y, int y_stride,
                                                  int m, int n, int c0, int lane) {
    const int r_end = min(m, (blockIdx.y + 1) * H3_LINEAR_W8_ROWS);
    for (int r0 = blockIdx.y * H3_LINEAR_W8_ROWS; r0 < r_end; r0 += 4) {
        float acc[COLS][4] = {};
#pragma unroll
        for (int j = 0; j < H3_LINEAR_W8_CHUNKS; ++j) {
            const int k0 = (lane + 32 * j) * 16;
            if (k0 >= k) break;
            float wv[COLS][16];
#pragma unroll
            for (int col = 0; col < COLS; ++col) DECODE(codes(col, j), wv[col]);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = r0 + i;
                if (r < r_end) {
                    const bf16* x_at = x + static_cast<int64_t>(r) * x_stride + k0;
                    float lo[8], hi[8];
                    nn::load8(x_at, lo);
                    nn::load8(x_at + 8, hi);
#pragma unroll
                    for (int col = 0; col < COLS; ++col) {
#pragma unroll
                        for (int q = 0; q < 8; ++q) acc[col][i] = fmaf(lo[q], wv[col][q], acc[col][i]);
#pragma unroll
                        for (int q = 0; q < 8; ++q) acc[col][i] = fmaf(hi[q], wv[col][8 + q], acc[col][i]);
                    }
                }
            }
        }
#pragma unroll
        for (int col = 0; col < COLS; ++col) {
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[col][i] = nn::warp_sum(acc[col][i]);
        }
        if (lane == 0) {
#pragma unroll
            for (int col = 0; col < COLS; ++col) {
                const int c = c0 + col;
                if (c >= n) continue;
                const float scale = w_scale[c];
                const float b = bias != nullptr ? __bfloat162float(bias[c]) : 0.0f;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = r0 + i;
                    if (r < r_end) y[static_cast<int64_t>(r) * y_stride + c] = __float2bfloat16_rn(fmaf(acc[col][i], scale, b));
                }
            }
        }
    }
}

// The body of the weight-only linear layers below; DECODE turns 16 codes into their values. One warp per COLS output
// columns (2: each x row read serves two columns, 232 registers, one CTA an SM; 1: half the weight registers, two
// CTAs an SM, so one CTA's loads overlap another's sums and stores), for TURNS column groups in turn: with more
// than one, a warp loads the next group's codes before it sums the current one, so its loads stay in flight
// through its sums. A CTA covers 8 COLS TURNS columns, turn t the 8 COLS from blockIdx.x * 8 COLS TURNS + t * 8 COLS.
// A column's sum is the same in every form.
template <int COLS, int TURNS, void (*DECODE)(const uint4&, float (&)[16])>
__device__ __forceinline__ void linear_w8_rows(const bf16* __restrict__ x, int x_stride, const uint8_t* __restrict__ w,
                                               const float* __restrict__ w_scale, int k, const bf16* __restrict__ bias,
                                               bf16* __restrict__ y, int y_stride, int m, int n) {
    const int lane = threadIdx.x & 31;
    const int c0 = (blockIdx.x * 8 * TURNS + (threadIdx.x >> 5)) * COLS;
    if (c0 >= n) return;
    if constexpr (TURNS == 1) {
        uint4 raw[COLS][H3_LINEAR_W8_CHUNKS];
        load_w8_codes<COLS>(raw, w, c0, k, n, lane);
        linear_w8_columns<COLS, DECODE>(RegisterCodes<COLS>{raw}, x, x_stride, w_scale, k, bias, y, y_stride, m, n, c0,
                                        lane);
    } else {
        // Turn t: the warp's column group 8 COLS columns after turn t - 1's; the codes of turn t + 1 load into the
        // other buffer before turn t's sums.
        uint4 raw[2][COLS][H3_LINEAR_W8_CHUNKS];
        load_w8_codes<COLS>(raw[0], w, c0, k, n, lane);
#pragma unroll
        for (int turn = 0; turn < TURNS; ++turn) {
            const int c = c0 + turn * 8 * COLS;
            if (c >= n) return;
            if (turn + 1 < TURNS && c + 8 * COLS < n) {
                load_w8_codes<COLS>(raw[(turn + 1) & 1], w, c + 8 * COLS, k, n, lane);
            }
            linear_w8_columns<COLS, DECODE>(RegisterCodes<COLS>{raw[turn & 1]}, x, x_stride, w_scale, k, bias, y, y_stride,
                                            m, n, c, lane);
        }
    }
}

// The ring form (sm_90): persistent CTAs, each over the column groups blockIdx.x, blockIdx.x + gridDim.x, ... of 16
// columns. Thread 0 streams each group's codes (16 rows of k bytes, contiguous in w) into a ring of
// H3_LINEAR_W8_STAGES shared-memory stages with one bulk copy, counted on the stage's mbarrier, so the copies of the
// next stages stay in flight while the warps sum the current one (a register form holds the codes of the group
// being summed and, in 1t4, of the next). Each warp sums its two columns exactly as the two-columns form does, reading the codes
// from the stage where that form reads its registers: the same codes, the same order, bit-equal outputs. Then the
// CTA synchronizes (the stage is free again) and thread 0 refills it with the group H3_LINEAR_W8_STAGES later.
#define H3_LINEAR_W8_STAGES 4
#define H3_LINEAR_W8_STAGE_BYTES (16 * 32 * 16 * H3_LINEAR_W8_CHUNKS)

// Thread 0 of a ring-form CTA: the codes of its group `i` (column group blockIdx.x + i * gridDim.x of 16, if the
// layer has it) into stage i % H3_LINEAR_W8_STAGES with one bulk copy, counted on the stage's mbarrier.
__device__ __forceinline__ void fill_w8_stage(uint32_t ring_base, uint32_t full_base, const uint8_t* __restrict__ w,
                                              int k, int n, int i) {
    const int g = blockIdx.x + i * gridDim.x;
    if (g >= (n + 15) / 16) return;
    const uint32_t bytes = static_cast<uint32_t>(min(16, n - g * 16)) * static_cast<uint32_t>(k);
    const int s = i % H3_LINEAR_W8_STAGES;
    mbar_expect_bytes(full_base + 8u * s, bytes);
    bulk_copy(ring_base + s * H3_LINEAR_W8_STAGE_BYTES, w + static_cast<int64_t>(g) * 16 * k, bytes,
              full_base + 8u * s);
}

template <void (*DECODE)(const uint4&, float (&)[16])>
__device__ __forceinline__ void linear_w8_rows_ring(const bf16* __restrict__ x, int x_stride,
                                                    const uint8_t* __restrict__ w,
                                                    const float* __restrict__ w_scale, int k,
                                                    const bf16* __restrict__ bias, bf16* __restrict__ y,
                                                    int y_stride, int m, int n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) uint8_t ring[];
    __shared__ __align__(8) uint64_t full[H3_LINEAR_W8_STAGES];
    const int lane = threadIdx.x & 31;
    const int local = (threadIdx.x >> 5) * 2;  // the warp's first column within a group
    const int groups = (n + 15) / 16;
    const uint32_t ring_base = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
    const uint32_t full_base = static_cast<uint32_t>(__cvta_generic_to_shared(full));
    if (threadIdx.x == 0) {
        for (int s = 0; s < H3_LINEAR_W8_STAGES; ++s) mbar_init(full_base + 8u * s, 1);
        mbar_fence_init();
        for (int i = 0; i < H3_LINEAR_W8_STAGES; ++i) fill_w8_stage(ring_base, full_base, w, k, n, i);
    }
    __syncthreads();
    for (int i = 0;; ++i) {
        const int g = blockIdx.x + i * gridDim.x;
        if (g >= groups) break;
        const int cols = min(16, n - g * 16);
        const int s = i % H3_LINEAR_W8_STAGES;
        mbar_wait(full_base + 8u * s, (i / H3_LINEAR_W8_STAGES) & 1);
        if (local < cols) {
            const SharedCodes codes{ring + s * H3_LINEAR_W8_STAGE_BYTES, k, local, cols, lane};
            linear_w8_columns<2, DECODE>(codes, x, x_stride, w_scale, k, bias, y, y_stride, m, n, g * 16 + local,
                                         lane);
        }
        __syncthreads();  // every warp has read the stage: refill it
        if (threadIdx.x == 0) fill_w8_stage(ring_base, full_base, w, k, n, i + H3_LINEAR_W8_STAGES);
    }
#else
    __trap();
#endif
}

}  // namespace

// Weight-only 8-bit linear layers for a few rows (the adaLN projections over the timestep rows):
//   y[r, c] = bf16(sum_k x[r, k] * value(w[c, k]) * scale[c] + bias[c])      for r < m, c < n
// x bf16 rows of x_stride; w 8-bit codes [n, k] (rows of k bytes, k a multiple of 16) with one f32 scale per row (per
// output channel, nn::fp8's rule): e4m3 (h3_linear_fp8w_rows) or INT8 (h3_linear_int8w_rows); bias (or null) and y
// bf16, y rows of y_stride. The sum is f32 over exact products (the bf16 x times the code's value), in lane-strided
// order then a warp butterfly, scaled once. One warp per 2 output columns (the _c1 kernels: 1; the _c1t4 kernels:
// 1, for 4 column groups in turn, the next group's codes loaded while the current one is summed) and up to
// H3_LINEAR_W8_ROWS (32) rows, 4 at a time; lane l holds the 16 codes at (l + 32 j) * 16 of each column, so
// k <= 32 * 16 * H3_LINEAR_W8_CHUNKS (3072). Grid: (ceil(n / 16), ceil(m / 32)) (_c1: ceil(n / 8); _c1t4:
// ceil(n / 32)), 256 threads.
#define H3_LINEAR_W8_KERNEL(NAME, COLS, TURNS, BOUNDS, DECODE)                                                   \
    extern "C" __global__ void __launch_bounds__ BOUNDS                                                             \
        NAME(const bf16* __restrict__ x, int x_stride, const uint8_t* __restrict__ w,                               \
             const float* __restrict__ w_scale, int k, const bf16* __restrict__ bias, bf16* __restrict__ y,          \
             int y_stride, int m, int n) {                                                                          \
        linear_w8_rows<COLS, TURNS, DECODE>(x, x_stride, w, w_scale, k, bias, y, y_stride, m, n);                   \
    }

H3_LINEAR_W8_KERNEL(h3_linear_fp8w_rows, 2, 1, (256), nn::decode16_e4m3)
H3_LINEAR_W8_KERNEL(h3_linear_int8w_rows, 2, 1, (256), nn::decode16_int8)
// One column a warp (16 columns a CTA become 8): the grid doubles; TF_LINEAR_W8_COLS=1 selects them.
H3_LINEAR_W8_KERNEL(h3_linear_fp8w_rows_c1, 1, 1, (256, 2), nn::decode16_e4m3)
H3_LINEAR_W8_KERNEL(h3_linear_int8w_rows_c1, 1, 1, (256, 2), nn::decode16_int8)
// One column a warp for 4 column groups in turn, the next group's codes in flight while the current one is summed
// (twice the _c1 kernels' code registers); TF_LINEAR_W8_COLS=1t4 selects them.
H3_LINEAR_W8_KERNEL(h3_linear_fp8w_rows_c1t4, 1, 4, (256, 1), nn::decode16_e4m3)
H3_LINEAR_W8_KERNEL(h3_linear_int8w_rows_c1t4, 1, 4, (256, 1), nn::decode16_int8)
// The ring form (sm_90): persistent CTAs, H3_LINEAR_W8_STAGES stages of H3_LINEAR_W8_STAGE_BYTES dynamic shared
// memory; grid (CTAs, ceil(m / 32)), 256 threads; TF_LINEAR_W8_COLS=ring selects them.
#define H3_LINEAR_W8_RING_KERNEL(NAME, DECODE)                                                                      \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                            \
        NAME(const bf16* __restrict__ x, int x_stride, const uint8_t* __restrict__ w,                               \
             const float* __restrict__ w_scale, int k, const bf16* __restrict__ bias, bf16* __restrict__ y,          \
             int y_stride, int m, int n) {                                                                          \
        linear_w8_rows_ring<DECODE>(x, x_stride, w, w_scale, k, bias, y, y_stride, m, n);                           \
    }

H3_LINEAR_W8_RING_KERNEL(h3_linear_fp8w_rows_ring, nn::decode16_e4m3)
H3_LINEAR_W8_RING_KERNEL(h3_linear_int8w_rows_ring, nn::decode16_int8)
