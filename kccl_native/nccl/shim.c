/* shim.c - libkccl_nccl.so: NCCL's C interface, every call handed to the real
 * NCCL, loaded on first use.  Under LD_PRELOAD it stands in front of the NCCL
 * a program (PyTorch) links; vLLM and SGLang load it by path
 * (VLLM_NCCL_SO_PATH, SGLANG_NCCL_SO_PATH) and find every function they look up.
 *
 * The real library: $KCCL_NCCL_LIB, else the libnccl.so.2 the process already
 * has loaded, else the one the dynamic loader finds.  When it cannot be loaded,
 * or lacks a function, the call returns ncclSystemError / ncclInvalidUsage and
 * ncclGetLastError says why.
 *
 * Most functions are forwarded here unchanged; route.c writes those that keep a
 * KCCL communicator beside the real one and the calls KCCL takes. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <stdarg.h>

#include "shim.h"

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static void *g_real;          /* dlopen handle of the real NCCL */
static char g_load_error[768];
static __thread char t_error[1024]; /* the shim's own last error, per thread */

void shim_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t_error, sizeof t_error, fmt, ap);
  va_end(ap);
}

void shim_clear_error(void) { t_error[0] = 0; }

/* The shim's address range, so that a "real" library that is the shim itself
 * (KCCL_NCCL_LIB pointing here) is refused instead of calling itself forever. */
static int is_ours(const void *p) {
  Dl_info mine, theirs;
  if (!dladdr((const void *)&is_ours, &mine) || !dladdr(p, &theirs)) return 0;
  return mine.dli_fbase == theirs.dli_fbase;
}

static void load_real(void) {
  const char *path = getenv("KCCL_NCCL_LIB");
  if (path && *path) {
    g_real = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!g_real)
      snprintf(g_load_error, sizeof g_load_error, "kccl_nccl: cannot load the real NCCL from KCCL_NCCL_LIB=%s: %s",
               path, dlerror());
  } else {
    /* The program's own NCCL first (PyTorch's wheel loads it through its rpath,
     * where a plain dlopen would not look), then the loader's search path. */
    g_real = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (!g_real) g_real = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!g_real)
      snprintf(g_load_error, sizeof g_load_error,
               "kccl_nccl: no real NCCL: libnccl.so.2 is neither loaded nor found (%s); set KCCL_NCCL_LIB to its path",
               dlerror());
  }
  if (g_real) {
    void *probe = dlsym(g_real, "ncclGetVersion");
    if (probe && is_ours(probe)) {
      snprintf(g_load_error, sizeof g_load_error,
               "kccl_nccl: KCCL_NCCL_LIB names this shim, not the real NCCL it should forward to");
      dlclose(g_real);
      g_real = NULL;
    }
  }
}

/* The real function `name`, or NULL (*rc: the code to return; with `record`,
 * the reason goes to t_error for ncclGetLastError). */
static void *real_fn(const char *name, ncclResult_t *rc, int record) {
  pthread_once(&g_once, load_real);
  if (!g_real) {
    if (record) snprintf(t_error, sizeof t_error, "%s (called %s)", g_load_error, name);
    *rc = ncclSystemError;
    return NULL;
  }
  void *p = dlsym(g_real, name);
  if (!p || is_ours(p)) {
    if (record) snprintf(t_error, sizeof t_error, "kccl_nccl: the real NCCL has no %s (an older version?)", name);
    *rc = ncclInvalidUsage;
    return NULL;
  }
  return p;
}

/* Each function resolves its real counterpart once (a pointer-sized store:
 * threads that race store the same value).  A call that reaches the real
 * library clears the shim's own error, so ncclGetLastError then asks the real
 * library. */
#define FORWARD(exported, name, params, args)                                        \
  typedef ncclResult_t(*name##_fn) params;                                           \
  exported ncclResult_t FORWARD_NAME_##exported(name) params {                       \
    static name##_fn real;                                                           \
    name##_fn f = __atomic_load_n(&real, __ATOMIC_ACQUIRE);                          \
    if (!f) {                                                                        \
      ncclResult_t rc = ncclSuccess;                                                 \
      f = (name##_fn)real_fn(#name, &rc, 1);                                         \
      if (!f) return rc;                                                             \
      __atomic_store_n(&real, f, __ATOMIC_RELEASE);                                  \
    }                                                                                \
    t_error[0] = 0;                                                                  \
    return f args;                                                                   \
  }
#define FORWARD_NAME_SHIM_EXPORT(name) name
#define FORWARD_NAME_SHIM_HIDDEN(name) real_##name
#define NCCL_FN(name, params, args) FORWARD(SHIM_EXPORT, name, params, args)
#define NCCL_ROUTED(name, params, args) FORWARD(SHIM_HIDDEN, name, params, args)
#include "nccl_functions.def"
#undef NCCL_FN
#undef NCCL_ROUTED

SHIM_EXPORT const char *ncclGetErrorString(ncclResult_t result) {
  typedef const char *(*fn)(ncclResult_t);
  ncclResult_t rc;
  fn f = (fn)real_fn("ncclGetErrorString", &rc, 0);
  if (f) return f(result);
  switch (result) { /* without the real library: the codes' meanings, and why */
    case ncclSuccess: return "no error";
    case ncclSystemError: return "system error (kccl_nccl: the real NCCL could not be loaded; see ncclGetLastError)";
    case ncclInvalidUsage: return "invalid usage (kccl_nccl: see ncclGetLastError)";
    default: return "unknown result code (kccl_nccl: the real NCCL could not be loaded)";
  }
}

SHIM_EXPORT const char *ncclGetLastError(ncclComm_t comm) {
  if (t_error[0]) return t_error; /* the shim's own failure comes first: the real library never saw the call */
  typedef const char *(*fn)(ncclComm_t);
  ncclResult_t rc;
  fn f = (fn)real_fn("ncclGetLastError", &rc, 1);
  return f ? f(comm) : t_error;
}
