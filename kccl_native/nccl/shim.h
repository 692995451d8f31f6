/* shim.h - what shim.c (loading and forwarding to the real NCCL) and route.c
 * (communicators with a KCCL side, and the calls KCCL takes) share. */
#ifndef KCCL_NCCL_SHIM_H_
#define KCCL_NCCL_SHIM_H_
#include "nccl_api.h"

#define SHIM_HIDDEN __attribute__((visibility("hidden")))
#define SHIM_EXPORT __attribute__((visibility("default")))

/* Every forwarded function, and the real library's function behind every
 * NCCL_ROUTED entry. */
#define NCCL_FN(name, params, args) SHIM_EXPORT ncclResult_t name params;
#define NCCL_ROUTED(name, params, args) SHIM_HIDDEN ncclResult_t real_##name params;
#include "nccl_functions.def"
#undef NCCL_FN
#undef NCCL_ROUTED

/* The calling thread's shim error (what ncclGetLastError returns first). */
SHIM_HIDDEN void shim_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
SHIM_HIDDEN void shim_clear_error(void);

#endif
