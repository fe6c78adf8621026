/* tokenwire CPU kernels: the declarations every source file shares.
 *
 * Rules of this folder:
 * 1. Pure C11 + GCC/Clang vector intrinsics. No -march flag: AVX2 and AVX-512 code is compiled
 *    per function with target attributes and chosen once at run time (dispatch.c).
 * 2. No Python in the kernels. module.c is the only file that includes Python.h; it unpacks
 *    buffers, releases the GIL for the whole call, and hands plain pointers down.
 * 3. Work is split over the persistent thread pool (pool.c) by output tiles; a kernel is told
 *    its [begin, end) range and never allocates.
 *
 * The INT4 weight layout the kernels read ("tiled", made once from the engine format by
 * tw_int4_pack, see int4_pack.c):
 *
 *   rows are grouped into tiles of TW_TILE = 16 output rows (N padded with zero rows);
 *   tile t, group g is one contiguous block of 64 + 8*G bytes:
 *     scales  fp16 [16]            row r's scale for group g
 *     zeros   fp16 [16]            row r's zero point for group g (quantized units)
 *     q       u32  [G/8][16]       chunk c, lane r: the 4 engine bytes of row r holding
 *                                  k = g*G + 8c .. g*G + 8c + 7; nibble j (bits 4j..4j+3) is k0 + j
 *   blocks are ordered tile-major (t, then g): one forward stream per tile.
 *
 * So one 64-byte load gives 8 k values of 16 rows, the 16 lanes of a vector are 16 outputs,
 * and a tile's result is stored with no horizontal sums. Bytes per weight equal the engine's
 * (qweight + fp16 scales + fp16 zeros), plus padding rows when N is not a multiple of 16.
 */
#ifndef TW_H
#define TW_H

#include <stddef.h>
#include <stdint.h>

#define TW_TILE 16
#define TW_ALIGN 64
/* Weight streams are read with a software prefetch this far ahead: the hardware prefetchers
 * alone left a memory-bound GEMV at half the read bandwidth (measured on one core: 6.3 ->
 * 11.7 GB/s with 4 KiB; 8 KiB did best in A/B runs of the decode step, 16 KiB no better);
 * the bandwidth probe prefetches the same way, so the roofline is comparable. */
#ifndef TW_PREFETCH_BYTES
#define TW_PREFETCH_BYTES 8192
#endif
#ifndef TW_PREFETCH_HINT
#define TW_PREFETCH_HINT _MM_HINT_T0
#endif

/* ------------------------------------------------------------------ INT4 weights */

typedef struct {
    int32_t n;              /* logical output rows N */
    int32_t k;              /* logical input features K */
    int32_t kp;             /* K padded to a multiple of the group size */
    int32_t group_size;     /* G: 32, 64 or 128 (any multiple of 8 works) */
    int32_t num_groups;     /* kp / G */
    int32_t num_tiles;      /* ceil(N / 16) */
    size_t block_bytes;     /* 64 + 8*G: one (tile, group) block */
    uint8_t *data;          /* [num_tiles][num_groups][block_bytes], 64-byte aligned, owned */
} tw_int4;

/* Activation buffers, prepared once per product and shared by all tiles. A thread works on
 * its own copy of this struct with m, kp and num_groups set from the weight at hand. */
typedef struct {
    int32_t m;              /* rows of x */
    int32_t kp;
    int32_t num_groups;
    float *x;               /* fp32 path: [m][kp] x zero-padded to kp */
    float *xsum;            /* fp32 path: [m][num_groups] sum of x over each group */
    int8_t *xq;             /* q8 path: [m][kp] round(x / d) per group, chunk order (even k, then odd k);
                               an ISA may lay it out its own way, up to 3 bytes per value (kern_avx512.c) */
    float *xd;              /* q8 path: [m][num_groups] d = max|x| / 127 of each group */
    float *xqsum;           /* q8 path: [m][num_groups] d * sum(xq) over each group */
} tw_act;

int tw_int4_pack(tw_int4 *w, const uint8_t *qweight, const uint16_t *scales, const uint16_t *zeros,
                 int n, int k, int kp, int group_size);
void tw_int4_free(tw_int4 *w);

/* y[m][n] (row stride ldy) for n in tiles [t0, t1). Every ISA provides both precisions. */
typedef void (*tw_int4_kernel)(const tw_int4 *w, const tw_act *a, float *y, int ldy, int t0, int t1);

/* Buffers for up to max_m rows of any weight with kp <= max_kp and num_groups <= max_groups. */
int tw_act_init(tw_act *a, int max_m, int max_kp, int max_groups);   /* 0 ok, -1 out of memory */
void tw_act_free(tw_act *a);

/* Activation preparation for rows [m0, m1): the readable versions (the scalar table's);
 * each ISA table has its own in .prep. */
void tw_act_prepare_f32(tw_act *a, const float *x, int ldx, int k, int m0, int m1);
void tw_act_prepare_q8(tw_act *a, const float *x, int ldx, int k, int m0, int m1);

/* ------------------------------------------------------------------ other weights (dense / int8 rows) */

enum { TW_W_F32 = 0, TW_W_F16 = 1, TW_W_I8 = 2, TW_W_I4 = 3 };

/* y[m][n] = sum_k x[m][k] * W[n][k] for row-major dense or per-row int8 weights, rows [n0, n1). */
typedef void (*tw_rows_kernel)(const void *w, const uint16_t *row_scales, int kind, int k,
                               const float *x, int ldx, int m, float *y, int ldy, int n0, int n1);

/* The q8 path of int8 rows (TW_W_I8, the classifier): x rounded per block of TW_ROWS_Q8_BLOCK
 * values to xq = round(x / d), d = max|x_b| / 127 (as tw_act_prepare_q8, natural k order), and
 *   y[i][n] = row_scales[n] * sum_b xd[i][b] * sum_{k in b} W[n][k] * xq[i][k]
 * with exact integer block sums: W @ x_hat, the same error bound as the INT4 q8 path
 * (int8_error_bound with G = 32). Float rows cost a convert and an FMA per weight, which
 * held Qwen2.5-0.5B's 136 MB int8 classifier to ~45% of the read bandwidth on two AVX2
 * cores; integer pairs are ~4x fewer instructions per weight. Needs k % TW_ROWS_Q8_BLOCK == 0. */
#define TW_ROWS_Q8_BLOCK 32
/* xq [m][ldq] int8, xd [m][ldq / TW_ROWS_Q8_BLOCK]; rows [n0, n1) of y [m][ldy] */
typedef void (*tw_rows_q8_kernel)(const int8_t *w, const uint16_t *row_scales, int k, const int8_t *xq,
                                  const float *xd, int ldq, int m, float *y, int ldy, int n0, int n1);
/* Rows [m0, m1) of x [.][ldx] (k values each) -> xq, xd as above (the readable version, every ISA's). */
void tw_rows_prepare_q8(const float *x, int ldx, int k, int m0, int m1, int8_t *xq, float *xd, int ldq);
int tw_rows_q8_fits(int kind, int k);                /* 1: the q8 rows path can run this weight */

/* ------------------------------------------------------------------ products (linear.c) */

/* Inside a pool task: thread ith's share. `a` must hold >= m rows of w's kp. */
void tw_int4_linear_part(const tw_int4 *w, const tw_act *buffers, const float *x, int ldx, int m,
                         float *y, int ldy, int prec, int ith, int nth);
void tw_rows_linear_part(const void *w, const uint16_t *row_scales, int kind, int n, int k,
                         const float *x, int ldx, int m, float *y, int ldy, int ith, int nth);
/* Whole products on the pool; x [m][k], y [m][n], both packed. */
int tw_int4_linear(const tw_int4 *w, const float *x, int m, float *y, int prec);
int tw_rows_linear(const void *w, const uint16_t *row_scales, int kind, int n, int k,
                   const float *x, int m, float *y, int prec);      /* -1: out of memory */

/* ------------------------------------------------------------------ dispatch */

enum { TW_ISA_SCALAR = 0, TW_ISA_AVX2 = 1, TW_ISA_AVX512 = 2 };
enum { TW_PREC_F32 = 0, TW_PREC_Q8 = 1 };

typedef void (*tw_prep_kernel)(tw_act *a, const float *x, int ldx, int k, int m0, int m1);

/* One query token's heads of one KV head against that head's cached keys (attention).
 * The cache keeps K transposed inside each block ([head_dim][block_size] per block and KV
 * head), so the scores of a block's keys are one vector per head with no horizontal sums,
 * and V as rows ([block_size][head_dim] per block and KV head): either way one KV head's part
 * of a block is one contiguous 4 KiB-ish run, which the hardware prefetchers follow. */
typedef struct {
    const float *q;                 /* [group][head_dim] the token's query heads (RoPE'd) */
    float *out;                     /* [group][head_dim] */
    const float *kt;                /* K of this layer and KV head: physical block b at kt + b * kt_block */
    const float *v;                 /* V of this layer and KV head: physical block b's row i at v + b * v_block + i * v_row */
    size_t kt_block, v_block, v_row;
    const int32_t *table;           /* the sequence's block table */
    int block_size, lo, hi;         /* visible keys: positions lo..hi */
    int group, head_dim;
    float scale;                    /* 1 / sqrt(head_dim) as float32, or the model's own */
    float softcap;                  /* scores = softcap * tanh(scores / softcap) before the softmax; 0: none */
    float *scores;                  /* [group][hi - lo + 1] scratch */
} tw_attn_args;

typedef struct {
    int isa;
    const char *name;
    tw_int4_kernel int4[2];          /* [TW_PREC_F32], [TW_PREC_Q8] */
    tw_prep_kernel prep[2];          /* activation preparation for each; same results as int4_pack.c's */
    tw_rows_kernel rows;
    tw_rows_q8_kernel rows_q8;       /* TW_W_I8 rows against int8 activations */
    float (*dot)(const float *a, const float *b, int n);
    void (*axpy)(float *y, float a, const float *x, int n);   /* y += a * x */
    float (*read_sum)(const uint8_t *p, size_t bytes);        /* stream-read; bytes % 256 == 0 */
    /* out = act(gate) * up, act = SiLU (gelu = 0) or tanh-GELU (gelu = 1) */
    void (*gated)(float *out, const float *gate, const float *up, int n, int gelu);
    float (*exp_sum)(float *x, int n, float sub);             /* x = exp(x - sub); returns the sum */
    /* out = softmax(q.k * scale) @ v per head, the reference's order: p = e / sum, then p @ v */
    void (*attend)(const tw_attn_args *a);
    /* Temperature sampling's exponentials (kernels/sampling.py), one row of logits [v]:
     * e[i] = exp(fl(fl(l[i] / t) - fl(max(l) / t))), the reference's float64 arguments bit for bit,
     * the exp within TW_EXP_ULPS ulp of libm's (0 where the argument is below -708, NaN stays
     * NaN), and sums[b] = the sum of e over [b * block, (b + 1) * block) in any order. */
    void (*exp_blocks)(const float *l, int v, double t, double *e, double *sums, int block);
    /* x += add (when add is not NULL), then out = x / sqrt(mean(x^2) + eps) * w */
    void (*residual_rms_norm)(float *out, float *x, const float *add, const float *w, int n, float eps);
} tw_kernels;

void tw_residual_rms_norm(float *out, float *x, const float *add, const float *w, int n, float eps);  /* readable one */

/* The attention of any table through its dot / axpy / exp_sum (scalar and AVX2 use it). */
void tw_attend_generic(const tw_attn_args *a);

int tw_isa_supported(int isa);
int tw_isa_best(void);
const tw_kernels *tw_kernels_for(int isa);          /* NULL when the CPU lacks it */
const tw_kernels *tw_active(void);                  /* the chosen table */
int tw_set_isa(int isa);                            /* 0 ok, -1 unsupported */

extern const tw_kernels tw_kernels_scalar;
extern const tw_kernels tw_kernels_avx2;
extern const tw_kernels tw_kernels_avx512;
#define TW_EXP_ULPS 4
#if defined(__x86_64__) || defined(__i386__)
void tw_exp_blocks_avx2(const float *l, int v, double t, double *e, double *sums, int block);
void tw_rows_q8_avx2(const int8_t *w, const uint16_t *row_scales, int k, const int8_t *xq, const float *xd,
                     int ldq, int m, float *y, int ldy, int n0, int n1);  /* AVX-512's table uses it too */
#endif

/* Scalar helpers other ISAs reuse for ragged edges. */
float tw_half_to_float(uint16_t h);
uint16_t tw_float_to_half(float f);

/* ------------------------------------------------------------------ thread pool */

/* fn(arg, ith, nth) runs on every pool thread, the caller being ith = 0; returns when all did. */
typedef void (*tw_task)(void *arg, int ith, int nth);

int tw_pool_num_threads(void);
int tw_pool_set_threads(int n);                     /* 0 ok; joins and restarts the workers */
int tw_physical_cores(void);
void tw_pool_run(tw_task fn, void *arg);
void tw_pool_run_n(tw_task fn, void *arg, int max_threads);     /* on at most max_threads threads */
/* The same; tasks with the same nonzero key do the same work, so the pool compares their times on
 * different thread counts and runs on fewer threads while that is faster (a core taken) */
void tw_pool_run_keyed(tw_task fn, void *arg, int max_threads, long long key);
void tw_pool_barrier(int ith, int nth);             /* inside a task: all threads meet here */
int tw_pool_active_threads(void);                   /* threads tasks run on now: fewer while a core is taken */
long long tw_pool_demotions(void);                  /* tasks judged contended so far */
void tw_pool_set_adaptive(int on);                  /* 0: always every thread (on by default) */
int tw_pool_task_threads(long long key, long long now);          /* tests: the pool's judgment alone, */
void tw_pool_judge_task(int nth, long long wall, long long waited, long long key, long long now);  /* no work */

/* Memory a thread will read soon: a barrier wait streams it towards L2 (prefetcht1, line by
 * line, advancing p) instead of spinning idle, until released or the range is done. */
typedef struct {
    const uint8_t *p;
    size_t left;                                    /* bytes */
} tw_prefetch_range;
void tw_pool_barrier_prefetch(int ith, int nth, tw_prefetch_range *ahead);   /* ahead may be NULL */

static inline void tw_split(int total, int ith, int nth, int *begin, int *end) {
    int base = total / nth, rem = total % nth;
    *begin = ith * base + (ith < rem ? ith : rem);
    *end = *begin + base + (ith < rem);
}

/* ------------------------------------------------------------------ memory bandwidth */

/* Stream-read a fresh `bytes` buffer on all pool threads, `reps` passes after one warm-up;
 * seconds[i] is pass i's wall time. 0 ok, -1 when the buffer cannot be allocated. */
int tw_read_bandwidth(size_t bytes, int reps, double *seconds);
double tw_now_seconds(void);

void tw_prefetch_l2(const void *p, size_t bytes);    /* prefetcht1 every 64-byte line (a no-op off x86) */
void *tw_alloc(size_t bytes);                        /* 64-byte aligned, zeroed; NULL on failure */
void tw_free(void *p);
int tw_populate(void *p, size_t bytes);               /* map the pages now; -1: no memory */

#endif
