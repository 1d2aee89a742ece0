/* Adam state formats, entry points: argument checks, the quantization maps, the per-call
 * constants (adam.c's own), kernel choice, and the split of a call's ranges into chunks of whole
 * blocks shared by the CPU Adam thread pool (adam_pool.c). */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "adam_formats_internal.h"
#include "inf_info.h"

/* Elements per chunk: 32 blocks (64 KiB of each fp32 stream), as adam.c's chunks. */
#define CHUNK_ELEMS (32 * INF_ADAM_QBLOCK)
#define MIN_ELEMS_PER_THREAD (64 * 1024)

/* ---- the maps ----
 *
 * bitsandbytes' dynamic maps (create_dynamic_map(signed, max_exponent_bits=7, total_bits=8),
 * the ones its 8-bit Adam uses for m and v), by their formula, in double, rounded once to float
 * (bitsandbytes builds them with float32 torch.linspace, so a value may differ by an ulp):
 *   signed:   for i = 0..6, n = 2^i:     +-10^(i-6) * (0.1 + 0.9 * (k + 0.5) / n), k < n
 *   unsigned: for i = 0..6, n = 2^(i+1):   10^(i-6) * (0.1 + 0.9 * (k + 0.5) / n), k < n
 * plus 0 and 1.0 (signed: 127 negative values, 0, 127 positive, 1.0; unsigned: 0, 254 positive,
 * 1.0), ascending. Exponent i's values lie in (10^(i-6) / 10, 10^(i-6)): the map is a dynamic
 * tree (a decimal exponent, then 2^i or 2^(i+1) linear fractions), covering 7 decades with 2-7
 * significant bits each, the finest near the block's absmax. */
static float map_values[2][256], map_bounds[2][255];
static uint32_t map_lut[2][ADAMF_LUT];   /* see [Note: the code lookup table] */
static int lut_ok;
static pthread_once_t maps_once = PTHREAD_ONCE_INIT;

static const double pow10_table[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};

static double map_value(int i, int k, int n) { return pow10_table[i] * (0.1 + 0.9 * (k + 0.5) / n); }

/* The smallest and largest float of a table slot (in value order). */
static void slot_range(int sign, uint32_t slot, float *lo, float *hi) {
    uint32_t a = ADAMF_LUT_LO_BITS + (slot << ADAMF_LUT_SHIFT);
    uint32_t b = a | ((1u << ADAMF_LUT_SHIFT) - 1);
    if (slot == 0) a = 0;                  /* magnitudes below 2^-24, zero included */
    *lo = sign ? -adam_bits_f32(b) : adam_bits_f32(a);
    *hi = sign ? -adam_bits_f32(a) : adam_bits_f32(b);
}

/* Each slot's entry (see [Note: the code lookup table]); 0 (the SIMD kernels then search) if
 * a slot holds two bounds, or the slot of the smallest magnitudes one, or a slot's range is not
 * where adamf_lut_slot (the kernels' slot, lane by lane) puts it. */
static int build_luts(void) {
    for (int m = 0; m < 2; m++)
        for (int sign = 0; sign < 2; sign++)
            for (uint32_t slot = 0; slot < ADAMF_LUT_PER_SIGN; slot++) {
                float lo, hi;
                slot_range(sign, slot, &lo, &hi);
                /* the slot the kernels compute for the range's ends is this one */
                uint32_t index = sign * ADAMF_LUT_PER_SIGN + slot;
                if (adamf_lut_slot(lo) != index || adamf_lut_slot(hi) != index) return 0;
                uint32_t c = adamf_qsearch(map_bounds[m], lo), d = adamf_qsearch(map_bounds[m], hi);
                if (d > c + 1 || (d > c && slot == 0)) return 0;
                uint32_t cmp = ADAMF_LUT_NO_BOUND;
                if (d > c) { /* bnd[c] lies in the slot: its bits share the slot's top bits */
                    cmp = adam_f32_bits(map_bounds[m][c]) & ADAMF_LUT_LOW_MASK;
                    if (sign) cmp ^= ADAMF_LUT_LOW_MASK; /* |y| <= |bound|, complemented */
                }
                map_lut[m][index] = c | cmp << 8;
            }
    return 1;
}

static void build_maps(void) {
    float *s = map_values[INF_ADAM_QMAP_SIGNED], *u = map_values[INF_ADAM_QMAP_UNSIGNED];
    int c = 0;
    for (int i = 6; i >= 0; i--)
        for (int k = (1 << i) - 1; k >= 0; k--) s[c++] = (float)-map_value(i, k, 1 << i);
    s[c++] = 0.0f;
    for (int i = 0; i <= 6; i++)
        for (int k = 0; k < (1 << i); k++) s[c++] = (float)map_value(i, k, 1 << i);
    s[c++] = 1.0f;
    c = 0;
    u[c++] = 0.0f;
    for (int i = 0; i <= 6; i++)
        for (int k = 0; k < (2 << i); k++) u[c++] = (float)map_value(i, k, 2 << i);
    u[c++] = 1.0f;
    for (int m = 0; m < 2; m++)
        for (int j = 0; j < 255; j++)
            map_bounds[m][j] = (float)(((double)map_values[m][j] + (double)map_values[m][j + 1]) / 2);
    lut_ok = build_luts();
}

int inf_adam_qmap(int map, float *values, float *bounds) {
    if ((map != INF_ADAM_QMAP_SIGNED && map != INF_ADAM_QMAP_UNSIGNED) || !values) return -EINVAL;
    pthread_once(&maps_once, build_maps);
    memcpy(values, map_values[map], sizeof map_values[map]);
    if (bounds) memcpy(bounds, map_bounds[map], sizeof map_bounds[map]);
    return 0;
}

int inf_adam_qlut_ready(void) {
    pthread_once(&maps_once, build_maps);
    return lut_ok;
}

/* ---- kernels ---- */

int inf_adam_fmt_kernel_supported(int kernel) {
    switch (kernel) {
    case INF_ADAM_KERNEL_AUTO:
    case INF_ADAM_KERNEL_SCALAR: return 1;
#if defined(__x86_64__)
    case INF_ADAM_KERNEL_AVX2:
    case INF_ADAM_KERNEL_AVX512: return inf_adam_kernel_supported(kernel);
#endif
    default: return 0; /* NEON: no format kernel yet */
    }
}

static adamf_range_fn kernel_fn(int kernel) {
    switch (kernel) {
    case INF_ADAM_KERNEL_SCALAR: return inf_adamf_range_scalar;
#if defined(__x86_64__)
    case INF_ADAM_KERNEL_AVX2: return inf_adamf_range_avx2;
    case INF_ADAM_KERNEL_AVX512: return inf_adamf_range_avx512;
#endif
    default: return NULL;
    }
}

static int best_kernel(void) {
    if (inf_adam_fmt_kernel_supported(INF_ADAM_KERNEL_AVX512)) return INF_ADAM_KERNEL_AVX512;
    if (inf_adam_fmt_kernel_supported(INF_ADAM_KERNEL_AVX2)) return INF_ADAM_KERNEL_AVX2;
    return INF_ADAM_KERNEL_SCALAR;
}

/* ---- checks ---- */

static int check_tensors(const struct inf_adam_fmt_tensor *ts, int nt, int gdt, int hdt,
                         int moments, int master) {
    if (nt < 0 || (nt > 0 && !ts)) return -EINVAL;
    if (gdt != INF_ADAM_DTYPE_F32 && gdt != INF_ADAM_DTYPE_BF16 && gdt != INF_ADAM_DTYPE_F16)
        return -EINVAL;
    if (hdt != INF_ADAM_DTYPE_NONE && hdt != INF_ADAM_DTYPE_BF16 && hdt != INF_ADAM_DTYPE_F16)
        return -EINVAL;
    if (moments != INF_ADAM_MOMENTS_BF16 && moments != INF_ADAM_MOMENTS_INT8) return -EINVAL;
    if (master != INF_ADAM_MASTER_F32 && master != INF_ADAM_MASTER_BF16_SR) return -EINVAL;
    /* a bf16 master is itself the 16-bit copy */
    if (master == INF_ADAM_MASTER_BF16_SR && hdt != INF_ADAM_DTYPE_NONE) return -EINVAL;
    for (int i = 0; i < nt; i++) {
        const struct inf_adam_fmt_tensor *t = &ts[i];
        if (t->numel < 0 || t->offset < 0) return -EINVAL;
        if (moments == INF_ADAM_MOMENTS_INT8 && t->offset % INF_ADAM_QBLOCK) return -EINVAL;
        if (t->numel == 0) continue;
        if (!t->param || !t->grad || !t->exp_avg || !t->exp_avg_sq) return -EINVAL;
        if (moments == INF_ADAM_MOMENTS_INT8 && (!t->exp_avg_absmax || !t->exp_avg_sq_absmax))
            return -EINVAL;
        if (hdt != INF_ADAM_DTYPE_NONE && !t->half_out) return -EINVAL;
    }
    return 0;
}

/* splitmix64's output function. */
static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* ---- chunks and threads ---- */

struct job {
    const struct adamf_ctx *x;
    adamf_range_fn fn;
    const struct adamf_chunk *chunks;
    size_t nchunks;
    atomic_size_t next;
};

static void run_chunks(void *arg, int index) {
    (void)index;
    struct job *j = arg;
    for (;;) {
        size_t k = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (k >= j->nchunks) return;
        j->fn(j->x, &j->chunks[k]);
    }
}

int inf_adam_step_fmt(const struct inf_adam_hparams *hp, const struct inf_adam_fmt_tensor *ts,
                      int nt, int gdt, int hdt, int moments, int master, uint64_t seed,
                      int kernel, int nthreads) {
    int rc = inf_adam_hparams_check(hp);
    if (rc == 0) rc = check_tensors(ts, nt, gdt, hdt, moments, master);
    if (rc) return rc;
    if (kernel == INF_ADAM_KERNEL_AUTO) kernel = best_kernel();
    if (!inf_adam_fmt_kernel_supported(kernel)) return -ENOTSUP;
    adamf_range_fn fn = kernel_fn(kernel);
    if (!fn) return -ENOTSUP;
    pthread_once(&maps_once, build_maps);

    uint64_t key = mix64(seed ^ mix64((uint64_t)hp->step + 0x9e3779b97f4a7c15ull));
    struct adamf_ctx x = {
        .c = inf_adam_consts(hp), .gdt = gdt, .hdt = hdt, .moments = moments, .master = master,
        .k0 = (uint32_t)key, .k1 = (uint32_t)(key >> 32),
        .map_s = map_values[INF_ADAM_QMAP_SIGNED], .map_u = map_values[INF_ADAM_QMAP_UNSIGNED],
        .bnd_s = map_bounds[INF_ADAM_QMAP_SIGNED], .bnd_u = map_bounds[INF_ADAM_QMAP_UNSIGNED],
        .lut_s = lut_ok ? map_lut[INF_ADAM_QMAP_SIGNED] : NULL,
        .lut_u = lut_ok ? map_lut[INF_ADAM_QMAP_UNSIGNED] : NULL};

    int64_t total = 0;
    size_t cap = 0;
    for (int i = 0; i < nt; i++) {
        total += ts[i].numel;
        cap += (size_t)((ts[i].numel + CHUNK_ELEMS - 1) / CHUNK_ELEMS);
    }
    if (total == 0) return 0;
    struct adamf_chunk *chunks = malloc(cap * sizeof *chunks);
    if (!chunks) return -ENOMEM;
    size_t psz = master == INF_ADAM_MASTER_BF16_SR ? 2 : 4;
    size_t gsz = gdt == INF_ADAM_DTYPE_F32 ? 4 : 2;
    size_t msz = moments == INF_ADAM_MOMENTS_BF16 ? 2 : 1;
    size_t n = 0;
    for (int i = 0; i < nt; i++) {
        const struct inf_adam_fmt_tensor *t = &ts[i];
        for (int64_t b = 0; b < t->numel; b += CHUNK_ELEMS) {
            size_t len = (size_t)(t->numel - b < CHUNK_ELEMS ? t->numel - b : CHUNK_ELEMS);
            int64_t blk = b / INF_ADAM_QBLOCK;
            chunks[n++] = (struct adamf_chunk){
                .p = (unsigned char *)t->param + (size_t)b * psz,
                .g = (const unsigned char *)t->grad + (size_t)b * gsz,
                .m = (unsigned char *)t->exp_avg + (size_t)b * msz,
                .v = (unsigned char *)t->exp_avg_sq + (size_t)b * msz,
                .ms = t->exp_avg_absmax ? t->exp_avg_absmax + blk : NULL,
                .vs = t->exp_avg_sq_absmax ? t->exp_avg_sq_absmax + blk : NULL,
                .half = t->half_out ? (uint16_t *)t->half_out + b : NULL,
                .offset = t->offset + b,
                .n = len};
        }
    }
    struct job j = {.x = &x, .fn = fn, .chunks = chunks, .nchunks = n};
    atomic_init(&j.next, 0);
    if (nthreads <= 0) nthreads = inf_adam_cpus_allowed();
    int64_t useful = total / MIN_ELEMS_PER_THREAD;
    if (useful < 1) useful = 1;
    if (nthreads > useful) nthreads = (int)useful;
    if ((size_t)nthreads > n) nthreads = (int)n;
    inf_adam_pool_run(nthreads, run_chunks, &j);
    free(chunks);
    return 0;
}
