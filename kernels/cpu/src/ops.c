/* The per-token pieces of a decoder layer besides the products: RMSNorm, RoPE, the gated
 * activation, the embedding row, and paged attention for one (token, KV head). Each mirrors
 * kernels/model.py's float32 operation order so the C forward agrees with the reference to
 * float32 accumulation order (sums are the only place the order differs). */
#include <math.h>
#include <string.h>

#include "model.h"

/* x / sqrt(mean(x^2) + eps) * w; the mean is summed in double (the reference's numpy sum is
 * pairwise float32: both are far below the float32 rounding of the result). */
void tw_rms_norm(float *out, const float *x, const float *w, int n, float eps) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float mean = (float)(ss / n);
    const float denom = sqrtf(mean + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] / denom * w[i];
}

void tw_residual_rms_norm(float *out, float *x, const float *add, const float *w, int n, float eps) {
    if (add)
        for (int i = 0; i < n; i++) x[i] += add[i];
    tw_rms_norm(out, x, w, n, eps);
}

/* cs: cos [half] then sin [half] of pos * inv_freq, angles in float64 as kernels/rope.py. */
void tw_rope_table(float *cs, int pos, const double *inv_freq, int half) {
    for (int j = 0; j < half; j++) {
        const double angle = (double)pos * inv_freq[j];
        cs[j] = (float)cos(angle);
        cs[half + j] = (float)sin(angle);
    }
}

/* Rotate-half RoPE in place on [num_heads][head_dim]: j < hd/2 pairs with j + hd/2. */
void tw_rope_apply(float *x, const float *cs, int num_heads, int head_dim) {
    const int half = head_dim / 2;
    for (int h = 0; h < num_heads; h++) {
        float *v = x + (size_t)h * head_dim;
        for (int j = 0; j < half; j++) {
            const float x1 = v[j], x2 = v[j + half], c = cs[j], s = cs[half + j];
            v[j] = x1 * c - x2 * s;
            v[j + half] = x2 * c + x1 * s;
        }
    }
}

void tw_activation_mul(float *out, const float *gate, const float *up, int n, int activation) {
    tw_active()->gated(out, gate, up, n, activation == TW_ACT_GELU_TANH);
}

/* Row `row` of W as float32, as kernels/reference.py decodes it: (q - z) * s, q * s, or the value. */
void tw_weight_row(const tw_weight *w, int row, float *out) {
    if (w->kind == TW_W_F32) {
        memcpy(out, (const float *)w->data + (size_t)row * w->k, (size_t)w->k * sizeof(float));
    } else if (w->kind == TW_W_F16) {
        const uint16_t *src = (const uint16_t *)w->data + (size_t)row * w->k;
        for (int k = 0; k < w->k; k++) out[k] = tw_half_to_float(src[k]);
    } else if (w->kind == TW_W_I8) {
        const int8_t *src = (const int8_t *)w->data + (size_t)row * w->k;
        const float s = tw_half_to_float(w->row_scales[row]);
        for (int k = 0; k < w->k; k++) out[k] = (float)src[k] * s;
    } else {
        const tw_int4 *q = &w->i4;
        const int t = row / TW_TILE, r = row % TW_TILE, gs = q->group_size;
        for (int g = 0; g < q->num_groups; g++) {
            const uint8_t *block = q->data + ((size_t)t * q->num_groups + g) * q->block_bytes;
            const float s = tw_half_to_float(((const uint16_t *)block)[r]);
            const float z = tw_half_to_float(((const uint16_t *)(block + 32))[r]);
            const uint32_t *chunks = (const uint32_t *)(block + 64);
            for (int c = 0; c < gs / 8; c++)
                for (int j = 0; j < 8; j++) {
                    const int k = g * gs + 8 * c + j;
                    if (k < q->k) out[k] = ((float)((chunks[c * TW_TILE + r] >> (4 * j)) & 15) - z) * s;
                }
        }
    }
}

/* The readable attention (scalar and AVX2 tables): the same float32 order as the reference,
 * scores, max, e = exp(s - max), p = e / sum(e), out = sum_j p_j v_j. */
void tw_attend_generic(const tw_attn_args *a) {
    const tw_kernels *kern = tw_active();
    const int hd = a->head_dim, bs = a->block_size, n = a->hi - a->lo + 1;
    for (int g = 0; g < a->group; g++) {
        const float *q = a->q + (size_t)g * hd;
        float *scores = a->scores + (size_t)g * n, *o = a->out + (size_t)g * hd;
        float max = -INFINITY;
        for (int j = a->lo; j <= a->hi; j++) {
            const float *kt = a->kt + (size_t)a->table[j / bs] * a->kt_block + j % bs;
            float dot = 0.0f;
            for (int d = 0; d < hd; d++) dot += q[d] * kt[(size_t)d * bs];
            float s = dot * a->scale;
            if (a->softcap > 0.0f) s = a->softcap * tanhf(s / a->softcap);
            scores[j - a->lo] = s;
            max = s > max ? s : max;
        }
        const float sum = kern->exp_sum(scores, n, max);
        memset(o, 0, (size_t)hd * sizeof(float));
        for (int j = a->lo; j <= a->hi; j++) {
            const float *v = a->v + (size_t)a->table[j / bs] * a->v_block + (size_t)(j % bs) * a->v_row;
            kern->axpy(o, scores[j - a->lo] / sum, v, hd);
        }
    }
}

static void add(float *x, const float *bias, int n) {
    for (int i = 0; i < n; i++) x[i] += bias[i];
}

/* Ask for an item's cached keys and values (the sequence's context, within the sliding
 * window) towards L2 ahead of tw_attention_item: the weight stream has evicted them since the
 * last step, and the item would miss on them block by block (~4 of a batch-1 layer's 25 us
 * outside the products, for a 0.5B model at 70 tokens). */
void tw_attention_prefetch(const tw_model *m, int layer, const tw_batch *b, int seq, int kv_head) {
    const int hd = m->head_dim, bs = m->block_size, kv_size = m->num_kv_heads * hd;
    const size_t per_layer = (size_t)m->num_blocks * bs * kv_size;
    const float *kt = m->k_cache + layer * per_layer + (size_t)kv_head * hd * bs;
    const float *v = m->v_cache + layer * per_layer + (size_t)kv_head * bs * hd;
    const int ctx = b->context_lens[seq], first_pos = b->positions[b->seq_starts[seq]], window = m->layers[layer].window;
    const int lo = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
    const int32_t *table = b->block_tables + (size_t)seq * b->max_blocks;
    for (int bi = lo / bs; bi * bs < ctx; bi++) {
        const int j0 = bi * bs > lo ? bi * bs : lo, j1 = (bi + 1) * bs < ctx ? (bi + 1) * bs : ctx;
        tw_prefetch_l2(kt + (size_t)table[bi] * kv_size * bs, (size_t)hd * bs * sizeof(float));
        tw_prefetch_l2(v + (size_t)table[bi] * kv_size * bs + (size_t)(j0 - bi * bs) * hd, (size_t)(j1 - j0) * hd * sizeof(float));
    }
}

/* One token's slice of one KV head: bias and RoPE on the group's query heads and on the key
 * head, and its K/V into the cache (rope: the token's [hd] table). */
static void prepare_head(const tw_model *m, int layer, const tw_batch *b, int t, int kv_head, const float *rope) {
    const int hd = m->head_dim, group = m->num_heads / m->num_kv_heads, bs = m->block_size, hkv = m->num_kv_heads;
    const int q_size = m->num_heads * hd, kv_size = hkv * hd, row = q_size + 2 * kv_size;
    const int q0 = kv_head * group * hd, k0 = q_size + kv_head * hd, v0 = q_size + kv_size + kv_head * hd;
    const size_t per_layer = (size_t)m->num_blocks * bs * kv_size;
    float *kt = m->k_cache + layer * per_layer + (size_t)kv_head * hd * bs;    /* block stride kv_size * bs */
    float *v = m->v_cache + layer * per_layer + (size_t)kv_head * bs * hd;     /* block stride kv_size * bs */
    const tw_layer *L = &m->layers[layer];
    const float *bias = L->qkv_bias;
    float *r = m->qkv + (size_t)t * row;
    if (bias) {
        add(r + q0, bias + q0, group * hd);
        add(r + k0, bias + k0, hd);
        add(r + v0, bias + v0, hd);
    }
    if (L->q_norm) {                        /* per head, over hd, before RoPE */
        for (int g = 0; g < group; g++) tw_rms_norm(r + q0 + g * hd, r + q0 + g * hd, L->q_norm, hd, m->eps);
        tw_rms_norm(r + k0, r + k0, L->k_norm, hd, m->eps);
    }
    tw_rope_apply(r + q0, rope, group, hd);
    tw_rope_apply(r + k0, rope, 1, hd);
    const int slot = b->slot_mapping[t];
    float *kblock = kt + (size_t)(slot / bs) * kv_size * bs + slot % bs;
    for (int d = 0; d < hd; d++) kblock[(size_t)d * bs] = r[k0 + d];
    memcpy(v + (size_t)(slot / bs) * kv_size * bs + (size_t)(slot % bs) * hd, r + v0, (size_t)hd * sizeof(float));
}

/* One token's attention over its context for the group's query heads of one KV head, into
 * attention row out_row[t] (t without out_row; none when out_row[t] < 0). */
void tw_attention_token(const tw_model *m, int layer, const tw_batch *b, int t, int kv_head, float *scores,
                        const int32_t *out_row) {
    const int pos = b->positions[t], out = out_row ? out_row[t] : t;
    if (out < 0) return;
    const int hd = m->head_dim, group = m->num_heads / m->num_kv_heads, bs = m->block_size, hkv = m->num_kv_heads;
    const int q_size = m->num_heads * hd, kv_size = hkv * hd, row = q_size + 2 * kv_size, q0 = kv_head * group * hd;
    const size_t per_layer = (size_t)m->num_blocks * bs * kv_size;
    const tw_layer *L = &m->layers[layer];
    const tw_attn_args args = {
        .q = m->qkv + (size_t)t * row + q0, .out = m->attn + (size_t)out * q_size + q0,
        .kt = m->k_cache + layer * per_layer + (size_t)kv_head * hd * bs,
        .v = m->v_cache + layer * per_layer + (size_t)kv_head * bs * hd,
        .kt_block = (size_t)kv_size * bs, .v_block = (size_t)kv_size * bs, .v_row = (size_t)hd,
        .table = b->block_tables + (size_t)b->token_seq[t] * b->max_blocks, .block_size = bs,
        .lo = L->window > 0 && pos - L->window + 1 > 0 ? pos - L->window + 1 : 0,
        .hi = pos, .group = group, .head_dim = hd, .scale = m->attn_scale, .softcap = m->attn_softcap,
        .scores = scores,
    };
    tw_active()->attend(&args);
}

/* Everything one sequence's tokens need from one KV head, self-contained so items run in
 * parallel with no barrier (a decode step's: one token per sequence): prepare_head for each
 * token, then attention for each token (a later token of a prefill chunk sees the earlier
 * ones, written just before). rope: [T][hd] tables. */
void tw_attention_item(const tw_model *m, int layer, const tw_batch *b, int seq, int kv_head, const float *rope,
                       float *scores, const int32_t *out_row) {
    const int hd = m->head_dim, group = m->num_heads / m->num_kv_heads, hkv = m->num_kv_heads;
    const int q_size = m->num_heads * hd, kv_size = hkv * hd, row = q_size + 2 * kv_size;
    const int q0 = kv_head * group * hd, k0 = q_size + kv_head * hd, v0 = q_size + kv_size + kv_head * hd;
    for (int t = b->seq_starts[seq]; t < b->seq_starts[seq + 1]; t++) {
        /* this item's slice of the qkv row was written by whichever core computed its tiles:
         * ask for all of its lines at once rather than missing on them one by one */
        const float *r = m->qkv + (size_t)t * row;
        tw_prefetch_l2(r + q0, (size_t)group * hd * sizeof(float));
        tw_prefetch_l2(r + k0, (size_t)hd * sizeof(float));
        tw_prefetch_l2(r + v0, (size_t)hd * sizeof(float));
    }
    for (int t = b->seq_starts[seq]; t < b->seq_starts[seq + 1]; t++)
        prepare_head(m, layer, b, t, kv_head, rope + (size_t)t * hd);
    for (int t = b->seq_starts[seq]; t < b->seq_starts[seq + 1]; t++)
        tw_attention_token(m, layer, b, t, kv_head, scores, out_row);
}

/* A prefill's attention in two passes, for even shares (a sequence's (sequence, KV head)
 * items are as few as its KV heads, 3 for a lone prompt on 2 threads, and a token's cost
 * grows with its position). Tokens [t0, t1) of every KV head: bias, RoPE and K/V into the
 * cache; then, once every thread's are in (a barrier), tw_attention_token per (token, KV
 * head) item (above). */
void tw_attention_prepare(const tw_model *m, int layer, const tw_batch *b, int t0, int t1, const float *rope) {
    for (int t = t0; t < t1; t++)
        for (int h = 0; h < m->num_kv_heads; h++) prepare_head(m, layer, b, t, h, rope + (size_t)t * m->head_dim);
}
