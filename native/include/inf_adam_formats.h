/* CPU Adam / AdamW with the optimizer states stored in fewer bytes (issue 38, opt-in).
 *
 * The same step as inf_adam.h (same hyperparameters, gradient dtypes, 1 / grad_scale, Adam and
 * AdamW modes, bias correction, optional 16-bit copy), in one pass over each flat range, but the
 * moments are READ in a stored format, dequantized to fp32, stepped in fp32 registers with the
 * very operations of inf_adam.h (same order, no FMA contraction), requantized and WRITTEN back:
 *
 *   moments BF16  m and v are bf16, rounded stochastically as the BF16_SR master below (NaN ->
 *                 0xFFFF; see [Note: stochastic rounding of bf16 moments] for why not to
 *                 nearest); 2 + 2 bytes per parameter.
 *   moments INT8  blockwise 8-bit (Dettmers et al. 2021, arXiv 2110.02861): blocks of
 *                 INF_ADAM_QBLOCK elements, one fp32 absmax per block per moment; m is coded with
 *                 the signed dynamic map, v with the unsigned one (inf_adam_qmap); 1 + 1 bytes per
 *                 parameter plus 2 * 4 / 2048 for the scales. Codes are indices into the map.
 *
 * and the fp32 master is either float32 (updated as inf_adam_step updates it) or
 *
 *   master BF16_SR  bf16, stochastically rounded: the fp32 update plus a 16-bit random number
 *                   from a counter-based hash of (seed, step, element index) added to its bits,
 *                   then truncated, so the result depends on neither threads nor SIMD width.
 *
 * INT8, per block (two passes, the block's fp32 values on the stack):
 *   m  = map_s[code_m] * absmax_m,  v = map_u[code_v] * absmax_v       (one rounding each)
 *   (the element update of inf_adam.h)
 *   absmax' = max |m'| over the block (NaN ignored: max is exact, so the lane order is free)
 *   code'   = #{ j : bound[j] <= m' / absmax' }   (absmax' == 0: m' / 1; bound[j] is the float
 *             nearest the midpoint of map[j] and map[j+1], so this is "nearest map entry, ties
 *             up"; a NaN m' compares false everywhere -> code 0)
 *   v only:   a positive v' never gets code 0 (it gets 1, 3.25e-7 * absmax'): a v stored as 0
 *             under an m that is not makes the next update m / sqrt((1 - beta2) g^2), up to
 *             m / eps, and one such element in a block spread over 3 decades of gradient
 *             scale took the mean update cosine with fp32 Adam from 0.98 to 0.15.
 *   A block whose updated m (or v) holds an inf or NaN stores absmax NaN (the whole block's
 *   moment reads back as NaN next step; fp32 moments would keep only that element NaN): a
 *   non-finite value is never turned silently into a finite one.
 *
 * Every kernel (scalar reference, AVX2, AVX-512) gives the same bits: compare-only quantization,
 * exact max, IEEE division and square root, the same fp32 operations in the same order.
 */
#ifndef INF_ADAM_FORMATS_H
#define INF_ADAM_FORMATS_H

#include <stdint.h>

#include "inf_adam.h"
#include "inf_common.h"

/* Stored formats of the moments. */
#define INF_ADAM_MOMENTS_BF16 1
#define INF_ADAM_MOMENTS_INT8 2

/* Stored formats of the master parameter. */
#define INF_ADAM_MASTER_F32 0
#define INF_ADAM_MASTER_BF16_SR 1

/* Elements per INT8 block (one absmax per block per moment). */
#define INF_ADAM_QBLOCK 2048

/* Maps of inf_adam_qmap. */
#define INF_ADAM_QMAP_SIGNED 0   /* m: 127 negative, 0, 128 positive values; max +1.0 */
#define INF_ADAM_QMAP_UNSIGNED 1 /* v: 0, 255 positive values; max 1.0 */

/* One flat range (the layout is mirrored by ctypes in infinity/optim/adam_formats.py).
 * param: float32 (MASTER_F32) or bf16 bits (MASTER_BF16_SR); grad: the call's grad_dtype;
 * exp_avg, exp_avg_sq: uint16_t bf16 bits (BF16) or uint8_t codes (INT8), numel each;
 * exp_avg_absmax, exp_avg_sq_absmax: INT8 only, ceil(numel / INF_ADAM_QBLOCK) floats, [k] the
 * scale of elements [k * QBLOCK, (k + 1) * QBLOCK) of this range (NULL with BF16);
 * half_out: as in inf_adam.h (MASTER_F32 only).
 * offset: the index of this range's element 0 in its flat tensor (>= 0): with INT8 moments it
 * must be a multiple of INF_ADAM_QBLOCK (a block never straddles two calls; the last block of a
 * range may be short), and it is the element counter of stochastic rounding.
 * No alignment needed; buffers must not overlap. */
struct inf_adam_fmt_tensor {
    void *param;
    const void *grad;
    void *exp_avg;
    void *exp_avg_sq;
    float *exp_avg_absmax;
    float *exp_avg_sq_absmax;
    void *half_out;
    int64_t offset;
    int64_t numel;
};

/* Step ntensors ranges in one call, shared by nthreads threads (<= 0: the CPUs this process may
 * run on) in whole blocks. seed: of stochastic rounding (bf16 moments and a BF16_SR master;
 * ignored otherwise).
 * kernel: INF_ADAM_KERNEL_{AUTO,SCALAR,AVX2,AVX512} (NEON has no format kernel yet: -ENOTSUP;
 * AUTO picks AVX-512, AVX2 or scalar).
 * Returns 0, -EINVAL (bad hyperparameters, formats, dtypes, NULL pointers, negative sizes or a
 * misaligned INT8 offset: nothing is written), -ENOTSUP or -ENOMEM. */
INF_API int inf_adam_step_fmt(const struct inf_adam_hparams *hp,
                              const struct inf_adam_fmt_tensor *tensors, int ntensors,
                              int grad_dtype, int half_dtype, int moments_format,
                              int master_format, uint64_t seed, int kernel, int nthreads);

/* The 256 values of a map (ascending; code c stands for values[c] * absmax) and, when bounds is
 * not NULL, its 255 decision bounds (bounds[j]: the float nearest (values[j] + values[j+1]) / 2).
 * Returns 0 or -EINVAL. */
INF_API int inf_adam_qmap(int map, float *values, float *bounds);

/* 1 when the SIMD kernels find int8 codes by the lookup table (one gather), 0 when they fall
 * back to the binary search over the bounds (eight): only a map whose bounds are closer than a
 * table slot would; the tests require 1 for the shipped maps, so a broken table cannot hide. */
INF_API int inf_adam_qlut_ready(void);

/* 1 when kernel can run inf_adam_step_fmt on this CPU and build, else 0. */
INF_API int inf_adam_fmt_kernel_supported(int kernel);

#endif
