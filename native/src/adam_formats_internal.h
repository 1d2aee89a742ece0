/* Private to the Adam state formats (adam_formats*.c): the per-call context, one chunk of a
 * range, the kernel table, and the scalar pieces every kernel shares (stochastic rounding's hash,
 * the handling of a non-finite block). See inf_adam_formats.h for the definitions. */
#ifndef INF_ADAM_FORMATS_INTERNAL_H
#define INF_ADAM_FORMATS_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "adam_internal.h"
#include "inf_adam_formats.h"

/* Code of 0.0 in each map (the value a block of zeros is coded with). */
#define ADAMF_ZERO_CODE_S 127
#define ADAMF_ZERO_CODE_U 0

/* Constants of one call. */
struct adamf_ctx {
    struct adam_consts c;
    int gdt, hdt;        /* INF_ADAM_DTYPE_*: gradient, 16-bit copy (NONE with BF16_SR) */
    int moments, master; /* INF_ADAM_MOMENTS_*, INF_ADAM_MASTER_* */
    uint32_t k0, k1;     /* stochastic rounding key, from (seed, step) */
    const float *map_s, *map_u; /* 256 values each */
    const float *bnd_s, *bnd_u; /* 255 decision bounds each */
    const uint32_t *lut_s, *lut_u; /* ADAMF_LUT slots each, or NULL */
};

/* One chunk: whole blocks of one range (pointers at the chunk's element 0; absmax pointers at
 * its first block); offset is the flat-tensor index of element 0 (the SR counter). */
struct adamf_chunk {
    void *p;
    const void *g;
    void *m, *v;
    float *ms, *vs;
    void *half;
    int64_t offset;
    size_t n;
};

typedef void (*adamf_range_fn)(const struct adamf_ctx *x, const struct adamf_chunk *r);

void inf_adamf_range_scalar(const struct adamf_ctx *x, const struct adamf_chunk *r);
#if defined(__x86_64__)
void inf_adamf_range_avx2(const struct adamf_ctx *x, const struct adamf_chunk *r);
void inf_adamf_range_avx512(const struct adamf_ctx *x, const struct adamf_chunk *r);
/* [Note: the code lookup table]
 * The SIMD kernels find a code in one gather instead of the binary search's eight: a table
 * indexed by the top bits of the float y = x / absmax (sign, exponent, 7 mantissa bits: a slot
 * spans 1/128 of an octave) holds, per slot, the smallest code c of the slot's values and the
 * one decision bound the slot may hold (at most one: checked when the table is built, the
 * map's entries are >= 1.4% apart, a slot is 0.8% wide). Then code(y) = c + (y >= bnd[c]), and
 * inside one slot y and the bound share sign, exponent and the top 7 mantissa bits, so
 * y >= bnd[c] is a compare of the low 16 bits: no second lookup.
 * The slot is bits 16..30 of |y| (exponent and 7 mantissa bits), |y| clamped to [2^-24, 1]
 * first, plus a sign's offset: y = x / absmax with |x| <= absmax lies in [-1, 1], and every
 * magnitude below 2^-24 shares the first slot, which must hold no bound (the smallest bound is
 * 1.6e-7; checked too). y is never NaN there: a block holding inf or NaN is coded before any
 * lookup (adamf_block_nonfinite), and absmax 0 divides by 1.
 * Entry: c | cmp << 8, cmp a 17-bit number the lane's low 16 bits are compared with (code + 1
 * where low >= cmp): the bound's low 16 bits for a positive slot, their complement for a
 * negative one (|y| <= |bound| there; the lane complements its bits too), and 0x10000 (never
 * reached) for a slot without a bound. So a lane costs a clamp, a shift, the gather, a compare
 * and an add, the same whatever the slot. The result is adamf_qsearch's by construction; the
 * tests compare every SIMD kernel with the scalar one and code every bound and its neighbours. */
#define ADAMF_LUT_MANT_BITS 7                /* the slot is |y|'s bits from 23 - 7 = 16 up */
#define ADAMF_LUT_SHIFT (23 - ADAMF_LUT_MANT_BITS)
#define ADAMF_LUT_EXP_LO (127 - 24)          /* biased exponent of the first slot: 2^-24 */
#define ADAMF_LUT_LO_BITS ((uint32_t)ADAMF_LUT_EXP_LO << 23)
#define ADAMF_LUT_ONE_BITS 0x3f800000u       /* 1.0f: |y| <= 1 */
#define ADAMF_LUT_PER_SIGN (((ADAMF_LUT_ONE_BITS - ADAMF_LUT_LO_BITS) >> ADAMF_LUT_SHIFT) + 1)
#define ADAMF_LUT (2 * ADAMF_LUT_PER_SIGN)
#define ADAMF_LUT_NO_BOUND 0x10000u
#define ADAMF_LUT_LOW_MASK 0xffffu

/* The table slot of y in [-1, 1] (the SIMD kernels compute the same, lane by lane). */
static inline uint32_t adamf_lut_slot(float y) {
    uint32_t u = adam_f32_bits(y), a = u & 0x7fffffffu;
    if (a < ADAMF_LUT_LO_BITS) a = ADAMF_LUT_LO_BITS;
    if (a > ADAMF_LUT_ONE_BITS) a = ADAMF_LUT_ONE_BITS;
    return (u >> 31) * ADAMF_LUT_PER_SIGN + ((a - ADAMF_LUT_LO_BITS) >> ADAMF_LUT_SHIFT);
}

#endif

/* ---- stochastic rounding ---- */

/* murmur3's 32-bit finalizer: a bijection that mixes every input bit into every output bit. */
static inline uint32_t adamf_fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}

/* The random 32 bits of element idx: fmix32(fmix32(lo32(idx) ^ k0) ^ (hi32(idx) + k1)).
 * 32-bit multiplies only, so AVX2 computes it lane by lane too (no 64-bit mullo). */
static inline uint32_t adamf_sr_hash(uint32_t k0, uint32_t k1, uint64_t idx) {
    uint32_t h = adamf_fmix32((uint32_t)idx ^ k0);
    return adamf_fmix32(h ^ ((uint32_t)(idx >> 32) + k1));
}

/* f rounded to bf16 stochastically with 16 random bits r (the hash's top half): rounds away
 * from zero with probability (dropped bits) / 2^16. NaN -> 0xFFFF; inf stays inf. */
static inline uint16_t adamf_bf16_sr(float f, uint32_t r) {
    uint32_t u = adam_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffffu;
    return (uint16_t)((u + r) >> 16);
}

/* [Note: stochastic rounding of bf16 moments]
 * bf16 moments are rounded stochastically too, not to nearest: v = beta2 v + (1 - beta2) g^2
 * moves by (1 - beta2) of its distance to g^2 a step, 0.1% at beta2 0.999, under half a bf16
 * ulp (2^-9 = 0.2%) whenever g^2 is near v, so rounding to nearest leaves v where it is: a v
 * that should decay after a large gradient never does, and the update stays small for as long
 * (the update agreement study measured it). Rounded stochastically the stored value is the
 * fp32 one in expectation, and v decays at its rate on average.
 * Each element's one hash h gives each rounding its own 16 bits. m takes h's low 16.
 * With an fp32 master (the default) v takes h's top 16: the two halves of a uniformly
 * distributed 32-bit word are independent, and h of consecutive indices is uniform enough (two
 * rounds of fmix32, a bijection mixing every input bit into every output bit), which the tests
 * check: m's and v's decisions, both exactly halfway and at 1/4 and 3/4, land in each joint
 * outcome at the product of their rates. A bf16 master takes h's top 16 bits itself
 * (adamf_bf16_sr's callers), so there v takes the top 16 of one more mix of h, at the cost of a
 * third fmix32 per element; the fp32-master case, the common one with bf16 moments, is spared it
 * (the SR hash measured ~27% of the bf16-moments kernel's time). */
static inline uint32_t adamf_sr_bits_m(uint32_t h) { return h & 0xffffu; }
static inline uint32_t adamf_sr_bits_v(uint32_t h, int master) {
    if (master == INF_ADAM_MASTER_BF16_SR) return adamf_fmix32(h ^ 0x9e3779b9u) >> 16;
    return h >> 16;
}

/* ---- INT8 blocks ---- */

/* A block whose updated moment holds inf or NaN: absmax NaN, every code the zero code. */
static inline void adamf_block_nonfinite(uint8_t *codes, size_t nb, float *absmax, int zero_code) {
    memset(codes, zero_code, nb);
    *absmax = adam_bits_f32(0x7fc00000u);
}

/* Nearest map entry, ties up: #{ j : bnd[j] <= x } over the 255 ascending bounds; NaN -> 0.
 * (The v map's callers then lift a positive x's code 0 to 1: inf_adam_formats.h.) */
static inline uint32_t adamf_qsearch(const float *bnd, float x) {
    uint32_t idx = 0;
    for (uint32_t s = 128; s; s >>= 1)
        if (x >= bnd[idx + s - 1]) idx += s;
    return idx;
}

#endif
