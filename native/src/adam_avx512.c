/* AVX-512F path of the CPU Adam element update, 16 floats per vector. Same operations in the
 * same order as adam_scalar.c, FMA contraction off, so the bits equal the scalar reference. The
 * tail (n % 16) runs the same vector code on a zero-padded copy. The 16-bit copy of large ranges
 * is written with non-temporal stores. Compiled with a function target
 * attribute and chosen at run time only on CPUs (and kernels) with AVX-512F. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "adam_internal.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f"), always_inline)) static inline

struct avx512_consts {
    __m512 inv_scale, l2, beta1, omb1, beta2, omb2, inv_bc2_sqrt, eps, decay, step_size;
};

TARGET __m512 load_grad(const void *g, size_t i, int gdt) {
    if (gdt == INF_ADAM_DTYPE_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (gdt == INF_ADAM_DTYPE_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i)));
    return _mm512_loadu_ps((const float *)g + i);
}

/* Round to nearest even; NaN -> 0xFFFF (torch's .to(torch.bfloat16)). */
TARGET __m256i to_bf16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_srli_epi32(r, 16);
    __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
    r = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xffff), r);
    return _mm512_cvtepi32_epi16(r);
}

/* Updates 16 elements at i; returns the new params (the caller stores the 16-bit copy). */
TARGET __m512 vec16(const struct avx512_consts *k, float *p, const void *g, float *m, float *v,
                    size_t i, int gdt, int mode) {
    __m512 gi = _mm512_mul_ps(load_grad(g, i, gdt), k->inv_scale);
    __m512 pi = _mm512_loadu_ps(p + i);
    if (mode == ADAM_MODE_L2) gi = _mm512_add_ps(gi, _mm512_mul_ps(k->l2, pi));
    __m512 mi = _mm512_add_ps(_mm512_mul_ps(k->beta1, _mm512_loadu_ps(m + i)),
                              _mm512_mul_ps(k->omb1, gi));
    __m512 vi = _mm512_add_ps(_mm512_mul_ps(k->beta2, _mm512_loadu_ps(v + i)),
                              _mm512_mul_ps(_mm512_mul_ps(k->omb2, gi), gi));
    __m512 d = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi), k->inv_bc2_sqrt), k->eps);
    __m512 u = _mm512_div_ps(mi, d);
    if (mode == ADAM_MODE_DECOUPLED) pi = _mm512_mul_ps(pi, k->decay);
    pi = _mm512_sub_ps(pi, _mm512_mul_ps(k->step_size, u));
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    _mm512_storeu_ps(p + i, pi);
    return pi;
}

TARGET __m256i to_half(__m512 x, int hdt) {
    return hdt == INF_ADAM_DTYPE_BF16 ? to_bf16(x) : _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
}

/* Elements [i, i + r), r <= 16: the same vector code on zero-padded copies (padding discarded). */
TARGET void partial16(const struct avx512_consts *k, float *p, const void *g, float *m, float *v,
                      void *half, size_t i, size_t r, int gdt, int hdt, int mode) {
    size_t gsz = gdt == INF_ADAM_DTYPE_F32 ? 4 : 2;
    float pb[16] = {0}, mb[16] = {0}, vb[16] = {0};
    uint16_t hb[16];
    _Alignas(64) unsigned char gb[64] = {0};
    memcpy(pb, p + i, r * 4);
    memcpy(mb, m + i, r * 4);
    memcpy(vb, v + i, r * 4);
    memcpy(gb, (const unsigned char *)g + i * gsz, r * gsz);
    __m512 pi = vec16(k, pb, gb, mb, vb, 0, gdt, mode);
    memcpy(p + i, pb, r * 4);
    memcpy(m + i, mb, r * 4);
    memcpy(v + i, vb, r * 4);
    if (hdt != INF_ADAM_DTYPE_NONE) {
        _mm256_storeu_si256((__m256i *)hb, to_half(pi, hdt));
        memcpy((uint16_t *)half + i, hb, r * 2);
    }
}

TARGET void avx512_loop(const struct adam_consts *c, float *p, const void *g, float *m, float *v,
                        void *half, size_t n, int gdt, int hdt, int mode) {
    struct avx512_consts k = {
        _mm512_set1_ps(c->inv_scale), _mm512_set1_ps(c->l2),           _mm512_set1_ps(c->beta1),
        _mm512_set1_ps(c->one_minus_beta1), _mm512_set1_ps(c->beta2),  _mm512_set1_ps(c->one_minus_beta2),
        _mm512_set1_ps(c->inv_bc2_sqrt),    _mm512_set1_ps(c->eps),    _mm512_set1_ps(c->decay),
        _mm512_set1_ps(c->step_size)};
    size_t i = 0;
    uint16_t *h = half;
    if (hdt != INF_ADAM_DTYPE_NONE && n >= ADAM_STREAM_MIN && (uintptr_t)h % 2 == 0) {
        /* stream the write-only 16-bit copy (see adam_avx2.c); peel to 32 bytes */
        size_t peel = ((32 - (uintptr_t)h % 32) % 32) / 2;
        if (peel) partial16(&k, p, g, m, v, half, 0, peel, gdt, hdt, mode);
        for (i = peel; i + 16 <= n; i += 16)
            _mm256_stream_si256((__m256i *)(h + i),
                                to_half(vec16(&k, p, g, m, v, i, gdt, mode), hdt));
        _mm_sfence();
    }
    for (; i + 16 <= n; i += 16) {
        __m512 pi = vec16(&k, p, g, m, v, i, gdt, mode);
        if (hdt != INF_ADAM_DTYPE_NONE) _mm256_storeu_si256((__m256i *)(h + i), to_half(pi, hdt));
    }
    if (i < n) partial16(&k, p, g, m, v, half, i, n - i, gdt, hdt, mode);
}

#define AVX512_CASE(G, H)                                                                        \
    case (G) * 4 + (H) + 1:                                                                      \
        if (c->mode == ADAM_MODE_L2) avx512_loop(c, p, g, m, v, half, n, G, H, ADAM_MODE_L2);   \
        else avx512_loop(c, p, g, m, v, half, n, G, H, ADAM_MODE_DECOUPLED);                     \
        break;

__attribute__((target("avx512f"))) void inf_adam_range_avx512(const struct adam_consts *c,
                                                               float *p, const void *g, float *m,
                                                               float *v, void *half, size_t n,
                                                               int gdt, int hdt) {
    switch (gdt * 4 + hdt + 1) {
        AVX512_CASE(INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_NONE)
        AVX512_CASE(INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_BF16)
        AVX512_CASE(INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_F16)
        AVX512_CASE(INF_ADAM_DTYPE_BF16, INF_ADAM_DTYPE_NONE)
        AVX512_CASE(INF_ADAM_DTYPE_BF16, INF_ADAM_DTYPE_BF16)
        AVX512_CASE(INF_ADAM_DTYPE_BF16, INF_ADAM_DTYPE_F16)
        AVX512_CASE(INF_ADAM_DTYPE_F16, INF_ADAM_DTYPE_NONE)
        AVX512_CASE(INF_ADAM_DTYPE_F16, INF_ADAM_DTYPE_BF16)
        AVX512_CASE(INF_ADAM_DTYPE_F16, INF_ADAM_DTYPE_F16)
    default:
        break;
    }
}

#endif /* __x86_64__ */
