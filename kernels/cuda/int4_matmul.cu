// INT4 group-wise weight x fp32 activation products: y[m, n] = sum_k W[n, k] x[m, k]
// with W[n, k] = (q[n, k] - zero[n, k/G]) * scale[n, k/G]  (docs/ENGINE_FORMAT.md).
//
// Three kernels:
//   int4_gemv_tc_*   decode, M <= 16 tokens: one block per 16 weight rows, its warps split K.
//   int4_gemm_tc     prefill and large batches: 128 weight rows x 64 tokens per block.
//   int4_mm_simt     any architecture, the engine's own packing; the fallback and a cross-check.
//
// Tensor-core path (sm_80+): mma.m16n8k16 with A = the weights' raw 4-bit codes q (exact in
// fp16) and B = the activations split in two fp16 parts, x = hi + lo (22 significant bits),
// fed as two B columns per token. Per group of G k's the warp keeps the raw dot products
// P = sum q x, and folds them into the fp32 result with the group's scale and zero point:
//     y += scale * (P_hi + P_lo - zero * sum_k x)
// so the result carries fp32-level accuracy, and no per-weight float conversion is needed.
//
// Device weight layout "tc" (written once at load time by kernels/cuda/layout.py):
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

// One packed word -> the four half2 A registers of a k16 step (exact small integers 0..15).
// (w & 0x000f000f) | 0x64006400 is half2(1024 + q, 1024 + q'); the high nibble of each byte
// gives 1024 + 16q, brought back with one fma by 1/16 and -64.
__device__ __forceinline__ void dequant_word(u32 w, u32 a[4]) {
    const u32 MAGIC = 0x64006400u;          // half2(1024, 1024)
    const u32 SIXTEENTH = 0x2c002c00u;      // half2(1/16, 1/16)
    const u32 MINUS_64 = 0xd400d400u;       // half2(-64, -64)
    a[0] = hsub2((w & 0x000f000fu) | MAGIC, MAGIC);
    a[1] = hfma2((w & 0x00f000f0u) | MAGIC, SIXTEENTH, MINUS_64);
    a[2] = hsub2(((w >> 8) & 0x000f000fu) | MAGIC, MAGIC);
    a[3] = hfma2(((w >> 8) & 0x00f000f0u) | MAGIC, SIXTEENTH, MINUS_64);
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

// Two fp32 activations -> half2 of their high parts, or of the remainders x - hi.
__device__ __forceinline__ u32 split_pair(float x0, float x1, bool low_part) {
    f16_t h0 = f32_to_f16(x0), h1 = f32_to_f16(x1);
    if (low_part) {
        h0 = f32_to_f16(x0 - f16_to_f32(h0));
        h1 = f32_to_f16(x1 - f16_to_f32(h1));
    }
    return pack_f16x2(h0, h1);
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

// ------------------------------------------------------------------ decode GEMV (M <= 4 * NT)

// grid (Np/16 row tiles, ceil(M / (4 NT))), block 32 * WARPS. Warp w takes the 128-wide K
// units w, w + WARPS, ...; PREFETCH units' weights are in flight before the first is used.
// Lane (g, t) feeds B column g of every n8 tile j: token 4j + g/2, the hi part when g is even.
template <int NT, int WARPS, int PREFETCH>
__device__ __forceinline__ void int4_gemv_tc(
    const float* __restrict__ x, int ldx, int M,                 // x: [M, ldx], zero beyond K
    const uint4* __restrict__ qw, const u32* __restrict__ sz,    // "tc" layout
    int num_units, int group_size,                               // Kp / 128, G
    const float* __restrict__ bias, float* y, int ldy, int N, int accumulate) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x, tok0 = blockIdx.y * 4 * NT;
    const int num_groups = num_units * 128 / group_size;
    const int spg_mask = group_size / 16 - 1;                     // k16 steps per group, minus one
    const uint4* qtile = qw + (size_t)tile * num_units * 2 * 32 + lane;
    const u32* stile = sz + (size_t)tile * num_groups * 16;
    const bool low_part = g & 1;

    const float* xrow[NT];
    bool valid[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int m = tok0 + 4 * j + (g >> 1);
        valid[j] = m < M;
        xrow[j] = x + (size_t)(valid[j] ? m : 0) * ldx + 2 * t;
    }
    float acc[NT][2], part[NT][4], xs[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        acc[j][0] = acc[j][1] = xs[j] = 0.0f;
        part[j][0] = part[j][1] = part[j][2] = part[j][3] = 0.0f;
    }
    pdl_wait();

    for (int u0 = warp; u0 < num_units; u0 += WARPS * PREFETCH) {
        uint4 wbuf[PREFETCH][2];
#pragma unroll
        for (int p = 0; p < PREFETCH; ++p) {
            const int u = u0 + p * WARPS;
            if (u < num_units) {
                wbuf[p][0] = __ldg(qtile + (size_t)(2 * u) * 32);
                wbuf[p][1] = __ldg(qtile + (size_t)(2 * u + 1) * 32);
            }
        }
#pragma unroll
        for (int p = 0; p < PREFETCH; ++p) {
            const int u = u0 + p * WARPS;
            if (u >= num_units) break;
            const u32 words[8] = {wbuf[p][0].x, wbuf[p][0].y, wbuf[p][0].z, wbuf[p][0].w,
                                  wbuf[p][1].x, wbuf[p][1].y, wbuf[p][1].z, wbuf[p][1].w};
#pragma unroll
            for (int s = 0; s < 8; ++s) {
                const int k0 = u * 128 + s * 16;
                u32 a[4];
                dequant_word(words[s], a);
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    float2 v0 = make_float2(0.0f, 0.0f), v1 = v0;
                    if (valid[j]) {
                        v0 = __ldg(reinterpret_cast<const float2*>(xrow[j] + k0));
                        v1 = __ldg(reinterpret_cast<const float2*>(xrow[j] + k0 + 8));
                    }
                    xs[j] += (v0.x + v0.y) + (v1.x + v1.y);
                    mma_16816(part[j], a, split_pair(v0.x, v0.y, low_part), split_pair(v1.x, v1.y, low_part));
                }
                if (((s + 1) & spg_mask) == 0) {                  // a group ends with this step
                    const int gi = k0 / group_size;
                    float s0, z0, s1, z1;
                    unpack_scale_zero(__ldg(stile + gi * 16 + g), s0, z0);
                    unpack_scale_zero(__ldg(stile + gi * 16 + g + 8), s1, z1);
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        float xsum = xs[j] + __shfl_xor_sync(FULL_MASK, xs[j], 1);
                        xsum += __shfl_xor_sync(FULL_MASK, xsum, 2);          // token 4j + g/2
                        const float xt = __shfl_sync(FULL_MASK, xsum, 8 * t);  // token 4j + t
                        acc[j][0] += s0 * ((part[j][0] + part[j][1]) - z0 * xt);
                        acc[j][1] += s1 * ((part[j][2] + part[j][3]) - z1 * xt);
                        part[j][0] = part[j][1] = part[j][2] = part[j][3] = 0.0f;
                        xs[j] = 0.0f;
                    }
                }
            }
        }
    }
    pdl_launch_dependents();

    __shared__ float red[WARPS][16][4 * NT];                       // per-warp partial results
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        red[warp][g][4 * j + t] = acc[j][0];
        red[warp][g + 8][4 * j + t] = acc[j][1];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 16 * 4 * NT; i += blockDim.x) {
        const int r = i / (4 * NT), col = i % (4 * NT);
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v += red[w][r][col];
        const int n = tile * 16 + r, m = tok0 + col;
        if (n < N && m < M) store_result(y, ldy, m, n, v, bias, accumulate);
    }
}

#define GEMV_ARGS const float* __restrict__ x, int ldx, int M, const uint4* __restrict__ qw, \
    const u32* __restrict__ sz, int num_units, int group_size, const float* __restrict__ bias, \
    float* y, int ldy, int N, int accumulate
#define GEMV_PASS x, ldx, M, qw, sz, num_units, group_size, bias, y, ldy, N, accumulate

extern "C" __global__ void __launch_bounds__(256) int4_gemv_tc_nt1(GEMV_ARGS) { int4_gemv_tc<1, 8, 4>(GEMV_PASS); }
extern "C" __global__ void __launch_bounds__(256) int4_gemv_tc_nt2(GEMV_ARGS) { int4_gemv_tc<2, 8, 4>(GEMV_PASS); }
extern "C" __global__ void __launch_bounds__(256) int4_gemv_tc_nt4(GEMV_ARGS) { int4_gemv_tc<4, 8, 2>(GEMV_PASS); }

// ------------------------------------------------------------------ prefill GEMM (any M)

// grid (Np/128 row blocks, ceil(M / 64) token tiles), block 256 (8 warps, one 16-row tile each).
// Per 128-wide K unit the block stages its 64 tokens once, already split into B fragments
// (fragment order, so each warp reads one 8-byte word per lane per n8 tile), and the
// per-group activation sums; every warp then multiplies its own weight tile against them.
#define GEMM_ROWS 128
#define GEMM_TOKENS 64
#define GEMM_NT (2 * GEMM_TOKENS / 8)                              // n8 tiles: hi and lo column per token

extern "C" __global__ void __launch_bounds__(256) int4_gemm_tc(
    const float* __restrict__ x, int ldx, int M,
    const uint4* __restrict__ qw, const u32* __restrict__ sz,
    int num_units, int group_size,
    const float* __restrict__ bias, float* y, int ldy, int N, int accumulate) {
    __shared__ uint2 frag[8][GEMM_NT][32];                         // [k16 step][n8 tile][lane] B fragments
    __shared__ float xsum[GEMM_TOKENS][4];                         // [token][group within the unit]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * (GEMM_ROWS / 16) + warp;
    const int tok0 = blockIdx.y * GEMM_TOKENS;
    const int num_groups = num_units * 128 / group_size;
    const int groups_per_unit = 128 / group_size;
    const uint4* qtile = qw + (size_t)tile * num_units * 2 * 32 + lane;
    const u32* stile = sz + (size_t)tile * num_groups * 16;
    // staging assignment: thread -> token tid/4, k range (tid%4)*32 .. +32 of the unit
    const int st_tok = tid >> 2, st_k = (tid & 3) * 32;
    const bool st_valid = tok0 + st_tok < M;
    const float* st_row = x + (size_t)(st_valid ? tok0 + st_tok : 0) * ldx + st_k;

    // part: this group's raw products, C fragment of n8 tile j; acc: rows g and g+8, token 4j + t
    float acc[GEMM_NT][2], part[GEMM_NT][4];
#pragma unroll
    for (int j = 0; j < GEMM_NT; ++j) {
        acc[j][0] = acc[j][1] = 0.0f;
        part[j][0] = part[j][1] = part[j][2] = part[j][3] = 0.0f;
    }
    pdl_wait();

    for (int u = 0; u < num_units; ++u) {
        const uint4 w0 = __ldg(qtile + (size_t)(2 * u) * 32);      // weights first: longest latency
        const uint4 w1 = __ldg(qtile + (size_t)(2 * u + 1) * 32);
        // stage this thread's 32 activations as B fragments, and their sum
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (st_valid) v = __ldg(reinterpret_cast<const float4*>(st_row + u * 128) + i);
            sum += (v.x + v.y) + (v.z + v.w);
#pragma unroll
            for (int h = 0; h < 2; ++h) {                          // the pairs (k, k+1) at k = st_k + 4i + 2h
                const int k = st_k + 4 * i + 2 * h;
                const float x0 = h ? v.z : v.x, x1 = h ? v.w : v.y;
                const int step = k >> 4, kk = k & 15;
                const int col = 2 * st_tok;                        // hi column; lo is col + 1
                const int j = col >> 3, fg = col & 7, ft = (kk & 7) >> 1, reg = kk >> 3;
                u32* hi_word = reinterpret_cast<u32*>(&frag[step][j][fg * 4 + ft]) + reg;
                u32* lo_word = reinterpret_cast<u32*>(&frag[step][j][(fg + 1) * 4 + ft]) + reg;
                *hi_word = split_pair(x0, x1, false);
                *lo_word = split_pair(x0, x1, true);
            }
        }
        if (group_size >= 64) sum += __shfl_xor_sync(FULL_MASK, sum, 1);
        if (group_size >= 128) sum += __shfl_xor_sync(FULL_MASK, sum, 2);
        if (((tid & 3) & (group_size / 32 - 1)) == 0) xsum[st_tok][st_k / group_size] = sum;
        __syncthreads();

        const u32 words[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            u32 a[4];
            dequant_word(words[s], a);
#pragma unroll
            for (int j = 0; j < GEMM_NT; ++j) {
                const uint2 b = frag[s][j][lane];
                mma_16816(part[j], a, b.x, b.y);
            }
            if (((s + 1) & (group_size / 16 - 1)) == 0) {
                const int gu = (s * 16) / group_size;             // group within the unit
                const int gi = u * groups_per_unit + gu;
                float s0, z0, s1, z1;
                unpack_scale_zero(__ldg(stile + gi * 16 + g), s0, z0);
                unpack_scale_zero(__ldg(stile + gi * 16 + g + 8), s1, z1);
#pragma unroll
                for (int j = 0; j < GEMM_NT; ++j) {
                    // C columns 2t, 2t+1 of n8 tile j: token 4j + t, its hi and lo parts
                    const float xt = xsum[4 * j + t][gu];
                    acc[j][0] += s0 * ((part[j][0] + part[j][1]) - z0 * xt);
                    acc[j][1] += s1 * ((part[j][2] + part[j][3]) - z1 * xt);
                    part[j][0] = part[j][1] = part[j][2] = part[j][3] = 0.0f;
                }
            }
        }
        __syncthreads();                                           // frag/xsum are restaged next unit
    }
    pdl_launch_dependents();
#pragma unroll
    for (int j = 0; j < GEMM_NT; ++j) {
        const int m = tok0 + 4 * j + t;
        const int n0 = tile * 16 + g, n1 = n0 + 8;
        if (m < M && n0 < N) store_result(y, ldy, m, n0, acc[j][0], bias, accumulate);
        if (m < M && n1 < N) store_result(y, ldy, m, n1, acc[j][1], bias, accumulate);
    }
}

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
