// Row norms: the affine RMSNorm of Qwen3-style text models (rounded before the weight, as transformers does) and
// LayerNorm / RMSNorm, affine or not, optionally modulated by (1 + scale) and a shift. Kernel set nn_norm.
//
// Storage is bf16, arithmetic f32. Reductions run in a fixed order (warp butterflies, then warp totals in
// ascending order), so results are bit-identical from run to run. No fast-math. Row kernels need 16-byte aligned
// rows: pointers aligned to 16 bytes, row strides and column counts multiples of 8 elements.
// Row-normalising kernels run one block of NN_ROW_THREADS threads per row and hold the row in registers, so
// cols <= NN_ROW_THREADS * 8 * NN_ROW_CHUNKS (8192).
#include <cuda_bf16.h>
#include <stdint.h>

#include "common/common.cuh"

#define NN_ROW_THREADS 256
#define NN_ROW_CHUNKS 4

using nn::bf16;

// Qwen3 RMSNorm: n = bf16(x * rsqrt(mean(x^2) + eps)); y = bf16(weight * n). Statistics in f32.
// Grid: `rows` blocks of NN_ROW_THREADS threads.
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_rms_norm(const bf16* __restrict__ x, int x_stride, bf16* __restrict__ y, int y_stride,
                const bf16* __restrict__ weight, int rows, int cols, float eps) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const bf16* in_row = x + static_cast<int64_t>(row) * x_stride;
    float v[NN_ROW_CHUNKS][8];
    float sq = 0.0f;
#pragma unroll
    for (int c = 0; c < NN_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * NN_ROW_THREADS) * 8;
        if (col < cols) {
            nn::load8(in_row + col, v[c]);
#pragma unroll
            for (int i = 0; i < 8; ++i) sq += v[c][i] * v[c][i];
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) v[c][i] = 0.0f;
        }
    }
    const float ms = nn::block_sum(sq, scratch) / static_cast<float>(cols);
    const float r = rsqrtf(ms + eps);
    bf16* out_row = y + static_cast<int64_t>(row) * y_stride;
#pragma unroll
    for (int c = 0; c < NN_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * NN_ROW_THREADS) * 8;
        if (col < cols) {
            float w[8];
            nn::load8(weight + col, w);
            float o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = w[i] * nn::round_bf16(v[c][i] * r);
            nn::store8(out_row + col, o);
        }
    }
}

// Zero-centred RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (1 + weight[col]), in f32 (the checkpoint stores
// scale - 1). Grid: `rows` blocks of NN_ROW_THREADS threads.
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_rms_norm_zc(const bf16* __restrict__ x, int x_stride, bf16* __restrict__ y, int y_stride,
                   const bf16* __restrict__ weight, int rows, int cols, float eps) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    float v[NN_ROW_CHUNKS][8];
    nn::load_row<NN_ROW_THREADS, NN_ROW_CHUNKS>(x + static_cast<int64_t>(row) * x_stride, cols, v);
    float sq = 0.0f;
#pragma unroll
    for (int c = 0; c < NN_ROW_CHUNKS; ++c) {
#pragma unroll
        for (int i = 0; i < 8; ++i) sq += v[c][i] * v[c][i];
    }
    const float ms = nn::block_sum(sq, scratch) / static_cast<float>(cols);
    const float r = rsqrtf(ms + eps);
    bf16* out_row = y + static_cast<int64_t>(row) * y_stride;
#pragma unroll
    for (int c = 0; c < NN_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * NN_ROW_THREADS) * 8;
        if (col < cols) {
            float w[8];
            nn::load8(weight + col, w);
            float o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = v[c][i] * r * (1.0f + w[i]);
            nn::store8(out_row + col, o);
        }
    }
}

// LayerNorm or RMSNorm of each row, affine or not, then an optional adaLN-style modulation:
//   LayerNorm: n = (x - mean) * rsqrt(mean((x - mean)^2) + eps)     RMSNorm: n = x * rsqrt(mean(x^2) + eps)
//   affine:    n = n * weight[col] (+ bias[col] when bias is given)
//   modulated: n = n * (1 + scale[m, col]) (+ shift[m, col] when shift_offset >= 0)
// all in f32, rounded to bf16 once on the store. Statistics as qi_adaln_modulate computes them (the mean, then the
// mean of squared deviations; fixed-order block sums). scale/shift of row r come from modulation row m: row_index[r]
// when row_index is given (clamped to [0, mod_rows); the caller checks the indices), else the modulation-row rule
// (nn::modulation_row; seq_len 1 gives row r its own modulation row). `mod` null: no modulation.
// Grid: `rows` blocks of NN_ROW_THREADS threads.
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_norm_modulate(const bf16* __restrict__ x, int x_stride, bf16* __restrict__ y, int y_stride,
                     const bf16* __restrict__ weight, const bf16* __restrict__ bias, int rows, int cols, float eps,
                     int layer_norm, const bf16* __restrict__ mod, int mod_stride, int mod_rows, int scale_offset,
                     int shift_offset, int seq_len, int target_begin, int prefix_row,
                     const int* __restrict__ row_index) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    float v[NN_ROW_CHUNKS][8];
    const float inv_cols = 1.0f / static_cast<float>(cols);
    const float total =
        nn::load_row<NN_ROW_THREADS, NN_ROW_CHUNKS>(x + static_cast<int64_t>(row) * x_stride, cols, v);
    float mean = 0.0f;
    float rstd;
    if (layer_norm != 0) {
        mean = nn::block_sum(total, scratch) * inv_cols;
        const float sq = nn::centred_square_sum<NN_ROW_THREADS, NN_ROW_CHUNKS>(v, cols, mean);
        rstd = rsqrtf(nn::block_sum(sq, scratch) * inv_cols + eps);
    } else {
        float sq = 0.0f;
#pragma unroll
        for (int c = 0; c < NN_ROW_CHUNKS; ++c) {
#pragma unroll
            for (int i = 0; i < 8; ++i) sq += v[c][i] * v[c][i];
        }
        rstd = rsqrtf(nn::block_sum(sq, scratch) / static_cast<float>(cols) + eps);
    }
    const bf16* mod_row = nullptr;
    if (mod != nullptr) {
        int m = row_index != nullptr ? row_index[row] : nn::modulation_row(row, seq_len, target_begin, prefix_row);
        m = min(max(m, 0), mod_rows - 1);
        mod_row = mod + static_cast<int64_t>(m) * mod_stride;
    }
    bf16* out_row = y + static_cast<int64_t>(row) * y_stride;
#pragma unroll
    for (int c = 0; c < NN_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * NN_ROW_THREADS) * 8;
        if (col < cols) {
            float o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = (v[c][i] - mean) * rstd;
            if (weight != nullptr) {
                float w[8];
                nn::load8(weight + col, w);
#pragma unroll
                for (int i = 0; i < 8; ++i) o[i] *= w[i];
                if (bias != nullptr) {
                    float b[8];
                    nn::load8(bias + col, b);
#pragma unroll
                    for (int i = 0; i < 8; ++i) o[i] += b[i];
                }
            }
            if (mod_row != nullptr) {
                float s[8];
                nn::load8(mod_row + scale_offset + col, s);
#pragma unroll
                for (int i = 0; i < 8; ++i) o[i] *= 1.0f + s[i];
                if (shift_offset >= 0) {
                    float h[8];
                    nn::load8(mod_row + shift_offset + col, h);
#pragma unroll
                    for (int i = 0; i < 8; ++i) o[i] += h[i];
                }
            }
            nn::store8(out_row + col, o);
        }
    }
}
