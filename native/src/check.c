/* Page fingerprints of the swap-space integrity check (inf_check.h): the sampled hash, CRC-32C
 * with a scalar (slice-by-8 table) reference and the SSE4.2 crc32 instruction, chosen at run time. */
#include "inf_check.h"

#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define HAVE_SSE42_KERNEL 1
#else
#define HAVE_SSE42_KERNEL 0
#endif

#define PAGE INF_CHECK_PAGE
#define CRC32C_POLY 0x82F63B78u /* reflected Castagnoli polynomial */

static inline uint32_t nonzero(uint32_t h) { return h ? h : 1u; }

static inline uint64_t load64(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, sizeof w);
    return w;
}

/* ---------------------------------------------------------------- sampled (no SIMD: 2 loads) */
static inline uint32_t sampled_page(const uint8_t *p) {
    uint64_t x = load64(p) * 0x9E3779B97F4A7C15ull ^ load64(p + PAGE - 8);
    x ^= x >> 33; /* murmur3's fmix64: every input bit reaches every output bit */
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ull;
    x ^= x >> 33;
    return nonzero((uint32_t)x ^ (uint32_t)(x >> 32));
}

/* ---------------------------------------------------------------- CRC-32C, scalar reference */
static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (CRC32C_POLY & (0u - (c & 1u)));
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

/* raw update (no pre/post inversion) of `c` over n bytes */
static uint32_t crc_scalar(uint32_t c, const uint8_t *p, uint64_t n) {
    while (n && ((uintptr_t)p & 7)) {
        c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xFF];
        n--;
    }
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t w = load64(p) ^ c; /* little-endian: byte 0 is the low byte */
        c = crc_table[7][w & 0xFF] ^ crc_table[6][(w >> 8) & 0xFF] ^
            crc_table[5][(w >> 16) & 0xFF] ^ crc_table[4][(w >> 24) & 0xFF] ^
            crc_table[3][(w >> 32) & 0xFF] ^ crc_table[2][(w >> 40) & 0xFF] ^
            crc_table[1][(w >> 48) & 0xFF] ^ crc_table[0][w >> 56];
    }
    while (n--) c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xFF];
    return c;
}

static void full_pages_scalar(const uint8_t *buf, uint64_t npages, uint32_t *out) {
    for (uint64_t i = 0; i < npages; i++)
        out[i] = nonzero(~crc_scalar(0xFFFFFFFFu, buf + i * PAGE, PAGE));
}

/* ---------------------------------------------------------------- CRC-32C, SSE4.2 */
#if HAVE_SSE42_KERNEL
__attribute__((target("sse4.2"))) static uint32_t crc_sse42(uint32_t c, const uint8_t *p,
                                                             uint64_t n) {
    uint64_t c64 = c;
    for (; n >= 8; n -= 8, p += 8) c64 = _mm_crc32_u64(c64, load64(p));
    c = (uint32_t)c64;
    while (n--) c = _mm_crc32_u8(c, *p++);
    return c;
}

/* Four pages at a time: the crc32 instruction has a latency of 3 cycles and a throughput of 1, so
 * four independent chains keep it busy (one page's chain alone runs at a third of the speed). */
__attribute__((target("sse4.2"))) static void full_pages_sse42(const uint8_t *buf,
                                                               uint64_t npages, uint32_t *out) {
    uint64_t i = 0;
    for (; i + 4 <= npages; i += 4) {
        const uint8_t *p = buf + i * PAGE;
        uint64_t c0 = 0xFFFFFFFFu, c1 = c0, c2 = c0, c3 = c0;
        for (size_t k = 0; k < PAGE; k += 8) {
            c0 = _mm_crc32_u64(c0, load64(p + k));
            c1 = _mm_crc32_u64(c1, load64(p + PAGE + k));
            c2 = _mm_crc32_u64(c2, load64(p + 2 * PAGE + k));
            c3 = _mm_crc32_u64(c3, load64(p + 3 * PAGE + k));
        }
        out[i] = nonzero(~(uint32_t)c0);
        out[i + 1] = nonzero(~(uint32_t)c1);
        out[i + 2] = nonzero(~(uint32_t)c2);
        out[i + 3] = nonzero(~(uint32_t)c3);
    }
    for (; i < npages; i++) out[i] = nonzero(~crc_sse42(0xFFFFFFFFu, buf + i * PAGE, PAGE));
}
#endif

/* ---------------------------------------------------------------- dispatch */
static int sse42_available(void) {
#if HAVE_SSE42_KERNEL
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") ? 1 : 0;
#else
    return 0;
#endif
}

int inf_check_kernel(int kernel) {
    switch (kernel) {
    case INF_CHECK_KERNEL_AUTO:
        return sse42_available() ? INF_CHECK_KERNEL_SSE42 : INF_CHECK_KERNEL_SCALAR;
    case INF_CHECK_KERNEL_SCALAR:
        return INF_CHECK_KERNEL_SCALAR;
    case INF_CHECK_KERNEL_SSE42:
        return sse42_available() ? INF_CHECK_KERNEL_SSE42 : -ENOTSUP;
    default:
        return -EINVAL;
    }
}

uint32_t inf_crc32c(int kernel, uint32_t crc, const void *buf, uint64_t n) {
    const uint8_t *p = buf;
    if (!n) return crc;
#if HAVE_SSE42_KERNEL
    if (inf_check_kernel(kernel) == INF_CHECK_KERNEL_SSE42) return ~crc_sse42(~crc, p, n);
#endif
    pthread_once(&crc_once, crc_init);
    return ~crc_scalar(~crc, p, n);
}

typedef void (*pages_fn)(const uint8_t *, uint64_t, uint32_t *);

static void sampled_pages(const uint8_t *buf, uint64_t npages, uint32_t *out) {
    for (uint64_t i = 0; i < npages; i++) out[i] = sampled_page(buf + i * PAGE);
}

/* The page kernel for (mode, kernel), or NULL with *err set. */
static pages_fn resolve(int mode, int kernel, int *err) {
    int k = inf_check_kernel(kernel);
    if (k < 0) {
        *err = k;
        return NULL;
    }
    if (mode == INF_CHECK_SAMPLED) return sampled_pages;
    if (mode != INF_CHECK_FULL) {
        *err = -EINVAL;
        return NULL;
    }
#if HAVE_SSE42_KERNEL
    if (k == INF_CHECK_KERNEL_SSE42) return full_pages_sse42;
#endif
    pthread_once(&crc_once, crc_init);
    return full_pages_scalar;
}

int inf_check_pages(int mode, int kernel, const void *buf, uint64_t npages, uint32_t *out) {
    int err = 0;
    pages_fn fn = resolve(mode, kernel, &err);
    if (!fn) return err;
    if (!npages) return 0;
    if (!buf || !out) return -EINVAL;
    fn(buf, npages, out);
    return 0;
}

int64_t inf_check_verify(int mode, int kernel, const void *buf, uint64_t npages,
                         const uint32_t *expected, uint64_t *checked, uint64_t *first_bad,
                         uint64_t *last_bad) {
    int err = 0;
    pages_fn fn = resolve(mode, kernel, &err);
    uint64_t first = UINT64_MAX, last = UINT64_MAX, compared = 0;
    int64_t bad = 0;
    if (!fn) return err;
    if (npages && (!buf || !expected)) return -EINVAL;
    const uint8_t *p = buf;
    if (mode == INF_CHECK_SAMPLED) {
        for (uint64_t i = 0; i < npages; i++) {
            if (!expected[i]) continue;
            compared++;
            if (sampled_page(p + i * PAGE) != expected[i]) {
                if (!bad++) first = i;
                last = i;
            }
        }
    } else {
        uint32_t got[64];
        for (uint64_t i = 0; i < npages; i += 64) {
            uint64_t n = npages - i < 64 ? npages - i : 64, any = 0;
            for (uint64_t j = 0; j < n; j++) any |= expected[i + j];
            if (!any) continue; /* nothing recorded here: do not read the pages at all */
            fn(p + i * PAGE, n, got);
            for (uint64_t j = 0; j < n; j++) {
                if (!expected[i + j]) continue;
                compared++;
                if (got[j] != expected[i + j]) {
                    if (!bad++) first = i + j;
                    last = i + j;
                }
            }
        }
    }
    if (checked) *checked = compared;
    if (first_bad) *first_bad = first;
    if (last_bad) *last_bad = last;
    return bad;
}
