/* Small C test of the aio engine: round trips with tails on every available backend, many requests
 * in flight, errno propagation (EBADF), short reads at end of file, page-cache residency of direct
 * I/O, engine teardown with requests in flight.
 *   ./test_aio [DIR]      (DIR on a real disk, default /var/tmp); exit 0 = pass, 77 = skipped */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "inf_aio.h"

static int failures;
#define CHECK(cond, ...)                                                                     \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                  \
            fprintf(stderr, __VA_ARGS__);                                                    \
            fputc('\n', stderr);                                                             \
            failures++;                                                                      \
        }                                                                                    \
    } while (0)

static void fill(unsigned char *p, size_t n, uint64_t seed) {
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p[i] = (unsigned char)x;
    }
}

static int64_t run(inf_aio *e, int op, int fd, uint32_t align, void *buf, uint64_t n, uint64_t off) {
    inf_aio_req *r = NULL;
    int rc = inf_aio_submit(e, op, fd, align, buf, n, off, &r);
    if (rc) return rc;
    inf_aio_req_wait(r, -1);
    int64_t res = inf_aio_req_result(r, NULL);
    inf_aio_req_free(r);
    return res;
}

static int open_file(const char *path, int direct) {
    return open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | (direct ? O_DIRECT : 0), 0600);
}

static void test_backend(int backend, const char *dir) {
    const char *name = inf_aio_backend_name(backend);
    if (!inf_aio_backend_available(backend)) {
        printf("skip %s: not available on this kernel\n", name);
        return;
    }
    int direct = backend != INF_AIO_MMAP;
    char path[4096];
    snprintf(path, sizeof path, "%s/test_aio_%s_%d.dat", dir, name, (int)getpid());
    int fd = open_file(path, direct);
    CHECK(fd >= 0, "%s: open %s: %s", name, path, strerror(errno));
    if (fd < 0) return;
    uint32_t align = 1;
    if (direct) CHECK(inf_aio_dio_align(fd, &align, NULL) == 0, "%s: dio_align", name);

    struct inf_aio_config cfg = {backend, 8, 2, 64 << 10, 0, 1};
    inf_aio *e = NULL;
    int rc = inf_aio_create(&cfg, &e);
    CHECK(rc == 0, "%s: create: %d", name, rc);
    if (rc) {
        close(fd);
        unlink(path);
        return;
    }
    CHECK(inf_aio_backend(e) == backend, "%s: backend in use %d", name, inf_aio_backend(e));

    /* Round trip of a size with a block remainder and an unaligned tail. */
    const uint64_t n = (1 << 20) + (3 << 16) + 1000;
    void *w = NULL, *r = NULL;
    inf_aio_buf_alloc(n, 4096, &w);
    inf_aio_buf_alloc(n, 4096, &r);
    fill(w, n, (uint64_t)backend);
    memset(r, 0, n);
    int64_t got = run(e, INF_AIO_WRITE, fd, align, w, n, 0);
    CHECK(got == (int64_t)n, "%s: write returned %lld", name, (long long)got);
    struct stat st;
    fstat(fd, &st);
    CHECK((uint64_t)st.st_size == n, "%s: size %lld after write of %llu", name, (long long)st.st_size,
          (unsigned long long)n);
    got = run(e, INF_AIO_READ, fd, align, r, n, 0);
    CHECK(got == (int64_t)n, "%s: read returned %lld", name, (long long)got);
    CHECK(memcmp(w, r, n) == 0, "%s: read back differs", name);

    /* Reading past the end is a short count (the contiguous prefix), not an error. */
    got = run(e, INF_AIO_READ, fd, align, r, 1 << 20, 1 << 20);
    CHECK(got == (int64_t)(n - (1 << 20)), "%s: short read returned %lld", name, (long long)got);

    /* Rewrite an inner unaligned range: bytes after it in the same block must survive. */
    fill(w, 700, 99);
    got = run(e, INF_AIO_WRITE, fd, align, w, 700, 4096);
    CHECK(got == 700, "%s: inner tail write %lld", name, (long long)got);
    got = run(e, INF_AIO_READ, fd, align, r, 8192, 0);
    CHECK(got == 8192, "%s: reread %lld", name, (long long)got);
    unsigned char *rb = r;
    CHECK(memcmp(rb + 4096, w, 700) == 0, "%s: inner tail bytes", name);
    fill(w, n, (uint64_t)backend);
    CHECK(memcmp(rb + 4096 + 700, (unsigned char *)w + 4096 + 700, 8192 - 4096 - 700) == 0,
          "%s: bytes after the inner tail were clobbered", name);

    /* Many requests in flight at once, then destroy waits for the last ones. */
    enum { K = 256 };
    inf_aio_req *reqs[K];
    for (int i = 0; i < K; i++) {
        rc = inf_aio_submit(e, INF_AIO_WRITE, fd, align, (char *)w + (size_t)(i % 16) * 4096, 4096,
                            (uint64_t)i * 4096, &reqs[i]);
        CHECK(rc == 0, "%s: submit %d: %d", name, i, rc);
    }
    for (int i = 0; i < K; i++) {
        inf_aio_req_wait(reqs[i], -1);
        CHECK(inf_aio_req_result(reqs[i], NULL) == 4096, "%s: req %d", name, i);
        inf_aio_req_free(reqs[i]);
    }

    if (direct) {
        CHECK(inf_aio_resident_pages(fd, 0, 0) == 0, "%s: %lld pages of a direct file are cached", name,
              (long long)inf_aio_resident_pages(fd, 0, 0));
        /* Misaligned buffer / offset are refused before any I/O. */
        inf_aio_req *bad = NULL;
        CHECK(inf_aio_submit(e, INF_AIO_READ, fd, align, (char *)r + 1, 4096, 0, &bad) == -EINVAL,
              "%s: misaligned buffer accepted", name);
        CHECK(inf_aio_submit(e, INF_AIO_READ, fd, align, r, 4096, 100, &bad) == -EINVAL,
              "%s: misaligned offset accepted", name);
    }

    /* errno travels back: writing through a read-only descriptor is EBADF. */
    int rofd = open(path, O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
    got = run(e, INF_AIO_WRITE, rofd, align, w, 1 << 16, 0);
    CHECK(got == -EBADF || (backend == INF_AIO_MMAP && got == -EBADF) || got == -EACCES,
          "%s: write to O_RDONLY fd gave %lld", name, (long long)got);
    close(rofd);

    /* Destroy with requests in flight: it must wait for them. */
    for (int i = 0; i < 16; i++)
        inf_aio_submit(e, INF_AIO_WRITE, fd, align, w, 1 << 16, (uint64_t)i << 16, &reqs[i]);
    CHECK(inf_aio_destroy(e) == 0, "%s: destroy", name);
    for (int i = 0; i < 16; i++) {
        CHECK(inf_aio_req_done(reqs[i]), "%s: request %d not done after destroy", name, i);
        inf_aio_req_free(reqs[i]);
    }
    inf_aio_buf_free(w, n);
    inf_aio_buf_free(r, n);
    close(fd);
    unlink(path);
    printf("ok %s\n", name);
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "/var/tmp";
    char probe[4096];
    snprintf(probe, sizeof probe, "%s/test_aio_probe_%d", dir, (int)getpid());
    int fd = open(probe, O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0600);
    if (fd < 0) {
        printf("skip: %s does not take O_DIRECT (%s); pass a directory on a real disk\n", dir,
               strerror(errno));
        return 77;
    }
    close(fd);
    unlink(probe);
    struct inf_aio_config bad = {INF_AIO_THREADS, 0, 1, 4096, 0, 1};
    inf_aio *e = NULL;
    CHECK(inf_aio_create(&bad, &e) == -EINVAL, "queue_depth 0 accepted");
    bad.queue_depth = 4;
    bad.block_size = 1000;
    CHECK(inf_aio_create(&bad, &e) == -EINVAL, "block_size 1000 accepted");
    for (int b = INF_AIO_IO_URING; b <= INF_AIO_MMAP; b++) test_backend(b, dir);
    if (failures) {
        fprintf(stderr, "%d failure(s)\n", failures);
        return 1;
    }
    printf("all passed\n");
    return 0;
}
