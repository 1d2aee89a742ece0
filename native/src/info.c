/* Run-time capability probes: CPU features and kernel async I/O interfaces. */
#define _GNU_SOURCE
#include "inf_info.h"

#include <errno.h>
#include <linux/aio_abi.h>
#include <linux/io_uring.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

const char *inf_version(void) { return "0.1.0"; }

unsigned inf_cpu_features(void) {
    unsigned f = 0;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) f |= INF_CPU_AVX2;
    if (__builtin_cpu_supports("fma")) f |= INF_CPU_FMA;
    if (__builtin_cpu_supports("f16c")) f |= INF_CPU_F16C;
    if (__builtin_cpu_supports("avx512f")) f |= INF_CPU_AVX512F;
    if (__builtin_cpu_supports("avx512bw")) f |= INF_CPU_AVX512BW;
#elif defined(__aarch64__)
    f |= INF_CPU_NEON; /* Advanced SIMD is mandatory on AArch64. */
#endif
    return f;
}

int inf_probe_io_uring(void) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    long fd = syscall(__NR_io_uring_setup, 4, &p);
    if (fd < 0) return 0;
    close((int)fd);
    return 1;
}

int inf_probe_libaio(void) {
    aio_context_t ctx = 0;
    if (syscall(__NR_io_setup, 4, &ctx) < 0) return 0;
    syscall(__NR_io_destroy, ctx);
    return 1;
}
