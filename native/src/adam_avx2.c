/* AVX2 (+F16C) path of the CPU Adam element update, 8 floats per vector. Same operations in the
 * same order as adam_scalar.c, FMA contraction off, so the bits equal the scalar reference. The
 * tail (n % 8) runs the same vector code on a zero-padded copy. The 16-bit copy of large ranges
 * is written with non-temporal stores. Compiled with a function target attribute and chosen at
 * run time (never -march=native). */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "adam_internal.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx2,f16c"), always_inline)) static inline

struct avx2_consts {
    __m256 inv_scale, l2, beta1, omb1, beta2, omb2, inv_bc2_sqrt, eps, decay, step_size;
};

TARGET __m256 load_grad(const void *g, size_t i, int gdt) {
    if (gdt == INF_ADAM_DTYPE_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)g + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (gdt == INF_ADAM_DTYPE_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)g + i)));
    return _mm256_loadu_ps((const float *)g + i);
}

/* bf16 bits in the low half of each 32-bit lane: round to nearest even; NaN -> 0xFFFF (torch's
 * .to(torch.bfloat16)). */
TARGET __m256i bf16_lanes(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_srli_epi32(r, 16);
    /* NaN lanes: all-ones >> 16 = 0xffff, OR-ed over the (16-bit) rounded value */
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_or_si256(r, _mm256_srli_epi32(nan, 16));
}

TARGET __m128i to_bf16(__m256 x) {
    __m256i r = bf16_lanes(x);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* 16 values at once: one 256-bit pack and a lane fix-up instead of two 128-bit packs. */
TARGET __m256i to_bf16x2(__m256 lo, __m256 hi) {
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_lanes(lo), bf16_lanes(hi)), 0xd8);
}

/* Updates 8 elements at i; returns the new params (the caller stores the 16-bit copy). */
TARGET __m256 vec8(const struct avx2_consts *k, float *p, const void *g, float *m, float *v,
                   size_t i, int gdt, int mode) {
    __m256 gi = _mm256_mul_ps(load_grad(g, i, gdt), k->inv_scale);
    __m256 pi = _mm256_loadu_ps(p + i);
    if (mode == ADAM_MODE_L2) gi = _mm256_add_ps(gi, _mm256_mul_ps(k->l2, pi));
    __m256 mi = _mm256_add_ps(_mm256_mul_ps(k->beta1, _mm256_loadu_ps(m + i)),
                              _mm256_mul_ps(k->omb1, gi));
    __m256 vi = _mm256_add_ps(_mm256_mul_ps(k->beta2, _mm256_loadu_ps(v + i)),
                              _mm256_mul_ps(_mm256_mul_ps(k->omb2, gi), gi));
    __m256 d = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), k->inv_bc2_sqrt), k->eps);
    __m256 u = _mm256_div_ps(mi, d);
    if (mode == ADAM_MODE_DECOUPLED) pi = _mm256_mul_ps(pi, k->decay);
    pi = _mm256_sub_ps(pi, _mm256_mul_ps(k->step_size, u));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    _mm256_storeu_ps(p + i, pi);
    return pi;
}

TARGET __m128i to_half(__m256 x, int hdt) {
    return hdt == INF_ADAM_DTYPE_BF16 ? to_bf16(x) : _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
}

/* Elements [i, i + r), r <= 8: the same vector code on zero-padded copies (padding discarded). */
TARGET void partial8(const struct avx2_consts *k, float *p, const void *g, float *m, float *v,
                     void *half, size_t i, size_t r, int gdt, int hdt, int mode) {
    size_t gsz = gdt == INF_ADAM_DTYPE_F32 ? 4 : 2;
    float pb[8] = {0}, mb[8] = {0}, vb[8] = {0};
    uint16_t hb[8];
    _Alignas(32) unsigned char gb[32] = {0};
    memcpy(pb, p + i, r * 4);
    memcpy(mb, m + i, r * 4);
    memcpy(vb, v + i, r * 4);
    memcpy(gb, (const unsigned char *)g + i * gsz, r * gsz);
    __m256 pi = vec8(k, pb, gb, mb, vb, 0, gdt, mode);
    memcpy(p + i, pb, r * 4);
    memcpy(m + i, mb, r * 4);
    memcpy(v + i, vb, r * 4);
    if (hdt != INF_ADAM_DTYPE_NONE) {
        _mm_storeu_si128((__m128i *)hb, to_half(pi, hdt));
        memcpy((uint16_t *)half + i, hb, r * 2);
    }
}

TARGET void avx2_loop(const struct adam_consts *c, float *p, const void *g, float *m, float *v,
                      void *half, size_t n, int gdt, int hdt, int mode) {
    struct avx2_consts k = {
        _mm256_set1_ps(c->inv_scale), _mm256_set1_ps(c->l2),           _mm256_set1_ps(c->beta1),
        _mm256_set1_ps(c->one_minus_beta1), _mm256_set1_ps(c->beta2),  _mm256_set1_ps(c->one_minus_beta2),
        _mm256_set1_ps(c->inv_bc2_sqrt),    _mm256_set1_ps(c->eps),    _mm256_set1_ps(c->decay),
        _mm256_set1_ps(c->step_size)};
    size_t i = 0;
    uint16_t *h = half;
    if (hdt != INF_ADAM_DTYPE_NONE && n >= ADAM_STREAM_MIN && (uintptr_t)h % 2 == 0) {
        /* The 16-bit copy is write-only: stream it (non-temporal stores), so its cache lines are
         * not first read from memory (2 instead of 4 extra bytes per param). Peel to 32 bytes. */
        size_t peel = ((32 - (uintptr_t)h % 32) % 32) / 2;
        for (; i < peel; i += 8)
            partial8(&k, p, g, m, v, half, i, peel - i < 8 ? peel - i : 8, gdt, hdt, mode);
        i = peel;
        for (; i + 16 <= n; i += 16) {
            __m256 lo = vec8(&k, p, g, m, v, i, gdt, mode);
            __m256 hi = vec8(&k, p, g, m, v, i + 8, gdt, mode);
            __m256i hv = hdt == INF_ADAM_DTYPE_BF16
                             ? to_bf16x2(lo, hi)
                             : _mm256_set_m128i(_mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT),
                                                _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT));
            _mm256_stream_si256((__m256i *)(h + i), hv);
        }
        _mm_sfence();
    }
    for (; i + 8 <= n; i += 8) {
        __m256 pi = vec8(&k, p, g, m, v, i, gdt, mode);
        if (hdt != INF_ADAM_DTYPE_NONE) _mm_storeu_si128((__m128i *)(h + i), to_half(pi, hdt));
    }
    if (i < n) partial8(&k, p, g, m, v, half, i, n - i, gdt, hdt, mode);
}

#define AVX2_CASE(G, H)                                                                          \
    case (G) * 4 + (H) + 1:                                                                      \
        if (c->mode == ADAM_MODE_L2) avx2_loop(c, p, g, m, v, half, n, G, H, ADAM_MODE_L2);     \
        else avx2_loop(c, p, g, m, v, half, n, G, H, ADAM_MODE_DECOUPLED);                       \
        break;

__attribute__((target("avx2,f16c"))) void inf_adam_range_avx2(const struct adam_consts *c,
                                                               float *p, const void *g, float *m,
                                                               float *v, void *half, size_t n,
                                                               int gdt, int hdt) {
    switch (gdt * 4 + hdt + 1) {
        AVX2_CASE(INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_NONE)
        AVX2_CASE(INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_BF16)
        AVX2_CASE(INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_F16)
        AVX2_CASE(INF_ADAM_DTYPE_BF16, INF_ADAM_DTYPE_NONE)
        AVX2_CASE(INF_ADAM_DTYPE_BF16, INF_ADAM_DTYPE_BF16)
        AVX2_CASE(INF_ADAM_DTYPE_BF16, INF_ADAM_DTYPE_F16)
        AVX2_CASE(INF_ADAM_DTYPE_F16, INF_ADAM_DTYPE_NONE)
        AVX2_CASE(INF_ADAM_DTYPE_F16, INF_ADAM_DTYPE_BF16)
        AVX2_CASE(INF_ADAM_DTYPE_F16, INF_ADAM_DTYPE_F16)
    default:
        break;
    }
}

#endif /* __x86_64__ */
