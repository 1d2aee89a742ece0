/* CPU Adam entry points: argument checks, per-step constants, kernel choice, and the split of a
 * call's ranges into cache-line aligned chunks shared by the thread pool. */
/* The constants must be the very doubles the Python torch path computes: no fused multiply-add
 * (AArch64 compilers would fuse 1 - lr * weight_decay). */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <errno.h>
#include <math.h> /* isfinite only: the library needs no libm */
#include <stdatomic.h>
#include <stdlib.h>

#include "adam_internal.h"
#include "inf_info.h"

/* Elements per chunk: 256 KiB of each fp32 stream. Small enough that threads finish together on a
 * noisy machine, large enough that each stream is a long sequential run for the prefetchers. */
#define CHUNK_ELEMS (64 * 1024)
/* Below this many elements per thread, waking a worker costs more than it saves. */
#define MIN_ELEMS_PER_THREAD (64 * 1024)

struct chunk {
    const struct inf_adam_tensor *t;
    int64_t begin, end;
};

/* What a pass does on each chunk besides its range function: fold staged adds into the
 * gradient first (inf_adam_step_fold), sum the gradient's squares (the norm), zero the gradient
 * after the update (inf_adam_step_zero, fold). Each while the chunk is in cache. A plain pass
 * (a step, an accumulate, the bandwidth reference) leaves them all out: PLAIN_PASS. */
struct pass_extras {
    double *sq_sum;                          /* the call's sum of squares, or NULL */
    int zero_grad;
    const struct inf_adam_addend *addends;   /* their range: an index into the call's tensors */
    int naddends;
};
static const struct pass_extras PLAIN_PASS = {0};

struct job {
    const struct adam_consts *c;
    adam_range_fn fn;
    const struct chunk *chunks;
    size_t nchunks;
    int gdt, hdt;
    double *chunk_sq; /* per chunk: its gradient's sum of squares (inf_adam_step_norm), or NULL */
    int zero_grad;    /* zero each chunk's gradient after its update (inf_adam_step_zero) */
    const struct inf_adam_tensor *ranges;       /* the call's first range (addends name theirs) */
    const struct inf_adam_addend *addends;      /* added into a chunk first (inf_adam_step_fold) */
    int naddends;
    atomic_size_t next;
};

static void accumulate_range(const struct adam_consts *c, float *restrict dst, const void *src,
                             float *m, float *v, void *half, size_t n, int gdt, int hdt);

/* The addends of the chunk's range that overlap it, added into its fp32 gradient in the order
 * given (each add inf_grad_accumulate's bits), so the update reads the whole gradient. */
static void fold_addends(const struct job *j, const struct chunk *ch) {
    int range = (int)(ch->t - j->ranges);
    float *grad = (float *)ch->t->grad;
    for (int k = 0; k < j->naddends; k++) {
        const struct inf_adam_addend *a = &j->addends[k];
        if (a->range != range) continue;
        int64_t lo = a->begin > ch->begin ? a->begin : ch->begin;
        int64_t hi = a->begin + a->numel < ch->end ? a->begin + a->numel : ch->end;
        if (lo >= hi) continue;
        size_t asz = a->dtype == INF_ADAM_DTYPE_F32 ? 4 : 2;
        accumulate_range(NULL, grad + lo, (const unsigned char *)a->values + (size_t)(lo - a->begin) * asz,
                         NULL, NULL, NULL, (size_t)(hi - lo), a->dtype, INF_ADAM_DTYPE_NONE);
    }
}

static size_t dtype_size(int dt) { return dt == INF_ADAM_DTYPE_F32 ? 4 : 2; }

static void run_chunks(void *arg, int index) {
    (void)index;
    struct job *j = arg;
    size_t gsz = dtype_size(j->gdt);
    for (;;) {
        size_t k = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (k >= j->nchunks) return;
        const struct chunk *ch = &j->chunks[k];
        const struct inf_adam_tensor *t = ch->t;
        int64_t b = ch->begin;
        void *half = t->half_out ? (void *)((uint16_t *)t->half_out + b) : NULL;
        const void *grad = (const unsigned char *)t->grad + (size_t)b * gsz;
        if (j->naddends) fold_addends(j, ch);
        /* summed first: the chunk's gradient (256 KiB) is then in cache for the update */
        if (j->chunk_sq) j->chunk_sq[k] = inf_adam_grad_sq_sum(grad, (size_t)(ch->end - b), j->gdt);
        if (j->fn)
            j->fn(j->c, t->param + b, grad, t->exp_avg + b, t->exp_avg_sq + b, half,
                  (size_t)(ch->end - b), j->gdt, j->hdt);
        /* while the chunk's gradient is still in cache: a store to lines just read, instead of
         * a pass of its own over the whole gradient later (read for ownership, then written) */
        if (j->zero_grad) memset((void *)grad, 0, (size_t)(ch->end - b) * gsz);
    }
}

/* First element index >= want at which param's address is 64-byte aligned (or want itself when
 * param is not even float-aligned). */
static int64_t aligned_boundary(const float *param, int64_t want) {
    uintptr_t a = (uintptr_t)(param + want);
    if ((uintptr_t)param % sizeof(float)) return want;
    return want + (int64_t)(((64 - a % 64) % 64) / sizeof(float));
}

static size_t count_chunks(const struct inf_adam_tensor *ts, int nt) {
    size_t n = 0;
    for (int i = 0; i < nt; i++)
        if (ts[i].numel > 0) n += (size_t)(ts[i].numel / CHUNK_ELEMS) + 1;
    return n;
}

static size_t fill_chunks(const struct inf_adam_tensor *ts, int nt, struct chunk *out) {
    size_t n = 0;
    for (int i = 0; i < nt; i++) {
        int64_t b = 0, numel = ts[i].numel;
        while (b < numel) {
            int64_t e = numel - b <= CHUNK_ELEMS + CHUNK_ELEMS / 4
                            ? numel
                            : aligned_boundary(ts[i].param, b + CHUNK_ELEMS);
            if (e > numel) e = numel;
            out[n++] = (struct chunk){&ts[i], b, e};
            b = e;
        }
    }
    return n;
}

/* Runs fn over every range of ts on up to nthreads threads; with sq_sum, also stores the sum of
 * the gradients' squares there (chunk sums added in chunk order: independent of the threads). */
static int run_ranges(const struct adam_consts *c, adam_range_fn fn,
                      const struct inf_adam_tensor *ts, int nt, int gdt, int hdt, int nthreads,
                      const struct pass_extras *x) {
    double *sq_sum = x->sq_sum;
    int64_t total = 0;
    for (int i = 0; i < nt; i++) total += ts[i].numel;
    if (sq_sum) *sq_sum = 0.0;
    if (total == 0) return 0;
    size_t cap = count_chunks(ts, nt);
    struct chunk *chunks = malloc(cap * sizeof *chunks);
    if (!chunks) return -ENOMEM;
    double *chunk_sq = NULL;
    if (sq_sum && !(chunk_sq = calloc(cap, sizeof *chunk_sq))) {
        free(chunks);
        return -ENOMEM;
    }
    struct job j = {.c = c, .fn = fn, .chunks = chunks, .gdt = gdt, .hdt = hdt,
                    .chunk_sq = chunk_sq, .zero_grad = x->zero_grad, .ranges = ts,
                    .addends = x->addends, .naddends = x->naddends};
    j.nchunks = fill_chunks(ts, nt, chunks);
    atomic_init(&j.next, 0);
    if (nthreads <= 0) nthreads = inf_adam_cpus_allowed();
    int64_t useful = total / MIN_ELEMS_PER_THREAD;
    if (useful < 1) useful = 1;
    if (nthreads > useful) nthreads = (int)useful;
    if ((size_t)nthreads > j.nchunks) nthreads = (int)j.nchunks;
    inf_adam_pool_run(nthreads, run_chunks, &j);
    if (sq_sum) {
        double sum = 0.0;
        for (size_t k = 0; k < j.nchunks; k++) sum += chunk_sq[k];
        *sq_sum = sum;
    }
    free(chunk_sq);
    free(chunks);
    return 0;
}

/* ---- kernels ---- */

const char *inf_adam_kernel_name(int kernel) {
    switch (kernel) {
    case INF_ADAM_KERNEL_AUTO: return "auto";
    case INF_ADAM_KERNEL_SCALAR: return "scalar";
    case INF_ADAM_KERNEL_AVX2: return "avx2";
    case INF_ADAM_KERNEL_AVX512: return "avx512";
    case INF_ADAM_KERNEL_NEON: return "neon";
    default: return NULL;
    }
}

int inf_adam_kernel_supported(int kernel) {
    unsigned f = inf_cpu_features();
    switch (kernel) {
    case INF_ADAM_KERNEL_AUTO:
    case INF_ADAM_KERNEL_SCALAR: return 1;
#if defined(__x86_64__)
    case INF_ADAM_KERNEL_AVX2: {
        unsigned need = INF_CPU_AVX2 | INF_CPU_FMA | INF_CPU_F16C;
        return (f & need) == need;
    }
    case INF_ADAM_KERNEL_AVX512: return (f & INF_CPU_AVX512F) != 0;
#endif
#if defined(__aarch64__)
    case INF_ADAM_KERNEL_NEON: return (f & INF_CPU_NEON) != 0;
#endif
    default: return 0;
    }
}

int inf_adam_kernel_best(void) {
    if (inf_adam_kernel_supported(INF_ADAM_KERNEL_AVX512)) return INF_ADAM_KERNEL_AVX512;
    if (inf_adam_kernel_supported(INF_ADAM_KERNEL_AVX2)) return INF_ADAM_KERNEL_AVX2;
    if (inf_adam_kernel_supported(INF_ADAM_KERNEL_NEON)) return INF_ADAM_KERNEL_NEON;
    return INF_ADAM_KERNEL_SCALAR;
}

static adam_range_fn kernel_fn(int kernel) {
    switch (kernel) {
    case INF_ADAM_KERNEL_SCALAR: return inf_adam_range_scalar;
#if defined(__x86_64__)
    case INF_ADAM_KERNEL_AVX2: return inf_adam_range_avx2;
    case INF_ADAM_KERNEL_AVX512: return inf_adam_range_avx512;
#endif
#if defined(__aarch64__)
    case INF_ADAM_KERNEL_NEON: return inf_adam_range_neon;
#endif
    default: return NULL;
    }
}

/* ---- the step ---- */

static int check_hparams(const struct inf_adam_hparams *hp) {
    if (!hp) return -EINVAL;
    if (!isfinite(hp->lr) || hp->lr < 0) return -EINVAL;
    if (!(hp->beta1 >= 0 && hp->beta1 < 1) || !(hp->beta2 >= 0 && hp->beta2 < 1)) return -EINVAL;
    if (!isfinite(hp->eps) || hp->eps < 0) return -EINVAL;
    if (!isfinite(hp->weight_decay) || hp->weight_decay < 0) return -EINVAL;
    if (!isfinite(hp->grad_scale) || !(hp->grad_scale > 0)) return -EINVAL;
    if (hp->bias_correction && hp->step < 1) return -EINVAL;
    return 0;
}

static int check_tensors(const struct inf_adam_tensor *ts, int nt, int gdt, int hdt) {
    if (nt < 0 || (nt > 0 && !ts)) return -EINVAL;
    if (gdt != INF_ADAM_DTYPE_F32 && gdt != INF_ADAM_DTYPE_BF16 && gdt != INF_ADAM_DTYPE_F16)
        return -EINVAL;
    if (hdt != INF_ADAM_DTYPE_NONE && hdt != INF_ADAM_DTYPE_BF16 && hdt != INF_ADAM_DTYPE_F16)
        return -EINVAL;
    for (int i = 0; i < nt; i++) {
        const struct inf_adam_tensor *t = &ts[i];
        if (t->numel < 0) return -EINVAL;
        if (t->numel == 0) continue;
        if (!t->param || !t->grad || !t->exp_avg || !t->exp_avg_sq) return -EINVAL;
        if (hdt != INF_ADAM_DTYPE_NONE && !t->half_out) return -EINVAL;
    }
    return 0;
}

/* x^n by binary exponentiation in double: deterministic, no libm (the torch path mirrors it). */
static double power(double x, int64_t n) {
    double r = 1.0;
    while (n > 0) {
        if (n & 1) r *= x;
        x *= x;
        n >>= 1;
    }
    return r;
}

static struct adam_consts make_consts(const struct inf_adam_hparams *hp) {
    /* in double, then rounded once: infinity/optim/cpu_adam.py's torch path does the same */
    double bc1 = hp->bias_correction ? 1.0 - power(hp->beta1, hp->step) : 1.0;
    double bc2 = hp->bias_correction ? 1.0 - power(hp->beta2, hp->step) : 1.0;
    int l2 = !hp->adamw_mode && hp->weight_decay != 0.0;
    struct adam_consts c = {
        .inv_scale = (float)(1.0 / hp->grad_scale),
        .l2 = l2 ? (float)hp->weight_decay : 0.0f,
        .beta1 = (float)hp->beta1,
        .one_minus_beta1 = (float)(1.0 - hp->beta1),
        .beta2 = (float)hp->beta2,
        .one_minus_beta2 = (float)(1.0 - hp->beta2),
        .inv_bc2_sqrt = (float)(1.0 / adam_sqrt(bc2)),
        .eps = (float)hp->eps,
        .decay = hp->adamw_mode ? (float)(1.0 - hp->lr * hp->weight_decay) : 1.0f,
        .step_size = (float)(hp->lr / bc1),
        .mode = l2 ? ADAM_MODE_L2 : ADAM_MODE_DECOUPLED,
    };
    return c;
}

static int adam_step(const struct inf_adam_hparams *hp, const struct inf_adam_tensor *tensors,
                     int ntensors, int grad_dtype, int half_dtype, int kernel, int nthreads,
                     const struct pass_extras *x) {
    int rc = check_hparams(hp);
    if (rc == 0) rc = check_tensors(tensors, ntensors, grad_dtype, half_dtype);
    if (rc) return rc;
    if (kernel == INF_ADAM_KERNEL_AUTO) kernel = inf_adam_kernel_best();
    if (!inf_adam_kernel_supported(kernel)) return -ENOTSUP;
    adam_range_fn fn = kernel_fn(kernel);
    if (!fn) return -ENOTSUP;
    struct adam_consts c = make_consts(hp);
    return run_ranges(&c, fn, tensors, ntensors, grad_dtype, half_dtype, nthreads, x);
}

int inf_adam_step(const struct inf_adam_hparams *hp, const struct inf_adam_tensor *tensors,
                  int ntensors, int grad_dtype, int half_dtype, int kernel, int nthreads) {
    return adam_step(hp, tensors, ntensors, grad_dtype, half_dtype, kernel, nthreads, &PLAIN_PASS);
}

int inf_adam_step_zero(const struct inf_adam_hparams *hp, const struct inf_adam_tensor *tensors,
                       int ntensors, int grad_dtype, int half_dtype, int kernel, int nthreads,
                       double *grad_sq_sum) {
    struct pass_extras x = {.sq_sum = grad_sq_sum, .zero_grad = 1};
    return adam_step(hp, tensors, ntensors, grad_dtype, half_dtype, kernel, nthreads, &x);
}

int inf_adam_step_fold(const struct inf_adam_hparams *hp, const struct inf_adam_tensor *tensors,
                       int ntensors, const struct inf_adam_addend *addends, int naddends,
                       int half_dtype, int kernel, int nthreads, double *grad_sq_sum) {
    if (naddends < 0 || (naddends > 0 && !addends) || ntensors < 0 || (ntensors > 0 && !tensors))
        return -EINVAL;
    for (int k = 0; k < naddends; k++) {
        const struct inf_adam_addend *a = &addends[k];
        if (a->range < 0 || a->range >= ntensors) return -EINVAL;
        if (a->dtype != INF_ADAM_DTYPE_F32 && a->dtype != INF_ADAM_DTYPE_BF16 &&
            a->dtype != INF_ADAM_DTYPE_F16)
            return -EINVAL;
        if (a->begin < 0 || a->numel < 0 || a->begin + a->numel > tensors[a->range].numel)
            return -EINVAL;
        if (a->numel > 0 && !a->values) return -EINVAL;
    }
    struct pass_extras x = {.sq_sum = grad_sq_sum, .zero_grad = 1, .addends = addends,
                            .naddends = naddends};
    return adam_step(hp, tensors, ntensors, INF_ADAM_DTYPE_F32, half_dtype, kernel, nthreads, &x);
}

int inf_adam_step_norm(const struct inf_adam_hparams *hp, const struct inf_adam_tensor *tensors,
                       int ntensors, int grad_dtype, int half_dtype, int kernel, int nthreads,
                       double *grad_sq_sum) {
    if (!grad_sq_sum) return -EINVAL;
    double sum = 0.0;
    int rc = adam_step(hp, tensors, ntensors, grad_dtype, half_dtype, kernel, nthreads,
                       &(struct pass_extras){.sq_sum = &sum});
    if (rc == 0) *grad_sq_sum = sum;
    return rc;
}

/* ---- the norm alone ---- */

/* Steps nothing: the job's chunks only have their gradient summed (run_chunks with fn NULL). */
int inf_grad_sq_sum(const void *grad, int64_t numel, int grad_dtype, int nthreads, double *out) {
    if (!out || numel < 0 || (numel > 0 && !grad)) return -EINVAL;
    if (grad_dtype != INF_ADAM_DTYPE_F32 && grad_dtype != INF_ADAM_DTYPE_BF16 &&
        grad_dtype != INF_ADAM_DTYPE_F16)
        return -EINVAL;
    /* param only places the chunk boundaries (at its 64-byte lines): the gradient's own */
    struct inf_adam_tensor t = {(float *)grad, grad, NULL, NULL, NULL, numel};
    struct adam_consts unused = {0};
    return run_ranges(&unused, NULL, &t, 1, grad_dtype, INF_ADAM_DTYPE_NONE, nthreads,
                      &(struct pass_extras){.sq_sum = out});
}

/* ---- a gradient accumulated into its fp32 home ---- */

/* dst += widen(src). The fp32 and bf16 loops are plain enough for the compiler to vectorize at
 * -O3 (the bf16 widening is a shift); they are their own scalar reference, and the add is
 * memory-bound (10 bytes an element for bf16). fp16's software widening has branches the
 * compiler cannot vectorize (0.86 G elements/s on 2 cores against torch's 3.5), so where the
 * CPU has F16C its hardware conversion does the bulk, exactly (every fp16 value is a float),
 * and the scalar loop only the tail or a CPU without it. */
#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx,f16c"))) static size_t accumulate_f16c(float *restrict dst,
                                                                    const uint16_t *restrict s,
                                                                    size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i)));
        _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i), g));
    }
    return i;
}
#endif

static void accumulate_range(const struct adam_consts *c, float *restrict dst, const void *src,
                             float *m, float *v, void *half, size_t n, int gdt, int hdt) {
    (void)c, (void)m, (void)v, (void)half, (void)hdt;
    if (gdt == INF_ADAM_DTYPE_F32) {
        const float *restrict s = src;
        for (size_t i = 0; i < n; i++) dst[i] += s[i];
    } else if (gdt == INF_ADAM_DTYPE_BF16) {
        const uint16_t *restrict s = src;
        for (size_t i = 0; i < n; i++) dst[i] += adam_bf16_to_f32(s[i]);
    } else {
        const uint16_t *restrict s = src;
        size_t i = 0;
#if defined(__x86_64__)
        if (inf_cpu_features() & INF_CPU_F16C) i = accumulate_f16c(dst, s, n);
#endif
        for (; i < n; i++) dst[i] += adam_f16_to_f32(s[i]);
    }
}

int inf_grad_accumulate(float *dst, const void *src, int64_t numel, int src_dtype,
                        int nthreads) {
    if (numel < 0 || (numel > 0 && (!dst || !src))) return -EINVAL;
    if (src_dtype != INF_ADAM_DTYPE_F32 && src_dtype != INF_ADAM_DTYPE_BF16 &&
        src_dtype != INF_ADAM_DTYPE_F16)
        return -EINVAL;
    struct inf_adam_tensor t = {dst, src, NULL, NULL, NULL, numel};
    struct adam_consts unused = {0};
    return run_ranges(&unused, accumulate_range, &t, 1, src_dtype, INF_ADAM_DTYPE_NONE,
                      nthreads, &PLAIN_PASS);
}

/* ---- bandwidth reference ---- */

/* a, c, d += b: Adam's memory traffic (4 fp32 reads, 3 in-place writes per element) with as few
 * instructions as possible, so that it measures the memory system and not the core. */
static void rmw_range_scalar(const struct adam_consts *c, float *restrict a, const void *bv,
                             float *restrict cc, float *restrict d, void *half, size_t n, int gdt,
                             int hdt) {
    (void)c, (void)half, (void)gdt, (void)hdt;
    const float *b = bv;
    for (size_t i = 0; i < n; i++) {
        float x = b[i];
        a[i] += x;
        cc[i] += x;
        d[i] += x;
    }
}

#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx2"))) static void rmw_range_avx2(const struct adam_consts *c,
                                                          float *restrict a, const void *bv,
                                                          float *restrict cc, float *restrict d,
                                                          void *half, size_t n, int gdt, int hdt) {
    const float *b = bv;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(b + i);
        _mm256_storeu_ps(a + i, _mm256_add_ps(_mm256_loadu_ps(a + i), x));
        _mm256_storeu_ps(cc + i, _mm256_add_ps(_mm256_loadu_ps(cc + i), x));
        _mm256_storeu_ps(d + i, _mm256_add_ps(_mm256_loadu_ps(d + i), x));
    }
    rmw_range_scalar(c, a + i, b + i, cc + i, d + i, half, n - i, gdt, hdt);
}
#endif

int inf_adam_rmw_bandwidth(float *a, const float *b, float *c, float *d, int64_t n,
                           int nthreads) {
    if (n < 0 || (n > 0 && (!a || !b || !c || !d))) return -EINVAL;
    struct inf_adam_tensor t = {a, b, c, d, NULL, n};
    struct adam_consts unused = {0};
    adam_range_fn fn = rmw_range_scalar;
#if defined(__x86_64__)
    if (inf_adam_kernel_supported(INF_ADAM_KERNEL_AVX2)) fn = rmw_range_avx2;
#endif
    return run_ranges(&unused, fn, &t, 1, INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_NONE, nthreads,
                      &PLAIN_PASS);
}

/* ---- shared with the state formats (adam_formats.c): the same checks and constants ---- */

int inf_adam_hparams_check(const struct inf_adam_hparams *hp) { return check_hparams(hp); }

struct adam_consts inf_adam_consts(const struct inf_adam_hparams *hp) { return make_consts(hp); }
