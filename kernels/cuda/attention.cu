// Paged attention for prefill chunks and decode tokens alike (kernels/model.py's paged_attention):
// each query at position p attends to its sequence's cached keys 0..p (the last `window`
// only, when sliding_window > 0), gathered through the block table. The step's own K/V are
// already in the cache (rope_kv_append runs first), so a chunk sees earlier chunks too.
// Scores are dot * scale, soft-capped to softcap * tanh(score / softcap) when softcap > 0
// (Gemma 2); the host passes each layer's own window (Gemma 2/3 alternate).
//
//   q:            [T, ldq] fp32 rotated queries, Hq heads of hd
//   k/v_cache:    one layer's [num_slots, Hkv, hd] (fp32 or fp16), slot = block * block_size + offset
//   block_tables: int [S, ld_bt]; positions: int [T]
//   items:        int [num_items, 3] = (sequence, first token row, number of queries <= 16 / heads_per_block)
//   split_size:   keys per split, or 0: each item's keys spread evenly over the grid's splits, in
//                 whole tiles of 32 (a split past the item's keys finds none)
//   out:          [T, ldo] fp32 when the grid has one split; otherwise per-split partials go to
//                 ws_ml float2 [T, Hq, max_splits] (running max, sum) and ws_acc [T, Hq, max_splits, hd]
//                 and attention_combine merges them.
//
// attention_paged_fused_*: the same, with attention_combine folded into the last split to finish:
// each block of a split grid writes its partials, and the last of an (item, head chunk)'s splits
// to arrive (counters[item, chunk], re-armed after) merges them into `out` in split order.
//
// grid (num_items, Hkv * head_chunks, num_splits), block 128 (4 warps).
// A block owns one KV head and `heads_per_block` of its query heads, for up to 16
// (query, head) pairs; the keys of its split come through shared memory 32 at a time,
// each warp scores them for its pairs (lane = key) and folds them into an online softmax
// (lane = output dimension). Split along the sequence (flash-decoding) so one long context
// still fills the GPU.
#include "common.cuh"

#define ATT_WARPS 4
#define ATT_PAIRS 16
#define ATT_PAIRS_PER_WARP (ATT_PAIRS / ATT_WARPS)
#define ATT_TILE 32
#define ATT_MAX_DPL 8                                   // head_dim <= 256

__device__ __forceinline__ float load_cache(const float* p) { return *p; }
__device__ __forceinline__ float load_cache(const f16_t* p) { return f16_to_f32(*p); }

// 16 bytes of cache (4 fp32 or 8 fp16 values) as floats
__device__ __forceinline__ void unpack16(const uint4& r, float* out, const float*) {
    out[0] = __uint_as_float(r.x); out[1] = __uint_as_float(r.y);
    out[2] = __uint_as_float(r.z); out[3] = __uint_as_float(r.w);
}
__device__ __forceinline__ void unpack16(const uint4& r, float* out, const f16_t*) {
    const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = f16_to_f32((f16_t)(w[i] & 0xffffu));
        out[2 * i + 1] = f16_to_f32((f16_t)(w[i] >> 16));
    }
}

// One tile's keys and values (its `slots`) from the cache into shared memory. With head_dim a
// multiple of 16 bytes' worth, in 16-byte loads, ATT_LOADS of K and of V issued per thread before
// any is stored, so a tile costs a round trip or two to memory; one value at a time (each load
// waited for before its store: 64 round trips a tile at head_dim 128) made a batch-1 decode's
// attention 90 us a layer at 128 tokens of context on an H200 (2026-11-27).
#define ATT_LOADS 8
template <typename CT>
__device__ __forceinline__ void load_tile(const CT* __restrict__ k_cache, const CT* __restrict__ v_cache,
                                          const int* slots, int num_keys, int num_kv_heads, int kh, int head_dim,
                                          float* ks, float* vs) {
    constexpr int VEC = 16 / sizeof(CT);
    if (head_dim % VEC == 0) {
        const int per_key = head_dim / VEC, total = ATT_TILE * per_key;
        for (int base = threadIdx.x; base < total; base += ATT_LOADS * blockDim.x) {
            uint4 kr[ATT_LOADS], vr[ATT_LOADS];
#pragma unroll
            for (int j = 0; j < ATT_LOADS; ++j) {
                const int i = base + j * blockDim.x, kk = i / per_key;
                kr[j] = vr[j] = make_uint4(0u, 0u, 0u, 0u);
                if (i < total && kk < num_keys) {
                    const size_t src = ((size_t)slots[kk] * num_kv_heads + kh) * head_dim + (i % per_key) * VEC;
                    kr[j] = *reinterpret_cast<const uint4*>(k_cache + src);
                    vr[j] = *reinterpret_cast<const uint4*>(v_cache + src);
                }
            }
#pragma unroll
            for (int j = 0; j < ATT_LOADS; ++j) {
                const int i = base + j * blockDim.x, kk = i / per_key, d = (i % per_key) * VEC;
                if (i >= total) break;
                float kf[VEC], vf[VEC];
                unpack16(kr[j], kf, k_cache);
                unpack16(vr[j], vf, v_cache);
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    ks[kk * (head_dim + 1) + d + e] = kf[e];
                    vs[kk * head_dim + d + e] = vf[e];
                }
            }
        }
        return;
    }
    for (int i = threadIdx.x; i < ATT_TILE * head_dim; i += blockDim.x) {     // head_dim 2, 4, 6 (tests)
        const int kk = i / head_dim, d = i % head_dim;
        float kv = 0.0f, vv = 0.0f;
        if (kk < num_keys) {
            const size_t src = ((size_t)slots[kk] * num_kv_heads + kh) * head_dim + d;
            kv = load_cache(k_cache + src);
            vv = load_cache(v_cache + src);
        }
        ks[kk * (head_dim + 1) + d] = kv;
        vs[kk * head_dim + d] = vv;
    }
}

// Merge the splits of (token t, head h): out = sum_z acc_z e^(m_z - M) / sum_z l_z e^(m_z - M).
// Splits that saw no key carry m = -inf, l = 0 and drop out. Threads stride over the head's dims.
__device__ __forceinline__ void combine_splits(const float2* ws_ml, const float* ws_acc, int num_splits, int max_splits,
                                               float* out, int ldo, int num_heads, int head_dim, int t, int h,
                                               int first, int stride) {
    const size_t base = ((size_t)t * num_heads + h) * max_splits;
    float m_max = -TW_INF;
    for (int z = 0; z < num_splits; ++z) m_max = fmaxf(m_max, __ldcg(&ws_ml[base + z].x));
    float denom = 0.0f;
    for (int z = 0; z < num_splits; ++z) {
        const float2 ml = __ldcg(ws_ml + base + z);
        if (ml.y > 0.0f) denom += ml.y * expf(ml.x - m_max);
    }
    for (int d = first; d < head_dim; d += stride) {
        float v = 0.0f;
        for (int z = 0; z < num_splits; ++z) {
            const float2 ml = __ldcg(ws_ml + base + z);
            if (ml.y > 0.0f) v += __ldcg(ws_acc + (base + z) * head_dim + d) * expf(ml.x - m_max);
        }
        out[(size_t)t * ldo + h * head_dim + d] = v / denom;
    }
}

template <typename CT, bool COMBINE = false>
__device__ __forceinline__ void attention_paged(
    const float* __restrict__ q, int ldq, const CT* __restrict__ k_cache, const CT* __restrict__ v_cache,
    const int* __restrict__ block_tables, int ld_bt, const int* __restrict__ positions,
    const int* __restrict__ items, float* __restrict__ out, int ldo,
    float2* __restrict__ ws_ml, float* __restrict__ ws_acc, int max_splits,
    int num_heads, int num_kv_heads, int head_dim, int block_size, int heads_per_block,
    int sliding_window, float scale, float softcap, int split_size, int* __restrict__ counters = nullptr) {
    extern __shared__ float smem[];
    float* qs = smem;                                                 // [16 pairs][hd]
    float* ks = qs + ATT_PAIRS * head_dim;                            // [32 keys][hd + 1] (padded: no bank conflicts)
    float* vs = ks + ATT_TILE * (head_dim + 1);                       // [32 keys][hd]
    __shared__ int slots[ATT_TILE];
    __shared__ int qpos[ATT_PAIRS];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = num_heads / num_kv_heads, head_chunks = group / heads_per_block;
    const int kh = blockIdx.y / head_chunks;
    const int head0 = kh * group + (blockIdx.y % head_chunks) * heads_per_block;
    pdl_wait();
    const int seq = items[3 * blockIdx.x], t0 = items[3 * blockIdx.x + 1], nq = items[3 * blockIdx.x + 2];
    const int num_pairs = nq * heads_per_block;
    const int p_first = positions[t0], p_last = positions[t0 + nq - 1];
    const int lo = sliding_window > 0 ? max(0, p_first - sliding_window + 1) : 0;
    // split_size 0: this item's keys spread over the grid's splits in whole tiles (decode graphs:
    // the grid is fixed at capture, the context is not; 128 keys of one sequence were one block of
    // 28 us a layer on an H200 at batch 1, when a split size fixed by max_model_len took them all)
    const int keys_per_split = split_size > 0
        ? split_size : ((p_last + 1 - lo + (int)gridDim.z - 1) / (int)gridDim.z + ATT_TILE - 1) / ATT_TILE * ATT_TILE;
    const int split_lo = lo + blockIdx.z * keys_per_split;
    const int split_hi = min(p_last + 1, split_lo + keys_per_split);
    const int* table = block_tables + (size_t)seq * ld_bt;

    for (int i = threadIdx.x; i < num_pairs * head_dim; i += blockDim.x) {
        const int p = i / head_dim, d = i % head_dim;
        qs[i] = q[(size_t)(t0 + p / heads_per_block) * ldq + (head0 + p % heads_per_block) * head_dim + d];
    }
    if (threadIdx.x < ATT_PAIRS) qpos[threadIdx.x] = threadIdx.x < num_pairs ? positions[t0 + threadIdx.x / heads_per_block] : 0;

    float m[ATT_PAIRS_PER_WARP], l[ATT_PAIRS_PER_WARP], acc[ATT_PAIRS_PER_WARP][ATT_MAX_DPL];
#pragma unroll
    for (int pi = 0; pi < ATT_PAIRS_PER_WARP; ++pi) {
        m[pi] = -TW_INF;
        l[pi] = 0.0f;
#pragma unroll
        for (int dl = 0; dl < ATT_MAX_DPL; ++dl) acc[pi][dl] = 0.0f;
    }
    const int dims_per_lane = (head_dim + 31) / 32;

    for (int kt = split_lo; kt < split_hi; kt += ATT_TILE) {
        const int num_keys = min(ATT_TILE, split_hi - kt);
        __syncthreads();                                              // previous tile fully consumed
        if (threadIdx.x < num_keys) {
            const int pos = kt + threadIdx.x;
            slots[threadIdx.x] = table[pos / block_size] * block_size + pos % block_size;
        }
        __syncthreads();
        load_tile(k_cache, v_cache, slots, num_keys, num_kv_heads, kh, head_dim, ks, vs);
        __syncthreads();
#pragma unroll
        for (int pi = 0; pi < ATT_PAIRS_PER_WARP; ++pi) {
            const int p = warp + pi * ATT_WARPS;
            if (p >= num_pairs) break;
            const int pos_q = qpos[p], key = kt + lane;
            const bool visible = lane < num_keys && key <= pos_q && (sliding_window <= 0 || key > pos_q - sliding_window);
            const float* qp = qs + p * head_dim;
            const float* kp = ks + lane * (head_dim + 1);
            float d4[4] = {0.0f, 0.0f, 0.0f, 0.0f};                   // four chains: latency, not a sum order
            for (int d = 0; d < head_dim; d += 4) {                   // head_dim is even; 4 | hd but for hd = 2
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    if (d + i < head_dim) d4[i] += qp[d + i] * kp[d + i];
            }
            const float dot = (d4[0] + d4[1]) + (d4[2] + d4[3]);
            float score = dot * scale;
            if (softcap > 0.0f) score = softcap * tanhf(score / softcap);       // Gemma 2, as core/model.py
            score = visible ? score : -TW_INF;
            const float m_new = fmaxf(m[pi], warp_max(score));
            if (m_new == -TW_INF) continue;                           // nothing visible yet (uniform)
            const float alpha = expf(m[pi] - m_new);
            const float e = visible ? expf(score - m_new) : 0.0f;
            l[pi] = l[pi] * alpha + warp_sum(e);
#pragma unroll
            for (int dl = 0; dl < ATT_MAX_DPL; ++dl) acc[pi][dl] *= alpha;
            for (int kk = 0; kk < num_keys; ++kk) {
                const float ek = __shfl_sync(FULL_MASK, e, kk);
#pragma unroll
                for (int dl = 0; dl < ATT_MAX_DPL; ++dl) {
                    const int d = lane + 32 * dl;
                    if (dl < dims_per_lane && d < head_dim) acc[pi][dl] += ek * vs[kk * head_dim + d];
                }
            }
            m[pi] = m_new;
        }
    }
    pdl_launch_dependents();

#pragma unroll
    for (int pi = 0; pi < ATT_PAIRS_PER_WARP; ++pi) {
        const int p = warp + pi * ATT_WARPS;
        if (p >= num_pairs) break;
        const int t = t0 + p / heads_per_block, h = head0 + p % heads_per_block;
        if (gridDim.z == 1) {
            float* dst = out + (size_t)t * ldo + h * head_dim;
#pragma unroll
            for (int dl = 0; dl < ATT_MAX_DPL; ++dl) {
                const int d = lane + 32 * dl;
                if (dl < dims_per_lane && d < head_dim) dst[d] = acc[pi][dl] / l[pi];
            }
        } else {
            const size_t w = ((size_t)t * num_heads + h) * max_splits + blockIdx.z;
            if (lane == 0) ws_ml[w] = make_float2(m[pi], l[pi]);
#pragma unroll
            for (int dl = 0; dl < ATT_MAX_DPL; ++dl) {
                const int d = lane + 32 * dl;
                if (dl < dims_per_lane && d < head_dim) ws_acc[w * head_dim + d] = acc[pi][dl];
            }
        }
    }
    if (!COMBINE || gridDim.z == 1) return;
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    int* counter = counters + blockIdx.x * gridDim.y + blockIdx.y;
    if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == (int)gridDim.z - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int p = warp; p < num_pairs; p += ATT_WARPS)                 // attention_combine's sum, per pair
        combine_splits(ws_ml, ws_acc, gridDim.z, max_splits, out, ldo, num_heads, head_dim,
                       t0 + p / heads_per_block, head0 + p % heads_per_block, lane, 32);
    if (threadIdx.x == 0) *counter = 0;                               // re-armed for the next launch
}

#define ATT_ARGS(CT) const float* __restrict__ q, int ldq, const CT* __restrict__ k_cache, \
    const CT* __restrict__ v_cache, const int* __restrict__ block_tables, int ld_bt, const int* __restrict__ positions, \
    const int* __restrict__ items, float* __restrict__ out, int ldo, float2* __restrict__ ws_ml, \
    float* __restrict__ ws_acc, int max_splits, int num_heads, int num_kv_heads, int head_dim, int block_size, \
    int heads_per_block, int sliding_window, float scale, float softcap, int split_size
#define ATT_PASS q, ldq, k_cache, v_cache, block_tables, ld_bt, positions, items, out, ldo, ws_ml, ws_acc, \
    max_splits, num_heads, num_kv_heads, head_dim, block_size, heads_per_block, sliding_window, scale, softcap, \
    split_size

extern "C" __global__ void __launch_bounds__(128) attention_paged_f32(ATT_ARGS(float)) { attention_paged<float>(ATT_PASS); }
extern "C" __global__ void __launch_bounds__(128) attention_paged_f16(ATT_ARGS(f16_t)) { attention_paged<f16_t>(ATT_PASS); }
extern "C" __global__ void __launch_bounds__(128) attention_paged_fused_f32(ATT_ARGS(float), int* __restrict__ counters) {
    attention_paged<float, true>(ATT_PASS, counters);
}
extern "C" __global__ void __launch_bounds__(128) attention_paged_fused_f16(ATT_ARGS(f16_t), int* __restrict__ counters) {
    attention_paged<f16_t, true>(ATT_PASS, counters);
}

// The unfused merge (the reference of the fused kernels' last split). grid (T, Hq), block 128.
extern "C" __global__ void __launch_bounds__(128) attention_combine(
    const float2* __restrict__ ws_ml, const float* __restrict__ ws_acc, int num_splits, int max_splits,
    float* __restrict__ out, int ldo, int num_heads, int head_dim) {
    pdl_wait();
    combine_splits(ws_ml, ws_acc, num_splits, max_splits, out, ldo, num_heads, head_dim, blockIdx.x, blockIdx.y,
                   threadIdx.x, blockDim.x);
}
