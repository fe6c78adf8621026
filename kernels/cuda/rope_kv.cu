// RoPE on the new tokens' queries and keys (rotate-half layout, kernels/rope.py) and their K/V
// written into the paged cache at each token's slot (block * block_size + offset).
//   qkv:      [T, ldqkv] fp32, rows Q heads | K heads | V heads (bias already added)
//   cos_sin:  float2 [max_positions, hd/2]: (cos, sin) rounded once from float64 angles, the
//             same table kernels/rope.py computes, so rotations match the reference bit for bit
//   q_out:    [T, ldq] fp32, the rotated queries
//   k_cache, v_cache: one layer's [num_slots, Hkv, hd] in the cache dtype (fp32 or fp16)
// grid (T), block 128. Products are rounded separately (no fused multiply-add), as numpy does.
#include "common.cuh"

__device__ __forceinline__ void store_cache(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_cache(f16_t* p, float v) { *p = f32_to_f16(v); }

template <typename CT>
__device__ __forceinline__ void rope_kv_append(
    const float* __restrict__ qkv, int ldqkv, const int* __restrict__ positions, const int* __restrict__ slot_mapping,
    const float2* __restrict__ cos_sin, int max_positions, float* __restrict__ q_out, int ldq,
    CT* __restrict__ k_cache, CT* __restrict__ v_cache, int num_heads, int num_kv_heads, int head_dim) {
    pdl_wait();
    const int t = blockIdx.x, half = head_dim / 2;
    const int pos = min(max(positions[t], 0), max_positions - 1);
    const size_t slot_base = (size_t)slot_mapping[t] * num_kv_heads * head_dim;
    const float* row = qkv + (size_t)t * ldqkv;
    const float2* cs = cos_sin + (size_t)pos * half;
    for (int idx = threadIdx.x; idx < (num_heads + num_kv_heads) * half; idx += blockDim.x) {
        const int head = idx / half, j = idx % half;
        const float* src = row + head * head_dim;             // Q heads, then K heads
        const float x1 = src[j], x2 = src[j + half];
        const float2 c = cs[j];
        const float r1 = __fsub_rn(__fmul_rn(x1, c.x), __fmul_rn(x2, c.y));
        const float r2 = __fadd_rn(__fmul_rn(x2, c.x), __fmul_rn(x1, c.y));
        if (head < num_heads) {
            float* dst = q_out + (size_t)t * ldq + head * head_dim;
            dst[j] = r1;
            dst[j + half] = r2;
        } else {
            CT* dst = k_cache + slot_base + (head - num_heads) * head_dim;
            store_cache(dst + j, r1);
            store_cache(dst + j + half, r2);
        }
    }
    const float* v = row + (num_heads + num_kv_heads) * head_dim;
    for (int idx = threadIdx.x; idx < num_kv_heads * head_dim; idx += blockDim.x)
        store_cache(v_cache + slot_base + idx, v[idx]);
}

#define ROPE_ARGS(CT) const float* __restrict__ qkv, int ldqkv, const int* __restrict__ positions, \
    const int* __restrict__ slot_mapping, const float2* __restrict__ cos_sin, int max_positions, \
    float* __restrict__ q_out, int ldq, CT* __restrict__ k_cache, CT* __restrict__ v_cache, \
    int num_heads, int num_kv_heads, int head_dim
#define ROPE_PASS qkv, ldqkv, positions, slot_mapping, cos_sin, max_positions, q_out, ldq, k_cache, v_cache, \
    num_heads, num_kv_heads, head_dim

extern "C" __global__ void rope_kv_append_f32(ROPE_ARGS(float)) { rope_kv_append<float>(ROPE_PASS); }
extern "C" __global__ void rope_kv_append_f16(ROPE_ARGS(f16_t)) { rope_kv_append<f16_t>(ROPE_PASS); }
