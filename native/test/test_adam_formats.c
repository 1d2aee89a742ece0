/* Tests of the Adam state formats (inf_adam_formats.h):
 *  - the maps: ascending, 0 and 1.0 where documented, bounds strictly between neighbours;
 *  - every SIMD kernel this CPU has against the scalar reference, bit for bit (param, 16-bit
 *    copy, moments, block scales), for bf16 and int8 moments, fp32 and bf16-SR masters, every
 *    grad/half dtype, AdamW / Adam+L2 / Adam, sizes 0..4100 (around the vector widths and the
 *    2048-element block), block-aligned offsets (and offsets around 2^32 for the SR counter),
 *    with special values: NaN, +-inf, subnormals, huge gradients, zero and subnormal scales;
 *  - the fp32 master's update equals inf_adam_step's on the dequantized moments, bit for bit;
 *  - stochastic rounding: unbiased, and m's and v's decisions independent (both masters);
 *  - results independent of the thread count; -EINVAL for a misaligned int8 offset and the like.
 * A kernel the CPU lacks is reported as SKIP (visible), not as a pass.
 * Run: build/<dir>/test_adam_formats  (or tests/unit/test_adam_formats.py compiles and runs it). */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "inf_adam.h"
#include "inf_adam_formats.h"

static int passed, failed, skipped;

#define CHECK(cond, ...)                                                                          \
    do {                                                                                          \
        if (!(cond)) {                                                                            \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                           \
            printf(__VA_ARGS__);                                                                  \
            printf("\n");                                                                         \
            failed++;                                                                             \
            return;                                                                               \
        }                                                                                         \
    } while (0)

#define QB INF_ADAM_QBLOCK

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}
static float frand(float lo, float hi) { return lo + (hi - lo) * (float)(rnd() & 0xffffff) / 16777216.0f; }

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static uint16_t bf16_rne(float f) { /* test-side copy of the rounding (NaN -> 0xffff) */
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffff;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static float bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }
/* Whether h is one of f's two bf16 neighbours (f truncated, or one ulp further from zero; f
 * itself when representable): what stochastic rounding may give. NaN -> 0xffff. */
static int bf16_neighbour(uint16_t h, float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return h == 0xffff;
    uint16_t down = (uint16_t)(u >> 16);
    return h == down || ((u & 0xffffu) && h == (uint16_t)(down + 1));
}

/* One range's buffers in a given format. */
struct state {
    size_t n, nblk;
    int moments, master, gdt, hdt;
    void *p, *g, *m, *v, *half;
    float *ms, *vs;
};

static size_t gsize(int dt) { return dt == INF_ADAM_DTYPE_F32 ? 4 : 2; }

static void state_alloc(struct state *s, size_t n, int moments, int master, int gdt, int hdt) {
    s->n = n;
    s->nblk = (n + QB - 1) / QB;
    s->moments = moments, s->master = master, s->gdt = gdt, s->hdt = hdt;
    /* +1 element of slack: pointers are never NULL for n == 0; moments and params sized for
     * any format (test_errors steps one state as both) */
    s->p = calloc(n + 1, 4);
    s->g = calloc(n + 1, gsize(gdt));
    s->m = calloc(n + 1, 2);
    s->v = calloc(n + 1, 2);
    s->half = calloc(n + 1, 2);
    s->ms = calloc(s->nblk + 1, 4);
    s->vs = calloc(s->nblk + 1, 4);
}

static void state_free(struct state *s) {
    free(s->p), free(s->g), free(s->m), free(s->v), free(s->half), free(s->ms), free(s->vs);
}

static void state_copy(struct state *d, const struct state *s) {
    state_alloc(d, s->n, s->moments, s->master, s->gdt, s->hdt);
    size_t msz = s->moments == INF_ADAM_MOMENTS_INT8 ? 1 : 2;
    memcpy(d->p, s->p, s->n * (s->master == INF_ADAM_MASTER_F32 ? 4 : 2));
    memcpy(d->g, s->g, s->n * gsize(s->gdt));
    memcpy(d->m, s->m, s->n * msz);
    memcpy(d->v, s->v, s->n * msz);
    memcpy(d->half, s->half, s->n * 2);
    memcpy(d->ms, s->ms, s->nblk * 4);
    memcpy(d->vs, s->vs, s->nblk * 4);
}

/* Two NaNs are equal whatever their payloads (test_adam.c's rule: when two different NaNs meet,
 * IEEE 754 leaves open which payload the result carries, and compilers commute the operands of +
 * and * freely). Only the fp32 master and an fp16 copy carry payloads; every other output is
 * canonical (bf16 NaN 0xffff, an int8 block's NaN scale 0x7fc00000) and compared byte for byte. */
static int nan32(uint32_t x) { return (x & 0x7fffffffu) > 0x7f800000u; }
static int nan16(uint16_t x) { return (x & 0x7c00u) == 0x7c00u && (x & 0x3ffu); }

/* First differing element (byte for the byte-compared buffers) of two states, or -1. */
static long state_diff(const struct state *a, const struct state *b, const char **what) {
    size_t msz = a->moments == INF_ADAM_MOMENTS_INT8 ? 1 : 2;
    if (a->master == INF_ADAM_MASTER_F32) {
        const uint32_t *x = a->p, *y = b->p;
        for (size_t i = 0; i < a->n; i++)
            if (x[i] != y[i] && !(nan32(x[i]) && nan32(y[i]))) {
                *what = "param";
                return (long)i;
            }
    }
    if (a->hdt == INF_ADAM_DTYPE_F16) {
        const uint16_t *x = a->half, *y = b->half;
        for (size_t i = 0; i < a->n; i++)
            if (x[i] != y[i] && !(nan16(x[i]) && nan16(y[i]))) {
                *what = "half_out";
                return (long)i;
            }
    }
    struct { const char *name; const void *x, *y; size_t bytes; } bufs[] = {
        {"param", a->p, b->p, a->master == INF_ADAM_MASTER_F32 ? 0 : a->n * 2},
        {"exp_avg", a->m, b->m, a->n * msz},
        {"exp_avg_sq", a->v, b->v, a->n * msz},
        {"half_out", a->half, b->half, a->hdt == INF_ADAM_DTYPE_BF16 ? a->n * 2 : 0},
        {"exp_avg_absmax", a->ms, b->ms, a->moments == INF_ADAM_MOMENTS_INT8 ? a->nblk * 4 : 0},
        {"exp_avg_sq_absmax", a->vs, b->vs, a->moments == INF_ADAM_MOMENTS_INT8 ? a->nblk * 4 : 0},
    };
    for (size_t k = 0; k < sizeof bufs / sizeof bufs[0]; k++) {
        if (!memcmp(bufs[k].x, bufs[k].y, bufs[k].bytes)) continue;
        const unsigned char *x = bufs[k].x, *y = bufs[k].y;
        for (size_t i = 0; i < bufs[k].bytes; i++)
            if (x[i] != y[i]) {
                *what = bufs[k].name;
                return (long)i;
            }
    }
    return -1;
}

static const float specials[] = {NAN, INFINITY, -INFINITY, 1e-42f, -3e-39f, 3e38f, -0.0f, 0.0f};

static void state_fill(struct state *s, int special) {
    for (size_t i = 0; i < s->n; i++) {
        float p = frand(-1, 1), g = frand(-1, 1) * (rnd() % 4 ? 1.0f : 1e-3f);
        if (special && rnd() % 97 == 0) g = specials[rnd() % 8];
        if (special && rnd() % 211 == 0) p = specials[3 + rnd() % 2]; /* subnormal params */
        if (s->master == INF_ADAM_MASTER_F32) ((float *)s->p)[i] = p;
        else ((uint16_t *)s->p)[i] = bf16_rne(p);
        if (s->gdt == INF_ADAM_DTYPE_F32) ((float *)s->g)[i] = g;
        else if (s->gdt == INF_ADAM_DTYPE_BF16) ((uint16_t *)s->g)[i] = bf16_rne(g);
        else { /* fp16: random bits, NaN/inf patterns included */
            uint16_t h = (uint16_t)rnd();
            if (!special && (h & 0x7c00u) == 0x7c00u) h &= 0xbfffu;
            ((uint16_t *)s->g)[i] = h;
        }
        if (s->moments == INF_ADAM_MOMENTS_INT8) {
            ((uint8_t *)s->m)[i] = (uint8_t)rnd();
            ((uint8_t *)s->v)[i] = (uint8_t)rnd();
        } else {
            float m = frand(-0.1f, 0.1f), v = frand(0, 0.01f);
            if (special && rnd() % 101 == 0) m = specials[rnd() % 8];
            if (special && rnd() % 103 == 0) v = specials[3 + rnd() % 5];
            ((uint16_t *)s->m)[i] = bf16_rne(m);
            ((uint16_t *)s->v)[i] = bf16_rne(fabsf(v));
        }
    }
    for (size_t b = 0; b < s->nblk; b++) {
        unsigned kind = rnd() % 4;
        s->ms[b] = frand(0, 0.2f);
        s->vs[b] = frand(0, 0.02f);
        if (kind == 1) s->ms[b] = 0.0f, s->vs[b] = 0.0f; /* a fresh (all-zero) block */
        if (special && kind == 2) s->ms[b] = 1e-40f, s->vs[b] = 2e-41f; /* subnormal scales */
        if (special && kind == 3) s->ms[b] = NAN;   /* a block made non-finite by an earlier step */
    }
}

static int step(const struct state *s, const struct inf_adam_hparams *hp, int64_t offset,
                uint64_t seed, int kernel, int threads) {
    struct inf_adam_fmt_tensor t = {s->p, s->g, s->m, s->v, s->ms, s->vs,
                                    s->hdt == INF_ADAM_DTYPE_NONE ? NULL : s->half, offset,
                                    (int64_t)s->n};
    return inf_adam_step_fmt(hp, &t, 1, s->gdt, s->hdt, s->moments, s->master, seed, kernel,
                             threads);
}

static struct inf_adam_hparams hparams(int mode) {
    /* mode 0: AdamW, 1: Adam + L2, 2: Adam without weight decay; grad_scale != 1 */
    struct inf_adam_hparams hp = {1e-3, 0.9, 0.999, 1e-8, mode == 2 ? 0.0 : 0.01, 4.0, 7,
                                  mode == 0, 1};
    return hp;
}

static const size_t sizes[] = {0, 1, 7, 8, 9, 15, 16, 17, 31, 2047, 2048, 2049, 4095, 4096, 4100};
#define NSIZES (sizeof sizes / sizeof sizes[0])

static void test_maps(void) {
    float v[256], b[255];
    for (int map = 0; map < 2; map++) {
        CHECK(inf_adam_qmap(map, v, b) == 0, "qmap %d", map);
        for (int j = 0; j < 255; j++) {
            CHECK(v[j] < v[j + 1], "map %d not ascending at %d", map, j);
            CHECK(v[j] < b[j] && b[j] < v[j + 1], "map %d bound %d not between", map, j);
        }
        CHECK(v[255] == 1.0f, "map %d max %g", map, v[255]);
    }
    inf_adam_qmap(INF_ADAM_QMAP_SIGNED, v, NULL);
    CHECK(v[127] == 0.0f && v[0] < -0.99f, "signed map: code 127 is 0, code 0 near -1");
    inf_adam_qmap(INF_ADAM_QMAP_UNSIGNED, v, NULL);
    CHECK(v[0] == 0.0f && v[1] > 3e-7f && v[1] < 4e-7f, "unsigned map: 0, then 3.25e-7");
    CHECK(inf_adam_qmap(2, v, b) == -EINVAL, "unknown map");
    CHECK(inf_adam_qlut_ready() == 1, "the code lookup table was not built: the SIMD kernels "
                                      "search (see [Note: the code lookup table])");
    passed++;
}

static void test_kernel_matches_scalar(int kernel) {
    const char *name = inf_adam_kernel_name(kernel);
    if (!inf_adam_fmt_kernel_supported(kernel)) {
        printf("SKIP %s format kernel: not supported by this CPU/build\n", name);
        skipped++;
        return;
    }
    long runs = 0;
    for (int moments = INF_ADAM_MOMENTS_BF16; moments <= INF_ADAM_MOMENTS_INT8; moments++)
        for (int master = 0; master <= 1; master++)
            for (int gdt = 0; gdt <= 2; gdt++)
                for (int hdt = -1; hdt <= 2; hdt++) {
                    if (hdt == INF_ADAM_DTYPE_F32) continue;
                    if (master == INF_ADAM_MASTER_BF16_SR && hdt != INF_ADAM_DTYPE_NONE) continue;
                    for (int mode = 0; mode < 3; mode++)
                        for (size_t si = 0; si < NSIZES; si++)
                            for (int oi = 0; oi < 3; oi++) {
                                size_t n = sizes[si];
                                /* offsets: 0, a block-aligned one, one just below 2^32 */
                                int64_t offset = oi == 0 ? 0 : oi == 1 ? 3 * QB
                                                                       : (int64_t)(1ull << 32) - QB;
                                if (moments == INF_ADAM_MOMENTS_BF16 && oi == 2) offset += 3;
                                struct state a, b;
                                state_alloc(&a, n, moments, master, gdt, hdt);
                                state_fill(&a, (si + oi + mode) % 2);
                                state_copy(&b, &a);
                                struct inf_adam_hparams hp = hparams(mode);
                                int ra = step(&a, &hp, offset, 42, INF_ADAM_KERNEL_SCALAR, 1);
                                int rb = step(&b, &hp, offset, 42, kernel, 1);
                                const char *what = "";
                                long at = state_diff(&a, &b, &what);
                                state_free(&a);
                                state_free(&b);
                                CHECK(ra == 0 && rb == 0, "rc %d %d", ra, rb);
                                CHECK(at < 0,
                                      "%s != scalar: moments %d master %d grad %d half %d mode %d "
                                      "n %zu offset %lld: %s differs at %ld",
                                      name, moments, master, gdt, hdt, mode, n, (long long)offset,
                                      what, at);
                                runs++;
                            }
                }
    printf("ok %s format kernels == scalar reference (bit for bit, %ld cases)\n", name, runs);
    passed++;
}

/* The fp32 master's update and 16-bit copy equal inf_adam_step's on the dequantized moments. */
static void test_param_equals_fp32_kernel(void) {
    float map_s[256], map_u[256];
    inf_adam_qmap(INF_ADAM_QMAP_SIGNED, map_s, NULL);
    inf_adam_qmap(INF_ADAM_QMAP_UNSIGNED, map_u, NULL);
    for (int moments = INF_ADAM_MOMENTS_BF16; moments <= INF_ADAM_MOMENTS_INT8; moments++)
        for (int mode = 0; mode < 3; mode++) {
            size_t n = 4100;
            struct state s;
            state_alloc(&s, n, moments, INF_ADAM_MASTER_F32, INF_ADAM_DTYPE_F32,
                        INF_ADAM_DTYPE_BF16);
            state_fill(&s, 1);
            float *p = malloc(n * 4), *m = malloc(n * 4), *v = malloc(n * 4);
            uint16_t *h = malloc(n * 2);
            memcpy(p, s.p, n * 4);
            for (size_t i = 0; i < n; i++) {
                if (moments == INF_ADAM_MOMENTS_INT8) {
                    m[i] = map_s[((uint8_t *)s.m)[i]] * s.ms[i / QB];
                    v[i] = map_u[((uint8_t *)s.v)[i]] * s.vs[i / QB];
                } else {
                    m[i] = bf16_f32(((uint16_t *)s.m)[i]);
                    v[i] = bf16_f32(((uint16_t *)s.v)[i]);
                }
            }
            struct inf_adam_hparams hp = hparams(mode);
            struct inf_adam_tensor t = {p, s.g, m, v, h, (int64_t)n};
            int r1 = inf_adam_step(&hp, &t, 1, INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_BF16,
                                   INF_ADAM_KERNEL_SCALAR, 1);
            int r2 = step(&s, &hp, 0, 1, INF_ADAM_KERNEL_AUTO, 1);
            int same = !memcmp(h, s.half, n * 2);
            for (size_t i = 0; i < n; i++) {
                uint32_t x = f32_bits(p[i]), y = ((uint32_t *)s.p)[i];
                same &= x == y || (nan32(x) && nan32(y));
            }
            int moments_ok = 1;
            if (moments == INF_ADAM_MOMENTS_BF16)
                for (size_t i = 0; i < n; i++)
                    moments_ok &= bf16_neighbour(((uint16_t *)s.m)[i], m[i]) &&
                                  bf16_neighbour(((uint16_t *)s.v)[i], v[i]);
            state_free(&s);
            free(p), free(m), free(v), free(h);
            CHECK(r1 == 0 && r2 == 0, "rc %d %d", r1, r2);
            CHECK(same, "moments %d mode %d: param/half differ from inf_adam_step's", moments, mode);
            CHECK(moments_ok, "bf16 moments are not the fp32 kernel's rounded to a neighbour");
        }
    passed++;
}

static void test_threads(void) {
    for (int moments = INF_ADAM_MOMENTS_BF16; moments <= INF_ADAM_MOMENTS_INT8; moments++)
        for (int master = 0; master <= 1; master++) {
            size_t n = 300001;
            struct state a, b;
            state_alloc(&a, n, moments, master, INF_ADAM_DTYPE_BF16, INF_ADAM_DTYPE_NONE);
            state_fill(&a, 0);
            state_copy(&b, &a);
            struct inf_adam_hparams hp = hparams(0);
            int ra = step(&a, &hp, 5 * QB, 9, INF_ADAM_KERNEL_AUTO, 1);
            int rb = step(&b, &hp, 5 * QB, 9, INF_ADAM_KERNEL_AUTO, 4);
            const char *what = "";
            long at = state_diff(&a, &b, &what);
            state_free(&a);
            state_free(&b);
            CHECK(ra == 0 && rb == 0, "rc %d %d", ra, rb);
            CHECK(at < 0, "1 vs 4 threads differ (moments %d master %d): %s byte %ld", moments,
                  master, what, at);
        }
    passed++;
}

/* Stochastic rounding: unbiased on average, and a different seed gives different bits. */
static void test_stochastic_rounding(void) {
    size_t n = 1 << 16;
    struct state s;
    state_alloc(&s, n, INF_ADAM_MOMENTS_BF16, INF_ADAM_MASTER_BF16_SR, INF_ADAM_DTYPE_F32,
                INF_ADAM_DTYPE_NONE);
    /* lr 0: the update is p * 1 - 0, so p is re-rounded as itself (exact: no change) ... */
    struct inf_adam_hparams hp = {0.0, 0.9, 0.999, 1e-8, 0.0, 1.0, 1, 1, 1};
    for (size_t i = 0; i < n; i++) ((uint16_t *)s.p)[i] = bf16_rne(1.0f);
    int rc = step(&s, &hp, 0, 3, INF_ADAM_KERNEL_AUTO, 1);
    int unchanged = 1;
    for (size_t i = 0; i < n; i++) unchanged &= ((uint16_t *)s.p)[i] == 0x3f80;
    CHECK(rc == 0 && unchanged, "a representable value must stay put (rc %d)", rc);
    /* ... and an update of a quarter ulp (1 + 2^-10 from 1; bf16 ulp at 1 is 2^-7) lands on
     * 1 + 2^-7 about 1/8 of the time (2^-10 / 2^-7) */
    hp.lr = 1.0 / 1024, hp.weight_decay = 0.0;
    for (size_t i = 0; i < n; i++) {
        ((uint16_t *)s.p)[i] = 0x3f80;
        ((uint16_t *)s.m)[i] = 0, ((uint16_t *)s.v)[i] = 0;
        ((float *)s.g)[i] = -1.0f; /* m/d = -1 at step 1 with bias correction: p += lr */
    }
    hp.eps = 0.0;
    rc = step(&s, &hp, 0, 3, INF_ADAM_KERNEL_AUTO, 1);
    size_t up = 0;
    for (size_t i = 0; i < n; i++) up += ((uint16_t *)s.p)[i] == 0x3f81;
    double frac = (double)up / (double)n;
    state_free(&s);
    CHECK(rc == 0 && frac > 0.115 && frac < 0.135, "rounded up %.4f of the time, want 0.125", frac);
    /* bf16 moments too (see [Note: stochastic rounding of bf16 moments]): v = 1 with a zero
     * gradient decays to 0.999, a quarter ulp below 1 (the ulp under 1 is 2^-8), which rounding
     * to nearest would leave at 1 forever; stochastically it lands on 1 - 2^-8 with probability
     * 0.001 / 2^-8 = 0.256, so the stored v decays at its rate on average. m = 0.5 decays to
     * 0.45, 0.4 of an ulp (2^-9) above 0.44921875: down with probability 0.6. */
    for (int master = 0; master <= 1; master++) { /* v's bits differ by master: both */
        state_alloc(&s, n, INF_ADAM_MOMENTS_BF16, master, INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_NONE);
        for (size_t i = 0; i < n; i++) {
            if (master == INF_ADAM_MASTER_F32) ((float *)s.p)[i] = 1.0f;
            else ((uint16_t *)s.p)[i] = bf16_rne(1.0f);
            ((float *)s.g)[i] = 0.0f;
            ((uint16_t *)s.m)[i] = bf16_rne(0.5f), ((uint16_t *)s.v)[i] = bf16_rne(1.0f);
        }
        hp = (struct inf_adam_hparams){0.0, 0.9, 0.999, 1e-8, 0.0, 1.0, 2, 1, 1};
        rc = step(&s, &hp, 0, 3, INF_ADAM_KERNEL_AUTO, 1);
        size_t v_down = 0, m_down = 0, other = 0;
        for (size_t i = 0; i < n; i++) {
            uint16_t mi = ((uint16_t *)s.m)[i], vi = ((uint16_t *)s.v)[i];
            v_down += vi == 0x3f7f;
            m_down += mi == 0x3ee6;
            other += (vi != 0x3f7f && vi != 0x3f80) || (mi != 0x3ee6 && mi != 0x3ee7);
        }
        double fv = (double)v_down / (double)n, fm = (double)m_down / (double)n;
        state_free(&s);
        CHECK(rc == 0 && other == 0, "master %d: moments rounded off their neighbours (%zu; rc %d)",
              master, other, rc);
        CHECK(fv > 0.24 && fv < 0.272, "master %d: v rounded down %.4f of the time, want 0.256",
              master, fv);
        CHECK(fm > 0.58 && fm < 0.62, "master %d: m rounded down %.4f of the time, want 0.6",
              master, fm);
    }
    passed++;
}

/* m's and v's rounding decisions are independent (see [Note: stochastic rounding of bf16
 * moments]: with an fp32 master they are the low and the top 16 bits of one hash). With a zero
 * gradient and beta1 = beta2 = 0.75 the moments become 3x/4 exactly, for a bf16 x chosen so
 * that 3x/4 lies 1/4, 1/2 or 3/4 of an ulp above its lower neighbour: rounded up with that
 * probability. Over n elements each of the four joint outcomes (m up or not, v up or not)
 * should then be a Binomial(n, p) count, p the product of the two rates; it must lie within 5
 * of its standard deviations sqrt(n p (1 - p)) of n p (a false alarm has probability ~6e-7 per
 * count, ~1e-5 over the 16 distinct ones: the kernels agree bit for bit). The seed is fixed, so
 * the outcome is too. At n = 2^17 a correlation rho of the two decisions of ~0.025 fails it
 * (both halfway: P(both up) = (1 + rho) / 4, 5 sd of the fraction = 5 sqrt(3/16 / n) = 0.006).
 * The scalar kernel (the definition) and the one this CPU runs (AUTO) are both counted. */
/* sqrt(x) for x > 0 by Newton's method (the tests link without libm). */
static double root(double x) {
    double r = x > 1 ? x : 1;
    for (int i = 0; i < 64; i++) r = (r + x / r) / 2;
    return r;
}

static void test_moment_roundings_independent(void) {
    size_t n = 1 << 17;
    /* x (bf16) -> 3x/4's dropped bits: 0x3f81 -> 0x8000, 0x3fff -> 0x4000, 0x3fd5 -> 0xc000 */
    static const struct { uint16_t m, v; uint32_t dm, dv; } cases[] = {
        {0x3f81, 0x3f81, 0x8000, 0x8000}, {0x3fff, 0x3fd5, 0x4000, 0xc000}};
    static const int kernels[] = {INF_ADAM_KERNEL_SCALAR, INF_ADAM_KERNEL_AUTO};
    for (int ki = 0; ki < 2; ki++)
        for (int master = 0; master <= 1; master++)
            for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
                int kernel = kernels[ki];
                const char *name = inf_adam_kernel_name(kernel);
                uint32_t mb = f32_bits(0.75f * bf16_f32(cases[c].m));
                uint32_t vb = f32_bits(0.75f * bf16_f32(cases[c].v));
                CHECK((mb & 0xffffu) == cases[c].dm && (vb & 0xffffu) == cases[c].dv,
                      "test setup: 3x/4 drops 0x%04x, 0x%04x, want 0x%04x, 0x%04x", mb & 0xffffu,
                      vb & 0xffffu, cases[c].dm, cases[c].dv);
                struct state s;
                state_alloc(&s, n, INF_ADAM_MOMENTS_BF16, master, INF_ADAM_DTYPE_F32,
                            INF_ADAM_DTYPE_NONE);
                for (size_t i = 0; i < n; i++) {
                    if (master == INF_ADAM_MASTER_F32) ((float *)s.p)[i] = 1.0f;
                    else ((uint16_t *)s.p)[i] = bf16_rne(1.0f);
                    ((float *)s.g)[i] = 0.0f;
                    ((uint16_t *)s.m)[i] = cases[c].m, ((uint16_t *)s.v)[i] = cases[c].v;
                }
                struct inf_adam_hparams hp = {0.0, 0.75, 0.75, 1e-8, 0.0, 1.0, 2, 1, 1};
                int rc = step(&s, &hp, 0, 11, kernel, 1);
                size_t count[2][2] = {{0, 0}, {0, 0}}, other = 0;
                for (size_t i = 0; i < n; i++) {
                    uint16_t mi = ((uint16_t *)s.m)[i], vi = ((uint16_t *)s.v)[i];
                    uint16_t m_down = (uint16_t)(mb >> 16), v_down = (uint16_t)(vb >> 16);
                    int mu = mi == m_down + 1, vu = vi == v_down + 1;
                    other += (!mu && mi != m_down) || (!vu && vi != v_down);
                    count[mu][vu]++;
                }
                state_free(&s);
                CHECK(rc == 0 && other == 0, "%s kernel, master %d case %zu: moments off their "
                      "neighbours (%zu; rc %d)", name, master, c, other, rc);
                double pm = cases[c].dm / 65536.0, pv = cases[c].dv / 65536.0;
                for (int mu = 0; mu < 2; mu++)
                    for (int vu = 0; vu < 2; vu++) {
                        double p = (mu ? pm : 1 - pm) * (vu ? pv : 1 - pv);
                        double want = (double)n * p, sd = root((double)n * p * (1 - p));
                        CHECK(fabs((double)count[mu][vu] - want) <= 5 * sd,
                              "%s kernel, master %d, m up w.p. %.2f, v up w.p. %.2f: (m %s, "
                              "v %s) %zu of %zu times, want %.0f +- %.0f (5 sd): m's and v's "
                              "roundings are correlated", name, master, pm, pv,
                              mu ? "up" : "down", vu ? "up" : "down", count[mu][vu], n, want,
                              5 * sd);
                    }
                printf("ok %s kernel, master %d, m/v up w.p. %.2f/%.2f: (down,down) %zu "
                       "(down,up) %zu (up,down) %zu (up,up) %zu of %zu\n", name, master, pm, pv,
                       count[0][0], count[0][1], count[1][0], count[1][1], n);
            }
    passed++;
}

static void test_errors(void) {
    struct state s;
    state_alloc(&s, 100, INF_ADAM_MOMENTS_INT8, INF_ADAM_MASTER_F32, 0, -1);
    struct inf_adam_hparams hp = hparams(0);
    CHECK(step(&s, &hp, 1, 0, 0, 1) == -EINVAL, "int8 offset not block-aligned");
    CHECK(step(&s, &hp, QB / 2, 0, 0, 1) == -EINVAL, "int8 offset half a block");
    CHECK(step(&s, &hp, -QB, 0, 0, 1) == -EINVAL, "negative offset");
    CHECK(step(&s, &hp, QB, 0, 0, 1) == 0, "aligned offset");
    struct inf_adam_fmt_tensor t = {s.p, s.g, s.m, s.v, NULL, s.vs, NULL, 0, 100};
    CHECK(inf_adam_step_fmt(&hp, &t, 1, 0, -1, INF_ADAM_MOMENTS_INT8, 0, 0, 0, 1) == -EINVAL,
          "int8 without scales");
    CHECK(inf_adam_step_fmt(&hp, &t, 1, 0, -1, INF_ADAM_MOMENTS_BF16, 0, 0, 0, 1) == 0,
          "bf16 needs no scales");
    CHECK(inf_adam_step_fmt(&hp, &t, 1, 0, -1, 3, 0, 0, 0, 1) == -EINVAL, "unknown moments");
    CHECK(inf_adam_step_fmt(&hp, &t, 1, 0, -1, INF_ADAM_MOMENTS_BF16, 2, 0, 0, 1) == -EINVAL,
          "unknown master");
    CHECK(inf_adam_step_fmt(&hp, &t, 1, 0, INF_ADAM_DTYPE_BF16, INF_ADAM_MOMENTS_BF16,
                            INF_ADAM_MASTER_BF16_SR, 0, 0, 1) == -EINVAL,
          "bf16 master with a 16-bit copy");
    CHECK(inf_adam_step_fmt(&hp, &t, 1, 0, -1, INF_ADAM_MOMENTS_BF16, 0, 0, 99, 1) == -ENOTSUP,
          "unknown kernel");
    hp.beta1 = 1.0;
    CHECK(inf_adam_step_fmt(&hp, &t, 1, 0, -1, INF_ADAM_MOMENTS_BF16, 0, 0, 0, 1) == -EINVAL,
          "beta1 1");
    state_free(&s);
    passed++;
}

int main(void) {
    test_maps();
    test_kernel_matches_scalar(INF_ADAM_KERNEL_AVX2);
    test_kernel_matches_scalar(INF_ADAM_KERNEL_AVX512);
    test_kernel_matches_scalar(INF_ADAM_KERNEL_NEON);
    test_param_equals_fp32_kernel();
    test_threads();
    test_stochastic_rounding();
    test_moment_roundings_independent();
    test_errors();
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    return failed ? 1 : 0;
}
