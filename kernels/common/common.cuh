// Device helpers shared by every engine kernel: bf16 vector loads, fixed-order reductions, the row loader of the
// row-normalising kernels, and the modulation-row rule of the adaLN kernels.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

namespace nn {

using bf16 = __nv_bfloat16;

// Eight bf16 values moved as one 16-byte access.
struct alignas(16) Bf16x8 {
    __nv_bfloat162 pairs[4];
};

__device__ __forceinline__ void load8(const bf16* p, float (&out)[8]) {
    Bf16x8 v = *reinterpret_cast<const Bf16x8*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 f = __bfloat1622float2(v.pairs[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void store8(bf16* p, const float (&in)[8]) {
    Bf16x8 v;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v.pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    }
    *reinterpret_cast<Bf16x8*>(p) = v;
}

// The eight values of a Bf16x8 in f32 (exact), and eight f32 values rounded into one.
__device__ __forceinline__ void unpack8(const Bf16x8& v, float (&out)[8]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 f = __bfloat1622float2(v.pairs[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ Bf16x8 pack8(const float (&in)[8]) {
    Bf16x8 v;
#pragma unroll
    for (int i = 0; i < 4; ++i) v.pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    return v;
}

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// silu with the approximate division (2 ulp; x / inf is 0 for x below about -88, silu's limit there): one reciprocal
// and a multiply, no IEEE slow path. Results may differ from the host's IEEE division where a value sits on a bf16
// rounding boundary. The 8-bit SwiGLU kernels and the INT8 GEMM's SwiGLU epilogue share it, so both paths agree.
__device__ __forceinline__ float silu_fast(float x) { return __fdividef(x, 1.0f + expf(-x)); }

// Butterfly sum over the 32 lanes of a warp; every lane gets the same value, in the same order on every run.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// Butterfly maximum over the 32 lanes of a warp; every lane gets it (a maximum is exact in any order).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
}

// The K consecutive (row, head) items one warp of a block of 8 warps takes in a kernel over rows x heads_per_row
// items of D channels each (heads of a fused row, `stride` elements apart from row to row): for each, its row, its
// head and the Pack of channels at channel `dim` of the head, every load issued before any is used; `at(k)` is that
// address again (recomputed rather than held, to keep the registers for more warps). Only the first `count` items
// exist; the others are the warp's last ones. The item index is uniform across the warp, so every lane takes the
// same branches.
template <int K, int D, typename Pack>
struct WarpHeadItems {
    bf16* base;
    int stride;
    int dim;
    int count;
    int row[K];
    int head[K];
    Pack raw[K];

    __device__ __forceinline__ void load(bf16* base_, int stride_, int rows, int heads_per_row, int dim_) {
        base = base_;
        stride = stride_;
        dim = dim_;
        const int64_t items = static_cast<int64_t>(rows) * heads_per_row;
        const int64_t first = (static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5)) * K;
        count = static_cast<int>(items > first ? (items - first < K ? items - first : K) : 0);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t item = first + k;
            row[k] = 0;
            head[k] = 0;
            if (item < items) {
                const int64_t r = item / heads_per_row;
                row[k] = static_cast<int>(r);  // r < rows, an int
                head[k] = static_cast<int>(item - r * heads_per_row);
                raw[k] = *reinterpret_cast<const Pack*>(at(k));
            }
        }
    }

    // The address of item k's channel `dim`.
    __device__ __forceinline__ bf16* at(int k) const {
        return base + static_cast<int64_t>(row[k]) * stride + head[k] * D + dim;
    }
};

// Rotate-half RoPE within one warp, lane l holding channels E*l .. E*l + E - 1 of a head whose first `2 * half`
// channels rotate. When half is a multiple of E every channel of a lane pairs with the same channel slot of one other
// lane (l +- half / E), so the partners come through shuffles instead of shared memory (a shared-memory round trip
// per item, with 4-way bank conflicts, was what bounded the QK norm + RoPE kernels). `rotates_by_shuffle` says
// whether this applies; every lane of the warp must call `rotate_half_partners`.
template <int E>
__device__ __forceinline__ bool rotates_by_shuffle(int half) {
    return half > 0 && half % E == 0;
}

// partner[i] = -x[ch + half] for ch < half, x[ch - half] for half <= ch < 2 * half, x[ch] past the rotated width
// (ch = E * lane + i; needs rotates_by_shuffle<E>(half)).
template <int E>
__device__ __forceinline__ void rotate_half_partners(const float (&x)[E], int lane, int half, float (&partner)[E]) {
    const int off = half / E;
    const bool first = lane < off;
    const int src = first ? lane + off : (lane < 2 * off ? lane - off : lane);
#pragma unroll
    for (int i = 0; i < E; ++i) {
        const float p = __shfl_sync(0xffffffffu, x[i], src);
        partner[i] = first ? -p : p;
    }
}

// One entry of a cos or sin table, in f32.
__device__ __forceinline__ float table_entry(const float* t, int64_t i) { return t[i]; }
__device__ __forceinline__ float table_entry(const bf16* t, int64_t i) { return __bfloat162float(t[i]); }

template <int E>
struct TableEntries {
    float v[E];
};

// E consecutive entries of a cos or sin table starting at `at` (an element index), in f32: one vector access when
// `vector` (the caller checked that `at` and the table are aligned to E entries), else E scalar loads.
template <int E, typename T>
__device__ __forceinline__ TableEntries<E> load_table(const T* __restrict__ t, int64_t at, bool vector) {
    TableEntries<E> out;
    if (vector) {
        if constexpr (sizeof(T) == 2 && E == 4) {
            const uint2 raw = *reinterpret_cast<const uint2*>(t + at);
            const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
            const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
            out.v[0] = a.x, out.v[1] = a.y, out.v[2] = b.x, out.v[3] = b.y;
            return out;
        } else if constexpr (sizeof(T) == 2 && E == 2) {
            const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(t + at));
            out.v[0] = a.x, out.v[1] = a.y;
            return out;
        } else if constexpr (sizeof(T) == 4 && E == 4) {
            const float4 a = *reinterpret_cast<const float4*>(t + at);
            out.v[0] = a.x, out.v[1] = a.y, out.v[2] = a.z, out.v[3] = a.w;
            return out;
        } else if constexpr (sizeof(T) == 4 && E == 2) {
            const float2 a = *reinterpret_cast<const float2*>(t + at);
            out.v[0] = a.x, out.v[1] = a.y;
            return out;
        }
    }
#pragma unroll
    for (int i = 0; i < E; ++i) out.v[i] = table_entry(t, at + i);
    return out;
}

// Whether E-entry vector loads of a [rows, stride] table are aligned at every row and every multiple of E.
template <int E, typename T>
__device__ __forceinline__ bool table_vectors_aligned(const T* t, int stride) {
    return stride % E == 0 && reinterpret_cast<uintptr_t>(t) % (E * sizeof(T)) == 0;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024), returned to every thread. Fixed
// order: warp butterflies, then the warp totals in ascending warp order. `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) {
        total += scratch[w];
    }
    return total;
}

// Loads one row into registers: chunk c of this thread is columns (threadIdx.x + c * THREADS) * 8 .. + 8; columns
// past `cols` read as 0. Returns this thread's f32 sum of the loaded values (in chunk order).
template <int THREADS, int CHUNKS>
__device__ __forceinline__ float load_row(const bf16* row, int cols, float (&v)[CHUNKS][8]) {
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int col = (threadIdx.x + c * THREADS) * 8;
        if (col < cols) {
            load8(row + col, v[c]);
#pragma unroll
            for (int i = 0; i < 8; ++i) sum += v[c][i];
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) v[c][i] = 0.0f;
        }
    }
    return sum;
}

// This thread's f32 sum of (v - mean)^2 over its loaded columns (chunk order), for LayerNorm's variance.
template <int THREADS, int CHUNKS>
__device__ __forceinline__ float centred_square_sum(const float (&v)[CHUNKS][8], int cols, float mean) {
    float sq = 0.0f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int col = (threadIdx.x + c * THREADS) * 8;
        if (col < cols) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float d = v[c][i] - mean;
                sq += d * d;
            }
        }
    }
    return sq;
}

// The adaLN modulation-row rule (the Qwen-Image DiT's; seq_len 1 gives every row its own): rows are `seq_len`
// tokens per sample; a token at position >= target_begin within its sample uses its sample's modulation row, every
// other token (text, condition image) the t = 0 row `prefix_row`.
__device__ __forceinline__ int modulation_row(int row, int seq_len, int target_begin, int prefix_row) {
    const int sample = row / seq_len;
    const int position = row - sample * seq_len;
    return position >= target_begin ? sample : prefix_row;
}

}  // namespace nn
