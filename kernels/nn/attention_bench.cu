// Flash attention tiles that production never selects, kept for `tf bench attention` and the tile comparisons of
// the GPU tests (kernel set nn_attention_bench, loaded only with tf-engines' `bench-kernels` feature). The bodies
// are in attention.cuh, shared with the production kernels of attention.cu.
#include "nn/attention.cuh"

NN_ATTENTION_KERNEL(nn_attention_d128_w8s3, 8, 3, 128, 1)
NN_ATTENTION_KERNEL(nn_attention_d128_w4s2, 4, 2, 128, 2)
NN_ATTENTION_KERNEL(nn_attention_d128_w4s3, 4, 3, 128, 2)

NN_ATTENTION_SM90_KERNEL(nn_attention_d128_sm90, 256, attention_sm90)
NN_ATTENTION_SM90_KERNEL(nn_attention_d128_sm90_ws, 384, attention_sm90_ws<false>)
