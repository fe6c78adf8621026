// INT4 group-wise weight x fp32 activation products: y[m, n] = sum_k W[n, k] x[m, k]
// with W[n, k] = (q[n, k] - zero[n, k/G]) * scale[n, k/G]  (docs/ENGINE_FORMAT.md).
//
// Kernels:
//   int4_mm_tc_*     tensor cores (sm_80+), every M: decode (4..16 tokens per block) and prefill
//                    (64), K split across blocks when the rows alone cannot fill the GPU.
//   int4_mm_simt     any architecture, the engine's own packing; the fallback and a cross-check.
//   int4_repack_tc   engine packing -> "tc" layout, once at load time.
//   int4_mm_tc_*_{rope_f32,rope_f16,silu,gelu,argmax}   the fused decoder kernels: the same product
//                    with the RMSNorm of x folded into its prologue and the next small kernel folded
//                    into its epilogue (see "Fused kernels" below); the plain kernels stay as their
//                    reference.
//
// Tensor-core path: mma.m16n8k16 with A = the weights' codes minus their zero points (exact
// small integers in fp16) and B = the activations, either split in two fp16 parts
// x = hi + lo fed as two B columns (22 significant bits: fp32-level results, the default) or
// rounded to fp16 (the faster "h" kernels). The fp32 products of each group are scaled once.
//
// Device weight layout "tc" (written once at load time by int4_repack_tc; layout.py is its twin):
//   rows padded to Np = multiple of 128, K padded to Kp = multiple of 128 (zero codes, zero scales)
//   qw: u32 [Np/16 tiles][Kp/64 chunks][32 lanes][4 steps]  -- one uint4 per lane per chunk
//       word `s` of lane (g = lane/4, t = lane%4) is the A fragment of k16-step s of the chunk:
//       nibble j and nibble j+4 hold register j = (q[r_j][k_j], q[r_j][k_j+1]) with
//       (r_j, k_j) = (g, 2t), (g+8, 2t), (g, 2t+8), (g+8, 2t+8)   (rows within the tile, k within the step)
//   sz: u32 [Np/16 tiles][Kp/G groups][16 rows]  -- half2 (scale in the low half, zero in the high half)
#include "common.cuh"

// ------------------------------------------------------------------ tensor-core helpers

__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
    u32 d;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ void mma_16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();   // the host never selects the tensor-core kernels below sm_80
#endif
}

__device__ __forceinline__ void unpack_scale_zero(u32 sz, float& scale, float& zero) {
    scale = f16_to_f32((f16_t)(sz & 0xffffu));
    zero = f16_to_f32((f16_t)(sz >> 16));
}

__device__ __forceinline__ void store_result(float* y, int ldy, int m, int n, float v,
                                             const float* bias, int accumulate) {
    if (bias) v += bias[n];
    float* dst = y + (size_t)m * ldy + n;
    *dst = accumulate ? *dst + v : v;
}

// ------------------------------------------------------------------ the tensor-core product

// Zero points folded into A: (1024 + q) - (1024 + z) and (1024 + 16q)/16 - (64 + z) are q - z,
// exact in fp16 for integer z in 0..15 (the quantizer's; weights.py sends other zeros to SIMT).
struct ZeroFold {
    u32 lo_g;      // half2(1024 + z) of row g      (registers 0 and 2: low nibbles)
    u32 hi_g8;     // half2(-(64 + z)) of row g + 8 (registers 1 and 3: high nibbles)
};

__device__ __forceinline__ ZeroFold zero_fold(float z_g, float z_g8) {
    const f16_t lo = f32_to_f16(1024.0f + z_g), hi = f32_to_f16(-(64.0f + z_g8));
    return {pack_f16x2(lo, lo), pack_f16x2(hi, hi)};
}

__device__ __forceinline__ void dequant_word_zero(u32 w, const ZeroFold& zf, u32 a[4]) {
    const u32 MAGIC = 0x64006400u, SIXTEENTH = 0x2c002c00u;
    a[0] = hsub2((w & 0x000f000fu) | MAGIC, zf.lo_g);
    a[1] = hfma2((w & 0x00f000f0u) | MAGIC, SIXTEENTH, zf.hi_g8);
    a[2] = hsub2(((w >> 8) & 0x000f000fu) | MAGIC, zf.lo_g);
    a[3] = hfma2(((w >> 8) & 0x00f000f0u) | MAGIC, SIXTEENTH, zf.hi_g8);
}

__device__ __forceinline__ u32 f16x2_of(float lo, float hi) {
    return pack_f16x2(f32_to_f16(lo), f32_to_f16(hi));
}

// Activations of one 128-wide K unit as B fragments: TOKENS x 64 pairs (k, k + 1), spread over
// the block's 256 threads, PER_THREAD pairs each. Loading (global) and storing (shared, in
// fragment order) are separate so the next unit's loads can fly while this unit is multiplied.
// With `denom` (the fused RMSNorm prologue) each value becomes x / denom[tok] * norm_w[k], in
// rmsnorm.cu's order of operations, and zero past norm_dim.
template <int TOKENS, int PER_THREAD>
__device__ __forceinline__ void load_unit_x(float2 (&xr)[PER_THREAD], const float* __restrict__ x, int ldx, int M,
                                            int tok0, int u, const float* denom = nullptr,
                                            const float* __restrict__ norm_w = nullptr, int norm_dim = 0) {
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int idx = threadIdx.x + i * 256, tok = idx >> 6, k = 2 * (idx & 63);
        xr[i] = make_float2(0.0f, 0.0f);
        if (idx < TOKENS * 64 && tok0 + tok < M) {
            xr[i] = __ldg(reinterpret_cast<const float2*>(x + (size_t)(tok0 + tok) * ldx + u * 128 + k));
            if (denom) {
                const int kk = u * 128 + k;
                const float dn = denom[tok];
                xr[i].x = kk < norm_dim ? xr[i].x / dn * __ldg(norm_w + kk) : 0.0f;
                xr[i].y = kk + 1 < norm_dim ? xr[i].y / dn * __ldg(norm_w + kk + 1) : 0.0f;
            }
        }
    }
}

// The scale/zero words of one unit's groups for this lane's rows g and g + 8, in the "tc" layout.
__device__ __forceinline__ void load_unit_sz(u32 (&szw)[4][2], const u32* __restrict__ stile, int u,
                                             int groups_per_unit, int g) {
#pragma unroll
    for (int gg = 0; gg < 4; ++gg) {
        if (gg < groups_per_unit) {
            szw[gg][0] = __ldg(stile + (u * groups_per_unit + gg) * 16 + g);
            szw[gg][1] = __ldg(stile + (u * groups_per_unit + gg) * 16 + g + 8);
        }
    }
}

// One unit's weights for this lane (two 16-byte words: its 16 rows x 128 k of the warp's tile)
// and its scale/zero words.
__device__ __forceinline__ void load_unit_w(uint4 (&w)[2], u32 (&szw)[4][2], const uint4* __restrict__ qtile,
                                            const u32* __restrict__ stile, int u, int groups_per_unit, int g) {
    w[0] = __ldg(qtile + (size_t)(2 * u) * 32);
    w[1] = __ldg(qtile + (size_t)(2 * u + 1) * 32);
    load_unit_sz(szw, stile, u, groups_per_unit, g);
}

// cp.async (sm_80+): 16 bytes global -> shared without a register, `wait_group<N>`: until at most N of
// this thread's committed groups are in flight, their bytes then visible to it
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"((u32)__cvta_generic_to_shared(smem)), "l"(gmem));
#else
    __trap();   // the host never selects the tensor-core kernels below sm_80
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" :: "n"(N));
#endif
}

// load_unit_w's ASYNC twin: the lane's two weight words go to its own slot of shared memory (only it
// reads them back: no barrier), the scale/zero words to registers; the caller commits the group.
__device__ __forceinline__ void load_unit_w_async(uint4 (&slot)[2][32], u32 (&szw)[4][2], const uint4* __restrict__ qtile,
                                                  const u32* __restrict__ stile, int u, int groups_per_unit, int g,
                                                  int lane) {
    cp_async16(&slot[0][lane], qtile + (size_t)(2 * u) * 32);
    cp_async16(&slot[1][lane], qtile + (size_t)(2 * u + 1) * 32);
    load_unit_sz(szw, stile, u, groups_per_unit, g);
}

template <int NT, bool SPLIT, int TOKENS, int PER_THREAD>
__device__ __forceinline__ void store_unit_x(const float2 (&xr)[PER_THREAD], uint2 (*frag)[NT][32]) {
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int idx = threadIdx.x + i * 256, tok = idx >> 6, k = 2 * (idx & 63);
        if (idx >= TOKENS * 64) break;
        const int step = k >> 4, kk = k & 15, ft = (kk & 7) >> 1, reg = kk >> 3;
        const float2 v = xr[i];
        if (SPLIT) {
            const int j = tok >> 2, col = 2 * (tok & 3);
            const u32 hi = f16x2_of(v.x, v.y);
            const u32 lo = f16x2_of(v.x - f16_to_f32((f16_t)(hi & 0xffffu)), v.y - f16_to_f32((f16_t)(hi >> 16)));
            reinterpret_cast<u32*>(&frag[step][j][col * 4 + ft])[reg] = hi;
            reinterpret_cast<u32*>(&frag[step][j][(col + 1) * 4 + ft])[reg] = lo;
        } else {
            const int j = tok >> 3, col = tok & 7;
            reinterpret_cast<u32*>(&frag[step][j][col * 4 + ft])[reg] = f16x2_of(v.x, v.y);
        }
    }
}

// ------------------------------------------------------------------ fused prologue and epilogues

// Epilogues. Results leave the product in pairs: rows n and n + 8 of a 16-row tile, for one
// token m (a lane holds exactly such pairs). The fused kernels' weights are uploaded with their
// rows reordered (kernels/cuda/layout.py) so that each pair is what the folded kernel needs:
//   EPI_ROPE_*  qkv rows of each head in the order [j0..j0+7, j0+half..j0+half+7, ...]: a pair is
//               (x[j], x[j + half]), rotated (rope_kv_append's arithmetic) into q_out or the
//               paged K cache; V pairs go to the V cache. Needs head_dim % 16 == 0.
//   EPI_SILU/GELU  gate_up rows interleaved [gate 8t..8t+7, up 8t..8t+7]: a pair is (gate[i], up[i])
//               and y[m, i] = act(gate) * up. Needs intermediate_size % 8 == 0.
//   EPI_ARGMAX  logits stored as usual, and the row's greedy token: the block's best (logit,
//               lowest index) per token in shared memory, one 64-bit atomicMax per block into
//               argmax_keys, and the last block of the token tile to arrive writes tokens[m] and
//               re-arms the keys and its counter (graphs replay it as is).
#define EPI_STORE 0
#define EPI_ROPE_F32 1
#define EPI_ROPE_F16 2
#define EPI_SILU 3
#define EPI_GELU 4
#define EPI_ARGMAX 5

struct FusedArgs {
    const float* norm_w; int norm_dim; float eps;               // prologue: x -> rmsnorm(x) * norm_w
    const int* positions; const int* slot_mapping;              // EPI_ROPE_*
    const float2* cos_sin; int max_positions;
    float* q_out; int ldq; void* k_cache; void* v_cache;
    int num_heads; int num_kv_heads; int head_dim;
    u64* argmax_keys; int* argmax_counters; int* tokens;        // EPI_ARGMAX
};

__device__ __forceinline__ void store_cache_value(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_cache_value(f16_t* p, float v) { *p = f32_to_f16(v); }

template <int EPI>
__device__ __forceinline__ void epilogue_pair(float* y, int ldy, int M, int N, int m, int n, float va, float vb,
                                              const float* bias, int accumulate, const FusedArgs& f, u64* best,
                                              int tok) {
    if (m >= M || n >= N) return;
    if (EPI == EPI_STORE || EPI == EPI_ARGMAX) {
        store_result(y, ldy, m, n, va, bias, accumulate);
        if (n + 8 < N) store_result(y, ldy, m, n + 8, vb, bias, accumulate);
        if (EPI == EPI_ARGMAX) {                                // lm_head: never accumulates
            u64 key = rank_key(bias ? va + bias[n] : va, n);
            if (n + 8 < N) {
                const u64 kb = rank_key(bias ? vb + bias[n + 8] : vb, n + 8);
                key = kb > key ? kb : key;
            }
            atomicMax(best + tok, key);
        }
        return;
    }
    if (bias) { va += bias[n]; vb += bias[n + 8]; }
    if (EPI == EPI_SILU || EPI == EPI_GELU) {
        const int i = (n >> 4) * 8 + (n & 7);                   // interleaved: pair = (gate[i], up[i])
        y[(size_t)m * ldy + i] = (EPI == EPI_GELU ? act_gelu_tanh(va) : act_silu(va)) * vb;
        return;
    }
    // EPI_ROPE_*: n is row r < 8 of a 16-row block b of a head; the pair is (x[j], x[j + half])
    const int hd = f.head_dim, half = hd / 2, head = n / hd, p = n % hd;
    const int j = (p >> 4) * 8 + (p & 7);
    typedef typename tw_select<EPI == EPI_ROPE_F16, f16_t, float>::type CT;
    const size_t slot_base = (size_t)f.slot_mapping[m] * f.num_kv_heads * hd;
    if (head >= f.num_heads + f.num_kv_heads) {                 // V: no rotation
        CT* dst = reinterpret_cast<CT*>(f.v_cache) + slot_base + (head - f.num_heads - f.num_kv_heads) * hd;
        store_cache_value(dst + j, va);
        store_cache_value(dst + j + half, vb);
        return;
    }
    const int pos = min(max(f.positions[m], 0), f.max_positions - 1);
    const float2 c = f.cos_sin[(size_t)pos * half + j];
    const float r1 = __fsub_rn(__fmul_rn(va, c.x), __fmul_rn(vb, c.y));
    const float r2 = __fadd_rn(__fmul_rn(vb, c.x), __fmul_rn(va, c.y));
    if (head < f.num_heads) {
        float* dst = f.q_out + (size_t)m * f.ldq + head * hd;
        dst[j] = r1;
        dst[j + half] = r2;
    } else {
        CT* dst = reinterpret_cast<CT*>(f.k_cache) + slot_base + (head - f.num_heads) * hd;
        store_cache_value(dst + j, r1);
        store_cache_value(dst + j + half, r2);
    }
}

// EPI_ARGMAX after every pair of the block: the block's best per token into argmax_keys, and the
// last block of the token tile turns the keys into token ids (all threads of the block call this).
template <int TOKENS>
__device__ __forceinline__ void argmax_finish(const FusedArgs& f, u64* best, int tok0, int M) {
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x < TOKENS && tok0 + threadIdx.x < M && best[threadIdx.x])
        atomicMax(reinterpret_cast<unsigned long long*>(f.argmax_keys + tok0 + threadIdx.x), best[threadIdx.x]);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(f.argmax_counters + blockIdx.y, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x < TOKENS && tok0 + threadIdx.x < M) {
        const u64 key = atomicExch(reinterpret_cast<unsigned long long*>(f.argmax_keys + tok0 + threadIdx.x), 0ull);
        f.tokens[tok0 + threadIdx.x] = key_index(key);
    }
    if (threadIdx.x == 0) f.argmax_counters[blockIdx.y] = 0;
}

// int4_mm_tc<NT, SPLIT>: y[M, N] (+)= x[M, K] W^T (+ bias), weights in the "tc" layout.
//
// grid (Np / 128 row blocks, ceil(M / TOKENS) token tiles, K splits), block 256 (8 warps).
// Warp w owns weight rows [16 w, 16 w + 16) of the row block, for every k of the block's K
// range (units_per_split units of 128). Per unit the block stages its tokens' activations
// once in shared memory, already as B fragments, and every warp reads them from there.
// B columns: SPLIT (exact) feeds each token as two fp16 columns, hi = fp16(x) and
// lo = fp16(x - hi), 4 tokens per n8 tile; otherwise one fp16 column per token, 8 per tile.
// The weights of the next PREFETCH units are in flight while a unit is multiplied; with up to
// 8 n8 tiles the activations are double-buffered too (the next unit's loads fly meanwhile).
// With more than one K split, each block writes fp32 partials to ws and the last block of a
// (row block, token tile) to arrive adds them in split order (deterministic), applies the
// epilogue and re-arms the counter, so graphs replay it as is.
// PDL: the block's first PREFETCH units of weights load before the dependency wait, and
// dependents are signalled as soon as the last weight
// load is issued. NORM: x's rows are RMS-normalized on the fly (f.norm_w), each block computing
// its tokens' norms itself (rmsnorm.cu's reduction order, so results match the unfused pair); the
// tiles of up to 16 tokens only (the 64-token tiles' fused kernels take x normalised: "_xn").
// ASYNC (the x4 kernels) keeps the PREFETCH units in flight in shared memory (cp.async, each lane
// its own bytes: no barrier) instead of registers, so more can fly per SM (64 registers: 4 blocks).
// Experiments (kernels.py MM_VARIANTS, `bench engine --backend cuda --mm-variant`): the "r" kernel,
// x4 with its units in registers. PROBE (the "p" kernel, never in a model step) streams the weights
// as the product does and nothing else (no activation, no barrier, no multiply), so its time is the
// ceiling of this grid and load pipeline:
// 3.1-4.7 TB/s where the products moved 1.3-2.1 (H200, 2026-11-28), so the products' own loop,
// not their loads, holds them. A prefetch.global.L2 of each block's whole slice went: the probes
// streamed 15-50% faster without it, the products 0-16% (lm_head most).
// SPG: the steps (k16) per group, 2, 4 or 8 (group size 32, 64, 128), or 0: read from group_size.
// With it known, a unit's group starts, ends and scale selection are fixed at compile time: the
// generic x4 loop was ~470 instructions a unit (cuobjdump, sm_90), half of them that bookkeeping,
// and a batch-1 product of ~8 warps a scheduler is issue bound (kernels.py MM_BY_GROUP).
template <int NT, bool SPLIT, int PREFETCH, int EPI = EPI_STORE, bool NORM = false, bool PROBE = false, int SPG = 0,
          bool ASYNC = false>
__device__ __forceinline__ void int4_mm_tc(
    const float* __restrict__ x, int ldx, int M,                 // x: [M, ldx], zero beyond K
    const uint4* __restrict__ qw, const u32* __restrict__ sz,    // "tc" layout
    int num_units, int group_size, int units_per_split,
    const float* __restrict__ bias, float* y, int ldy, int N, int accumulate,
    float* __restrict__ ws, int* __restrict__ counters,          // K-split partials / arrival counters
    const FusedArgs& f = FusedArgs{}) {
    constexpr int TPT = SPLIT ? 4 : 8;                           // tokens per n8 tile
    constexpr int TOKENS = NT * TPT;
    constexpr int NACC = SPLIT ? 2 : 4;                          // results per tile and lane
    constexpr bool DOUBLE = NT <= 8;                             // 2 x 16 KB at most: static shared memory
    constexpr int PER_THREAD = (TOKENS * 64 + 255) / 256;
    __shared__ uint2 frag[DOUBLE ? 2 : 1][8][NT][32];            // [buffer][k16 step][n8 tile][lane]
    __shared__ int is_last;
    __shared__ float denom[NORM ? TOKENS : 1];                   // the fused RMSNorm's per-token sqrt(mean + eps)
    __shared__ u64 best[EPI == EPI_ARGMAX ? TOKENS : 1];         // EPI_ARGMAX: the block's best key per token
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * 8 + warp;
    const int tok0 = blockIdx.y * TOKENS;
    const int num_groups = num_units * 128 / group_size;
    const int steps_per_group = SPG ? SPG : group_size / 16, groups_per_unit = 8 / steps_per_group;
    if (SPG && group_size != SPG * 16) __trap();                 // the host picks the kernel by group size
    const int u_begin = blockIdx.z * units_per_split, u_end = min(num_units, u_begin + units_per_split);
    const uint4* qtile = qw + (size_t)tile * num_units * 2 * 32 + lane;
    const u32* stile = sz + (size_t)tile * num_groups * 16;

    float acc[NT][NACC], part[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int i = 0; i < NACC; ++i) acc[j][i] = 0.0f;
        part[j][0] = part[j][1] = part[j][2] = part[j][3] = 0.0f;
    }
    // weights (never written by an earlier kernel) may load before the dependency wait
    static_assert(!(ASYNC && PROBE), "the probes stream through registers");
    uint4 wbuf[ASYNC ? 1 : PREFETCH][2];
    __shared__ __align__(16) uint4 wring[ASYNC ? PREFETCH : 1][8][2][32];   // ASYNC: [unit slot][warp][word][lane]
    u32 szbuf[PREFETCH][4][2];                                   // [unit][group in unit][row g, row g + 8]
#pragma unroll
    for (int p = 0; p < PREFETCH; ++p) {
        if (u_begin + p < u_end) {
            if (ASYNC) load_unit_w_async(wring[p][warp], szbuf[p], qtile, stile, u_begin + p, groups_per_unit, g, lane);
            else load_unit_w(wbuf[p], szbuf[p], qtile, stile, u_begin + p, groups_per_unit, g);
        }
        if (ASYNC) cp_async_commit();                            // one group per unit slot, empty or not
    }
    if (EPI == EPI_ARGMAX && tid < TOKENS) best[tid] = 0ull;
    pdl_wait();
    if (PROBE) {                                                 // the weight stream alone
        u32 seen = 0u;
        for (int u0 = u_begin; u0 < u_end; u0 += PREFETCH) {
#pragma unroll
            for (int p = 0; p < PREFETCH; ++p) {
                const int u = u0 + p;
                if (u >= u_end) break;
                seen ^= wbuf[p][0].x ^ wbuf[p][0].y ^ wbuf[p][0].z ^ wbuf[p][0].w ^ wbuf[p][1].x ^ wbuf[p][1].y
                        ^ wbuf[p][1].z ^ wbuf[p][1].w ^ szbuf[p][0][0] ^ szbuf[p][0][1];
                if (u + PREFETCH < u_end) load_unit_w(wbuf[p], szbuf[p], qtile, stile, u + PREFETCH, groups_per_unit, g);
            }
        }
        pdl_launch_dependents();
        if (seen == 0x9e3779b9u) y[0] = 1.0f;                    // never, as far as the compiler knows
        return;
    }
    bool signalled = false;                                      // pdl_launch_dependents issued
    if (NORM) {
        // rmsnorm.cu's sum for each token of the tile, in its order (thread tid's partial over
        // d = tid, tid + 256, ..., then block_sum's tree: each warp's warp_sum, the 8 warp sums
        // through shared memory, a warp_sum of those), 8 tokens at a time so that their loads are
        // in flight together: one token after another, every load waited for, cost a decode block
        // ~8 us a token and the 64-token tile's products 10x their unfused time (H200, 2026-11-27).
        // A pass is as many tokens as the tile has, 8 at most: the x4 tile's passes summed 8 rows, 4
        // of them clamped copies (the fused decode products ran 0.94-1.14 TB/s against the plain
        // ones' 1.74 at batch 1, H100, 2026-11-28).
        constexpr int NB = TOKENS < 8 ? TOKENS : 8;              // tokens per pass (<= warps per block)
        __shared__ float scratch[NB][8];                         // [token of the pass][warp]
        for (int tb = 0; tb < TOKENS && tok0 + tb < M; tb += NB) {
            float ss[NB];
            const float* row[NB];
#pragma unroll
            for (int j = 0; j < NB; ++j) {
                ss[j] = 0.0f;
                row[j] = x + (size_t)min(tok0 + tb + j, M - 1) * ldx;     // past M: a valid row, unused
            }
#pragma unroll 4
            for (int d = tid; d < f.norm_dim; d += 256) {
#pragma unroll
                for (int j = 0; j < NB; ++j) ss[j] += row[j][d] * row[j][d];
            }
#pragma unroll
            for (int j = 0; j < NB; ++j) ss[j] = warp_sum(ss[j]);
            __syncthreads();                                     // the previous pass has read scratch
            if (lane == 0) {
#pragma unroll
                for (int j = 0; j < NB; ++j) scratch[j][warp] = ss[j];
            }
            __syncthreads();
            if (warp < NB) {                                     // warp j finishes token j of the pass
                const float total = warp_sum(lane < 8 ? scratch[warp][lane] : 0.0f);
                if (lane == 0) denom[tb + warp] = sqrtf(total / (float)f.norm_dim + f.eps);
            }
        }
        __syncthreads();
    }
    const float* dn = NORM ? denom : nullptr;

    float2 xr[PER_THREAD];
    int cur = 0;                                                 // the buffer being multiplied
    if (u_begin < u_end) {
        load_unit_x<TOKENS, PER_THREAD>(xr, x, ldx, M, tok0, u_begin, dn, f.norm_w, f.norm_dim);
        store_unit_x<NT, SPLIT, TOKENS, PER_THREAD>(xr, frag[0]);
    }
    __syncthreads();

    for (int u0 = u_begin; u0 < u_end; u0 += PREFETCH) {
#pragma unroll
        for (int p = 0; p < PREFETCH; ++p) {
            const int u = u0 + p;
            if (u >= u_end) break;                               // uniform across the block
            if (!signalled && u + PREFETCH >= u_end) {           // every weight load is issued
                pdl_launch_dependents();
                signalled = true;
            }
            if (DOUBLE) {
                if (u + 1 < u_end) load_unit_x<TOKENS, PER_THREAD>(xr, x, ldx, M, tok0, u + 1, dn, f.norm_w, f.norm_dim);
            } else if (u != u_begin) {
                load_unit_x<TOKENS, PER_THREAD>(xr, x, ldx, M, tok0, u, dn, f.norm_w, f.norm_dim);
                store_unit_x<NT, SPLIT, TOKENS, PER_THREAD>(xr, frag[0]);
                __syncthreads();
            }
            uint4 w0, w1;
            if (ASYNC) {                                         // this unit's group: PREFETCH - 1 later ones may fly
                cp_async_wait<PREFETCH - 1>();
                w0 = wring[p][warp][0][lane];
                w1 = wring[p][warp][1][lane];
            } else {
                w0 = wbuf[p][0];
                w1 = wbuf[p][1];
            }
            const u32 words[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
            ZeroFold zf = {0u, 0u};
            float s_g = 0.0f, s_g8 = 0.0f;
            int gg = 0;                                          // group within the unit
#pragma unroll
            for (int s = 0; s < 8; ++s) {
                if ((s & (steps_per_group - 1)) == 0) {          // a group starts with this step
                    u32 w0 = szbuf[p][0][0], w8 = szbuf[p][0][1];
#pragma unroll
                    for (int q = 1; q < 4; ++q)
                        if (gg == q) { w0 = szbuf[p][q][0]; w8 = szbuf[p][q][1]; }
                    float z_g, z_g8;
                    unpack_scale_zero(w0, s_g, z_g);
                    unpack_scale_zero(w8, s_g8, z_g8);
                    zf = zero_fold(z_g, z_g8);
                    ++gg;
                }
                u32 a[4];
                dequant_word_zero(words[s], zf, a);
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const uint2 b = frag[cur][s][j][lane];
                    mma_16816(part[j], a, b.x, b.y);
                }
                if (((s + 1) & (steps_per_group - 1)) == 0) {    // the group ends: scale its products
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        if (SPLIT) {
                            acc[j][0] += s_g * (part[j][0] + part[j][1]);
                            acc[j][1] += s_g8 * (part[j][2] + part[j][3]);
                        } else {
                            acc[j][0] += s_g * part[j][0];
                            acc[j][1] += s_g * part[j][1];
                            acc[j][NACC - 2] += s_g8 * part[j][2];
                            acc[j][NACC - 1] += s_g8 * part[j][3];
                        }
                        part[j][0] = part[j][1] = part[j][2] = part[j][3] = 0.0f;
                    }
                }
            }
            // refill this prefetch slot with the unit PREFETCH ahead (ASYNC: its words were read above)
            if (u + PREFETCH < u_end) {
                if (ASYNC) load_unit_w_async(wring[p][warp], szbuf[p], qtile, stile, u + PREFETCH, groups_per_unit, g, lane);
                else load_unit_w(wbuf[p], szbuf[p], qtile, stile, u + PREFETCH, groups_per_unit, g);
            }
            if (ASYNC) cp_async_commit();
            if (DOUBLE) {
                if (u + 1 < u_end) store_unit_x<NT, SPLIT, TOKENS, PER_THREAD>(xr, frag[cur ^ 1]);
                cur ^= 1;
            }
            __syncthreads();                                     // the staged unit changes hands
        }
    }
    if (!signalled) pdl_launch_dependents();

    // lane results: rows n0 = 16 tile + g and n0 + 8, as pairs; tokens per tile j: SPLIT 4j + t, else 8j + 2t (+1)
    const int n0 = tile * 16 + g;
    if (gridDim.z == 1) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            if (SPLIT) {
                epilogue_pair<EPI>(y, ldy, M, N, tok0 + 4 * j + t, n0, acc[j][0], acc[j][1], bias, accumulate, f,
                                   best, 4 * j + t);
            } else {
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    epilogue_pair<EPI>(y, ldy, M, N, tok0 + 8 * j + 2 * t + e, n0, acc[j][e], acc[j][NACC - 2 + e],
                                       bias, accumulate, f, best, 8 * j + 2 * t + e);
            }
        }
        if (EPI == EPI_ARGMAX) argmax_finish<TOKENS>(f, best, tok0, M);
        return;
    }
    // K split: partials [split][token of the tile][row of the row block], then the last block sums them
    const int rows = gridDim.x * 128, ws_tile = TOKENS * rows;
    float* mine = ws + ((size_t)blockIdx.z * gridDim.y + blockIdx.y) * ws_tile;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int i = 0; i < NACC; ++i) {
            const int tok = SPLIT ? 4 * j + t : 8 * j + 2 * t + (i & 1);
            const int n = n0 + ((SPLIT ? i : i >> 1) ? 8 : 0);
            mine[(size_t)tok * rows + n] = acc[j][i];
        }
    }
    __threadfence();
    __syncthreads();
    int* counter = counters + blockIdx.y * gridDim.x + blockIdx.x;
    if (tid == 0) is_last = atomicAdd(counter, 1) == (int)gridDim.z - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int i = tid; i < TOKENS * 64; i += blockDim.x) {        // (token, pair): rows n and n + 8
        const int tok = i / 64, r = i % 64, n = blockIdx.x * 128 + (r >> 3) * 16 + (r & 7), m = tok0 + tok;
        if (m >= M || n >= N) continue;
        float va = 0.0f, vb = 0.0f;
        for (int z = 0; z < (int)gridDim.z; ++z) {
            const float* part_z = ws + ((size_t)z * gridDim.y + blockIdx.y) * ws_tile + (size_t)tok * rows;
            va += __ldcg(part_z + n);
            vb += __ldcg(part_z + n + 8);
        }
        epilogue_pair<EPI>(y, ldy, M, N, m, n, va, vb, bias, accumulate, f, best, tok);
    }
    if (tid == 0) *counter = 0;                                  // re-armed for the next launch
    if (EPI == EPI_ARGMAX) argmax_finish<TOKENS>(f, best, tok0, M);
}

#define MM_ARGS const float* __restrict__ x, int ldx, int M, const uint4* __restrict__ qw, \
    const u32* __restrict__ sz, int num_units, int group_size, int units_per_split, \
    const float* __restrict__ bias, float* y, int ldy, int N, int accumulate, float* __restrict__ ws, \
    int* __restrict__ counters
#define MM_PASS x, ldx, M, qw, sz, num_units, group_size, units_per_split, bias, y, ldy, N, accumulate, ws, counters

// exact (hi/lo activations): 4, 8, 16 tokens for decode (one kernel per group size), 64 for prefill
#define MM_BY_GROUP(NAME, NT, SPLIT, PREFETCH, ASYNC) \
    extern "C" __global__ void __launch_bounds__(256) NAME##g32(MM_ARGS) \
        { int4_mm_tc<NT, SPLIT, PREFETCH, EPI_STORE, false, false, 2, ASYNC>(MM_PASS); } \
    extern "C" __global__ void __launch_bounds__(256) NAME##g64(MM_ARGS) \
        { int4_mm_tc<NT, SPLIT, PREFETCH, EPI_STORE, false, false, 4, ASYNC>(MM_PASS); } \
    extern "C" __global__ void __launch_bounds__(256) NAME##g128(MM_ARGS) \
        { int4_mm_tc<NT, SPLIT, PREFETCH, EPI_STORE, false, false, 8, ASYNC>(MM_PASS); }
// x4: 5 units of weights in flight per warp through shared memory (cp.async, 40 KB a block, 64
// registers: 4 blocks a SM): the 8B step's kernels 3.29 -> 3.09 ms at batch 1 against 4 units in
// registers (80 registers, 3 a SM), each planned for one wave (H200, 2026-11-28)
MM_BY_GROUP(int4_mm_tc_x4, 1, true, 5, true)
MM_BY_GROUP(int4_mm_tc_x8, 2, true, 4, false)
MM_BY_GROUP(int4_mm_tc_x16, 4, true, 2, false)
// the experiments (kernels.py MM_VARIANTS, MM_PROBES): x4 (group 64) with its 4 units in flight in
// registers (what x4 was before cp.async); the weight stream alone
extern "C" __global__ void __launch_bounds__(256) int4_mm_tc_x4g64r(MM_ARGS) {
    int4_mm_tc<1, true, 4, EPI_STORE, false, false, 4, false>(MM_PASS);
}
extern "C" __global__ void __launch_bounds__(256) int4_mm_tc_x4p(MM_ARGS) {
    int4_mm_tc<1, true, 4, EPI_STORE, false, true>(MM_PASS);
}
extern "C" __global__ void __launch_bounds__(256) int4_mm_tc_x64(MM_ARGS) { int4_mm_tc<16, true, 1>(MM_PASS); }
// fp16 activations (one column per token): 8, 16 tokens for decode, 64 for prefill
extern "C" __global__ void __launch_bounds__(256) int4_mm_tc_h8(MM_ARGS) { int4_mm_tc<1, false, 4>(MM_PASS); }
extern "C" __global__ void __launch_bounds__(256) int4_mm_tc_h16(MM_ARGS) { int4_mm_tc<2, false, 4>(MM_PASS); }
extern "C" __global__ void __launch_bounds__(256) int4_mm_tc_h64(MM_ARGS) { int4_mm_tc<8, false, 2>(MM_PASS); }

// ------------------------------------------------------------------ fused kernels

// The plain product's parameters, then the fused ones (kernels.py _MATMUL_FUSED), unused ones 0.
#define MMF_ARGS MM_ARGS, const float* __restrict__ norm_w, int norm_dim, float eps, \
    const int* __restrict__ positions, const int* __restrict__ slot_mapping, const float2* __restrict__ cos_sin, \
    int max_positions, float* __restrict__ q_out, int ldq, void* k_cache, void* v_cache, int num_heads, \
    int num_kv_heads, int head_dim, u64* argmax_keys, int* argmax_counters, int* tokens
#define MMF_STRUCT FusedArgs{norm_w, norm_dim, eps, positions, slot_mapping, cos_sin, max_positions, q_out, ldq, \
    k_cache, v_cache, num_heads, num_kv_heads, head_dim, argmax_keys, argmax_counters, tokens}
// NORM false (the "_xn" kernels): x arrives normalised (rmsnorm ran first, forward.py
// NORM_APART_ABOVE), the epilogue is the same: a 64-token tile normalising its activations in
// every block, once per unit it loads, made the fused gate_up 2.2x its unfused product at batch 64
// (H200, 2026-11-27).
// ARGMAX_BLOCKS: the argmax kernel's minimum blocks per SM for ptxas: 2 (at most 128 registers,
// what ptxas picks by itself for the decode tiles), 1 where that would spill (x16 at group 32, which
// wants 178; the fp16 tiles; the 64-token tiles).
// LB: the other four kernels' launch bounds, LB_PLAIN (ptxas picks the registers: 128 at most for
// these) or LB_ONE (a minimum of 1 block a SM: the fp16 tiles, which spilled at 128).
#define LB_PLAIN 256
#define LB_ONE 256, 1
#define MM_FUSED_AS(NAME, SUFFIX, NT, SPLIT, PREFETCH, NORM, SPG, ARGMAX_BLOCKS, ASYNC, LB) \
    extern "C" __global__ void __launch_bounds__(LB) NAME##_rope_f32##SUFFIX(MMF_ARGS) \
        { int4_mm_tc<NT, SPLIT, PREFETCH, EPI_ROPE_F32, NORM, false, SPG, ASYNC>(MM_PASS, MMF_STRUCT); } \
    extern "C" __global__ void __launch_bounds__(LB) NAME##_rope_f16##SUFFIX(MMF_ARGS) \
        { int4_mm_tc<NT, SPLIT, PREFETCH, EPI_ROPE_F16, NORM, false, SPG, ASYNC>(MM_PASS, MMF_STRUCT); } \
    extern "C" __global__ void __launch_bounds__(LB) NAME##_silu##SUFFIX(MMF_ARGS) \
        { int4_mm_tc<NT, SPLIT, PREFETCH, EPI_SILU, NORM, false, SPG, ASYNC>(MM_PASS, MMF_STRUCT); } \
    extern "C" __global__ void __launch_bounds__(LB) NAME##_gelu##SUFFIX(MMF_ARGS) \
        { int4_mm_tc<NT, SPLIT, PREFETCH, EPI_GELU, NORM, false, SPG, ASYNC>(MM_PASS, MMF_STRUCT); } \
    extern "C" __global__ void __launch_bounds__(256, ARGMAX_BLOCKS) NAME##_argmax##SUFFIX(MMF_ARGS) \
        { int4_mm_tc<NT, SPLIT, PREFETCH, EPI_ARGMAX, NORM, false, SPG, ASYNC>(MM_PASS, MMF_STRUCT); }
#define MM_FUSED(NAME, NT, SPLIT, PREFETCH) MM_FUSED_AS(NAME, , NT, SPLIT, PREFETCH, true, 0, 1, false, LB_ONE)

MM_FUSED_AS(int4_mm_tc_x4g32, , 1, true, 5, true, 2, 2, true, LB_PLAIN)
MM_FUSED_AS(int4_mm_tc_x4g64, , 1, true, 5, true, 4, 2, true, LB_PLAIN)
MM_FUSED_AS(int4_mm_tc_x4g128, , 1, true, 5, true, 8, 2, true, LB_PLAIN)
MM_FUSED_AS(int4_mm_tc_x4g64r, , 1, true, 4, true, 4, 2, false, LB_PLAIN)
MM_FUSED_AS(int4_mm_tc_x8g32, , 2, true, 4, true, 2, 2, false, LB_PLAIN)
MM_FUSED_AS(int4_mm_tc_x8g64, , 2, true, 4, true, 4, 2, false, LB_PLAIN)
MM_FUSED_AS(int4_mm_tc_x8g128, , 2, true, 4, true, 8, 2, false, LB_PLAIN)
MM_FUSED_AS(int4_mm_tc_x16g32, , 4, true, 2, true, 2, 1, false, LB_PLAIN)
MM_FUSED_AS(int4_mm_tc_x16g64, , 4, true, 2, true, 4, 2, false, LB_PLAIN)
MM_FUSED_AS(int4_mm_tc_x16g128, , 4, true, 2, true, 8, 2, false, LB_PLAIN)
MM_FUSED_AS(int4_mm_tc_x64, _xn, 16, true, 1, false, 0, 1, false, LB_PLAIN)
MM_FUSED(int4_mm_tc_h8, 1, false, 4)
MM_FUSED(int4_mm_tc_h16, 2, false, 4)
MM_FUSED_AS(int4_mm_tc_h64, _xn, 8, false, 2, false, 0, 1, false, LB_PLAIN)

// ------------------------------------------------------------------ layout conversion at load time

// Engine packing -> "tc" layout, on the device (kernels/cuda/layout.py holds the numpy twin).
// qweight bytes [N, Kb] (Kb = Kp/2), scales/zeros fp16 [N, num_src_groups].
// One thread per output word: first the qw words, then the sz words. grid (ceil(total / 256)), block 256.
extern "C" __global__ void int4_repack_tc(
    const unsigned char* __restrict__ qweight, const f16_t* __restrict__ scales, const f16_t* __restrict__ zeros,
    int N, int Kb, int num_src_groups, u32* __restrict__ qw, u32* __restrict__ sz,
    int num_tiles, int num_chunks, int num_groups) {
    pdl_wait();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t num_qw = (size_t)num_tiles * num_chunks * 128;
    if (i < num_qw) {
        const int s = i & 3, lane = (i >> 2) & 31;
        const int chunk = (int)((i >> 7) % num_chunks), tile = (int)((i >> 7) / num_chunks);
        const int g = lane >> 2, t = lane & 3;
        u32 word = 0;
#pragma unroll
        for (int p = 0; p < 8; ++p) {
            const int j = p & 3;
            const int row = tile * 16 + g + ((j & 1) ? 8 : 0);
            const int k = chunk * 64 + s * 16 + ((j & 2) ? 8 : 0) + 2 * t + (p >> 2);
            u32 code = 0;
            if (row < N && k < 2 * Kb) {
                const unsigned char byte = qweight[(size_t)row * Kb + k / 2];
                code = (k & 1) ? (byte >> 4) : (byte & 0xfu);
            }
            word |= code << (4 * p);
        }
        qw[i] = word;
        return;
    }
    const size_t si = i - num_qw;
    if (si >= (size_t)num_tiles * num_groups * 16) return;
    const int r = si & 15, gi = (int)((si >> 4) % num_groups), tile = (int)((si >> 4) / num_groups);
    const int row = tile * 16 + r;
    u32 word = 0;
    if (row < N && gi < num_src_groups) {
        const size_t src = (size_t)row * num_src_groups + gi;
        word = pack_f16x2(scales[src], zeros[src]);
    }
    sz[si] = word;
}

// ------------------------------------------------------------------ SIMT fallback (any arch)

// Engine packing: qweight bytes [N, Kp/2] read as u32 words of 8 codes in k order (code i of
// word w is k = 8w + i: low nibble first), scales/zeros fp16 [N, Kp/G].
// grid (ceil(N / 4), ceil(M / MT)), block 128: one warp per weight row, lanes over words.
#define SIMT_MT 8

extern "C" __global__ void __launch_bounds__(128) int4_mm_simt(
    const float* __restrict__ x, int ldx, int M,
    const u32* __restrict__ qweight, const f16_t* __restrict__ scales, const f16_t* __restrict__ zeros,
    int words_per_row, int group_size,
    const float* __restrict__ bias, float* y, int ldy, int N, int accumulate) {
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * 4 + (threadIdx.x >> 5);
    const int m0 = blockIdx.y * SIMT_MT;
    const int num_groups = words_per_row * 8 / group_size;
    pdl_wait();
    if (n >= N) return;
    float acc[SIMT_MT];
#pragma unroll
    for (int i = 0; i < SIMT_MT; ++i) acc[i] = 0.0f;
    for (int w = lane; w < words_per_row; w += 32) {
        const u32 q = __ldg(qweight + (size_t)n * words_per_row + w);
        const int gi = (w * 8) / group_size;
        const float s = f16_to_f32(__ldg(scales + (size_t)n * num_groups + gi));
        const float z = f16_to_f32(__ldg(zeros + (size_t)n * num_groups + gi));
        float wv[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) wv[i] = ((float)((q >> (4 * i)) & 0xfu) - z) * s;
#pragma unroll
        for (int mt = 0; mt < SIMT_MT; ++mt) {
            if (m0 + mt >= M) break;
            const float4* xp = reinterpret_cast<const float4*>(x + (size_t)(m0 + mt) * ldx + w * 8);
            const float4 a = __ldg(xp), b = __ldg(xp + 1);
            acc[mt] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w
                     + wv[4] * b.x + wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
        }
    }
#pragma unroll
    for (int mt = 0; mt < SIMT_MT; ++mt) {
        const float v = warp_sum(acc[mt]);
        if (lane == 0 && m0 + mt < M) store_result(y, ldy, m0 + mt, n, v, bias, accumulate);
    }
}
