/* AVX2 + FMA + F16C kernels: the path for x86-64 CPUs without AVX-512 (client parts, older
 * servers). Same tiled layout and arithmetic as kern_avx512.c; a 16-row tile is two ymm
 * halves. Nibbles become floats by shift + mask + convert (a 16-entry vpermps table needs
 * AVX-512); the q8 path multiplies with vpmaddubsw (u8 x s8 pairs into int16, no overflow:
 * 2 * 15 * 127 < 32767, and two of them summed still fit) and widens with vpmaddwd.
 * Only 16 vector registers here, so activation blocks are at most 2 rows. */
#include "tw.h"

#if defined(__x86_64__) || defined(__i386__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif

#include <immintrin.h>
#include <math.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE void store_tile(float *y, __m256 lo, __m256 hi, int rows) {
    if (rows >= TW_TILE) {
        _mm256_storeu_ps(y, lo);
        _mm256_storeu_ps(y + 8, hi);
        return;
    }
    float tmp[TW_TILE];
    _mm256_storeu_ps(tmp, lo);
    _mm256_storeu_ps(tmp + 8, hi);
    memcpy(y, tmp, (size_t)rows * sizeof(float));
}

INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE __m256 load_half8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_load_si128((const __m128i *)p)); }

/* ---------------------------------------------------------------- INT4 x fp32 */

INLINE void tile_f32(const tw_int4 *w, const tw_act *a, float *y, int ldy, int t, int m0, const int MB) {
    const int NACC = MB == 1 ? 2 : 1;
    const __m256i mask4 = _mm256_set1_epi32(15);
    const int ng = w->num_groups, gs = w->group_size, chunks = gs / 8, kp = a->kp;
    const uint8_t *block = w->data + (size_t)t * ng * w->block_bytes;
    __m256 F[2][2];
    for (int i = 0; i < MB; i++) F[i][0] = F[i][1] = _mm256_setzero_ps();
    for (int g = 0; g < ng; g++, block += w->block_bytes) {
        const __m256i *q = (const __m256i *)(block + 64);
        const float *x[2];
        __m256 A[2][2][2];                                    /* [row][half][acc] */
        for (int i = 0; i < MB; i++) {
            x[i] = a->x + (size_t)(m0 + i) * kp + (size_t)g * gs;
            for (int u = 0; u < NACC; u++) A[i][0][u] = A[i][1][u] = _mm256_setzero_ps();
        }
        for (int c = 0; c < chunks; c++) {
            _mm_prefetch((const char *)(q + 2 * c) + TW_PREFETCH_BYTES, TW_PREFETCH_HINT);
            const __m256i w0 = _mm256_load_si256(q + 2 * c), w1 = _mm256_load_si256(q + 2 * c + 1);
            for (int j = 0; j < 8; j++) {
                const __m256 v0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w0, 4 * j), mask4));
                const __m256 v1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w1, 4 * j), mask4));
                for (int i = 0; i < MB; i++) {
                    const __m256 xv = _mm256_broadcast_ss(x[i] + 8 * c + j);
                    A[i][0][j % NACC] = _mm256_fmadd_ps(v0, xv, A[i][0][j % NACC]);
                    A[i][1][j % NACC] = _mm256_fmadd_ps(v1, xv, A[i][1][j % NACC]);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 s = load_half8(block + 16 * h), z = load_half8(block + 32 + 16 * h);
            for (int i = 0; i < MB; i++) {
                __m256 acc = NACC == 2 ? _mm256_add_ps(A[i][h][0], A[i][h][1]) : A[i][h][0];
                const __m256 xs = _mm256_set1_ps(a->xsum[(size_t)(m0 + i) * ng + g]);
                F[i][h] = _mm256_fmadd_ps(s, _mm256_fnmadd_ps(z, xs, acc), F[i][h]);
            }
        }
    }
    const int rows = w->n - t * TW_TILE;
    for (int i = 0; i < MB; i++) store_tile(y + (size_t)(m0 + i) * ldy + t * TW_TILE, F[i][0], F[i][1], rows);
}

static void int4_f32_avx2(const tw_int4 *w, const tw_act *a, float *y, int ldy, int t0, int t1) {
    for (int t = t0; t < t1; t++) {
        int m = 0;
        for (; m + 2 <= a->m; m += 2) tile_f32(w, a, y, ldy, t, m, 2);
        if (m < a->m) tile_f32(w, a, y, ldy, t, m, 1);
    }
}

/* ---------------------------------------------------------------- INT4 x q8 */

INLINE void tile_q8(const tw_int4 *w, const tw_act *a, float *y, int ldy, int t, int m0, const int MB) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int ng = w->num_groups, gs = w->group_size, chunks = gs / 8, kp = a->kp;
    const uint8_t *block = w->data + (size_t)t * ng * w->block_bytes;
    __m256 F[2][2];
    for (int i = 0; i < MB; i++) F[i][0] = F[i][1] = _mm256_setzero_ps();
    for (int g = 0; g < ng; g++, block += w->block_bytes) {
        const __m256i *q = (const __m256i *)(block + 64);
        const int32_t *x[2];
        __m256i A[2][2];
        for (int i = 0; i < MB; i++) {
            x[i] = (const int32_t *)(a->xq + (size_t)(m0 + i) * kp + (size_t)g * gs);
            A[i][0] = A[i][1] = _mm256_setzero_si256();
        }
        for (int c = 0; c < chunks; c++) {
            _mm_prefetch((const char *)(q + 2 * c) + TW_PREFETCH_BYTES, TW_PREFETCH_HINT);
            for (int h = 0; h < 2; h++) {
                const __m256i wv = _mm256_load_si256(q + 2 * c + h);
                const __m256i lo = _mm256_and_si256(wv, low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low4);
                for (int i = 0; i < MB; i++) {
                    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x[i][2 * c])),
                                                       _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x[i][2 * c + 1])));
                    A[i][h] = _mm256_add_epi32(A[i][h], _mm256_madd_epi16(p, ones));
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 s = load_half8(block + 16 * h), z = load_half8(block + 32 + 16 * h);
            for (int i = 0; i < MB; i++) {
                const size_t mg = (size_t)(m0 + i) * ng + g;
                const __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(A[i][h]), _mm256_set1_ps(a->xd[mg]));
                F[i][h] = _mm256_fmadd_ps(s, _mm256_fnmadd_ps(z, _mm256_set1_ps(a->xqsum[mg]), dot), F[i][h]);
            }
        }
    }
    const int rows = w->n - t * TW_TILE;
    for (int i = 0; i < MB; i++) store_tile(y + (size_t)(m0 + i) * ldy + t * TW_TILE, F[i][0], F[i][1], rows);
}

static void int4_q8_avx2(const tw_int4 *w, const tw_act *a, float *y, int ldy, int t0, int t1) {
    for (int t = t0; t < t1; t++) {
        int m = 0;
        for (; m + 2 <= a->m; m += 2) tile_q8(w, a, y, ldy, t, m, 2);
        if (m < a->m) tile_q8(w, a, y, ldy, t, m, 1);
    }
}

/* ---------------------------------------------------------------- activation preparation */

INLINE __m256 load_span(const float *p, int i, int end, int k) {
    const int n = (end < k ? end : k) - i;
    if (n >= 8) return _mm256_loadu_ps(p + i);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p + i, _mm256_cmpgt_epi32(_mm256_set1_epi32(n > 0 ? n : 0), lanes));
}

INLINE float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static void prep_f32_avx2(tw_act *a, const float *x, int ldx, int k, int m0, int m1) {
    const int kp = a->kp, ng = a->num_groups, gs = kp / ng;
    for (int m = m0; m < m1; m++) {
        const float *src = x + (size_t)m * ldx;
        float *dst = a->x + (size_t)m * kp;
        for (int g = 0; g < ng; g++) {
            __m256 acc = _mm256_setzero_ps();
            for (int i = g * gs; i < (g + 1) * gs; i += 8) {           /* gs is a multiple of 8 */
                const __m256 v = load_span(src, i, (g + 1) * gs, k);
                _mm256_storeu_ps(dst + i, v);
                acc = _mm256_add_ps(acc, v);
            }
            a->xsum[(size_t)m * ng + g] = hsum8(acc);
        }
    }
}

static void prep_q8_avx2(tw_act *a, const float *x, int ldx, int k, int m0, int m1) {
    const int kp = a->kp, ng = a->num_groups, gs = kp / ng;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int m = m0; m < m1; m++) {
        const float *src = x + (size_t)m * ldx;
        int8_t *dst = a->xq + (size_t)m * kp;
        for (int g = 0; g < ng; g++) {
            const int end = (g + 1) * gs;
            __m256 vmax = _mm256_setzero_ps();
            for (int i = g * gs; i < end; i += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(load_span(src, i, end, k), absmask));
            const float amax = hmax8(vmax);
            const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            __m256i total = _mm256_setzero_si256();
            for (int i = g * gs; i < end; i += 8) {
                __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load_span(src, i, end, k), inv));
                q = _mm256_max_epi32(_mm256_min_epi32(q, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
                total = _mm256_add_epi32(total, q);
                int32_t v[8];
                _mm256_storeu_si256((__m256i *)v, q);
                for (int j = 0; j < 8; j++) dst[i + (j % 2) * 4 + j / 2] = (int8_t)v[j];
            }
            int32_t t[8];
            _mm256_storeu_si256((__m256i *)t, total);
            a->xd[(size_t)m * ng + g] = amax / 127.0f;
            a->xqsum[(size_t)m * ng + g] = amax / 127.0f * (float)(t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7]);
        }
    }
}

/* ---------------------------------------------------------------- dense / int8 rows */

INLINE __m256 load_row8(const void *w, int kind, size_t idx) {
    switch (kind) {
    case TW_W_F32: return _mm256_loadu_ps((const float *)w + idx);
    case TW_W_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + idx)));
    default: {
        int64_t eight;
        memcpy(&eight, (const int8_t *)w + idx, 8);
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(eight)));
    }
    }
}

INLINE float weight_at(const void *w, int kind, size_t idx) {
    switch (kind) {
    case TW_W_F32: return ((const float *)w)[idx];
    case TW_W_F16: return tw_half_to_float(((const uint16_t *)w)[idx]);
    default: return (float)((const int8_t *)w)[idx];
    }
}


/* NB weight rows against MB (1 or 2) activation rows: NB x MB independent accumulators, each
 * x vector loaded once for the NB rows. One row and one accumulator, as this was, chained every
 * FMA on the last one's latency: Qwen2.5-0.5B's int8 classifier (136 MB) took 25.7 ms on two
 * cores, 5.3 GB/s of a 15.5 GB/s machine, no faster than its fp16 form at twice the bytes. */
#define ROWS_AHEAD 32                /* rows_avx2 prefetches this far ahead (28 KB of Qwen2.5-0.5B's int8 rows; 8 and 16 were slower) */

INLINE void rows_block_avx2(const void *w, const uint16_t *row_scales, int kind, int k, const float *x, int ldx,
                            float *y, int ldy, int n, const int NB, const int MB) {
    const int k8 = k / 8 * 8;
    __m256 acc[4][2];
    for (int r = 0; r < NB; r++)
        for (int i = 0; i < MB; i++) acc[r][i] = _mm256_setzero_ps();
    for (int kk = 0; kk < k8; kk += 8) {
        __m256 xv[2];
        for (int i = 0; i < MB; i++) xv[i] = _mm256_loadu_ps(x + (size_t)i * ldx + kk);
        for (int r = 0; r < NB; r++) {
            const __m256 wv = load_row8(w, kind, (size_t)(n + r) * k + kk);
            for (int i = 0; i < MB; i++) acc[r][i] = _mm256_fmadd_ps(wv, xv[i], acc[r][i]);
        }
    }
    for (int r = 0; r < NB; r++) {
        const float scale = kind == TW_W_I8 ? tw_half_to_float(row_scales[n + r]) : 1.0f;
        for (int i = 0; i < MB; i++) {
            float sum = hsum8(acc[r][i]);
            for (int kk = k8; kk < k; kk++) sum += weight_at(w, kind, (size_t)(n + r) * k + kk) * x[(size_t)i * ldx + kk];
            y[(size_t)i * ldy + n + r] = sum * scale;
        }
    }
}

/* NB weight rows against every activation row, two at a time (inlined for NB 4 and 1). */
INLINE void rows_pass_avx2(const void *w, const uint16_t *row_scales, int kind, int k, const float *x, int ldx,
                           int m, float *y, int ldy, int n, const int NB) {
    int i = 0;
    for (; i + 2 <= m; i += 2) rows_block_avx2(w, row_scales, kind, k, x + (size_t)i * ldx, ldx, y + (size_t)i * ldy, ldy, n, NB, 2);
    if (i < m) rows_block_avx2(w, row_scales, kind, k, x + (size_t)i * ldx, ldx, y + (size_t)i * ldy, ldy, n, NB, 1);
}

static void rows_avx2(const void *w, const uint16_t *row_scales, int kind, int k,
                      const float *x, int ldx, int m, float *y, int ldy, int n0, int n1) {
    const size_t row_bytes = (size_t)k * (kind == TW_W_F32 ? 4 : kind == TW_W_F16 ? 2 : 1);
    const char *base = w;
    int n = n0;
    for (; n + 4 <= n1; n += 4) {
        if (n + ROWS_AHEAD + 4 <= n1)        /* the block ROWS_AHEAD rows on, while this one computes */
            for (size_t b = 0; b < 4 * row_bytes; b += 64) _mm_prefetch(base + (n + ROWS_AHEAD) * row_bytes + b, _MM_HINT_T0);
        rows_pass_avx2(w, row_scales, kind, k, x, ldx, m, y, ldy, n, 4);
    }
    for (; n < n1; n++) rows_pass_avx2(w, row_scales, kind, k, x, ldx, m, y, ldy, n, 1);
}

/* q8 rows: NB weight rows against one activation row. Per block of 32 and row, |w| as u8 (so
 * -128 reads 128) times x carrying w's sign: vpmaddubsw's int16 pair sums stay below
 * 2 * 128 * 127 < 32767, vpmaddwd widens them, and one convert and FMA apply the block's step:
 * 7 instructions per 32 weights where the float rows spend 12. */
INLINE void rows_q8_pass_avx2(const int8_t *w, const uint16_t *row_scales, int k, const int8_t *xq, int ldq,
                              const float *xd, int ldd, float *y, int ldy, int n, const int NB, const int MB,
                              int ahead) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int nb = k / TW_ROWS_Q8_BLOCK;
    __m256 acc[4][2];                                   /* [weight row][activation row] */
    for (int r = 0; r < NB; r++)
        for (int i = 0; i < MB; i++) acc[r][i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i xv[2];
        __m256 d[2];
        for (int i = 0; i < MB; i++) {
            xv[i] = _mm256_loadu_si256((const __m256i *)(xq + (size_t)i * ldq + (size_t)b * TW_ROWS_Q8_BLOCK));
            d[i] = _mm256_broadcast_ss(xd + (size_t)i * ldd + b);
        }
        if (NB == 4 && ahead) {             /* the 128 bytes a block of 4 rows reads, as far ahead as the probe */
            const char *p = (const char *)w + (size_t)n * k + TW_PREFETCH_BYTES + (size_t)b * 128;
            _mm_prefetch(p, _MM_HINT_T0);
            _mm_prefetch(p + 64, _MM_HINT_T0);
        }
        for (int r = 0; r < NB; r++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (size_t)(n + r) * k + (size_t)b * TW_ROWS_Q8_BLOCK));
            const __m256i wabs = _mm256_abs_epi8(wv);
            for (int i = 0; i < MB; i++) {
                const __m256i pairs = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv[i], wv));
                acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), d[i], acc[r][i]);
            }
        }
    }
    for (int r = 0; r < NB; r++)
        for (int i = 0; i < MB; i++) y[(size_t)i * ldy + n + r] = hsum8(acc[r][i]) * tw_half_to_float(row_scales[n + r]);
}

/* NB weight rows against every activation row, two at a time (the weights' loads and |w| shared). */
INLINE void rows_q8_rows_avx2(const int8_t *w, const uint16_t *row_scales, int k, const int8_t *xq, int ldq,
                              const float *xd, int ldd, int m, float *y, int ldy, int n, const int NB, int ahead) {
    int i = 0;
    for (; i + 2 <= m; i += 2, ahead = 0)
        rows_q8_pass_avx2(w, row_scales, k, xq + (size_t)i * ldq, ldq, xd + (size_t)i * ldd, ldd, y + (size_t)i * ldy,
                          ldy, n, NB, 2, ahead);
    if (i < m)
        rows_q8_pass_avx2(w, row_scales, k, xq + (size_t)i * ldq, ldq, xd + (size_t)i * ldd, ldd, y + (size_t)i * ldy,
                          ldy, n, NB, 1, ahead);
}

void tw_rows_q8_avx2(const int8_t *w, const uint16_t *row_scales, int k, const int8_t *xq, const float *xd,
                     int ldq, int m, float *y, int ldy, int n0, int n1) {
    const int ldd = ldq / TW_ROWS_Q8_BLOCK;
    int n = n0;
    const size_t end = (size_t)n1 * k;
    for (; n + 4 <= n1; n += 4)             /* the 4 rows stay in L1 for the later activation rows */
        rows_q8_rows_avx2(w, row_scales, k, xq, ldq, xd, ldd, m, y, ldy, n, 4, (size_t)(n + 4) * k + TW_PREFETCH_BYTES <= end);
    for (; n < n1; n++) rows_q8_rows_avx2(w, row_scales, k, xq, ldq, xd, ldd, m, y, ldy, n, 1, 0);
}

/* ---------------------------------------------------------------- vector helpers (attention) */

static float dot_avx2(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static void axpy_avx2(float *y, float alpha, const float *x, int n) {
    const __m256 av = _mm256_set1_ps(alpha);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += alpha * x[i];
}

/* ---------------------------------------------------------------- exp and the gated activations */

/* exp(x) as exp512 in kern_avx512.c; 2^n is built in the exponent field, so x is clamped to
 * where that stays normal and past the overflow point the result is set to inf. */
INLINE __m256 exp256(__m256 x_in) {
    const __m256 x = _mm256_max_ps(_mm256_min_ps(x_in, _mm256_set1_ps(88.3f)), _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 overflow = _mm256_cmp_ps(x_in, _mm256_set1_ps(88.72284f), _CMP_GT_OQ);
    const __m256 normal = _mm256_cmp_ps(x_in, _mm256_set1_ps(-87.33654f), _CMP_GE_OQ);   /* else 0, as exp512 */
    const __m256 e = _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(pow2n)), normal);
    return _mm256_blendv_ps(e, _mm256_set1_ps(__builtin_inff()), overflow);
}

INLINE __m256 gated256(__m256 x, __m256 up, int gelu) {
    const __m256 one = _mm256_set1_ps(1.0f);
    if (!gelu) return _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), x)))), up);
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x), x), x);
    const __m256 y = _mm256_mul_ps(_mm256_set1_ps((float)0.7978845608028654), _mm256_add_ps(x, x3));
    const __m256 e = exp256(_mm256_add_ps(y, y));
    const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, t)), up);
}

static void gated_avx2(float *out, const float *gate, const float *up, int n, int gelu) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, gated256(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i), gelu));
    if (i < n) tw_kernels_scalar.gated(out + i, gate + i, up + i, n - i, gelu);
}

static float exp_sum_avx2(float *x, int n, float sub) {
    const __m256 s = _mm256_set1_ps(sub);
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    return hsum8(acc) + (i < n ? tw_kernels_scalar.exp_sum(x + i, n - i, sub) : 0.0f);
}

/* ---------------------------------------------------------------- attention */

/* The generic attention's arithmetic, bit for bit, with each block's scores computed eight
 * positions at a time: K is transposed inside a block ([head_dim][block_size]), so a score
 * vector is a sum over d of q[d] x one row of 8 keys, accumulated in the same order (multiply,
 * then add: no FMA) as tw_attend_generic's scalar dot; the tail of a block goes the scalar
 * way. The scores were 2/3 of a stories260K step (head_dim 8) and of a verifying step's
 * extra rows (speculative decoding) on the default model. */
static void attend_avx2(const tw_attn_args *a) {
    const int hd = a->head_dim, bs = a->block_size, n = a->hi - a->lo + 1;
    for (int g = 0; g < a->group; g++) {
        const float *q = a->q + (size_t)g * hd;
        float *scores = a->scores + (size_t)g * n, *o = a->out + (size_t)g * hd;
        int j = a->lo;
        while (j <= a->hi) {
            const float *kt = a->kt + (size_t)a->table[j / bs] * a->kt_block;
            const int end = (j / bs + 1) * bs <= a->hi + 1 ? (j / bs + 1) * bs : a->hi + 1;
            for (; j + 8 <= end; j += 8) {
                const float *k = kt + j % bs;
                __m256 dot = _mm256_setzero_ps();
                for (int d = 0; d < hd; d++)
                    dot = _mm256_add_ps(dot, _mm256_mul_ps(_mm256_set1_ps(q[d]), _mm256_loadu_ps(k + (size_t)d * bs)));
                _mm256_storeu_ps(scores + (j - a->lo), dot);
            }
            for (; j < end; j++) {
                const float *k = kt + j % bs;
                float dot = 0.0f;
                for (int d = 0; d < hd; d++) dot += q[d] * k[(size_t)d * bs];
                scores[j - a->lo] = dot;
            }
        }
        float max = -INFINITY;
        for (int i = 0; i < n; i++) {
            float sc = scores[i] * a->scale;
            if (a->softcap > 0.0f) sc = a->softcap * tanhf(sc / a->softcap);
            scores[i] = sc;
            max = sc > max ? sc : max;
        }
        const float sum = exp_sum_avx2(scores, n, max);
        memset(o, 0, (size_t)hd * sizeof(float));
        for (int i = a->lo; i <= a->hi; i++) {
            const float *v = a->v + (size_t)a->table[i / bs] * a->v_block + (size_t)(i % bs) * a->v_row;
            axpy_avx2(o, scores[i - a->lo] / sum, v, hd);
        }
    }
}

/* exp(x) of 4 doubles for x <= 0: x = k ln2 + r, |r| <= ln2 / 2 (ln2 in two parts, the high
 * one with 32 trailing zero bits so k * ln2_hi is exact), exp(r) by its Taylor series to r^13
 * (the next term is below 0.05 ulp) in Horner form, times 2^k built in the exponent field.
 * Within 2 ulp of libm's over [-708, 0] (tests); below -708 (and -inf) 0, NaN stays NaN. */
INLINE __m256d exp_nonpositive_pd(__m256d x) {
    const __m256d ln2_hi = _mm256_set1_pd(6.93147180369123816490e-01);
    const __m256d ln2_lo = _mm256_set1_pd(1.90821492927058770002e-10);
    const __m256d k = _mm256_round_pd(_mm256_mul_pd(x, _mm256_set1_pd(1.44269504088896340736)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256d r = _mm256_fnmadd_pd(k, ln2_lo, _mm256_fnmadd_pd(k, ln2_hi, x));
    static const double inv_factorial[14] = {
        1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040, 1.0 / 40320, 1.0 / 362880,
        1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600, 1.0 / 6227020800.0};
    __m256d p = _mm256_set1_pd(inv_factorial[13]);
    for (int n = 12; n >= 0; n--) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(inv_factorial[n]));
    /* 2^k: k + 1023 + 2^52 holds k + 1023 in its low mantissa bits; shifted into the exponent */
    const __m256i bits = _mm256_slli_epi64(_mm256_castpd_si256(_mm256_add_pd(k, _mm256_set1_pd(1023.0 + 4503599627370496.0))), 52);
    const __m256d y = _mm256_mul_pd(p, _mm256_castsi256_pd(bits));
    return _mm256_andnot_pd(_mm256_cmp_pd(x, _mm256_set1_pd(-708.0), _CMP_LT_OQ), y);
}

void tw_exp_blocks_avx2(const float *l, int v, double t, double *e, double *sums, int block) {
    __m256 top8 = _mm256_set1_ps(l[0]);
    int i = 0;
    for (; i + 8 <= v; i += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(l + i));
    float top = hmax8(top8);
    for (; i < v; i++) top = l[i] > top ? l[i] : top;
    const double m = (double)top / t;
    const __m256d vt = _mm256_set1_pd(t), vm = _mm256_set1_pd(m);
    for (int b = 0; b * block < v; b++) {
        const int end = (b + 1) * block < v ? (b + 1) * block : v;
        __m256d acc = _mm256_setzero_pd();
        for (i = b * block; i + 4 <= end; i += 4) {
            __m256d x = _mm256_cvtps_pd(_mm_loadu_ps(l + i));
            if (t != 1.0) x = _mm256_div_pd(x, vt);          /* x / 1 is x: the division only where it rounds */
            const __m256d y = exp_nonpositive_pd(_mm256_sub_pd(x, vm));
            _mm256_storeu_pd(e + i, y);
            acc = _mm256_add_pd(acc, y);
        }
        double lanes[4];
        _mm256_storeu_pd(lanes, acc);
        double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
        for (; i < end; i++) {
            const double x = (double)l[i] / t - m;
            e[i] = x < -708.0 ? 0.0 : exp(x);
            sum += e[i];
        }
        sums[b] = sum;
    }
}

static float read_sum_avx2(const uint8_t *p, size_t bytes) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < bytes; i += 128) {
        _mm_prefetch((const char *)p + i + TW_PREFETCH_BYTES, TW_PREFETCH_HINT);
        _mm_prefetch((const char *)p + i + 64 + TW_PREFETCH_BYTES, TW_PREFETCH_HINT);
        a0 = _mm256_add_epi32(a0, _mm256_load_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi32(a1, _mm256_load_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_add_epi32(a2, _mm256_load_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_add_epi32(a3, _mm256_load_si256((const __m256i *)(p + i + 96)));
    }
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, s);
    return (float)(lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7]);
}

const tw_kernels tw_kernels_avx2 = {
    .isa = TW_ISA_AVX2, .name = "avx2",
    .int4 = {int4_f32_avx2, int4_q8_avx2},
    .prep = {prep_f32_avx2, prep_q8_avx2},
    .rows = rows_avx2, .rows_q8 = tw_rows_q8_avx2, .dot = dot_avx2, .axpy = axpy_avx2, .read_sum = read_sum_avx2,
    .gated = gated_avx2, .exp_sum = exp_sum_avx2, .attend = attend_avx2, .exp_blocks = tw_exp_blocks_avx2,
    .residual_rms_norm = tw_residual_rms_norm,
};

#if defined(__clang__)
#pragma clang attribute pop
#endif

#else
const tw_kernels tw_kernels_avx2 = {.isa = TW_ISA_AVX2, .name = "avx2"};
#endif
