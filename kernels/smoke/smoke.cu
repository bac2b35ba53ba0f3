// Smoke kernels: prove the kernel toolchain (headers, targets, SASS checks) end to end.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include "smoke.cuh"

// y[i] = a * x[i] + y[i] for i < n.
extern "C" __global__ void tf_smoke_axpy_f32(float a, const float* __restrict__ x, float* __restrict__ y,
                                             unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = tf_smoke::axpy(a, x[i], y[i]);
    }
}

// One warp computes c[16x16] (f32, row-major) = a[16x16] (bf16, row-major) * b[16x16] (bf16, column-major)
// on tensor cores. Launch with one block of 32 threads.
extern "C" __global__ void tf_smoke_mma_bf16(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b,
                                             float* __restrict__ c) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    using namespace nvcuda;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
    wmma::fill_fragment(fc, 0.0f);
    wmma::load_matrix_sync(fa, a, 16);
    wmma::load_matrix_sync(fb, b, 16);
    wmma::mma_sync(fc, fa, fb, fc);
    wmma::store_matrix_sync(c, fc, 16, wmma::mem_row_major);
#endif
}

// Converts n halves to floats (exercises <cuda_fp16.h>).
extern "C" __global__ void tf_smoke_half_to_f32(const __half* __restrict__ x, float* __restrict__ y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = __half2float(x[i]);
    }
}
