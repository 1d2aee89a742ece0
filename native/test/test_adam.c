/* Tests of the native CPU Adam (inf_adam.h):
 *  - the scalar 16-bit conversions against the hardware (F16C) on every rounding boundary;
 *  - every SIMD kernel this CPU has against the scalar reference, bit for bit, over sizes 0..40
 *    and larger, element offsets 0..15, all grad/half dtypes, both weight-decay forms, special
 *    values (NaN, inf, signed zeros, subnormals, huge);
 *  - results independent of the thread count; many ranges in one call == one call per range;
 *  - argument errors (-EINVAL, -ENOTSUP); two threads stepping at once; a step after fork();
 *  - the gradient norm's SIMD lanes (adam_norm.c, compiled in here: its functions are hidden in
 *    the library) against its scalar lanes, bit for bit, for every gradient dtype.
 * A kernel the CPU lacks is reported as SKIP (visible), not as a pass.
 * Run: build/<dir>/test_adam   (or tests/unit/test_cpu_adam_c.py compiles and runs it). */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "inf_adam.h"
#include "../src/adam_internal.h"

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

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

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}
static float frand(float lo, float hi) { return lo + (hi - lo) * (float)(rnd() & 0xffffff) / 16777216.0f; }

/* ---- conversions ---- */

#if defined(__x86_64__) || defined(__aarch64__)
#if defined(__x86_64__)
#define HW_F16 __attribute__((target("f16c")))
HW_F16 static uint16_t hw_f32_to_f16(float f) {
    return (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEAREST_INT), 0);
}
HW_F16 static float hw_f16_to_f32(uint16_t h) {
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}
static int have_hw_f16(void) { return __builtin_cpu_supports("f16c"); }
#else
static uint16_t hw_f32_to_f16(float f) {
    return vget_lane_u16(vreinterpret_u16_f16(vcvt_f16_f32(vdupq_n_f32(f))), 0);
}
static float hw_f16_to_f32(uint16_t h) {
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
}
static int have_hw_f16(void) { return 1; }
#endif

static void test_f16_conversions(void) {
    if (!have_hw_f16()) {
        printf("SKIP f16 conversions: CPU lacks F16C (no hardware reference)\n");
        skipped++;
        return;
    }
    for (uint32_t h = 0; h < 65536; h++) {
        uint32_t a = adam_f32_bits(adam_f16_to_f32((uint16_t)h));
        uint32_t b = adam_f32_bits(hw_f16_to_f32((uint16_t)h));
        CHECK(a == b, "f16 %#x -> f32: scalar %#x, F16C %#x", h, a, b);
    }
    /* every sign/exponent/top-10-mantissa prefix with the low 13 bits on rounding boundaries */
    static const uint32_t lows[] = {0, 1, 0xfff, 0x1000, 0x1001, 0x1fff, 0x0800, 0x17ff};
    for (uint32_t hi = 0; hi < (1u << 19); hi++)
        for (size_t k = 0; k < sizeof lows / sizeof lows[0]; k++) {
            uint32_t u = (hi << 13) | lows[k];
            float f = adam_bits_f32(u);
            uint16_t a = adam_f32_to_f16(f), b = hw_f32_to_f16(f);
            CHECK(a == b, "f32 %#x -> f16: scalar %#x, F16C %#x", u, a, b);
        }
    for (uint64_t u = 0; u < (1ull << 32); u += 4093) {
        float f = adam_bits_f32((uint32_t)u);
        uint16_t a = adam_f32_to_f16(f), b = hw_f32_to_f16(f);
        CHECK(a == b, "f32 %#x -> f16: scalar %#x, F16C %#x", (uint32_t)u, a, b);
    }
    passed++;
}
#else
static void test_f16_conversions(void) {
    printf("SKIP f16 conversions: no hardware reference on this architecture\n");
    skipped++;
}
#endif

static void test_bf16_conversion(void) {
    /* round to nearest even, NaN -> 0xffff, overflow -> inf */
    CHECK(adam_f32_to_bf16(adam_bits_f32(0x3f808000u)) == 0x3f80, "tie to even (down)");
    CHECK(adam_f32_to_bf16(adam_bits_f32(0x3f818000u)) == 0x3f82, "tie to even (up)");
    CHECK(adam_f32_to_bf16(adam_bits_f32(0x3f808001u)) == 0x3f81, "above tie");
    CHECK(adam_f32_to_bf16(adam_bits_f32(0x7f7fffffu)) == 0x7f80, "max float -> inf");
    CHECK(adam_f32_to_bf16(adam_bits_f32(0xff800000u)) == 0xff80, "-inf");
    CHECK(adam_f32_to_bf16(adam_bits_f32(0x7fc00000u)) == 0xffff, "NaN");
    CHECK(adam_f32_to_bf16(adam_bits_f32(0xff800001u)) == 0xffff, "-sNaN");
    CHECK(adam_f32_to_bf16(adam_bits_f32(0x00000001u)) == 0x0000, "tiny subnormal");
    passed++;
}

/* ---- kernels against the scalar reference ---- */

static float special(void) {
    static const uint32_t bits[] = {0x7fc00000u, 0xffc00000u, 0x7fa12345u, 0x7f800000u,
                                    0xff800000u, 0x00000000u, 0x80000000u, 0x00000001u,
                                    0x807fffffu, 0x7f7fffffu, 0x3f808000u, 0x477ff000u};
    return adam_bits_f32(bits[rnd() % (sizeof bits / sizeof bits[0])]);
}

static void fill_inputs(float *p, void *g, float *m, float *v, size_t n, int gdt, int specials) {
    for (size_t i = 0; i < n; i++) {
        int sp = specials && rnd() % 16 == 0;
        p[i] = sp ? special() : frand(-2, 2);
        float gi = sp && rnd() % 2 ? special() : frand(-1, 1) * (rnd() % 4 ? 1e-2f : 1e3f);
        if (gdt == INF_ADAM_DTYPE_F32) ((float *)g)[i] = gi;
        else if (gdt == INF_ADAM_DTYPE_BF16) ((uint16_t *)g)[i] = adam_f32_to_bf16(gi);
        else ((uint16_t *)g)[i] = adam_f32_to_f16(gi);
        m[i] = sp && rnd() % 3 == 0 ? special() : frand(-1e-2f, 1e-2f);
        v[i] = frand(0, 1e-3f);
    }
}

struct bufs {
    float *p, *m, *v;
    unsigned char *g;
    uint16_t *h;
};

static struct bufs bufs_new(size_t n, size_t off) {
    struct bufs b;
    b.p = (float *)calloc(n + 16, 4) + off;
    b.m = (float *)calloc(n + 16, 4) + off;
    b.v = (float *)calloc(n + 16, 4) + off;
    b.g = (unsigned char *)calloc(n + 16, 4) + off * 4;
    b.h = (uint16_t *)calloc(n + 16, 2) + off;
    return b;
}

static void bufs_free(struct bufs b, size_t off) {
    free(b.p - off);
    free(b.m - off);
    free(b.v - off);
    free(b.g - off * 4);
    free(b.h - off);
}

static void bufs_copy(struct bufs dst, struct bufs src, size_t n) {
    memcpy(dst.p, src.p, n * 4);
    memcpy(dst.m, src.m, n * 4);
    memcpy(dst.v, src.v, n * 4);
    memcpy(dst.g, src.g, n * 4);
    memcpy(dst.h, src.h, n * 2);
}

/* Bit for bit, except that two NaNs compare equal whatever their payloads: when two different
 * NaNs meet (say a NaN gradient and a NaN param in g + wd * p), IEEE 754 leaves open which
 * payload the result carries, and compilers commute the operands of + and * freely. */
static int same_f32(const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t x = adam_f32_bits(a[i]), y = adam_f32_bits(b[i]);
        if (x != y && !(a[i] != a[i] && b[i] != b[i])) return 0;
    }
    return 1;
}

static int same_half(const uint16_t *a, const uint16_t *b, size_t n, int hdt) {
    for (size_t i = 0; i < n; i++) {
        if (a[i] == b[i]) continue;
        uint16_t ea = hdt == INF_ADAM_DTYPE_F16 ? 0x7c00 : 0x7f80;
        int na = (a[i] & ea) == ea && (a[i] & ~(ea | 0x8000)) != 0;
        int nb = (b[i] & ea) == ea && (b[i] & ~(ea | 0x8000)) != 0;
        if (!(na && nb)) return 0;
    }
    return 1;
}

static int same(struct bufs a, struct bufs b, size_t n, int hdt) {
    return same_f32(a.p, b.p, n) && same_f32(a.m, b.m, n) && same_f32(a.v, b.v, n) &&
           (hdt == INF_ADAM_DTYPE_NONE || same_half(a.h, b.h, n, hdt));
}

static struct inf_adam_hparams hparams(int adamw, double wd, int bias_correction) {
    struct inf_adam_hparams hp = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                                  .weight_decay = wd, .grad_scale = 1.0, .step = 7,
                                  .adamw_mode = adamw, .bias_correction = bias_correction};
    return hp;
}

static int step1(const struct inf_adam_hparams *hp, struct bufs b, size_t n, int gdt, int hdt,
                 int kernel, int threads) {
    struct inf_adam_tensor t = {b.p, b.g, b.m, b.v, hdt == INF_ADAM_DTYPE_NONE ? NULL : b.h,
                                (int64_t)n};
    return inf_adam_step(hp, &t, 1, gdt, hdt, kernel, threads);
}

static void test_kernel_matches_scalar(int kernel) {
    const char *name = inf_adam_kernel_name(kernel);
    if (!inf_adam_kernel_supported(kernel)) {
        printf("SKIP %s kernel: not supported by this CPU/build\n", name);
        skipped++;
        return;
    }
    static const size_t big[] = {1000, 4099, 70001, 300007};
    for (int si = 0; si < 41 + 4; si++) {
        size_t n = si < 41 ? (size_t)si : big[si - 41];
        for (size_t off = 0; off < 16; off += (n < 41 ? 1 : 5)) {
            for (int gdt = 0; gdt < 3; gdt++)
                for (int hdt = -1; hdt < 3; hdt++) {
                    if (hdt == INF_ADAM_DTYPE_F32) continue;
                    for (int mode = 0; mode < 3; mode++) {
                        struct inf_adam_hparams hp =
                            hparams(mode == 0, mode == 2 ? 0.0 : 0.05, mode != 1);
                        hp.grad_scale = mode == 1 ? 1024.0 : 3.0;
                        struct bufs in = bufs_new(n, off), a = bufs_new(n, off), b = bufs_new(n, off);
                        fill_inputs(in.p, in.g, in.m, in.v, n, gdt, 1);
                        bufs_copy(a, in, n);
                        bufs_copy(b, in, n);
                        int ra = step1(&hp, a, n, gdt, hdt, INF_ADAM_KERNEL_SCALAR, 1);
                        int rb = step1(&hp, b, n, gdt, hdt, kernel, 1);
                        int ok = ra == 0 && rb == 0 && same(a, b, n, hdt);
                        bufs_free(in, off);
                        bufs_free(a, off);
                        bufs_free(b, off);
                        CHECK(ok, "%s != scalar: n=%zu offset=%zu grad dtype %d half dtype %d "
                                  "mode %d (rc %d, %d)", name, n, off, gdt, hdt, mode, ra, rb);
                    }
                }
        }
    }
    printf("ok %s kernel == scalar reference (bit for bit)\n", name);
    passed++;
}

/* ---- threads, multi-range, errors ---- */

static void test_threads_and_ranges(void) {
    size_t n = 3 * 1000 * 1000 + 7;
    struct inf_adam_hparams hp = hparams(1, 0.01, 1);
    struct bufs in = bufs_new(n, 3), a = bufs_new(n, 3), b = bufs_new(n, 3);
    fill_inputs(in.p, in.g, in.m, in.v, n, INF_ADAM_DTYPE_F32, 0);
    bufs_copy(a, in, n);
    CHECK(step1(&hp, a, n, INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_BF16, INF_ADAM_KERNEL_AUTO, 1) == 0,
          "1 thread");
    static const int counts[] = {2, 3, 8, 0};
    for (size_t k = 0; k < 4; k++) {
        bufs_copy(b, in, n);
        CHECK(step1(&hp, b, n, INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_BF16, INF_ADAM_KERNEL_AUTO,
                    counts[k]) == 0, "%d threads", counts[k]);
        CHECK(same(a, b, n, INF_ADAM_DTYPE_BF16), "%d threads differ from 1", counts[k]);
    }
    /* the same data as 5 ranges of uneven sizes in one call */
    bufs_copy(b, in, n);
    size_t cuts[] = {0, 1, 65537, 65540, 2000000, n};
    struct inf_adam_tensor ts[5];
    for (int i = 0; i < 5; i++) {
        size_t s = cuts[i];
        ts[i] = (struct inf_adam_tensor){b.p + s, b.g + s * 4, b.m + s, b.v + s, b.h + s,
                                         (int64_t)(cuts[i + 1] - s)};
    }
    CHECK(inf_adam_step(&hp, ts, 5, INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_BF16, INF_ADAM_KERNEL_AUTO,
                        2) == 0, "multi-range");
    CHECK(same(a, b, n, INF_ADAM_DTYPE_BF16), "multi-range differs from one range");
    bufs_free(in, 3);
    bufs_free(a, 3);
    bufs_free(b, 3);
    passed++;
}

static void test_errors(void) {
    float x[4] = {0};
    uint16_t h[4];
    struct inf_adam_tensor t = {x, x + 1, x + 2, x + 3, NULL, 1};
    struct inf_adam_hparams hp = hparams(1, 0.0, 1);
    CHECK(inf_adam_step(&hp, &t, 1, INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_NONE, 0, 1) == 0, "valid");
    struct inf_adam_hparams bad = hp;
    bad.beta1 = 1.0;
    CHECK(inf_adam_step(&bad, &t, 1, 0, -1, 0, 1) == -EINVAL, "beta1 = 1");
    bad = hp;
    bad.step = 0;
    CHECK(inf_adam_step(&bad, &t, 1, 0, -1, 0, 1) == -EINVAL, "step 0 with bias correction");
    bad.bias_correction = 0;
    CHECK(inf_adam_step(&bad, &t, 1, 0, -1, 0, 1) == 0, "step 0 without bias correction");
    bad = hp;
    bad.grad_scale = 0;
    CHECK(inf_adam_step(&bad, &t, 1, 0, -1, 0, 1) == -EINVAL, "grad_scale 0");
    bad = hp;
    bad.lr = -1;
    CHECK(inf_adam_step(&bad, &t, 1, 0, -1, 0, 1) == -EINVAL, "negative lr");
    CHECK(inf_adam_step(NULL, &t, 1, 0, -1, 0, 1) == -EINVAL, "NULL hparams");
    CHECK(inf_adam_step(&hp, &t, 1, 3, -1, 0, 1) == -EINVAL, "grad dtype 3");
    CHECK(inf_adam_step(&hp, &t, 1, 0, INF_ADAM_DTYPE_F32, 0, 1) == -EINVAL, "half dtype f32");
    CHECK(inf_adam_step(&hp, &t, 1, 0, INF_ADAM_DTYPE_BF16, 0, 1) == -EINVAL, "half_out NULL");
    t.half_out = h;
    CHECK(inf_adam_step(&hp, &t, 1, 0, INF_ADAM_DTYPE_BF16, 0, 1) == 0, "half_out given");
    t.numel = -1;
    CHECK(inf_adam_step(&hp, &t, 1, 0, -1, 0, 1) == -EINVAL, "negative numel");
    t.numel = 1;
    t.exp_avg = NULL;
    CHECK(inf_adam_step(&hp, &t, 1, 0, -1, 0, 1) == -EINVAL, "NULL exp_avg");
    t.numel = 0;
    CHECK(inf_adam_step(&hp, &t, 1, 0, -1, 0, 1) == 0, "NULL allowed with numel 0");
    CHECK(inf_adam_step(&hp, NULL, 0, 0, -1, 0, 1) == 0, "no tensors");
    CHECK(inf_adam_step(&hp, &t, 1, 0, -1, 99, 1) == -ENOTSUP, "unknown kernel");
#if defined(__x86_64__)
    CHECK(inf_adam_step(&hp, &t, 1, 0, -1, INF_ADAM_KERNEL_NEON, 1) == -ENOTSUP, "NEON on x86");
#endif
    CHECK(inf_adam_rmw_bandwidth(NULL, x, x, x, 4, 1) == -EINVAL, "rmw NULL");
    {
        enum { RN = 200003 };
        float *a = malloc(RN * 4), *b = malloc(RN * 4), *c = malloc(RN * 4), *d = malloc(RN * 4);
        for (int i = 0; i < RN; i++) a[i] = (float)i, b[i] = 1.0f, c[i] = 2.0f, d[i] = -1.0f;
        int rc = inf_adam_rmw_bandwidth(a, b, c, d, RN, 2), ok = rc == 0;
        for (int i = 0; i < RN && ok; i++) ok = a[i] == (float)i + 1 && c[i] == 3 && d[i] == 0;
        free(a), free(b), free(c), free(d);
        CHECK(ok, "rmw kernel: a, c, d += b wrong (rc %d)", rc);
    }
    CHECK(inf_adam_kernel_name(99) == NULL, "unknown kernel name");
    CHECK(inf_adam_kernel_supported(inf_adam_kernel_best()), "best kernel supported");
    passed++;
}

struct conc {
    struct bufs b;
    size_t n;
    int rc;
};

static void *conc_main(void *arg) {
    struct conc *c = arg;
    struct inf_adam_hparams hp = hparams(1, 0.01, 1);
    for (int i = 0; i < 5 && c->rc == 0; i++)
        c->rc = step1(&hp, c->b, c->n, INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_NONE,
                      INF_ADAM_KERNEL_AUTO, 2);
    return NULL;
}

static void test_concurrent_callers_and_fork(void) {
    size_t n = 500000;
    struct bufs in = bufs_new(n, 0), ref = bufs_new(n, 0);
    fill_inputs(in.p, in.g, in.m, in.v, n, INF_ADAM_DTYPE_F32, 0);
    bufs_copy(ref, in, n);
    struct inf_adam_hparams hp = hparams(1, 0.01, 1);
    for (int i = 0; i < 5; i++)
        step1(&hp, ref, n, INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_NONE, INF_ADAM_KERNEL_AUTO, 1);
    struct conc cs[3];
    pthread_t tids[3];
    for (int k = 0; k < 3; k++) {
        cs[k] = (struct conc){bufs_new(n, 0), n, 0};
        bufs_copy(cs[k].b, in, n);
        pthread_create(&tids[k], NULL, conc_main, &cs[k]);
    }
    int ok = 1;
    for (int k = 0; k < 3; k++) {
        pthread_join(tids[k], NULL);
        ok = ok && cs[k].rc == 0 && same(cs[k].b, ref, n, INF_ADAM_DTYPE_NONE);
        bufs_free(cs[k].b, 0);
    }
    CHECK(ok, "concurrent callers got wrong results");
    /* the pool has workers now; a forked child must still be able to step with threads */
    pid_t pid = fork();
    if (pid == 0) {
        struct bufs c = bufs_new(n, 0);
        bufs_copy(c, in, n);
        for (int i = 0; i < 5; i++)
            if (step1(&hp, c, n, INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_NONE, INF_ADAM_KERNEL_AUTO,
                      2) != 0)
                _exit(2);
        _exit(same(c, ref, n, INF_ADAM_DTYPE_NONE) ? 0 : 3);
    }
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid, "fork/waitpid failed: %s", strerror(errno));
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child after fork: status %#x", status);
    bufs_free(in, 0);
    bufs_free(ref, 0);
    passed++;
}

/* ---- the norm's sum of squares: SIMD lanes == scalar lanes ---- */

#include "../src/adam_norm.c"

static uint16_t sample16(int gdt, int special) {
    static const uint16_t bf16_special[] = {0x0000, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0x0001,
                                            0x8001, 0x7f7f, 0x0080};
    static const uint16_t f16_special[] = {0x0000, 0x8000, 0x7c00, 0xfc00, 0x7e00, 0x0001,
                                           0x83ff, 0x7bff, 0x0400};
    if (special) {
        size_t k = rnd() % 9;
        return gdt == INF_ADAM_DTYPE_BF16 ? bf16_special[k] : f16_special[k];
    }
    float f = frand(-30.0f, 30.0f);
    return gdt == INF_ADAM_DTYPE_BF16 ? adam_f32_to_bf16(f) : adam_f32_to_f16(f);
}

static void test_norm_lanes_match_scalar(void) {
    if (!(inf_cpu_features() & INF_CPU_AVX2)) {
        printf("SKIP norm lanes: no AVX2 on this CPU (the scalar lanes are the only path)\n");
        skipped++;
        return;
    }
    enum { MAXN = 1100 };
    static uint16_t h[MAXN + 16];
    static float f[MAXN + 16];
    const int dtypes[] = {INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_BF16, INF_ADAM_DTYPE_F16};
    for (int d = 0; d < 3; d++) {
        int gdt = dtypes[d];
        for (size_t n = 0; n <= MAXN; n += (n < 40 ? 1 : 53)) {
            for (size_t off = 0; off < 16; off += 5) {
                int special = n % 3 == 1;     /* inf, NaN, subnormals, signed zeros among values */
                for (size_t i = 0; i < n + off; i++) {
                    h[i] = sample16(gdt == INF_ADAM_DTYPE_F32 ? INF_ADAM_DTYPE_BF16 : gdt,
                                    special && rnd() % 7 == 0);
                    f[i] = adam_bf16_to_f32(h[i]);
                }
                const void *g = gdt == INF_ADAM_DTYPE_F32 ? (const void *)(f + off)
                                                          : (const void *)(h + off);
                double acc[LANES] = {0};
                lanes_scalar(acc, g, 0, n, gdt);
                double want = combine(acc), got = inf_adam_grad_sq_sum(g, n, gdt);
                int same = (want != want && got != got) || memcmp(&want, &got, sizeof want) == 0;
                CHECK(same, "norm lanes, dtype %d, n %zu, offset %zu: simd %.17g, scalar %.17g",
                      gdt, n, off, got, want);
            }
        }
    }
    passed++;
}

int main(void) {
    printf("best kernel: %s\n", inf_adam_kernel_name(inf_adam_kernel_best()));
    test_f16_conversions();
    test_bf16_conversion();
    test_kernel_matches_scalar(INF_ADAM_KERNEL_AVX2);
    test_kernel_matches_scalar(INF_ADAM_KERNEL_AVX512);
    test_kernel_matches_scalar(INF_ADAM_KERNEL_NEON);
    test_threads_and_ranges();
    test_errors();
    test_concurrent_callers_and_fork();
    test_norm_lanes_match_scalar();
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    return failed ? 1 : 0;
}
