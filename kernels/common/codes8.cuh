// 8-bit weight codes in 16-byte words: the exact values of e4m3 and INT8 codes (nn::fp8's RowCodes on the host),
// before their row's scale. Shared by the weight-only linear layers and the dequantizing kernel.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace nn {

// The values of 16 e4m3 codes (a 16-byte word), exact: e4m3 -> half is exact, half -> float too.
__device__ __forceinline__ void decode16_e4m3(const uint4& raw, float (&out)[16]) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>((words[i] >> (16 * h)) & 0xffffu);
            const __half2 v(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3));
            const float2 f = __half22float2(v);
            out[4 * i + 2 * h] = f.x;
            out[4 * i + 2 * h + 1] = f.y;
        }
    }
}

// The values of 16 INT8 codes (a 16-byte word, two's complement), exact.
__device__ __forceinline__ void decode16_int8(const uint4& raw, float (&out)[16]) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            out[4 * i + b] = static_cast<float>(static_cast<int8_t>((words[i] >> (8 * b)) & 0xffu));
        }
    }
}

}  // namespace nn
