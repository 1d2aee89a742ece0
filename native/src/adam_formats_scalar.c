/* Scalar reference of the Adam state formats (inf_adam_formats.h): the definition the AVX2 and
 * AVX-512 kernels must match bit for bit, and the kernel on other CPUs. The element update is
 * adam_scalar.c's, operation for operation; FMA contraction is off for this file. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "adam_formats_internal.h"

#define INLINE static inline __attribute__((always_inline))

INLINE float load_grad(const void *g, size_t i, int gdt) {
    if (gdt == INF_ADAM_DTYPE_BF16) return adam_bf16_to_f32(((const uint16_t *)g)[i]);
    if (gdt == INF_ADAM_DTYPE_F16) return adam_f16_to_f32(((const uint16_t *)g)[i]);
    return ((const float *)g)[i];
}

INLINE float load_param(const void *p, size_t i, int master) {
    if (master == INF_ADAM_MASTER_BF16_SR) return adam_bf16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

/* Stores the updated param (and its 16-bit copy) of element i. */
INLINE void store_param(const struct adamf_ctx *x, const struct adamf_chunk *r, size_t i, float pi,
                        int master) {
    if (master == INF_ADAM_MASTER_BF16_SR) {
        uint32_t h = adamf_sr_hash(x->k0, x->k1, (uint64_t)(r->offset + (int64_t)i));
        ((uint16_t *)r->p)[i] = adamf_bf16_sr(pi, h >> 16);
        return;
    }
    ((float *)r->p)[i] = pi;
    if (x->hdt == INF_ADAM_DTYPE_BF16) ((uint16_t *)r->half)[i] = adam_f32_to_bf16(pi);
    else if (x->hdt == INF_ADAM_DTYPE_F16) ((uint16_t *)r->half)[i] = adam_f32_to_f16(pi);
}

/* adam_scalar.c's element update on fp32 values. */
INLINE void update(const struct adam_consts *c, float graw, float *pp, float *mp, float *vp,
                   int mode) {
    float gi = graw * c->inv_scale;
    float pi = *pp;
    if (mode == ADAM_MODE_L2) gi = gi + c->l2 * pi;
    float mi = c->beta1 * *mp + c->one_minus_beta1 * gi;
    float vi = c->beta2 * *vp + (c->one_minus_beta2 * gi) * gi;
    float d = adam_sqrtf(vi) * c->inv_bc2_sqrt + c->eps;
    float u = mi / d;
    if (mode == ADAM_MODE_DECOUPLED) pi = pi * c->decay;
    pi = pi - c->step_size * u;
    *pp = pi;
    *mp = mi;
    *vp = vi;
}

INLINE void bf16_loop(const struct adamf_ctx *x, const struct adamf_chunk *r, int master, int mode) {
    uint16_t *m = r->m, *v = r->v;
    for (size_t i = 0; i < r->n; i++) {
        float pi = load_param(r->p, i, master);
        float mi = adam_bf16_to_f32(m[i]), vi = adam_bf16_to_f32(v[i]);
        update(&x->c, load_grad(r->g, i, x->gdt), &pi, &mi, &vi, mode);
        /* see [Note: stochastic rounding of bf16 moments] */
        uint32_t h = adamf_sr_hash(x->k0, x->k1, (uint64_t)(r->offset + (int64_t)i));
        m[i] = adamf_bf16_sr(mi, adamf_sr_bits_m(h));
        v[i] = adamf_bf16_sr(vi, adamf_sr_bits_v(h, master));
        store_param(x, r, i, pi, master);
    }
}

/* max |a| ignoring NaN, in the order-free form every kernel uses (MAXPS(a, acc) semantics). */
INLINE float absmax_step(float acc, float a, int *bad) {
    float ab = adam_bits_f32(adam_f32_bits(a) & 0x7fffffffu);
    if (!(ab <= 3.40282347e38f)) *bad = 1;
    return ab > acc ? ab : acc;
}

static void quantize_block(const float *buf, size_t nb, float amax, int bad, const float *bnd,
                           int zero_code, int pos_floor, uint8_t *codes, float *absmax) {
    if (bad) {
        adamf_block_nonfinite(codes, nb, absmax, zero_code);
        return;
    }
    float div = amax == 0.0f ? 1.0f : amax;
    for (size_t j = 0; j < nb; j++) {
        float xj = buf[j] / div;
        uint32_t code = adamf_qsearch(bnd, xj);
        if (pos_floor && code == 0 && xj > 0.0f) code = 1; /* see inf_adam_formats.h */
        codes[j] = (uint8_t)code;
    }
    *absmax = amax;
}

INLINE void int8_loop(const struct adamf_ctx *x, const struct adamf_chunk *r, int master,
                      int mode) {
    float mbuf[INF_ADAM_QBLOCK], vbuf[INF_ADAM_QBLOCK];
    for (size_t b = 0, blk = 0; b < r->n; b += INF_ADAM_QBLOCK, blk++) {
        size_t nb = r->n - b < INF_ADAM_QBLOCK ? r->n - b : INF_ADAM_QBLOCK;
        struct adamf_chunk s = *r; /* the block as a range of its own */
        s.p = (unsigned char *)r->p + b * (master == INF_ADAM_MASTER_BF16_SR ? 2 : 4);
        s.g = (const unsigned char *)r->g + b * (x->gdt == INF_ADAM_DTYPE_F32 ? 4 : 2);
        s.half = r->half ? (uint16_t *)r->half + b : NULL;
        s.offset = r->offset + (int64_t)b;
        uint8_t *cm = (uint8_t *)r->m + b, *cv = (uint8_t *)r->v + b;
        float sm = r->ms[blk], sv = r->vs[blk];
        float am = 0.0f, av = 0.0f;
        int bad_m = 0, bad_v = 0;
        for (size_t j = 0; j < nb; j++) {
            float pi = load_param(s.p, j, master);
            float mi = x->map_s[cm[j]] * sm, vi = x->map_u[cv[j]] * sv;
            update(&x->c, load_grad(s.g, j, x->gdt), &pi, &mi, &vi, mode);
            store_param(x, &s, j, pi, master);
            mbuf[j] = mi;
            vbuf[j] = vi;
            am = absmax_step(am, mi, &bad_m);
            av = absmax_step(av, vi, &bad_v);
        }
        quantize_block(mbuf, nb, am, bad_m, x->bnd_s, ADAMF_ZERO_CODE_S, 0, cm, &r->ms[blk]);
        quantize_block(vbuf, nb, av, bad_v, x->bnd_u, ADAMF_ZERO_CODE_U, 1, cv, &r->vs[blk]);
    }
}

#define LOOPS(MASTER, MODE)                                                                      \
    do {                                                                                         \
        if (x->moments == INF_ADAM_MOMENTS_INT8) int8_loop(x, r, MASTER, MODE);                  \
        else bf16_loop(x, r, MASTER, MODE);                                                      \
    } while (0)

void inf_adamf_range_scalar(const struct adamf_ctx *x, const struct adamf_chunk *r) {
    /* one loop per (moments, master, mode); dtype branches inside are loop-invariant */
    int l2 = x->c.mode == ADAM_MODE_L2;
    if (x->master == INF_ADAM_MASTER_BF16_SR) {
        if (l2) LOOPS(INF_ADAM_MASTER_BF16_SR, ADAM_MODE_L2);
        else LOOPS(INF_ADAM_MASTER_BF16_SR, ADAM_MODE_DECOUPLED);
    } else {
        if (l2) LOOPS(INF_ADAM_MASTER_F32, ADAM_MODE_L2);
        else LOOPS(INF_ADAM_MASTER_F32, ADAM_MODE_DECOUPLED);
    }
}
