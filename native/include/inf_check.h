/* Page fingerprints for the swap-space integrity check: one 32-bit value per 4 KiB page, recorded
 * when the engine writes a page to a swap file and compared when it reads the page back, so that
 * bytes changed behind the engine's back (another process writing into the file, a disk that lost
 * or misplaced a write) are reported where they are read instead of training on them.
 *
 * Two modes:
 *   INF_CHECK_SAMPLED  a hash of the first and the last 8 bytes of each page (two cache lines a
 *                      page: ~1/32 of the bytes touched); catches any change of those 16 bytes.
 *   INF_CHECK_FULL     CRC-32C of the whole page; catches any change of the page.
 * A fingerprint is never 0, so callers can keep 0 in a table for "not recorded". The kernel
 * (scalar reference or the SSE4.2 crc32 instruction) is chosen at run time; INF_CHECK_KERNEL_*
 * forces one (tests compare them). */
#ifndef INF_CHECK_H
#define INF_CHECK_H

#include <stdint.h>

#include "inf_common.h"

#define INF_CHECK_PAGE 4096

#define INF_CHECK_SAMPLED 1
#define INF_CHECK_FULL 2

#define INF_CHECK_KERNEL_AUTO 0
#define INF_CHECK_KERNEL_SCALAR 1
#define INF_CHECK_KERNEL_SSE42 2

/* The kernel that `kernel` resolves to on this machine (AUTO: the fastest available); -ENOTSUP
 * when a forced kernel is not available, -EINVAL for an unknown value. */
INF_API int inf_check_kernel(int kernel);

/* CRC-32C (Castagnoli, reflected, as iSCSI/ext4) of n bytes, continuing from `crc` (start with 0):
 * inf_crc32c(0, "123456789", 9) == 0xE3069283. Negative kernel values are not allowed; an
 * unavailable kernel falls back to the scalar one. */
INF_API uint32_t inf_crc32c(int kernel, uint32_t crc, const void *buf, uint64_t n);

/* out[i] = fingerprint of page i of buf (npages pages of INF_CHECK_PAGE bytes). 0 or -errno
 * (-EINVAL: unknown mode, NULL pointers with npages > 0; -ENOTSUP: forced kernel missing). */
INF_API int inf_check_pages(int mode, int kernel, const void *buf, uint64_t npages, uint32_t *out);

/* Compares page i's fingerprint with expected[i] for every i whose expected[i] != 0 (0: never
 * recorded, not checked). Returns the number of pages that differ (0: all agree) or -errno. When
 * not NULL: *checked = the number of pages compared (expected != 0), *first_bad / *last_bad = the
 * index of the first and the last differing page (UINT64_MAX when none differ). */
INF_API int64_t inf_check_verify(int mode, int kernel, const void *buf, uint64_t npages,
                                 const uint32_t *expected, uint64_t *checked, uint64_t *first_bad,
                                 uint64_t *last_bad);

#endif
