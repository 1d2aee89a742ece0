/* What the loaded native library can do on this machine: CPU features found at run time and
 * which asynchronous I/O interfaces the kernel accepts. */
#ifndef INF_INFO_H
#define INF_INFO_H

#include "inf_common.h"

/* Bits of inf_cpu_features(). */
#define INF_CPU_AVX2     (1u << 0)
#define INF_CPU_FMA      (1u << 1)
#define INF_CPU_F16C     (1u << 2)
#define INF_CPU_AVX512F  (1u << 3)
#define INF_CPU_AVX512BW (1u << 4)
#define INF_CPU_NEON     (1u << 5)

/* Library version, as "MAJOR.MINOR.PATCH". */
INF_API const char *inf_version(void);

/* Bit set of INF_CPU_* features usable by this process (CPU and OS support both checked). */
INF_API unsigned inf_cpu_features(void);

/* 1 when the kernel accepts io_uring_setup for this process, 0 when it refuses (ENOSYS, EPERM,
 * io_uring_disabled), never negative. */
INF_API int inf_probe_io_uring(void);

/* 1 when the kernel accepts io_setup (Linux native AIO), 0 otherwise. */
INF_API int inf_probe_libaio(void);

#endif
