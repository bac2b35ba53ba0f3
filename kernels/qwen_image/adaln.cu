// Qwen-Image DiT elementwise and normalisation kernels.
//
// Storage is bf16, arithmetic f32, and every result is rounded to bf16 once (the QK-norm kernel rounds
// where the reference model does, see there). Reductions run in a fixed order (warp butterflies, then warp
// totals in ascending order), so results are bit-identical from run to run. No fast-math.
//
// Row kernels (adaln, rms norm, gated residual, copy rows, swiglu, qk norm) need 16-byte aligned rows:
// pointers aligned to 16 bytes, row strides and column counts multiples of 8 elements. Row-normalising
// kernels run one block of QI_ROW_THREADS threads per row and hold the row in registers, so
// cols <= QI_ROW_THREADS * 8 * QI_ROW_CHUNKS (8192).
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"

#define QI_ROW_THREADS 256
#define QI_ROW_CHUNKS 4

using qi::bf16;

namespace {

// Loads one row into registers: chunk c of this thread is columns (threadIdx.x + c * QI_ROW_THREADS) * 8
// .. + 8; columns past `cols` read as 0. Returns this thread's f32 sum of the loaded values.
__device__ __forceinline__ float load_row(const bf16* row, int cols, float (&v)[QI_ROW_CHUNKS][8]) {
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < QI_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * QI_ROW_THREADS) * 8;
        if (col < cols) {
            qi::load8(row + col, v[c]);
#pragma unroll
            for (int i = 0; i < 8; ++i) sum += v[c][i];
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) v[c][i] = 0.0f;
        }
    }
    return sum;
}

__device__ __forceinline__ float silu_f32(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ float gelu_tanh_f32(float x) {
    const float k_sqrt_2_over_pi = 0.7978845608028654f;
    const float inner = k_sqrt_2_over_pi * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + tanhf(inner));
}

}  // namespace

// y = LayerNorm(x) * (1 + scale): LayerNorm without affine, statistics in f32 (the mean, then the mean of
// squared deviations). The scale of row r is mod[m * mod_stride + mod_offset + col], m the modulation row
// of r (qi::modulation_row). Grid: `rows` blocks of QI_ROW_THREADS threads.
extern "C" __global__ void __launch_bounds__(QI_ROW_THREADS)
    qi_adaln_modulate(const bf16* __restrict__ x, int x_stride, bf16* __restrict__ y, int y_stride,
                      const bf16* __restrict__ mod, int mod_stride, int mod_offset, int rows, int cols,
                      int seq_len, int target_begin, int prefix_row, float eps) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    float v[QI_ROW_CHUNKS][8];
    const float inv_cols = 1.0f / static_cast<float>(cols);
    const float mean = qi::block_sum(load_row(x + static_cast<int64_t>(row) * x_stride, cols, v), scratch) * inv_cols;
    float sq = 0.0f;
#pragma unroll
    for (int c = 0; c < QI_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * QI_ROW_THREADS) * 8;
        if (col < cols) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float d = v[c][i] - mean;
                sq += d * d;
            }
        }
    }
    const float var = qi::block_sum(sq, scratch) * inv_cols;
    const float rstd = rsqrtf(var + eps);
    const int m = qi::modulation_row(row, seq_len, target_begin, prefix_row);
    const bf16* scale_row = mod + static_cast<int64_t>(m) * mod_stride + mod_offset;
    bf16* out_row = y + static_cast<int64_t>(row) * y_stride;
#pragma unroll
    for (int c = 0; c < QI_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * QI_ROW_THREADS) * 8;
        if (col < cols) {
            float s[8];
            qi::load8(scale_row + col, s);
            float o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = (v[c][i] - mean) * rstd * (1.0f + s[i]);
            qi::store8(out_row + col, o);
        }
    }
}

// Zero-centred RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (1 + weight[col]), in f32 (the checkpoint stores
// scale - 1). Grid: `rows` blocks of QI_ROW_THREADS threads.
extern "C" __global__ void __launch_bounds__(QI_ROW_THREADS)
    qi_rms_norm_zc(const bf16* __restrict__ x, int x_stride, bf16* __restrict__ y, int y_stride,
                   const bf16* __restrict__ weight, int rows, int cols, float eps) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    float v[QI_ROW_CHUNKS][8];
    load_row(x + static_cast<int64_t>(row) * x_stride, cols, v);
    float sq = 0.0f;
#pragma unroll
    for (int c = 0; c < QI_ROW_CHUNKS; ++c) {
#pragma unroll
        for (int i = 0; i < 8; ++i) sq += v[c][i] * v[c][i];
    }
    const float ms = qi::block_sum(sq, scratch) / static_cast<float>(cols);
    const float r = rsqrtf(ms + eps);
    bf16* out_row = y + static_cast<int64_t>(row) * y_stride;
#pragma unroll
    for (int c = 0; c < QI_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * QI_ROW_THREADS) * 8;
        if (col < cols) {
            float w[8];
            qi::load8(weight + col, w);
            float o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = v[c][i] * r * (1.0f + w[i]);
            qi::store8(out_row + col, o);
        }
    }
}

// x += tanh(gate) * y in f32 (one fma), the gate of row r taken from its modulation row like
// qi_adaln_modulate. In place on x. Grid: (rows, ceil(cols / 8 / QI_ROW_THREADS)).
extern "C" __global__ void __launch_bounds__(QI_ROW_THREADS)
    qi_gated_residual(bf16* __restrict__ x, int x_stride, const bf16* __restrict__ y, int y_stride,
                      const bf16* __restrict__ mod, int mod_stride, int mod_offset, int rows, int cols,
                      int seq_len, int target_begin, int prefix_row) {
    const int row = blockIdx.x;
    const int col = (blockIdx.y * QI_ROW_THREADS + threadIdx.x) * 8;
    if (row >= rows || col >= cols) return;
    const int m = qi::modulation_row(row, seq_len, target_begin, prefix_row);
    float g[8], a[8], b[8];
    qi::load8(mod + static_cast<int64_t>(m) * mod_stride + mod_offset + col, g);
    bf16* x_at = x + static_cast<int64_t>(row) * x_stride + col;
    qi::load8(x_at, a);
    qi::load8(y + static_cast<int64_t>(row) * y_stride + col, b);
#pragma unroll
    for (int i = 0; i < 8; ++i) a[i] = fmaf(tanhf(g[i]), b[i], a[i]);
    qi::store8(x_at, a);
}

// Gated residual then the next adaLN, in one pass over the row: x += tanh(gate) * y (stored, rounded to bf16),
// then out = LayerNorm(x) * (1 + scale) from the rounded x, exactly as qi_gated_residual followed by
// qi_adaln_modulate. Gate and scale come from the same modulation rows at two offsets. Grid: `rows` blocks.
extern "C" __global__ void __launch_bounds__(QI_ROW_THREADS)
    qi_gated_residual_adaln(bf16* __restrict__ x, int x_stride, const bf16* __restrict__ y, int y_stride,
                            bf16* __restrict__ out, int out_stride, const bf16* __restrict__ mod, int mod_stride,
                            int gate_offset, int scale_offset, int rows, int cols, int seq_len, int target_begin,
                            int prefix_row, float eps) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const int m = qi::modulation_row(row, seq_len, target_begin, prefix_row);
    const bf16* mod_row = mod + static_cast<int64_t>(m) * mod_stride;
    bf16* x_row = x + static_cast<int64_t>(row) * x_stride;
    const bf16* y_row = y + static_cast<int64_t>(row) * y_stride;
    float v[QI_ROW_CHUNKS][8];
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < QI_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * QI_ROW_THREADS) * 8;
        if (col < cols) {
            float g[8], b[8];
            qi::load8(mod_row + gate_offset + col, g);
            qi::load8(x_row + col, v[c]);
            qi::load8(y_row + col, b);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[c][i] = qi::round_bf16(fmaf(tanhf(g[i]), b[i], v[c][i]));
            qi::store8(x_row + col, v[c]);
#pragma unroll
            for (int i = 0; i < 8; ++i) sum += v[c][i];
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) v[c][i] = 0.0f;
        }
    }
    const float inv_cols = 1.0f / static_cast<float>(cols);
    const float mean = qi::block_sum(sum, scratch) * inv_cols;
    float sq = 0.0f;
#pragma unroll
    for (int c = 0; c < QI_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * QI_ROW_THREADS) * 8;
        if (col < cols) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float d = v[c][i] - mean;
                sq += d * d;
            }
        }
    }
    const float var = qi::block_sum(sq, scratch) * inv_cols;
    const float rstd = rsqrtf(var + eps);
    bf16* out_row = out + static_cast<int64_t>(row) * out_stride;
#pragma unroll
    for (int c = 0; c < QI_ROW_CHUNKS; ++c) {
        const int col = (threadIdx.x + c * QI_ROW_THREADS) * 8;
        if (col < cols) {
            float s[8];
            qi::load8(mod_row + scale_offset + col, s);
            float o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = (v[c][i] - mean) * rstd * (1.0f + s[i]);
            qi::store8(out_row + col, o);
        }
    }
}

// SwiGLU on a fused gate|up GEMM output: out[r, c] = silu(gate_up[r, c]) * gate_up[r, hidden + c], c <
// hidden. Grid: (rows, ceil(hidden / 8 / QI_ROW_THREADS)).
extern "C" __global__ void __launch_bounds__(QI_ROW_THREADS)
    qi_swiglu(const bf16* __restrict__ gate_up, int gate_up_stride, bf16* __restrict__ out, int out_stride, int rows,
              int hidden) {
    const int row = blockIdx.x;
    const int col = (blockIdx.y * QI_ROW_THREADS + threadIdx.x) * 8;
    if (row >= rows || col >= hidden) return;
    const bf16* in_row = gate_up + static_cast<int64_t>(row) * gate_up_stride;
    float g[8], u[8];
    qi::load8(in_row + col, g);
    qi::load8(in_row + hidden + col, u);
#pragma unroll
    for (int i = 0; i < 8; ++i) g[i] = silu_f32(g[i]) * u[i];
    qi::store8(out + static_cast<int64_t>(row) * out_stride + col, g);
}

// Elementwise y = gelu_tanh(x) over n values (y may alias x). Any n; pointers 16-byte aligned.
// Grid-stride over 8-value chunks.
extern "C" __global__ void __launch_bounds__(QI_ROW_THREADS)
    qi_gelu_tanh(const bf16* x, bf16* y, int64_t n) {
    const int64_t chunks = (n + 7) / 8;
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t base = c * 8;
        if (base + 8 <= n) {
            float v[8];
            qi::load8(x + base, v);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = gelu_tanh_f32(v[i]);
            qi::store8(y + base, v);
        } else {
            for (int64_t i = base; i < n; ++i) y[i] = __float2bfloat16_rn(gelu_tanh_f32(__bfloat162float(x[i])));
        }
    }
}

// Elementwise y = silu(x) = x / (1 + exp(-x)) over n values (y may alias x), like qi_gelu_tanh.
extern "C" __global__ void __launch_bounds__(QI_ROW_THREADS) qi_silu(const bf16* x, bf16* y, int64_t n) {
    const int64_t chunks = (n + 7) / 8;
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t base = c * 8;
        if (base + 8 <= n) {
            float v[8];
            qi::load8(x + base, v);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = silu_f32(v[i]);
            qi::store8(y + base, v);
        } else {
            for (int64_t i = base; i < n; ++i) y[i] = __float2bfloat16_rn(silu_f32(__bfloat162float(x[i])));
        }
    }
}

// Sinusoidal timestep embedding: for sample b and i < half = dim / 2, a = (t_scale * t[b]) *
// exp(-ln(max_period) * i / half); out[b, i] = cos(a), out[b, half + i] = sin(a). f32 with accurate
// expf/cosf/sinf. Grid: batch blocks of half threads (half <= 1024).
extern "C" __global__ void qi_timestep_embedding(const float* __restrict__ t, bf16* __restrict__ out, int batch,
                                                 int dim, float t_scale, float max_period) {
    const int b = blockIdx.x;
    const int half = dim / 2;
    const int i = threadIdx.x;
    if (b >= batch || i >= half) return;
    const float freq = expf(-logf(max_period) * static_cast<float>(i) / static_cast<float>(half));
    const float arg = (t_scale * t[b]) * freq;
    bf16* row = out + static_cast<int64_t>(b) * dim;
    row[i] = __float2bfloat16_rn(cosf(arg));
    row[half + i] = __float2bfloat16_rn(sinf(arg));
}

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
    qi_qk_norm_rope(const bf16* __restrict__ qkv, int qkv_stride, int rows, int heads,
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
        const float sq = qi::warp_sum(x01.x * x01.x + x01.y * x01.y + x23.x * x23.x + x23.y * x23.y);
        const float r = rsqrtf(sq * (1.0f / 128.0f) + eps);
        const float n0 = qi::round_bf16(qi::round_bf16(x01.x * r) * w01.x);
        const float n1 = qi::round_bf16(qi::round_bf16(x01.y * r) * w01.y);
        const float n2 = qi::round_bf16(qi::round_bf16(x23.x * r) * w23.x);
        const float n3 = qi::round_bf16(qi::round_bf16(x23.y * r) * w23.y);
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

// Copies a [rows, cols] bf16 block between row strides (cols, strides multiples of 8, 16-byte aligned).
// Grid: (rows, ceil(cols / 8 / QI_ROW_THREADS)).
extern "C" __global__ void __launch_bounds__(QI_ROW_THREADS)
    qi_copy_rows(const bf16* __restrict__ src, int src_stride, bf16* __restrict__ dst, int dst_stride, int rows,
                 int cols) {
    const int row = blockIdx.x;
    const int col = (blockIdx.y * QI_ROW_THREADS + threadIdx.x) * 8;
    if (row >= rows || col >= cols) return;
    *reinterpret_cast<qi::Bf16x8*>(dst + static_cast<int64_t>(row) * dst_stride + col) =
        *reinterpret_cast<const qi::Bf16x8*>(src + static_cast<int64_t>(row) * src_stride + col);
}

// dst[c, r] = src[r, c] for a dense [rows, cols] bf16 matrix. 32x32 tiles through shared memory.
// Grid: (ceil(cols / 32), ceil(rows / 32)), block (32, 8).
extern "C" __global__ void __launch_bounds__(256)
    qi_transpose(const bf16* __restrict__ src, bf16* __restrict__ dst, int rows, int cols) {
    __shared__ bf16 tile[32][33];
    const int c0 = blockIdx.x * 32;
    const int r0 = blockIdx.y * 32;
#pragma unroll
    for (int i = threadIdx.y; i < 32; i += 8) {
        const int r = r0 + i;
        const int c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[i][threadIdx.x] = src[static_cast<int64_t>(r) * cols + c];
    }
    __syncthreads();
#pragma unroll
    for (int i = threadIdx.y; i < 32; i += 8) {
        const int c = c0 + i;
        const int r = r0 + threadIdx.x;
        if (r < rows && c < cols) dst[static_cast<int64_t>(c) * rows + r] = tile[threadIdx.x][i];
    }
}
