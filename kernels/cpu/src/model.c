/* The C forward's lifecycle (init / reserve / free), batch validation, and the step itself.
 *
 * A step is one pool task: every thread walks the same sequence of stages and takes its
 * share of each (token rows, attention (token, KV head) items, or output tiles of a
 * product); a barrier separates stages that read what the previous one wrote. No
 * allocation, no Python, no GIL inside the step. The stage list mirrors
 * ReferenceModel.forward line by line. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model.h"

/* ------------------------------------------------------------------ lifecycle */

static size_t q_row(const tw_model *m) { return (size_t)(m->num_heads + 2 * m->num_kv_heads) * m->head_dim; }

int tw_model_init(tw_model *m) {
    const size_t per_cache = (size_t)m->num_layers * m->num_blocks * m->block_size * m->num_kv_heads * m->head_dim;
    m->k_cache = tw_alloc(per_cache * sizeof(float));
    m->v_cache = tw_alloc(per_cache * sizeof(float));
    m->attn_scale = (float)pow((double)m->head_dim, -0.5);         /* np.float32(head_dim ** -0.5) */
    return m->k_cache && m->v_cache ? 0 : -1;
}

static void free_scratch(tw_model *m) {
    float **bufs[] = {&m->x, &m->h, &m->qkv, &m->attn, &m->tmp, &m->gate_up, &m->mlp, &m->rope, &m->scores};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) {
        tw_free(*bufs[i]);
        *bufs[i] = NULL;
    }
    tw_act_free(&m->act);
    m->cap_tokens = m->cap_ctx = m->cap_threads = 0;
}

static void free_weight(tw_weight *w) {
    if (w->kind == TW_W_I4) tw_int4_free(&w->i4);
    w->kind = -1;
}

void tw_model_free(tw_model *m) {
    free_scratch(m);
    for (int l = 0; m->layers && l < m->num_layers; l++) {
        tw_layer *L = &m->layers[l];
        tw_free(L->attn_norm);
        tw_free(L->qkv_bias);
        tw_free(L->mlp_norm);
        free_weight(&L->qkv);
        free_weight(&L->o);
        free_weight(&L->gate_up);
        free_weight(&L->down);
    }
    tw_free(m->layers);
    free_weight(&m->embed);
    free_weight(&m->lm_head);
    tw_free(m->norm);
    tw_free(m->inv_freq);
    tw_free(m->k_cache);
    tw_free(m->v_cache);
    m->layers = NULL;
    m->norm = m->k_cache = m->v_cache = NULL;
    m->inv_freq = NULL;
}

const char *tw_model_missing(const tw_model *m) {
    static char what[96];
    if (m->embed.kind < 0) return "embed";
    if (!m->norm) return "norm";
    for (int l = 0; l < m->num_layers; l++) {
        const tw_layer *L = &m->layers[l];
        const char *name = !L->attn_norm ? "attn_norm" : !L->mlp_norm ? "mlp_norm" : L->qkv.kind < 0 ? "qkv_proj"
                         : L->o.kind < 0 ? "o_proj" : L->gate_up.kind < 0 ? "gate_up_proj" : L->down.kind < 0 ? "down_proj" : NULL;
        if (name) {
            snprintf(what, sizeof what, "layers.%d.%s", l, name);
            return what;
        }
    }
    return NULL;
}

size_t tw_weight_bytes(const tw_weight *w) {
    switch (w->kind) {
    case TW_W_I4: return (size_t)w->i4.num_tiles * w->i4.num_groups * w->i4.block_bytes;
    case TW_W_F32: return (size_t)w->n * w->k * 4;
    case TW_W_F16: return (size_t)w->n * w->k * 2;
    case TW_W_I8: return (size_t)w->n * w->k + (size_t)w->n * 2;
    default: return 0;
    }
}

/* ------------------------------------------------------------------ batch checks */

/* Every index the step will follow is checked here, so a bad batch is an error message,
 * never a write outside the cache. Also fills token_seq. */
const char *tw_batch_check(const tw_model *m, const tw_batch *b) {
    static __thread char msg[160];
    const int T = b->num_tokens, S = b->num_seqs, bs = m->block_size;
    if (b->seq_starts[0] != 0 || b->seq_starts[S] != T) return "seq_starts must begin at 0 and end at the token count";
    for (int s = 0; s < S; s++) {
        const int a = b->seq_starts[s], e = b->seq_starts[s + 1], ctx = b->context_lens[s];
        if (e < a) return "seq_starts must not decrease";
        if (ctx < 0 || (ctx + bs - 1) / bs > b->max_blocks) return "a block table is shorter than its sequence's context";
        for (int i = 0; i < (ctx + bs - 1) / bs; i++) {
            const int blk = b->block_tables[(size_t)s * b->max_blocks + i];
            if (blk < 0 || blk >= m->num_blocks) {
                snprintf(msg, sizeof msg, "block id %d out of range: the cache has %d blocks", blk, m->num_blocks);
                return msg;
            }
        }
        for (int t = a; t < e; t++) {
            if (b->positions[t] < 0 || b->positions[t] >= ctx) return "a token's position is outside its sequence's context";
            b->token_seq[t] = s;
        }
    }
    for (int t = 0; t < T; t++) {
        if (b->token_ids[t] < 0 || b->token_ids[t] >= m->vocab) {
            snprintf(msg, sizeof msg, "token id %d out of range [0, %d)", b->token_ids[t], m->vocab);
            return msg;
        }
        if (b->slot_mapping[t] < 0 || b->slot_mapping[t] >= m->num_blocks * bs) {
            snprintf(msg, sizeof msg, "KV slot out of range: the cache has %d blocks of %d", m->num_blocks, bs);
            return msg;
        }
    }
    for (int i = 0; i < b->num_logits; i++)
        if (b->logits_indices[i] < 0 || b->logits_indices[i] >= T) return "a logits index is outside the batch's tokens";
    return NULL;
}

/* ------------------------------------------------------------------ scratch */

static int grow(float **p, size_t count) {
    tw_free(*p);
    *p = tw_alloc(count * sizeof(float));
    return *p ? 0 : -1;
}

static int widest_k(const tw_model *m, int *max_kp, int *max_groups) {
    const tw_weight *all[4];
    *max_kp = 8;
    *max_groups = 1;
    for (int l = 0; l < m->num_layers; l++) {
        const tw_layer *L = &m->layers[l];
        all[0] = &L->qkv, all[1] = &L->o, all[2] = &L->gate_up, all[3] = &L->down;
        for (int i = 0; i < 4; i++)
            if (all[i]->kind == TW_W_I4) {
                *max_kp = all[i]->i4.kp > *max_kp ? all[i]->i4.kp : *max_kp;
                *max_groups = all[i]->i4.num_groups > *max_groups ? all[i]->i4.num_groups : *max_groups;
            }
    }
    const tw_weight *head = m->lm_head.kind >= 0 ? &m->lm_head : &m->embed;
    if (head->kind == TW_W_I4) {
        *max_kp = head->i4.kp > *max_kp ? head->i4.kp : *max_kp;
        *max_groups = head->i4.num_groups > *max_groups ? head->i4.num_groups : *max_groups;
    }
    return 0;
}

int tw_model_reserve(tw_model *m, const tw_batch *b, int num_threads) {
    int max_ctx = 1;
    for (int s = 0; s < b->num_seqs; s++) max_ctx = b->context_lens[s] > max_ctx ? b->context_lens[s] : max_ctx;
    if (max_ctx > m->cap_ctx || num_threads > m->cap_threads) {
        const int ctx = max_ctx > m->cap_ctx ? max_ctx : m->cap_ctx, th = num_threads > m->cap_threads ? num_threads : m->cap_threads;
        if (grow(&m->scores, (size_t)ctx * th)) return -1;
        m->cap_ctx = ctx;
        m->cap_threads = th;
    }
    const int T = b->num_tokens > 0 ? b->num_tokens : 1;
    if (T <= m->cap_tokens) return 0;
    const size_t D = m->dim, I = m->hidden, q = (size_t)m->num_heads * m->head_dim;
    int max_kp, max_groups;
    widest_k(m, &max_kp, &max_groups);
    tw_act_free(&m->act);
    if (grow(&m->x, T * D) || grow(&m->h, T * (D > q ? D : q)) || grow(&m->qkv, T * q_row(m)) || grow(&m->attn, T * q) ||
        grow(&m->tmp, T * D) || grow(&m->gate_up, T * 2 * I) || grow(&m->mlp, T * I) ||
        grow(&m->rope, (size_t)T * m->head_dim) || tw_act_init(&m->act, T, max_kp, max_groups)) {
        free_scratch(m);
        return -1;
    }
    m->cap_tokens = T;
    return 0;
}

/* ------------------------------------------------------------------ the step */

typedef struct {
    tw_model *m;
    tw_batch *b;
} step_job;

/* y [rows][w->n] = x [rows][w->k] @ W^T, thread ith's share (ends with every thread's tiles done
 * only after the caller's next barrier). */
static void product(const tw_model *m, const tw_weight *w, const float *x, int ldx, int rows,
                    float *y, int ith, int nth) {
    if (w->kind == TW_W_I4) tw_int4_linear_part(&w->i4, &m->act, x, ldx, rows, y, w->n, m->prec, ith, nth);
    else tw_rows_linear_part(w->data, w->row_scales, w->kind, w->n, w->k, x, ldx, rows, y, w->n, ith, nth);
}

static void embed_rows(tw_model *m, const tw_batch *b, int t0, int t1) {
    for (int t = t0; t < t1; t++) {
        float *x = m->x + (size_t)t * m->dim;
        tw_weight_row(&m->embed, b->token_ids[t], x);
        for (int i = 0; i < m->dim; i++) x[i] *= m->embed_mult;
        tw_rope_table(m->rope + (size_t)t * m->head_dim, b->positions[t], m->inv_freq, m->head_dim / 2);
    }
}

/* bias, RoPE on q and k, then k and v into the cache slot of each token */
static void rope_and_cache(tw_model *m, int layer, const tw_batch *b, int t0, int t1) {
    const int hd = m->head_dim, q = m->num_heads * hd, kv = m->num_kv_heads * hd;
    const size_t per_layer = (size_t)m->num_blocks * m->block_size * kv;
    const float *bias = m->layers[layer].qkv_bias;
    for (int t = t0; t < t1; t++) {
        float *row = m->qkv + (size_t)t * q_row(m);
        if (bias)
            for (int i = 0; i < q + 2 * kv; i++) row[i] += bias[i];
        const float *cs = m->rope + (size_t)t * hd;
        tw_rope_apply(row, cs, m->num_heads, hd);
        tw_rope_apply(row + q, cs, m->num_kv_heads, hd);
        const size_t slot = (size_t)b->slot_mapping[t];
        memcpy(m->k_cache + layer * per_layer + slot * kv, row + q, (size_t)kv * sizeof(float));
        memcpy(m->v_cache + layer * per_layer + slot * kv, row + q + kv, (size_t)kv * sizeof(float));
    }
}

static void attention(tw_model *m, int layer, const tw_batch *b, int ith, int nth) {
    int i0, i1;
    tw_split(b->num_tokens * m->num_kv_heads, ith, nth, &i0, &i1);
    float *scores = m->scores + (size_t)ith * m->cap_ctx;
    for (int i = i0; i < i1; i++) tw_attend(m, layer, b, i / m->num_kv_heads, i % m->num_kv_heads, scores, m->attn);
}

static void residual_norm(tw_model *m, const float *norm, int t0, int t1, int add) {
    for (int t = t0; t < t1; t++) {
        float *x = m->x + (size_t)t * m->dim;
        if (add)
            for (int i = 0; i < m->dim; i++) x[i] += m->tmp[(size_t)t * m->dim + i];
        tw_rms_norm(m->h + (size_t)t * m->dim, x, norm, m->dim, m->eps);
    }
}

static void mlp_rows(tw_model *m, int t0, int t1) {
    const size_t I = m->hidden;
    for (int t = t0; t < t1; t++)
        tw_activation_mul(m->mlp + t * I, m->gate_up + t * 2 * I, m->gate_up + t * 2 * I + I, (int)I, m->activation);
}

static void final_rows(tw_model *m, const tw_batch *b, int r0, int r1) {
    for (int r = r0; r < r1; r++) {
        const float *x = m->x + (size_t)b->logits_indices[r] * m->dim;
        tw_rms_norm(m->h + (size_t)r * m->dim, x, m->norm, m->dim, m->eps);
    }
}

static void step_task(void *arg, int ith, int nth) {
    step_job *job = arg;
    tw_model *m = job->m;
    tw_batch *b = job->b;
    const int T = b->num_tokens;
    int t0, t1;
    tw_split(T, ith, nth, &t0, &t1);
    embed_rows(m, b, t0, t1);
    for (int l = 0; l < m->num_layers; l++) {
        const tw_layer *L = &m->layers[l];
        tw_pool_barrier(ith, nth);
        residual_norm(m, L->attn_norm, t0, t1, l > 0);     /* x += down output of layer l-1 */
        tw_pool_barrier(ith, nth);
        product(m, &L->qkv, m->h, m->dim, T, m->qkv, ith, nth);
        tw_pool_barrier(ith, nth);
        rope_and_cache(m, l, b, t0, t1);
        tw_pool_barrier(ith, nth);
        attention(m, l, b, ith, nth);
        tw_pool_barrier(ith, nth);
        product(m, &L->o, m->attn, m->num_heads * m->head_dim, T, m->tmp, ith, nth);
        tw_pool_barrier(ith, nth);
        residual_norm(m, L->mlp_norm, t0, t1, 1);
        tw_pool_barrier(ith, nth);
        product(m, &L->gate_up, m->h, m->dim, T, m->gate_up, ith, nth);
        tw_pool_barrier(ith, nth);
        mlp_rows(m, t0, t1);
        tw_pool_barrier(ith, nth);
        product(m, &L->down, m->mlp, m->hidden, T, m->tmp, ith, nth);
    }
    tw_pool_barrier(ith, nth);
    for (int t = t0; t < t1; t++)
        for (int i = 0; i < m->dim; i++) m->x[(size_t)t * m->dim + i] += m->tmp[(size_t)t * m->dim + i];
    tw_pool_barrier(ith, nth);
    int r0, r1;
    tw_split(b->num_logits, ith, nth, &r0, &r1);
    final_rows(m, b, r0, r1);
    tw_pool_barrier(ith, nth);
    const tw_weight *head = m->lm_head.kind >= 0 ? &m->lm_head : &m->embed;
    if (b->num_logits > 0) product(m, head, m->h, m->dim, b->num_logits, b->logits, ith, nth);
}

/* Threads pay for themselves only with enough work between barriers (a step has ~12 per
 * layer): a tiny model's decode step runs on one thread. */
#define MIN_WEIGHT_BYTES_PER_THREAD (2u << 20)

void tw_model_forward(tw_model *m, tw_batch *b, int threads) {
    step_job job = {m, b};
    if (threads <= 0) {
        size_t work = tw_model_weight_bytes(m) * (size_t)(b->num_tokens > 0 ? b->num_tokens : 1);
        size_t by_work = work / MIN_WEIGHT_BYTES_PER_THREAD;
        threads = by_work < 1 ? 1 : (by_work > 1024 ? 1024 : (int)by_work);
    }
    tw_pool_run_n(step_task, &job, threads);
}

size_t tw_model_weight_bytes(const tw_model *m) {
    size_t total = tw_weight_bytes(m->lm_head.kind >= 0 ? &m->lm_head : &m->embed);
    for (int l = 0; l < m->num_layers; l++) {
        const tw_layer *L = &m->layers[l];
        total += tw_weight_bytes(&L->qkv) + tw_weight_bytes(&L->o) + tw_weight_bytes(&L->gate_up) + tw_weight_bytes(&L->down);
    }
    return total;
}
