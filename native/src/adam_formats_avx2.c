/* AVX2 (+F16C) kernel of the Adam state formats, 8 elements per vector: the operations of
 * adam_formats_scalar.c in the same order, FMA contraction off, so the bits equal the scalar
 * reference. Structure as adam_formats_avx512.c (gathers from the maps, padded tails). Chosen at
 * run time (never -march=native). */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "adam_formats_internal.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx2,f16c"), always_inline)) static inline
#define W 8

struct vconsts {
    __m256 inv_scale, l2, beta1, omb1, beta2, omb2, inv_bc2_sqrt, eps, decay, step_size;
};

/* Running max |m'|, max |v'| of a block and its lanes holding inf or NaN (all-ones lanes). */
struct acc {
    __m256 am, av, bad_m, bad_v;
};

TARGET __m256 load_bf16(const uint16_t *a) {
    __m128i h = _mm_loadu_si128((const __m128i *)a);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

TARGET __m256 load_grad(const void *g, size_t i, int gdt) {
    if (gdt == INF_ADAM_DTYPE_BF16) return load_bf16((const uint16_t *)g + i);
    if (gdt == INF_ADAM_DTYPE_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)g + i)));
    return _mm256_loadu_ps((const float *)g + i);
}

/* 8 lanes of 16-bit values (each <= 0xffff in a 32-bit lane) -> 8 uint16. */
TARGET __m128i pack16(__m256i r) {
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* Round to nearest even; NaN -> 0xFFFF (adam_f32_to_bf16). */
TARGET __m128i to_bf16(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_srli_epi32(r, 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return pack16(_mm256_or_si256(r, _mm256_srli_epi32(nan, 16)));
}

TARGET __m256i fmix32(__m256i h) {
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0x85ebca6bu));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0xc2b2ae35u));
    return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

/* adamf_sr_hash of 8 lanes, elements e..e+7. */
TARGET __m256i sr_hash(const struct adamf_ctx *x, int64_t e) {
    uint64_t base = (uint64_t)e;
    __m256i lo0 = _mm256_set1_epi32((int)(uint32_t)base);
    __m256i lo = _mm256_add_epi32(lo0, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    /* lo wrapped past 2^32 (unsigned lo < lo0): carry into hi; -1 lanes, so subtract */
    __m256i sign = _mm256_set1_epi32((int)0x80000000u);
    __m256i carry = _mm256_cmpgt_epi32(_mm256_xor_si256(lo0, sign), _mm256_xor_si256(lo, sign));
    __m256i hi = _mm256_sub_epi32(_mm256_set1_epi32((int)(uint32_t)(base >> 32)), carry);
    __m256i h = fmix32(_mm256_xor_si256(lo, _mm256_set1_epi32((int)x->k0)));
    return fmix32(_mm256_xor_si256(h, _mm256_add_epi32(hi, _mm256_set1_epi32((int)x->k1))));
}

/* adamf_sr_bits_v of 8 lanes. */
TARGET __m256i sr_bits_v(__m256i h, int master) {
    if (master == INF_ADAM_MASTER_BF16_SR) h = fmix32(_mm256_xor_si256(h, _mm256_set1_epi32((int)0x9e3779b9u)));
    return _mm256_srli_epi32(h, 16);
}

/* adamf_bf16_sr of 8 lanes with random bits r16 (< 2^16). */
TARGET __m128i to_bf16_sr(__m256 p, __m256i r16) {
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(p), r16), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
    return pack16(_mm256_or_si256(r, _mm256_srli_epi32(nan, 16)));
}

TARGET void update(const struct vconsts *k, __m256 graw, __m256 *pp, __m256 *mp, __m256 *vp,
                   int mode) {
    __m256 gi = _mm256_mul_ps(graw, k->inv_scale);
    __m256 pi = *pp;
    if (mode == ADAM_MODE_L2) gi = _mm256_add_ps(gi, _mm256_mul_ps(k->l2, pi));
    __m256 mi = _mm256_add_ps(_mm256_mul_ps(k->beta1, *mp), _mm256_mul_ps(k->omb1, gi));
    __m256 vi = _mm256_add_ps(_mm256_mul_ps(k->beta2, *vp),
                              _mm256_mul_ps(_mm256_mul_ps(k->omb2, gi), gi));
    __m256 d = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), k->inv_bc2_sqrt), k->eps);
    __m256 u = _mm256_div_ps(mi, d);
    if (mode == ADAM_MODE_DECOUPLED) pi = _mm256_mul_ps(pi, k->decay);
    *pp = _mm256_sub_ps(pi, _mm256_mul_ps(k->step_size, u));
    *mp = mi;
    *vp = vi;
}

TARGET void track(__m256 val, __m256 *acc, __m256 *bad) {
    __m256 a = _mm256_and_ps(val, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
    *bad = _mm256_or_ps(*bad, _mm256_cmp_ps(a, _mm256_set1_ps(3.40282347e38f), _CMP_NLE_UQ));
    *acc = _mm256_max_ps(a, *acc); /* a > acc ? a : acc: a NaN lane keeps acc */
}

/* Max over the lanes (no NaN in acc: any order gives the same value). */
TARGET float reduce_max(__m256 acc) {
    _Alignas(32) float l[8];
    _mm256_store_ps(l, acc);
    float r = l[0];
    for (int j = 1; j < 8; j++) r = l[j] > r ? l[j] : r;
    return r;
}

/* 8 elements at i (see adam_formats_avx512.c's vec16). */
TARGET void vec8(const struct adamf_ctx *x, const struct vconsts *k, void *p, const void *g,
                 void *m, void *v, void *half, size_t i, int64_t e, __m256 sm, __m256 sv,
                 float *mbuf, float *vbuf, struct acc *a, int moments, int master, int mode) {
    __m256 pi = master == INF_ADAM_MASTER_BF16_SR ? load_bf16((const uint16_t *)p + i)
                                                  : _mm256_loadu_ps((const float *)p + i);
    __m256 mi, vi;
    if (moments == INF_ADAM_MOMENTS_INT8) {
        __m256i cm = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((uint8_t *)m + i)));
        __m256i cv = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((uint8_t *)v + i)));
        mi = _mm256_mul_ps(_mm256_i32gather_ps(x->map_s, cm, 4), sm);
        vi = _mm256_mul_ps(_mm256_i32gather_ps(x->map_u, cv, 4), sv);
    } else {
        mi = load_bf16((const uint16_t *)m + i);
        vi = load_bf16((const uint16_t *)v + i);
    }
    update(k, load_grad(g, i, x->gdt), &pi, &mi, &vi, mode);
    if (moments == INF_ADAM_MOMENTS_INT8) {
        _mm256_storeu_ps(mbuf + i, mi);
        _mm256_storeu_ps(vbuf + i, vi);
        track(mi, &a->am, &a->bad_m);
        track(vi, &a->av, &a->bad_v);
    }
    __m256i h = _mm256_setzero_si256();
    if (moments == INF_ADAM_MOMENTS_BF16 || master == INF_ADAM_MASTER_BF16_SR) h = sr_hash(x, e);
    if (moments == INF_ADAM_MOMENTS_BF16) { /* [Note: stochastic rounding of bf16 moments] */
        _mm_storeu_si128((__m128i *)((uint16_t *)m + i),
                         to_bf16_sr(mi, _mm256_and_si256(h, _mm256_set1_epi32(0xffff))));
        _mm_storeu_si128((__m128i *)((uint16_t *)v + i), to_bf16_sr(vi, sr_bits_v(h, master)));
    }
    if (master == INF_ADAM_MASTER_BF16_SR) {
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), to_bf16_sr(pi, _mm256_srli_epi32(h, 16)));
        return;
    }
    _mm256_storeu_ps((float *)p + i, pi);
    if (x->hdt == INF_ADAM_DTYPE_BF16)
        _mm_storeu_si128((__m128i *)((uint16_t *)half + i), to_bf16(pi));
    else if (x->hdt == INF_ADAM_DTYPE_F16)
        _mm_storeu_si128((__m128i *)((uint16_t *)half + i),
                         _mm256_cvtps_ph(pi, _MM_FROUND_TO_NEAREST_INT));
}

/* Elements [i, i + r), r < 8: vec8 on padded copies; only r elements are copied back. */
TARGET void partial8(const struct adamf_ctx *x, const struct vconsts *k, void *p, const void *g,
                     void *m, void *v, void *half, size_t i, size_t r, int64_t e, __m256 sm,
                     __m256 sv, float *mbuf, float *vbuf, struct acc *a, int moments, int master,
                     int mode) {
    size_t psz = master == INF_ADAM_MASTER_BF16_SR ? 2 : 4;
    size_t gsz = x->gdt == INF_ADAM_DTYPE_F32 ? 4 : 2;
    size_t msz = moments == INF_ADAM_MOMENTS_INT8 ? 1 : 2;
    _Alignas(32) unsigned char pb[32] = {0}, gb[32] = {0}, mb[32] = {0}, vb[32] = {0};
    _Alignas(32) uint16_t hb[8];
    if (moments == INF_ADAM_MOMENTS_INT8) {
        memset(mb, ADAMF_ZERO_CODE_S, sizeof mb);
        memset(vb, ADAMF_ZERO_CODE_U, sizeof vb);
    }
    memcpy(pb, (unsigned char *)p + i * psz, r * psz);
    memcpy(gb, (const unsigned char *)g + i * gsz, r * gsz);
    memcpy(mb, (unsigned char *)m + i * msz, r * msz);
    memcpy(vb, (unsigned char *)v + i * msz, r * msz);
    vec8(x, k, pb, gb, mb, vb, hb, 0, e, sm, sv, mbuf + i, vbuf + i, a, moments, master, mode);
    memcpy((unsigned char *)p + i * psz, pb, r * psz);
    if (moments == INF_ADAM_MOMENTS_BF16) {
        memcpy((unsigned char *)m + i * msz, mb, r * msz);
        memcpy((unsigned char *)v + i * msz, vb, r * msz);
    }
    if (master == INF_ADAM_MASTER_F32 && x->hdt != INF_ADAM_DTYPE_NONE)
        memcpy((uint16_t *)half + i, hb, r * 2);
}

/* adamf_qsearch of 8 lanes: 8 gathers from the bounds. */
TARGET __m256i qsearch8(const float *bnd, int pos_floor, __m256 xv) {
    __m256i idx = _mm256_setzero_si256();
    for (int s = 128; s; s >>= 1) {
        __m256i probe = _mm256_add_epi32(idx, _mm256_set1_epi32(s - 1));
        __m256 ge = _mm256_cmp_ps(xv, _mm256_i32gather_ps(bnd, probe, 4), _CMP_GE_OQ);
        idx = _mm256_add_epi32(idx, _mm256_and_si256(_mm256_castps_si256(ge), _mm256_set1_epi32(s)));
    }
    if (pos_floor) { /* a positive value never gets code 0 */
        __m256 pos = _mm256_cmp_ps(xv, _mm256_setzero_ps(), _CMP_GT_OQ);
        idx = _mm256_max_epu32(idx, _mm256_and_si256(_mm256_castps_si256(pos), _mm256_set1_epi32(1)));
    }
    return idx;
}

/* adamf_qsearch of 8 lanes of y in [-1, 1], never NaN, by the table (see [Note: the code
 * lookup table]): one gather. */
TARGET __m256i qlut8(const uint32_t *lut, int pos_floor, __m256 xv) {
    __m256i u = _mm256_castps_si256(xv);
    __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    a = _mm256_min_epu32(_mm256_max_epu32(a, _mm256_set1_epi32((int)ADAMF_LUT_LO_BITS)),
                         _mm256_set1_epi32((int)ADAMF_LUT_ONE_BITS));
    __m256i slot = _mm256_srli_epi32(_mm256_sub_epi32(a, _mm256_set1_epi32((int)ADAMF_LUT_LO_BITS)),
                                     ADAMF_LUT_SHIFT);
    __m256i negative = _mm256_srai_epi32(u, 31);
    slot = _mm256_add_epi32(slot, _mm256_and_si256(negative, _mm256_set1_epi32(ADAMF_LUT_PER_SIGN)));
    __m256i entry = _mm256_i32gather_epi32((const int *)lut, slot, 4);
    __m256i low = _mm256_xor_si256(_mm256_and_si256(u, _mm256_set1_epi32(ADAMF_LUT_LOW_MASK)),
                                   _mm256_and_si256(negative, _mm256_set1_epi32(ADAMF_LUT_LOW_MASK)));
    /* low >= cmp (both under 2^17: a signed compare is exact): lanes of all ones, i.e. -1 */
    __m256i up = _mm256_xor_si256(_mm256_cmpgt_epi32(_mm256_srli_epi32(entry, 8), low),
                                  _mm256_set1_epi32(-1));
    __m256i c = _mm256_sub_epi32(_mm256_and_si256(entry, _mm256_set1_epi32(0xff)), up);
    if (pos_floor) { /* a positive value never gets code 0 (u > 0 as an integer: y > +0) */
        __m256i pos = _mm256_cmpgt_epi32(u, _mm256_setzero_si256());
        c = _mm256_max_epu32(c, _mm256_and_si256(pos, _mm256_set1_epi32(1)));
    }
    return c;
}

TARGET __m256i codes8(const float *bnd, const uint32_t *lut, int pos_floor, __m256 xv) {
    return lut ? qlut8(lut, pos_floor, xv) : qsearch8(bnd, pos_floor, xv);
}

TARGET __m128i pack8(__m256i c) {
    __m128i w = pack16(c);
    return _mm_packus_epi16(w, w);
}

/* Pass 2 of a block: codes of buf[0, nb) (buf is readable up to nb rounded up to 8). */
TARGET void quantize_block(const float *buf, size_t nb, float amax, int bad, const float *bnd,
                           const uint32_t *lut, int zero_code, int pos_floor, uint8_t *codes, float *absmax) {
    if (bad) {
        adamf_block_nonfinite(codes, nb, absmax, zero_code);
        return;
    }
    __m256 div = _mm256_set1_ps(amax == 0.0f ? 1.0f : amax);
    size_t j = 0;
    for (; j + W <= nb; j += W)
        _mm_storel_epi64((__m128i *)(codes + j),
                         pack8(codes8(bnd, lut, pos_floor, _mm256_div_ps(_mm256_loadu_ps(buf + j), div))));
    if (j < nb) {
        _Alignas(16) uint8_t tmp[16];
        _mm_store_si128((__m128i *)tmp,
                        pack8(codes8(bnd, lut, pos_floor, _mm256_div_ps(_mm256_loadu_ps(buf + j), div))));
        memcpy(codes + j, tmp, nb - j);
    }
    *absmax = amax;
}

TARGET void bf16_chunk(const struct adamf_ctx *x, const struct vconsts *k,
                       const struct adamf_chunk *r, int master, int mode) {
    __m256 z = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + W <= r->n; i += W)
        vec8(x, k, r->p, r->g, r->m, r->v, r->half, i, r->offset + (int64_t)i, z, z, NULL, NULL,
             NULL, INF_ADAM_MOMENTS_BF16, master, mode);
    if (i < r->n)
        partial8(x, k, r->p, r->g, r->m, r->v, r->half, i, r->n - i, r->offset + (int64_t)i, z, z,
                 NULL, NULL, NULL, INF_ADAM_MOMENTS_BF16, master, mode);
}

TARGET void int8_chunk(const struct adamf_ctx *x, const struct vconsts *k,
                       const struct adamf_chunk *r, int master, int mode) {
    _Alignas(32) float mbuf[INF_ADAM_QBLOCK + W], vbuf[INF_ADAM_QBLOCK + W];
    size_t psz = master == INF_ADAM_MASTER_BF16_SR ? 2 : 4;
    size_t gsz = x->gdt == INF_ADAM_DTYPE_F32 ? 4 : 2;
    for (size_t b = 0, blk = 0; b < r->n; b += INF_ADAM_QBLOCK, blk++) {
        size_t nb = r->n - b < INF_ADAM_QBLOCK ? r->n - b : INF_ADAM_QBLOCK;
        void *p = (unsigned char *)r->p + b * psz;
        const void *g = (const unsigned char *)r->g + b * gsz;
        uint8_t *cm = (uint8_t *)r->m + b, *cv = (uint8_t *)r->v + b;
        void *half = r->half ? (uint16_t *)r->half + b : NULL;
        int64_t e = r->offset + (int64_t)b;
        __m256 sm = _mm256_set1_ps(r->ms[blk]), sv = _mm256_set1_ps(r->vs[blk]);
        __m256 z = _mm256_setzero_ps();
        struct acc a = {z, z, z, z};
        size_t j = 0;
        for (; j + W <= nb; j += W)
            vec8(x, k, p, g, cm, cv, half, j, e + (int64_t)j, sm, sv, mbuf, vbuf, &a,
                 INF_ADAM_MOMENTS_INT8, master, mode);
        if (j < nb)
            partial8(x, k, p, g, cm, cv, half, j, nb - j, e + (int64_t)j, sm, sv, mbuf, vbuf, &a,
                     INF_ADAM_MOMENTS_INT8, master, mode);
        quantize_block(mbuf, nb, reduce_max(a.am), _mm256_movemask_ps(a.bad_m) != 0, x->bnd_s, x->lut_s,
                       ADAMF_ZERO_CODE_S, 0, cm, &r->ms[blk]);
        quantize_block(vbuf, nb, reduce_max(a.av), _mm256_movemask_ps(a.bad_v) != 0, x->bnd_u, x->lut_u,
                       ADAMF_ZERO_CODE_U, 1, cv, &r->vs[blk]);
    }
}

#define CHUNK(MASTER, MODE)                                                                      \
    do {                                                                                         \
        if (x->moments == INF_ADAM_MOMENTS_INT8) int8_chunk(x, &k, r, MASTER, MODE);             \
        else bf16_chunk(x, &k, r, MASTER, MODE);                                                 \
    } while (0)

__attribute__((target("avx2,f16c"))) void inf_adamf_range_avx2(const struct adamf_ctx *x,
                                                               const struct adamf_chunk *r) {
    const struct adam_consts *c = &x->c;
    struct vconsts k = {
        _mm256_set1_ps(c->inv_scale), _mm256_set1_ps(c->l2),           _mm256_set1_ps(c->beta1),
        _mm256_set1_ps(c->one_minus_beta1), _mm256_set1_ps(c->beta2),  _mm256_set1_ps(c->one_minus_beta2),
        _mm256_set1_ps(c->inv_bc2_sqrt),    _mm256_set1_ps(c->eps),    _mm256_set1_ps(c->decay),
        _mm256_set1_ps(c->step_size)};
    int l2 = c->mode == ADAM_MODE_L2;
    if (x->master == INF_ADAM_MASTER_BF16_SR) {
        if (l2) CHUNK(INF_ADAM_MASTER_BF16_SR, ADAM_MODE_L2);
        else CHUNK(INF_ADAM_MASTER_BF16_SR, ADAM_MODE_DECOUPLED);
    } else {
        if (l2) CHUNK(INF_ADAM_MASTER_F32, ADAM_MODE_L2);
        else CHUNK(INF_ADAM_MASTER_F32, ADAM_MODE_DECOUPLED);
    }
}

#endif /* __x86_64__ */
