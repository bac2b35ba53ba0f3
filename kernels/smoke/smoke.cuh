// Device helpers shared by the smoke kernels (a header, so the build hashes included files too).
#pragma once

namespace tf_smoke {
__device__ __forceinline__ float axpy(float a, float x, float y) { return fmaf(a, x, y); }
}  // namespace tf_smoke
