/* A small persistent thread pool for the CPU Adam step.
 *
 * Why our own: an optimizer step is ~30 ms of pure memory streaming that must use every core the
 * process may run on, called from Python through ctypes (the GIL is released), without depending
 * on torch's OpenMP pool (which may be busy, or sized differently) and without creating threads
 * per call. Workers are created on first need and kept; an idle worker blocks on a condition
 * variable (no spinning while torch or anything else runs). The caller takes part as index 0.
 * Work is shared dynamically by the job itself, so the caller never waits for a worker that has
 * not woken up yet (on a busy machine that can take a scheduler tick): when the caller runs out of
 * work it closes the job, and waits (a short bounded spin, then blocking) only for workers that
 * had already joined. One job runs at a time; concurrent callers take turns. After fork() the
 * child starts with an empty pool. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#include "adam_internal.h"

#define POOL_MAX_WORKERS 255
#define POOL_WAIT_SPINS 20000 /* ~tens of microseconds of pause before blocking */
#define POOL_STACK_BYTES (256 * 1024)

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t submit_lock = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;        /* guards the fields below */
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;          /* a new generation was posted */
static pthread_cond_t done = PTHREAD_COND_INITIALIZER;          /* active reached 0 */
static int nworkers;
static uint64_t generation;
static uint64_t start_generation[POOL_MAX_WORKERS + 1];
static int job_workers; /* workers with index <= job_workers may join this generation */
static int job_closed;  /* the caller ran out of work: late workers must not join */
static adam_pool_fn job_fn;
static void *job_arg;
static atomic_int active; /* workers inside job_fn */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void *worker_main(void *arg) {
    int index = (int)(intptr_t)arg;
    pthread_mutex_lock(&lock);
    uint64_t seen = start_generation[index];
    pthread_mutex_unlock(&lock);
    for (;;) {
        pthread_mutex_lock(&lock);
        while (generation == seen) pthread_cond_wait(&wake, &lock);
        seen = generation;
        int take = index <= job_workers && !job_closed;
        adam_pool_fn fn = job_fn;
        void *fn_arg = job_arg;
        if (take) atomic_fetch_add_explicit(&active, 1, memory_order_relaxed);
        pthread_mutex_unlock(&lock);
        if (!take) continue;
        fn(fn_arg, index);
        if (atomic_fetch_sub_explicit(&active, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&lock);
            pthread_cond_signal(&done);
            pthread_mutex_unlock(&lock);
        }
    }
    return NULL;
}

/* Grow the pool to `want` workers (called with submit_lock held); returns the count it has. */
static int ensure_workers(int want) {
    if (want > POOL_MAX_WORKERS) want = POOL_MAX_WORKERS;
    if (nworkers >= want) return want;
    pthread_attr_t attr;
    if (pthread_attr_init(&attr) != 0) return nworkers;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, POOL_STACK_BYTES);
    /* workers never take signals: Python's SIGINT and friends stay with the main thread */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    while (nworkers < want) {
        int index = nworkers + 1;
        pthread_mutex_lock(&lock);
        start_generation[index] = generation;
        pthread_mutex_unlock(&lock);
        pthread_t tid;
        if (pthread_create(&tid, &attr, worker_main, (void *)(intptr_t)index) != 0) break;
        char name[16];
        snprintf(name, sizeof name, "inf-adam-%u", (unsigned)index % 1000u);
        pthread_setname_np(tid, name);
        nworkers = index;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    return nworkers < want ? nworkers : want;
}

static void atfork_prepare(void) { pthread_mutex_lock(&submit_lock); }
static void atfork_parent(void) { pthread_mutex_unlock(&submit_lock); }
static void atfork_child(void) {
    /* only the forking thread exists in the child: start over with no workers */
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c = PTHREAD_COND_INITIALIZER;
    submit_lock = m;
    lock = m;
    wake = c;
    done = c;
    nworkers = 0;
    job_workers = 0;
    job_closed = 1;
    atomic_store(&active, 0);
}

static void pool_init(void) { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }

int inf_adam_pool_run(int nthreads, adam_pool_fn fn, void *arg) {
    if (nthreads <= 1) {
        fn(arg, 0);
        return 1;
    }
    pthread_once(&pool_once, pool_init);
    pthread_mutex_lock(&submit_lock);
    int nw = ensure_workers(nthreads - 1);
    if (nw <= 0) {
        pthread_mutex_unlock(&submit_lock);
        fn(arg, 0);
        return 1;
    }
    pthread_mutex_lock(&lock);
    job_fn = fn;
    job_arg = arg;
    job_workers = nw;
    job_closed = 0;
    generation++;
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&lock);

    fn(arg, 0); /* returns when no work is left to take; joined workers may still be busy */

    pthread_mutex_lock(&lock);
    job_closed = 1;
    pthread_mutex_unlock(&lock);
    for (int spin = 0; spin < POOL_WAIT_SPINS; spin++) {
        if (atomic_load_explicit(&active, memory_order_acquire) == 0) break;
        cpu_relax();
    }
    if (atomic_load_explicit(&active, memory_order_acquire) != 0) {
        pthread_mutex_lock(&lock);
        while (atomic_load_explicit(&active, memory_order_acquire) != 0)
            pthread_cond_wait(&done, &lock);
        pthread_mutex_unlock(&lock);
    }
    pthread_mutex_unlock(&submit_lock);
    return nw + 1;
}

int inf_adam_cpus_allowed(void) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}
