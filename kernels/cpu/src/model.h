/* The C forward: one engine step of a Llama-family decoder as one thread-pool task.
 *
 * Same contract as the numpy reference (kernels/model.py), which is its specification: a flat
 * batch of new tokens from many sequences (prefill chunks and decode tokens mixed), each
 * token's K/V written to its paged-cache slot before attention, every token attending to the
 * cached positions of its own sequence up to itself (optionally a sliding window), logits for
 * the requested rows only. All arithmetic is float32 in the reference's operation order, the
 * cache is float32, RoPE angles are float64; the INT4 products follow kern_*.c.
 */
#ifndef TW_MODEL_H
#define TW_MODEL_H

#include "tw.h"

typedef struct {
    int kind;                       /* TW_W_F32, TW_W_F16, TW_W_I8, TW_W_I4; -1 = not set */
    int n, k;                       /* logical [N, K] */
    tw_int4 i4;                     /* TW_W_I4: repacked, owned */
    const void *data;               /* F32 / F16 / I8: row-major [n][k], borrowed (kept alive by the owner) */
    const uint16_t *row_scales;     /* I8: fp16 [n], borrowed */
} tw_weight;

typedef struct {
    float *attn_norm;               /* [D], owned copy */
    float *qkv_bias;                /* [q + 2kv] or NULL */
    float *mlp_norm;                /* [D] */
    float *q_norm, *k_norm;         /* [hd] each, or NULL: per-head RMSNorm before RoPE (Qwen3, Gemma 3) */
    float *post_attn_norm;          /* [D] or NULL: RMSNorm of the o product before the residual add (Gemma 2/3) */
    float *post_mlp_norm;           /* [D] or NULL: the same for the down product */
    int window;                     /* this layer's sliding window, 0: none */
    int local_rope;                 /* 1: RoPE with inv_freq_local (Gemma 3's sliding layers) */
    tw_weight qkv, o, gate_up, down;
} tw_layer;

enum { TW_ACT_SILU = 0, TW_ACT_GELU_TANH = 1 };

/* Row-wise work is cheap next to the products (O(T*D) against O(T*D*N)), so for a decode
 * step every thread does all of it on its own copy instead of splitting it and meeting at a
 * barrier: a layer needs only the 5 barriers where a thread reads another's product output.
 * From TW_SPLIT_ROWS tokens on (prefill), the activation and its quantization are split by
 * rows into shared buffers instead, at the cost of two more barriers per product. */
#define TW_SPLIT_ROWS 32         /* measured: at 4 the two extra barriers per product cost a batch-16 step more
                                  * (wake-ups after a barrier sleep) than the redone row work */

typedef struct {
    float *x;                       /* [T][D]  the residual stream */
    float *h;                       /* [T][D]  normed input of qkv / gate_up / lm_head */
    float *mlp;                     /* [min(T, TW_SPLIT_ROWS)][I]  act(gate) * up, the input of down */
    float *rope;                    /* [T][hd] cos [hd/2] then sin [hd/2] per token */
    float *rope_local;              /* [T][hd] the same with inv_freq_local, when the model has one */
    float *post;                    /* [D] one normed product row (post norms) */
    float *scores;                  /* [group][cap_ctx] attention scores of one token's query group */
    tw_act act;                     /* [min(T, TW_SPLIT_ROWS)] rows of the widest K */
    float *best;                    /* [T] fused argmax: the largest logit of each row in this thread's columns */
    int32_t *best_at;               /* [T] ... and its index (-1: none yet) */
} tw_thread_scratch;

/* Where thread 0's time goes in a step (ns, summed over steps; read and reset from Python). */
enum { TW_PROF_ROWS, TW_PROF_PREP, TW_PROF_QKV, TW_PROF_ATTN, TW_PROF_O, TW_PROF_GATE_UP, TW_PROF_DOWN,
       TW_PROF_LM_HEAD, TW_PROF_BARRIER, TW_PROF_STAGES };
#define TW_PROF_NAMES {"rows", "act_prep", "qkv_proj", "attention", "o_proj", "gate_up_proj", "down_proj", \
                       "lm_head", "barrier_wait"}

typedef struct {
    uint64_t ns[TW_PROF_STAGES];
    uint64_t steps, step_ns;
} tw_profile;

typedef struct {
    /* architecture */
    int dim, hidden, num_layers, num_heads, num_kv_heads, head_dim, vocab;
    int activation;                 /* TW_ACT_* */
    int sliding_window;             /* 0: none; the layers' own windows are tw_layer.window */
    float eps, embed_mult, attn_scale;
    float attn_softcap, final_softcap;  /* cap * tanh(x / cap) on attention scores / logits; 0: none */
    double *inv_freq;               /* [head_dim / 2], from kernels/rope.py */
    double *inv_freq_local;         /* [head_dim / 2] or NULL: RoPE of layers with local_rope */
    int prec;                       /* TW_PREC_F32 (exact) or TW_PREC_Q8 */
    /* weights */
    tw_weight embed, lm_head;       /* lm_head.kind == -1: tied to embed */
    float *norm;                    /* [D] */
    tw_layer *layers;               /* [num_layers] */
    /* paged KV cache, float32 */
    int block_size, num_blocks;
    float *k_cache;                 /* [L][num_blocks][Hkv][hd][block_size]  K transposed per block */
    float *v_cache;                 /* [L][num_blocks][Hkv][block_size][hd] */
    /* scratch, grown on demand between steps */
    int cap_tokens, cap_ctx, cap_threads;
    float *qkv;                     /* [T][q + 2kv]   shared: qkv product, then RoPE'd in place */
    float *attn;                    /* [T][q]         shared: attention output */
    float *tmp;                     /* [T][D]         shared: o / down product output */
    float *gate_up;                 /* [T][2I]        shared */
    float *mlp;                     /* [T][I]         shared act(gate) * up, for long batches */
    tw_act act;                     /* [T] rows       shared activation preparation, for long batches */
    tw_thread_scratch *own;         /* [cap_threads]  each thread's private buffers */
    _Atomic int *next_work;         /* [5 * L + 1] per shared stage: the next unclaimed item, 0 at step start */
    tw_profile prof;
} tw_model;

typedef struct {
    int num_tokens, num_seqs, num_logits, max_blocks;
    const int32_t *token_ids;       /* [T] */
    const int32_t *positions;       /* [T] */
    const int32_t *seq_starts;      /* [S + 1] */
    const int32_t *context_lens;    /* [S] */
    const int32_t *block_tables;    /* [S][max_blocks] */
    const int32_t *slot_mapping;    /* [T] */
    const int32_t *logits_indices;  /* [S_sample] */
    float *logits;                  /* [S_sample][V] */
    int32_t *argmax;                /* [S_sample] or NULL: each logits row's first maximum (NaN the largest, as numpy) */
    int32_t *token_seq;             /* [T] scratch: owning sequence of each token */
    int32_t *logit_row;             /* [T] scratch: the logits row of each token, -1: none (tw_model_forward fills it) */
} tw_batch;

int tw_model_init(tw_model *m);                                   /* after the fields above are set */
void tw_model_free(tw_model *m);
const char *tw_model_missing(const tw_model *m);                  /* first unset weight, or NULL */
const char *tw_batch_check(const tw_model *m, const tw_batch *b); /* error text, or NULL when valid */
/* Threads a step runs on: at most `threads` (<= 0: as many as its work is worth) and the pool. */
int tw_model_threads(const tw_model *m, const tw_batch *b, int threads);
int tw_model_reserve(tw_model *m, const tw_batch *b, int threads);   /* grow scratch; 0 ok */
void tw_model_forward(tw_model *m, tw_batch *b, int threads);       /* threads from tw_model_threads */
size_t tw_weight_bytes(const tw_weight *w);                       /* bytes one product reads */
size_t tw_model_weight_bytes(const tw_model *m);                  /* all layer products + lm_head */

/* ops.c: row-wise pieces of a layer (one token per call), the reference's float32 order */
void tw_rms_norm(float *out, const float *x, const float *w, int n, float eps);
void tw_rope_table(float *cs, int pos, const double *inv_freq, int half);
void tw_rope_apply(float *x, const float *cs, int num_heads, int head_dim);
void tw_activation_mul(float *out, const float *gate, const float *up, int n, int activation);
void tw_weight_row(const tw_weight *w, int row, float *out);      /* one row of W as float32 */
void tw_attention_prefetch(const tw_model *m, int layer, const tw_batch *b, int seq, int kv_head);
/* out_row: NULL, or [T] where token t's attention output goes (row out_row[t] of m->attn; < 0: its K/V are
 * written but its attention is not needed) */
void tw_attention_item(const tw_model *m, int layer, const tw_batch *b, int seq, int kv_head, const float *rope,
                       float *scores, const int32_t *out_row);
void tw_attention_prepare(const tw_model *m, int layer, const tw_batch *b, int t0, int t1, const float *rope);
void tw_attention_token(const tw_model *m, int layer, const tw_batch *b, int t, int kv_head, float *scores,
                        const int32_t *out_row);

#endif
