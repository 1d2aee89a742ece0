/* Shared conventions of the infinity native library.
 * Every public function is prefixed inf_, returns 0 or a positive count on success and -errno
 * on failure, and never aborts the process. */
#ifndef INF_COMMON_H
#define INF_COMMON_H

#ifdef __cplusplus
#define INF_EXTERN_C extern "C"
#else
#define INF_EXTERN_C
#endif

#define INF_API INF_EXTERN_C __attribute__((visibility("default")))

#endif
