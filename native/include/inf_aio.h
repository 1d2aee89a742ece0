/* Asynchronous file I/O engine: moves bytes between aligned host buffers and byte ranges of files
 * (O_DIRECT or page cache) with many requests in flight.
 *
 * One engine owns `thread_count` worker lanes; each lane keeps up to `queue_depth` pieces of
 * `block_size` bytes in flight through its backend (an io_uring ring, a Linux AIO context, or, for
 * the threads/mmap backends, that many blocking pread/pwrite/memcpy workers). A request is split
 * into pieces; lanes pull pieces from one FIFO, so a single large request uses every lane.
 *
 * Requests are submitted from any thread and waited from any thread. Every function returns 0 (or
 * a count) on success and -errno on failure; nothing aborts the process.
 *
 * Direct-I/O rules (a file submitted with align > 1): `buf` must be 512-aligned, `offset` a
 * multiple of `align`. `nbytes` is free: the final piece that is not a multiple of `align` (the
 * tail) is read through an aligned bounce buffer (padded read, only the requested bytes are
 * copied out) and written read-modify-write through the same bounce buffer (the whole padded
 * block is written back with its old bytes; a file that this extends is truncated back to the
 * requested end). The page cache is never used for a direct file, the tail included. */
#ifndef INF_AIO_H
#define INF_AIO_H

#include <stdint.h>

#include "inf_common.h"

enum inf_aio_backend {
    INF_AIO_AUTO = 0,     /* io_uring, else libaio, else threads */
    INF_AIO_IO_URING = 1, /* raw io_uring syscalls */
    INF_AIO_LIBAIO = 2,   /* raw io_setup/io_submit/io_getevents syscalls */
    INF_AIO_THREADS = 3,  /* blocking pread/pwrite workers */
    INF_AIO_MMAP = 4,     /* memcpy to/from mmap'd file ranges (page cache; for tmpfs and friends) */
};

enum inf_aio_op { INF_AIO_READ = 0, INF_AIO_WRITE = 1 };

struct inf_aio_config {
    int backend;             /* enum inf_aio_backend */
    uint32_t queue_depth;    /* pieces in flight per lane, 1..4096 */
    uint32_t thread_count;   /* lanes, 1..64 */
    uint64_t block_size;     /* piece size in bytes, a multiple of 4096 */
    int single_submit;       /* 1: one piece per submit syscall; 0: batch the free slots */
    int overlap_events;      /* 1: refill a slot as soon as it completes; 0: submit a batch, wait for all */
};

typedef struct inf_aio inf_aio;
typedef struct inf_aio_req inf_aio_req;

/* 1 when `backend` works in this process (the kernel accepts it), 0 otherwise. */
INF_API int inf_aio_backend_available(int backend);

/* Static name of a backend ("io_uring", "libaio", "threads", "mmap", "auto"), NULL if unknown. */
INF_API const char *inf_aio_backend_name(int backend);

/* Start an engine. AUTO resolves to the first available kernel backend. -EINVAL names a bad
 * field (see inf_aio_config); other errors come from the backend setup (-ENOSYS, -EPERM, -ENOMEM). */
INF_API int inf_aio_create(const struct inf_aio_config *cfg, inf_aio **out);

/* The backend actually running (never AUTO). */
INF_API int inf_aio_backend(const inf_aio *eng);

/* Wait for every submitted request, stop the lanes and free the engine. Requests not yet freed
 * with inf_aio_req_free stay valid (done) and must still be freed by the caller. */
INF_API int inf_aio_destroy(inf_aio *eng);

/* Queue a read or write of `nbytes` between `buf` and `fd` at `offset`. `align` is the file's
 * direct-I/O alignment (1 for a buffered fd). -EINVAL when buf/offset break the direct-I/O rules,
 * -ESHUTDOWN when the engine is being destroyed. On success *out is a request to wait on and free. */
INF_API int inf_aio_submit(inf_aio *eng, int op, int fd, uint32_t align, void *buf,
                           uint64_t nbytes, uint64_t offset, inf_aio_req **out);

/* 1 when the request has finished (successfully or not), 0 otherwise. */
INF_API int inf_aio_req_done(const inf_aio_req *req);

/* Block until the request finishes or `timeout_ns` passes (< 0: no limit). 0 or -ETIMEDOUT. */
INF_API int inf_aio_req_wait(inf_aio_req *req, int64_t timeout_ns);

/* Result of a finished request: bytes moved (a contiguous prefix; fewer than asked only for a read
 * that reached end of file) or -errno of the first failed piece, whose file offset goes to
 * *err_offset when not NULL. -EBUSY while the request is in flight. */
INF_API int64_t inf_aio_req_result(const inf_aio_req *req, uint64_t *err_offset);

/* Free a finished request; -EBUSY (and nothing freed) while it is in flight. */
INF_API int inf_aio_req_free(inf_aio_req *req);

/* Direct-I/O alignment of an open file from statx(STATX_DIOALIGN): file offset/length unit and
 * memory unit. Falls back to 4096/4096 when the kernel or filesystem does not report it. */
INF_API int inf_aio_dio_align(int fd, uint32_t *offset_align, uint32_t *mem_align);

/* Number of pages of fd's byte range [offset, offset+len) resident in the page cache (mincore on
 * a shared read-only mapping; never faults pages in). len == 0 means up to end of file. */
INF_API int64_t inf_aio_resident_pages(int fd, uint64_t offset, uint64_t len);

/* Anonymous page-aligned (or `align`-aligned, a power of two >= 4096) memory for I/O buffers;
 * zero-filled and populated at once; huge pages are advised for sizes >= 2 MiB. Free with
 * inf_aio_buf_free(ptr, nbytes). */
INF_API int inf_aio_buf_alloc(uint64_t nbytes, uint64_t align, void **out);
INF_API int inf_aio_buf_free(void *ptr, uint64_t nbytes);

#endif
