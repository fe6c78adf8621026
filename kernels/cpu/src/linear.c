/* Matrix products as thread-pool work: y[m][:] = x[m][:] @ W^T.
 *
 * `*_part(..., ith, nth)` is the share of thread ith of nth and is called from inside a pool
 * task (the C forward runs a whole step as one task); `tw_*_linear` wraps it in its own task
 * for callers outside. INT4: the activations are prepared once (rows split over threads),
 * all threads meet, then each computes a contiguous range of 16-row tiles. */
#include "tw.h"

int tw_act_init(tw_act *a, int max_m, int kp, int num_groups) {
    a->m = max_m;
    a->kp = kp;
    a->num_groups = num_groups;
    a->x = tw_alloc((size_t)max_m * kp * sizeof(float));
    a->xsum = tw_alloc((size_t)max_m * num_groups * sizeof(float));
    a->xq = tw_alloc((size_t)max_m * kp * 3);      /* 3 bytes per value: AVX-512's exact path (24-bit digits) */
    a->xd = tw_alloc((size_t)max_m * num_groups * sizeof(float));
    a->xqsum = tw_alloc((size_t)max_m * num_groups * sizeof(float));
    if (a->x && a->xsum && a->xq && a->xd && a->xqsum) return 0;
    tw_act_free(a);
    return -1;
}

void tw_act_free(tw_act *a) {
    tw_free(a->x);
    tw_free(a->xsum);
    tw_free(a->xq);
    tw_free(a->xd);
    tw_free(a->xqsum);
    a->x = a->xsum = a->xd = a->xqsum = NULL;
    a->xq = NULL;
}

void tw_int4_linear_part(const tw_int4 *w, const tw_act *buffers, const float *x, int ldx, int m,
                         float *y, int ldy, int prec, int ith, int nth) {
    int m0, m1, t0, t1;
    tw_act a = *buffers;                    /* this thread's view: no shared writes */
    a.m = m;
    a.kp = w->kp;
    a.num_groups = w->num_groups;
    tw_split(m, ith, nth, &m0, &m1);
    tw_active()->prep[prec == TW_PREC_Q8](&a, x, ldx, w->k, m0, m1);
    tw_pool_barrier(ith, nth);
    tw_split(w->num_tiles, ith, nth, &t0, &t1);
    tw_active()->int4[prec == TW_PREC_Q8](w, &a, y, ldy, t0, t1);
}

void tw_rows_linear_part(const void *w, const uint16_t *row_scales, int kind, int n, int k,
                         const float *x, int ldx, int m, float *y, int ldy, int ith, int nth) {
    int n0, n1;
    tw_split(n, ith, nth, &n0, &n1);
    tw_active()->rows(w, row_scales, kind, k, x, ldx, m, y, ldy, n0, n1);
}

typedef struct {
    const tw_int4 *w;
    tw_act *a;
    const float *x;
    int ldx, m, ldy, prec;
    float *y;
} int4_job;

static void int4_task(void *arg, int ith, int nth) {
    int4_job *j = arg;
    tw_int4_linear_part(j->w, j->a, j->x, j->ldx, j->m, j->y, j->ldy, j->prec, ith, nth);
}

int tw_int4_linear(const tw_int4 *w, const float *x, int m, float *y, int prec) {
    tw_act a;
    if (tw_act_init(&a, m, w->kp, w->num_groups) != 0) return -1;
    int4_job job = {w, &a, x, w->k, m, w->n, prec, y};
    tw_pool_run(int4_task, &job);
    tw_act_free(&a);
    return 0;
}

typedef struct {
    const void *w;
    const uint16_t *row_scales;
    int kind, n, k, m;
    const float *x;
    const int8_t *xq;               /* q8 path: [m][k], or NULL */
    const float *xd;                /* q8 path: [m][k / 32] */
    float *y;
} rows_job;

static void rows_task(void *arg, int ith, int nth) {
    rows_job *j = arg;
    if (!j->xq) {
        tw_rows_linear_part(j->w, j->row_scales, j->kind, j->n, j->k, j->x, j->k, j->m, j->y, j->n, ith, nth);
        return;
    }
    int n0, n1;
    tw_split(j->n, ith, nth, &n0, &n1);
    tw_active()->rows_q8(j->w, j->row_scales, j->k, j->xq, j->xd, j->k, j->m, j->y, j->n, n0, n1);
}

/* prec TW_PREC_Q8 takes the q8 rows path where it fits (tw_rows_q8_fits), fp32 rows otherwise. */
int tw_rows_linear(const void *w, const uint16_t *row_scales, int kind, int n, int k,
                   const float *x, int m, float *y, int prec) {
    rows_job job = {w, row_scales, kind, n, k, m, x, NULL, NULL, y};
    int8_t *xq = NULL;
    float *xd = NULL;
    if (prec == TW_PREC_Q8 && tw_rows_q8_fits(kind, k)) {
        xq = tw_alloc((size_t)m * k);
        xd = tw_alloc((size_t)m * (k / TW_ROWS_Q8_BLOCK) * sizeof(float));
        if (!xq || !xd) {
            tw_free(xq), tw_free(xd);
            return -1;
        }
        tw_rows_prepare_q8(x, k, k, 0, m, xq, xd, k);
        job.xq = xq, job.xd = xd;
    }
    tw_pool_run(rows_task, &job);
    tw_free(xq), tw_free(xd);
    return 0;
}
