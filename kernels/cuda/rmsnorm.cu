// RMSNorm, as kernels/model.py's rms_norm: out = x / sqrt(mean(x^2) + eps) * w over the first D
// columns of each row, or out += that when accumulate (Gemma 2/3's norm of a product's output
// before the residual add).  x: [*, ldx] fp32, w: [D] fp32, out: [R, ldo] fp32 (columns >= D untouched).
// Output row r reads input row rows[r] (the final norm gathers the rows that need logits), or
// row r when rows is null. grid (R), block 256; the row is read twice (from L1 the second time).
#include "common.cuh"

// sqrt(mean(row^2) + eps) over D values: thread i sums d = i, i + blockDim, ... in order, then
// block_sum's tree. int4_matmul.cu's fused prologue repeats this order exactly (tested equal).
__device__ __forceinline__ float rms_denom(const float* row, int D, float eps, float* scratch) {
    float ss = 0.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) ss += row[d] * row[d];
    ss = block_sum(ss, scratch);
    return sqrtf(ss / (float)D + eps);
}

extern "C" __global__ void __launch_bounds__(256) rmsnorm(
    const float* __restrict__ x, int ldx, const int* __restrict__ rows, const float* __restrict__ w,
    float* __restrict__ out, int ldo, int D, float eps, int accumulate) {
    __shared__ float scratch[32];
    pdl_wait();
    const float* row = x + (size_t)(rows ? rows[blockIdx.x] : blockIdx.x) * ldx;
    const float denom = rms_denom(row, D, eps, scratch);
    pdl_launch_dependents();
    float* dst = out + (size_t)blockIdx.x * ldo;
    if (accumulate)
        for (int d = threadIdx.x; d < D; d += blockDim.x) dst[d] = __fadd_rn(dst[d], __fmul_rn(row[d] / denom, w[d]));
    else
        for (int d = threadIdx.x; d < D; d += blockDim.x) dst[d] = row[d] / denom * w[d];
}

// Per-head RMSNorm of the new tokens' query and key heads in place (Qwen3, Gemma 3: before
// RoPE), each head over its hd values with its own weights.
//   qkv: [T, ldqkv] fp32, rows Q heads | K heads | V heads; q_norm, k_norm: [hd] fp32
// grid (T, Hq + Hkv), block 32 (one warp per head).
extern "C" __global__ void __launch_bounds__(32) head_rmsnorm(
    float* __restrict__ qkv, int ldqkv, const float* __restrict__ q_norm, const float* __restrict__ k_norm,
    int num_heads, int head_dim, float eps) {
    pdl_wait();
    const int head = blockIdx.y;
    float* x = qkv + (size_t)blockIdx.x * ldqkv + (size_t)head * head_dim;
    const float* w = head < num_heads ? q_norm : k_norm;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < head_dim; d += 32) ss += x[d] * x[d];
    ss = warp_sum(ss);
    const float denom = sqrtf(ss / (float)head_dim + eps);
    pdl_launch_dependents();
    for (int d = threadIdx.x; d < head_dim; d += 32) x[d] = x[d] / denom * w[d];
}

// Gemma 2's final-logit soft-capping in place: logits = cap * tanh(logits / cap), before any
// sampling. logits: [R, ldl] fp32. grid (R), block 256.
extern "C" __global__ void __launch_bounds__(256) logit_softcap(float* __restrict__ logits, int ldl, int vocab_size,
                                                                float cap) {
    pdl_wait();
    pdl_launch_dependents();
    float* row = logits + (size_t)blockIdx.x * ldl;
    for (int v = threadIdx.x; v < vocab_size; v += blockDim.x) row[v] = cap * tanhf(row[v] / cap);
}
