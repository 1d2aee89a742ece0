/* The `io_uring` backend through raw syscalls (no liburing needed at build time).
 *
 * One ring per lane, created by the lane's own thread, which is the only one that ever submits or
 * reaps on it: that allows IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN (completion work runs when
 * the lane asks for events, not as interrupts of its syscalls), with a fallback to plain rings on
 * kernels that predate them. Each lane keeps queue_depth pieces in flight plus one IORING_OP_READ
 * on its wake eventfd (see [Note: aio lanes and pieces]). */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/io_uring.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "aio_internal.h"

#ifndef IORING_SETUP_COOP_TASKRUN
#define IORING_SETUP_COOP_TASKRUN (1U << 8)
#endif
#ifndef IORING_SETUP_SINGLE_ISSUER
#define IORING_SETUP_SINGLE_ISSUER (1U << 12)
#endif
#ifndef IORING_SETUP_DEFER_TASKRUN
#define IORING_SETUP_DEFER_TASKRUN (1U << 13)
#endif

#define WAKE_TAG UINT64_MAX

struct ring {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_map_len, cq_map_len, sqes_len;
    unsigned sqe_tail;  /* local: next SQE to fill */
    unsigned pending;   /* filled, not yet passed to the kernel */
};

static int sys_setup(unsigned entries, struct io_uring_params *p) {
    long r = syscall(__NR_io_uring_setup, entries, p);
    return r < 0 ? -errno : (int)r;
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
    long r = syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, (size_t)_NSIG / 8);
    return r < 0 ? -errno : (int)r;
}

static void ring_close(struct ring *r) {
    if (r->sqes && r->sqes != MAP_FAILED) munmap(r->sqes, r->sqes_len);
    if (r->cq_map && r->cq_map != MAP_FAILED && r->cq_map != r->sq_map) munmap(r->cq_map, r->cq_map_len);
    if (r->sq_map && r->sq_map != MAP_FAILED) munmap(r->sq_map, r->sq_map_len);
    if (r->fd >= 0) close(r->fd);
    memset(r, 0, sizeof *r);
    r->fd = -1;
}

static int ring_open(struct ring *r, unsigned entries, unsigned flags) {
    struct io_uring_params p;
    memset(r, 0, sizeof *r);
    r->fd = -1;
    memset(&p, 0, sizeof p);
    p.flags = flags;
    int fd = sys_setup(entries, &p);
    if (fd < 0) return fd;
    r->fd = fd;
    r->sq_map_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_map_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_map_len > r->sq_map_len) r->sq_map_len = r->cq_map_len;
        r->cq_map_len = r->sq_map_len;
    }
    r->sq_map = mmap(NULL, r->sq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                     IORING_OFF_SQ_RING);
    if (r->sq_map == MAP_FAILED) goto fail;
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        r->cq_map = r->sq_map;
    } else {
        r->cq_map = mmap(NULL, r->cq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                         IORING_OFF_CQ_RING);
        if (r->cq_map == MAP_FAILED) goto fail;
    }
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                   IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) goto fail;
    char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    r->sqe_tail = *r->sq_tail;
    return 0;
fail: {
    int err = -errno;
    ring_close(r);
    return err;
}
}

/* Strongest setup the kernel accepts: single issuer + deferred task work (6.1), cooperative task
 * work (5.19), plain. */
static int ring_open_best(struct ring *r, unsigned entries) {
    static const unsigned tries[] = {
        IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
        IORING_SETUP_COOP_TASKRUN,
        0,
    };
    int rc = -EINVAL;
    for (size_t i = 0; i < sizeof tries / sizeof tries[0]; i++) {
        rc = ring_open(r, entries, tries[i]);
        if (rc != -EINVAL) return rc;
    }
    return rc;
}

static struct io_uring_sqe *ring_sqe(struct ring *r) {
    unsigned idx = r->sqe_tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[idx];
    r->sq_array[idx] = idx;
    r->sqe_tail++;
    r->pending++;
    memset(sqe, 0, sizeof *sqe);
    return sqe;
}

/* Publish filled SQEs and enter the kernel; returns -errno only for errors that are not retried. */
static int ring_enter(struct ring *r, unsigned min_complete, int getevents) {
    __atomic_store_n(r->sq_tail, r->sqe_tail, __ATOMIC_RELEASE);
    for (;;) {
        unsigned flags = (getevents || min_complete) ? IORING_ENTER_GETEVENTS : 0;
        int rc = sys_enter(r->fd, r->pending, min_complete, flags);
        if (rc >= 0) {
            r->pending -= (unsigned)rc < r->pending ? (unsigned)rc : r->pending;
            if (r->pending == 0 || min_complete == 0) return 0;
            continue;
        }
        if (rc == -EINTR) continue;
        if (rc == -EAGAIN || rc == -EBUSY) return 0; /* reap first, then retry */
        return rc;
    }
}

static void prep_wake(struct ring *r, struct aio_lane *l, uint64_t *wake_val) {
    struct io_uring_sqe *sqe = ring_sqe(r);
    sqe->opcode = IORING_OP_READ;
    sqe->fd = l->wake_fd;
    sqe->addr = (uint64_t)(uintptr_t)wake_val;
    sqe->len = sizeof *wake_val;
    sqe->user_data = WAKE_TAG;
}

int aio_uring_available(void) {
    static int cached = -1;
    int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (v >= 0) return v;
    struct ring r;
    v = 0;
    if (ring_open(&r, 4, 0) == 0) {
        /* IORING_OP_READ/WRITE (5.6): ask the probe instead of trusting the version. */
        size_t sz = sizeof(struct io_uring_probe) + 64 * sizeof(struct io_uring_probe_op);
        struct io_uring_probe *pr = calloc(1, sz);
        if (pr && syscall(__NR_io_uring_register, r.fd, IORING_REGISTER_PROBE, pr, 64) == 0) {
            v = pr->last_op >= IORING_OP_WRITE &&
                (pr->ops[IORING_OP_READ].flags & IO_URING_OP_SUPPORTED) &&
                (pr->ops[IORING_OP_WRITE].flags & IO_URING_OP_SUPPORTED);
        }
        free(pr);
        ring_close(&r);
    }
    __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
    return v;
}

void *aio_uring_lane(void *arg) {
    struct aio_lane *l = arg;
    inf_aio *e = l->eng;
    const int qd = (int)e->cfg.queue_depth;
    const int single = e->cfg.single_submit;
    const int overlap = e->cfg.overlap_events;
    struct ring ring;
    struct aio_piece *slots = calloc((size_t)qd, sizeof *slots);
    struct aio_piece *taken = calloc((size_t)qd, sizeof *taken);
    struct aio_piece *done = calloc((size_t)qd, sizeof *done);
    int64_t *res = calloc((size_t)qd, sizeof *res);
    int *free_slots = calloc((size_t)qd, sizeof *free_slots);
    uint64_t wake_val = 0;
    int err = (slots && taken && done && res && free_slots) ? 0 : -ENOMEM;
    if (!err) {
        l->wake_fd = eventfd(0, EFD_CLOEXEC);
        if (l->wake_fd < 0) err = -errno;
    }
    if (!err) err = ring_open_best(&ring, (unsigned)qd + 1);
    aio_lane_ready(l, err);
    if (err) goto out;

    int nfree = qd;
    for (int i = 0; i < qd; i++) free_slots[i] = qd - 1 - i;
    int inflight = 0;
    prep_wake(&ring, l, &wake_val);
    for (;;) {
        int room = (overlap || inflight == 0) ? qd - inflight : 0;
        int n = 0;
        if (room > 0) {
            n = aio_take(l, taken, room, inflight == 0 ? AIO_TAKE_WAIT : AIO_TAKE_ARM);
            if (n < 0) break; /* stopping, nothing in flight */
        }
        int ndone = 0;
        for (int i = 0; i < n; i++) {
            struct aio_piece *p = &taken[i];
            if (p->tail) { /* small and unaligned: run it here, synchronously */
                done[ndone] = *p;
                res[ndone++] = aio_exec_sync(l, p);
                continue;
            }
            int s = free_slots[--nfree];
            slots[s] = *p;
            slots[s].slot = s;
            struct io_uring_sqe *sqe = ring_sqe(&ring);
            sqe->opcode = p->req->op == INF_AIO_READ ? IORING_OP_READ : IORING_OP_WRITE;
            sqe->fd = p->req->fd;
            sqe->addr = (uint64_t)(uintptr_t)aio_piece_buf(p);
            sqe->len = (uint32_t)p->len;
            sqe->off = aio_piece_pos(p);
            sqe->user_data = (uint64_t)s;
            inflight++;
            if (single) ring_enter(&ring, 0, 0);
        }
        if (ndone) aio_complete(e, done, res, ndone);
        if (inflight == 0 && ring.pending == 0) continue;
        /* Wait for one completion (overlap) or the whole batch; new work wakes us via the eventfd. */
        unsigned want = overlap ? 1u : (unsigned)inflight;
        int rc = ring_enter(&ring, inflight ? want : 0, 1);
        if (rc < 0) {
            /* The ring itself failed (EFAULT, EBADF of the ring: a bug, not an I/O error). Fail
             * what it holds and run the rest of this lane's work synchronously. */
            for (int s = 0; s < qd; s++) {
                if (slots[s].req == NULL) continue;
                res[0] = rc;
                aio_complete(e, &slots[s], res, 1);
                slots[s].req = NULL;
            }
            ring_close(&ring);
            goto sync_only;
        }
        unsigned head = *ring.cq_head;
        unsigned tail = __atomic_load_n(ring.cq_tail, __ATOMIC_ACQUIRE);
        ndone = 0;
        int rearm = 0;
        for (; head != tail; head++) {
            struct io_uring_cqe *cqe = &ring.cqes[head & *ring.cq_mask];
            if (cqe->user_data == WAKE_TAG) {
                rearm = 1;
                continue;
            }
            int s = (int)cqe->user_data;
            done[ndone] = slots[s];
            res[ndone] = cqe->res;
            slots[s].req = NULL;
            free_slots[nfree++] = s;
            inflight--;
            ndone++;
        }
        __atomic_store_n(ring.cq_head, head, __ATOMIC_RELEASE);
        for (int i = 0; i < ndone; i++) {
            if (res[i] < 0 || (uint64_t)res[i] < done[i].len) res[i] = aio_settle(l, &done[i], res[i]);
        }
        if (ndone) aio_complete(e, done, res, ndone);
        if (rearm) prep_wake(&ring, l, &wake_val);
    }
    ring_close(&ring);
    goto out;
sync_only:
    for (;;) {
        int n = aio_take(l, taken, 1, AIO_TAKE_WAIT);
        if (n < 0) break;
        res[0] = aio_exec_sync(l, &taken[0]);
        aio_complete(e, taken, res, 1);
    }
out:
    if (l->wake_fd >= 0) {
        pthread_mutex_lock(&e->mu);
        close(l->wake_fd);
        l->wake_fd = -1;
        pthread_mutex_unlock(&e->mu);
    }
    free(slots);
    free(taken);
    free(done);
    free(res);
    free(free_slots);
    return NULL;
}
