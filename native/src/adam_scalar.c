/* Scalar reference of the CPU Adam element update: the definition every SIMD path must match
 * bit for bit, and the kernel on CPUs without a SIMD path. FMA contraction is off for this file
 * (the SIMD files use the same operations, one rounding each, in the same order). */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "adam_internal.h"

static inline float load_grad(const void *g, size_t i, int gdt) {
    if (gdt == INF_ADAM_DTYPE_BF16) return adam_bf16_to_f32(((const uint16_t *)g)[i]);
    if (gdt == INF_ADAM_DTYPE_F16) return adam_f16_to_f32(((const uint16_t *)g)[i]);
    return ((const float *)g)[i];
}

static inline __attribute__((always_inline)) void scalar_loop(const struct adam_consts *c,
                                                              float *p, const void *g, float *m,
                                                              float *v, void *half, size_t n,
                                                              int gdt, int hdt, int mode) {
    for (size_t i = 0; i < n; i++) {
        float gi = load_grad(g, i, gdt) * c->inv_scale;
        float pi = p[i];
        if (mode == ADAM_MODE_L2) gi = gi + c->l2 * pi;
        float mi = c->beta1 * m[i] + c->one_minus_beta1 * gi;
        float vi = c->beta2 * v[i] + (c->one_minus_beta2 * gi) * gi;
        float d = adam_sqrtf(vi) * c->inv_bc2_sqrt + c->eps;
        float u = mi / d;
        if (mode == ADAM_MODE_DECOUPLED) pi = pi * c->decay;
        pi = pi - c->step_size * u;
        m[i] = mi;
        v[i] = vi;
        p[i] = pi;
        if (hdt == INF_ADAM_DTYPE_BF16) ((uint16_t *)half)[i] = adam_f32_to_bf16(pi);
        else if (hdt == INF_ADAM_DTYPE_F16) ((uint16_t *)half)[i] = adam_f32_to_f16(pi);
    }
}

#define SCALAR_CASE(G, H)                                                                        \
    case (G) * 4 + (H) + 1:                                                                      \
        if (c->mode == ADAM_MODE_L2) scalar_loop(c, p, g, m, v, half, n, G, H, ADAM_MODE_L2);   \
        else scalar_loop(c, p, g, m, v, half, n, G, H, ADAM_MODE_DECOUPLED);                     \
        break;

void inf_adam_range_scalar(const struct adam_consts *c, float *p, const void *g, float *m,
                           float *v, void *half, size_t n, int gdt, int hdt) {
    /* one specialized loop per (grad dtype, half dtype, mode): no dtype branch per element */
    switch (gdt * 4 + hdt + 1) {
        SCALAR_CASE(INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_NONE)
        SCALAR_CASE(INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_BF16)
        SCALAR_CASE(INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_F16)
        SCALAR_CASE(INF_ADAM_DTYPE_BF16, INF_ADAM_DTYPE_NONE)
        SCALAR_CASE(INF_ADAM_DTYPE_BF16, INF_ADAM_DTYPE_BF16)
        SCALAR_CASE(INF_ADAM_DTYPE_BF16, INF_ADAM_DTYPE_F16)
        SCALAR_CASE(INF_ADAM_DTYPE_F16, INF_ADAM_DTYPE_NONE)
        SCALAR_CASE(INF_ADAM_DTYPE_F16, INF_ADAM_DTYPE_BF16)
        SCALAR_CASE(INF_ADAM_DTYPE_F16, INF_ADAM_DTYPE_F16)
    default:
        break; /* validated by the caller */
    }
}
