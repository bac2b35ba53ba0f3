// MiniMax H3 audio VAE decoder (BigVGAN), f32 throughout as the reference pins it.
//
// Activations are f32 `[batch][channels][len]` (channels-first, as the reference). Convolutions run as implicit
// GEMMs on CUDA cores: an output tile of BM channels x BN positions per block, the weights of BKC input channels
// and the input window those positions read staged in shared memory, each thread accumulating a TM x TN sub-tile
// in registers. Weights are stored k-major, `wt[(ci * K + j) * cout + co]`, so a tile's weight rows are
// contiguous. A transposed convolution is run as `stride` plain convolutions, one per output phase, over
// phase-reordered weights (the host builds them); the kernel's output mapping `t = out_offset + n * out_stride`
// places each phase's outputs.
//
// The epilogue adds the bias, a residual, scales, accumulates into the output and clamps, as flags say: an AMP
// unit's second convolution adds its residual in place, a block's last one adds its share into the stage sum,
// conv_post clamps. Each output element is read and written by one thread only, so `res` may be `out`.
//
// h3a_snake_aa fuses the anti-aliased SnakeBeta: 2x up-sampling by a 12-tap transposed filter over a
// replicate-padded input, SnakeBeta, and the 12-tap low-pass 2x down-sampling, one row segment per block with
// the input window and the up-sampled segment in shared memory (one read and one write of the activation).
//
// Every accumulation runs in a fixed order: results are bit-identical from run to run.
#include <stdint.h>

#define H3A_THREADS 256

// ------------------------------------------------------------------------------------------------------------
// Convolution, tiled.
// ------------------------------------------------------------------------------------------------------------

// Input channels staged per shared-memory step.
#define H3A_BKC 8

struct ConvArgs {
    const float* x;     // [batch, cin, in_len]
    const float* wt;    // [cin * k, cout]
    const float* bias;  // [cout] or null
    const float* res;   // [batch, cout, out_len] or null
    float* out;         // [batch, cout, out_len]
    int cin, cout, k, dil;
    int in_len, in_offset, in_stride;  // input position of output n, tap j: n * in_stride + in_offset + j * dil
    int n_out, out_offset, out_stride, out_len;  // output position of n: out_offset + n * out_stride
    float scale;
    int accumulate, clamp;
};

__device__ __forceinline__ void epilogue(const ConvArgs& a, int b, int co, int n, float acc) {
    const int64_t t = static_cast<int64_t>(a.out_offset) + static_cast<int64_t>(n) * a.out_stride;
    const int64_t idx = (static_cast<int64_t>(b) * a.cout + co) * a.out_len + t;
    float v = acc;
    if (a.bias) v += a.bias[co];
    if (a.res) v += a.res[idx];
    v *= a.scale;
    if (a.accumulate) v += a.out[idx];
    if (a.clamp) v = fminf(fmaxf(v, -1.0f), 1.0f);
    a.out[idx] = v;
}

// Grid: (ceil(n_out / BN), ceil(cout / BM), batch); H3A_THREADS threads; dynamic shared memory
// H3A_BKC * (k * BM + window) floats, window = (BN - 1) * in_stride + (k - 1) * dil + 1 (the host computes it).
template <int BM, int BN, int TM, int TN>
__device__ __forceinline__ void conv_tiled(const ConvArgs& a) {
    static_assert((BM / TM) * (BN / TN) == H3A_THREADS, "one sub-tile per thread");
    constexpr int NX = BN / TN;  // threads along positions
    extern __shared__ __align__(16) float smem[];
    const int k = a.k;
    const int window = (BN - 1) * a.in_stride + (k - 1) * a.dil + 1;
    float* ws = smem;                      // [H3A_BKC * k][BM]
    float* xs = smem + H3A_BKC * k * BM;   // [H3A_BKC][window]

    const int tid = threadIdx.x;
    const int tx = tid % NX;
    const int ty = tid / NX;
    const int n0 = blockIdx.x * BN;
    const int co0 = blockIdx.y * BM;
    const int b = blockIdx.z;
    const float* xb = a.x + static_cast<int64_t>(b) * a.cin * a.in_len;
    const int64_t in0 = static_cast<int64_t>(n0) * a.in_stride + a.in_offset;

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;

    for (int c0 = 0; c0 < a.cin; c0 += H3A_BKC) {
        // Weights: rows (c0 + c) * k + j, columns co0 .. co0 + BM (zeros past cin / cout).
        const int wrows = H3A_BKC * k;
        for (int idx = tid; idx < wrows * BM; idx += H3A_THREADS) {
            const int r = idx / BM;
            const int m = idx - r * BM;
            const int ci = c0 + r / k;
            const int co = co0 + m;
            float v = 0.0f;
            if (ci < a.cin && co < a.cout) v = a.wt[(static_cast<int64_t>(c0) * k + r) * a.cout + co];
            ws[idx] = v;
        }
        // Input window of each staged channel (zeros outside [0, in_len) and past cin).
        for (int idx = tid; idx < H3A_BKC * window; idx += H3A_THREADS) {
            const int c = idx / window;
            const int i = idx - c * window;
            const int ci = c0 + c;
            const int64_t pos = in0 + i;
            float v = 0.0f;
            if (ci < a.cin && pos >= 0 && pos < a.in_len) v = xb[static_cast<int64_t>(ci) * a.in_len + pos];
            xs[idx] = v;
        }
        __syncthreads();
        for (int c = 0; c < H3A_BKC; ++c) {
            const float* xrow = xs + c * window + tx * a.in_stride;
            const float* wrow = ws + (c * k) * BM + ty * TM;
            for (int j = 0; j < k; ++j) {
                float wv[TM];
                float xv[TN];
                if constexpr (TM % 4 == 0) {
                    // 16-byte aligned: BM and TM are multiples of 4 and the buffer is aligned.
#pragma unroll
                    for (int q = 0; q < TM / 4; ++q) {
                        const float4 w4 = reinterpret_cast<const float4*>(wrow + j * BM)[q];
                        wv[4 * q] = w4.x;
                        wv[4 * q + 1] = w4.y;
                        wv[4 * q + 2] = w4.z;
                        wv[4 * q + 3] = w4.w;
                    }
                } else if constexpr (TM == 2) {
                    const float2 w2 = *reinterpret_cast<const float2*>(wrow + j * BM);
                    wv[0] = w2.x;
                    wv[1] = w2.y;
                } else {
#pragma unroll
                    for (int i = 0; i < TM; ++i) wv[i] = wrow[j * BM + i];
                }
#pragma unroll
                for (int i = 0; i < TN; ++i) xv[i] = xrow[i * NX * a.in_stride + j * a.dil];
#pragma unroll
                for (int im = 0; im < TM; ++im)
#pragma unroll
                    for (int in = 0; in < TN; ++in) acc[im][in] = fmaf(wv[im], xv[in], acc[im][in]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int im = 0; im < TM; ++im) {
        const int co = co0 + ty * TM + im;
        if (co >= a.cout) continue;
#pragma unroll
        for (int in = 0; in < TN; ++in) {
            const int n = n0 + tx + in * NX;
            if (n < a.n_out) epilogue(a, b, co, n, acc[im][in]);
        }
    }
}

#define H3A_CONV_TILED(NAME, BM, BN, TM, TN)                                                                      \
    extern "C" __global__ void __launch_bounds__(H3A_THREADS)                                                    \
        NAME(const float* x, const float* __restrict__ wt, const float* __restrict__ bias, const float* res,      \
             float* out, int cin, int cout, int k, int dil, int in_len, int in_offset, int in_stride, int n_out,  \
             int out_offset, int out_stride, int out_len, float scale, int accumulate, int clamp) {               \
        const ConvArgs a{x,      wt,        bias,      res,        out,        cin,        cout,                  \
                         k,      dil,       in_len,    in_offset,  in_stride,  n_out,      out_offset,            \
                         out_stride, out_len, scale,   accumulate, clamp};                                        \
        conv_tiled<BM, BN, TM, TN>(a);                                                                            \
    }

H3A_CONV_TILED(h3a_conv_m64n128, 64, 128, 8, 4)
H3A_CONV_TILED(h3a_conv_m64n64, 64, 64, 4, 4)
H3A_CONV_TILED(h3a_conv_m32n128, 32, 128, 4, 4)
H3A_CONV_TILED(h3a_conv_m32n64, 32, 64, 2, 4)
H3A_CONV_TILED(h3a_conv_m32n256, 32, 256, 8, 4)
H3A_CONV_TILED(h3a_conv_m16n256, 16, 256, 2, 8)
H3A_CONV_TILED(h3a_conv_m8n256, 8, 256, 1, 8)

// ------------------------------------------------------------------------------------------------------------
// Convolution, direct: one thread per output element (tiny convolutions such as conv_post, and shapes whose
// tile would not fit shared memory). Grid-stride over batch * cout * n_out.
// ------------------------------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(H3A_THREADS)
    h3a_conv_direct(const float* x, const float* __restrict__ wt, const float* __restrict__ bias, const float* res,
                    float* out, int cin, int cout, int k, int dil, int in_len, int in_offset, int in_stride,
                    int n_out, int out_offset, int out_stride, int out_len, float scale, int accumulate, int clamp,
                    int batch) {
    const ConvArgs a{x,   wt,     bias,      res,       out,   cin,        cout,       k,
                     dil, in_len, in_offset, in_stride, n_out, out_offset, out_stride, out_len,
                     scale, accumulate, clamp};
    const int64_t total = static_cast<int64_t>(batch) * cout * n_out;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int n = static_cast<int>(i % n_out);
        const int64_t rest = i / n_out;
        const int co = static_cast<int>(rest % cout);
        const int b = static_cast<int>(rest / cout);
        const float* xb = x + static_cast<int64_t>(b) * cin * in_len;
        const int64_t p0 = static_cast<int64_t>(n) * in_stride + in_offset;
        float acc = 0.0f;
        for (int ci = 0; ci < cin; ++ci) {
            const float* xr = xb + static_cast<int64_t>(ci) * in_len;
            const float* wr = wt + static_cast<int64_t>(ci) * k * cout + co;
            for (int j = 0; j < k; ++j) {
                const int64_t p = p0 + static_cast<int64_t>(j) * dil;
                if (p >= 0 && p < in_len) acc = fmaf(wr[static_cast<int64_t>(j) * cout], xr[p], acc);
            }
        }
        epilogue(a, b, co, n, acc);
    }
}

// ------------------------------------------------------------------------------------------------------------
// Anti-aliased SnakeBeta (ratio 2, 12-tap filters), fused.
// ------------------------------------------------------------------------------------------------------------

#define H3A_TAPS 12
// Outputs per block and row segment.
#define H3A_SNAKE_T 512

// For a row x[0..len) (replicate padding at both ends), with u the 2x up-sampled signal
//   u[n] = 2 * sum_{j = 0..11, n + 15 - j even} up[j] * x[clamp((n + 15 - j) / 2 - 5)]     (n in [0, 2 len))
//   s[n] = u[n] + inv_mag[c] * sin(freq[c] * u[n])^2
// the output is y[t] = sum_{j = 0..11} down[j] * s[clamp(2 t + j - 5)]  (t in [0, len)).
// A block handles H3A_SNAKE_T outputs of one row at a time: x[t0 - 6 .. t0 + T + 5) and s[2 t0 - 5 .. 2 t0 + 2 T + 5)
// (indices clamped into the row) are staged in shared memory.
// Grid: (ceil(len / H3A_SNAKE_T), min(rows, 65535)), grid-stride over rows; H3A_THREADS threads.
extern "C" __global__ void __launch_bounds__(H3A_THREADS)
    h3a_snake_aa(const float* __restrict__ x, float* __restrict__ y, const float* __restrict__ freq,
                 const float* __restrict__ inv_mag, const float* __restrict__ up, const float* __restrict__ down,
                 int channels, int rows, int len) {
    __shared__ float xs[H3A_SNAKE_T + 11];
    __shared__ float ss[2 * H3A_SNAKE_T + 10];
    __shared__ float fu[H3A_TAPS];
    __shared__ float fd[H3A_TAPS];
    const int tid = threadIdx.x;
    if (tid < H3A_TAPS) {
        fu[tid] = up[tid];
        fd[tid] = down[tid];
    }
    const int t0 = blockIdx.x * H3A_SNAKE_T;
    const int two_len = 2 * len;
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        const int c = row % channels;
        const float fr = freq[c];
        const float im = inv_mag[c];
        const float* xr = x + static_cast<int64_t>(row) * len;
        float* yr = y + static_cast<int64_t>(row) * len;
        __syncthreads();  // the previous row's reads of xs / ss are done (and fu / fd are loaded)
        for (int i = tid; i < H3A_SNAKE_T + 11; i += H3A_THREADS) {
            const int p = min(max(t0 - 6 + i, 0), len - 1);
            xs[i] = xr[p];
        }
        __syncthreads();
        for (int m = tid; m < 2 * H3A_SNAKE_T + 10; m += H3A_THREADS) {
            const int n = min(max(2 * t0 - 5 + m, 0), two_len - 1);
            float u = 0.0f;
            // Taps whose parity makes n + 15 - j even; x index (n + 15 - j) / 2 - 5, staged at + 6 - t0.
            for (int j = (n + 1) & 1; j < H3A_TAPS; j += 2) {
                const int xi = (n + 15 - j) / 2 - 5;
                u = fmaf(fu[j], xs[xi - t0 + 6], u);
            }
            u *= 2.0f;
            const float sn = sinf(fr * u);
            ss[m] = fmaf(im, sn * sn, u);
        }
        __syncthreads();
        for (int i = tid; i < H3A_SNAKE_T; i += H3A_THREADS) {
            const int t = t0 + i;
            if (t >= len) break;
            float v = 0.0f;
#pragma unroll
            for (int j = 0; j < H3A_TAPS; ++j) v = fmaf(fd[j], ss[2 * i + j], v);
            yr[t] = v;
        }
    }
}
