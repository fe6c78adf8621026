/* The tiled INT4 layout (see tw.h) made from the engine format, and the per-call activation
 * preparation both precisions share. Runs once per weight at load (pack) and once per call
 * (prepare); both are plain loops, the kernels are where the time goes. */
#define _DEFAULT_SOURCE
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "tw.h"

/* Small blocks come from calloc; large ones (weights, KV cache, the bandwidth probe's buffer)
 * straight from mmap, 2 MiB aligned and marked for transparent huge pages: a weight stream
 * then crosses a page boundary every 2 MiB instead of every 4 KiB (fewer TLB walks, and the
 * hardware prefetchers stop at page boundaries). Either way the memory is zero and the OS
 * maps it lazily; tw_populate maps it now (the KV cache: see model.c). */
#define HUGE_BYTES ((size_t)2 << 20)

typedef struct {
    void *raw;
    size_t mapped;          /* 0: from calloc */
} block_header;

void *tw_alloc(size_t bytes) {
    if (bytes >= 2 * HUGE_BYTES) {
        size_t mapped = bytes + 2 * HUGE_BYTES;
        void *raw = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (raw == MAP_FAILED) return NULL;
        uintptr_t p = ((uintptr_t)raw + HUGE_BYTES + HUGE_BYTES - 1) & ~(uintptr_t)(HUGE_BYTES - 1);
#ifdef MADV_HUGEPAGE
        madvise((void *)p, bytes, MADV_HUGEPAGE);
#endif
        ((block_header *)p)[-1] = (block_header){raw, mapped};
        return (void *)p;
    }
    void *raw = calloc(1, bytes + TW_ALIGN + sizeof(block_header));
    if (!raw) return NULL;
    uintptr_t p = ((uintptr_t)raw + sizeof(block_header) + TW_ALIGN - 1) & ~(uintptr_t)(TW_ALIGN - 1);
    ((block_header *)p)[-1] = (block_header){raw, 0};
    return (void *)p;
}

/* Map every page of [p, p + bytes) now, so no step pays for its first touch. The KV cache
 * needs this: mapped lazily, each new block's first write faulted in a zeroed huge page per
 * layer, compacting memory to find one when the host's free memory is fragmented, and a lone
 * stream's decode step that crossed into fresh blocks took 14-33 ms instead of 4.5. -> 0, or
 * -1 when the memory could not be had (MADV_POPULATE_WRITE says so; touching cannot). */
int tw_populate(void *p, size_t bytes) {
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23          /* Linux 5.14; older kernels answer EINVAL: touch instead */
#endif
    if (!p || !bytes) return 0;
    const uintptr_t page = 4096, start = (uintptr_t)p & ~(page - 1);
    if (madvise((void *)start, (uintptr_t)p + bytes - start, MADV_POPULATE_WRITE) == 0) return 0;
    if (errno == ENOMEM || errno == EFAULT) return -1;
    volatile uint8_t *bytes_at = p;
    for (size_t i = 0; i < bytes; i += page) bytes_at[i] = 0;      /* zero already: a write maps it */
    return 0;
}

void tw_free(void *p) {
    if (!p) return;
    block_header h = ((block_header *)p)[-1];
    if (h.mapped) munmap(h.raw, h.mapped);
    else free(h.raw);
}

float tw_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (mant << 13);                    /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);           /* normal: rebias 15 -> 127 */
    } else {
        float f = ldexpf((float)mant, -24);                         /* subnormal or zero */
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t tw_float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, abs = x & 0x7fffffff;
    if (abs >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (abs > 0x7f800000 ? 0x200 : 0));
    if (abs >= 0x477ff000) return (uint16_t)(sign | 0x7c00);          /* rounds past 65504: inf */
    if (abs < 0x38800000) {                                            /* subnormal half */
        float a;
        memcpy(&a, &abs, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(a * 16777216.0f));
    }
    uint32_t r = abs + 0xfff + ((abs >> 13) & 1);                      /* round to nearest even */
    return (uint16_t)(sign | ((r - 0x38000000) >> 13));
}

void tw_prefetch_l2(const void *p, size_t bytes) {
#if defined(__x86_64__) || defined(__i386__)
    for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 2);
#else
    (void)p, (void)bytes;
#endif
}

/* qweight u8 [n][kp/2], scales/zeros fp16 [n][kp/G] -> w (allocates w->data). */
int tw_int4_pack(tw_int4 *w, const uint8_t *qweight, const uint16_t *scales, const uint16_t *zeros,
                 int n, int k, int kp, int group_size) {
    if (n <= 0 || k <= 0 || group_size <= 0 || group_size % 8 || kp % group_size || k > kp) return -1;
    w->n = n;
    w->k = k;
    w->kp = kp;
    w->group_size = group_size;
    w->num_groups = kp / group_size;
    w->num_tiles = (n + TW_TILE - 1) / TW_TILE;
    w->block_bytes = 64 + 8 * (size_t)group_size;
    w->data = tw_alloc((size_t)w->num_tiles * w->num_groups * w->block_bytes);
    if (!w->data) return -2;
    int ng = w->num_groups, chunks = group_size / 8;
    size_t row_bytes = (size_t)kp / 2;
    for (int t = 0; t < w->num_tiles; t++) {
        for (int g = 0; g < ng; g++) {
            uint8_t *block = w->data + ((size_t)t * ng + g) * w->block_bytes;
            uint16_t *s = (uint16_t *)block, *z = (uint16_t *)(block + 32);
            uint32_t *q = (uint32_t *)(block + 64);
            for (int r = 0; r < TW_TILE; r++) {
                int row = t * TW_TILE + r;
                if (row >= n) break;                                   /* padding rows stay zero */
                s[r] = scales[(size_t)row * ng + g];
                z[r] = zeros[(size_t)row * ng + g];
                const uint8_t *src = qweight + (size_t)row * row_bytes + (size_t)g * group_size / 2;
                for (int c = 0; c < chunks; c++) memcpy(&q[c * TW_TILE + r], src + 4 * c, 4);
            }
        }
    }
    return 0;
}

void tw_int4_free(tw_int4 *w) {
    tw_free(w->data);
    w->data = NULL;
}

/* fp32 path: x copied zero-padded to kp, plus each group's sum (the zero-point term). */
void tw_act_prepare_f32(tw_act *a, const float *x, int ldx, int k, int m0, int m1) {
    int kp = a->kp, ng = a->num_groups, gs = kp / ng;
    for (int m = m0; m < m1; m++) {
        float *dst = a->x + (size_t)m * kp;
        memcpy(dst, x + (size_t)m * ldx, (size_t)k * sizeof(float));
        memset(dst + k, 0, (size_t)(kp - k) * sizeof(float));
        for (int g = 0; g < ng; g++) {
            float s = 0.0f;
            for (int i = 0; i < gs; i++) s += dst[g * gs + i];
            a->xsum[(size_t)m * ng + g] = s;
        }
    }
}

/* The int8 activations' rounding, one definition for the INT4 products' groups and the int8
 * rows' blocks: d = max|x| / 127 over the group, q = round-to-nearest-even(x * 127 / max|x|)
 * within [-127, 127]. */
static float block_amax(const float *x, int begin, int end) {
    float amax = 0.0f;
    for (int i = begin; i < end; i++) amax = fmaxf(amax, fabsf(x[i]));
    return amax;
}

static int q8_round(float x, float inv) {
    int v = (int)lrintf(x * inv);
    return v > 127 ? 127 : (v < -127 ? -127 : v);
}

/* q8 path: per group d = max|x| / 127, xq = round(x / d), stored per 8-k chunk as
 * [k0, k0+2, k0+4, k0+6, k0+1, k0+3, k0+5, k0+7] to meet the low / high nibbles of a lane. */
void tw_act_prepare_q8(tw_act *a, const float *x, int ldx, int k, int m0, int m1) {
    int kp = a->kp, ng = a->num_groups, gs = kp / ng;
    for (int m = m0; m < m1; m++) {
        const float *src = x + (size_t)m * ldx;
        int8_t *dst = a->xq + (size_t)m * kp;
        for (int g = 0; g < ng; g++) {
            int base = g * gs, end = base + gs < k ? base + gs : k;
            float amax = block_amax(src, base, end);
            float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t total = 0;
            for (int i = 0; i < gs; i++) {
                int kk = base + i;
                int v = kk < k ? q8_round(src[kk], inv) : 0;
                int c = i / 8, j = i % 8;                    /* chunk, nibble index */
                dst[base + 8 * c + (j % 2) * 4 + j / 2] = (int8_t)v;
                total += v;
            }
            a->xd[(size_t)m * ng + g] = d;
            a->xqsum[(size_t)m * ng + g] = d * (float)total;
        }
    }
}

int tw_rows_q8_fits(int kind, int k) { return kind == TW_W_I8 && k > 0 && k % TW_ROWS_Q8_BLOCK == 0; }

/* The int8 rows' activations: blocks of 32 in natural k order, rounded as tw_act_prepare_q8. */
void tw_rows_prepare_q8(const float *x, int ldx, int k, int m0, int m1, int8_t *xq, float *xd, int ldq) {
    const int nb = k / TW_ROWS_Q8_BLOCK;
    for (int m = m0; m < m1; m++) {
        const float *src = x + (size_t)m * ldx;
        int8_t *dst = xq + (size_t)m * ldq;
        for (int b = 0; b < nb; b++) {
            const int base = b * TW_ROWS_Q8_BLOCK;
            const float amax = block_amax(src, base, base + TW_ROWS_Q8_BLOCK);
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int i = base; i < base + TW_ROWS_Q8_BLOCK; i++) dst[i] = (int8_t)q8_round(src[i], inv);
            xd[(size_t)m * (ldq / TW_ROWS_Q8_BLOCK) + b] = amax / 127.0f;
        }
    }
}
