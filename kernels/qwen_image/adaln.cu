// Qwen-Image DiT kernels: adaLN (LayerNorm without affine times (1 + scale)), the tanh-gated residual and the
// fused residual + adaLN. Kernel set qwen_image_dit.
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

// y = LayerNorm(x) * (1 + scale): LayerNorm without affine, statistics in f32 (the mean, then the mean of
// squared deviations). The scale of row r is mod[m * mod_stride + mod_offset + col], m the modulation row
// of r (nn::modulation_row). Grid: `rows` blocks of NN_ROW_THREADS threads.
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    qi_adaln_modulate(const bf16* __restrict__ x, int x_stride, bf16* __restrict__ y, int y_stride,
                      const bf16* __restrict__ mod, int mod_stride, int mod_offset, int rows, int cols,
                      int seq_len, int target_begin, int prefix_row, float eps) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    float v[NN_ROW_CHUNKS][8];
    const float inv_cols = 1.0f / static_cast<float>(cols);
    const float mean = nn::block_sum(nn::load_row<NN_ROW_THREADS, NN_ROW_CHUNKS>(x + static_cast<int64_t>(row) * x_stride, cols, v), scratch) * inv_cols;
    const float sq = nn::centred_square_sum<NN_ROW_THREADS, NN_ROW_CHUNKS>(v, cols, mean);
    const float var = nn::block_sum(sq, scratch) * inv_cols;
    const float rstd = rsqrtf(var + eps);
    const int m = nn::modulation_row(row, seq_len, target_begin, prefix_row);
    const bf16* scale_row = mod + static_cast<int64_t>(m) * mod_stride + mod_offset;
    bf16* out_row = y + static_cast<int64_t>(row) * y_stride;
#pragma unroll
    for (int c = 0; c < NN_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * NN_ROW_THREADS) * 8;
        if (col < cols) {
            float s[8];
            nn::load8(scale_row + col, s);
            float o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = (v[c][i] - mean) * rstd * (1.0f + s[i]);
            nn::store8(out_row + col, o);
        }
    }
}


// x += tanh(gate) * y in f32 (one fma), the gate of row r taken from its modulation row like
// qi_adaln_modulate. In place on x. Grid: (rows, ceil(cols / 8 / NN_ROW_THREADS)).
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    qi_gated_residual(bf16* __restrict__ x, int x_stride, const bf16* __restrict__ y, int y_stride,
                      const bf16* __restrict__ mod, int mod_stride, int mod_offset, int rows, int cols,
                      int seq_len, int target_begin, int prefix_row) {
    const int row = blockIdx.x;
    const int col = (blockIdx.y * NN_ROW_THREADS + threadIdx.x) * 8;
    if (row >= rows || col >= cols) return;
    const int m = nn::modulation_row(row, seq_len, target_begin, prefix_row);
    float g[8], a[8], b[8];
    nn::load8(mod + static_cast<int64_t>(m) * mod_stride + mod_offset + col, g);
    bf16* x_at = x + static_cast<int64_t>(row) * x_stride + col;
    nn::load8(x_at, a);
    nn::load8(y + static_cast<int64_t>(row) * y_stride + col, b);
#pragma unroll
    for (int i = 0; i < 8; ++i) a[i] = fmaf(tanhf(g[i]), b[i], a[i]);
    nn::store8(x_at, a);
}

// Gated residual then the next adaLN, in one pass over the row: x += tanh(gate) * y (stored, rounded to bf16),
// then out = LayerNorm(x) * (1 + scale) from the rounded x, exactly as qi_gated_residual followed by
// qi_adaln_modulate. Gate and scale come from the same modulation rows at two offsets. Grid: `rows` blocks.
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    qi_gated_residual_adaln(bf16* __restrict__ x, int x_stride, const bf16* __restrict__ y, int y_stride,
                            bf16* __restrict__ out, int out_stride, const bf16* __restrict__ mod, int mod_stride,
                            int gate_offset, int scale_offset, int rows, int cols, int seq_len, int target_begin,
                            int prefix_row, float eps) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const int m = nn::modulation_row(row, seq_len, target_begin, prefix_row);
    const bf16* mod_row = mod + static_cast<int64_t>(m) * mod_stride;
    bf16* x_row = x + static_cast<int64_t>(row) * x_stride;
    const bf16* y_row = y + static_cast<int64_t>(row) * y_stride;
    float v[NN_ROW_CHUNKS][8];
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < NN_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * NN_ROW_THREADS) * 8;
        if (col < cols) {
            float g[8], b[8];
            nn::load8(mod_row + gate_offset + col, g);
            nn::load8(x_row + col, v[c]);
            nn::load8(y_row + col, b);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[c][i] = nn::round_bf16(fmaf(tanhf(g[i]), b[i], v[c][i]));
            nn::store8(x_row + col, v[c]);
#pragma unroll
            for (int i = 0; i < 8; ++i) sum += v[c][i];
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) v[c][i] = 0.0f;
        }
    }
    const float inv_cols = 1.0f / static_cast<float>(cols);
    const float mean = nn::block_sum(sum, scratch) * inv_cols;
    const float sq = nn::centred_square_sum<NN_ROW_THREADS, NN_ROW_CHUNKS>(v, cols, mean);
    const float var = nn::block_sum(sq, scratch) * inv_cols;
    const float rstd = rsqrtf(var + eps);
    bf16* out_row = out + static_cast<int64_t>(row) * out_stride;
#pragma unroll
    for (int c = 0; c < NN_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * NN_ROW_THREADS) * 8;
        if (col < cols) {
            float s[8];
            nn::load8(mod_row + scale_offset + col, s);
            float o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = (v[c][i] - mean) * rstd * (1.0f + s[i]);
            nn::store8(out_row + col, o);
        }
    }
}
