/* The `libaio` backend: Linux native AIO through raw io_setup/io_submit/io_getevents syscalls (no
 * libaio library or headers needed at build time).
 *
 * One AIO context per lane with queue_depth pieces in flight plus an IOCB_CMD_POLL on the lane's
 * wake eventfd (see [Note: aio lanes and pieces]). Kernels without AIO poll (< 4.18) get a 1 ms
 * io_getevents timeout instead while the lane has free slots and nothing queued. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/aio_abi.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "aio_internal.h"

#define WAKE_TAG UINT64_MAX
#define AIO_CMD_POLL 5 /* IOCB_CMD_POLL, not in every aio_abi.h */

static long sys_io_setup(unsigned nr, aio_context_t *ctx) { return syscall(__NR_io_setup, nr, ctx); }
static long sys_io_destroy(aio_context_t ctx) { return syscall(__NR_io_destroy, ctx); }
static long sys_io_submit(aio_context_t ctx, long n, struct iocb **iocbs) {
    return syscall(__NR_io_submit, ctx, n, iocbs);
}
static long sys_io_getevents(aio_context_t ctx, long min_nr, long nr, struct io_event *ev,
                             struct timespec *ts) {
    return syscall(__NR_io_getevents, ctx, min_nr, nr, ev, ts);
}

int aio_libaio_available(void) {
    static int cached = -1;
    int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (v >= 0) return v;
    aio_context_t ctx = 0;
    v = sys_io_setup(4, &ctx) == 0;
    if (v) sys_io_destroy(ctx);
    __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
    return v;
}

/* Submit iocbs[0..n); returns how many went in, or -errno if none did. EAGAIN means "reap first". */
static long submit_all(aio_context_t ctx, struct iocb **iocbs, long n, int single) {
    long done = 0;
    while (done < n) {
        long chunk = single ? 1 : n - done;
        long r = sys_io_submit(ctx, chunk, iocbs + done);
        if (r < 0) {
            if (errno == EINTR) continue;
            return done ? done : -errno;
        }
        if (r == 0) break;
        done += r;
    }
    return done;
}

void *aio_libaio_lane(void *arg) {
    struct aio_lane *l = arg;
    inf_aio *e = l->eng;
    const int qd = (int)e->cfg.queue_depth;
    const int single = e->cfg.single_submit;
    const int overlap = e->cfg.overlap_events;
    aio_context_t ctx = 0;
    struct aio_piece *slots = calloc((size_t)qd, sizeof *slots);
    struct aio_piece *taken = calloc((size_t)qd, sizeof *taken);
    struct aio_piece *done = calloc((size_t)qd, sizeof *done);
    struct iocb *iocbs = calloc((size_t)qd, sizeof *iocbs);
    struct iocb **batch = calloc((size_t)qd + 1, sizeof *batch);
    struct io_event *events = calloc((size_t)qd + 1, sizeof *events);
    int64_t *res = calloc((size_t)qd, sizeof *res);
    int *free_slots = calloc((size_t)qd, sizeof *free_slots);
    struct iocb wake;
    int err = (slots && taken && done && iocbs && batch && events && res && free_slots) ? 0 : -ENOMEM;
    if (!err) {
        l->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (l->wake_fd < 0) err = -errno;
    }
    if (!err && sys_io_setup((unsigned)qd + 1, &ctx) < 0) err = -errno;
    int have_poll = 0;
    if (!err) {
        memset(&wake, 0, sizeof wake);
        wake.aio_lio_opcode = AIO_CMD_POLL;
        wake.aio_fildes = (uint32_t)l->wake_fd;
        wake.aio_buf = POLLIN;
        wake.aio_data = WAKE_TAG;
        struct iocb *w = &wake;
        have_poll = submit_all(ctx, &w, 1, 1) == 1;
    }
    aio_lane_ready(l, err);
    if (err) goto out;

    int nfree = qd;
    for (int i = 0; i < qd; i++) free_slots[i] = qd - 1 - i;
    int inflight = 0;
    for (;;) {
        int room = (overlap || inflight == 0) ? qd - inflight : 0;
        int n = 0;
        if (room > 0) {
            n = aio_take(l, taken, room, inflight == 0 ? AIO_TAKE_WAIT : AIO_TAKE_ARM);
            if (n < 0) break;
        }
        int ndone = 0, nb = 0;
        for (int i = 0; i < n; i++) {
            struct aio_piece *p = &taken[i];
            if (p->tail) {
                done[ndone] = *p;
                res[ndone++] = aio_exec_sync(l, p);
                continue;
            }
            int s = free_slots[--nfree];
            slots[s] = *p;
            slots[s].slot = s;
            struct iocb *cb = &iocbs[s];
            memset(cb, 0, sizeof *cb);
            cb->aio_lio_opcode = p->req->op == INF_AIO_READ ? IOCB_CMD_PREAD : IOCB_CMD_PWRITE;
            cb->aio_fildes = (uint32_t)p->req->fd;
            cb->aio_buf = (uint64_t)(uintptr_t)aio_piece_buf(p);
            cb->aio_nbytes = p->len;
            cb->aio_offset = (int64_t)aio_piece_pos(p);
            cb->aio_data = (uint64_t)s;
            batch[nb++] = cb;
        }
        if (nb) {
            long sub = submit_all(ctx, batch, nb, single);
            long ok = sub < 0 ? 0 : sub;
            inflight += (int)ok;
            /* Pieces the kernel refused run synchronously: slower, but the request completes and an
             * error (e.g. EBADF, EINVAL) comes back with its real errno. */
            for (long i = ok; i < nb; i++) {
                int s = (int)batch[i]->aio_data;
                done[ndone] = slots[s];
                res[ndone++] = aio_exec_sync(l, &slots[s]);
                slots[s].req = NULL;
                free_slots[nfree++] = s;
            }
        }
        if (ndone) aio_complete(e, done, res, ndone);
        if (inflight == 0) continue;
        long want = overlap ? 1 : inflight;
        struct timespec ms = {0, 1000000};
        int drained = 0;
        pthread_mutex_lock(&e->mu);
        drained = l->sleeping;
        pthread_mutex_unlock(&e->mu);
        long got = sys_io_getevents(ctx, want, qd + 1, events, (!have_poll && drained) ? &ms : NULL);
        if (got < 0) {
            if (errno == EINTR) continue;
            got = 0;
        }
        ndone = 0;
        for (long i = 0; i < got; i++) {
            if (events[i].data == WAKE_TAG) {
                uint64_t v;
                ssize_t rd = read(l->wake_fd, &v, sizeof v);
                (void)rd;
                struct iocb *w = &wake;
                have_poll = submit_all(ctx, &w, 1, 1) == 1;
                continue;
            }
            int s = (int)events[i].data;
            done[ndone] = slots[s];
            res[ndone] = (int64_t)events[i].res;
            if (res[ndone] < 0 || (uint64_t)res[ndone] < done[ndone].len)
                res[ndone] = aio_settle(l, &done[ndone], res[ndone]);
            slots[s].req = NULL;
            free_slots[nfree++] = s;
            inflight--;
            ndone++;
        }
        if (ndone) aio_complete(e, done, res, ndone);
    }
out:
    if (ctx) sys_io_destroy(ctx); /* cancels the pending poll */
    if (l->wake_fd >= 0) {
        pthread_mutex_lock(&e->mu);
        close(l->wake_fd);
        l->wake_fd = -1;
        pthread_mutex_unlock(&e->mu);
    }
    free(slots);
    free(taken);
    free(done);
    free(iocbs);
    free(batch);
    free(events);
    free(res);
    free(free_slots);
    return NULL;
}
