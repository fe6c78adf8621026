// Shared device helpers for tokenwire's CUDA kernels.
//
// Rule 1: no #include of any CUDA header. Halves are raw 16-bit words converted with PTX,
// so the same source compiles under NVRTC (no include path needed) and nvcc alike.
// Rule 2: every kernel is `extern "C"` so the host finds it by its plain name.
// Rule 3: every kernel calls pdl_wait() before it touches memory an earlier kernel wrote or
// reads, so launches with programmatic dependent launch (sm_90) stay correct; without that
// launch attribute the wait is a no-op.
#pragma once

typedef unsigned short f16_t;          // IEEE binary16 bits
typedef unsigned int u32;
typedef unsigned long long u64;

#define TW_INF __int_as_float(0x7f800000)

// std::conditional without <type_traits> (rule 1)
template <bool B, typename T, typename F> struct tw_select { typedef T type; };
template <typename T, typename F> struct tw_select<false, T, F> { typedef F type; };
#define FULL_MASK 0xffffffffu

// ------------------------------------------------------------------ fp16 conversion

__device__ __forceinline__ float f16_to_f32(f16_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ f16_t f32_to_f16(float f) {
    f16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ u32 pack_f16x2(f16_t lo, f16_t hi) {
    return (u32)lo | ((u32)hi << 16);
}

// ------------------------------------------------------------------ programmatic dependent launch

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ------------------------------------------------------------------ gated activations (kernels/model.py)

__device__ __forceinline__ float act_silu(float x) { return x / (1.0f + expf(-x)); }

// 0.5 x (1 + tanh(u)) written as x / (1 + e^(-2u)): the same function without the cancellation
// of 1 + tanh(u) for negative x, where tanhf rounds to -1 and the product to 0 (the H200 run of
// 2026-11-27 returned -0 for -1.56e-6 at x = -4.9); e^(-2u) overflowing to inf gives -0, as it should.
__device__ __forceinline__ float act_gelu_tanh(float x) {
    const float k = 0.7978845608028654f;                   // sqrt(2 / pi)
    return x / (1.0f + expf(-2.0f * k * (x + 0.044715f * x * x * x)));
}

// ------------------------------------------------------------------ reductions

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ u64 warp_max_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        u64 other = __shfl_xor_sync(FULL_MASK, v, o);
        v = other > v ? other : v;
    }
    return v;
}

// Block-wide reductions: every thread gets the result. `scratch` holds one value per warp
// (32 entries suffice for any block). Deterministic: fixed tree order.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();                       // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : -TW_INF;
    return warp_max(v);
}

__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = (blockDim.x + 31) >> 5;
    v = warp_sum_f64(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : 0.0;
    return warp_sum_f64(v);
}

__device__ __forceinline__ u64 block_max_u64(u64 v, u64* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = (blockDim.x + 31) >> 5;
    v = warp_max_u64(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : 0ull;
    return warp_max_u64(v);
}

__device__ __forceinline__ int block_sum_int(int v, int* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// ------------------------------------------------------------------ order-preserving keys

// float -> u32 whose unsigned order is the float order (NaN-free inputs).
__device__ __forceinline__ u32 ordered_bits(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Sort key: larger logit first, and among equal logits the lower index first (numpy's
// stable argsort of -x). Distinct for distinct indices.
__device__ __forceinline__ u64 rank_key(float logit, int index) {
    return ((u64)ordered_bits(logit) << 32) | (u64)(0xffffffffu - (u32)index);
}

__device__ __forceinline__ int key_index(u64 key) {
    return (int)(0xffffffffu - (u32)(key & 0xffffffffull));
}
