/* AVX-512 kernels (F, BW, VL, VNNI): the fast path on current Intel/AMD server CPUs.
 *
 * INT4, tiled layout (tw.h): a zmm holds one 64-byte chunk = 8 k values of 16 rows, so the
 * 16 lanes are 16 outputs and a tile ends with one store. Low and high nibbles are masked
 * out as bytes and fed to vpdpbusd (u8 weights x s8 activations, 4-way dot into int32, 64
 * multiply-adds per instruction); int32 group sums are scaled to float once per group.
 *
 * Both activation precisions run on that instruction:
 * - exact ("fp32"): activations as 23-bit integers per group (a power-of-two scale, error at
 *   most 2^-22 of the group's largest |x|; float32 itself resolves 2^-24) in three signed base-256
 *   digits, 6 vpdpbusd per 128 weights (tile_x24). Measured on one core with the weights in
 *   L2, a GEMV: 61 G weights/s, where the float FMA formulation (vpermps table + FMA per 16
 *   weights, 23 uops per 128 on two ports) reached 28 — below a core's share of DRAM
 *   bandwidth, so a decode step was compute bound at ~75% of the roofline.
 * - int8 (tile_q8): one digit, round(x * 127 / max|x|) per group, 2 vpdpbusd per 128 weights.
 *
 * Rows are processed in blocks of MB activation rows (compile-time constants below) so each
 * unpacked chunk is reused from registers; accumulators are split (NACC) so VNNI latency
 * never bounds a short block. This file is long because each kernel is one hot loop.
 */
#include "tw.h"

#if defined(__x86_64__) || defined(__i386__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#endif

#include <immintrin.h>
#include <math.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))


INLINE __mmask16 tile_mask(const tw_int4 *w, int t) {
    int rows = w->n - t * TW_TILE;
    return rows >= TW_TILE ? (__mmask16)0xffff : (__mmask16)((1u << rows) - 1);
}

/* acc += dot4(u8 w, s8 *x broadcast to all lanes). Written as asm because compilers neither
 * fold the broadcast into vpdpbusd's memory operand nor keep its accumulator in place, and
 * the extra moves and loads cost a third of the front end in the batch kernel. */
#define DPBUSD_BCAST(acc, w, x) \
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)(x)))

/* A zeroed register by the zeroing idiom (no execution port): written as asm because GCC
 * otherwise keeps one zero register and copies it into each accumulator (a vector move each). */
INLINE __m512i zero_acc(void) {
    __m512i z;
    __asm__ volatile("vpxord %0, %0, %0" : "=v"(z));
    return z;
}

INLINE __mmask16 first_lanes(int count) {
    return count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1);
}

INLINE __m512 load_half16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)p));
}

/* ---------------------------------------------------------------- INT4 x q8 */

/* The q8 activations this ISA prepares (prep_q8_avx512) are interleaved by chunk:
 * xq[(c * m + row) * 8 + 0..7] for global chunk c = k / 8, so every row of a block is one
 * fixed offset from a single pointer. Up to 16 rows per pass keep one unpacked chunk in use
 * for 32 vpdpbusd; the float accumulators are registers too, updated once per group (up to 8
 * rows they stay in registers: +1.3% at 8 rows on one core, 173 -> 175 G multiply-adds/s; the
 * compiler spills some at 16, as fast as the memory ones were). */
INLINE void tile_q8(const tw_int4 *w, const tw_act *a, float *y, int ldy, int t, int m0, const int MB, const int GS) {
    enum { MAXMB = 16 };
    const int NACC = MB == 1 ? 4 : (MB <= 4 ? 2 : 1);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const int ng = w->num_groups, gs = GS ? GS : w->group_size, chunks = gs / 8;
    const size_t row8 = (size_t)a->m * 8;                  /* bytes from one chunk of all rows to the next */
    const uint8_t *block = w->data + (size_t)t * ng * w->block_bytes;
    __m512 F[MAXMB];
    for (int i = 0; i < MB; i++) F[i] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++, block += w->block_bytes) {
        const __m512i *q = (const __m512i *)(block + 64);
        const int8_t *x = a->xq + (size_t)g * chunks * row8 + (size_t)m0 * 8;
        __m512i A[MAXMB][4];
        for (int i = 0; i < MB; i++)
            for (int u = 0; u < NACC; u++) A[i][u] = _mm512_setzero_si512();
        for (int c = 0; c < chunks; c++, x += row8) {
            _mm_prefetch((const char *)(q + c) + TW_PREFETCH_BYTES, TW_PREFETCH_HINT);
            const __m512i wv = _mm512_load_si512(q + c);
            const __m512i lo = _mm512_and_si512(wv, low4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low4);
            for (int i = 0; i < MB; i++) {
                const int u0 = NACC == 4 ? 2 * (c & 1) : 0, u1 = NACC == 1 ? 0 : u0 + 1;
                DPBUSD_BCAST(A[i][u0], lo, x + 8 * i);
                DPBUSD_BCAST(A[i][u1], hi, x + 8 * i + 4);
            }
        }
        const __m512 s = load_half16(block), z = load_half16(block + 32);
        for (int i = 0; i < MB; i++) {
            __m512i acc = A[i][0];
            for (int u = 1; u < NACC; u++) acc = _mm512_add_epi32(acc, A[i][u]);
            const size_t mg = (size_t)(m0 + i) * ng + g;
            const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(a->xd[mg]));
            F[i] = _mm512_fmadd_ps(s, _mm512_fnmadd_ps(z, _mm512_set1_ps(a->xqsum[mg]), dot), F[i]);
        }
    }
    const __mmask16 mask = tile_mask(w, t);
    for (int i = 0; i < MB; i++) _mm512_mask_storeu_ps(y + (size_t)(m0 + i) * ldy + t * TW_TILE, mask, F[i]);
}

/* One activation row (decode): as tile_x24_one, two groups at a time with the low and high
 * nibbles in their own accumulators (the high ones as byte & 0xf0, 16x, shifted back per group).
 * The integer sum is tile_q8's exactly, and its float steps are tile_q8's, rounding for
 * rounding: a row's product does not depend on how many rows share its step (greedy output
 * with and without speculation, or beside other requests, is the same). */
INLINE __m512 q8_rescale(__m512 F, __m512i L, __m512i H, const uint8_t *block, const tw_act *a, int g) {
    const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(L, _mm512_srai_epi32(H, 4))),
                                     _mm512_set1_ps(a->xd[g]));
    const __m512 s = load_half16(block), z = load_half16(block + 32);
    return _mm512_fmadd_ps(s, _mm512_fnmadd_ps(z, _mm512_set1_ps(a->xqsum[g]), dot), F);
}

INLINE void tile_q8_one(const tw_int4 *w, const tw_act *a, float *y, int t, const int GS) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), high4 = _mm512_set1_epi8((char)0xf0);
    const int ng = w->num_groups, gs = GS ? GS : w->group_size, chunks = gs / 8;
    const size_t bb = GS ? 64 + 8 * (size_t)GS : w->block_bytes, xg = (size_t)chunks * 8;
    const uint8_t *block = w->data + (size_t)t * ng * bb;
    __m512 F = _mm512_setzero_ps();
    int g = 0;
    for (; g + 2 <= ng; g += 2, block += 2 * bb) {
        const __m512i *qa = (const __m512i *)(block + 64), *qb = (const __m512i *)(block + bb + 64);
        const int8_t *xa = a->xq + (size_t)g * xg, *xb = xa + xg;
        __m512i La = zero_acc(), Ha = zero_acc(), Lb = zero_acc(), Hb = zero_acc();
        __m512i La2 = zero_acc(), Ha2 = zero_acc(), Lb2 = zero_acc(), Hb2 = zero_acc();
        for (size_t off = 0; off < 2 * bb; off += 64) _mm_prefetch((const char *)block + off + TW_PREFETCH_BYTES, TW_PREFETCH_HINT);
        for (int c = 0; c < chunks; c += 2) {
            const __m512i wa = _mm512_load_si512(qa + c), wb = _mm512_load_si512(qb + c);
            DPBUSD_BCAST(La, _mm512_and_si512(wa, low4), xa + 8 * c);
            DPBUSD_BCAST(Ha, _mm512_and_si512(wa, high4), xa + 8 * c + 4);
            DPBUSD_BCAST(Lb, _mm512_and_si512(wb, low4), xb + 8 * c);
            DPBUSD_BCAST(Hb, _mm512_and_si512(wb, high4), xb + 8 * c + 4);
            if (c + 1 < chunks) {
                const __m512i va = _mm512_load_si512(qa + c + 1), vb = _mm512_load_si512(qb + c + 1);
                DPBUSD_BCAST(La2, _mm512_and_si512(va, low4), xa + 8 * c + 8);
                DPBUSD_BCAST(Ha2, _mm512_and_si512(va, high4), xa + 8 * c + 12);
                DPBUSD_BCAST(Lb2, _mm512_and_si512(vb, low4), xb + 8 * c + 8);
                DPBUSD_BCAST(Hb2, _mm512_and_si512(vb, high4), xb + 8 * c + 12);
            }
        }
        F = q8_rescale(F, _mm512_add_epi32(La, La2), _mm512_add_epi32(Ha, Ha2), block, a, g);
        F = q8_rescale(F, _mm512_add_epi32(Lb, Lb2), _mm512_add_epi32(Hb, Hb2), block + bb, a, g + 1);
    }
    if (g < ng) {
        const __m512i *q = (const __m512i *)(block + 64);
        const int8_t *x = a->xq + (size_t)g * xg;
        __m512i L = zero_acc(), H = zero_acc();
        for (size_t off = 0; off < bb; off += 64) _mm_prefetch((const char *)block + off + TW_PREFETCH_BYTES, TW_PREFETCH_HINT);
        for (int c = 0; c < chunks; c++) {
            const __m512i wv = _mm512_load_si512(q + c);
            DPBUSD_BCAST(L, _mm512_and_si512(wv, low4), x + 8 * c);
            DPBUSD_BCAST(H, _mm512_and_si512(wv, high4), x + 8 * c + 4);
        }
        F = q8_rescale(F, L, H, block, a, g);
    }
    _mm512_mask_storeu_ps(y + t * TW_TILE, tile_mask(w, t), F);
}

INLINE void tiles_q8(const tw_int4 *w, const tw_act *a, float *y, int ldy, int t0, int t1, const int GS) {
    if (a->m == 1) {
        for (int t = t0; t < t1; t++) tile_q8_one(w, a, y, t, GS);
        return;
    }
    for (int t = t0; t < t1; t++) {
        int m = 0;
        for (; m + 16 <= a->m; m += 16) tile_q8(w, a, y, ldy, t, m, 16, GS);
        switch (a->m - m) {     /* the rest in one pass: each chunk is unpacked once for all of them */
        case 15: tile_q8(w, a, y, ldy, t, m, 15, GS); break;
        case 14: tile_q8(w, a, y, ldy, t, m, 14, GS); break;
        case 13: tile_q8(w, a, y, ldy, t, m, 13, GS); break;
        case 12: tile_q8(w, a, y, ldy, t, m, 12, GS); break;
        case 11: tile_q8(w, a, y, ldy, t, m, 11, GS); break;
        case 10: tile_q8(w, a, y, ldy, t, m, 10, GS); break;
        case 9: tile_q8(w, a, y, ldy, t, m, 9, GS); break;
        case 8: tile_q8(w, a, y, ldy, t, m, 8, GS); break;
        case 7: tile_q8(w, a, y, ldy, t, m, 7, GS); break;
        case 6: tile_q8(w, a, y, ldy, t, m, 6, GS); break;
        case 5: tile_q8(w, a, y, ldy, t, m, 5, GS); break;
        case 4: tile_q8(w, a, y, ldy, t, m, 4, GS); break;
        case 3: tile_q8(w, a, y, ldy, t, m, 3, GS); break;
        case 2: tile_q8(w, a, y, ldy, t, m, 2, GS); break;
        case 1: tile_q8(w, a, y, ldy, t, m, 1, GS); break;
        default: break;
        }
    }
}

static void int4_q8_avx512(const tw_int4 *w, const tw_act *a, float *y, int ldy, int t0, int t1) {
    switch (w->group_size) {
    case 32: tiles_q8(w, a, y, ldy, t0, t1, 32); break;
    case 64: tiles_q8(w, a, y, ldy, t0, t1, 64); break;
    case 128: tiles_q8(w, a, y, ldy, t0, t1, 128); break;
    default: tiles_q8(w, a, y, ldy, t0, t1, 0); break;
    }
}

/* ---------------------------------------------------------------- INT4 x exact activations (24-bit digits) */

/* The fp32-precision path on AVX-512, as integer dot products: prep_x24_avx512 writes each
 * activation as a 23-bit integer x_int = round(x * 2^s) (one power-of-two scale per group,
 * max|x| * 2^s < 2^22 and max|x| >= 2^21 / 2^s, so the rounding (half a unit) is at most
 * 2^-22 of the group's largest |x|; float32 itself resolves 2^-24) split into three signed
 * base-256 digits, x_int = 65536 d2 + 256 d1 + d0. Each digit plane is a vpdpbusd against
 * the nibbles, exact in int32, and the three are combined in float once per group. Per 16
 * rows x 8 k: 6 vpdpbusd where the FMA path needs 7 shifts, 8 permutes and 8 FMAs, which
 * makes a decode step memory bound again. Three digits are the minimum for 23 bits with
 * vpdpbusd's 8-bit activation operand: a batch of 16 needs 3x the int8 path's multiply rate.
 * Layout of xq: 24 bytes per (global chunk c, row m) at (c * rows + m) * 24: the d0 bytes of
 * the even k, of the odd k, then d1's and d2's. */
INLINE void tile_x24(const tw_int4 *w, const tw_act *a, float *y, int ldy, int t, int m0, const int MB, const int GS) {
    enum { MAXMB = 8 };
    const int NACC = MB == 1 ? 2 : 1;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const int ng = w->num_groups, gs = GS ? GS : w->group_size, chunks = gs / 8;
    const size_t row24 = (size_t)a->m * 24;
    const uint8_t *block = w->data + (size_t)t * ng * w->block_bytes;
    __m512 F[MAXMB];
    for (int i = 0; i < MB; i++) F[i] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++, block += w->block_bytes) {
        const __m512i *q = (const __m512i *)(block + 64);
        const int8_t *x = a->xq + (size_t)g * chunks * row24 + (size_t)m0 * 24;
        __m512i A[MAXMB][2][3];
        for (int i = 0; i < MB; i++)
            for (int u = 0; u < NACC; u++) A[i][u][0] = A[i][u][1] = A[i][u][2] = _mm512_setzero_si512();
        for (int c = 0; c < chunks; c++, x += row24) {
            _mm_prefetch((const char *)(q + c) + TW_PREFETCH_BYTES, TW_PREFETCH_HINT);
            const __m512i wv = _mm512_load_si512(q + c);
            const __m512i lo = _mm512_and_si512(wv, low4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low4);
            for (int i = 0; i < MB; i++) {
                const int u = NACC == 2 ? (c & 1) : 0;
                for (int d = 0; d < 3; d++) {
                    DPBUSD_BCAST(A[i][u][d], lo, x + 24 * i + 8 * d);
                    DPBUSD_BCAST(A[i][u][d], hi, x + 24 * i + 8 * d + 4);
                }
            }
        }
        const __m512 s = load_half16(block), z = load_half16(block + 32);
        for (int i = 0; i < MB; i++) {
            __m512i d0 = A[i][0][0], d1 = A[i][0][1], d2 = A[i][0][2];
            if (NACC == 2) {
                d0 = _mm512_add_epi32(d0, A[i][1][0]);
                d1 = _mm512_add_epi32(d1, A[i][1][1]);
                d2 = _mm512_add_epi32(d2, A[i][1][2]);
            }
            const __m512 hi2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d2), _mm512_set1_ps(65536.0f),
                                               _mm512_mul_ps(_mm512_cvtepi32_ps(d1), _mm512_set1_ps(256.0f)));
            const size_t mg = (size_t)(m0 + i) * ng + g;
            const __m512 dot = _mm512_mul_ps(_mm512_add_ps(hi2, _mm512_cvtepi32_ps(d0)), _mm512_set1_ps(a->xd[mg]));
            F[i] = _mm512_fmadd_ps(s, _mm512_fnmadd_ps(z, _mm512_set1_ps(a->xqsum[mg]), dot), F[i]);
        }
    }
    const __mmask16 mask = tile_mask(w, t);
    for (int i = 0; i < MB; i++) _mm512_mask_storeu_ps(y + (size_t)(m0 + i) * ldy + t * TW_TILE, mask, F[i]);
}

/* One activation row (decode): two groups of the tile at a time, each with its own six
 * accumulators (3 digits x low / high nibbles), so 12 independent vpdpbusd chains hide the
 * instruction's latency. The high nibbles are masked in place (byte & 0xf0 = 16 * nibble,
 * one op instead of shift + mask); their sums are exact multiples of 16 and are shifted
 * back once per group. */
INLINE __m512i x24_digits_dot(__m512i L, __m512i H) { return _mm512_add_epi32(L, _mm512_srai_epi32(H, 4)); }

INLINE __m512 x24_group_sum(__m512i L0, __m512i L1, __m512i L2, __m512i H0, __m512i H1, __m512i H2) {
    const __m512i d0 = x24_digits_dot(L0, H0), d1 = x24_digits_dot(L1, H1), d2 = x24_digits_dot(L2, H2);
    const __m512 hi2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d2), _mm512_set1_ps(65536.0f),
                                       _mm512_mul_ps(_mm512_cvtepi32_ps(d1), _mm512_set1_ps(256.0f)));
    return _mm512_add_ps(hi2, _mm512_cvtepi32_ps(d0));
}

INLINE __m512 x24_rescale(__m512 F, __m512 dot, const uint8_t *block, const tw_act *a, int g) {
    const __m512 s = load_half16(block), z = load_half16(block + 32);
    const __m512 v = _mm512_fmsub_ps(dot, _mm512_set1_ps(a->xd[g]), _mm512_mul_ps(z, _mm512_set1_ps(a->xqsum[g])));
    return _mm512_fmadd_ps(s, v, F);
}

#define X24_CHUNK(L0, L1, L2, H0, H1, H2, wv, x)                                   \
    do {                                                                          \
        const __m512i lo_ = _mm512_and_si512(wv, low4), hi_ = _mm512_and_si512(wv, high4); \
        DPBUSD_BCAST(L0, lo_, (x));                                                \
        DPBUSD_BCAST(H0, hi_, (x) + 4);                                            \
        DPBUSD_BCAST(L1, lo_, (x) + 8);                                            \
        DPBUSD_BCAST(H1, hi_, (x) + 12);                                           \
        DPBUSD_BCAST(L2, lo_, (x) + 16);                                           \
        DPBUSD_BCAST(H2, hi_, (x) + 20);                                           \
    } while (0)

INLINE void tile_x24_one(const tw_int4 *w, const tw_act *a, float *y, int t, const int GS) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), high4 = _mm512_set1_epi8((char)0xf0);
    const int ng = w->num_groups, gs = GS ? GS : w->group_size, chunks = gs / 8;
    const size_t bb = GS ? 64 + 8 * (size_t)GS : w->block_bytes, xg = (size_t)chunks * 24;
    const uint8_t *block = w->data + (size_t)t * ng * bb;
    __m512 F = _mm512_setzero_ps();
    int g = 0;
    for (; g + 2 <= ng; g += 2, block += 2 * bb) {
        const __m512i *qa = (const __m512i *)(block + 64), *qb = (const __m512i *)(block + bb + 64);
        const int8_t *xa = a->xq + (size_t)g * xg, *xb = xa + xg;
        __m512i La0 = zero_acc(), La1 = zero_acc(), La2 = zero_acc(), Ha0 = zero_acc(), Ha1 = zero_acc(), Ha2 = zero_acc();
        __m512i Lb0 = zero_acc(), Lb1 = zero_acc(), Lb2 = zero_acc(), Hb0 = zero_acc(), Hb1 = zero_acc(), Hb2 = zero_acc();
        /* the pair's 2 * bb bytes, one line per 64 bytes, TW_PREFETCH_BYTES ahead */
        for (size_t off = 0; off < 2 * bb; off += 64) _mm_prefetch((const char *)block + off + TW_PREFETCH_BYTES, TW_PREFETCH_HINT);
        for (int c = 0; c < chunks; c++) {
            const __m512i wa = _mm512_load_si512(qa + c), wb = _mm512_load_si512(qb + c);
            X24_CHUNK(La0, La1, La2, Ha0, Ha1, Ha2, wa, xa + 24 * c);
            X24_CHUNK(Lb0, Lb1, Lb2, Hb0, Hb1, Hb2, wb, xb + 24 * c);
        }
        F = x24_rescale(F, x24_group_sum(La0, La1, La2, Ha0, Ha1, Ha2), block, a, g);
        F = x24_rescale(F, x24_group_sum(Lb0, Lb1, Lb2, Hb0, Hb1, Hb2), block + bb, a, g + 1);
    }
    if (g < ng) {
        const __m512i *q = (const __m512i *)(block + 64);
        const int8_t *x = a->xq + (size_t)g * xg;
        __m512i L0 = zero_acc(), L1 = zero_acc(), L2 = zero_acc(), H0 = zero_acc(), H1 = zero_acc(), H2 = zero_acc();
        for (size_t off = 0; off < bb; off += 64) _mm_prefetch((const char *)block + off + TW_PREFETCH_BYTES, TW_PREFETCH_HINT);
        for (int c = 0; c < chunks; c++) {
            const __m512i wv = _mm512_load_si512(q + c);
            X24_CHUNK(L0, L1, L2, H0, H1, H2, wv, x + 24 * c);
        }
        F = x24_rescale(F, x24_group_sum(L0, L1, L2, H0, H1, H2), block, a, g);
    }
    _mm512_mask_storeu_ps(y + t * TW_TILE, tile_mask(w, t), F);
}

INLINE void tiles_x24(const tw_int4 *w, const tw_act *a, float *y, int ldy, int t0, int t1, const int GS) {
    if (a->m == 1) {
        for (int t = t0; t < t1; t++) tile_x24_one(w, a, y, t, GS);
        return;
    }
    for (int t = t0; t < t1; t++) {
        int m = 0;
        for (; m + 8 <= a->m; m += 8) tile_x24(w, a, y, ldy, t, m, 8, GS);
        switch (a->m - m) {
        case 7: tile_x24(w, a, y, ldy, t, m, 7, GS); break;
        case 6: tile_x24(w, a, y, ldy, t, m, 6, GS); break;
        case 5: tile_x24(w, a, y, ldy, t, m, 5, GS); break;
        case 4: tile_x24(w, a, y, ldy, t, m, 4, GS); break;
        case 3: tile_x24(w, a, y, ldy, t, m, 3, GS); break;
        case 2: tile_x24(w, a, y, ldy, t, m, 2, GS); break;
        case 1: tile_x24(w, a, y, ldy, t, m, 1, GS); break;
        default: break;
        }
    }
}

static void int4_x24_avx512(const tw_int4 *w, const tw_act *a, float *y, int ldy, int t0, int t1) {
    switch (w->group_size) {
    case 32: tiles_x24(w, a, y, ldy, t0, t1, 32); break;
    case 64: tiles_x24(w, a, y, ldy, t0, t1, 64); break;
    case 128: tiles_x24(w, a, y, ldy, t0, t1, 128); break;
    default: tiles_x24(w, a, y, ldy, t0, t1, 0); break;
    }
}

/* ---------------------------------------------------------------- activation preparation */

/* Lanes of [i, i + 16) that are inside both the group (ends at `end`) and the logical K. */
INLINE __mmask16 span_mask(int i, int end, int k) {
    int n = (end < k ? end : k) - i;
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* See tile_x24: a power-of-two scale per group, 23-bit integers, three signed base-256 digits.
 * The digits come from the integer's bytes: x + 0x808080 has base-256 digits d_i + 128 (each
 * in [0, 255] since |x| < 2^22), so its bytes xor 0x80 are the signed digits. Two dword
 * permutes and a byte shuffle put 16 values' digits in the two chunks' order (even k then odd
 * k, for each digit), stored 24 bytes a chunk. The group's scale exponent is read from the
 * float bits of its largest |x| (frexpf / ldexpf calls were a third of this function's time). */
INLINE __m512 pow2(int e) { return _mm512_castsi512_ps(_mm512_set1_epi32((e + 127) << 23)); }     /* -126 <= e <= 127 */

static void prep_x24_avx512(tw_act *a, const float *x, int ldx, int k, int m0, int m1) {
    const int kp = a->kp, ng = a->num_groups, gs = kp / ng;
    const size_t row24 = (size_t)a->m * 24;
    /* dwords k0 k2 k4 k6 | k1 k3 k5 k7 | k8 .. k14 | k9 .. k15 */
    const __m512i by_parity = _mm512_set_epi32(15, 13, 11, 9, 14, 12, 10, 8, 7, 5, 3, 1, 6, 4, 2, 0);
    /* in each lane of 4 values: their digit 0 bytes, digit 1 bytes, digit 2 bytes */
    const __m512i digit_major = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, -1, -1, -1, -1));
    /* chunk c: d0 even, d0 odd, d1 even, d1 odd, d2 even, d2 odd (dwords 0..5); chunk c + 1 at 8..13 */
    const __m512i chunk_order = _mm512_set_epi32(0, 0, 14, 10, 13, 9, 12, 8, 0, 0, 6, 2, 5, 1, 4, 0);
    const __m512i bias = _mm512_set1_epi32(0x808080);
    for (int m = m0; m < m1; m++) {
        const float *src = x + (size_t)m * ldx;
        int8_t *dst = a->xq + (size_t)m * 24;
        for (int g = 0; g < ng; g++) {
            const int end = (g + 1) * gs;
            __m512 vmax = _mm512_setzero_ps();
            for (int i = g * gs; i < end; i += 16)
                vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(span_mask(i, end, k), src + i)));
            const float amax = _mm512_reduce_max_ps(vmax);
            uint32_t bits;
            memcpy(&bits, &amax, sizeof bits);
            /* amax in [2^(E-127), 2^(E-126)): frexpf's exponent is E - 126, shift = 22 - that,
             * at most 126 (a subnormal amax, E = 0, lands there too) */
            const int biased = (int)(bits >> 23), shift = amax > 0.0f ? (148 - biased < 126 ? 148 - biased : 126) : 0;
            const __m512 scale = pow2(shift);
            __m512i total = _mm512_setzero_si512();
            for (int i = g * gs; i < end; i += 16) {
                const __m512i xi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(span_mask(i, end, k), src + i), scale));
                total = _mm512_add_epi32(total, xi);
                const __m512i digits = _mm512_xor_si512(_mm512_add_epi32(xi, bias), bias);
                const __m512i v = _mm512_permutexvar_epi32(chunk_order,
                    _mm512_shuffle_epi8(_mm512_permutexvar_epi32(by_parity, digits), digit_major));
                int8_t *c0 = dst + (size_t)(i / 8) * row24;
                _mm512_mask_storeu_epi32(c0, 0x003f, v);
                if (end - i >= 16) _mm512_mask_storeu_epi32(c0 + row24 - 32, 0x3f00, v);
            }
            const float unit = _mm512_cvtss_f32(pow2(-shift));
            a->xd[(size_t)m * ng + g] = unit;
            a->xqsum[(size_t)m * ng + g] = unit * (float)_mm512_reduce_add_epi32(total);
        }
    }
}

/* Same quantization as tw_act_prepare_q8 (x * (127 / amax) rounded to nearest even), 16 at a
 * time; the chunk order [k0 k2 k4 k6 k1 k3 k5 k7] is one byte shuffle; chunks are stored
 * interleaved across rows for tile_q8 (all of a->m rows must be prepared before the kernel).
 * Groups go 16 at a time in three passes (maxima; quantization; scales), so the horizontal
 * reductions of different groups overlap instead of forming one long dependency chain per
 * group (8 rows of the default model's widths: 0.30 -> 0.24 ns a value on one core; the same bytes). */
static void prep_q8_avx512(tw_act *a, const float *x, int ldx, int k, int m0, int m1) {
    const int kp = a->kp, ng = a->num_groups, gs = kp / ng;
    const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    const size_t row8 = (size_t)a->m * 8;                  /* the interleaved layout of tile_q8 */
    for (int m = m0; m < m1; m++) {
        const float *src = x + (size_t)m * ldx;
        int8_t *dst = a->xq + (size_t)m * 8;
        for (int g0 = 0; g0 < ng; g0 += 16) {
            const int nb = ng - g0 < 16 ? ng - g0 : 16;
            const __mmask16 lanes = first_lanes(nb);
            __attribute__((aligned(64))) float amax[16], inv[16];
            __attribute__((aligned(64))) int32_t sum[16];
            for (int j = 0; j < nb; j++) {
                const int end = (g0 + j + 1) * gs;
                __m512 vmax = _mm512_setzero_ps();
                for (int i = (g0 + j) * gs; i < end; i += 16)
                    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(span_mask(i, end, k), src + i)));
                amax[j] = _mm512_reduce_max_ps(vmax);
            }
            const __m512 vamax = _mm512_maskz_load_ps(lanes, amax);
            const __mmask16 positive = _mm512_cmp_ps_mask(vamax, _mm512_setzero_ps(), _CMP_GT_OQ);
            _mm512_store_ps(inv, _mm512_maskz_div_ps(positive, _mm512_set1_ps(127.0f), vamax));
            for (int j = 0; j < nb; j++) {
                const int end = (g0 + j + 1) * gs;
                const __m512 vinv = _mm512_set1_ps(inv[j]);
                __m512i total = _mm512_setzero_si512();
                for (int i = (g0 + j) * gs; i < end; i += 16) {
                    const __m512 v = _mm512_maskz_loadu_ps(span_mask(i, end, k), src + i);
                    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, vinv));
                    q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
                    total = _mm512_add_epi32(total, q);
                    const __m128i bytes = _mm_shuffle_epi8(_mm512_cvtepi32_epi8(q), order);
                    _mm_storel_epi64((__m128i *)(dst + (size_t)(i / 8) * row8), bytes);
                    if (end - i >= 16) _mm_storel_epi64((__m128i *)(dst + (size_t)(i / 8 + 1) * row8), _mm_srli_si128(bytes, 8));
                }
                sum[j] = _mm512_reduce_add_epi32(total);
            }
            const __m512 d = _mm512_div_ps(vamax, _mm512_set1_ps(127.0f));
            const size_t at = (size_t)m * ng + g0;
            _mm512_mask_storeu_ps(a->xd + at, lanes, d);
            _mm512_mask_storeu_ps(a->xqsum + at, lanes, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_maskz_load_epi32(lanes, sum))));
        }
    }
}

/* ---------------------------------------------------------------- dense / int8 rows */

INLINE __m512 load_row16(const void *w, int kind, size_t idx, __mmask16 mask) {
    switch (kind) {
    case TW_W_F32: return _mm512_maskz_loadu_ps(mask, (const float *)w + idx);
    case TW_W_F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)w + idx));
    default: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, (const int8_t *)w + idx)));
    }
}

/* Rows [n0, n1) against up to 4 activation rows at a time; int8 row scales applied at the end. */
INLINE void rows_block(const void *w, const uint16_t *row_scales, int kind, int k,
                       const float *x, int ldx, float *y, int ldy, int n, const int MB) {
    __m512 A[4];
    for (int i = 0; i < MB; i++) A[i] = _mm512_setzero_ps();
    const int elem = kind == TW_W_F32 ? 4 : kind == TW_W_F16 ? 2 : 1;
    for (int kk = 0; kk < k; kk += 16) {
        _mm_prefetch((const char *)w + ((size_t)n * k + kk) * elem + TW_PREFETCH_BYTES, TW_PREFETCH_HINT);
        const __mmask16 mask = k - kk >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - kk)) - 1);
        const __m512 wv = load_row16(w, kind, (size_t)n * k + kk, mask);
        for (int i = 0; i < MB; i++)
            A[i] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + (size_t)i * ldx + kk), A[i]);
    }
    const float scale = kind == TW_W_I8 ? tw_half_to_float(row_scales[n]) : 1.0f;
    for (int i = 0; i < MB; i++) y[(size_t)i * ldy + n] = _mm512_reduce_add_ps(A[i]) * scale;
}

static void rows_avx512(const void *w, const uint16_t *row_scales, int kind, int k,
                        const float *x, int ldx, int m, float *y, int ldy, int n0, int n1) {
    for (int n = n0; n < n1; n++) {
        int i = 0;
        for (; i + 4 <= m; i += 4) rows_block(w, row_scales, kind, k, x + (size_t)i * ldx, ldx, y + (size_t)i * ldy, ldy, n, 4);
        switch (m - i) {
        case 3: rows_block(w, row_scales, kind, k, x + (size_t)i * ldx, ldx, y + (size_t)i * ldy, ldy, n, 3); break;
        case 2: rows_block(w, row_scales, kind, k, x + (size_t)i * ldx, ldx, y + (size_t)i * ldy, ldy, n, 2); break;
        case 1: rows_block(w, row_scales, kind, k, x + (size_t)i * ldx, ldx, y + (size_t)i * ldy, ldy, n, 1); break;
        default: break;
        }
    }
}

/* ---------------------------------------------------------------- vector helpers (attention) */

static float dot_avx512(const float *a, const float *b, int n) {
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        const __mmask16 mask = (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, a + i), _mm512_maskz_loadu_ps(mask, b + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

static void axpy_avx512(float *y, float alpha, const float *x, int n) {
    const __m512 av = _mm512_set1_ps(alpha);
    int i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        const __mmask16 mask = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(y + i, mask, _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(mask, x + i), _mm512_maskz_loadu_ps(mask, y + i)));
    }
}

/* ---------------------------------------------------------------- exp and the gated activations */

/* exp(x) to ~1 ulp: x = n ln2 + r (Cody-Waite), exp(r) by a degree-6 polynomial on
 * |r| <= ln2/2, times 2^n with vscalefps (which also saturates to inf). Results below the
 * smallest normal float are returned as 0: a subnormal costs a microcode assist in every
 * later multiply (it made the attention of a random-weight model 3x slower), and a
 * probability under 1e-38 changes nothing a float32 sum can show. */
INLINE __m512 exp512(__m512 x) {
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_GE_OQ);
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.8f)), _mm512_set1_ps(-88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
    r = _mm512_fnmadd_ps(n, ln2_lo, r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(normal, p, n);
}

INLINE __m512 gated512(__m512 x, __m512 up, int gelu) {
    const __m512 one = _mm512_set1_ps(1.0f);
    if (!gelu) return _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), x)))), up);
    /* 0.5 x (1 + tanh(k0 (x + k1 x^3))), tanh(y) = 1 - 2 / (exp(2y) + 1) */
    const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), x), x), x);
    const __m512 y = _mm512_mul_ps(_mm512_set1_ps((float)0.7978845608028654), _mm512_add_ps(x, x3));
    const __m512 e = exp512(_mm512_add_ps(y, y));
    const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(one, t)), up);
}

static void gated_avx512(float *out, const float *gate, const float *up, int n, int gelu) {
    int i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, gated512(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i), gelu));
    if (i < n) {
        const __mmask16 mask = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(out + i, mask, gated512(_mm512_maskz_loadu_ps(mask, gate + i), _mm512_maskz_loadu_ps(mask, up + i), gelu));
    }
}

static float exp_sum_avx512(float *x, int n, float sub) {
    const __m512 s = _mm512_set1_ps(sub);
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), s));
        _mm512_storeu_ps(x + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (i < n) {
        const __mmask16 mask = (__mmask16)((1u << (n - i)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, x + i), s)));
        _mm512_mask_storeu_ps(x + i, mask, e);
        acc = _mm512_add_ps(acc, e);
    }
    return _mm512_reduce_add_ps(acc);
}

/* ---------------------------------------------------------------- attention */


/* Scores of GH heads (from g0) against NC chunks of 16 keys (kc[c]: chunk c's first key in a
 * transposed K block, row stride bs; mk[c]: its valid keys; col[c]: its first key's column in
 * the scores): the sum over d of q[g][d] * Kt[d][keys], one FMA per (d, head, chunk) and no
 * horizontal sums. Each q value is broadcast once for all NC chunks and each K row loaded once
 * for all GH heads, so loads stay below the FMAs; GH * NC accumulators in registers (fixed
 * array sizes: a variable-length array put them on the stack, 3x slower). */
INLINE void scores_pass(const tw_attn_args *a, int g0, const int GH, const float *const *kc, const __mmask16 *mk,
                        const int *col, const int NC) {
    enum { MAXGH = 8, MAXNC = 8 };
    const int hd = a->head_dim, bs = a->block_size, n = a->hi - a->lo + 1;
    const float *q = a->q + (size_t)g0 * hd;
    __m512 acc[MAXGH][MAXNC];
    for (int g = 0; g < GH; g++)
        for (int c = 0; c < NC; c++) acc[g][c] = _mm512_setzero_ps();
    for (int d = 0; d < hd; d++) {
        __m512 kv[MAXNC];
        for (int c = 0; c < NC; c++) kv[c] = _mm512_maskz_loadu_ps(mk[c], kc[c] + (size_t)d * bs);
        for (int g = 0; g < GH; g++) {
            const __m512 qv = _mm512_set1_ps(q[(size_t)g * hd + d]);
            for (int c = 0; c < NC; c++) acc[g][c] = _mm512_fmadd_ps(qv, kv[c], acc[g][c]);
        }
    }
    for (int g = 0; g < GH; g++)
        for (int c = 0; c < NC; c++)
            _mm512_mask_storeu_ps(a->scores + (size_t)(g0 + g) * n + col[c], mk[c],
                                  _mm512_mul_ps(acc[g][c], _mm512_set1_ps(a->scale)));
}

/* All visible keys for GH heads: chunks of up to 16 keys within a block, NC per pass (a
 * short last pass runs with its missing chunks masked off). */
INLINE void attn_scores(const tw_attn_args *a, int g0, const int GH) {
    enum { MAXNC = 8 };
    const int NC = GH >= 5 ? 2 : (GH >= 3 ? 4 : 8);     /* GH * NC <= 16 accumulators, >= 8 chains */
    const int bs = a->block_size, lo = a->lo, hi = a->hi;
    const float *kc[MAXNC];
    __mmask16 mk[MAXNC];
    int col[MAXNC], count = 0;
    for (int bi = lo / bs; bi <= hi / bs; bi++) {
        const float *kt = a->kt + (size_t)a->table[bi] * a->kt_block;
        const int j0 = lo > bi * bs ? lo : bi * bs, j1 = hi + 1 < (bi + 1) * bs ? hi + 1 : (bi + 1) * bs;
        for (int c0 = j0; c0 < j1; c0 += 16) {
            kc[count] = kt + (c0 - bi * bs);
            mk[count] = first_lanes(j1 - c0);
            col[count] = c0 - lo;
            if (++count == NC) {
                scores_pass(a, g0, GH, kc, mk, col, NC);
                count = 0;
            }
        }
    }
    if (count) {
        for (int c = count; c < NC; c++) kc[c] = kc[0], mk[c] = 0, col[c] = 0;
        scores_pass(a, g0, GH, kc, mk, col, NC);
    }
}

/* out[g] = sum_j p[g][j] v_j for GH heads from g0, each V row loaded once for all of them;
 * with fewer than 8 accumulators (GH * HD / 16), even and odd keys get their own set so FMA
 * latency does not bound the loop. The item's rows were asked for in advance
 * (tw_attention_prefetch). */
INLINE void values_key(const tw_attn_args *a, const float *p, int n, const float *v, __m512 acc[4][8], const int GH,
                       const int HD) {
    for (int c = 0; c < HD / 16; c++) {
        const __m512 vv = _mm512_loadu_ps(v + 16 * c);
        for (int g = 0; g < GH; g++) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[(size_t)g * n]), vv, acc[g][c]);
    }
}

INLINE void attn_values(const tw_attn_args *a, int g0, const int GH, const int HD) {
    const int bs = a->block_size, lo = a->lo, hi = a->hi, n = hi - lo + 1, pairs = GH * HD / 16 < 8;
    const float *p = a->scores + (size_t)g0 * n - lo;          /* p[g * n + j]: head g0 + g, key j */
    __m512 acc[2][4][8];                                      /* [key parity][head][16 dims] */
    for (int u = 0; u < 2; u++)
        for (int g = 0; g < GH; g++)
            for (int c = 0; c < HD / 16; c++) acc[u][g][c] = _mm512_setzero_ps();
    for (int bi = lo / bs; bi <= hi / bs; bi++) {
        const float *vb = a->v + (size_t)a->table[bi] * a->v_block;        /* row j at vb + (j - bi bs) v_row */
        const int j0 = lo > bi * bs ? lo : bi * bs, j1 = hi + 1 < (bi + 1) * bs ? hi + 1 : (bi + 1) * bs;
        int j = j0;
        if (pairs)
            for (; j + 2 <= j1; j += 2) {
                values_key(a, p + j, n, vb + (size_t)(j - bi * bs) * a->v_row, acc[0], GH, HD);
                values_key(a, p + j + 1, n, vb + (size_t)(j + 1 - bi * bs) * a->v_row, acc[1], GH, HD);
            }
        for (; j < j1; j++) values_key(a, p + j, n, vb + (size_t)(j - bi * bs) * a->v_row, acc[0], GH, HD);
    }
    for (int g = 0; g < GH; g++)
        for (int c = 0; c < HD / 16; c++)
            _mm512_storeu_ps(a->out + (size_t)(g0 + g) * HD + 16 * c, pairs ? _mm512_add_ps(acc[0][g][c], acc[1][g][c]) : acc[0][g][c]);
}

static float exp_sum_avx512(float *x, int n, float sub);

/* softmax of one head's scores in place: p = exp(s - max) / sum, the reference's order */
static void softmax_row(float *s, int n) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < n; j += 16) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, first_lanes(n - j), s + j));
    const __m512 sum = _mm512_set1_ps(exp_sum_avx512(s, n, _mm512_reduce_max_ps(vmax)));
    for (int j = 0; j < n; j += 16) {
        const __mmask16 mask = first_lanes(n - j);
        _mm512_mask_storeu_ps(s + j, mask, _mm512_div_ps(_mm512_maskz_loadu_ps(mask, s + j), sum));
    }
}

static void attend_avx512(const tw_attn_args *a) {
    const int hd = a->head_dim, group = a->group;
    if (hd != 64 && hd != 128) {
        tw_attend_generic(a);
        return;
    }
    for (int g = 0; g < group; g += 8) {
        switch (group - g < 8 ? group - g : 8) {
        case 8: attn_scores(a, g, 8); break;
        case 7: attn_scores(a, g, 7); break;
        case 6: attn_scores(a, g, 6); break;
        case 5: attn_scores(a, g, 5); break;
        case 4: attn_scores(a, g, 4); break;
        case 3: attn_scores(a, g, 3); break;
        case 2: attn_scores(a, g, 2); break;
        default: attn_scores(a, g, 1); break;
        }
    }
    int g;
    const int n = a->hi - a->lo + 1;
    if (a->softcap > 0.0f)                  /* Gemma 2: capped scores, as the reference, before the softmax */
        for (size_t j = 0; j < (size_t)group * n; j++) a->scores[j] = a->softcap * tanhf(a->scores[j] / a->softcap);
    for (g = 0; g < group; g++) softmax_row(a->scores + (size_t)g * n, n);
    if (hd == 128) {
        for (g = 0; g + 2 <= group; g += 2) attn_values(a, g, 2, 128);
        if (g < group) attn_values(a, g, 1, 128);
        return;
    }
    for (g = 0; g + 4 <= group; g += 4) attn_values(a, g, 4, 64);
    switch (group - g) {
    case 3: attn_values(a, g, 3, 64); break;
    case 2: attn_values(a, g, 2, 64); break;
    case 1: attn_values(a, g, 1, 64); break;
    default: break;
    }
}

/* ---------------------------------------------------------------- RMSNorm */

/* x += add, then x / sqrt(mean(x^2) + eps) * w (the reference's order: divide, then scale);
 * the sum of squares is accumulated in 16 float lanes. */
static void residual_rms_norm_avx512(float *out, float *x, const float *add, const float *w, int n, float eps) {
    __m512 ss = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __mmask16 mask = first_lanes(n - i);
        __m512 v = _mm512_maskz_loadu_ps(mask, x + i);
        if (add) {
            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, add + i));
            _mm512_mask_storeu_ps(x + i, mask, v);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 denom = _mm512_set1_ps(sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps));
    for (int i = 0; i < n; i += 16) {
        const __mmask16 mask = first_lanes(n - i);
        const __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(mask, x + i), denom);
        _mm512_mask_storeu_ps(out + i, mask, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, w + i)));
    }
}

/* The memory-bandwidth probe: the same 64-byte streaming loads and software prefetch as the
 * INT4 kernels, nothing else. */
static float read_sum_avx512(const uint8_t *p, size_t bytes) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < bytes; i += 256) {
        for (int line = 0; line < 256; line += 64) _mm_prefetch((const char *)p + i + line + TW_PREFETCH_BYTES, TW_PREFETCH_HINT);
        a0 = _mm512_add_epi32(a0, _mm512_load_si512(p + i));
        a1 = _mm512_add_epi32(a1, _mm512_load_si512(p + i + 64));
        a2 = _mm512_add_epi32(a2, _mm512_load_si512(p + i + 128));
        a3 = _mm512_add_epi32(a3, _mm512_load_si512(p + i + 192));
    }
    return (float)_mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)));
}

const tw_kernels tw_kernels_avx512 = {
    .isa = TW_ISA_AVX512, .name = "avx512",
    .int4 = {int4_x24_avx512, int4_q8_avx512},
    .prep = {prep_x24_avx512, prep_q8_avx512},
    .rows = rows_avx512, .rows_q8 = tw_rows_q8_avx2, .dot = dot_avx512, .axpy = axpy_avx512, .read_sum = read_sum_avx512,
    .gated = gated_avx512, .exp_sum = exp_sum_avx512, .attend = attend_avx512, .exp_blocks = tw_exp_blocks_avx2,
    .residual_rms_norm = residual_rms_norm_avx512,
};

#if defined(__clang__)
#pragma clang attribute pop
#endif

#else  /* not x86: the table exists so dispatch links; tw_isa_supported never picks it */
const tw_kernels tw_kernels_avx512 = {.isa = TW_ISA_AVX512, .name = "avx512"};
#endif
