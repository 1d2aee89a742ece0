/* Sum of squares of one chunk's gradient, for inf_adam_step_norm (the global gradient norm of
 * a step whose gradients are stepped unit by unit and never all held at once).
 *
 * Why its own pass and not a term inside each Adam kernel: run right after the chunk's update,
 * the gradient is still in cache, so the pass costs a few percent of the memory-bound step, and
 * the four bit-exact kernels stay as they are. The result is the same bits on every CPU: a
 * float squared is exact in double (48 significant bits), so x * x + acc rounds once whether or
 * not it is fused, and the sums run in one fixed order: element i goes to lane i % 8 of the
 * chunk, the lanes are added pairwise at the end. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "adam_internal.h"
#include "inf_info.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define LANES 8

static inline float grad_at(const void *g, size_t i, int gdt) {
    if (gdt == INF_ADAM_DTYPE_BF16) return adam_bf16_to_f32(((const uint16_t *)g)[i]);
    if (gdt == INF_ADAM_DTYPE_F16) return adam_f16_to_f32(((const uint16_t *)g)[i]);
    return ((const float *)g)[i];
}

/* Lanes 0-7 -> ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), the order the AVX2 path's
 * horizontal sum takes. */
static double combine(const double *acc) {
    double a = acc[0] + acc[4], b = acc[1] + acc[5], c = acc[2] + acc[6], d = acc[3] + acc[7];
    return (a + c) + (b + d);
}

static void lanes_scalar(double *acc, const void *g, size_t from, size_t n, int gdt) {
    for (size_t i = from; i < n; i++) {
        double x = (double)grad_at(g, i, gdt);
        acc[i % LANES] += x * x;
    }
}

#if defined(__x86_64__)
/* x's 8 floats squared in double into lanes 0-3 (lo) and 4-7 (hi), as the scalar path's i % 8. */
__attribute__((target("avx2"), always_inline)) static inline void add_squares(__m256d *lo,
                                                                              __m256d *hi,
                                                                              __m256 x) {
    __m256d xl = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    __m256d xh = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    *lo = _mm256_add_pd(*lo, _mm256_mul_pd(xl, xl));
    *hi = _mm256_add_pd(*hi, _mm256_mul_pd(xh, xh));
}

/* fp32 gradients, 8 per iteration. */
__attribute__((target("avx2"))) static size_t lanes_avx2(double *acc, const float *g, size_t n) {
    __m256d lo = _mm256_loadu_pd(acc), hi = _mm256_loadu_pd(acc + 4);
    size_t i = 0;
    for (; i + LANES <= n; i += LANES) add_squares(&lo, &hi, _mm256_loadu_ps(g + i));
    _mm256_storeu_pd(acc, lo);
    _mm256_storeu_pd(acc + 4, hi);
    return i;
}

/* 16-bit gradients, 8 per iteration, widened to the fp32 values adam_bf16_to_f32 and
 * adam_f16_to_f32 give (exact: every bf16 and fp16 value is a float): bf16 is the upper half of
 * a float (a shift), fp16 goes through F16C. A bf16 gradient home (the deferred step's, see the
 * planner's [Note: the gradient home in the compute dtype]) is normed here every step: the
 * scalar loop took ~8x the fp32 path's time. */
__attribute__((target("avx2"))) static size_t lanes_avx2_bf16(double *acc, const uint16_t *g,
                                                                size_t n) {
    __m256d lo = _mm256_loadu_pd(acc), hi = _mm256_loadu_pd(acc + 4);
    size_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(g + i)));
        add_squares(&lo, &hi, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
    _mm256_storeu_pd(acc, lo);
    _mm256_storeu_pd(acc + 4, hi);
    return i;
}

__attribute__((target("avx2,f16c"))) static size_t lanes_avx2_f16(double *acc, const uint16_t *g,
                                                                   size_t n) {
    __m256d lo = _mm256_loadu_pd(acc), hi = _mm256_loadu_pd(acc + 4);
    size_t i = 0;
    for (; i + LANES <= n; i += LANES)
        add_squares(&lo, &hi, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + i))));
    _mm256_storeu_pd(acc, lo);
    _mm256_storeu_pd(acc + 4, hi);
    return i;
}
#endif

double inf_adam_grad_sq_sum(const void *g, size_t n, int gdt) {
    double acc[LANES] = {0};
    size_t done = 0;
#if defined(__x86_64__)
    unsigned features = inf_cpu_features();
    if (features & INF_CPU_AVX2) {
        if (gdt == INF_ADAM_DTYPE_F32)
            done = lanes_avx2(acc, (const float *)g, n);
        else if (gdt == INF_ADAM_DTYPE_BF16)
            done = lanes_avx2_bf16(acc, (const uint16_t *)g, n);
        else if (gdt == INF_ADAM_DTYPE_F16 && (features & INF_CPU_F16C))
            done = lanes_avx2_f16(acc, (const uint16_t *)g, n);
    }
#endif
    lanes_scalar(acc, g, done, n, gdt);
    return combine(acc);
}
