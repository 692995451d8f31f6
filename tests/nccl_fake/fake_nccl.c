/* fake_nccl.c - a stand-in for libnccl.so.2 in tests/test_nccl_shim.py: a few of
 * NCCL's functions, each writing what it received to a log the test reads
 * (fake_log), so that the test can see that the shim forwards every argument.
 * With FAKE_NCCL_DIR set, communicators really span processes (the end of this
 * file), so that the shim's KCCL side can be made through it and tested.
 * ncclCommSplit is left out on purpose: the shim must report it missing. */
#include <stdio.h>
#include <string.h>
#include <sys/random.h>

#include "nccl_api.h"

static int multi(void);
static ncclResult_t multi_init(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank);
struct fake_comm;
ncclResult_t ncclCommAbort(ncclComm_t comm);
static ncclResult_t multi_allreduce(const void *send, void *recv, size_t count, ncclDataType_t dt, ncclRedOp_t op,
                                    struct fake_comm *c);

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
  if (multi() && getrandom(id->internal, 16, 0) != 16) return ncclSystemError;
  logf_("GetUniqueId;");
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  unsigned sum = 0;
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) sum += (unsigned char)id.internal[i];
  logf_("CommInitRank nranks=%d rank=%d idsum=%u;", nranks, rank, sum);
  if (multi()) return multi_init(comm, nranks, id, rank);
  *comm = (ncclComm_t)(size_t)0x1234;
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t dt, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  logf_("AllReduce send=%p recv=%p count=%zu dtype=%d op=%d comm=%p stream=%p;", send, recv, count, (int)dt, (int)op,
        (void *)comm, (void *)stream);
  if (multi()) return multi_allreduce(send, recv, count, dt, op, (struct fake_comm *)comm);
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
  return multi() ? ncclCommAbort(comm) : ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) { return r == ncclInvalidArgument ? "fake: invalid argument" : "fake: other"; }

const char *ncclGetLastError(ncclComm_t comm) {
  (void)comm;
  return "fake: last error";
}

/* ---- Ranks in several processes (FAKE_NCCL_DIR names a folder) ----
 * A communicator is a file there named after the unique id, mapped by every rank:
 * a barrier and one slot per rank.  A collective writes the rank's bytes to its
 * slot, waits for all, computes its result from every slot, and waits again.
 * Its "device" buffers are host memory, and it reports no CUDA device. */
#include <fcntl.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

enum { SLOT = 16384, MAX_RANKS = 16 };
struct shared {
  unsigned arrived, gen;
  char slot[MAX_RANKS][SLOT];
};
struct fake_comm {
  int nranks, rank;
  struct shared *sh;
};

static int multi(void) { return getenv("FAKE_NCCL_DIR") != NULL; }

static int barrier(struct shared *sh, int n) {
  unsigned g = __atomic_load_n(&sh->gen, __ATOMIC_ACQUIRE);
  if (__atomic_add_fetch(&sh->arrived, 1, __ATOMIC_ACQ_REL) == (unsigned)n) {
    __atomic_store_n(&sh->arrived, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&sh->gen, g + 1, __ATOMIC_RELEASE);
    return 0;
  }
  time_t give_up = time(NULL) + 20; /* a test that goes wrong fails instead of hanging */
  while (__atomic_load_n(&sh->gen, __ATOMIC_ACQUIRE) == g) {
    if (time(NULL) > give_up) return -1;
    sched_yield();
  }
  return 0;
}

static ncclResult_t multi_init(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  if (nranks < 1 || nranks > MAX_RANKS || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  char path[512];
  int n = snprintf(path, sizeof path, "%s/", getenv("FAKE_NCCL_DIR"));
  for (int i = 0; i < 16; i++) n += snprintf(path + n, sizeof path - (size_t)n, "%02x", (unsigned char)id.internal[i]);
  int fd = open(path, O_RDWR | O_CREAT, 0600);
  if (fd < 0 || ftruncate(fd, sizeof(struct shared)) != 0) return ncclSystemError;
  struct shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (sh == MAP_FAILED) return ncclSystemError;
  struct fake_comm *c = malloc(sizeof *c);
  c->nranks = nranks;
  c->rank = rank;
  c->sh = sh;
  if (barrier(sh, nranks)) return ncclSystemError;
  *comm = (ncclComm_t)c;
  return ncclSuccess;
}

static size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}

#define REDUCE(T)                                                                     \
  for (size_t i = 0; i < count; i++) {                                               \
    T acc = ((const T *)c->sh->slot[0])[i];                                          \
    for (int r = 1; r < c->nranks; r++) {                                            \
      T x = ((const T *)c->sh->slot[r])[i];                                          \
      acc = op == ncclMin ? (x < acc ? x : acc) : op == ncclMax ? (x > acc ? x : acc) : acc + x; \
    }                                                                                \
    ((T *)recv)[i] = acc;                                                            \
  }

static ncclResult_t multi_allreduce(const void *send, void *recv, size_t count, ncclDataType_t dt, ncclRedOp_t op,
                                    struct fake_comm *c) {
  if (count * type_size(dt) > SLOT || (op != ncclSum && op != ncclMin && op != ncclMax)) return ncclInvalidArgument;
  if (dt != ncclInt64 && dt != ncclFloat32) return ncclInvalidArgument;
  memcpy(c->sh->slot[c->rank], send, count * type_size(dt));
  if (barrier(c->sh, c->nranks)) return ncclSystemError;
  if (dt == ncclInt64) { REDUCE(int64_t) } else { REDUCE(float) }
  return barrier(c->sh, c->nranks) ? ncclSystemError : ncclSuccess;
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t dt, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  (void)stream;
  logf_("Broadcast count=%zu root=%d;", count, root);
  struct fake_comm *c = (struct fake_comm *)comm;
  if (!multi() || count * type_size(dt) > SLOT || root < 0 || root >= c->nranks) return ncclInvalidArgument;
  if (c->rank == root) memcpy(c->sh->slot[root], send, count * type_size(dt));
  if (barrier(c->sh, c->nranks)) return ncclSystemError;
  memcpy(recv, c->sh->slot[root], count * type_size(dt));
  return barrier(c->sh, c->nranks) ? ncclSystemError : ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
  *count = multi() ? ((struct fake_comm *)comm)->nranks : 4;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
  *rank = multi() ? ((struct fake_comm *)comm)->rank : 3;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
  (void)comm;
  *device = -1;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  logf_("CommAbort comm=%p;", (void *)comm);
  if (multi()) {
    munmap(((struct fake_comm *)comm)->sh, sizeof(struct shared));
    free(comm);
  }
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *state) {
  (void)comm;
  *state = ncclSuccess;
  return ncclSuccess;
}
