/* The `mmap` backend's piece runner: memcpy between the caller's buffer and a shared mapping of the
 * file range. Page-cache based, for filesystems without O_DIRECT (tmpfs, some FUSE/overlay mounts);
 * never chosen by `auto`.
 *
 * Writes first reserve the range with fallocate (which also grows the file), so a full filesystem
 * is an ENOSPC here instead of a SIGBUS inside memcpy; where fallocate is unsupported the file is
 * grown with ftruncate under eng->grow_mu. Reads are clamped to the file size (a short count at
 * end of file), since touching a mapping beyond it raises SIGBUS. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "aio_internal.h"

static int grow_to(inf_aio *e, int fd, uint64_t pos, uint64_t len) {
    if (fallocate(fd, 0, (off_t)pos, (off_t)len) == 0) return 0;
    if (errno != EOPNOTSUPP && errno != ENOSYS) return -errno;
    int rc = 0;
    pthread_mutex_lock(&e->grow_mu);
    struct stat st;
    if (fstat(fd, &st) != 0) rc = -errno;
    else if ((uint64_t)st.st_size < pos + len && ftruncate(fd, (off_t)(pos + len)) != 0) rc = -errno;
    pthread_mutex_unlock(&e->grow_mu);
    return rc;
}

int64_t aio_mmap_exec(struct aio_lane *l, struct aio_piece *p) {
    inf_aio *e = l->eng;
    inf_aio_req *r = p->req;
    uint64_t pos = aio_piece_pos(p);
    uint64_t len = p->len;
    if (r->op == INF_AIO_READ) {
        struct stat st;
        if (fstat(r->fd, &st) != 0) return -errno;
        if (pos >= (uint64_t)st.st_size) return 0;
        if (len > (uint64_t)st.st_size - pos) len = (uint64_t)st.st_size - pos;
    } else {
        int rc = grow_to(e, r->fd, pos, len);
        if (rc) return rc;
    }
    uint64_t base = pos & ~((uint64_t)e->page - 1);
    uint64_t delta = pos - base;
    int prot = r->op == INF_AIO_READ ? PROT_READ : PROT_WRITE;
    int flags = MAP_SHARED | (r->op == INF_AIO_READ ? MAP_POPULATE : 0);
    char *m = mmap(NULL, len + delta, prot, flags, r->fd, (off_t)base);
    if (m == MAP_FAILED) return -errno;
    if (r->op == INF_AIO_READ) memcpy(aio_piece_buf(p), m + delta, len);
    else memcpy(m + delta, aio_piece_buf(p), len);
    munmap(m, len + delta);
    return (int64_t)len;
}
