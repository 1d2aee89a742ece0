/* NEON (AArch64 Advanced SIMD) path of the CPU Adam element update, 4 floats per vector. Same
 * operations in the same order as adam_scalar.c, FMA contraction off (GCC would otherwise fuse
 * vmulq/vaddq into fmla), so the bits equal the scalar reference. The tail (n % 4) runs the same
 * vector code on a zero-padded copy. AArch64 always has NEON and fp16 conversions. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "adam_internal.h"

#if defined(__aarch64__)
#include <arm_neon.h>

#define INLINE __attribute__((always_inline)) static inline

struct neon_consts {
    float32x4_t inv_scale, l2, beta1, omb1, beta2, omb2, inv_bc2_sqrt, eps, decay, step_size;
};

INLINE float32x4_t load_grad(const void *g, size_t i, int gdt) {
    if (gdt == INF_ADAM_DTYPE_BF16)
        return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)g + i), 16));
    if (gdt == INF_ADAM_DTYPE_F16)
        return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)g + i)));
    return vld1q_f32((const float *)g + i);
}

/* Round to nearest even; NaN -> 0xFFFF (torch's .to(torch.bfloat16)). */
INLINE uint16x4_t to_bf16(float32x4_t x) {
    uint32x4_t u = vreinterpretq_u32_f32(x);
    uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), lsb), 16);
    uint32x4_t ordered = vceqq_f32(x, x);
    r = vbslq_u32(ordered, r, vdupq_n_u32(0xffff));
    return vmovn_u32(r);
}

INLINE void vec4(const struct neon_consts *k, float *p, const void *g, float *m, float *v,
                 void *half, size_t i, int gdt, int hdt, int mode) {
    float32x4_t gi = vmulq_f32(load_grad(g, i, gdt), k->inv_scale);
    float32x4_t pi = vld1q_f32(p + i);
    if (mode == ADAM_MODE_L2) gi = vaddq_f32(gi, vmulq_f32(k->l2, pi));
    float32x4_t mi = vaddq_f32(vmulq_f32(k->beta1, vld1q_f32(m + i)), vmulq_f32(k->omb1, gi));
    float32x4_t vi = vaddq_f32(vmulq_f32(k->beta2, vld1q_f32(v + i)),
                               vmulq_f32(vmulq_f32(k->omb2, gi), gi));
    float32x4_t d = vaddq_f32(vmulq_f32(vsqrtq_f32(vi), k->inv_bc2_sqrt), k->eps);
    float32x4_t u = vdivq_f32(mi, d);
    if (mode == ADAM_MODE_DECOUPLED) pi = vmulq_f32(pi, k->decay);
    pi = vsubq_f32(pi, vmulq_f32(k->step_size, u));
    vst1q_f32(m + i, mi);
    vst1q_f32(v + i, vi);
    vst1q_f32(p + i, pi);
    if (hdt == INF_ADAM_DTYPE_BF16) vst1_u16((uint16_t *)half + i, to_bf16(pi));
    else if (hdt == INF_ADAM_DTYPE_F16)
        vst1_u16((uint16_t *)half + i, vreinterpret_u16_f16(vcvt_f16_f32(pi)));
}

INLINE void neon_loop(const struct adam_consts *c, float *p, const void *g, float *m, float *v,
                      void *half, size_t n, int gdt, int hdt, int mode) {
    struct neon_consts k = {
        vdupq_n_f32(c->inv_scale),       vdupq_n_f32(c->l2),    vdupq_n_f32(c->beta1),
        vdupq_n_f32(c->one_minus_beta1), vdupq_n_f32(c->beta2), vdupq_n_f32(c->one_minus_beta2),
        vdupq_n_f32(c->inv_bc2_sqrt),    vdupq_n_f32(c->eps),   vdupq_n_f32(c->decay),
        vdupq_n_f32(c->step_size)};
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        vec4(&k, p, g, m, v, half, i, gdt, hdt, mode);
        vec4(&k, p, g, m, v, half, i + 4, gdt, hdt, mode);
    }
    for (; i + 4 <= n; i += 4) vec4(&k, p, g, m, v, half, i, gdt, hdt, mode);
    if (i == n) return;
    /* tail: the same vector code on zero-padded copies; the padding lanes are discarded */
    size_t r = n - i, gsz = gdt == INF_ADAM_DTYPE_F32 ? 4 : 2;
    float pb[4] = {0}, mb[4] = {0}, vb[4] = {0};
    uint16_t hb[4];
    _Alignas(16) unsigned char gb[16] = {0};
    memcpy(pb, p + i, r * 4);
    memcpy(mb, m + i, r * 4);
    memcpy(vb, v + i, r * 4);
    memcpy(gb, (const unsigned char *)g + i * gsz, r * gsz);
    vec4(&k, pb, gb, mb, vb, hb, 0, gdt, hdt, mode);
    memcpy(p + i, pb, r * 4);
    memcpy(m + i, mb, r * 4);
    memcpy(v + i, vb, r * 4);
    if (hdt != INF_ADAM_DTYPE_NONE) memcpy((uint16_t *)half + i, hb, r * 2);
}

#define NEON_CASE(G, H)                                                                          \
    case (G) * 4 + (H) + 1:                                                                      \
        if (c->mode == ADAM_MODE_L2) neon_loop(c, p, g, m, v, half, n, G, H, ADAM_MODE_L2);     \
        else neon_loop(c, p, g, m, v, half, n, G, H, ADAM_MODE_DECOUPLED);                       \
        break;

void inf_adam_range_neon(const struct adam_consts *c, float *p, const void *g, float *m, float *v,
                         void *half, size_t n, int gdt, int hdt) {
    switch (gdt * 4 + hdt + 1) {
        NEON_CASE(INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_NONE)
        NEON_CASE(INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_BF16)
        NEON_CASE(INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_F16)
        NEON_CASE(INF_ADAM_DTYPE_BF16, INF_ADAM_DTYPE_NONE)
        NEON_CASE(INF_ADAM_DTYPE_BF16, INF_ADAM_DTYPE_BF16)
        NEON_CASE(INF_ADAM_DTYPE_BF16, INF_ADAM_DTYPE_F16)
        NEON_CASE(INF_ADAM_DTYPE_F16, INF_ADAM_DTYPE_NONE)
        NEON_CASE(INF_ADAM_DTYPE_F16, INF_ADAM_DTYPE_BF16)
        NEON_CASE(INF_ADAM_DTYPE_F16, INF_ADAM_DTYPE_F16)
    default:
        break;
    }
}

#endif /* __aarch64__ */
