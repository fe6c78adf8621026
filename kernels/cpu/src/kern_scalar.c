/* Portable kernels: the fallback on any CPU, and the readable statement of what the SIMD
 * versions compute over the tiled layout (tw.h). Same arithmetic as theirs, so results match
 * to float32 accumulation order:
 *   fp32:  y[n] = sum_g s[n,g] * (sum_{k in g} q[n,k] x[k]  -  z[n,g] * sum_{k in g} x[k])
 *   q8:    y[n] = sum_g s[n,g] * (d_g * sum_{k in g} q[n,k] xq[k]  -  z[n,g] * d_g * sum xq)
 */
#include <math.h>
#include <string.h>

#include "tw.h"

static void load_qparams(const uint8_t *block, float *s, float *z) {
    const uint16_t *hs = (const uint16_t *)block, *hz = (const uint16_t *)(block + 32);
    for (int r = 0; r < TW_TILE; r++) {
        s[r] = tw_half_to_float(hs[r]);
        z[r] = tw_half_to_float(hz[r]);
    }
}

static void store_tile(float *y, const float *acc, int rows) {
    memcpy(y, acc, (size_t)rows * sizeof(float));
}

static void int4_f32_scalar(const tw_int4 *w, const tw_act *a, float *y, int ldy, int t0, int t1) {
    int ng = w->num_groups, gs = w->group_size, chunks = gs / 8;
    for (int t = t0; t < t1; t++) {
        int rows = w->n - t * TW_TILE < TW_TILE ? w->n - t * TW_TILE : TW_TILE;
        for (int m = 0; m < a->m; m++) {
            float acc[TW_TILE] = {0}, s[TW_TILE], z[TW_TILE];
            for (int g = 0; g < ng; g++) {
                const uint8_t *block = w->data + ((size_t)t * ng + g) * w->block_bytes;
                const uint32_t *q = (const uint32_t *)(block + 64);
                const float *x = a->x + (size_t)m * a->kp + (size_t)g * gs;
                load_qparams(block, s, z);
                for (int r = 0; r < TW_TILE; r++) {
                    float part = 0.0f;
                    for (int c = 0; c < chunks; c++)
                        for (int j = 0; j < 8; j++) part += (float)((q[c * TW_TILE + r] >> (4 * j)) & 15) * x[8 * c + j];
                    acc[r] += s[r] * (part - z[r] * a->xsum[(size_t)m * ng + g]);
                }
            }
            store_tile(y + (size_t)m * ldy + t * TW_TILE, acc, rows);
        }
    }
}

static void int4_q8_scalar(const tw_int4 *w, const tw_act *a, float *y, int ldy, int t0, int t1) {
    int ng = w->num_groups, gs = w->group_size, chunks = gs / 8;
    for (int t = t0; t < t1; t++) {
        int rows = w->n - t * TW_TILE < TW_TILE ? w->n - t * TW_TILE : TW_TILE;
        for (int m = 0; m < a->m; m++) {
            float acc[TW_TILE] = {0}, s[TW_TILE], z[TW_TILE];
            for (int g = 0; g < ng; g++) {
                const uint8_t *block = w->data + ((size_t)t * ng + g) * w->block_bytes;
                const uint32_t *q = (const uint32_t *)(block + 64);
                const int8_t *xq = a->xq + (size_t)m * a->kp + (size_t)g * gs;
                float d = a->xd[(size_t)m * ng + g], dsum = a->xqsum[(size_t)m * ng + g];
                load_qparams(block, s, z);
                for (int r = 0; r < TW_TILE; r++) {
                    int32_t part = 0;
                    for (int c = 0; c < chunks; c++) {
                        uint32_t v = q[c * TW_TILE + r];
                        for (int b = 0; b < 4; b++) {           /* byte b: k0+2b (low), k0+2b+1 (high) */
                            part += (int32_t)((v >> (8 * b)) & 15) * xq[8 * c + b];
                            part += (int32_t)((v >> (8 * b + 4)) & 15) * xq[8 * c + 4 + b];
                        }
                    }
                    acc[r] += s[r] * ((float)part * d - z[r] * dsum);
                }
            }
            store_tile(y + (size_t)m * ldy + t * TW_TILE, acc, rows);
        }
    }
}

static float weight_at(const void *w, const uint16_t *row_scales, int kind, size_t row, size_t idx) {
    switch (kind) {
    case TW_W_F32: return ((const float *)w)[idx];
    case TW_W_F16: return tw_half_to_float(((const uint16_t *)w)[idx]);
    default: return (float)((const int8_t *)w)[idx] * tw_half_to_float(row_scales[row]);
    }
}

static void rows_scalar(const void *w, const uint16_t *row_scales, int kind, int k,
                        const float *x, int ldx, int m, float *y, int ldy, int n0, int n1) {
    for (int n = n0; n < n1; n++)
        for (int i = 0; i < m; i++) {
            float acc = 0.0f;
            for (int kk = 0; kk < k; kk++) acc += weight_at(w, row_scales, kind, n, (size_t)n * k + kk) * x[(size_t)i * ldx + kk];
            y[(size_t)i * ldy + n] = acc;
        }
}

/* The q8 rows' statement: exact int32 block sums, each scaled by its activation step. */
static void rows_q8_scalar(const int8_t *w, const uint16_t *row_scales, int k, const int8_t *xq, const float *xd,
                           int ldq, int m, float *y, int ldy, int n0, int n1) {
    const int nb = k / TW_ROWS_Q8_BLOCK;
    for (int n = n0; n < n1; n++)
        for (int i = 0; i < m; i++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                int32_t sum = 0;
                for (int kk = b * TW_ROWS_Q8_BLOCK; kk < (b + 1) * TW_ROWS_Q8_BLOCK; kk++)
                    sum += (int32_t)w[(size_t)n * k + kk] * xq[(size_t)i * ldq + kk];
                acc += xd[(size_t)i * (ldq / TW_ROWS_Q8_BLOCK) + b] * (float)sum;
            }
            y[(size_t)i * ldy + n] = acc * tw_half_to_float(row_scales[n]);
        }
}

static float dot_scalar(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void axpy_scalar(float *y, float alpha, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += alpha * x[i];
}

static float read_sum_scalar(const uint8_t *p, size_t bytes) {
    const uint64_t *w = (const uint64_t *)p;
    uint64_t acc[4] = {0};
    for (size_t i = 0; i < bytes / 8; i += 4)
        for (int u = 0; u < 4; u++) acc[u] += w[i + u];
    return (float)(acc[0] ^ acc[1] ^ acc[2] ^ acc[3]);
}

static void gated_scalar(float *out, const float *gate, const float *up, int n, int gelu) {
    const float k0 = (float)0.7978845608028654, k1 = 0.044715f;
    for (int i = 0; i < n; i++) {
        const float x = gate[i];
        out[i] = (gelu ? 0.5f * x * (1.0f + tanhf(k0 * (x + k1 * x * x * x))) : x / (1.0f + expf(-x))) * up[i];
    }
}

static float exp_sum_scalar(float *x, int n, float sub) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += x[i] = expf(x[i] - sub);
    return sum;
}

/* The statement of exp_blocks: libm's exp of the reference's arguments. */
static void exp_blocks_scalar(const float *l, int v, double t, double *e, double *sums, int block) {
    float top = l[0];
    for (int i = 1; i < v; i++) top = l[i] > top ? l[i] : top;
    const double m = (double)top / t;
    for (int b = 0; b * block < v; b++) {
        double sum = 0.0;
        for (int i = b * block; i < v && i < (b + 1) * block; i++) {
            const double x = (double)l[i] / t - m;
            e[i] = x < -708.0 ? 0.0 : exp(x);
            sum += e[i];
        }
        sums[b] = sum;
    }
}

const tw_kernels tw_kernels_scalar = {
    .isa = TW_ISA_SCALAR, .name = "scalar",
    .int4 = {int4_f32_scalar, int4_q8_scalar},
    .prep = {tw_act_prepare_f32, tw_act_prepare_q8},
    .rows = rows_scalar, .rows_q8 = rows_q8_scalar, .dot = dot_scalar, .axpy = axpy_scalar, .read_sum = read_sum_scalar,
    .gated = gated_scalar, .exp_sum = exp_sum_scalar, .attend = tw_attend_generic, .exp_blocks = exp_blocks_scalar,
    .residual_rms_norm = tw_residual_rms_norm,
};
