// Dense and INT8 weight x fp32 activation products, for the weights an engine keeps unquantized
// or per-row int8 (embedding-as-classifier, lm_head; docs/ENGINE_FORMAT.md):
//   y[m, n] = sum_k W[n, k] x[m, k]          W fp32 or fp16 [N, ldw]
//   y[m, n] = scale[n] sum_k q[n, k] x[m, k] W int8 [N, ldw] with fp16 row scales
// Rows are padded on upload to ldw (a multiple of 8, zeros); x is zero beyond K.
// grid (ceil(N / 4), ceil(M / DENSE_MT)), block 128: one warp per weight row, lanes over 8-wide chunks.
#include "common.cuh"

#define DENSE_MT 8

__device__ __forceinline__ void load8(const float* w, float v[8]) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(w)), b = __ldg(reinterpret_cast<const float4*>(w) + 1);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

__device__ __forceinline__ void load8(const f16_t* w, float v[8]) {
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(w));
    const u32 words[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = f16_to_f32((f16_t)(words[i] & 0xffffu));
        v[2 * i + 1] = f16_to_f32((f16_t)(words[i] >> 16));
    }
}

__device__ __forceinline__ void load8(const signed char* w, float v[8]) {
    const uint2 a = __ldg(reinterpret_cast<const uint2*>(w));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[i] = (float)(signed char)((a.x >> (8 * i)) & 0xffu);
        v[4 + i] = (float)(signed char)((a.y >> (8 * i)) & 0xffu);
    }
}

template <typename W>
__device__ __forceinline__ void dense_mm(
    const float* __restrict__ x, int ldx, int M,
    const W* __restrict__ w, int ldw, const f16_t* __restrict__ row_scales,
    const float* __restrict__ bias, float* y, int ldy, int N, int accumulate) {
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * 4 + (threadIdx.x >> 5);
    const int m0 = blockIdx.y * DENSE_MT;
    pdl_wait();
    if (n >= N) return;
    float acc[DENSE_MT];
#pragma unroll
    for (int i = 0; i < DENSE_MT; ++i) acc[i] = 0.0f;
    for (int c = lane * 8; c < ldw; c += 32 * 8) {
        float wv[8];
        load8(w + (size_t)n * ldw + c, wv);
#pragma unroll
        for (int mt = 0; mt < DENSE_MT; ++mt) {
            if (m0 + mt >= M) break;
            const float4* xp = reinterpret_cast<const float4*>(x + (size_t)(m0 + mt) * ldx + c);
            const float4 a = __ldg(xp), b = __ldg(xp + 1);
            acc[mt] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w
                     + wv[4] * b.x + wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
        }
    }
    const float scale = row_scales ? f16_to_f32(row_scales[n]) : 1.0f;
#pragma unroll
    for (int mt = 0; mt < DENSE_MT; ++mt) {
        float v = warp_sum(acc[mt]) * scale;
        if (lane == 0 && m0 + mt < M) {
            if (bias) v += bias[n];
            float* dst = y + (size_t)(m0 + mt) * ldy + n;
            *dst = accumulate ? *dst + v : v;
        }
    }
}

#define DENSE_ARGS(W) const float* __restrict__ x, int ldx, int M, const W* __restrict__ w, int ldw, \
    const f16_t* __restrict__ row_scales, const float* __restrict__ bias, float* y, int ldy, int N, int accumulate
#define DENSE_PASS x, ldx, M, w, ldw, row_scales, bias, y, ldy, N, accumulate

extern "C" __global__ void __launch_bounds__(128) dense_mm_f32(DENSE_ARGS(float)) { dense_mm<float>(DENSE_PASS); }
extern "C" __global__ void __launch_bounds__(128) dense_mm_f16(DENSE_ARGS(f16_t)) { dense_mm<f16_t>(DENSE_PASS); }
extern "C" __global__ void __launch_bounds__(128) dense_mm_i8(DENSE_ARGS(signed char)) { dense_mm<signed char>(DENSE_PASS); }
