/* The aio engine core: configuration, the request FIFO, piece dispatch and completion, waiting,
 * and the blocking piece runner shared by every backend. See [Note: aio lanes and pieces]. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "aio_internal.h"

#define AIO_MAX_QUEUE_DEPTH 4096u
#define AIO_MAX_THREADS 64u
#define AIO_MAX_POOL 64u  /* blocking workers of the threads/mmap backends */

const char *inf_aio_backend_name(int backend) {
    switch (backend) {
    case INF_AIO_AUTO: return "auto";
    case INF_AIO_IO_URING: return "io_uring";
    case INF_AIO_LIBAIO: return "libaio";
    case INF_AIO_THREADS: return "threads";
    case INF_AIO_MMAP: return "mmap";
    default: return NULL;
    }
}

int inf_aio_backend_available(int backend) {
    switch (backend) {
    case INF_AIO_IO_URING: return aio_uring_available();
    case INF_AIO_LIBAIO: return aio_libaio_available();
    case INF_AIO_THREADS:
    case INF_AIO_MMAP: return 1;
    case INF_AIO_AUTO: return 1;
    default: return 0;
    }
}

int inf_aio_backend(const inf_aio *eng) { return eng->cfg.backend; }

/* ------------------------------------------------------------------ lifecycle */

static void *(*lane_main(int backend))(void *) {
    switch (backend) {
    case INF_AIO_IO_URING: return aio_uring_lane;
    case INF_AIO_LIBAIO: return aio_libaio_lane;
    default: return aio_threads_lane;
    }
}

static void stop_lanes(inf_aio *e) {
    pthread_mutex_lock(&e->mu);
    e->stopping = 1;
    pthread_cond_broadcast(&e->work_cv);
    for (uint32_t i = 0; i < e->nlanes; i++) {
        if (e->lanes[i].wake_fd >= 0) {
            uint64_t one = 1;
            ssize_t w = write(e->lanes[i].wake_fd, &one, sizeof one);
            (void)w;
        }
    }
    pthread_mutex_unlock(&e->mu);
    for (uint32_t i = 0; i < e->nlanes; i++)
        if (e->lanes[i].started) pthread_join(e->lanes[i].thread, NULL);
}

static void free_engine(inf_aio *e) {
    for (uint32_t i = 0; i < e->nlanes; i++) free(e->lanes[i].bounce);
    free(e->lanes);
    pthread_cond_destroy(&e->work_cv);
    pthread_cond_destroy(&e->done_cv);
    pthread_mutex_destroy(&e->mu);
    pthread_mutex_destroy(&e->tail_mu);
    pthread_mutex_destroy(&e->grow_mu);
    free(e);
}

int inf_aio_create(const struct inf_aio_config *cfg, inf_aio **out) {
    if (!cfg || !out) return -EINVAL;
    *out = NULL;
    if (cfg->queue_depth < 1 || cfg->queue_depth > AIO_MAX_QUEUE_DEPTH) return -EINVAL;
    if (cfg->thread_count < 1 || cfg->thread_count > AIO_MAX_THREADS) return -EINVAL;
    if (cfg->block_size == 0 || cfg->block_size % 4096 != 0) return -EINVAL;
    int backend = cfg->backend;
    if (backend == INF_AIO_AUTO) {
        if (aio_uring_available()) backend = INF_AIO_IO_URING;
        else if (aio_libaio_available()) backend = INF_AIO_LIBAIO;
        else backend = INF_AIO_THREADS;
    }
    if (backend < INF_AIO_IO_URING || backend > INF_AIO_MMAP) return -EINVAL;
    if (!inf_aio_backend_available(backend)) return -ENOSYS;

    inf_aio *e = calloc(1, sizeof *e);
    if (!e) return -ENOMEM;
    e->cfg = *cfg;
    e->cfg.backend = backend;
    e->page = (size_t)sysconf(_SC_PAGESIZE);
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->tail_mu, NULL);
    pthread_mutex_init(&e->grow_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->work_cv, &ca);
    pthread_cond_init(&e->done_cv, &ca);
    pthread_condattr_destroy(&ca);

    if (backend == INF_AIO_IO_URING || backend == INF_AIO_LIBAIO) {
        e->nlanes = cfg->thread_count;
    } else {
        /* Blocking workers: each keeps one piece in flight, so thread_count lanes of queue_depth
         * become thread_count * queue_depth workers (capped). */
        uint64_t n = (uint64_t)cfg->thread_count * cfg->queue_depth;
        e->nlanes = (uint32_t)(n > AIO_MAX_POOL ? AIO_MAX_POOL : n);
    }
    e->lanes = calloc(e->nlanes, sizeof *e->lanes);
    if (!e->lanes) {
        free_engine(e);
        return -ENOMEM;
    }
    for (uint32_t i = 0; i < e->nlanes; i++) {
        e->lanes[i].eng = e;
        e->lanes[i].index = (int)i;
        e->lanes[i].wake_fd = -1;
    }
    int err = 0;
    for (uint32_t i = 0; i < e->nlanes && !err; i++) {
        int rc = pthread_create(&e->lanes[i].thread, NULL, lane_main(backend), &e->lanes[i]);
        if (rc) {
            err = -rc;
            break;
        }
        e->lanes[i].started = 1;
    }
    /* Wait until every started lane reports its backend setup. */
    pthread_mutex_lock(&e->mu);
    for (uint32_t i = 0; i < e->nlanes; i++) {
        if (!e->lanes[i].started) continue;
        while (!e->lanes[i].setup_done) pthread_cond_wait(&e->done_cv, &e->mu);
        if (e->lanes[i].setup_err && !err) err = e->lanes[i].setup_err;
    }
    pthread_mutex_unlock(&e->mu);
    if (err) {
        stop_lanes(e);
        free_engine(e);
        return err;
    }
    *out = e;
    return 0;
}

void aio_lane_ready(struct aio_lane *l, int err) {
    inf_aio *e = l->eng;
    pthread_mutex_lock(&e->mu);
    l->setup_err = err;
    l->setup_done = 1;
    pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->mu);
}

int inf_aio_destroy(inf_aio *e) {
    if (!e) return -EINVAL;
    pthread_mutex_lock(&e->mu);
    e->closing = 1;
    while (e->outstanding > 0) pthread_cond_wait(&e->done_cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
    stop_lanes(e);
    /* A waiter woken by the last completion may still be leaving inf_aio_req_wait. */
    pthread_mutex_lock(&e->mu);
    while (e->waiters > 0) pthread_cond_wait(&e->done_cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
    free_engine(e);
    return 0;
}

/* ------------------------------------------------------------------ submit / dispatch */

int inf_aio_submit(inf_aio *e, int op, int fd, uint32_t align, void *buf, uint64_t nbytes,
                   uint64_t offset, inf_aio_req **out) {
    if (!e || !out || fd < 0 || (op != INF_AIO_READ && op != INF_AIO_WRITE)) return -EINVAL;
    if (align == 0 || (align & (align - 1)) != 0) return -EINVAL;
    if (nbytes > 0 && !buf) return -EFAULT;
    if (align > 1) {
        if (((uintptr_t)buf % 512) != 0 || offset % align != 0) return -EINVAL;
    }
    if (e->cfg.backend == INF_AIO_MMAP) align = 1; /* page cache: no direct-I/O tail rules */
    uint64_t block = e->cfg.block_size;
    uint64_t body = align > 1 ? nbytes - nbytes % align : nbytes;
    uint64_t nbody = (body + block - 1) / block;
    uint64_t npieces = nbody + (body < nbytes ? 1 : 0);
    if (npieces > UINT32_MAX) return -E2BIG;

    inf_aio_req *r = calloc(1, sizeof *r);
    if (!r) return -ENOMEM;
    r->eng = e;
    r->op = op;
    r->fd = fd;
    r->align = align;
    r->buf = buf;
    r->nbytes = nbytes;
    r->offset = offset;
    r->body = body;
    r->block = block;
    r->npieces = (uint32_t)npieces;
    r->valid_end = nbytes;

    pthread_mutex_lock(&e->mu);
    if (e->closing) {
        pthread_mutex_unlock(&e->mu);
        free(r);
        return -ESHUTDOWN;
    }
    if (npieces == 0) {
        __atomic_store_n(&r->done, 1, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&e->mu);
        *out = r;
        return 0;
    }
    e->outstanding++;
    if (e->last) e->last->next = r;
    else e->head = r;
    e->last = r;
    /* Wake blocked lanes (at most one per piece) and kernel lanes sleeping with free slots. */
    uint64_t wake = npieces < e->nlanes ? npieces : e->nlanes;
    if (wake >= e->nlanes) pthread_cond_broadcast(&e->work_cv);
    else
        for (uint64_t i = 0; i < wake; i++) pthread_cond_signal(&e->work_cv);
    for (uint32_t i = 0; i < e->nlanes; i++) {
        struct aio_lane *l = &e->lanes[i];
        if (l->sleeping) {
            uint64_t one = 1;
            l->sleeping = 0;
            ssize_t w = write(l->wake_fd, &one, sizeof one);
            (void)w;
        }
    }
    pthread_mutex_unlock(&e->mu);
    *out = r;
    return 0;
}

static void fill_piece(inf_aio_req *r, uint32_t i, struct aio_piece *p) {
    uint64_t nbody = (r->body + r->block - 1) / r->block;
    p->req = r;
    p->slot = -1;
    if (i < nbody) {
        p->off = (uint64_t)i * r->block;
        p->len = r->body - p->off < r->block ? r->body - p->off : r->block;
        p->tail = 0;
    } else {
        p->off = r->body;
        p->len = r->nbytes - r->body;
        p->tail = 1;
    }
}

int aio_take(struct aio_lane *l, struct aio_piece *out, int max, int mode) {
    inf_aio *e = l->eng;
    int n = 0;
    pthread_mutex_lock(&e->mu);
    l->sleeping = 0;
    if (mode == AIO_TAKE_WAIT) {
        while (!e->head && !e->stopping) pthread_cond_wait(&e->work_cv, &e->mu);
        if (!e->head) {
            pthread_mutex_unlock(&e->mu);
            return -1;
        }
    }
    while (n < max && e->head) {
        inf_aio_req *r = e->head;
        fill_piece(r, r->next_piece++, &out[n++]);
        if (r->next_piece == r->npieces) {
            e->head = r->next;
            if (!e->head) e->last = NULL;
            r->next = NULL;
        }
    }
    if (mode == AIO_TAKE_ARM && n < max && l->wake_fd >= 0) l->sleeping = 1;
    pthread_mutex_unlock(&e->mu);
    return n;
}

void aio_complete(inf_aio *e, struct aio_piece *p, const int64_t *res, int n) {
    int finished = 0;
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < n; i++) {
        inf_aio_req *r = p[i].req;
        int64_t v = res[i];
        if (v < 0) {
            if (r->error == 0 || p[i].off < r->err_rel) {
                r->error = v;
                r->err_rel = p[i].off;
            }
        } else if ((uint64_t)v < p[i].len) {
            uint64_t end = p[i].off + (uint64_t)v;
            if (end < r->valid_end) r->valid_end = end;
        }
        if (++r->pieces_done == r->npieces) {
            e->outstanding--;
            __atomic_store_n(&r->done, 1, __ATOMIC_RELEASE);
            finished = 1;
        }
    }
    if (finished) pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->mu);
}

/* ------------------------------------------------------------------ waiting */

int inf_aio_req_done(const inf_aio_req *r) {
    return __atomic_load_n(&r->done, __ATOMIC_ACQUIRE);
}

int inf_aio_req_wait(inf_aio_req *r, int64_t timeout_ns) {
    if (!r) return -EINVAL;
    if (__atomic_load_n(&r->done, __ATOMIC_ACQUIRE)) return 0;
    inf_aio *e = r->eng;
    struct timespec deadline;
    if (timeout_ns >= 0) {
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        deadline.tv_sec += timeout_ns / 1000000000LL;
        deadline.tv_nsec += timeout_ns % 1000000000LL;
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
    }
    int rc = 0;
    pthread_mutex_lock(&e->mu);
    e->waiters++;
    while (!__atomic_load_n(&r->done, __ATOMIC_ACQUIRE)) {
        if (timeout_ns < 0) {
            pthread_cond_wait(&e->done_cv, &e->mu);
        } else if (pthread_cond_timedwait(&e->done_cv, &e->mu, &deadline) == ETIMEDOUT) {
            if (!__atomic_load_n(&r->done, __ATOMIC_ACQUIRE)) rc = -ETIMEDOUT;
            break;
        }
    }
    if (--e->waiters == 0 && e->closing) pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->mu);
    return rc;
}

int64_t inf_aio_req_result(const inf_aio_req *r, uint64_t *err_offset) {
    if (!r) return -EINVAL;
    if (!inf_aio_req_done(r)) return -EBUSY;
    if (r->error) {
        if (err_offset) *err_offset = r->offset + r->err_rel;
        return r->error;
    }
    return (int64_t)r->valid_end;
}

int inf_aio_req_free(inf_aio_req *r) {
    if (!r) return 0;
    if (!inf_aio_req_done(r)) return -EBUSY;
    free(r);
    return 0;
}

/* ------------------------------------------------------------------ blocking piece runner */

/* pread/pwrite until `len` bytes moved, end of file (reads) or an error. A failure after partial
 * progress still reports the error: the caller needs the reason, not a silent short count. */
static int64_t rw_full(int op, int fd, char *buf, uint64_t len, uint64_t pos) {
    uint64_t done = 0;
    while (done < len) {
        ssize_t r = op == INF_AIO_READ ? pread(fd, buf + done, len - done, (off_t)(pos + done))
                                       : pwrite(fd, buf + done, len - done, (off_t)(pos + done));
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            return -errno;
        }
        if (r == 0) {
            if (op == INF_AIO_READ) break;
            return -EIO;
        }
        done += (uint64_t)r;
    }
    return (int64_t)done;
}

static int ensure_bounce(struct aio_lane *l, size_t need) {
    if (l->bounce_size >= need) return 0;
    size_t sz = need < 65536 ? 65536 : need;
    void *p = NULL;
    int rc = posix_memalign(&p, 4096, sz);
    if (rc) return -rc;
    free(l->bounce);
    l->bounce = p;
    l->bounce_size = sz;
    return 0;
}

/* The unaligned tail of a direct-I/O request, through the lane's aligned bounce buffer.
 * Padding (not a buffered fd) keeps the tail out of the page cache and avoids mixing buffered and
 * direct writes on one page, which the kernel cannot keep coherent when they race. */
static int64_t exec_tail(struct aio_lane *l, struct aio_piece *p) {
    inf_aio_req *r = p->req;
    uint64_t pos = aio_piece_pos(p);
    uint64_t padded = (p->len + r->align - 1) / r->align * r->align;
    int rc = ensure_bounce(l, padded);
    if (rc) return rc;
    if (r->op == INF_AIO_READ) {
        int64_t got = rw_full(INF_AIO_READ, r->fd, l->bounce, padded, pos);
        if (got < 0) return got;
        uint64_t n = (uint64_t)got < p->len ? (uint64_t)got : p->len;
        memcpy(aio_piece_buf(p), l->bounce, n);
        return (int64_t)n;
    }
    inf_aio *e = l->eng;
    int64_t ret = (int64_t)p->len;
    pthread_mutex_lock(&e->tail_mu);
    struct stat st;
    if (fstat(r->fd, &st) != 0) {
        ret = -errno;
        goto out;
    }
    uint64_t size_before = (uint64_t)st.st_size;
    uint64_t end = pos + p->len;
    int64_t old = 0;
    if (end < size_before) { /* bytes after ours in the same block belong to the file: keep them */
        old = rw_full(INF_AIO_READ, r->fd, l->bounce, padded, pos);
        if (old < 0) {
            ret = old;
            goto out;
        }
    }
    memset(l->bounce + old, 0, padded - (uint64_t)old);
    memcpy(l->bounce, aio_piece_buf(p), p->len);
    int64_t w = rw_full(INF_AIO_WRITE, r->fd, l->bounce, padded, pos);
    if (w < 0) {
        ret = w;
        goto out;
    }
    if (pos + padded > size_before && fstat(r->fd, &st) == 0 && (uint64_t)st.st_size == pos + padded) {
        /* The padding extended the file: cut it back to where the caller's bytes end. */
        uint64_t keep = end > size_before ? end : size_before;
        if (ftruncate(r->fd, (off_t)keep) != 0) ret = -errno;
    }
out:
    pthread_mutex_unlock(&e->tail_mu);
    return ret;
}

int64_t aio_exec_sync(struct aio_lane *l, struct aio_piece *p) {
    if (p->tail) return exec_tail(l, p);
    if (l->eng->cfg.backend == INF_AIO_MMAP) return aio_mmap_exec(l, p);
    return rw_full(p->req->op, p->req->fd, aio_piece_buf(p), p->len, aio_piece_pos(p));
}

int64_t aio_settle(struct aio_lane *l, struct aio_piece *p, int64_t res) {
    (void)l;
    inf_aio_req *r = p->req;
    if (res == -EAGAIN || res == -EINTR)
        return rw_full(r->op, r->fd, aio_piece_buf(p), p->len, aio_piece_pos(p));
    if (res >= 0 && (uint64_t)res < p->len && r->op == INF_AIO_WRITE) {
        /* A short write (e.g. the disk filled up): finish it to get the real errno or succeed. */
        int64_t more = rw_full(INF_AIO_WRITE, r->fd, aio_piece_buf(p) + res, p->len - (uint64_t)res,
                               aio_piece_pos(p) + (uint64_t)res);
        return more < 0 ? more : res + more;
    }
    return res;
}
