/* A persistent thread pool: one task at a time runs on all threads (the caller is thread 0).
 *
 * Workers spin briefly on a generation counter after each task (a decode step issues
 * hundreds of tasks back to back, and waking a sleeping thread costs tens of microseconds),
 * then sleep on a condition variable so an idle server burns no CPU. Callers are serialised
 * by a mutex: the engine thread is the only regular caller, tests may call from several.
 * Workers start lazily and are restarted after fork (the child has none of them).
 *
 * The pool notices a descheduled worker (tasks run with a key, tw_pool_run_keyed: the C
 * forward's steps). Every thread adds up the time it waits for the others (at barriers, for a
 * worker's late start, for the task's end); when, in a task long enough to judge, more than
 * LOST_FRACTION of the threads' time went to waiting, one thread was not running (a neighbour
 * took its core: a barrier then waits milliseconds for it, and a step on two threads ran at
 * 0.17x of quiet with a busy loop on one of two cores). Once that held on PERSIST_TASKS
 * comparable tasks in a row (a hypervisor's blip slows one step, and judged alone it held a
 * quiet machine on one thread 17-29 times in 100 requests), the pool tries one thread fewer,
 * and keeps that only if the next EXPERIMENT_TASKS tasks with the same key are not slower (on
 * a machine loaded all over, two threads may wait a lot and still beat one: then it returns
 * and does not try again for a hold, doubled per failed trial). While on fewer threads, after
 * a hold (HOLD_MIN_NS, doubled per failed probe, up to HOLD_MAX_NS) it probes one thread more,
 * kept if >= 5% faster than the count below on tasks with the same key. Either experiment
 * ends as lost at its first task over LOSING_RATIO times its bar: a lost probe costs one
 * slow step, not three. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include "tw.h"

#define TASK_PAUSE_NS 50000     /* after a task a worker spins this long on pause ... */
#define TASK_SPIN_NS 3000000    /* ... then yields its core between checks until this long, then sleeps:
                                 * engine steps come back to back with ~0.3 ms of Python between them,
                                 * and a worker woken from sleep arrives late to the first barrier */
#define BARRIER_SPIN_NS 30000   /* a thread at a barrier spins this long before it sleeps */
#define LOST_FRACTION 0.3      /* of the threads' time spent waiting: a thread was descheduled */
#define JUDGE_NS 200000         /* shorter tasks do not say (a wake-up alone is tens of microseconds) */
#define EXPERIMENT_TASKS 3      /* a changed thread count is judged on this many comparable tasks ... */
#define LOSING_RATIO 1.5        /* ... or on its first one that took this many times its bar: a probe of two
                                 * threads while a neighbour holds a core ran each of its 3 steps at 2x,
                                 * and at concurrency 1 those probes were the inter-token p99 */
#define PERSIST_TASKS 3         /* comparable tasks in a row judged contended before a thread is dropped */
#define HOLD_MIN_NS 20000000LL  /* fewer threads for this long before probing one more ... */
#define HOLD_MAX_NS 1000000000LL /* ... doubling while the probes stay contended */
#define DEMOTE_HOLD_MAX_NS 100000000LL /* after failed trials, no lowering for at most this long: a
                                 * longer hold carried over to steps of another shape, which a
                                 * taken core then slowed 4x until it ran out */
#define YIELD_AFTER 256         /* pauses before a waiter starts yielding its core (oversubscribed machines) */

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

static struct {
    pthread_mutex_t run_mu;     /* one caller at a time; also guards resizing */
    pthread_mutex_t sleep_mu;
    pthread_cond_t sleep_cv;
    int nth;                    /* threads in the pool, caller included; 0 = not chosen yet */
    int task_nth;               /* threads the current task runs on (<= nth) */
    int num_workers;            /* started workers (nth - 1 once started) */
    pthread_t *workers;
    _Atomic unsigned generation;
    unsigned start_generation;  /* generation when the workers were started: their first "seen" */
    _Atomic int pending;        /* workers still inside the current task */
    _Atomic int stop;
    tw_task fn;
    void *arg;
    _Atomic int bar_count;
    _Atomic unsigned bar_phase;
    _Atomic int bar_sleepers;
    struct {
        long long ns;               /* this task's waiting, written by its own thread only */
        char pad[56];
    } *waits;                       /* [nth] */
    long long posted_ns;            /* when the current task was posted */
    int limit;                      /* threads tasks run on now (<= nth; < nth while contended) */
    long long hold_ns, probe_at_ns; /* contended: next probe of limit + 1 at probe_at_ns */
    int probing;                    /* the limit was just raised: the next comparable task tests it */
    int trial;                      /* the limit was just lowered: the next comparable task tests it */
    long long demote_hold_ns, demote_at_ns;  /* after a failed trial: no lowering before demote_at_ns */
    long long tried_ns;                      /* when the current probe or trial began */
    int exp_tasks;                           /* comparable tasks of the current probe or trial so far */
    long long exp_sum;                       /* ... and their total time */
    long long trial_base;                    /* a trial's bar: the mean time of the contended run that began it */
    int contended_run;                       /* comparable tasks in a row judged contended, at limit */
    long long contended_sum;                 /* ... and their total time */
    long long *last_wall, *last_key;         /* [nth + 1] running mean of the tasks on k threads with key */
    int adaptive;                   /* 0: always nth (tw_pool_set_adaptive) */
    _Atomic long long demotions;    /* times a task was judged contended */
} pool = {.run_mu = PTHREAD_MUTEX_INITIALIZER, .sleep_mu = PTHREAD_MUTEX_INITIALIZER, .sleep_cv = PTHREAD_COND_INITIALIZER,
        .adaptive = 1};

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void relax(unsigned *spins) {
    if (++*spins < YIELD_AFTER) CPU_RELAX();
    else sched_yield();
}

static unsigned wait_for_task(unsigned seen) {
    unsigned g;
    long long start = 0;
    for (unsigned spins = 0; (g = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen; spins++) {
        if ((spins & 255) != 255) { CPU_RELAX(); continue; }
        long long t = now_ns();
        if (!start) start = t;
        if (t - start < TASK_PAUSE_NS) continue;
        if (t - start < TASK_SPIN_NS) {
            sched_yield();                      /* a runnable thread on this core goes first */
            continue;
        }
        pthread_mutex_lock(&pool.sleep_mu);
        while ((g = atomic_load(&pool.generation)) == seen) pthread_cond_wait(&pool.sleep_cv, &pool.sleep_mu);
        pthread_mutex_unlock(&pool.sleep_mu);
        break;
    }
    return g;
}

static void *worker_main(void *arg) {
    int ith = (int)(intptr_t)arg;
    unsigned seen = pool.start_generation;   /* not a fresh load: a task may already be posted */
    for (;;) {
        seen = wait_for_task(seen);
        if (atomic_load(&pool.stop)) return NULL;
        if (ith < pool.task_nth) {
            pool.waits[ith].ns = now_ns() - pool.posted_ns;       /* late start: the others waited */
            pool.fn(pool.arg, ith, pool.task_nth);
        }
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
}

int tw_physical_cores(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
    int seen[CPU_SETSIZE][2], count = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++) {
        if (!CPU_ISSET(cpu, &set)) continue;
        int ids[2] = {cpu, 0};          /* core_id, package; a CPU without topology counts alone */
        const char *names[2] = {"core_id", "physical_package_id"};
        for (int f = 0; f < 2; f++) {
            char path[128];
            snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/%s", cpu, names[f]);
            FILE *fp = fopen(path, "r");
            if (fp) {
                if (fscanf(fp, "%d", &ids[f]) != 1) ids[f] = f ? 0 : cpu;
                fclose(fp);
            }
        }
        int dup = 0;
        for (int i = 0; i < count && !dup; i++) dup = seen[i][0] == ids[0] && seen[i][1] == ids[1];
        if (!dup) {
            seen[count][0] = ids[0];
            seen[count][1] = ids[1];
            count++;
        }
    }
    return count > 0 ? count : 1;
}

static void stop_workers(void) {
    if (!pool.num_workers) return;
    atomic_store(&pool.stop, 1);
    pthread_mutex_lock(&pool.sleep_mu);
    atomic_fetch_add(&pool.generation, 1);
    pthread_cond_broadcast(&pool.sleep_cv);
    pthread_mutex_unlock(&pool.sleep_mu);
    for (int i = 0; i < pool.num_workers; i++) pthread_join(pool.workers[i], NULL);
    free(pool.workers);
    pool.workers = NULL;
    pool.num_workers = 0;
    atomic_store(&pool.stop, 0);
}

static int start_workers(void) {
    free(pool.waits);
    pool.waits = calloc((size_t)pool.nth, sizeof *pool.waits);
    if (!pool.waits) return -1;
    free(pool.last_wall);
    free(pool.last_key);
    pool.last_wall = calloc((size_t)pool.nth + 1, sizeof *pool.last_wall);
    pool.last_key = calloc((size_t)pool.nth + 1, sizeof *pool.last_key);
    if (!pool.last_wall || !pool.last_key) return -1;
    pool.limit = pool.nth;
    pool.probing = pool.trial = 0;
    pool.hold_ns = pool.demote_hold_ns = HOLD_MIN_NS;
    pool.demote_at_ns = 0;
    int want = pool.nth - 1;
    if (want <= 0) return 0;
    pool.workers = calloc((size_t)want, sizeof(pthread_t));
    if (!pool.workers) return -1;
    pool.start_generation = atomic_load(&pool.generation);
    for (int i = 0; i < want; i++) {
        if (pthread_create(&pool.workers[i], NULL, worker_main, (void *)(intptr_t)(i + 1)) != 0) {
            pool.num_workers = i;
            stop_workers();
            return -1;
        }
        pool.num_workers = i + 1;
    }
    return 0;
}

static void after_fork_in_child(void) {
    /* The child inherits the bookkeeping but no threads: forget them, restart on next use. */
    pthread_mutex_init(&pool.run_mu, NULL);
    pthread_mutex_init(&pool.sleep_mu, NULL);
    pthread_cond_init(&pool.sleep_cv, NULL);
    free(pool.workers);
    pool.workers = NULL;
    pool.num_workers = 0;
}

static void ensure_started(void) {
    static int atfork_done;
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        atfork_done = 1;
    }
    if (pool.nth == 0) pool.nth = tw_physical_cores();
    if ((pool.num_workers != pool.nth - 1 || !pool.waits) && start_workers() != 0) {
        pool.nth = 1;                       /* cannot create threads: run everything on the caller */
    }
}

int tw_pool_num_threads(void) {
    pthread_mutex_lock(&pool.run_mu);
    if (pool.nth == 0) pool.nth = tw_physical_cores();
    int n = pool.nth;
    pthread_mutex_unlock(&pool.run_mu);
    return n;
}

int tw_pool_set_threads(int n) {
    if (n < 1 || n > 1024) return -1;
    pthread_mutex_lock(&pool.run_mu);
    stop_workers();
    pool.nth = n;
    int rc = start_workers();
    if (rc != 0) pool.nth = 1;
    pthread_mutex_unlock(&pool.run_mu);
    return rc;
}

/* After a task on nth threads that took `wall` ns (key: tasks with equal keys do the same work,
 * 0: not comparable, never judged). Each thread count keeps a running mean of its tasks' times
 * (restarted when the key changes); a changed count is judged on the mean of its first
 * EXPERIMENT_TASKS comparable tasks against the running mean of the count before it, so one
 * slow step (the one whose waits started a trial) does not decide alone; but one task over
 * LOSING_RATIO times the bar ends the experiment as lost at once (a wake-up's lateness is tens
 * of microseconds, not half a step, and each task more of a lost probe is a step at ~2x). */
static void judge(int nth, long long wall, long long waited, long long key, long long now) {
    if (!pool.adaptive || key == 0 || wall < JUDGE_NS) return;
    if ((pool.probing || pool.trial) && now - pool.tried_ns > HOLD_MAX_NS)
        pool.probing = pool.trial = 0;      /* no comparable task came: keep this count */
    const int before = pool.probing ? nth - 1 : pool.trial ? nth + 1 : 0;
    if (before && pool.last_key[before] != key)
        pool.probing = pool.trial = 0;      /* no mean to judge this shape by: keep this count (a probe
                                             * left pending blocked every lowering for up to a second) */
    if ((pool.probing || pool.trial) && nth == pool.limit) {   /* a task capped lower (max_threads) says nothing
                                                            * of the count on trial: judging it set limit 0 */
        pool.exp_sum += wall;
        const double base = pool.trial ? pool.trial_base : pool.last_wall[before];
        if (++pool.exp_tasks >= EXPERIMENT_TASKS || wall > LOSING_RATIO * base) {
            const double mean = (double)pool.exp_sum / pool.exp_tasks;
            if (pool.probing && !(mean < 0.95 * base)) {        /* more threads must pay: back, probe less often */
                pool.limit = nth - 1;
                pool.hold_ns = pool.hold_ns * 2 < HOLD_MAX_NS ? pool.hold_ns * 2 : HOLD_MAX_NS;
            } else if (pool.probing) {
                pool.hold_ns = HOLD_MIN_NS;
            } else if (mean > base) {           /* fewer threads lost: the waits were the machine's load */
                pool.limit = nth + 1;
                pool.demote_hold_ns = pool.demote_hold_ns * 2 < DEMOTE_HOLD_MAX_NS ? pool.demote_hold_ns * 2
                                                                                 : DEMOTE_HOLD_MAX_NS;
                pool.demote_at_ns = now + pool.demote_hold_ns;
            } else {
                pool.demote_hold_ns = HOLD_MIN_NS;
            }
            pool.probing = pool.trial = 0;
            pool.probe_at_ns = now + pool.hold_ns;
        }
    } else if (!pool.probing && !pool.trial && nth > 1 && nth == pool.limit && now >= pool.demote_at_ns &&
               pool.last_key[nth] == key) {
        if ((double)waited <= LOST_FRACTION * (double)nth * (double)wall) {
            pool.contended_run = 0, pool.contended_sum = 0;
        } else if (pool.contended_sum += wall, ++pool.contended_run >= PERSIST_TASKS) {   /* a thread stays missing */
            atomic_fetch_add(&pool.demotions, 1);
            pool.limit = nth - 1;
            pool.trial = 1;
            pool.trial_base = pool.contended_sum / pool.contended_run;
            pool.contended_run = 0, pool.contended_sum = 0;
            pool.tried_ns = now;
            pool.exp_tasks = 0, pool.exp_sum = 0;
            pool.hold_ns = HOLD_MIN_NS;
            pool.probe_at_ns = now + pool.hold_ns;
        }
    }
    if (pool.last_key[nth] == key) pool.last_wall[nth] = (3 * pool.last_wall[nth] + wall) / 4;
    else pool.last_wall[nth] = wall, pool.last_key[nth] = key, pool.contended_run = 0, pool.contended_sum = 0;
}

/* Threads the next task may use: the limit, raised by one when a probe is due. */
static int task_limit(long long now) {
    if (!pool.adaptive) return pool.nth;
    if (pool.limit < pool.nth && !pool.trial && !pool.probing && now >= pool.probe_at_ns) {
        pool.limit++;
        pool.probing = 1;
        pool.tried_ns = now;
        pool.exp_tasks = 0, pool.exp_sum = 0;
    }
    return pool.limit;
}

void tw_pool_run_keyed(tw_task fn, void *arg, int max_threads, long long key) {
    pthread_mutex_lock(&pool.run_mu);
    ensure_started();
    long long start = now_ns();
    const int limit = key ? task_limit(start) : pool.nth, cap = limit > 1 ? limit : 1;
    const int nth = max_threads < cap ? (max_threads < 1 ? 1 : max_threads) : cap;
    if (nth == 1) {                          /* the workers stay asleep */
        fn(arg, 0, 1);
        long long end = now_ns();
        judge(1, end - start, 0, key, end);
        pthread_mutex_unlock(&pool.run_mu);
        return;
    }
    pool.fn = fn;
    pool.arg = arg;
    pool.task_nth = nth;
    for (int i = 0; i < nth; i++) pool.waits[i].ns = 0;
    atomic_store(&pool.pending, pool.nth - 1);
    atomic_store(&pool.bar_count, 0);
    pool.posted_ns = start;
    pthread_mutex_lock(&pool.sleep_mu);     /* a worker going to sleep cannot miss this bump */
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.sleep_cv);
    pthread_mutex_unlock(&pool.sleep_mu);
    fn(arg, 0, nth);
    long long done = now_ns();
    unsigned spins = 0;
    while (atomic_load_explicit(&pool.pending, memory_order_acquire) != 0) relax(&spins);
    long long end = now_ns();
    pool.waits[0].ns += end - done;          /* the caller waited for the last worker */
    long long waited = 0;
    for (int i = 0; i < nth; i++) waited += pool.waits[i].ns;
    judge(nth, end - start, waited, key, end);
    pthread_mutex_unlock(&pool.run_mu);
}

void tw_pool_run_n(tw_task fn, void *arg, int max_threads) { tw_pool_run_keyed(fn, arg, max_threads, 0); }

int tw_pool_active_threads(void) {
    pthread_mutex_lock(&pool.run_mu);
    if (pool.nth == 0) pool.nth = tw_physical_cores();
    int n = pool.adaptive && pool.waits ? pool.limit : pool.nth;
    pthread_mutex_unlock(&pool.run_mu);
    return n;
}

long long tw_pool_demotions(void) { return atomic_load(&pool.demotions); }

void tw_pool_set_adaptive(int on) {
    pthread_mutex_lock(&pool.run_mu);
    pool.adaptive = on != 0;
    pool.limit = pool.nth;
    pool.probing = pool.trial = 0;
    pool.hold_ns = pool.demote_hold_ns = HOLD_MIN_NS;
    pool.demote_at_ns = 0;
    pool.contended_run = 0, pool.contended_sum = 0;
    pthread_mutex_unlock(&pool.run_mu);
}

/* The judgment alone, for tests (no work runs): the thread count the pool gives a task with
 * `key` starting at `now`, then its judgment of that task having taken `wall` ns on `nth`
 * threads that waited `waited` ns in all, as tw_pool_run_keyed would make it. */
int tw_pool_task_threads(long long key, long long now) {
    pthread_mutex_lock(&pool.run_mu);
    ensure_started();
    const int nth = key ? task_limit(now) : pool.nth;
    pthread_mutex_unlock(&pool.run_mu);
    return nth;
}

void tw_pool_judge_task(int nth, long long wall, long long waited, long long key, long long now) {
    pthread_mutex_lock(&pool.run_mu);
    judge(nth, wall, nth > 1 ? waited : 0, key, now);
    pthread_mutex_unlock(&pool.run_mu);
}

void tw_pool_run(tw_task fn, void *arg) { tw_pool_run_n(fn, arg, 1 << 30); }

#if defined(__linux__)
static void phase_sleep(unsigned phase) {
    syscall(SYS_futex, &pool.bar_phase, FUTEX_WAIT_PRIVATE, phase, NULL, NULL, 0);
}
static void phase_wake_all(void) { syscall(SYS_futex, &pool.bar_phase, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }
#else
static void phase_sleep(unsigned phase) { (void)phase; sched_yield(); }
static void phase_wake_all(void) {}
#endif

/* Spin briefly (threads usually arrive within microseconds of each other), then sleep on the
 * phase word so a thread waiting for a descheduled one gives its core away. While it spins, a
 * thread streams `ahead` towards L2: the memory bus has work while the slower thread
 * finishes, and the early one starts its next share from L2. */
void tw_pool_barrier_prefetch(int ith, int nth, tw_prefetch_range *ahead) {
    if (nth <= 1) return;
    unsigned phase = atomic_load_explicit(&pool.bar_phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&pool.bar_count, 1, memory_order_acq_rel) == nth - 1) {
        atomic_store_explicit(&pool.bar_count, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&pool.bar_phase, 1, memory_order_release);
        if (atomic_load(&pool.bar_sleepers)) phase_wake_all();
        return;
    }
    long long deadline = 0, arrived = now_ns();
    for (unsigned spins = 0; atomic_load_explicit(&pool.bar_phase, memory_order_acquire) == phase; spins++) {
        if (ahead && ahead->left >= 64) {          /* no pause: the fill buffers pace this loop */
            tw_prefetch_l2(ahead->p, 64);
            ahead->p += 64;
            ahead->left -= 64;
        } else if ((spins & 63) != 63) {
            CPU_RELAX();
            continue;
        }
        if ((spins & 63) != 63) continue;
        long long t = now_ns();
        if (!deadline) deadline = t + BARRIER_SPIN_NS;
        if (t < deadline) continue;
        atomic_fetch_add(&pool.bar_sleepers, 1);
        while (atomic_load_explicit(&pool.bar_phase, memory_order_acquire) == phase) phase_sleep(phase);
        atomic_fetch_sub(&pool.bar_sleepers, 1);
        break;
    }
    pool.waits[ith].ns += now_ns() - arrived;
}

void tw_pool_barrier(int ith, int nth) { tw_pool_barrier_prefetch(ith, nth, NULL); }
