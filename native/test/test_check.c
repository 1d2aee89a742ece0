/* Small C test of the swap-space integrity check: CRC-32C known answers, the SSE4.2 kernel against
 * the scalar reference and a bitwise CRC at every length and misalignment, fingerprints never 0,
 * verify finding exactly the changed pages (first and last), unrecorded pages skipped, and the
 * sampled mode's blind spot (bytes between a page's first and last 8) documented by a test.
 *   ./test_check      exit 0 = pass */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "inf_check.h"

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

static uint32_t crc_bitwise(const uint8_t *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    while (n--) {
        c ^= *p++;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
    }
    return ~c;
}

static void fill(uint8_t *p, size_t n, uint64_t seed) {
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p[i] = (uint8_t)x;
    }
}

int main(void) {
    const int kernels[] = {INF_CHECK_KERNEL_SCALAR, INF_CHECK_KERNEL_SSE42};
    int have_sse42 = inf_check_kernel(INF_CHECK_KERNEL_SSE42) == INF_CHECK_KERNEL_SSE42;
    CHECK(inf_check_kernel(99) == -EINVAL, "unknown kernel");
    CHECK(inf_check_kernel(INF_CHECK_KERNEL_AUTO) > 0, "auto resolves");
    printf("kernel auto = %d (sse4.2 %s)\n", inf_check_kernel(0), have_sse42 ? "yes" : "no");

    /* known answers */
    for (int k = 0; k < 2; k++) {
        if (kernels[k] == INF_CHECK_KERNEL_SSE42 && !have_sse42) continue;
        CHECK(inf_crc32c(kernels[k], 0, "123456789", 9) == 0xE3069283u, "kernel %d", kernels[k]);
        uint8_t zeros[32] = {0};
        CHECK(inf_crc32c(kernels[k], 0, zeros, 32) == 0x8A9136AAu, "32 zeros, kernel %d", kernels[k]);
        /* continuation */
        CHECK(inf_crc32c(kernels[k], inf_crc32c(kernels[k], 0, "1234", 4), "56789", 5) ==
                  0xE3069283u, "continued, kernel %d", kernels[k]);
    }

    /* every length and misalignment against the bitwise reference */
    enum { N = 4 * INF_CHECK_PAGE + 64 };
    uint8_t *buf = aligned_alloc(INF_CHECK_PAGE, 2 * N);
    fill(buf, 2 * N, 7);
    for (size_t off = 0; off < 9; off++)
        for (size_t n = 0; n < 300; n += (n < 40 ? 1 : 37)) {
            uint32_t want = crc_bitwise(buf + off, n);
            for (int k = 0; k < 2; k++) {
                if (kernels[k] == INF_CHECK_KERNEL_SSE42 && !have_sse42) continue;
                CHECK(inf_crc32c(kernels[k], 0, buf + off, n) == want, "off %zu n %zu kernel %d", off,
                      n, kernels[k]);
            }
        }

    /* page fingerprints: kernels agree, full = crc of the page, never 0 */
    enum { PAGES = 37 };
    uint8_t *pages = aligned_alloc(INF_CHECK_PAGE, PAGES * INF_CHECK_PAGE);
    fill(pages, PAGES * INF_CHECK_PAGE, 11);
    memset(pages + 3 * INF_CHECK_PAGE, 0, INF_CHECK_PAGE); /* a zero page */
    uint32_t a[PAGES], b[PAGES], s[PAGES];
    CHECK(inf_check_pages(INF_CHECK_FULL, INF_CHECK_KERNEL_SCALAR, pages, PAGES, a) == 0, "scalar");
    if (have_sse42) {
        CHECK(inf_check_pages(INF_CHECK_FULL, INF_CHECK_KERNEL_SSE42, pages, PAGES, b) == 0, "sse42");
        CHECK(memcmp(a, b, sizeof a) == 0, "scalar and sse4.2 page crcs differ");
    } else {
        CHECK(inf_check_pages(INF_CHECK_FULL, INF_CHECK_KERNEL_SSE42, pages, PAGES, b) == -ENOTSUP,
              "forced missing kernel");
    }
    CHECK(inf_check_pages(INF_CHECK_SAMPLED, 0, pages, PAGES, s) == 0, "sampled");
    CHECK(inf_check_pages(7, 0, pages, PAGES, s) == -EINVAL, "unknown mode");
    CHECK(inf_check_pages(INF_CHECK_SAMPLED, 0, NULL, 1, s) == -EINVAL, "NULL buffer");
    for (int i = 0; i < PAGES; i++) {
        uint32_t c = crc_bitwise(pages + (size_t)i * INF_CHECK_PAGE, INF_CHECK_PAGE);
        CHECK(a[i] == (c ? c : 1u), "page %d", i);
        CHECK(a[i] != 0 && s[i] != 0, "page %d fingerprint 0", i);
    }

    /* verify: clean, then changed pages found exactly, unrecorded pages skipped */
    for (int mode = INF_CHECK_SAMPLED; mode <= INF_CHECK_FULL; mode++) {
        uint32_t *want = mode == INF_CHECK_FULL ? a : s;
        uint64_t first = 0, last = 0;
        CHECK(inf_check_verify(mode, 0, pages, PAGES, want, NULL, &first, &last) == 0, "clean mode %d", mode);
        CHECK(first == UINT64_MAX && last == UINT64_MAX, "no bad pages mode %d", mode);
        uint8_t *copy = aligned_alloc(INF_CHECK_PAGE, PAGES * INF_CHECK_PAGE);
        memcpy(copy, pages, PAGES * INF_CHECK_PAGE);
        /* random bytes over [page 5 + 100, page 9 + 8): touches the last word of 5..8, first of 9 */
        fill(copy + 5 * INF_CHECK_PAGE + 100, 4 * INF_CHECK_PAGE - 92, 99);
        uint64_t checked = 0;
        int64_t bad = inf_check_verify(mode, 0, copy, PAGES, want, &checked, &first, &last);
        CHECK(checked == PAGES, "mode %d checked %llu", mode, (unsigned long long)checked);
        CHECK(bad == 5 && first == 5 && last == 9, "mode %d: bad %lld first %llu last %llu", mode,
              (long long)bad, (unsigned long long)first, (unsigned long long)last);
        uint32_t skip[PAGES];
        memcpy(skip, want, sizeof skip);
        skip[5] = skip[9] = 0; /* never recorded: not checked */
        bad = inf_check_verify(mode, 0, copy, PAGES, skip, &checked, &first, &last);
        CHECK(checked == PAGES - 2, "mode %d skip checked %llu", mode, (unsigned long long)checked);
        CHECK(bad == 3 && first == 6 && last == 8, "mode %d skip: bad %lld", mode, (long long)bad);
        /* zeros over a whole page */
        memcpy(copy, pages, PAGES * INF_CHECK_PAGE);
        memset(copy + 20 * INF_CHECK_PAGE, 0, INF_CHECK_PAGE);
        CHECK(inf_check_verify(mode, 0, copy, PAGES, want, NULL, &first, &last) == 1 && first == 20,
              "mode %d zero page", mode);
        /* one byte in the middle of a page: only the full check sees it */
        memcpy(copy, pages, PAGES * INF_CHECK_PAGE);
        copy[30 * INF_CHECK_PAGE + 2048] ^= 1;
        bad = inf_check_verify(mode, 0, copy, PAGES, want, NULL, NULL, NULL);
        CHECK(bad == (mode == INF_CHECK_FULL ? 1 : 0), "mode %d mid-page byte: %lld", mode,
              (long long)bad);
        /* one byte in a page's last 8 bytes: both see it */
        memcpy(copy, pages, PAGES * INF_CHECK_PAGE);
        copy[31 * INF_CHECK_PAGE + INF_CHECK_PAGE - 3] ^= 0x80;
        CHECK(inf_check_verify(mode, 0, copy, PAGES, want, NULL, &first, NULL) == 1 && first == 31,
              "mode %d edge byte", mode);
        free(copy);
    }
    free(pages);
    free(buf);
    if (failures) {
        fprintf(stderr, "%d failures\n", failures);
        return 1;
    }
    printf("test_check: ok\n");
    return 0;
}
