// Token embedding lookup: out[t, d] = E[token_ids[t], d] * multiplier for d < D, in every
// encoding an engine may store the embedding in (docs/ENGINE_FORMAT.md):
//   f32 / f16  E [V, ldw]
//   i8         E = q [V, ldw] * scale[V] (fp16 row scales)
//   i4         E = (q - zero) * scale per group of G along D, engine packing:
//              qweight bytes [V, Kp/2] (low nibble = even d), scales/zeros fp16 [V, Kp/G]
// grid (T), block 256: one block per token. Ids outside [0, V) give a zero row (the host
// rejects them before launch; this only keeps a bad id from reading out of bounds).
#include "common.cuh"

__device__ __forceinline__ float embed_value(const float* e, int row, int d, int ldw, const void*, const void*, int) {
    return e[(size_t)row * ldw + d];
}

__device__ __forceinline__ float embed_value(const f16_t* e, int row, int d, int ldw, const void*, const void*, int) {
    return f16_to_f32(e[(size_t)row * ldw + d]);
}

__device__ __forceinline__ float embed_value(const signed char* e, int row, int d, int ldw,
                                             const void* scales, const void*, int) {
    return (float)e[(size_t)row * ldw + d] * f16_to_f32(((const f16_t*)scales)[row]);
}

__device__ __forceinline__ float embed_value(const unsigned char* e, int row, int d, int ldw,
                                             const void* scales, const void* zeros, int group_size) {
    // ldw: bytes per row (Kp / 2)
    const unsigned char byte = e[(size_t)row * ldw + d / 2];
    const float q = (float)((d & 1) ? (byte >> 4) : (byte & 0xf));
    const int num_groups = ldw * 2 / group_size, gi = d / group_size;
    const float s = f16_to_f32(((const f16_t*)scales)[(size_t)row * num_groups + gi]);
    const float z = f16_to_f32(((const f16_t*)zeros)[(size_t)row * num_groups + gi]);
    return (q - z) * s;
}

template <typename E>
__device__ __forceinline__ void embed(const int* __restrict__ token_ids, const E* __restrict__ table,
                                      const void* scales, const void* zeros, int ldw, int group_size,
                                      int vocab_size, int D, float multiplier, float* out, int ldo) {
    pdl_wait();
    const int t = blockIdx.x, id = token_ids[t];
    float* dst = out + (size_t)t * ldo;
    const bool ok = id >= 0 && id < vocab_size;
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        dst[d] = ok ? embed_value(table, id, d, ldw, scales, zeros, group_size) * multiplier : 0.0f;
}

#define EMBED_ARGS(E) const int* __restrict__ token_ids, const E* __restrict__ table, const void* scales, \
    const void* zeros, int ldw, int group_size, int vocab_size, int D, float multiplier, float* out, int ldo
#define EMBED_PASS token_ids, table, scales, zeros, ldw, group_size, vocab_size, D, multiplier, out, ldo

extern "C" __global__ void embed_f32(EMBED_ARGS(float)) { embed<float>(EMBED_PASS); }
extern "C" __global__ void embed_f16(EMBED_ARGS(f16_t)) { embed<f16_t>(EMBED_PASS); }
extern "C" __global__ void embed_i8(EMBED_ARGS(signed char)) { embed<signed char>(EMBED_PASS); }
extern "C" __global__ void embed_i4(EMBED_ARGS(unsigned char)) { embed<unsigned char>(EMBED_PASS); }
