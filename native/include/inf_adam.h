/* CPU Adam / AdamW over fp32 master weights and moments, with an optional fused 16-bit copy.
 *
 * One pass over each flat range reads the fp32 param, the gradient (fp32, bf16 or fp16), m and v,
 * applies Adam (L2 weight decay added to the gradient) or AdamW (decoupled weight decay) with bias
 * correction, writes param, m and v, and optionally writes the updated param as bf16 or fp16 into
 * a second buffer (the copy a GPU needs next step). The step is memory-bandwidth bound (28 bytes
 * per parameter, +2 for the 16-bit copy), so the work of one call is split across a small
 * persistent thread pool (the calling thread takes part) in cache-line aligned chunks.
 *
 * Kernels: a scalar reference and SIMD paths (AVX-512, AVX2+FMA+F16C, NEON) chosen at run time.
 * Every SIMD path gives the same bits as the scalar reference: the same operations in the same
 * order, no FMA contraction anywhere, IEEE sqrt and division.
 *
 * Element update, in this order (all float32; constants precomputed in double, then rounded):
 *   g  = grad * (1 / grad_scale)
 *   g  = g + weight_decay * p                      (Adam mode with weight_decay != 0 only)
 *   m  = beta1 * m + (1 - beta1) * g
 *   v  = beta2 * v + ((1 - beta2) * g) * g
 *   d  = sqrt(v) * (1 / sqrt(1 - beta2^step)) + eps
 *   p  = p * (1 - lr * weight_decay)               (AdamW mode only)
 *   p  = p - (lr / (1 - beta1^step)) * (m / d)
 *   half_out = round_to_nearest_even(p)            (when asked)
 * The 16-bit copy equals torch's .to(dtype) of a contiguous fp32 tensor bit for bit, NaN too: bf16
 * NaN -> 0xFFFF (torch's vectorized CPU cast; its scalar path, used for strided tensors, gives
 * 0x7FC0), fp16 NaN keeps its sign and top payload bits, quiet (as F16C and NEON convert).
 * Without bias correction both (1 - beta^step) factors are 1.
 */
#ifndef INF_ADAM_H
#define INF_ADAM_H

#include <stdint.h>

#include "inf_common.h"

/* Element types of the gradient and of the 16-bit copy. */
#define INF_ADAM_DTYPE_NONE (-1) /* no 16-bit copy (half_dtype only) */
#define INF_ADAM_DTYPE_F32 0
#define INF_ADAM_DTYPE_BF16 1
#define INF_ADAM_DTYPE_F16 2

/* Kernels. AUTO picks the fastest one this CPU and build support. */
#define INF_ADAM_KERNEL_AUTO 0
#define INF_ADAM_KERNEL_SCALAR 1
#define INF_ADAM_KERNEL_AVX2 2
#define INF_ADAM_KERNEL_AVX512 3
#define INF_ADAM_KERNEL_NEON 4

/* Hyperparameters of one step; the layout is mirrored by ctypes in infinity/optim/_adam_native.py. */
struct inf_adam_hparams {
    double lr;           /* >= 0 */
    double beta1;        /* in [0, 1) */
    double beta2;        /* in [0, 1) */
    double eps;          /* >= 0 */
    double weight_decay; /* >= 0 */
    double grad_scale;   /* > 0: gradients are divided by it (loss-scale unscaling, clipping) */
    int64_t step;        /* the step being taken, counted from 1 (>= 1 with bias correction) */
    int32_t adamw_mode;  /* 1: decoupled weight decay (AdamW); 0: L2 added to the gradient (Adam) */
    int32_t bias_correction; /* 1: divide the moments by (1 - beta^step); 0: do not */
};

/* One flat range. param, exp_avg, exp_avg_sq are float32; grad is of the call's grad_dtype;
 * half_out (may be NULL when the call's half_dtype is NONE) is bf16 or fp16. All hold numel
 * elements, need no alignment, and must not overlap each other. */
struct inf_adam_tensor {
    float *param;
    const void *grad;
    float *exp_avg;
    float *exp_avg_sq;
    void *half_out;
    int64_t numel;
};

/* Step ntensors flat ranges in one call (the work of all of them is shared by nthreads threads).
 * nthreads <= 0 means the CPUs this process may run on (sched_getaffinity).
 * Returns 0, -EINVAL (bad hyperparameters, dtypes, NULL pointers or negative sizes: nothing is
 * written), or -ENOTSUP (kernel not supported by this CPU or build). */
INF_API int inf_adam_step(const struct inf_adam_hparams *hp, const struct inf_adam_tensor *tensors,
                          int ntensors, int grad_dtype, int half_dtype, int kernel, int nthreads);

/* inf_adam_step that also stores in *grad_sq_sum the sum over every element of every range of
 * grad^2, the gradient as given (before 1 / grad_scale), in double: the global gradient norm
 * of a step whose gradients are never all in memory at once is the root of the sum of these.
 * Each chunk's gradient is summed right after its update, while it is still in cache; the
 * products are exact in double and the sums run in a fixed order (eight lanes per chunk, the
 * chunks in range order), so the result is the same for every kernel and thread count.
 * grad_sq_sum must not be NULL; it is written only when 0 is returned. */
INF_API int inf_adam_step_norm(const struct inf_adam_hparams *hp,
                               const struct inf_adam_tensor *tensors, int ntensors, int grad_dtype,
                               int half_dtype, int kernel, int nthreads, double *grad_sq_sum);

/* inf_adam_step that also zeroes every gradient element it steps, each chunk right after its
 * update while the chunk is still in cache (the grad pointers are written, though declared
 * const for the other calls): the step of a gradient accumulated in place, which the next
 * backward accumulates into again from zero, without a pass of its own over it. With grad_sq_sum
 * not NULL, stores there what inf_adam_step_norm stores (summed before the zeroing). */
INF_API int inf_adam_step_zero(const struct inf_adam_hparams *hp,
                               const struct inf_adam_tensor *tensors, int ntensors, int grad_dtype,
                               int half_dtype, int kernel, int nthreads, double *grad_sq_sum);

/* A gradient part still apart from the fp32 gradient it belongs to (the last micro-batch's,
 * copied off the device into staging): values[i] (of dtype: F32, BF16 or F16) adds to element
 * begin + i of range `range` of the call, for i < numel. */
struct inf_adam_addend {
    int32_t range;
    int32_t dtype;
    int64_t begin;
    int64_t numel;
    const void *values;
};

/* inf_adam_step_zero of fp32 gradients, each chunk's gradient first completed by adding the
 * addends that overlap it, in the order given (each add inf_grad_accumulate's bits, so the step
 * is that of the adds made first, then the step), while the chunk is in cache: the last
 * micro-batch's gradient folded into the step instead of added by a pass of its own. The norm
 * (grad_sq_sum not NULL) is of the completed gradient. Returns 0, -EINVAL (also: an addend
 * outside its range, a bad range index or dtype), -ENOMEM or -ENOTSUP. */
INF_API int inf_adam_step_fold(const struct inf_adam_hparams *hp,
                               const struct inf_adam_tensor *tensors, int ntensors,
                               const struct inf_adam_addend *addends, int naddends,
                               int half_dtype, int kernel, int nthreads, double *grad_sq_sum);

/* The sum of grad^2 over numel elements of grad (of grad_dtype) alone, summed as
 * inf_adam_step_norm sums it (the same bits for a buffer at the same address, whatever the
 * kernel and thread count): the norm of a gradient that is not stepped yet (clipping needs the
 * global norm before any step). One read pass, shared by nthreads threads (<= 0: the CPUs this
 * process may run on). Returns 0, -EINVAL or -ENOMEM. */
INF_API int inf_grad_sq_sum(const void *grad, int64_t numel, int grad_dtype, int nthreads,
                            double *out);

/* dst[i] += (float)src[i] for numel elements: a gradient of src_dtype (F32, BF16 or F16)
 * accumulated into its fp32 host home in one pass, widened in registers (exactly) and added
 * in fp32, so each element has the bits of torch's dst.add_(src.float()). Shared by nthreads
 * threads (<= 0: the CPUs this process may run on); dst and src must not overlap. Returns 0 or
 * -EINVAL. */
INF_API int inf_grad_accumulate(float *dst, const void *src, int64_t numel, int src_dtype,
                                int nthreads);

/* 1 when kernel (an INF_ADAM_KERNEL_*) can run on this CPU with this build, else 0. */
INF_API int inf_adam_kernel_supported(int kernel);

/* The kernel AUTO resolves to on this CPU. */
INF_API int inf_adam_kernel_best(void);

/* "auto", "scalar", "avx2", "avx512", "neon", or NULL for an unknown id. */
INF_API const char *inf_adam_kernel_name(int kernel);

/* Reference for benchmarks: the memory traffic of an fp32 Adam step with trivial arithmetic.
 * Reads a, b, c, d and writes a, c, d in place (a += b; c += b; d += b: 28 bytes per element),
 * split across nthreads threads exactly like inf_adam_step. Returns 0 or -EINVAL. */
INF_API int inf_adam_rmw_bandwidth(float *a, const float *b, float *c, float *d, int64_t n,
                                   int nthreads);

#endif
