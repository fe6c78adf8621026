/* The memory read-bandwidth probe behind the benchmark's roofline.
 *
 * It reads a buffer the way the INT4 kernels read weights: every pool thread streams its own
 * contiguous slice front to back with the active ISA's widest loads, nothing written. The
 * buffer is freshly allocated and written once (so its pages exist), read once to warm up,
 * then timed pass by pass; the caller picks the statistic. */
#include <string.h>
#include <time.h>

#include "tw.h"

typedef struct {
    const uint8_t *data;
    size_t bytes;               /* multiple of 256 */
    float (*read_sum)(const uint8_t *, size_t);
    volatile float sink[256];   /* per thread, so the reads are not optimised away */
} probe;

double tw_now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void probe_task(void *arg, int ith, int nth) {
    probe *p = arg;
    int begin, end;
    tw_split((int)(p->bytes / 4096), ith, nth, &begin, &end);   /* page-sized units */
    size_t b = (size_t)begin * 4096, e = (size_t)end * 4096;
    if (ith == nth - 1) e = p->bytes;
    p->sink[ith & 255] = e > b ? p->read_sum(p->data + b, e - b) : 0.0f;
}

int tw_read_bandwidth(size_t bytes, int reps, double *seconds) {
    bytes = (bytes + 4095) / 4096 * 4096;
    uint8_t *buf = tw_alloc(bytes);
    if (!buf) return -1;
    for (size_t i = 0; i < bytes; i += 64) buf[i] = (uint8_t)i;  /* non-zero pages, faulted in */
    probe p = {.data = buf, .bytes = bytes, .read_sum = tw_active()->read_sum};
    tw_pool_run(probe_task, &p);                                 /* warm-up pass */
    for (int r = 0; r < reps; r++) {
        double t0 = tw_now_seconds();
        tw_pool_run(probe_task, &p);
        seconds[r] = tw_now_seconds() - t0;
    }
    tw_free(buf);
    return 0;
}
