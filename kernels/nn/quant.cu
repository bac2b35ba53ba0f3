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
// Every kernel runs one block per row and holds the row in registers, chunk c of thread t being the 8 columns from
// (t + c * blockDim.x) * 8:
// - the norm kernels: NN_ROW_THREADS threads, CHUNKS chunks each (the `_c2` entry points 2, up to 4096 columns;
//   the plain ones 4, up to 8192), the chunk order of nn_norm_modulate's sums: chunks past the row add nothing,
//   so both variants give the same statistics bit for bit and the launcher takes the narrowest that fits;
// - SwiGLU and the plain row quantizer: NN_WIDE_CHUNKS (2) chunks per thread and as many threads as the row
//   needs (ceil(cols / 16) rounded up to a warp, at most 1024: up to 16384 columns), the launcher's block size.
//   16 values a thread keep the kernel within 32 registers, so two such blocks share an SM (48 warps at 12288
//   columns, 56 at 14336) and each thread has its four 16-byte loads in flight at once: the memory system stays
//   busy while other rows compute (silu costs about as much time as the row's bytes) and reduce.
// The codes depend only on each value and its row's scale, and the scale only on the row's max, so the block
// shape never changes an output.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "common/codes8.cuh"
#include "common/common.cuh"

#define NN_ROW_THREADS 256
#define NN_NORM_CHUNKS 4
#define NN_WIDE_CHUNKS 2
#define NN_WIDE_MAX_THREADS 1024
// Registers of nn_swiglu_fp8: on sm_80..sm_100 its 16 held values, the loads and silu's division fit in 40 without
// a stack frame (32 would need one for the division's slow path); at 40, two 768-thread blocks (12288 columns)
// share an SM. sm_12x's code needs 48.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
#define NN_WIDE_REGISTERS 48
#define NN_SWIGLU_REGISTERS 48
#else
#define NN_WIDE_REGISTERS 40
// nn_swiglu_fp8 divides with __fdividef (no slow path), which fits it in 32: at 14336 columns (MiniMax H3) two
// 896-thread blocks then share an SM, where 40 left room for one and the SM idled while that block reduced and stored.
#define NN_SWIGLU_REGISTERS 32
#endif

using nn::bf16;

namespace {

// Largest finite e4m3 value.
constexpr float kE4m3Max = 448.0f;

// silu with the approximate division (nn::silu_fast), so the kernel needs no stack frame at 32 registers.
__device__ __forceinline__ float silu_f32(float x) { return nn::silu_fast(x); }

// Max over the whole block (blockDim.x a multiple of 32), returned to every thread. `scratch` holds 32 floats and
// serves this one reduction only (no other reduction of the kernel reads it), so one barrier suffices. A max is
// exact, so its order does not matter.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    v = nn::warp_max(v);
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

// This thread's max |value| over its loaded columns (`threads` per row).
template <int CHUNKS>
__device__ __forceinline__ float chunk_amax(const float (&v)[CHUNKS][8], int cols, int threads) {
    float amax = 0.0f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int col = (threadIdx.x + c * threads) * 8;
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

// Eight values times `inv` as eight INT8 codes (round to nearest even, saturating to +-127: nn::fp8's
// int8_encode; NaN becomes 0), stored as 8 bytes at `out`.
__device__ __forceinline__ void store8_int8(uint8_t* out, const float (&v)[8], float inv) {
    uint32_t words[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int code = max(-127, min(127, __float2int_rn(v[i] * inv)));
        words[i / 4] |= (static_cast<uint32_t>(code) & 0xffu) << (8 * (i % 4));
    }
    *reinterpret_cast<uint2*>(out) = make_uint2(words[0], words[1]);
}

// The row scale of 8-bit codes from the row's amax: amax / 448 for e4m3, amax / 127 for INT8 (1 for an all-zero row).
template <bool INT8>
__device__ __forceinline__ float codes_scale(float amax) {
    if constexpr (INT8) {
        return amax > 0.0f ? amax / 127.0f : 1.0f;
    } else {
        return row_scale(amax);
    }
}

// Quantizes the row held in `v` (this thread's chunks, `threads` per row) into `q_row` as e4m3 codes (INT8 false)
// or INT8 codes (two's complement) and writes its scale: the block's max first, then the codes. Every thread of
// the block must call it, once; `max_scratch` (32 floats) is used by nothing else.
template <int CHUNKS, bool INT8>
__device__ __forceinline__ void store_row_codes(const float (&v)[CHUNKS][8], int cols, int threads,
                                                uint8_t* __restrict__ q_row, float* __restrict__ scale_out,
                                                float* max_scratch) {
    const float amax = block_max(chunk_amax<CHUNKS>(v, cols, threads), max_scratch);
    const float scale = codes_scale<INT8>(amax);
    const float inv = 1.0f / scale;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int col = (threadIdx.x + c * threads) * 8;
        if (col < cols) {
            if constexpr (INT8) {
                store8_int8(q_row + col, v[c], inv);
            } else {
                store8_e4m3(q_row + col, v[c], inv);
            }
        }
    }
    if (threadIdx.x == 0) *scale_out = scale;
}

// store_row_codes in both formats for the same row with one max reduction: e4m3 codes into q_row (scale amax / 448)
// and INT8 codes into i8_row (scale amax / 127), the inputs of an FP8 and an INT8 GEMM over the same rows.
template <int CHUNKS>
__device__ __forceinline__ void store_row_fp8_and_int8(const float (&v)[CHUNKS][8], int cols, int threads,
                                                       uint8_t* __restrict__ q_row, float* __restrict__ scale_out,
                                                       uint8_t* __restrict__ i8_row, float* __restrict__ i8_scale_out,
                                                       float* max_scratch) {
    const float amax = block_max(chunk_amax<CHUNKS>(v, cols, threads), max_scratch);
    const float scale = codes_scale<false>(amax);
    const float i8_scale = codes_scale<true>(amax);
    const float inv = 1.0f / scale;
    const float i8_inv = 1.0f / i8_scale;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int col = (threadIdx.x + c * threads) * 8;
        if (col < cols) {
            store8_e4m3(q_row + col, v[c], inv);
            store8_int8(i8_row + col, v[c], i8_inv);
        }
    }
    if (threadIdx.x == 0) {
        *scale_out = scale;
        *i8_scale_out = i8_scale;
    }
}

// The norm-then-modulate body nn_norm_modulate computes, on values already in registers (overwritten with the
// result): LayerNorm or RMSNorm, optional affine, optional (1 + scale) (+ shift) from modulation row `mod_row`.
// RMSNorm divides the sum of squares by `norm_cols`, the model's width: a row padded with zero columns up to
// `cols` (MiniMax H3's tiny models) keeps its mean square; `norm_cols == cols` is nn_norm_modulate's statistic.
template <int CHUNKS>
__device__ __forceinline__ void norm_modulate_row(float (&v)[CHUNKS][8], float total, int cols, int norm_cols,
                                                  float eps, int layer_norm, const bf16* __restrict__ weight,
                                                  const bf16* __restrict__ bias, const bf16* mod_row,
                                                  int scale_offset, int shift_offset, float* scratch) {
    const float inv_cols = 1.0f / static_cast<float>(cols);
    float mean = 0.0f;
    float rstd;
    if (layer_norm != 0) {
        mean = nn::block_sum(total, scratch) * inv_cols;
        const float sq = nn::centred_square_sum<NN_ROW_THREADS, CHUNKS>(v, cols, mean);
        rstd = rsqrtf(nn::block_sum(sq, scratch) * inv_cols + eps);
    } else {
        float sq = 0.0f;
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
#pragma unroll
            for (int i = 0; i < 8; ++i) sq += v[c][i] * v[c][i];
        }
        rstd = rsqrtf(nn::block_sum(sq, scratch) / static_cast<float>(norm_cols) + eps);
    }
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
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

// Loads chunks of 8 bf16 values as raw 16-byte words, all issued before any is used (chunk c of this thread: the
// 8 columns from (threadIdx.x + c * blockDim.x) * 8; columns past `cols` are not read).
template <int CHUNKS>
__device__ __forceinline__ void load_raw(const bf16* __restrict__ row, int cols, uint4 (&raw)[CHUNKS]) {
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int col = (threadIdx.x + c * blockDim.x) * 8;
        raw[c] = col < cols ? *reinterpret_cast<const uint4*>(row + col) : make_uint4(0u, 0u, 0u, 0u);
    }
}

// The eight f32 values of a raw 16-byte word of bf16 (exact).
__device__ __forceinline__ void unpack8(const uint4& raw, float (&out)[8]) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(words[i] << 16);
        out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
}

// The body of nn_norm_modulate_fp8 (INT8 false) and nn_norm_modulate_int8 with CHUNKS chunks per thread
// (cols <= NN_ROW_THREADS * 8 * CHUNKS).
template <int CHUNKS, bool INT8 = false>
__device__ __forceinline__ void norm_modulate_fp8_row(const bf16* __restrict__ x, int x_stride,
                                                      uint8_t* __restrict__ q, int q_stride,
                                                      float* __restrict__ scales, const bf16* __restrict__ weight,
                                                      const bf16* __restrict__ bias, int rows, int cols, float eps,
                                                      int layer_norm, const bf16* __restrict__ mod, int mod_stride,
                                                      int mod_rows, int scale_offset, int shift_offset, int seq_len,
                                                      int target_begin, int prefix_row,
                                                      const int* __restrict__ row_index, int norm_cols,
                                                      float* scratch, float* max_scratch) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    float v[CHUNKS][8];
    const float total = nn::load_row<NN_ROW_THREADS, CHUNKS>(x + static_cast<int64_t>(row) * x_stride, cols, v);
    const bf16* mod_row = nullptr;
    if (mod != nullptr) {
        const int m = select_row(row, row_index, seq_len, target_begin, prefix_row, mod_rows);
        mod_row = mod + static_cast<int64_t>(m) * mod_stride;
    }
    norm_modulate_row<CHUNKS>(v, total, cols, norm_cols, eps, layer_norm, weight, bias, mod_row, scale_offset,
                              shift_offset, scratch);
    store_row_codes<CHUNKS, INT8>(v, cols, NN_ROW_THREADS, q + static_cast<int64_t>(row) * q_stride, scales + row,
                                  max_scratch);
}

// What a gated residual's FP8 norm also writes: nothing, the normed rows in bf16 to h (the _and_bf16 entry points),
// or their INT8 codes to h with one f32 scale per row in h_scales (the _and_int8 entry points).
enum class SecondOut { None, Bf16, Int8 };

// The body of nn_gated_residual_norm_modulate_fp8 with CHUNKS chunks per thread, and SECOND of its entry points;
// INT8: the normed rows as INT8 codes into q (nn_gated_residual_norm_modulate_int8, SECOND None).
template <int CHUNKS, SecondOut SECOND, bool INT8 = false>
__device__ __forceinline__ void gated_residual_norm_modulate_fp8_row(
    bf16* __restrict__ x, int x_stride, const bf16* __restrict__ y, int y_stride, const bf16* __restrict__ gate_table,
    int gate_stride, int gate_rows, int gate_offset, int gate_tanh, uint8_t* __restrict__ q, int q_stride,
    float* __restrict__ scales, const bf16* __restrict__ weight, const bf16* __restrict__ bias, int rows, int cols,
    float eps, int layer_norm, const bf16* __restrict__ mod, int mod_stride, int mod_rows, int scale_offset,
    int shift_offset, int seq_len, int target_begin, int prefix_row, const int* __restrict__ row_index,
    int norm_cols, void* __restrict__ h, int h_stride, float* __restrict__ h_scales, float* scratch,
    float* max_scratch) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    const int gm = select_row(row, row_index, seq_len, target_begin, prefix_row, gate_rows);
    const bf16* gate_row = gate_table + static_cast<int64_t>(gm) * gate_stride + gate_offset;
    bf16* x_row = x + static_cast<int64_t>(row) * x_stride;
    const bf16* y_row = y + static_cast<int64_t>(row) * y_stride;
    const bf16* mod_row = nullptr;
    if (mod != nullptr) {
        const int m = select_row(row, row_index, seq_len, target_begin, prefix_row, mod_rows);
        mod_row = mod + static_cast<int64_t>(m) * mod_stride;
    }
    float v[CHUNKS][8];
    float total = 0.0f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
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
    norm_modulate_row<CHUNKS>(v, total, cols, norm_cols, eps, layer_norm, weight, bias, mod_row, scale_offset,
                              shift_offset, scratch);
    uint8_t* q_row = q + static_cast<int64_t>(row) * q_stride;
    if (SECOND == SecondOut::Int8) {
        uint8_t* i8_row = static_cast<uint8_t*>(h) + static_cast<int64_t>(row) * h_stride;
        store_row_fp8_and_int8<CHUNKS>(v, cols, NN_ROW_THREADS, q_row, scales + row, i8_row, h_scales + row,
                                       max_scratch);
        return;
    }
    if (SECOND == SecondOut::Bf16) {
        bf16* h_row = static_cast<bf16*>(h) + static_cast<int64_t>(row) * h_stride;
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int col = (threadIdx.x + c * NN_ROW_THREADS) * 8;
            if (col < cols) nn::store8(h_row + col, v[c]);
        }
    }
    store_row_codes<CHUNKS, INT8>(v, cols, NN_ROW_THREADS, q_row, scales + row, max_scratch);
}

// The body of nn_quantize_rows_fp8 (INT8 false) and nn_quantize_rows_int8.
template <bool INT8>
__device__ __forceinline__ void quantize_rows_body(const bf16* __restrict__ x, int x_stride, uint8_t* __restrict__ q,
                                                   int q_stride, float* __restrict__ scales, int rows, int cols,
                                                   float* scratch) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    uint4 raw[NN_WIDE_CHUNKS];
    load_raw<NN_WIDE_CHUNKS>(x + static_cast<int64_t>(row) * x_stride, cols, raw);
    float v[NN_WIDE_CHUNKS][8];
#pragma unroll
    for (int c = 0; c < NN_WIDE_CHUNKS; ++c) unpack8(raw[c], v[c]);
    uint8_t* q_row = q + static_cast<int64_t>(row) * q_stride;
    store_row_codes<NN_WIDE_CHUNKS, INT8>(v, cols, blockDim.x, q_row, scales + row, scratch);
}

}  // namespace

// q, scales = quantize(x): a bf16 matrix as e4m3 rows with one scale per row (the attention output before the
// output projection, or any bf16 GEMM input). cols <= NN_WIDE_MAX_THREADS * 8 * NN_WIDE_CHUNKS (16384).
// Grid: `rows` blocks of ceil(cols / 16) threads rounded up to a multiple of 32.
extern "C" __global__ void __launch_bounds__(NN_WIDE_MAX_THREADS, 2)
    nn_quantize_rows_fp8(const bf16* __restrict__ x, int x_stride, uint8_t* __restrict__ q, int q_stride,
                         float* __restrict__ scales, int rows, int cols) {
    __shared__ float scratch[32];
    quantize_rows_body<false>(x, x_stride, q, q_stride, scales, rows, cols, scratch);
}

// q, scales = quantize(x) in INT8: nn_quantize_rows_fp8 with a row's scale amax / 127 (1 for an all-zero row) and
// two's-complement codes (the weight-only layers' format, made on the device from a bf16 matrix). Same grid and
// limits as nn_quantize_rows_fp8.
extern "C" __global__ void __launch_bounds__(NN_WIDE_MAX_THREADS, 2)
    nn_quantize_rows_int8(const bf16* __restrict__ x, int x_stride, uint8_t* __restrict__ q, int q_stride,
                          float* __restrict__ scales, int rows, int cols) {
    __shared__ float scratch[32];
    quantize_rows_body<true>(x, x_stride, q, q_stride, scales, rows, cols, scratch);
}

// w = dequantize(q, scales): 8-bit rows [rows, cols] (e4m3 when int8 == 0, else INT8), each code times its row's
// scale, rounded once to bf16 into dense rows of cols (the input of a bf16 GEMM over weights kept in 8 bits: MiniMax
// H3's weight-only adaLN projections over a request's whole timestep schedule). cols a multiple of 16. Grid-stride
// over 16-code chunks; any grid.
extern "C" __global__ void __launch_bounds__(256)
    nn_dequantize_rows_bf16(const uint8_t* __restrict__ q, const float* __restrict__ scales, int int8, int rows,
                            int cols, bf16* __restrict__ w) {
    const int64_t chunks_per_row = cols / 16;
    const int64_t chunks = static_cast<int64_t>(rows) * chunks_per_row;
    for (int64_t chunk = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; chunk < chunks;
         chunk += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t row = chunk / chunks_per_row;
        const uint4 raw = *reinterpret_cast<const uint4*>(q + chunk * 16);
        const float scale = scales[row];
        float v[16];
        if (int8 != 0) {
            nn::decode16_int8(raw, v);
        } else {
            nn::decode16_e4m3(raw, v);
        }
        uint32_t out[8];
#pragma unroll
        for (int p = 0; p < 8; ++p) {
            const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * p] * scale, v[2 * p + 1] * scale);
            out[p] = *reinterpret_cast<const uint32_t*>(&pair);
        }
        uint4* dst = reinterpret_cast<uint4*>(w + chunk * 16);
        dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
        dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
    }
}

// nn_norm_modulate with an FP8 output: n = norm(x) (* weight (+ bias)) (* (1 + scale) (+ shift)) in f32, as
// nn_norm_modulate computes it, then quantized per row into q / scales instead of rounded to bf16. Arguments as
// nn_norm_modulate's with (q, q_stride, scales) in place of (y, y_stride), then norm_cols: the width an RMSNorm
// divides by (cols, or the model's width when the row is zero-padded past it; LayerNorm takes cols). cols <= 8192; the `_c2` entry point
// (same arguments, same results) cols <= 4096, in fewer registers. Grid: `rows` blocks of NN_ROW_THREADS threads.
#define NN_NORM_MODULATE_FP8_ARGS                                                                                   \
    const bf16 *__restrict__ x, int x_stride, uint8_t *__restrict__ q, int q_stride, float *__restrict__ scales,    \
        const bf16 *__restrict__ weight, const bf16 *__restrict__ bias, int rows, int cols, float eps,             \
        int layer_norm, const bf16 *__restrict__ mod, int mod_stride, int mod_rows, int scale_offset,               \
        int shift_offset, int seq_len, int target_begin, int prefix_row, const int *__restrict__ row_index,         \
        int norm_cols
#define NN_NORM_MODULATE_FP8_PASS                                                                                   \
    x, x_stride, q, q_stride, scales, weight, bias, rows, cols, eps, layer_norm, mod, mod_stride, mod_rows,         \
        scale_offset, shift_offset, seq_len, target_begin, prefix_row, row_index, norm_cols, scratch, max_scratch

extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS) nn_norm_modulate_fp8(NN_NORM_MODULATE_FP8_ARGS) {
    __shared__ float scratch[32];
    __shared__ float max_scratch[32];
    norm_modulate_fp8_row<NN_NORM_CHUNKS>(NN_NORM_MODULATE_FP8_PASS);
}

extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS) nn_norm_modulate_fp8_c2(NN_NORM_MODULATE_FP8_ARGS) {
    __shared__ float scratch[32];
    __shared__ float max_scratch[32];
    norm_modulate_fp8_row<2>(NN_NORM_MODULATE_FP8_PASS);
}

// nn_norm_modulate_fp8 with INT8 codes (scale amax / 127 a row, as nn_quantize_rows_int8): the input of an INT8
// GEMM. Same arguments, grid and limits; the `_c2` entry point cols <= 4096.
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS) nn_norm_modulate_int8(NN_NORM_MODULATE_FP8_ARGS) {
    __shared__ float scratch[32];
    __shared__ float max_scratch[32];
    norm_modulate_fp8_row<NN_NORM_CHUNKS, true>(NN_NORM_MODULATE_FP8_PASS);
}

extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS) nn_norm_modulate_int8_c2(NN_NORM_MODULATE_FP8_ARGS) {
    __shared__ float scratch[32];
    __shared__ float max_scratch[32];
    norm_modulate_fp8_row<2, true>(NN_NORM_MODULATE_FP8_PASS);
}

// A gated residual, then the next norm with an FP8 output, in one pass over the row:
//   x += g * y with g = tanh(gate) (gate_tanh != 0) or gate, one fma in f32, stored rounded to bf16;
//   then nn_norm_modulate_fp8 of the stored (rounded) x; the _and_bf16 entry points store the normed rows in bf16 to
//   h too (h_stride elements apart: the input of a bf16 GEMM beside the FP8 one, MiniMax H3's fc1 halves), the
//   _and_int8 entry points (one more argument, h_scales) their INT8 codes to h (h_stride bytes apart, 16-byte
//   aligned) and each row's scale amax / 127 to h_scales (the input of an INT8 GEMM beside the FP8 one); the
//   others ignore h.
// The gate of row r is gate_table[m * gate_stride + gate_offset + col] and the scale/shift come from
// mod[m * mod_stride + ...], m the row's modulation row (row_index, else the rule) clamped to each table's rows:
// the two tables may differ (a block's gate and the next block's modulation) but share the row selection.
// For Qwen-Image's tanh gates and LayerNorm * (1 + scale) the residual is bit-identical to
// qi_gated_residual_adaln's; MiniMax H3's plain gates and RMSNorm * weight * (1 + scale) + shift over rows
// zero-padded past norm_cols (the last argument, as in nn_norm_modulate_fp8) match h3_residual_norm.
// cols <= 8192; the `_c2` entry point (same arguments, same results) cols <= 4096.
// Grid: `rows` blocks of NN_ROW_THREADS threads.
#define NN_GATED_RESIDUAL_FP8_ARGS                                                                                  \
    bf16 *__restrict__ x, int x_stride, const bf16 *__restrict__ y, int y_stride,                                   \
        const bf16 *__restrict__ gate_table, int gate_stride, int gate_rows, int gate_offset, int gate_tanh,        \
        uint8_t *__restrict__ q, int q_stride, float *__restrict__ scales, const bf16 *__restrict__ weight,         \
        const bf16 *__restrict__ bias, int rows, int cols, float eps, int layer_norm, const bf16 *__restrict__ mod, \
        int mod_stride, int mod_rows, int scale_offset, int shift_offset, int seq_len, int target_begin,            \
        int prefix_row, const int *__restrict__ row_index, int norm_cols, bf16 *__restrict__ h, int h_stride
#define NN_GATED_RESIDUAL_FP8_PASS                                                                                  \
    x, x_stride, y, y_stride, gate_table, gate_stride, gate_rows, gate_offset, gate_tanh, q, q_stride, scales,      \
        weight, bias, rows, cols, eps, layer_norm, mod, mod_stride, mod_rows, scale_offset, shift_offset, seq_len,  \
        target_begin, prefix_row, row_index, norm_cols, h, h_stride

extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_gated_residual_norm_modulate_fp8(NN_GATED_RESIDUAL_FP8_ARGS) {
    __shared__ float scratch[32];
    __shared__ float max_scratch[32];
    gated_residual_norm_modulate_fp8_row<NN_NORM_CHUNKS, SecondOut::None>(NN_GATED_RESIDUAL_FP8_PASS, nullptr, scratch, max_scratch);
}

extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_gated_residual_norm_modulate_fp8_c2(NN_GATED_RESIDUAL_FP8_ARGS) {
    __shared__ float scratch[32];
    __shared__ float max_scratch[32];
    gated_residual_norm_modulate_fp8_row<2, SecondOut::None>(NN_GATED_RESIDUAL_FP8_PASS, nullptr, scratch, max_scratch);
}

// nn_gated_residual_norm_modulate_fp8 with the normed rows as INT8 codes (scale amax / 127 a row): the input of an
// INT8 GEMM. Same arguments, grid and limits (h ignored); the `_c2` entry point cols <= 4096.
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_gated_residual_norm_modulate_int8(NN_GATED_RESIDUAL_FP8_ARGS) {
    __shared__ float scratch[32];
    __shared__ float max_scratch[32];
    gated_residual_norm_modulate_fp8_row<NN_NORM_CHUNKS, SecondOut::None, true>(NN_GATED_RESIDUAL_FP8_PASS, nullptr,
                                                                                scratch, max_scratch);
}

extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_gated_residual_norm_modulate_int8_c2(NN_GATED_RESIDUAL_FP8_ARGS) {
    __shared__ float scratch[32];
    __shared__ float max_scratch[32];
    gated_residual_norm_modulate_fp8_row<2, SecondOut::None, true>(NN_GATED_RESIDUAL_FP8_PASS, nullptr, scratch,
                                                                   max_scratch);
}

// A minimum of two blocks an SM (up to 128 registers a thread): with none, ptxas held this entry point to 64 registers
// and an 8-byte stack frame on sm_100a; with it, 80 registers and no stack.
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS, 2)
    nn_gated_residual_norm_modulate_fp8_and_bf16(NN_GATED_RESIDUAL_FP8_ARGS) {
    __shared__ float scratch[32];
    __shared__ float max_scratch[32];
    gated_residual_norm_modulate_fp8_row<NN_NORM_CHUNKS, SecondOut::Bf16>(NN_GATED_RESIDUAL_FP8_PASS, nullptr, scratch, max_scratch);
}

extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_gated_residual_norm_modulate_fp8_and_bf16_c2(NN_GATED_RESIDUAL_FP8_ARGS) {
    __shared__ float scratch[32];
    __shared__ float max_scratch[32];
    gated_residual_norm_modulate_fp8_row<2, SecondOut::Bf16>(NN_GATED_RESIDUAL_FP8_PASS, nullptr, scratch, max_scratch);
}

// Four blocks an SM (up to 64 registers a thread, no spills on any target): at two, ptxas gave it 75-86 registers
// and three blocks shared an SM, at MiniMax H3's 5376 columns a pass that moves 8 bytes a value.
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS, 4)
    nn_gated_residual_norm_modulate_fp8_and_int8(NN_GATED_RESIDUAL_FP8_ARGS, float* __restrict__ h_scales) {
    __shared__ float scratch[32];
    __shared__ float max_scratch[32];
    gated_residual_norm_modulate_fp8_row<NN_NORM_CHUNKS, SecondOut::Int8>(NN_GATED_RESIDUAL_FP8_PASS, h_scales, scratch,
                                                                          max_scratch);
}

extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_gated_residual_norm_modulate_fp8_and_int8_c2(NN_GATED_RESIDUAL_FP8_ARGS, float* __restrict__ h_scales) {
    __shared__ float scratch[32];
    __shared__ float max_scratch[32];
    gated_residual_norm_modulate_fp8_row<2, SecondOut::Int8>(NN_GATED_RESIDUAL_FP8_PASS, h_scales, scratch,
                                                             max_scratch);
}

namespace {
// The body of nn_swiglu_fp8 (INT8 false) and nn_swiglu_int8.
template <bool INT8>
__device__ __forceinline__ void swiglu_codes_row(const bf16* __restrict__ gate, const bf16* __restrict__ value,
                                                 int in_stride, uint8_t* __restrict__ q, int q_stride,
                                                 float* __restrict__ scales, int rows, int hidden, float* scratch) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    const int64_t at = static_cast<int64_t>(row) * in_stride;
    uint4 gate_raw[NN_WIDE_CHUNKS];
    uint4 value_raw[NN_WIDE_CHUNKS];
    load_raw<NN_WIDE_CHUNKS>(gate + at, hidden, gate_raw);
    load_raw<NN_WIDE_CHUNKS>(value + at, hidden, value_raw);
    float v[NN_WIDE_CHUNKS][8];
#pragma unroll
    for (int c = 0; c < NN_WIDE_CHUNKS; ++c) {
        float g[8];
        unpack8(gate_raw[c], g);
        unpack8(value_raw[c], v[c]);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[c][i] = silu_f32(g[i]) * v[c][i];
    }
    store_row_codes<NN_WIDE_CHUNKS, INT8>(v, hidden, blockDim.x, q + static_cast<int64_t>(row) * q_stride,
                                          scales + row, scratch);
}
}  // namespace

// SwiGLU with an FP8 output: h[c] = silu(gate[c]) * value[c] in f32 over a row's two halves of `hidden` columns,
// read at `gate` and `value` with one row stride (the halves of a fused GEMM output row, or two matrices), quantized
// per row into q / scales. hidden <= NN_WIDE_MAX_THREADS * 8 * NN_WIDE_CHUNKS (16384). Grid: `rows` blocks of
// ceil(hidden / 16) threads rounded up to a multiple of 32. Every load of the row is issued before the first silu.
extern "C" __global__ void __maxnreg__(NN_SWIGLU_REGISTERS)
    nn_swiglu_fp8(const bf16* __restrict__ gate, const bf16* __restrict__ value, int in_stride,
                  uint8_t* __restrict__ q, int q_stride, float* __restrict__ scales, int rows, int hidden) {
    __shared__ float scratch[32];
    swiglu_codes_row<false>(gate, value, in_stride, q, q_stride, scales, rows, hidden, scratch);
}

// nn_swiglu_fp8 with INT8 codes (scale amax / 127 a row): the input of an INT8 GEMM. Same arguments, grid and
// limits.
extern "C" __global__ void __maxnreg__(NN_SWIGLU_REGISTERS)
    nn_swiglu_int8(const bf16* __restrict__ gate, const bf16* __restrict__ value, int in_stride,
                   uint8_t* __restrict__ q, int q_stride, float* __restrict__ scales, int rows, int hidden) {
    __shared__ float scratch[32];
    swiglu_codes_row<true>(gate, value, in_stride, q, q_stride, scales, rows, hidden, scratch);
}

// nn_swiglu_fp8 with the gate half an INT8 GEMM's exact int32 products: the gate value of row r, column c is
// float(gate[r, c]) * (gate_row_scales[r] * gate_col_scales[c]) (the activation's and the weight's INT8 scales),
// rounded to bf16 as a bf16-output GEMM rounds it; the value half is bf16. value rows `value_stride` elements
// apart, gate rows `gate_stride` int32 apart (16-byte aligned, strides multiples of 4); hidden a multiple of 8 and
// <= 16384; the output as nn_swiglu_fp8's. Grid: `rows` blocks of ceil(hidden / 16) threads rounded up to a warp,
// NN_SWIGLU_I32GATE_SHARED_PER_THREAD bytes of dynamic shared memory a thread.
// A thread reads 7 bytes an output (2 of value, 4 of product, 1 written) against nn_swiglu_fp8's 5, so the kernel
// runs two blocks an SM to keep the memory busy while a block reduces and stores: at most 32 registers. It takes
// its chunks one after the other (one chunk's 80 bytes of loads in flight a thread, 143 KB an SM at 14336 columns,
// several times what the memory's latency needs) and parks each chunk's 8 results in shared memory (57 KB a block
// at 14336 columns) rather than in registers; the codes are those of holding the results in registers.
#define NN_SWIGLU_I32GATE_SHARED_PER_THREAD (NN_WIDE_CHUNKS * 8 * 4)
extern "C" __global__ void __launch_bounds__(NN_WIDE_MAX_THREADS, 2)
    nn_swiglu_i32gate_fp8(const bf16* __restrict__ value, int value_stride, const int32_t* __restrict__ gate,
                          int gate_stride, const float* __restrict__ gate_row_scales,
                          const float* __restrict__ gate_col_scales, uint8_t* __restrict__ q, int q_stride,
                          float* __restrict__ scales, int rows, int hidden) {
    __shared__ float scratch[32];
    // Chunk c of thread t at parked[(c * blockDim.x + t) * 2 + {0, 1}].
    extern __shared__ float4 parked[];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const bf16* value_row = value + static_cast<int64_t>(row) * value_stride;
    const int32_t* gate_row = gate + static_cast<int64_t>(row) * gate_stride;
    const float row_scale_of_gate = gate_row_scales[row];
    float amax = 0.0f;
#pragma unroll 1
    for (int c = 0; c < NN_WIDE_CHUNKS; ++c) {
        const int chunk = threadIdx.x + c * blockDim.x;
        const int col = chunk * 8;
        if (col >= hidden) break;
        const uint4 value_raw = *reinterpret_cast<const uint4*>(value_row + col);
        const int4 g0 = *reinterpret_cast<const int4*>(gate_row + col);
        const int4 g1 = *reinterpret_cast<const int4*>(gate_row + col + 4);
        const float4 w0 = *reinterpret_cast<const float4*>(gate_col_scales + col);
        const float4 w1 = *reinterpret_cast<const float4*>(gate_col_scales + col + 4);
        float out[8];
        unpack8(value_raw, out);
        const int g[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
        const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float gate_value = nn::round_bf16(static_cast<float>(g[i]) * (row_scale_of_gate * w[i]));
            out[i] = silu_f32(gate_value) * out[i];
            amax = fmaxf(amax, fabsf(out[i]));
        }
        parked[2 * chunk] = make_float4(out[0], out[1], out[2], out[3]);
        parked[2 * chunk + 1] = make_float4(out[4], out[5], out[6], out[7]);
    }
    const float scale = codes_scale<false>(block_max(amax, scratch));
    const float inv = 1.0f / scale;
    uint8_t* q_row = q + static_cast<int64_t>(row) * q_stride;
#pragma unroll 1
    for (int c = 0; c < NN_WIDE_CHUNKS; ++c) {
        const int chunk = threadIdx.x + c * blockDim.x;
        const int col = chunk * 8;
        if (col >= hidden) break;
        // Each thread reads back only what it parked.
        const float4 a = parked[2 * chunk];
        const float4 b = parked[2 * chunk + 1];
        const float values[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        store8_e4m3(q_row + col, values, inv);
    }
    if (threadIdx.x == 0) scales[row] = scale;
}
