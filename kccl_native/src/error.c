/* error.c - result strings, the per-thread last-error text, debug logging. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

static __thread char last_error[512];
int kccl_debug_level = 0; /* set from KCCL_DEBUG at init */

const char *kcclGetErrorString(kcclResult_t r) {
  switch (r) {
    case kcclSuccess: return "no error";
    case kcclUnhandledCudaError: return "unhandled cuda error";
    case kcclSystemError: return "unhandled system error (see the last error text)";
    case kcclInternalError: return "internal error - please report this issue to the KCCL developers";
    case kcclInvalidArgument: return "invalid argument";
    case kcclInvalidUsage: return "invalid usage";
    case kcclRemoteError: return "remote process exited, aborted, or called a different collective";
    case kcclInProgress: return "KCCL operation in progress";
    case kcclTimeout: return "timed out waiting for a peer (KCCL_TIMEOUT_MS)";
    default: return "unknown result code";
  }
}

const char *kcclGetLastError(kcclComm_t comm) {
  (void)comm;
  return last_error;
}

static void vset(kcclResult_t code, const char *fmt, va_list ap) {
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  if (code != kcclSuccess && kccl_debug_level >= 1)
    fprintf(stderr, "[kccl pid %d] WARN %s: %s\n", (int)getpid(), kcclGetErrorString(code), last_error);
}

kcclResult_t kccl_err(kcclResult_t code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vset(code, fmt, ap);
  va_end(ap);
  return code;
}

kcclResult_t kccl_verr(kcclResult_t code, const char *fmt, va_list ap) {
  vset(code, fmt, ap);
  return code;
}

void kccl_log(int level, const char *fmt, ...) {
  if (level > kccl_debug_level) return;
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  fprintf(stderr, "[kccl pid %d] %s\n", (int)getpid(), buf);
}
