/* The C forward's lifecycle (init / reserve / free), batch validation, and the step itself.
 *
 * A step is one pool task: every thread walks the same sequence of stages and takes its
 * share of each (token rows, attention (token, KV head) items, or output tiles of a
 * product); a barrier separates stages that read what the previous one wrote. No
 * allocation, no Python, no GIL inside the step. The stage list mirrors
 * ReferenceModel.forward line by line. */
#include <math.h>
#include <stdatomic.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <stdio.h>
#include <string.h>

#include "model.h"

/* ------------------------------------------------------------------ lifecycle */

static size_t q_row(const tw_model *m) { return (size_t)(m->num_heads + 2 * m->num_kv_heads) * m->head_dim; }

int tw_model_init(tw_model *m) {
    const size_t per_cache = (size_t)m->num_layers * m->num_blocks * m->block_size * m->num_kv_heads * m->head_dim;
    /* resident from the start (tw_populate): a step never faults in a fresh block, and a
     * server that cannot have its KV cache fails at start, not an hour in */
    m->k_cache = tw_alloc(per_cache * sizeof(float));
    m->v_cache = tw_alloc(per_cache * sizeof(float));
    if (tw_populate(m->k_cache, per_cache * sizeof(float)) || tw_populate(m->v_cache, per_cache * sizeof(float)))
        return -1;
    if (m->attn_scale == 0.0f) m->attn_scale = (float)pow((double)m->head_dim, -0.5);   /* np.float32(head_dim ** -0.5) */
    m->next_work = tw_alloc((size_t)(5 * m->num_layers + 1) * sizeof(_Atomic int));
    return m->k_cache && m->v_cache && m->next_work ? 0 : -1;
}

static void free_own(tw_thread_scratch *own) {
    tw_free(own->x);
    tw_free(own->h);
    tw_free(own->mlp);
    tw_free(own->rope);
    tw_free(own->rope_local);
    tw_free(own->post);
    tw_free(own->scores);
    tw_free(own->best);
    tw_free(own->best_at);
    tw_act_free(&own->act);
    memset(own, 0, sizeof *own);
}

static void free_scratch(tw_model *m) {
    float **bufs[] = {&m->qkv, &m->attn, &m->tmp, &m->gate_up, &m->mlp};
    tw_act_free(&m->act);
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) {
        tw_free(*bufs[i]);
        *bufs[i] = NULL;
    }
    for (int i = 0; m->own && i < m->cap_threads; i++) free_own(&m->own[i]);
    tw_free(m->own);
    m->own = NULL;
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
        tw_free(L->q_norm);
        tw_free(L->k_norm);
        tw_free(L->post_attn_norm);
        tw_free(L->post_mlp_norm);
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
    tw_free(m->inv_freq_local);
    m->inv_freq_local = NULL;
    tw_free(m->k_cache);
    tw_free(m->v_cache);
    tw_free((void *)m->next_work);
    m->next_work = NULL;
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

static float *floats(size_t count) { return tw_alloc((count ? count : 1) * sizeof(float)); }

static void widen(const tw_weight *w, int *max_kp, int *max_groups) {
    if (tw_rows_q8_fits(w->kind, w->k)) {          /* the q8 rows' xq [k] and xd [k / 32] */
        *max_kp = w->k > *max_kp ? w->k : *max_kp;
        *max_groups = w->k / TW_ROWS_Q8_BLOCK > *max_groups ? w->k / TW_ROWS_Q8_BLOCK : *max_groups;
        return;
    }
    if (w->kind != TW_W_I4) return;
    *max_kp = w->i4.kp > *max_kp ? w->i4.kp : *max_kp;
    *max_groups = w->i4.num_groups > *max_groups ? w->i4.num_groups : *max_groups;
}

/* activation buffers for `rows` rows of any of the model's INT4 products and int8 rows */
static int act_init(const tw_model *m, tw_act *a, int rows) {
    int max_kp = 8, max_groups = 1;
    for (int l = 0; l < m->num_layers; l++) {
        const tw_layer *L = &m->layers[l];
        widen(&L->qkv, &max_kp, &max_groups), widen(&L->o, &max_kp, &max_groups);
        widen(&L->gate_up, &max_kp, &max_groups), widen(&L->down, &max_kp, &max_groups);
    }
    widen(m->lm_head.kind >= 0 ? &m->lm_head : &m->embed, &max_kp, &max_groups);
    return tw_act_init(a, rows, max_kp, max_groups);
}

static int alloc_own(const tw_model *m, tw_thread_scratch *own, int tokens, int ctx) {
    const size_t T = (size_t)tokens, few = tokens < TW_SPLIT_ROWS ? T : TW_SPLIT_ROWS;
    own->x = floats(T * m->dim);
    own->h = floats(T * m->dim);
    own->mlp = floats(few * m->hidden);
    own->rope = floats(T * m->head_dim);
    own->rope_local = m->inv_freq_local ? floats(T * m->head_dim) : NULL;
    own->post = floats((size_t)m->dim);
    own->scores = floats((size_t)ctx * (m->num_heads / m->num_kv_heads));
    own->best = floats(T);
    own->best_at = tw_alloc(T * sizeof(int32_t));
    int act_ok = act_init(m, &own->act, (int)few) == 0;
    return own->x && own->h && own->mlp && own->rope && (own->rope_local || !m->inv_freq_local) && own->post &&
           own->scores && own->best && own->best_at && act_ok ? 0 : -1;
}

/* A capacity that covers `need`, grown by at least half of `cap`: a decode stream's context
 * grows by one token per step, and reallocating (and faulting in) every buffer each step cost
 * ~8% of a 0.5B model's decode step. */
static int grown(int need, int cap) {
    if (need <= cap) return cap;
    const long more = (long)cap + cap / 2;
    return more > need ? (more < (1 << 30) ? (int)more : 1 << 30) : need;
}

/* Only the attention scores depend on the context length: a longer context regrows them alone. */
static int regrow_scores(tw_model *m, int ctx) {
    for (int i = 0; i < m->cap_threads; i++) {
        tw_free(m->own[i].scores);
        m->own[i].scores = floats((size_t)ctx * (m->num_heads / m->num_kv_heads));
        if (!m->own[i].scores) return -1;
    }
    m->cap_ctx = ctx;
    return 0;
}

/* Grow the scratch for this batch on `threads` threads (outside the step: it allocates). */
int tw_model_reserve(tw_model *m, const tw_batch *b, int threads) {
    int ctx = 1;
    for (int s = 0; s < b->num_seqs; s++) ctx = b->context_lens[s] > ctx ? b->context_lens[s] : ctx;
    const int T = b->num_tokens > 0 ? b->num_tokens : 1;
    if (T <= m->cap_tokens && threads <= m->cap_threads) {
        if (ctx <= m->cap_ctx) return 0;
        if (regrow_scores(m, grown(ctx, m->cap_ctx)) == 0) return 0;
        free_scratch(m);
        return -1;
    }
    const int tokens = grown(T, m->cap_tokens);
    ctx = grown(ctx, m->cap_ctx);
    threads = threads > m->cap_threads ? threads : m->cap_threads;
    free_scratch(m);
    const size_t q = (size_t)m->num_heads * m->head_dim;
    m->qkv = floats((size_t)tokens * q_row(m));
    m->attn = floats((size_t)tokens * q);
    m->tmp = floats((size_t)tokens * m->dim);
    m->gate_up = floats((size_t)tokens * 2 * m->hidden);
    m->mlp = floats((size_t)tokens * m->hidden);
    m->own = tw_alloc((size_t)threads * sizeof(tw_thread_scratch));
    m->cap_threads = m->own ? threads : 0;
    int ok = m->qkv && m->attn && m->tmp && m->gate_up && m->mlp && m->own && act_init(m, &m->act, tokens) == 0;
    for (int i = 0; ok && i < threads; i++) ok = alloc_own(m, &m->own[i], tokens, ctx) == 0;
    if (!ok) {
        free_scratch(m);
        return -1;
    }
    m->cap_tokens = tokens;
    m->cap_ctx = ctx;
    return 0;
}

/* ------------------------------------------------------------------ the step */

typedef struct {
    tw_model *m;
    tw_batch *b;
    int nth;                        /* threads the step ran on (the pool may give fewer than asked) */
    int last_rows;                  /* rows the last layer carries past its attention: T, or the logits rows alone */
} step_job;

/* ------------------------------------------------------------------ fused greedy argmax */

/* Does value v at index i come before the best so far (bv at bi, bi < 0: none)? numpy's
 * argmax: the first maximum, NaN above everything (the first NaN wins). */
static int beats(float v, int i, float bv, int bi) {
    if (i < 0) return 0;
    if (bi < 0) return 1;
    if (isnan(v) || isnan(bv)) return isnan(v) && (!isnan(bv) || i < bi);
    return v > bv || (v == bv && i < bi);
}

/* The largest of x[0, n) (n >= 1) and whether any is NaN: 4 lanes of maxps on x86-64 (whose
 * baseline has SSE2); plain C elsewhere (the compiler does not vectorize a float max without
 * -ffast-math). The maximum is exact either way when no value is NaN. */
static float chunk_max(const float *x, int n, int *nan) {
#if defined(__SSE2__)
    if (n >= 8) {
        __m128 m0 = _mm_loadu_ps(x), m1 = _mm_loadu_ps(x + 4), u = _mm_setzero_ps();
        int i = 8;
        for (; i + 8 <= n; i += 8) {
            const __m128 a = _mm_loadu_ps(x + i), b = _mm_loadu_ps(x + i + 4);
            u = _mm_or_ps(u, _mm_or_ps(_mm_cmpunord_ps(a, a), _mm_cmpunord_ps(b, b)));
            m0 = _mm_max_ps(m0, a), m1 = _mm_max_ps(m1, b);
        }
        u = _mm_or_ps(u, _mm_or_ps(_mm_cmpunord_ps(m0, m0), _mm_cmpunord_ps(m1, m1)));  /* the first 8 */
        float lanes[4], mx;
        _mm_storeu_ps(lanes, _mm_max_ps(m0, m1));
        mx = lanes[0];
        for (int j = 1; j < 4; j++) mx = lanes[j] > mx ? lanes[j] : mx;
        for (; i < n; i++) {
            mx = x[i] > mx ? x[i] : mx;
            if (x[i] != x[i]) *nan = 1;
        }
        if (_mm_movemask_ps(u)) *nan = 1;
        return mx;
    }
#endif
    float mx = x[0];
    for (int i = 0; i < n; i++) {
        mx = x[i] > mx ? x[i] : mx;
        if (x[i] != x[i]) *nan = 1;
    }
    return mx;
}

/* Fold x[0, n) (indices base..base+n, above every index folded before) into (*best, *at): a
 * chunk's maximum first, the index search only in a chunk that holds a new best or a NaN. */
static void argmax_fold(const float *x, int n, int base, float *best, int32_t *at) {
    if (*at >= 0 && isnan(*best)) return;
    for (int i0 = 0; i0 < n; i0 += 256) {
        const int i1 = i0 + 256 < n ? i0 + 256 : n;
        int nan = 0;
        const float mx = chunk_max(x + i0, i1 - i0, &nan);
        if (!nan && *at >= 0 && !(mx > *best)) continue;
        for (int i = i0; i < i1; i++) {
            if (isnan(x[i])) {
                *best = x[i], *at = base + i;
                return;
            }
            if (*at < 0 || x[i] > *best) *best = x[i], *at = base + i;
        }
    }
}

/* After the step: each row's argmax from the threads' partial ones, or (final soft cap, which
 * may round distinct logits to equal ones) from the capped row itself. */
static void argmax_merge(const tw_model *m, const tw_batch *b, int nth) {
    for (int r = 0; r < b->num_logits; r++) {
        float best = 0.0f;
        int32_t at = -1;
        if (m->final_softcap > 0.0f) argmax_fold(b->logits + (size_t)r * m->vocab, m->vocab, 0, &best, &at);
        else
            for (int t = 0; t < nth; t++)
                if (beats(m->own[t].best[r], m->own[t].best_at[r], best, at)) best = m->own[t].best[r], at = m->own[t].best_at[r];
        b->argmax[r] = at;
    }
}

/* Bytes of the next product a thread streams towards L2 while it waits at a barrier: its own
 * first share (below), up to WAIT_PREFETCH_BYTES. */
#define WAIT_PREFETCH_BYTES (256u << 10)
#define WARM_BYTES (64u << 10)          /* of which warm() asks for this much at once */

/* A thread's place in the step: thread 0 stamps each stage (the others run unobserved, they
 * do the same work), and every thread counts the shared stages it passes, in the same order,
 * to find that stage's work counter. `ahead` is what it may still prefetch while it waits. */
typedef struct {
    tw_model *m;
    int ith, nth;
    uint64_t last;
    int stage_no;
    tw_prefetch_range ahead;
} clock0;

/* How a shared stage's `total` items are handed out: thread ith first takes its own share
 * [ith * first, (ith + 1) * first) (known in advance, so it can be prefetched), then pieces
 * of what is left from the stage's counter, each 1 / (2 nth) of the remainder and at least
 * `min` ("guided"): a core slowed by a neighbour takes fewer, few pieces mean few jumps for
 * the weight stream, and the last pieces are small, so the threads finish a product within
 * microseconds of each other (chunks of 1/16 left one idle for up to 20 us per product, and
 * ~300 us after the lm_head). Results do not depend on who computes what. */
typedef struct {
    int total, first, min;
} shares;

/* Items [begin, end) of the current shared stage for this thread; start with *end = -1;
 * returns 0 when none are left. */
static int claim(clock0 *c, shares s, int *begin, int *end) {
    if (c->nth == 1) {
        if (*end >= s.total) return 0;
        *begin = 0, *end = s.total;
        return s.total > 0;
    }
    if (*end < 0) {
        *begin = c->ith * s.first;
        *end = *begin + s.first < s.total ? *begin + s.first : s.total;
        if (*begin < *end) return 1;
    }
    _Atomic int *counter = &c->m->next_work[c->stage_no];
    const int base = c->nth * s.first;
    int taken = atomic_load_explicit(counter, memory_order_relaxed), size;
    do {
        const int left = s.total - base - taken;
        if (left <= 0) return 0;
        size = left / (2 * c->nth);
        size = size > s.min ? size : s.min;
        size = size < left ? size : left;
    } while (!atomic_compare_exchange_weak_explicit(counter, &taken, taken + size, memory_order_relaxed,
                                                    memory_order_relaxed));
    *begin = base + taken;
    *end = *begin + size;
    return 1;
}

/* A product's tiles: half of them in equal own shares, the rest in guided pieces of >= 64 KiB
 * (streams long enough for the prefetch). */
static shares tile_shares(const clock0 *c, const tw_int4 *w) {
    const int min = (int)((64u << 10) / (w->num_groups * w->block_bytes)) + 1;
    return (shares){w->num_tiles, w->num_tiles / (2 * c->nth), min};
}

/* Start this thread's own share of the next product on its way to L2: WARM_BYTES now, and up
 * to WAIT_PREFETCH_BYTES while it waits at the next barrier. Called when a thread's part of a
 * product is done, so the memory bus keeps streaming weights through the barrier, the
 * attention and the row work before the next product. */
static void warm(clock0 *c, const tw_weight *w) {
    c->ahead.left = 0;
    if (w->kind != TW_W_I4 || c->nth == 1) return;
    const size_t tile_bytes = (size_t)w->i4.num_groups * w->i4.block_bytes;
    const shares s = tile_shares(c, &w->i4);
    const int first = c->ith * s.first, last = first + s.first < s.total ? first + s.first : s.total;
    if (first >= last) return;
    size_t bytes = (size_t)(last - first) * tile_bytes;
    bytes = bytes < WAIT_PREFETCH_BYTES ? bytes : WAIT_PREFETCH_BYTES;
    const uint8_t *start = w->i4.data + (size_t)first * tile_bytes;
    const size_t now = bytes < WARM_BYTES ? bytes : WARM_BYTES;
    tw_prefetch_l2(start, now);
    c->ahead = (tw_prefetch_range){start + now, bytes - now};
}

static void stamp(clock0 *c, int stage) {
    if (c->ith) return;
    uint64_t now = (uint64_t)(tw_now_seconds() * 1e9);
    c->m->prof.ns[stage] += now - c->last;
    c->last = now;
}

static void sync(clock0 *c) {
    tw_pool_barrier_prefetch(c->ith, c->nth, &c->ahead);
    stamp(c, TW_PROF_BARRIER);
}

/* Long batches (prefill) split row-wise work and share its result; a decode step's few rows
 * are cheaper to redo on every thread than to meet at a barrier for. */
static int shared_rows(const clock0 *c, int rows) { return rows >= TW_SPLIT_ROWS || c->nth == 1; }

/* Dense or int8 rows (embedding-sized classifiers): a contiguous share of the rows each. Int8
 * rows under int8 activations take the q8 rows path, their activations rounded as the INT4
 * products' are: by this thread alone for a few rows, or split over the threads (then they meet). */
static void rows_product(clock0 *c, tw_thread_scratch *own, const tw_weight *w, const float *x, int ldx,
                         int rows, float *y) {
    const tw_model *m = c->m;
    if (m->prec != TW_PREC_Q8 || !tw_rows_q8_fits(w->kind, w->k)) {
        tw_rows_linear_part(w->data, w->row_scales, w->kind, w->n, w->k, x, ldx, rows, y, w->n, c->ith, c->nth);
        return;
    }
    const int shared = shared_rows(c, rows);
    const tw_act *a = shared ? &m->act : &own->act;
    int r0 = 0, r1 = rows, n0, n1;
    if (shared) tw_split(rows, c->ith, c->nth, &r0, &r1);
    tw_rows_prepare_q8(x, ldx, w->k, r0, r1, a->xq, a->xd, w->k);
    stamp(c, TW_PROF_PREP);
    if (shared && c->nth > 1) sync(c);
    tw_split(w->n, c->ith, c->nth, &n0, &n1);
    tw_active()->rows_q8(w->data, w->row_scales, w->k, a->xq, a->xd, w->k, rows, y, w->n, n0, n1);
}

/* y [rows][w->n] = x [rows][w->k] @ W^T: this thread's output tiles / rows (no barrier after).
 * INT4: the activations are prepared first, by this thread alone into its own buffers for
 * a few rows, or split over the threads into the shared ones (then they meet). */
static void product(clock0 *c, tw_thread_scratch *own, const tw_weight *w, const float *x, int ldx,
                    int rows, float *y, int stage, int argmax) {
    const tw_model *m = c->m;
    if (rows == 0) {                            /* a pruned last layer whose chunk samples nothing */
        c->stage_no += w->kind == TW_W_I4;
        stamp(c, stage);
        return;
    }
    if (argmax)
        for (int r = 0; r < rows; r++) own->best_at[r] = -1;
    if (w->kind != TW_W_I4) {
        rows_product(c, own, w, x, ldx, rows, y);
        if (argmax) {
            int n0, n1;
            tw_split(w->n, c->ith, c->nth, &n0, &n1);
            for (int r = 0; r < rows; r++)
                argmax_fold(y + (size_t)r * w->n + n0, n1 - n0, n0, &own->best[r], &own->best_at[r]);
        }
        stamp(c, stage);
        return;
    }
    int t0 = 0, t1, r0 = 0, r1 = rows;
    const int shared = shared_rows(c, rows);
    tw_act a = shared ? m->act : own->act;
    a.m = rows;
    a.kp = w->i4.kp;
    a.num_groups = w->i4.num_groups;
    if (shared) tw_split(rows, c->ith, c->nth, &r0, &r1);
    tw_active()->prep[m->prec == TW_PREC_Q8](&a, x, ldx, w->k, r0, r1);
    stamp(c, TW_PROF_PREP);
    if (shared && c->nth > 1) sync(c);
    const shares s = tile_shares(c, &w->i4);
    t1 = -1;
    while (claim(c, s, &t0, &t1)) {
        tw_active()->int4[m->prec == TW_PREC_Q8](&w->i4, &a, y, w->n, t0, t1);
        if (argmax) {                           /* while the tiles' outputs are in L1 / L2 */
            const int n0 = t0 * 16, n1 = t1 * 16 < w->n ? t1 * 16 : w->n;
            for (int r = 0; r < rows && n0 < n1; r++)
                argmax_fold(y + (size_t)r * w->n + n0, n1 - n0, n0, &own->best[r], &own->best_at[r]);
        }
    }
    c->stage_no++;
    stamp(c, stage);
}

static void embed_rows(const tw_model *m, const tw_batch *b, tw_thread_scratch *own) {
    for (int t = 0; t < b->num_tokens; t++) {
        float *x = own->x + (size_t)t * m->dim;
        tw_weight_row(&m->embed, b->token_ids[t], x);
        for (int i = 0; i < m->dim; i++) x[i] *= m->embed_mult;
        tw_rope_table(own->rope + (size_t)t * m->head_dim, b->positions[t], m->inv_freq, m->head_dim / 2);
        if (m->inv_freq_local)
            tw_rope_table(own->rope_local + (size_t)t * m->head_dim, b->positions[t], m->inv_freq_local, m->head_dim / 2);
    }
}

/* The product row a thread adds to its residual stream: the shared output itself, or (post
 * norms) its RMSNorm in the thread's own row buffer, since every thread reads the shared one. */
static const float *product_row(const tw_model *m, tw_thread_scratch *own, const float *post_norm, int t) {
    const float *row = m->tmp + (size_t)t * m->dim;
    if (!post_norm) return row;
    tw_rms_norm(own->post, row, post_norm, m->dim, m->eps);
    return own->post;
}

/* x += the shared product output (when `add`; RMSNorm'd by `post_norm` first when given),
 * then h = RMSNorm(x) for every token */
static void residual_norm(const tw_model *m, tw_thread_scratch *own, const float *norm, int tokens, int add,
                          const float *post_norm) {
    for (int t = 0; t < tokens; t++) {
        float *x = own->x + (size_t)t * m->dim;
        tw_active()->residual_rms_norm(own->h + (size_t)t * m->dim, x, add ? product_row(m, own, post_norm, t) : NULL,
                                       norm, m->dim, m->eps);
    }
}

/* (sequence, KV head) items: a quarter of them as each thread's own share, then one at a time
 * (their cost varies with the context length). The first item's keys and values are asked for
 * before the barrier (warm_attention), where the thread would otherwise wait idle; asking for
 * the next item's while computing one did not pay (a burst of ~1000 prefetches stalls the core
 * as long as the loads it saves). */
static shares attention_shares(const clock0 *c, const tw_batch *b) {
    const int items = b->num_seqs * c->m->num_kv_heads, first = items / (2 * c->nth);
    return (shares){items, first > 1 ? first : 1, 1};
}

/* A long batch with a prefill chunk (TW_SPLIT_ROWS tokens on) splits its attention by token
 * (tw_attention_prepare, then (token, KV head) items after a barrier): its sequences' items
 * would be too few and too uneven to share (a lone prompt on 2 threads: 3 items of a
 * 3-KV-head model, one thread doing two). Measured on the default model: 32 tokens -170 us of
 * attention, 512 tokens -10 ms and half the barrier wait; at 8 tokens the extra barrier per
 * layer cost more (+30-40 us) than the balance saved. Shorter batches and decode steps keep
 * the self-contained items and no barrier. */
static int split_attention(const clock0 *c, const tw_batch *b) {
    return c->nth > 1 && b->num_tokens >= TW_SPLIT_ROWS && b->num_tokens > b->num_seqs;
}

static void warm_attention(const clock0 *c, int layer, const tw_batch *b) {
    const tw_model *m = c->m;
    const int item = c->ith * attention_shares(c, b).first;
    if (c->nth > 1 && !split_attention(c, b) && item < b->num_seqs * m->num_kv_heads)
        tw_attention_prefetch(m, layer, b, item / m->num_kv_heads, item % m->num_kv_heads);
}

static void attention(clock0 *c, int layer, const tw_batch *b, tw_thread_scratch *own, const int32_t *out_row) {
    const tw_model *m = c->m;
    const float *rope = m->layers[layer].local_rope ? own->rope_local : own->rope;
    const int hkv = m->num_kv_heads;
    int i0 = 0, i1 = -1;
    if (split_attention(c, b)) {
        int t0, t1;
        tw_split(b->num_tokens, c->ith, c->nth, &t0, &t1);
        tw_attention_prepare(m, layer, b, t0, t1, rope);
        stamp(c, TW_PROF_ATTN);
        sync(c);
        const int items = b->num_tokens * hkv, first = items / (2 * c->nth);
        const shares s = {items, first > 1 ? first : 1, 1};
        while (claim(c, s, &i0, &i1))
            for (int i = i0; i < i1; i++) tw_attention_token(m, layer, b, i / hkv, i % hkv, own->scores, out_row);
    } else {
        while (claim(c, attention_shares(c, b), &i0, &i1))
            for (int i = i0; i < i1; i++)
                tw_attention_item(m, layer, b, i / hkv, i % hkv, rope, own->scores, out_row);
    }
    c->stage_no++;
}

/* The last layer past its attention only matters for the rows whose logits are asked for (a
 * prompt's last token): their attention outputs went to rows 0..R-1 (out_row), and each thread
 * moves their residual rows there too (logits_indices ascend, so row r <= logits_indices[r]). */
static void keep_logit_rows(const tw_model *m, const tw_batch *b, tw_thread_scratch *own) {
    for (int r = 0; r < b->num_logits; r++)
        if (b->logits_indices[r] != r)
            memcpy(own->x + (size_t)r * m->dim, own->x + (size_t)b->logits_indices[r] * m->dim, (size_t)m->dim * sizeof(float));
}

/* act(gate) * up of every token -> the down product's input (split and shared for long batches) */
static const float *mlp_rows(clock0 *c, tw_thread_scratch *own, int tokens) {
    const tw_model *m = c->m;
    const size_t I = m->hidden;
    const int shared = shared_rows(c, tokens);
    int t0 = 0, t1 = tokens;
    if (shared) tw_split(tokens, c->ith, c->nth, &t0, &t1);
    float *out = shared ? m->mlp : own->mlp;
    for (int t = t0; t < t1; t++)
        tw_activation_mul(out + t * I, m->gate_up + t * 2 * I, m->gate_up + t * 2 * I + I, (int)I, m->activation);
    stamp(c, TW_PROF_ROWS);
    if (shared && c->nth > 1) sync(c);
    return out;
}

/* pruned: the last layer ran on the logits rows alone, row r being logits row r */
static void logits_rows(const tw_model *m, const tw_batch *b, tw_thread_scratch *own, int pruned) {
    const float *post = m->layers[m->num_layers - 1].post_mlp_norm;
    for (int r = 0; r < b->num_logits; r++) {
        const int t = pruned ? r : b->logits_indices[r];
        tw_active()->residual_rms_norm(own->h + (size_t)r * m->dim, own->x + (size_t)t * m->dim, product_row(m, own, post, t),
                                       m->norm, m->dim, m->eps);
    }
}

/* One step, as ReferenceModel.forward: a barrier wherever a thread reads what the products
 * or the attention items of the others wrote. */
static void step_task(void *arg, int ith, int nth) {
    step_job *job = arg;
    tw_model *m = job->m;
    tw_batch *b = job->b;
    tw_thread_scratch *own = &m->own[ith];
    const int T = b->num_tokens, D = m->dim, q = m->num_heads * m->head_dim;
    clock0 c = {m, ith, nth, ith ? 0 : (uint64_t)(tw_now_seconds() * 1e9), 0};
    if (ith == 0) job->nth = nth;
    const uint64_t start = c.last;
    const int pruned = job->last_rows < T;
    embed_rows(m, b, own);
    for (int l = 0; l < m->num_layers; l++) {
        const tw_layer *L = &m->layers[l];
        const int last = l == m->num_layers - 1, rows = last ? job->last_rows : T;
        residual_norm(m, own, L->attn_norm, T, l > 0,               /* x += down output of layer l-1 */
                      l > 0 ? m->layers[l - 1].post_mlp_norm : NULL);
        stamp(&c, TW_PROF_ROWS);
        product(&c, own, &L->qkv, own->h, D, T, m->qkv, TW_PROF_QKV, 0);
        warm_attention(&c, l, b);
        warm(&c, &L->o);
        sync(&c);
        attention(&c, l, b, own, last && pruned ? b->logit_row : NULL);
        if (last && pruned) keep_logit_rows(m, b, own);
        stamp(&c, TW_PROF_ATTN);
        sync(&c);
        product(&c, own, &L->o, m->attn, q, rows, m->tmp, TW_PROF_O, 0);
        warm(&c, &L->gate_up);
        sync(&c);
        residual_norm(m, own, L->mlp_norm, rows, 1, L->post_attn_norm);
        stamp(&c, TW_PROF_ROWS);
        product(&c, own, &L->gate_up, own->h, D, rows, m->gate_up, TW_PROF_GATE_UP, 0);
        warm(&c, &L->down);
        sync(&c);
        const float *mlp = mlp_rows(&c, own, rows);
        product(&c, own, &L->down, mlp, m->hidden, rows, m->tmp, TW_PROF_DOWN, 0);
        warm(&c, !last ? &m->layers[l + 1].qkv : (m->lm_head.kind >= 0 ? &m->lm_head : &m->embed));
        sync(&c);
    }
    logits_rows(m, b, own, pruned);
    stamp(&c, TW_PROF_ROWS);
    const tw_weight *head = m->lm_head.kind >= 0 ? &m->lm_head : &m->embed;
    if (b->num_logits > 0) product(&c, own, head, own->h, D, b->num_logits, b->logits, TW_PROF_LM_HEAD,
                                     b->argmax != NULL);
    if (ith == 0) {
        m->prof.steps++;
        m->prof.step_ns += c.last - start;
    }
}

/* Threads pay for themselves only with enough work between barriers: a tiny model's decode
 * step runs on one thread. */
#define MIN_WEIGHT_BYTES_PER_THREAD (2u << 20)

int tw_model_threads(const tw_model *m, const tw_batch *b, int threads) {
    const int pool = tw_pool_num_threads();
    if (threads <= 0) {
        size_t work = tw_model_weight_bytes(m) * (size_t)(b->num_tokens > 0 ? b->num_tokens : 1);
        size_t by_work = work / MIN_WEIGHT_BYTES_PER_THREAD;
        threads = by_work < 1 ? 1 : (by_work > 1024 ? 1024 : (int)by_work);
    }
    return threads < pool ? threads : pool;
}

/* Rows the last layer needs past its attention: only the logits rows (a prefill chunk's last
 * token; none for a chunk that samples nothing) when logits_indices ascend, which lets each
 * thread move its residual rows down in place; T otherwise. Fills b->logit_row. */
static int last_layer_rows(const tw_batch *b) {
    for (int r = 1; r < b->num_logits; r++)
        if (b->logits_indices[r] <= b->logits_indices[r - 1]) return b->num_tokens;
    if (b->num_logits >= b->num_tokens) return b->num_tokens;
    for (int t = 0; t < b->num_tokens; t++) b->logit_row[t] = -1;
    for (int r = 0; r < b->num_logits; r++) b->logit_row[b->logits_indices[r]] = r;
    return b->num_logits;
}

void tw_model_forward(tw_model *m, tw_batch *b, int threads) {
    step_job job = {m, b, 1, last_layer_rows(b)};
    for (int i = 0; i < 5 * m->num_layers + 1; i++) atomic_store_explicit(&m->next_work[i], 0, memory_order_relaxed);
    /* steps with the same token and logits counts do about the same work (the context grows slowly) */
    tw_pool_run_keyed(step_task, &job, threads, ((long long)b->num_tokens << 24) + b->num_logits + 1);
    if (m->final_softcap > 0.0f) {          /* Gemma 2: logits = cap * tanh(logits / cap), as the reference */
        const size_t count = (size_t)b->num_logits * m->vocab;
        for (size_t i = 0; i < count; i++) b->logits[i] = m->final_softcap * tanhf(b->logits[i] / m->final_softcap);
    }
    if (b->argmax) argmax_merge(m, b, job.nth);
}

size_t tw_model_weight_bytes(const tw_model *m) {
    size_t total = tw_weight_bytes(m->lm_head.kind >= 0 ? &m->lm_head : &m->embed);
    for (int l = 0; l < m->num_layers; l++) {
        const tw_layer *L = &m->layers[l];
        total += tw_weight_bytes(&L->qkv) + tw_weight_bytes(&L->o) + tw_weight_bytes(&L->gate_up) + tw_weight_bytes(&L->down);
    }
    return total;
}
