// FP8 e4m3 quantizing kernels: each writes the input of an FP8 GEMM as e4m3 codes plus one f32 scale per row
// (per token), computed in the same kernel that produces the row. Kernel set nn_quant.
//
//   scale[r] = amax_r / 448 (1 when the row is all zeros), code = e4m3_rn_satfinite(value * (1 / scale[r]))
//
// so value ~= code * scale[r]: the per-row ("outer vector") scale cuBLASLt multiplies back in the GEMM. amax is
// taken over the f32 values the row would otherwise be rounded to bf16 from; the quantization reads those f32
// values, never a bf16 copy. Max reductions are exact, so the codes and scales are bit-identical from run to run.
//
// Storage: bf16 inputs (16-byte aligned rows, column counts and strides multiples of 8 elements); e4m3 outputs
// with 16-byte aligned rows (the row stride a multiple of 16 bytes); f32 scales, one per row. Arithmetic f32, no
// fast-math: the scale and its reciprocal are IEEE divisions (correctly rounded) and the codes one f32 multiply
// each, so a host reference computes the same codes from the same f32 values.
// Every kernel runs one block of NN_ROW_THREADS threads per row and holds the row in registers: CHUNKS of 8
// columns per thread (the norm kernels 4, up to 8192 columns; SwiGLU and the plain row quantizer 8, up to 16384).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "common/common.cuh"

#define NN_ROW_THREADS 256
#define NN_NORM_CHUNKS 4
#define NN_WIDE_CHUNKS 8

using nn::bf16;

namespace {

// Largest finite e4m3 value.
constexpr float kE4m3Max = 448.0f;

__device__ __forceinline__ float silu_f32(float x) { return x / (1.0f + expf(-x)); }

// Max over the whole block (blockDim.x a multiple of 32), returned to every thread. `scratch` holds 32 floats.
// A max is exact, so its order does not matter.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    __syncthreads();  // scratch may still be read by a previous reduction
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) {
        total = fmaxf(total, scratch[w]);
    }
    return total;
}

// This thread's max |value| over its loaded columns.
template <int CHUNKS>
__device__ __forceinline__ float chunk_amax(const float (&v)[CHUNKS][8], int cols) {
    float amax = 0.0f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int col = (threadIdx.x + c * NN_ROW_THREADS) * 8;
        if (col < cols) {
#pragma unroll
            for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[c][i]));
        }
    }
    return amax;
}

// The row's scale from its amax (the whole block has it): amax / 448, or 1 for an all-zero row.
__device__ __forceinline__ float row_scale(float amax) { return amax > 0.0f ? amax / kE4m3Max : 1.0f; }

// Eight values times `inv` as eight e4m3 codes (round to nearest even, saturating to +-448), stored as 8 bytes at
// `out`.
__device__ __forceinline__ void store8_e4m3(uint8_t* out, const float (&v)[8], float inv) {
    uint32_t words[2];
#pragma unroll
    for (int w = 0; w < 2; ++w) {
        const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(
            make_float2(v[4 * w] * inv, v[4 * w + 1] * inv), __NV_SATFINITE, __NV_E4M3);
        const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
            make_float2(v[4 * w + 2] * inv, v[4 * w + 3] * inv), __NV_SATFINITE, __NV_E4M3);
        words[w] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
    *reinterpret_cast<uint2*>(out) = make_uint2(words[0], words[1]);
}

// Quantizes the row held in `v` (this thread's chunks) into `q_row` and writes its scale: the block's max first,
// then the codes. Every thread of the block must call it.
template <int CHUNKS>
__device__ __forceinline__ void store_row_fp8(const float (&v)[CHUNKS][8], int cols, uint8_t* __restrict__ q_row,
                                              float* __restrict__ scale_out, float* scratch) {
    const float amax = block_max(chunk_amax<CHUNKS>(v, cols), scratch);
    const float scale = row_scale(amax);
    const float inv = 1.0f / scale;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int col = (threadIdx.x + c * NN_ROW_THREADS) * 8;
        if (col < cols) store8_e4m3(q_row + col, v[c], inv);
    }
    if (threadIdx.x == 0) *scale_out = scale;
}

// The norm-then-modulate body nn_norm_modulate computes, on values already in registers (overwritten with the
// result): LayerNorm or RMSNorm, optional affine, optional (1 + scale) (+ shift) from modulation row `mod_row`.
__device__ __forceinline__ void norm_modulate_row(float (&v)[NN_NORM_CHUNKS][8], float total, int cols, float eps,
                                                  int layer_norm, const bf16* __restrict__ weight,
                                                  const bf16* __restrict__ bias, const bf16* mod_row,
                                                  int scale_offset, int shift_offset, float* scratch) {
    const float inv_cols = 1.0f / static_cast<float>(cols);
    float mean = 0.0f;
    float rstd;
    if (layer_norm != 0) {
        mean = nn::block_sum(total, scratch) * inv_cols;
        const float sq = nn::centred_square_sum<NN_ROW_THREADS, NN_NORM_CHUNKS>(v, cols, mean);
        rstd = rsqrtf(nn::block_sum(sq, scratch) * inv_cols + eps);
    } else {
        float sq = 0.0f;
#pragma unroll
        for (int c = 0; c < NN_NORM_CHUNKS; ++c) {
#pragma unroll
            for (int i = 0; i < 8; ++i) sq += v[c][i] * v[c][i];
        }
        rstd = rsqrtf(nn::block_sum(sq, scratch) / static_cast<float>(cols) + eps);
    }
#pragma unroll
    for (int c = 0; c < NN_NORM_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * NN_ROW_THREADS) * 8;
        if (col < cols) {
#pragma unroll
            for (int i = 0; i < 8; ++i) v[c][i] = (v[c][i] - mean) * rstd;
            if (weight != nullptr) {
                float w[8];
                nn::load8(weight + col, w);
#pragma unroll
                for (int i = 0; i < 8; ++i) v[c][i] *= w[i];
                if (bias != nullptr) {
                    float b[8];
                    nn::load8(bias + col, b);
#pragma unroll
                    for (int i = 0; i < 8; ++i) v[c][i] += b[i];
                }
            }
            if (mod_row != nullptr) {
                float s[8];
                nn::load8(mod_row + scale_offset + col, s);
#pragma unroll
                for (int i = 0; i < 8; ++i) v[c][i] *= 1.0f + s[i];
                if (shift_offset >= 0) {
                    float h[8];
                    nn::load8(mod_row + shift_offset + col, h);
#pragma unroll
                    for (int i = 0; i < 8; ++i) v[c][i] += h[i];
                }
            }
        }
    }
}

// The modulation row of activation row `row`: row_index[row] when given, else the modulation-row rule; clamped to
// [0, mod_rows).
__device__ __forceinline__ int select_row(int row, const int* __restrict__ row_index, int seq_len, int target_begin,
                                          int prefix_row, int mod_rows) {
    const int m = row_index != nullptr ? row_index[row] : nn::modulation_row(row, seq_len, target_begin, prefix_row);
    return min(max(m, 0), mod_rows - 1);
}

}  // namespace

// q, scales = quantize(x): a bf16 matrix as e4m3 rows with one scale per row (the attention output before the
// output projection, or any bf16 GEMM input). cols <= NN_ROW_THREADS * 8 * NN_WIDE_CHUNKS (16384).
// Grid: `rows` blocks of NN_ROW_THREADS threads.
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_quantize_rows_fp8(const bf16* __restrict__ x, int x_stride, uint8_t* __restrict__ q, int q_stride,
                         float* __restrict__ scales, int rows, int cols) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    float v[NN_WIDE_CHUNKS][8];
    nn::load_row<NN_ROW_THREADS, NN_WIDE_CHUNKS>(x + static_cast<int64_t>(row) * x_stride, cols, v);
    store_row_fp8<NN_WIDE_CHUNKS>(v, cols, q + static_cast<int64_t>(row) * q_stride, scales + row, scratch);
}

// nn_norm_modulate with an FP8 output: n = norm(x) (* weight (+ bias)) (* (1 + scale) (+ shift)) in f32, as
// nn_norm_modulate computes it, then quantized per row into q / scales instead of rounded to bf16. Arguments as
// nn_norm_modulate's with (q, q_stride, scales) in place of (y, y_stride). cols <= 8192.
// Grid: `rows` blocks of NN_ROW_THREADS threads.
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_norm_modulate_fp8(const bf16* __restrict__ x, int x_stride, uint8_t* __restrict__ q, int q_stride,
                         float* __restrict__ scales, const bf16* __restrict__ weight, const bf16* __restrict__ bias,
                         int rows, int cols, float eps, int layer_norm, const bf16* __restrict__ mod, int mod_stride,
                         int mod_rows, int scale_offset, int shift_offset, int seq_len, int target_begin,
                         int prefix_row, const int* __restrict__ row_index) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    float v[NN_NORM_CHUNKS][8];
    const float total =
        nn::load_row<NN_ROW_THREADS, NN_NORM_CHUNKS>(x + static_cast<int64_t>(row) * x_stride, cols, v);
    const bf16* mod_row = nullptr;
    if (mod != nullptr) {
        const int m = select_row(row, row_index, seq_len, target_begin, prefix_row, mod_rows);
        mod_row = mod + static_cast<int64_t>(m) * mod_stride;
    }
    norm_modulate_row(v, total, cols, eps, layer_norm, weight, bias, mod_row, scale_offset, shift_offset, scratch);
    store_row_fp8<NN_NORM_CHUNKS>(v, cols, q + static_cast<int64_t>(row) * q_stride, scales + row, scratch);
}

// A gated residual, then the next norm with an FP8 output, in one pass over the row:
//   x += g * y with g = tanh(gate) (gate_tanh != 0) or gate, one fma in f32, stored rounded to bf16;
//   then nn_norm_modulate_fp8 of the stored (rounded) x.
// The gate of row r is gate_table[m * gate_stride + gate_offset + col] and the scale/shift come from
// mod[m * mod_stride + ...], m the row's modulation row (row_index, else the rule) clamped to each table's rows:
// the two tables may differ (a block's gate and the next block's modulation) but share the row selection.
// For Qwen-Image's tanh gates and LayerNorm * (1 + scale) the residual is bit-identical to
// qi_gated_residual_adaln's. cols <= 8192. Grid: `rows` blocks of NN_ROW_THREADS threads.
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_gated_residual_norm_modulate_fp8(bf16* __restrict__ x, int x_stride, const bf16* __restrict__ y, int y_stride,
                                        const bf16* __restrict__ gate_table, int gate_stride, int gate_rows,
                                        int gate_offset, int gate_tanh, uint8_t* __restrict__ q, int q_stride,
                                        float* __restrict__ scales, const bf16* __restrict__ weight,
                                        const bf16* __restrict__ bias, int rows, int cols, float eps, int layer_norm,
                                        const bf16* __restrict__ mod, int mod_stride, int mod_rows, int scale_offset,
                                        int shift_offset, int seq_len, int target_begin, int prefix_row,
                                        const int* __restrict__ row_index) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const int gm = select_row(row, row_index, seq_len, target_begin, prefix_row, gate_rows);
    const bf16* gate_row = gate_table + static_cast<int64_t>(gm) * gate_stride + gate_offset;
    bf16* x_row = x + static_cast<int64_t>(row) * x_stride;
    const bf16* y_row = y + static_cast<int64_t>(row) * y_stride;
    float v[NN_NORM_CHUNKS][8];
    float total = 0.0f;
#pragma unroll
    for (int c = 0; c < NN_NORM_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * NN_ROW_THREADS) * 8;
        if (col < cols) {
            float g[8], b[8];
            nn::load8(gate_row + col, g);
            nn::load8(x_row + col, v[c]);
            nn::load8(y_row + col, b);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float gate = gate_tanh != 0 ? tanhf(g[i]) : g[i];
                v[c][i] = nn::round_bf16(fmaf(gate, b[i], v[c][i]));
            }
            nn::store8(x_row + col, v[c]);
#pragma unroll
            for (int i = 0; i < 8; ++i) total += v[c][i];
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) v[c][i] = 0.0f;
        }
    }
    const bf16* mod_row = nullptr;
    if (mod != nullptr) {
        const int m = select_row(row, row_index, seq_len, target_begin, prefix_row, mod_rows);
        mod_row = mod + static_cast<int64_t>(m) * mod_stride;
    }
    norm_modulate_row(v, total, cols, eps, layer_norm, weight, bias, mod_row, scale_offset, shift_offset, scratch);
    store_row_fp8<NN_NORM_CHUNKS>(v, cols, q + static_cast<int64_t>(row) * q_stride, scales + row, scratch);
}

// SwiGLU with an FP8 output: h[c] = silu(gate[c]) * value[c] in f32 over a fused GEMM output row of 2 * hidden
// columns ([gate | value] when gate_first != 0, else [value | gate]), quantized per row into q / scales.
// hidden <= 16384. Grid: `rows` blocks of NN_ROW_THREADS threads.
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_swiglu_fp8(const bf16* __restrict__ fused, int fused_stride, uint8_t* __restrict__ q, int q_stride,
                  float* __restrict__ scales, int rows, int hidden, int gate_first) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const bf16* in_row = fused + static_cast<int64_t>(row) * fused_stride;
    const bf16* gate = in_row + (gate_first != 0 ? 0 : hidden);
    const bf16* value = in_row + (gate_first != 0 ? hidden : 0);
    float v[NN_WIDE_CHUNKS][8];
#pragma unroll
    for (int c = 0; c < NN_WIDE_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * NN_ROW_THREADS) * 8;
        if (col < hidden) {
            float g[8], u[8];
            nn::load8(gate + col, g);
            nn::load8(value + col, u);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[c][i] = silu_f32(g[i]) * u[i];
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) v[c][i] = 0.0f;
        }
    }
    store_row_fp8<NN_WIDE_CHUNKS>(v, hidden, q + static_cast<int64_t>(row) * q_stride, scales + row, scratch);
}
