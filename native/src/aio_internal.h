/* Private to the aio component: the engine, requests, pieces and lanes shared by the backends.
 *
 * [Note: aio lanes and pieces]
 * A request is cut into pieces: `body` bytes (a multiple of the file's alignment) in pieces of at
 * most block_size, then at most one tail piece (nbytes % align bytes) run synchronously through a
 * bounce buffer. Pending requests form one FIFO under eng->mu; a lane takes pieces from its head
 * with aio_take() whenever it has free slots and hands results back with aio_complete(). The last
 * completed piece marks the request done (release store) and wakes waiters on eng->done_cv.
 * A kernel lane (io_uring, libaio) waiting in the kernel with free slots sets `sleeping`; a
 * submitter that finds it set writes the lane's eventfd, whose read/poll sits in the lane's queue,
 * so new work never waits for an unrelated completion. */
#ifndef INF_AIO_INTERNAL_H
#define INF_AIO_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "inf_aio.h"

struct inf_aio_req {
    inf_aio *eng;
    int op;
    int fd;
    uint32_t align;
    char *buf;
    uint64_t nbytes;
    uint64_t offset;
    uint64_t body;          /* bytes moved by aligned pieces; nbytes - body is the tail */
    uint64_t block;         /* piece size */
    uint32_t npieces;       /* body pieces + (tail ? 1 : 0) */
    uint32_t next_piece;    /* dispatch cursor, under eng->mu */
    uint32_t pieces_done;   /* under eng->mu */
    uint64_t valid_end;     /* end (relative) of the contiguous prefix moved; < nbytes on EOF */
    int64_t error;          /* -errno of the failed piece with the lowest offset, or 0 */
    uint64_t err_rel;       /* its offset relative to the request */
    int done;               /* atomic: 1 once every piece finished */
    struct inf_aio_req *next; /* FIFO link while pieces remain to dispatch */
};

struct aio_piece {
    inf_aio_req *req;
    uint64_t off;   /* relative to the request start */
    uint64_t len;
    int tail;       /* 1: the unaligned tail, run by aio_exec_sync */
    int slot;       /* backend slot index while in flight */
};

enum aio_take_mode {
    AIO_TAKE_WAIT = 0,  /* block until work arrives or the engine stops (then return -1) */
    AIO_TAKE_POLL = 1,  /* return what is there, maybe 0 */
    AIO_TAKE_ARM = 2,   /* like POLL; when the queue is drained set lane->sleeping */
};

struct aio_lane {
    inf_aio *eng;
    int index;
    pthread_t thread;
    int started;
    int wake_fd;        /* eventfd of kernel lanes, -1 otherwise */
    int sleeping;       /* under eng->mu: waiting in the kernel with free slots */
    int setup_done;     /* under eng->mu */
    int setup_err;
    char *bounce;       /* aligned scratch for tails */
    size_t bounce_size;
};

struct inf_aio {
    struct inf_aio_config cfg;  /* backend resolved (never AUTO) */
    pthread_mutex_t mu;
    pthread_cond_t work_cv;     /* lanes blocked in aio_take(WAIT) */
    pthread_cond_t done_cv;     /* request waiters, destroy, lane setup */
    pthread_mutex_t tail_mu;    /* serializes read-modify-write tails */
    pthread_mutex_t grow_mu;    /* serializes file growth in the mmap backend */
    inf_aio_req *head, *last;   /* requests with pieces left to dispatch */
    uint64_t outstanding;       /* submitted and not done */
    uint32_t waiters;           /* threads inside inf_aio_req_wait */
    int closing;                /* no new submissions */
    int stopping;               /* lanes exit */
    uint32_t nlanes;
    struct aio_lane *lanes;
    size_t page;
};

/* Lane entry points, one per backend (each reports setup with aio_lane_ready first). */
void *aio_uring_lane(void *lane);
void *aio_libaio_lane(void *lane);
void *aio_threads_lane(void *lane);
int aio_uring_available(void);
int aio_libaio_available(void);

/* Core services for the lanes (aio_core.c). */
void aio_lane_ready(struct aio_lane *l, int err);
int aio_take(struct aio_lane *l, struct aio_piece *out, int max, int mode);
void aio_complete(inf_aio *e, struct aio_piece *p, const int64_t *res, int n);
/* Run one piece with blocking syscalls (pread/pwrite loop, tail bounce, or mmap copy). */
int64_t aio_exec_sync(struct aio_lane *l, struct aio_piece *p);
/* Fix up a kernel completion: finish short writes and retry EAGAIN/EINTR synchronously. */
int64_t aio_settle(struct aio_lane *l, struct aio_piece *p, int64_t res);
int64_t aio_mmap_exec(struct aio_lane *l, struct aio_piece *p);

static inline char *aio_piece_buf(const struct aio_piece *p) { return p->req->buf + p->off; }
static inline uint64_t aio_piece_pos(const struct aio_piece *p) { return p->req->offset + p->off; }

#endif
