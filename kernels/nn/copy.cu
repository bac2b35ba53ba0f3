// Embeddings and copies: sinusoidal timestep embedding, embedding gather, strided row copy, transpose, and a
// seeded uniform fill (benchmarks and tests). Kernel set nn_copy.
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

// Sinusoidal timestep embedding: for sample b and i < half = dim / 2, a = (t_scale * t[b]) *
// exp(-ln(max_period) * i / half); out[b, i] = cos(a), out[b, half + i] = sin(a). f32 with accurate
// expf/cosf/sinf. Grid: batch blocks of half threads (half <= 1024).
extern "C" __global__ void nn_timestep_embedding(const float* __restrict__ t, bf16* __restrict__ out, int batch,
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

// Copies embedding rows: out[r, :] = table[ids[r], :] for r < rows. An id outside [0, vocab) writes a zero
// row (the host validates ids first; this only keeps a bad id from reading out of bounds).
// Grid: (rows, ceil(cols / 8 / NN_ROW_THREADS)).
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_embed_gather(const bf16* __restrict__ table, int vocab, int cols, const int* __restrict__ ids, int rows,
                    bf16* __restrict__ out, int out_stride) {
    const int row = blockIdx.x;
    const int col = (blockIdx.y * NN_ROW_THREADS + threadIdx.x) * 8;
    if (row >= rows || col >= cols) return;
    const int id = ids[row];
    nn::Bf16x8* dst = reinterpret_cast<nn::Bf16x8*>(out + static_cast<int64_t>(row) * out_stride + col);
    if (id < 0 || id >= vocab) {
        const float zeros[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        nn::store8(reinterpret_cast<bf16*>(dst), zeros);
        return;
    }
    *dst = *reinterpret_cast<const nn::Bf16x8*>(table + static_cast<int64_t>(id) * cols + col);
}

// Copies a [rows, cols] bf16 block between row strides (cols, strides multiples of 8, 16-byte aligned).
// Grid: (rows, ceil(cols / 8 / NN_ROW_THREADS)).
extern "C" __global__ void __launch_bounds__(NN_ROW_THREADS)
    nn_copy_rows(const bf16* __restrict__ src, int src_stride, bf16* __restrict__ dst, int dst_stride, int rows,
                 int cols) {
    const int row = blockIdx.x;
    const int col = (blockIdx.y * NN_ROW_THREADS + threadIdx.x) * 8;
    if (row >= rows || col >= cols) return;
    *reinterpret_cast<nn::Bf16x8*>(dst + static_cast<int64_t>(row) * dst_stride + col) =
        *reinterpret_cast<const nn::Bf16x8*>(src + static_cast<int64_t>(row) * src_stride + col);
}

// dst[c, r] = src[r, c] for a dense [rows, cols] bf16 matrix. 32x32 tiles through shared memory.
// Grid: (ceil(cols / 32), ceil(rows / 32)), block (32, 8).
extern "C" __global__ void __launch_bounds__(256)
    nn_transpose(const bf16* __restrict__ src, bf16* __restrict__ dst, int rows, int cols) {
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
    nn_fill_uniform(bf16* __restrict__ out, int64_t n, uint64_t seed, float offset, float scale) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const uint64_t bits = splitmix64((seed << 32) + static_cast<uint64_t>(i));
        const float u = static_cast<float>(bits >> 40) * (1.0f / 8388608.0f) - 1.0f;
        out[i] = __float2bfloat16_rn(offset + scale * u);
    }
}
