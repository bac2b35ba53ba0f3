// Qwen-Image 2.1 VAE decoder: the non-GEMM steps of a channels-last (NHWC) decode. Convolutions are GEMMs
// (cuBLASLt) over the columns these kernels gather.
//
// Activations are bf16 `[pixels][cp]`, `cp` the channel count rounded up to a multiple of 8; the padding
// channels hold zeros and stay zero (their weights, biases and norm gammas are zero). Norm statistics and the
// softmax run in f32. Reductions run in a fixed order, so results are bit-identical from run to run.
//
// Every 16-byte access needs 16-byte aligned pointers and `cp` a multiple of 8 (the host checks both).
#include <cuda_bf16.h>
#include <stdint.h>

#include "common/common.cuh"

#define QV_THREADS 256
#define QV_WARPS (QV_THREADS / 32)

using nn::bf16;

// Unpacked, de-normalized latents: out[p, c] = packed[p, c] * std[c] + mean[c] for c < z, zero for the padding
// channels up to zp. `packed` is one image's [pixels, z] f32 block (token = row * w + col, already channels-last).
// Grid-stride over pixels * zp.
extern "C" __global__ void __launch_bounds__(QV_THREADS)
    qv_denormalize(const float* __restrict__ packed, int pixels, int z, const float* __restrict__ mean,
                   const float* __restrict__ stddev, bf16* __restrict__ out, int zp) {
    const int64_t total = static_cast<int64_t>(pixels) * zp;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t p = i / zp;
        const int c = static_cast<int>(i - p * zp);
        const float v = c < z ? packed[p * z + c] * stddev[c] + mean[c] : 0.0f;
        out[i] = __float2bfloat16_rn(v);
    }
}

// Channel RMS norm (F.normalize over channels, times sqrt(C) and gamma), optionally followed by SiLU:
// y[p, :] = act(x[p, :] / max(|x[p, :]|_2, 1e-12) * scale * gamma), scale = sqrt(C) of the true width.
// One warp per pixel; `y` may be `x` (in place). Grid: ceil(pixels / QV_WARPS) blocks of QV_THREADS.
extern "C" __global__ void __launch_bounds__(QV_THREADS)
    qv_rms_norm_silu(const bf16* x, bf16* y, const float* __restrict__ gamma, int pixels, int cp, float scale,
                     int silu) {
    const int lane = threadIdx.x & 31;
    const int64_t pixel = static_cast<int64_t>(blockIdx.x) * QV_WARPS + (threadIdx.x >> 5);
    if (pixel >= pixels) return;
    const bf16* in_row = x + pixel * cp;
    bf16* out_row = y + pixel * cp;
    float sq = 0.0f;
    for (int col = lane * 8; col < cp; col += 32 * 8) {
        float v[8];
        nn::load8(in_row + col, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) sq += v[i] * v[i];
    }
    sq = nn::warp_sum(sq);
    const float inv = scale / fmaxf(sqrtf(sq), 1e-12f);
    for (int col = lane * 8; col < cp; col += 32 * 8) {
        float v[8];
        nn::load8(in_row + col, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float t = v[i] * inv * gamma[col + i];
            if (silu) t = t / (1.0f + __expf(-t));
            v[i] = t;
        }
        nn::store8(out_row + col, v);
    }
}

// Columns of a 3x3 "same" convolution for output rows [row0, row0 + rows) of an out_h x out_w map:
// cols[(r * out_w + x) * 9 + tap][c] = src(y + ky - 1, x + kx - 1)[c] (zero outside the map), tap = ky * 3 + kx,
// r = y - row0. With `upsample` = 1 the source is a nearest 2x upsample of x ([out_h / 2, out_w / 2, cp]),
// read in place. Each thread moves one 8-channel chunk of one output pixel for all 9 taps: the index arithmetic
// (32-bit: the launcher bounds rows * out_w * cp / 8) is paid once per 9 copies, and a warp's stores for one tap
// cover whole runs of cp channels. Grid-stride over rows * out_w * cp / 8.
extern "C" __global__ void __launch_bounds__(QV_THREADS)
    qv_im2col3x3(const bf16* __restrict__ x, int cp, int out_h, int out_w, int upsample, int row0, int rows,
                 bf16* __restrict__ cols) {
    const unsigned chunks = static_cast<unsigned>(cp) >> 3;
    const unsigned width = static_cast<unsigned>(out_w);
    const int src_w = out_w >> upsample;
    const unsigned total = static_cast<unsigned>(rows) * width * chunks;
    const uint4* src = reinterpret_cast<const uint4*>(x);
    uint4* dst_all = reinterpret_cast<uint4*>(cols);
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const unsigned chunk = i % chunks;
        const unsigned pixel = i / chunks;
        const int yy = row0 + static_cast<int>(pixel / width);
        const int xx = static_cast<int>(pixel % width);
        uint4* dst = dst_all + static_cast<size_t>(pixel) * 9 * chunks + chunk;
        uint4 v[9];
#pragma unroll
        for (int tap = 0; tap < 9; ++tap) {
            const int sy = yy + tap / 3 - 1;
            const int sx = xx + tap % 3 - 1;
            v[tap] = make_uint4(0u, 0u, 0u, 0u);
            if (sy >= 0 && sy < out_h && sx >= 0 && sx < out_w) {
                v[tap] = src[(static_cast<size_t>(sy >> upsample) * src_w + (sx >> upsample)) * chunks + chunk];
            }
        }
#pragma unroll
        for (int tap = 0; tap < 9; ++tap) dst[tap * chunks] = v[tap];
    }
}

// The DupUp3D shortcut of a first frame: y is [2h, 2w, out_cp]; channel o < out_c at sub-pixel (i, j) of input
// pixel (py, px) copies input channel (((o * factor_t + factor_t - 1) * 2 + i) * 2 + j) / repeats; padding
// channels are zero. Grid-stride over 4 * h * w * out_cp.
extern "C" __global__ void __launch_bounds__(QV_THREADS)
    qv_dup_up(const bf16* __restrict__ x, int h, int w, int in_cp, int out_c, int out_cp, int factor_t, int repeats,
              bf16* __restrict__ y) {
    // 32-bit index arithmetic: the launcher bounds 4 * h * w * out_cp.
    const unsigned w2 = 2u * static_cast<unsigned>(w);
    const unsigned channels = static_cast<unsigned>(out_cp);
    const unsigned total = 4u * static_cast<unsigned>(h) * static_cast<unsigned>(w) * channels;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const int o = static_cast<int>(i % channels);
        const unsigned pixel = i / channels;
        const unsigned yy = pixel / w2;
        const unsigned xx = pixel % w2;
        bf16 value = __float2bfloat16_rn(0.0f);
        if (o < out_c) {
            const int sub = ((o * factor_t + factor_t - 1) * 2 + static_cast<int>(yy & 1u)) * 2 + static_cast<int>(xx & 1u);
            const int src_c = sub / repeats;
            value = x[(static_cast<size_t>(yy >> 1) * w + (xx >> 1)) * in_cp + src_c];
        }
        y[i] = value;
    }
}

// Nearest 2x upsample: y [2h, 2w, cp] with y[(yy, xx), :] = x[(yy / 2, xx / 2), :], the input of an upsample
// conv run as an implicit GEMM (which cannot fold the upsample into its loads as the column gather does). 16 bytes
// (8 channels) a thread; grid-stride over 4 * h * w * cp / 8 chunks (32-bit: the launcher bounds it).
extern "C" __global__ void __launch_bounds__(QV_THREADS)
    qv_upsample2x(const bf16* __restrict__ x, int h, int w, int cp, bf16* __restrict__ y) {
    const unsigned chunks = static_cast<unsigned>(cp) / 8u;
    const unsigned w2 = 2u * static_cast<unsigned>(w);
    const unsigned total = 4u * static_cast<unsigned>(h) * static_cast<unsigned>(w) * chunks;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const unsigned chunk = i % chunks;
        const unsigned pixel = i / chunks;
        const unsigned src = (pixel / w2 >> 1) * static_cast<unsigned>(w) + ((pixel % w2) >> 1);
        reinterpret_cast<uint4*>(y)[i] = reinterpret_cast<const uint4*>(x)[src * chunks + chunk];
    }
}

// The decoded image as 8-bit pixels, channel-interleaved (HWC): out[p * channels + c] = round(255 * v), v =
// clamp(clamp(y[p, c], -1, 1) / 2 + 0.5, 0, 1), from the f32 channels-last conv_out result y [pixels, cp]. The
// same f32 operations in the same order as the host's conversion of the clamped planes, so the bytes are equal.
// Grid-stride over pixels * channels (32-bit: the launcher bounds it).
extern "C" __global__ void __launch_bounds__(QV_THREADS)
    qv_image_u8(const float* __restrict__ y, int pixels, int channels, int cp, unsigned char* __restrict__ out) {
    const unsigned total = static_cast<unsigned>(pixels) * static_cast<unsigned>(channels);
    const unsigned n = static_cast<unsigned>(channels);
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const unsigned p = i / n;
        const unsigned c = i - p * n;
        const float image = fminf(fmaxf(y[static_cast<size_t>(p) * cp + c], -1.0f), 1.0f);
        const float v = fminf(fmaxf(__fadd_rn(__fdiv_rn(image, 2.0f), 0.5f), 0.0f), 1.0f);
        out[i] = static_cast<unsigned char>(roundf(__fmul_rn(v, 255.0f)));
    }
}

// Row softmax of attention scores (already scaled): p[r, :] = exp(s[r, :] - max) / sum, f32 math, bf16 out.
// One block of QV_THREADS per row. Grid: rows.
extern "C" __global__ void __launch_bounds__(QV_THREADS)
    qv_softmax_rows(const float* __restrict__ s, int cols, bf16* __restrict__ p) {
    __shared__ float scratch[32];
    const float* row = s + static_cast<int64_t>(blockIdx.x) * cols;
    bf16* out = p + static_cast<int64_t>(blockIdx.x) * cols;
    float m = -INFINITY;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, row[c]);
    m = nn::warp_max(m);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = m;
    __syncthreads();
    m = scratch[0];
    for (int wi = 1; wi < static_cast<int>(blockDim.x >> 5); ++wi) m = fmaxf(m, scratch[wi]);
    float sum = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) sum += __expf(row[c] - m);
    sum = nn::block_sum(sum, scratch);
    const float inv = 1.0f / sum;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) out[c] = __float2bfloat16_rn(__expf(row[c] - m) * inv);
}

// The decoded image: out[c, p] = clamp(y[p, c], -1, 1) for c < channels, from the f32 channels-last conv_out
// result y [pixels, cp] to one image's f32 planes. Grid-stride over channels * pixels.
extern "C" __global__ void __launch_bounds__(QV_THREADS)
    qv_planes_clamp(const float* __restrict__ y, int pixels, int channels, int cp, float* __restrict__ out) {
    const int64_t total = static_cast<int64_t>(pixels) * channels;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t c = i / pixels;
        const int64_t p = i - c * pixels;
        out[i] = fminf(fmaxf(y[p * cp + c], -1.0f), 1.0f);
    }
}
