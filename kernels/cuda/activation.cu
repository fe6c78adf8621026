// Gated MLP activation, as kernels/model.py: act = f(gate) * up with f = silu (SwiGLU) or the tanh
// GELU (GeGLU). gate_up: [T, ldg] fp32 holding gate in columns [0, I) and up in [I, 2I);
// out: [T, ldo] fp32, columns [0, I).  grid (ceil(I / 256), T), block 256.
#include "common.cuh"

template <bool GELU>
__device__ __forceinline__ void glu(const float* __restrict__ gate_up, int ldg, float* __restrict__ out, int ldo, int I) {
    pdl_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (i >= I) return;
    const float* row = gate_up + (size_t)t * ldg;
    const float g = row[i], u = row[I + i];
    out[(size_t)t * ldo + i] = (GELU ? act_gelu_tanh(g) : act_silu(g)) * u;
}

extern "C" __global__ void glu_silu(const float* __restrict__ gate_up, int ldg, float* __restrict__ out, int ldo, int I) {
    glu<false>(gate_up, ldg, out, ldo, I);
}

extern "C" __global__ void glu_gelu_tanh(const float* __restrict__ gate_up, int ldg, float* __restrict__ out, int ldo, int I) {
    glu<true>(gate_up, ldg, out, ldo, I);
}
