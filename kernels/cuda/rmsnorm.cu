// RMSNorm, as kernels/model.py's rms_norm: out = x / sqrt(mean(x^2) + eps) * w over the first D
// columns of each row.  x: [*, ldx] fp32, w: [D] fp32, out: [R, ldo] fp32 (columns >= D untouched).
// Output row r reads input row rows[r] (the final norm gathers the rows that need logits), or
// row r when rows is null. grid (R), block 256; the row is read twice (from L1 the second time).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) rmsnorm(
    const float* __restrict__ x, int ldx, const int* __restrict__ rows, const float* __restrict__ w,
    float* __restrict__ out, int ldo, int D, float eps) {
    __shared__ float scratch[32];
    pdl_wait();
    const float* row = x + (size_t)(rows ? rows[blockIdx.x] : blockIdx.x) * ldx;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) ss += row[d] * row[d];
    ss = block_sum(ss, scratch);
    const float denom = sqrtf(ss / (float)D + eps);
    pdl_launch_dependents();
    float* dst = out + (size_t)blockIdx.x * ldo;
    for (int d = threadIdx.x; d < D; d += blockDim.x) dst[d] = row[d] / denom * w[d];
}
