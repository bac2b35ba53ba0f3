// Activations: SwiGLU of a fused GEMM output (either half order), gelu_tanh and silu. Kernel set nn_act.
//
// Storage is bf16, arithmetic f32. Reductions run in a fixed order (warp butterflies, then warp totals in
// ascending order), so results are bit-identical from run to run. No fast-math. Row kernels need 16-byte aligned
// rows: pointers aligned to 16 bytes, row strides and column counts multiples of 8 elements.
#include <cuda_bf16.h>
#include <stdint.h>

#include "common/common.cuh"

#define NN_ROW_THREADS 256
#define NN_ROW_CHUNKS 4

using nn::bf16;

namespace {

__device__ __forceinline__ float silu_f32(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ float gelu_tanh_f32(float x) {
    const float k_sqrt_2_over_pi = 0.7978845608028654f;
    const float inner = k_sqrt_2_over_pi * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + tanhf(inner));
}

}  // namespace

namespace {

// SwiGLU of one 8-column chunk of a row: out[r, c] = silu(gate[r, c]) * value[r, c] for c < hidden, the halves read
// at `gate` and `value` with one row stride (two halves of a fused GEMM output row, or two matrices).
__device__ __forceinline__ void swiglu_chunk(const bf16* __restrict__ gate, const bf16* __restrict__ value,
                                             int in_stride, bf16* __restrict__ out, int out_stride, int rows,
                                             int hidden) {
    const int row = blockIdx.x;
    const int col = (blockIdx.y * NN_ROW_THREADS + threadIdx.x) * 8;
    if (row >= rows || col >= hidden) return;
    const int64_t at = static_cast<int64_t>(row) * in_stride + col;
    float g[8], u[8];
    nn::load8(gate + at, g);
    nn::load8(value + at, u);
#pragma unroll
    for (int i = 0; i < 8; ++i) g[i] = silu_f32(g[i]) * u[i];
    nn::store8(out + static_cast<int64_t>(row) * out_stride + col, g);
}

}  // namespace

// SwiGLU on a fused gate|up GEMM output: out[r, c] = silu(gate_up[r, c]) * gate_up[r, hidden + c], c <
// hidden. Grid: (rows, ceil(hidden / 8 / NN_ROW_THREADS)).
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_swiglu(const bf16* __restrict__ gate_up, int gate_up_stride, bf16* __restrict__ out, int out_stride, int rows,
              int hidden) {
    swiglu_chunk(gate_up, gate_up + hidden, gate_up_stride, out, out_stride, rows, hidden);
}

// SwiGLU on a fused value|gate GEMM output: out[r, c] = silu(value_gate[r, hidden + c]) * value_gate[r, c], c <
// hidden. Grid as nn_swiglu.
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_swiglu_value_gate(const bf16* __restrict__ value_gate, int value_gate_stride, bf16* __restrict__ out,
                         int out_stride, int rows, int hidden) {
    swiglu_chunk(value_gate + hidden, value_gate, value_gate_stride, out, out_stride, rows, hidden);
}

// SwiGLU on halves held apart (a projection run as two GEMMs): out[r, c] = silu(gate[r, c]) * value[r, c], both
// inputs with row stride in_stride. Grid as nn_swiglu.
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_swiglu_apart(const bf16* __restrict__ gate, const bf16* __restrict__ value, int in_stride,
                    bf16* __restrict__ out, int out_stride, int rows, int hidden) {
    swiglu_chunk(gate, value, in_stride, out, out_stride, rows, hidden);
}

// Elementwise y = gelu_tanh(x) over n values (y may alias x). Any n; pointers 16-byte aligned.
// Grid-stride over 8-value chunks.
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_gelu_tanh(const bf16* x, bf16* y, int64_t n) {
    const int64_t chunks = (n + 7) / 8;
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t base = c * 8;
        if (base + 8 <= n) {
            float v[8];
            nn::load8(x + base, v);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = gelu_tanh_f32(v[i]);
            nn::store8(y + base, v);
        } else {
            for (int64_t i = base; i < n; ++i) y[i] = __float2bfloat16_rn(gelu_tanh_f32(__bfloat162float(x[i])));
        }
    }
}

// Elementwise y = silu(x) = x / (1 + exp(-x)) over n values (y may alias x), like nn_gelu_tanh.
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS) nn_silu(const bf16* x, bf16* y, int64_t n) {
    const int64_t chunks = (n + 7) / 8;
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t base = c * 8;
        if (base + 8 <= n) {
            float v[8];
            nn::load8(x + base, v);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = silu_f32(v[i]);
            nn::store8(y + base, v);
        } else {
            for (int64_t i = base; i < n; ++i) y[i] = __float2bfloat16_rn(silu_f32(__bfloat162float(x[i])));
        }
    }
}
