// MiniMax H3 video VAE decoder: the non-GEMM steps that are the model's own. The ViT blocks run on the shared
// kernels (partial RoPE, attention at head dim 64, SwiGLU) and cuBLASLt GEMMs; these kernels build a batch of tile
// tokens in f32, normalize the f32 residual stream into the GEMMs' bf16 inputs, put the decoded tiles of a clip
// together (un-patchify, spatial blend, temporal cross-fade) and turn the video into the pipeline's 8-bit frames.
//
// Reductions run in a fixed order, so results are bit-identical from run to run. The blend and the final conversion
// use explicitly rounded multiplies and adds (no FMA contraction), as the reference computes them in f32.
#include <cuda_bf16.h>
#include <stdint.h>

#include "common/common.cuh"

#define H3V_THREADS 256
// Most latent channels the token kernel caches per row (checked by the host).
#define H3V_MAX_CHANNELS 1024

using nn::bf16;

// The tokens of `tiles` decoded tiles, `tokens` rows each: rows < voxels are proj_in of a latent voxel, then the
// `registers` learned tokens, then one zero token. Tile b's voxel v = (f, y, x) (f-major) reads the post-quant
// latent at (f0 + f, y0 + y, x0 + x) of the channels-last volume `latents` [frames][height][width][channels],
// with (f0, y0, x0) = origins[3 b ..]. x[row, d] = bias[d] + sum_c weight_t[c, d] * z[c] (f32, c ascending;
// `weight_t` is proj_in's weight transposed, [channels][dim], so neighbouring threads read neighbouring values).
// Grid: tiles * tokens blocks of H3V_THREADS.
extern "C" __global__ void __launch_bounds__(H3V_THREADS)
    h3v_tokens(const float* __restrict__ latents, int height, int width, int channels, const int* __restrict__ origins,
               int tile_frames, int tile_rows, int tile_cols, int registers, const float* __restrict__ weight_t,
               const float* __restrict__ bias, const float* __restrict__ register_tokens, int dim,
               float* __restrict__ x) {
    __shared__ float z[H3V_MAX_CHANNELS];
    const int tokens = tile_frames * tile_rows * tile_cols + registers + 1;
    const int64_t row = blockIdx.x;
    const int tile = static_cast<int>(row / tokens);
    const int token = static_cast<int>(row - static_cast<int64_t>(tile) * tokens);
    const int voxels = tile_frames * tile_rows * tile_cols;
    float* out = x + row * dim;
    if (token >= voxels) {
        const int r = token - voxels;
        for (int d = threadIdx.x; d < dim; d += blockDim.x) {
            out[d] = r < registers ? register_tokens[static_cast<int64_t>(r) * dim + d] : 0.0f;
        }
        return;
    }
    const int f = token / (tile_rows * tile_cols);
    const int rest = token - f * tile_rows * tile_cols;
    const int y = rest / tile_cols;
    const int xx = rest - y * tile_cols;
    const int64_t voxel = (static_cast<int64_t>(origins[3 * tile] + f) * height + origins[3 * tile + 1] + y) * width +
                          origins[3 * tile + 2] + xx;
    for (int c = threadIdx.x; c < channels; c += blockDim.x) z[c] = latents[voxel * channels + c];
    __syncthreads();
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int c = 0; c < channels; ++c) acc = fmaf(weight_t[static_cast<int64_t>(c) * dim + d], z[c], acc);
        out[d] = acc + bias[d];
    }
}

// Row norm of the f32 residual stream into a bf16 GEMM input, f32 throughout:
//   layer_norm 0 (RMSNorm):   y = bf16(x * rsqrt(mean(x^2) + eps) * weight)
//   layer_norm 1 (LayerNorm): y = bf16((x - mean) * rsqrt(var + eps) * weight + bias)
// x [rows][cols] f32, y [rows][cols] bf16, weight / bias f32 [cols]. One block of H3V_THREADS per row.
extern "C" __global__ void __launch_bounds__(H3V_THREADS)
    h3v_norm(const float* __restrict__ x, bf16* __restrict__ y, const float* __restrict__ weight,
             const float* __restrict__ bias, int cols, float eps, int layer_norm) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const float* in = x + row * cols;
    bf16* out = y + row * cols;
    float mean = 0.0f;
    if (layer_norm) {
        float s = 0.0f;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) s += in[c];
        mean = nn::block_sum(s, scratch) / cols;
    }
    float sq = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float d = in[c] - mean;
        sq += d * d;
    }
    const float r = rsqrtf(nn::block_sum(sq, scratch) / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = (in[c] - mean) * r * weight[c];
        if (layer_norm) v += bias[c];
        out[c] = __float2bfloat16_rn(v);
    }
}

__device__ __forceinline__ float blend(float a, float b, int p, int extent) {
    const float wb = __fdiv_rn(static_cast<float>(p), static_cast<float>(extent));
    const float wa = __fsub_rn(1.0f, wb);
    return __fadd_rn(__fmul_rn(a, wa), __fmul_rn(b, wb));
}

// The tile grid of a clip: `ny` row starts, `ny - 1` row overlaps, `nx` column starts, `nx - 1` column overlaps
// (pixels), in that order in `grid`.
struct TileGrid {
    const int* ys;
    const int* y_overlap;
    const int* xs;
    const int* x_overlap;
    int ny;
    int nx;
};

// Output value (channel ch, clip frame t, tile-local y, x) of tile (i, j): proj_out row of the voxel token, column
// of the pixel in its patch. `out` rows are `tokens` per tile, tile (i, j) at index tile0 + i * nx + j.
__device__ __forceinline__ float tile_value(const float* __restrict__ out, int64_t tile, int tokens, int patch,
                                            int tile_rows, int tile_cols, int pt, int ps, int ch, int t, int y, int x) {
    const int token = ((t / pt) * tile_rows + y / ps) * tile_cols + x / ps;
    const int col = ((ch * pt + t % pt) * ps + y % ps) * ps + x % ps;
    return out[(tile * tokens + token) * patch + col];
}

// One clip of decoded tiles into the video: for every clip frame t and pixel (y, x), the stitched value (the tile
// whose kept region holds the pixel, blended over its overlap with the original tile above, then with the original
// tile to the left, as `_stitch_tiles`), placed as `_decode` places it:
//   t in [pre, chunk_frames):         video frame clip * head + t - pre; its first `blend_frames` frames are
//                                     cross-faded from what the previous clip's overlap left there (clip > 0);
//   t >= chunk_frames + pre (tail):   video frame (clip + 1) * head + t - chunk_frames - pre, written as is;
// frames at or past `video_frames` (the padding latents' frames) are not written.
// `out`: f32 proj_out rows; `video`: f32 [video_frames][height][width][channels]. Grid-stride over clip_frames *
// height * width pixels.
extern "C" __global__ void __launch_bounds__(H3V_THREADS)
    h3v_assemble(const float* __restrict__ out, int tile0, int tokens, int patch, const int* __restrict__ grid,
                 int ny, int nx, int tile_h, int tile_w, int tile_rows, int tile_cols, int pt, int ps, int channels,
                 int clip, int clip_frames, int pre, int chunk_frames, int head, int tail, int blend_frames,
                 float* video, int video_frames, int height, int width) {
    const TileGrid g{grid, grid + ny, grid + 2 * ny - 1, grid + 2 * ny - 1 + nx, ny, nx};
    const int64_t total = static_cast<int64_t>(clip_frames) * height * width;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int x = static_cast<int>(i % width);
        const int64_t rest = i / width;
        const int y = static_cast<int>(rest % height);
        const int t = static_cast<int>(rest / height);
        int frame;
        bool fade = false;
        if (t >= pre && t < chunk_frames) {
            frame = clip * head + t - pre;
            fade = clip > 0 && t - pre < blend_frames;
        } else if (tail > 0 && t >= chunk_frames + pre && t < chunk_frames + pre + tail) {
            frame = (clip + 1) * head + t - chunk_frames - pre;
        } else {
            continue;
        }
        if (frame >= video_frames) continue;
        int ti = 0;
        while (ti + 1 < g.ny && g.ys[ti + 1] <= y) ++ti;
        int tj = 0;
        while (tj + 1 < g.nx && g.xs[tj + 1] <= x) ++tj;
        const int ly = y - g.ys[ti];
        const int lx = x - g.xs[tj];
        const int64_t here = tile0 + static_cast<int64_t>(ti) * g.nx + tj;
        float* dst = video + ((static_cast<int64_t>(frame) * height + y) * width + x) * channels;
        for (int ch = 0; ch < channels; ++ch) {
            float v = tile_value(out, here, tokens, patch, tile_rows, tile_cols, pt, ps, ch, t, ly, lx);
            if (ti > 0) {
                const int ext = min(g.y_overlap[ti - 1], tile_h);
                if (ly < ext) {
                    const float a = tile_value(out, here - g.nx, tokens, patch, tile_rows, tile_cols, pt, ps, ch, t,
                                               tile_h - ext + ly, lx);
                    v = blend(a, v, ly, ext);
                }
            }
            if (tj > 0) {
                const int ext = min(g.x_overlap[tj - 1], tile_w);
                if (lx < ext) {
                    const float a = tile_value(out, here - 1, tokens, patch, tile_rows, tile_cols, pt, ps, ch, t, ly,
                                               tile_w - ext + lx);
                    v = blend(a, v, lx, ext);
                }
            }
            if (fade) v = blend(dst[ch], v, t - pre, blend_frames);
            dst[ch] = v;
        }
    }
}

// The pipeline's frames from the decoded video (3 channels, channels-last, in place): v = clamp(x * std + mean, 0,
// 1) per channel, rgb = round(v * 255) with ties to even. Grid-stride over n pixels.
extern "C" __global__ void __launch_bounds__(H3V_THREADS)
    h3v_frames(float* video, unsigned char* __restrict__ rgb, int64_t pixels, float mean0, float mean1, float mean2,
               float std0, float std1, float std2) {
    const float mean[3] = {mean0, mean1, mean2};
    const float stddev[3] = {std0, std1, std2};
    const int64_t total = pixels * 3;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int c = static_cast<int>(i % 3);
        float v = __fadd_rn(__fmul_rn(video[i], stddev[c]), mean[c]);
        v = fminf(fmaxf(v, 0.0f), 1.0f);
        video[i] = v;
        rgb[i] = static_cast<unsigned char>(rintf(__fmul_rn(v, 255.0f)));
    }
}
