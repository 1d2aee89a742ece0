/* The `threads` backend (and the worker pool of `mmap`): blocking workers, one piece each at a
 * time. Portable (only pread/pwrite), used where neither io_uring nor Linux AIO is allowed. */
#define _GNU_SOURCE
#include <stdint.h>

#include "aio_internal.h"

void *aio_threads_lane(void *arg) {
    struct aio_lane *l = arg;
    aio_lane_ready(l, 0);
    struct aio_piece p;
    while (aio_take(l, &p, 1, AIO_TAKE_WAIT) > 0) {
        int64_t res = aio_exec_sync(l, &p);
        aio_complete(l->eng, &p, &res, 1);
    }
    return NULL;
}
