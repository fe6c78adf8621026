/* The per-token pieces of a decoder layer besides the products: RMSNorm, RoPE, the gated
 * activation, the embedding row, and paged attention for one (token, KV head). Each mirrors
 * core/model.py's float32 operation order so the C forward agrees with the reference to
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

/* cs: cos [half] then sin [half] of pos * inv_freq, angles in float64 as core/rope.py. */
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

static float *cache_row(const tw_model *m, float *cache, int layer, int slot, int kv_head) {
    const size_t per_slot = (size_t)m->num_kv_heads * m->head_dim;
    const size_t per_layer = (size_t)m->num_blocks * m->block_size * per_slot;
    return cache + layer * per_layer + (size_t)slot * per_slot + (size_t)kv_head * m->head_dim;
}

static void add(float *x, const float *bias, int n) {
    for (int i = 0; i < n; i++) x[i] += bias[i];
}

/* Everything one sequence's tokens need from one KV head, self-contained so items run in
 * parallel with no barrier: bias and RoPE on the group's query heads and on the key head,
 * this step's K/V into the cache, then attention for each token (a later token of a
 * prefill chunk sees the earlier ones, written just before). rope: [T][hd] tables. */
void tw_attention_item(const tw_model *m, int layer, const tw_batch *b, int seq, int kv_head, const float *rope,
                       float *scores) {
    const int hd = m->head_dim, group = m->num_heads / m->num_kv_heads;
    const int q_size = m->num_heads * hd, kv_size = m->num_kv_heads * hd, row = q_size + 2 * kv_size;
    const int q0 = kv_head * group * hd, k0 = q_size + kv_head * hd, v0 = q_size + kv_size + kv_head * hd;
    const float *bias = m->layers[layer].qkv_bias;
    for (int t = b->seq_starts[seq]; t < b->seq_starts[seq + 1]; t++) {
        float *r = m->qkv + (size_t)t * row;
        if (bias) {
            add(r + q0, bias + q0, group * hd);
            add(r + k0, bias + k0, hd);
            add(r + v0, bias + v0, hd);
        }
        tw_rope_apply(r + q0, rope + (size_t)t * hd, group, hd);
        tw_rope_apply(r + k0, rope + (size_t)t * hd, 1, hd);
        memcpy(cache_row(m, m->k_cache, layer, b->slot_mapping[t], kv_head), r + k0, (size_t)hd * sizeof(float));
        memcpy(cache_row(m, m->v_cache, layer, b->slot_mapping[t], kv_head), r + v0, (size_t)hd * sizeof(float));
    }
    for (int t = b->seq_starts[seq]; t < b->seq_starts[seq + 1]; t++) tw_attend(m, layer, b, t, kv_head, scores, m->attn);
}

/* Token t's query heads of one KV head against its sequence's cached keys [lo, pos]:
 * softmax(q.k * scale) @ v into out[t][heads of the group]. scores: [context] scratch. */
void tw_attend(const tw_model *m, int layer, const tw_batch *b, int t, int kv_head, float *scores, float *out) {
    const tw_kernels *kern = tw_active();
    const int hd = m->head_dim, group = m->num_heads / m->num_kv_heads, bs = m->block_size;
    const int s = b->token_seq[t], pos = b->positions[t];
    const int lo = m->sliding_window > 0 && pos - m->sliding_window + 1 > 0 ? pos - m->sliding_window + 1 : 0;
    const int32_t *table = b->block_tables + (size_t)s * b->max_blocks;
    const int q_row = m->num_heads * hd + 2 * m->num_kv_heads * hd;
    for (int g = 0; g < group; g++) {
        const int head = kv_head * group + g;
        const float *q = m->qkv + (size_t)t * q_row + (size_t)head * hd;
        float *o = out + (size_t)t * m->num_heads * hd + (size_t)head * hd;
        float max = -INFINITY;
        for (int j = lo; j <= pos; j++) {
            const int slot = table[j / bs] * bs + j % bs;
            const float sc = kern->dot(q, cache_row(m, m->k_cache, layer, slot, kv_head), hd) * m->attn_scale;
            scores[j - lo] = sc;
            max = sc > max ? sc : max;
        }
        const float sum = kern->exp_sum(scores, pos - lo + 1, max);
        memset(o, 0, (size_t)hd * sizeof(float));
        for (int j = lo; j <= pos; j++) {
            const int slot = table[j / bs] * bs + j % bs;
            kern->axpy(o, scores[j - lo] / sum, cache_row(m, m->v_cache, layer, slot, kv_head), hd);
        }
    }
}
