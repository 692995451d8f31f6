/* fake_nccl.c - a stand-in for libnccl.so.2 in tests/test_nccl_shim.py: a few of
 * NCCL's functions, each writing what it received to a log the test reads
 * (fake_log), so that the test can see that the shim forwards every argument.
 * ncclCommSplit is left out on purpose: the shim must report it missing. */
#include <stdio.h>
#include <string.h>

#include "nccl_api.h"

static char g_log[4096];
static size_t g_len;

static void logf_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void logf_(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(g_log + g_len, sizeof g_log - g_len, fmt, ap);
  va_end(ap);
  if (n > 0 && g_len + (size_t)n < sizeof g_log) g_len += (size_t)n;
}

const char *fake_log(void) { return g_log; }
void fake_clear(void) { g_len = 0; g_log[0] = 0; }

ncclResult_t ncclGetVersion(int *version) {
  *version = 22805;
  logf_("GetVersion;");
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) id->internal[i] = (char)(i * 7 + 3);
  logf_("GetUniqueId;");
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  unsigned sum = 0;
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) sum += (unsigned char)id.internal[i];
  *comm = (ncclComm_t)(size_t)0x1234;
  logf_("CommInitRank nranks=%d rank=%d idsum=%u;", nranks, rank, sum);
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t dt, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  logf_("AllReduce send=%p recv=%p count=%zu dtype=%d op=%d comm=%p stream=%p;", send, recv, count, (int)dt, (int)op,
        (void *)comm, (void *)stream);
  return count == 0 ? ncclInvalidArgument : ncclSuccess;
}

ncclResult_t ncclGroupStart(void) {
  logf_("GroupStart;");
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  logf_("GroupEnd;");
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  logf_("CommDestroy comm=%p;", (void *)comm);
  return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) { return r == ncclInvalidArgument ? "fake: invalid argument" : "fake: other"; }

const char *ncclGetLastError(ncclComm_t comm) {
  (void)comm;
  return "fake: last error";
}
