/* AVX-512F kernel of the Adam state formats, 16 elements per vector: the operations of
 * adam_formats_scalar.c in the same order, FMA contraction off, so the bits equal the scalar
 * reference. INT8 codes are dequantized by permutes of the 1 KiB maps (map16) and found with one
 * gather of the code table (see [Note: the code lookup table] in adam_formats_internal.h), m's and
 * v's in one loop; the 8-step binary search over the
 * bounds stays as the fallback. A tail runs the same vector
 * code on padded copies (INT8 codes padded with the zero code, so the padding adds 0 to the
 * block's absmax). Chosen at run time only on CPUs with AVX-512F. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "adam_formats_internal.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f"), always_inline)) static inline
#define W 16

struct vconsts {
    __m512 inv_scale, l2, beta1, omb1, beta2, omb2, inv_bc2_sqrt, eps, decay, step_size;
};

/* Running max |m'|, max |v'| of a block and its lanes holding inf or NaN. */
struct acc {
    __m512 am, av;
    __mmask16 bad_m, bad_v;
};

TARGET __m512 load_bf16(const uint16_t *a) {
    __m256i h = _mm256_loadu_si256((const __m256i *)a);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

TARGET __m512 load_grad(const void *g, size_t i, int gdt) {
    if (gdt == INF_ADAM_DTYPE_BF16) return load_bf16((const uint16_t *)g + i);
    if (gdt == INF_ADAM_DTYPE_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i)));
    return _mm512_loadu_ps((const float *)g + i);
}

/* Round to nearest even; NaN -> 0xFFFF (adam_f32_to_bf16). */
TARGET __m256i to_bf16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_srli_epi32(r, 16);
    __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
    r = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xffff), r);
    return _mm512_cvtepi32_epi16(r);
}

TARGET __m512i fmix32(__m512i h) {
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0x85ebca6bu));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0xc2b2ae35u));
    return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

/* adamf_sr_hash of 16 lanes, elements e..e+15. */
TARGET __m512i sr_hash(const struct adamf_ctx *x, int64_t e) {
    uint64_t base = (uint64_t)e;
    __m512i lo0 = _mm512_set1_epi32((int)(uint32_t)base);
    __m512i lo = _mm512_add_epi32(lo0, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                         12, 13, 14, 15));
    __m512i hi = _mm512_set1_epi32((int)(uint32_t)(base >> 32));
    hi = _mm512_mask_add_epi32(hi, _mm512_cmplt_epu32_mask(lo, lo0), hi, _mm512_set1_epi32(1));
    __m512i h = fmix32(_mm512_xor_si512(lo, _mm512_set1_epi32((int)x->k0)));
    return fmix32(_mm512_xor_si512(h, _mm512_add_epi32(hi, _mm512_set1_epi32((int)x->k1))));
}

/* adamf_sr_bits_v of 16 lanes. */
TARGET __m512i sr_bits_v(__m512i h, int master) {
    if (master == INF_ADAM_MASTER_BF16_SR) h = fmix32(_mm512_xor_si512(h, _mm512_set1_epi32((int)0x9e3779b9u)));
    return _mm512_srli_epi32(h, 16);
}

/* adamf_bf16_sr of 16 lanes with random bits r (< 2^16). */
TARGET __m256i to_bf16_sr(__m512 p, __m512i r16) {
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(p), r16), 16);
    __mmask16 ordered = _mm512_cmp_ps_mask(p, p, _CMP_ORD_Q);
    r = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xffff), r);
    return _mm512_cvtepi32_epi16(r);
}

TARGET void update(const struct vconsts *k, __m512 graw, __m512 *pp, __m512 *mp, __m512 *vp,
                   int mode) {
    __m512 gi = _mm512_mul_ps(graw, k->inv_scale);
    __m512 pi = *pp;
    if (mode == ADAM_MODE_L2) gi = _mm512_add_ps(gi, _mm512_mul_ps(k->l2, pi));
    __m512 mi = _mm512_add_ps(_mm512_mul_ps(k->beta1, *mp), _mm512_mul_ps(k->omb1, gi));
    __m512 vi = _mm512_add_ps(_mm512_mul_ps(k->beta2, *vp),
                              _mm512_mul_ps(_mm512_mul_ps(k->omb2, gi), gi));
    __m512 d = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi), k->inv_bc2_sqrt), k->eps);
    __m512 u = _mm512_div_ps(mi, d);
    if (mode == ADAM_MODE_DECOUPLED) pi = _mm512_mul_ps(pi, k->decay);
    *pp = _mm512_sub_ps(pi, _mm512_mul_ps(k->step_size, u));
    *mp = mi;
    *vp = vi;
}

TARGET void track(__m512 val, __m512 *acc, __mmask16 *bad) {
    __m512 a = _mm512_abs_ps(val);
    *bad |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(3.40282347e38f), _CMP_NLE_UQ);
    *acc = _mm512_max_ps(a, *acc); /* a > acc ? a : acc: a NaN lane keeps acc */
}

/* map[code] of 16 lanes (a 256-entry map) without a gather: 8 two-table permutes (32 entries
 * each, by the code's low 5 bits), then blends on bits 5, 6 and 7. A gather of 16 lanes costs
 * about as much as 30 vector operations on AMD Zen 4 (the int8 kernel spent most of its time
 * in its four gathers per 16 elements); the same values, so the same bits. */
TARGET __m512 map16(const float *map, __m512i code) {
    __m512 r[8];
    for (int t = 0; t < 8; t++)
        r[t] = _mm512_permutex2var_ps(_mm512_loadu_ps(map + 32 * t), code,
                                      _mm512_loadu_ps(map + 32 * t + 16));
    __mmask16 b5 = _mm512_test_epi32_mask(code, _mm512_set1_epi32(32));
    __mmask16 b6 = _mm512_test_epi32_mask(code, _mm512_set1_epi32(64));
    __mmask16 b7 = _mm512_test_epi32_mask(code, _mm512_set1_epi32(128));
    __m512 a0 = _mm512_mask_blend_ps(b5, r[0], r[1]), a1 = _mm512_mask_blend_ps(b5, r[2], r[3]);
    __m512 a2 = _mm512_mask_blend_ps(b5, r[4], r[5]), a3 = _mm512_mask_blend_ps(b5, r[6], r[7]);
    __m512 c0 = _mm512_mask_blend_ps(b6, a0, a1), c1 = _mm512_mask_blend_ps(b6, a2, a3);
    return _mm512_mask_blend_ps(b7, c0, c1);
}

/* 16 elements at i. p/g/m/v/half as the chunk's (m, v: bf16 bits or codes); e: the flat index
 * of element i (SR); INT8: sm, sv the block's scales, updated moments to mbuf/vbuf + i. */
TARGET void vec16(const struct adamf_ctx *x, const struct vconsts *k, void *p, const void *g,
                  void *m, void *v, void *half, size_t i, int64_t e, __m512 sm, __m512 sv,
                  float *mbuf, float *vbuf, struct acc *a, int moments, int master, int mode) {
    __m512 pi = master == INF_ADAM_MASTER_BF16_SR ? load_bf16((const uint16_t *)p + i)
                                                  : _mm512_loadu_ps((const float *)p + i);
    __m512 mi, vi;
    if (moments == INF_ADAM_MOMENTS_INT8) {
        __m512i cm = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((uint8_t *)m + i)));
        __m512i cv = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((uint8_t *)v + i)));
        mi = _mm512_mul_ps(map16(x->map_s, cm), sm);
        vi = _mm512_mul_ps(map16(x->map_u, cv), sv);
    } else {
        mi = load_bf16((const uint16_t *)m + i);
        vi = load_bf16((const uint16_t *)v + i);
    }
    update(k, load_grad(g, i, x->gdt), &pi, &mi, &vi, mode);
    if (moments == INF_ADAM_MOMENTS_INT8) {
        _mm512_storeu_ps(mbuf + i, mi);
        _mm512_storeu_ps(vbuf + i, vi);
        track(mi, &a->am, &a->bad_m);
        track(vi, &a->av, &a->bad_v);
    }
    __m512i h = _mm512_setzero_si512();
    if (moments == INF_ADAM_MOMENTS_BF16 || master == INF_ADAM_MASTER_BF16_SR) h = sr_hash(x, e);
    if (moments == INF_ADAM_MOMENTS_BF16) { /* [Note: stochastic rounding of bf16 moments] */
        _mm256_storeu_si256((__m256i *)((uint16_t *)m + i),
                            to_bf16_sr(mi, _mm512_and_si512(h, _mm512_set1_epi32(0xffff))));
        _mm256_storeu_si256((__m256i *)((uint16_t *)v + i), to_bf16_sr(vi, sr_bits_v(h, master)));
    }
    if (master == INF_ADAM_MASTER_BF16_SR) {
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), to_bf16_sr(pi, _mm512_srli_epi32(h, 16)));
        return;
    }
    _mm512_storeu_ps((float *)p + i, pi);
    if (x->hdt == INF_ADAM_DTYPE_BF16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)half + i), to_bf16(pi));
    else if (x->hdt == INF_ADAM_DTYPE_F16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)half + i),
                            _mm512_cvtps_ph(pi, _MM_FROUND_TO_NEAREST_INT));
}

/* Elements [i, i + r), r < 16: vec16 on padded copies; only r elements are copied back. */
TARGET void partial16(const struct adamf_ctx *x, const struct vconsts *k, void *p, const void *g,
                      void *m, void *v, void *half, size_t i, size_t r, int64_t e, __m512 sm,
                      __m512 sv, float *mbuf, float *vbuf, struct acc *a, int moments, int master,
                      int mode) {
    size_t psz = master == INF_ADAM_MASTER_BF16_SR ? 2 : 4;
    size_t gsz = x->gdt == INF_ADAM_DTYPE_F32 ? 4 : 2;
    size_t msz = moments == INF_ADAM_MOMENTS_INT8 ? 1 : 2;
    _Alignas(64) unsigned char pb[64] = {0}, gb[64] = {0}, mb[64] = {0}, vb[64] = {0};
    _Alignas(64) uint16_t hb[16];
    if (moments == INF_ADAM_MOMENTS_INT8) {
        memset(mb, ADAMF_ZERO_CODE_S, sizeof mb);
        memset(vb, ADAMF_ZERO_CODE_U, sizeof vb);
    }
    memcpy(pb, (unsigned char *)p + i * psz, r * psz);
    memcpy(gb, (const unsigned char *)g + i * gsz, r * gsz);
    memcpy(mb, (unsigned char *)m + i * msz, r * msz);
    memcpy(vb, (unsigned char *)v + i * msz, r * msz);
    vec16(x, k, pb, gb, mb, vb, hb, 0, e, sm, sv, mbuf + i, vbuf + i, a, moments, master, mode);
    memcpy((unsigned char *)p + i * psz, pb, r * psz);
    if (moments == INF_ADAM_MOMENTS_BF16) {
        memcpy((unsigned char *)m + i * msz, mb, r * msz);
        memcpy((unsigned char *)v + i * msz, vb, r * msz);
    }
    if (master == INF_ADAM_MASTER_F32 && x->hdt != INF_ADAM_DTYPE_NONE)
        memcpy((uint16_t *)half + i, hb, r * 2);
}

/* adamf_qsearch of 16 lanes: 8 gathers from the bounds. */
TARGET __m512i qsearch16(const float *bnd, int pos_floor, __m512 xv) {
    __m512i idx = _mm512_setzero_si512();
    for (int s = 128; s; s >>= 1) {
        __m512i probe = _mm512_add_epi32(idx, _mm512_set1_epi32(s - 1));
        __mmask16 ge = _mm512_cmp_ps_mask(xv, _mm512_i32gather_ps(probe, bnd, 4), _CMP_GE_OQ);
        idx = _mm512_mask_add_epi32(idx, ge, idx, _mm512_set1_epi32(s));
    }
    if (pos_floor) { /* a positive value never gets code 0 */
        __mmask16 pos = _mm512_cmp_ps_mask(xv, _mm512_setzero_ps(), _CMP_GT_OQ);
        idx = _mm512_max_epu32(idx, _mm512_maskz_mov_epi32(pos, _mm512_set1_epi32(1)));
    }
    return idx;
}

/* adamf_qsearch of 16 lanes of y in [-1, 1], never NaN, by the table (see [Note: the code
 * lookup table]): one gather. */
TARGET __m512i qlut16(const uint32_t *lut, int pos_floor, __m512 xv) {
    __m512i u = _mm512_castps_si512(xv);
    __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    a = _mm512_min_epu32(_mm512_max_epu32(a, _mm512_set1_epi32((int)ADAMF_LUT_LO_BITS)),
                         _mm512_set1_epi32((int)ADAMF_LUT_ONE_BITS));
    __m512i slot = _mm512_srli_epi32(_mm512_sub_epi32(a, _mm512_set1_epi32((int)ADAMF_LUT_LO_BITS)),
                                     ADAMF_LUT_SHIFT);
    __mmask16 neg = _mm512_cmplt_epi32_mask(u, _mm512_setzero_si512());
    slot = _mm512_mask_add_epi32(slot, neg, slot, _mm512_set1_epi32(ADAMF_LUT_PER_SIGN));
    __m512i entry = _mm512_i32gather_epi32(slot, (const void *)lut, 4);
    __m512i low = _mm512_and_si512(u, _mm512_set1_epi32(ADAMF_LUT_LOW_MASK));
    low = _mm512_mask_xor_epi32(low, neg, low, _mm512_set1_epi32(ADAMF_LUT_LOW_MASK));
    __mmask16 up = _mm512_cmpge_epu32_mask(low, _mm512_srli_epi32(entry, 8));
    __m512i c = _mm512_and_si512(entry, _mm512_set1_epi32(0xff));
    c = _mm512_mask_add_epi32(c, up, c, _mm512_set1_epi32(1));
    if (pos_floor) /* a positive value never gets code 0 (u > 0 as an integer: y > +0) */
        c = _mm512_mask_max_epu32(c, _mm512_cmpgt_epi32_mask(u, _mm512_setzero_si512()), c,
                                  _mm512_set1_epi32(1));
    return c;
}

TARGET __m512i codes16(const float *bnd, const uint32_t *lut, int pos_floor, __m512 xv) {
    return lut ? qlut16(lut, pos_floor, xv) : qsearch16(bnd, pos_floor, xv);
}

/* Pass 2 of a block: codes of buf[0, nb) (buf is readable up to nb rounded up to 16). */
TARGET void quantize_block(const float *buf, size_t nb, float amax, int bad, const float *bnd,
                           const uint32_t *lut, int zero_code, int pos_floor, uint8_t *codes,
                           float *absmax) {
    if (bad) {
        adamf_block_nonfinite(codes, nb, absmax, zero_code);
        return;
    }
    __m512 div = _mm512_set1_ps(amax == 0.0f ? 1.0f : amax);
    size_t j = 0;
    for (; j + W <= nb; j += W)
        _mm_storeu_si128((__m128i *)(codes + j),
                         _mm512_cvtepi32_epi8(codes16(bnd, lut, pos_floor, _mm512_div_ps(_mm512_loadu_ps(buf + j), div))));
    if (j < nb) {
        _Alignas(16) uint8_t tmp[16];
        _mm_store_si128((__m128i *)tmp,
                        _mm512_cvtepi32_epi8(codes16(bnd, lut, pos_floor, _mm512_div_ps(_mm512_loadu_ps(buf + j), div))));
        memcpy(codes + j, tmp, nb - j);
    }
    *absmax = amax;
}

/* Pass 2 of a block whose m and v are both finite, by the tables: both moments' codes in one
 * loop, so that their lookups are in flight together (5% of the kernel on AMD Zen 4). */
TARGET void quantize_blocks(const uint32_t *lut_s, const uint32_t *lut_u, const float *mbuf,
                            const float *vbuf, size_t nb, float am, float av, uint8_t *cm,
                            uint8_t *cv) {
    __m512 dm = _mm512_set1_ps(am == 0.0f ? 1.0f : am), dv = _mm512_set1_ps(av == 0.0f ? 1.0f : av);
    size_t j = 0;
    for (; j + W <= nb; j += W) {
        __m512i qm = qlut16(lut_s, 0, _mm512_div_ps(_mm512_loadu_ps(mbuf + j), dm));
        __m512i qv = qlut16(lut_u, 1, _mm512_div_ps(_mm512_loadu_ps(vbuf + j), dv));
        _mm_storeu_si128((__m128i *)(cm + j), _mm512_cvtepi32_epi8(qm));
        _mm_storeu_si128((__m128i *)(cv + j), _mm512_cvtepi32_epi8(qv));
    }
    if (j < nb) {
        _Alignas(16) uint8_t tm[16], tv[16];
        _mm_store_si128((__m128i *)tm, _mm512_cvtepi32_epi8(
                            qlut16(lut_s, 0, _mm512_div_ps(_mm512_loadu_ps(mbuf + j), dm))));
        _mm_store_si128((__m128i *)tv, _mm512_cvtepi32_epi8(
                            qlut16(lut_u, 1, _mm512_div_ps(_mm512_loadu_ps(vbuf + j), dv))));
        memcpy(cm + j, tm, nb - j);
        memcpy(cv + j, tv, nb - j);
    }
}

TARGET void bf16_chunk(const struct adamf_ctx *x, const struct vconsts *k,
                       const struct adamf_chunk *r, int master, int mode) {
    __m512 z = _mm512_setzero_ps();
    size_t i = 0;
    for (; i + W <= r->n; i += W)
        vec16(x, k, r->p, r->g, r->m, r->v, r->half, i, r->offset + (int64_t)i, z, z, NULL, NULL,
              NULL, INF_ADAM_MOMENTS_BF16, master, mode);
    if (i < r->n)
        partial16(x, k, r->p, r->g, r->m, r->v, r->half, i, r->n - i, r->offset + (int64_t)i, z, z,
                  NULL, NULL, NULL, INF_ADAM_MOMENTS_BF16, master, mode);
}

TARGET void int8_chunk(const struct adamf_ctx *x, const struct vconsts *k,
                       const struct adamf_chunk *r, int master, int mode) {
    _Alignas(64) float mbuf[INF_ADAM_QBLOCK + W], vbuf[INF_ADAM_QBLOCK + W];
    size_t psz = master == INF_ADAM_MASTER_BF16_SR ? 2 : 4;
    size_t gsz = x->gdt == INF_ADAM_DTYPE_F32 ? 4 : 2;
    for (size_t b = 0, blk = 0; b < r->n; b += INF_ADAM_QBLOCK, blk++) {
        size_t nb = r->n - b < INF_ADAM_QBLOCK ? r->n - b : INF_ADAM_QBLOCK;
        void *p = (unsigned char *)r->p + b * psz;
        const void *g = (const unsigned char *)r->g + b * gsz;
        uint8_t *cm = (uint8_t *)r->m + b, *cv = (uint8_t *)r->v + b;
        void *half = r->half ? (uint16_t *)r->half + b : NULL;
        int64_t e = r->offset + (int64_t)b;
        __m512 sm = _mm512_set1_ps(r->ms[blk]), sv = _mm512_set1_ps(r->vs[blk]);
        struct acc a = {_mm512_setzero_ps(), _mm512_setzero_ps(), 0, 0};
        size_t j = 0;
        for (; j + W <= nb; j += W)
            vec16(x, k, p, g, cm, cv, half, j, e + (int64_t)j, sm, sv, mbuf, vbuf, &a,
                  INF_ADAM_MOMENTS_INT8, master, mode);
        if (j < nb)
            partial16(x, k, p, g, cm, cv, half, j, nb - j, e + (int64_t)j, sm, sv, mbuf, vbuf, &a,
                      INF_ADAM_MOMENTS_INT8, master, mode);
        float am = _mm512_reduce_max_ps(a.am), av = _mm512_reduce_max_ps(a.av);
        if (x->lut_s && !a.bad_m && !a.bad_v) {
            quantize_blocks(x->lut_s, x->lut_u, mbuf, vbuf, nb, am, av, cm, cv);
            r->ms[blk] = am;
            r->vs[blk] = av;
            continue;
        }
        quantize_block(mbuf, nb, am, a.bad_m != 0, x->bnd_s, x->lut_s, ADAMF_ZERO_CODE_S, 0, cm,
                       &r->ms[blk]);
        quantize_block(vbuf, nb, av, a.bad_v != 0, x->bnd_u, x->lut_u, ADAMF_ZERO_CODE_U, 1, cv,
                       &r->vs[blk]);
    }
}

#define CHUNK(MASTER, MODE)                                                                      \
    do {                                                                                         \
        if (x->moments == INF_ADAM_MOMENTS_INT8) int8_chunk(x, &k, r, MASTER, MODE);             \
        else bf16_chunk(x, &k, r, MASTER, MODE);                                                 \
    } while (0)

__attribute__((target("avx512f"))) void inf_adamf_range_avx512(const struct adamf_ctx *x,
                                                                const struct adamf_chunk *r) {
    const struct adam_consts *c = &x->c;
    struct vconsts k = {
        _mm512_set1_ps(c->inv_scale), _mm512_set1_ps(c->l2),           _mm512_set1_ps(c->beta1),
        _mm512_set1_ps(c->one_minus_beta1), _mm512_set1_ps(c->beta2),  _mm512_set1_ps(c->one_minus_beta2),
        _mm512_set1_ps(c->inv_bc2_sqrt),    _mm512_set1_ps(c->eps),    _mm512_set1_ps(c->decay),
        _mm512_set1_ps(c->step_size)};
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
