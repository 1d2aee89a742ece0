/* Private to the CPU Adam component (adam*.c): per-step constants, the kernel table, scalar
 * 16-bit conversions shared by the scalar reference, and the thread pool. */
#ifndef INF_ADAM_INTERNAL_H
#define INF_ADAM_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "inf_adam.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

/* Both L2 and decoupled forms exist; with weight_decay == 0 Adam mode uses ADAM_MODE_DECOUPLED
 * with decay == 1 (p * 1 == p exactly), so "no weight decay" needs no third loop. */
#define ADAM_MODE_DECOUPLED 0
#define ADAM_MODE_L2 1

/* Per-step constants, computed in double once per call and rounded to float (the same numbers
 * the pure-torch path in infinity/optim/cpu_adam.py computes). */
struct adam_consts {
    float inv_scale;    /* 1 / grad_scale */
    float l2;           /* weight_decay (ADAM_MODE_L2) */
    float beta1, one_minus_beta1;
    float beta2, one_minus_beta2;
    float inv_bc2_sqrt; /* 1 / sqrt(1 - beta2^step) */
    float eps;
    float decay;        /* 1 - lr * weight_decay (ADAM_MODE_DECOUPLED) */
    float step_size;    /* lr / (1 - beta1^step) */
    int mode;
};

/* Ranges at least this long write the 16-bit copy with non-temporal stores (x86). */
#define ADAM_STREAM_MIN 4096

/* Steps n elements of one range. gdt: INF_ADAM_DTYPE_{F32,BF16,F16}; hdt also NONE. */
typedef void (*adam_range_fn)(const struct adam_consts *c, float *p, const void *g, float *m,
                              float *v, void *half, size_t n, int gdt, int hdt);

void inf_adam_range_scalar(const struct adam_consts *c, float *p, const void *g, float *m,
                           float *v, void *half, size_t n, int gdt, int hdt);
#if defined(__x86_64__)
void inf_adam_range_avx2(const struct adam_consts *c, float *p, const void *g, float *m, float *v,
                         void *half, size_t n, int gdt, int hdt);
void inf_adam_range_avx512(const struct adam_consts *c, float *p, const void *g, float *m,
                           float *v, void *half, size_t n, int gdt, int hdt);
#endif
#if defined(__aarch64__)
void inf_adam_range_neon(const struct adam_consts *c, float *p, const void *g, float *m, float *v,
                         void *half, size_t n, int gdt, int hdt);
#endif

/* IEEE square roots without libm (GCC keeps a libm call for errno unless -fno-math-errno, which
 * cannot be set per file): the library links against libc only. */
static inline float adam_sqrtf(float x) {
#if defined(__x86_64__)
    return _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(x)));
#elif defined(__aarch64__)
    float r;
    __asm__("fsqrt %s0, %s1" : "=w"(r) : "w"(x));
    return r;
#else
    return __builtin_sqrtf(x);
#endif
}

static inline double adam_sqrt(double x) {
#if defined(__x86_64__)
    return _mm_cvtsd_f64(_mm_sqrt_sd(_mm_setzero_pd(), _mm_set_sd(x)));
#elif defined(__aarch64__)
    double r;
    __asm__("fsqrt %d0, %d1" : "=w"(r) : "w"(x));
    return r;
#else
    return __builtin_sqrt(x);
#endif
}

/* ---- scalar 16-bit conversions (bit-exact with torch's .to() and with F16C / NEON) ---- */

static inline uint32_t adam_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float adam_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float adam_bf16_to_f32(uint16_t h) { return adam_bits_f32((uint32_t)h << 16); }

/* Round to nearest even; every NaN becomes 0xFFFF, as torch's vectorized cast of a contiguous
 * tensor gives (torch's scalar path gives 0x7FC0; see inf_adam.h). */
static inline uint16_t adam_f32_to_bf16(float f) {
    uint32_t u = adam_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffffu;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* IEEE half -> float, exact; a signaling NaN is quieted (as F16C and NEON do). */
static inline float adam_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1fu) /* inf or NaN */
        return adam_bits_f32(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u));
    if (exp == 0) {
        if (mant == 0) return adam_bits_f32(sign);
        /* subnormal: mant * 2^-24, exact in float */
        int e = -1;
        do {
            mant <<= 1;
            e++;
        } while (!(mant & 0x400u));
        mant &= 0x3ffu;
        return adam_bits_f32(sign | ((uint32_t)(127 - 15 - e) << 23) | (mant << 13));
    }
    return adam_bits_f32(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

/* Float -> IEEE half, round to nearest even; overflow -> inf; NaN keeps its sign and the top
 * mantissa bits with the quiet bit set (what F16C's vcvtps2ph and torch's .to() give). */
static inline uint16_t adam_f32_to_f16(float f) {
    uint32_t u = adam_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf; inf */
    if (a < 0x38800000u) { /* below 2^-14: subnormal half (or zero) */
        if (a < 0x33000000u) return sign; /* < 2^-25: rounds to zero (2^-25 itself ties to 0) */
        uint32_t exp = a >> 23;
        uint32_t mant = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - exp; /* value = mant * 2^(exp-150); half ulp 2^-24 -> shift 14.. */
        /* result = mant * 2^(exp - 150 + 24) = mant >> (126 - exp) */
        uint32_t q = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1u);
        uint32_t halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    /* normal: rebias exponent, round 13 dropped bits to nearest even (carry may bump exponent) */
    uint32_t r = a - ((127u - 15u) << 23);
    r += 0xfffu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
}

/* Sum over n gradient elements of grad^2 in double, the same bits on every CPU (adam_norm.c). */
double inf_adam_grad_sq_sum(const void *g, size_t n, int gdt);

/* The checks and per-step constants of inf_adam_step, shared with the state formats
 * (adam_formats.c) so that both give the same numbers. */
int inf_adam_hparams_check(const struct inf_adam_hparams *hp);
struct adam_consts inf_adam_consts(const struct inf_adam_hparams *hp);

/* ---- thread pool (adam_pool.c) ---- */

/* fn(arg, index) runs on up to nthreads threads, index 0 being the caller, and must take work
 * from a shared counter until none is left (see adam.c): a worker that wakes late, or could not
 * be created, simply takes no part. Returns once the caller's fn returned and every worker that
 * joined has finished. Jobs never overlap: concurrent callers take turns. Returns the threads
 * offered the job (1 + workers). */
typedef void (*adam_pool_fn)(void *arg, int index);
int inf_adam_pool_run(int nthreads, adam_pool_fn fn, void *arg);

/* CPUs this process may run on (sched_getaffinity), at least 1. */
int inf_adam_cpus_allowed(void);

#endif
