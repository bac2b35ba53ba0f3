// Flash attention, the production kernels (kernel set nn_attention); the bodies are in attention.cuh.
//
//   nn_attention_d128_w8s2      mma.sync, 8 warps, 2 cp.async stages: the fallback on every GPU other than sm_90.
//   nn_attention_d128_sm90_tma  sm_90a: warp-specialised wgmma with TMA loads; what production picks on the H200.
//   nn_attention_d64_w8s2       mma.sync at head dim 64 (video VAE attention), every GPU.
#include "nn/attention.cuh"

NN_ATTENTION_KERNEL(nn_attention_d128_w8s2, 8, 2, 128, 1)
NN_ATTENTION_KERNEL(nn_attention_d64_w8s2, 8, 2, 64, 1)

// The warp-specialised kernel loading through TMA: the arguments of NN_ATTENTION_KERNEL, then five tensor maps (q, k, v, k prefix,
// v prefix; bf16, boxes of 64 columns x 128 rows, 128-byte swizzle, zero fill; dims {row width, rows, batch}).
extern "C" __global__ void __launch_bounds__(384, 1) nn_attention_d128_sm90_tma(
    const bf16* __restrict__ q, int64_t q_batch_stride, int q_row_stride, const bf16* __restrict__ k_prefix,
    const bf16* __restrict__ v_prefix, int64_t prefix_batch_stride, int prefix_row_stride, int prefix_len,
    const bf16* __restrict__ k, const bf16* __restrict__ v, int64_t kv_batch_stride, int kv_row_stride,
    bf16* __restrict__ o, int64_t o_batch_stride, int o_row_stride, int num_queries, int num_keys, int num_heads,
    int num_kv_heads, const int* __restrict__ key_limit, int64_t key_limit_batch_stride,
    const int* __restrict__ key_pad, float scale_log2, const __grid_constant__ TmaMap tm_q,
    const __grid_constant__ TmaMap tm_k, const __grid_constant__ TmaMap tm_v, const __grid_constant__ TmaMap tm_kp,
    const __grid_constant__ TmaMap tm_vp) {
#if defined(NN_HAS_WGMMA)
    attention_sm90_ws<true>(
        sm90_operands(q, q_batch_stride, q_row_stride, k_prefix, v_prefix, prefix_batch_stride, prefix_row_stride,
                      prefix_len, k, v, kv_batch_stride, kv_row_stride, o, o_batch_stride, o_row_stride, num_queries,
                      num_keys, num_heads, num_kv_heads),
        blockIdx.z, key_limit, key_limit_batch_stride, key_pad, scale_log2, &tm_q, &tm_k, &tm_v, &tm_kp, &tm_vp);
#else
    __trap();
#endif
}
