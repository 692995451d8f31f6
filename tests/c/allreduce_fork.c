/* A C program using only kccl.h: forks NRANKS processes that all-reduce,
 * all-gather, broadcast and pass messages around a ring, and check the results.  Exit code 0 = all good.
 * Built and run by tests/test_c_api.py. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kccl.h"

#define CHECK(call)                                                                         \
  do {                                                                                      \
    kcclResult_t r_ = (call);                                                               \
    if (r_ != kcclSuccess) {                                                                \
      fprintf(stderr, "%s failed: %s (%s)\n", #call, kcclGetErrorString(r_), kcclGetLastError(NULL)); \
      return 1;                                                                             \
    }                                                                                       \
  } while (0)

static int run_rank(kcclUniqueId id, int nranks, int rank) {
  kcclComm_t comm;
  CHECK(kcclCommInitRank(&comm, nranks, id, rank));
  int n = -1, me = -1;
  CHECK(kcclCommCount(comm, &n));
  CHECK(kcclCommUserRank(comm, &me));
  if (n != nranks || me != rank) return 2;

  enum { COUNT = 3000 };  /* odd, and > one line */
  static float send[COUNT], recv[COUNT];
  for (int i = 0; i < COUNT; i++) send[i] = (float)(rank + 1) * (float)(i % 7);
  CHECK(kcclAllReduce(send, recv, COUNT, kcclFloat32, kcclSum, comm, NULL));
  float tri = (float)(nranks * (nranks + 1) / 2);
  for (int i = 0; i < COUNT; i++)
    if (recv[i] != tri * (float)(i % 7)) { fprintf(stderr, "rank %d: all-reduce[%d] = %g\n", rank, i, recv[i]); return 3; }
  CHECK(kcclAllReduce(send, send, COUNT, kcclFloat32, kcclMax, comm, NULL)); /* in place */
  for (int i = 0; i < COUNT; i++)
    if (send[i] != (float)nranks * (float)(i % 7)) return 4;

  int64_t mine = 1000 + rank, all[64];
  CHECK(kcclAllGather(&mine, all, 1, kcclInt64, comm, NULL));
  for (int r = 0; r < nranks; r++)
    if (all[r] != 1000 + r) return 5;

  double b[5] = {0};
  const int root = nranks - 1;
  if (rank == root) for (int i = 0; i < 5; i++) b[i] = 0.5 * i;
  CHECK(kcclBroadcast(b, b, 5, kcclFloat64, root, comm, NULL));
  for (int i = 0; i < 5; i++)
    if (b[i] != 0.5 * i) return 6;

  /* point-to-point, NCCL's shape: each rank sends to the next and receives from the one
   * before; even ranks send first, so a ring of blocking calls cannot deadlock, and the
   * message spans several pieces of the ring of slots */
  if (nranks > 1) {
    enum { N = 200000 };
    static int32_t out[N], in[N];
    for (int i = 0; i < N; i++) out[i] = rank * N + i;
    const int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
    if (rank % 2 == 0) {
      CHECK(kcclSend(out, N, kcclInt32, next, comm, NULL));
      CHECK(kcclRecv(in, N, kcclInt32, prev, comm, NULL));
    } else {
      CHECK(kcclRecv(in, N, kcclInt32, prev, comm, NULL));
      CHECK(kcclSend(out, N, kcclInt32, next, comm, NULL));
    }
    for (int i = 0; i < N; i++)
      if (in[i] != prev * N + i) { fprintf(stderr, "rank %d: recv[%d] = %d\n", rank, i, (int)in[i]); return 9; }
    if (kcclSend(out, 1, kcclInt32, rank, comm, NULL) != kcclInvalidArgument) return 13;
  }

  /* a bad argument is a result code, not a crash */
  if (kcclAllReduce(send, recv, COUNT, (kcclDataType_t)42, kcclSum, comm, NULL) != kcclInvalidArgument) return 7;
  if (kcclBroadcast(b, b, 5, kcclFloat64, nranks, comm, NULL) != kcclInvalidArgument) return 8;
  CHECK(kcclBarrier(comm, NULL));
  CHECK(kcclCommDestroy(comm));
  return 0;
}

int main(int argc, char **argv) {
  int nranks = argc > 1 ? atoi(argv[1]) : 3;
  int version = 0;
  CHECK(kcclGetVersion(&version));
  if (version != KCCL_VERSION_CODE) return 10;
  kcclUniqueId id;
  CHECK(kcclGetUniqueId(&id));
  kcclUniqueId bad;
  memset(&bad, 0x5a, sizeof bad);
  kcclComm_t dummy;
  if (kcclCommInitRank(&dummy, 2, bad, 0) != kcclInvalidArgument) return 11;
  fflush(NULL);
  for (int r = 0; r < nranks; r++) {
    pid_t pid = fork();
    if (pid < 0) return 12;
    if (pid == 0) _exit(run_rank(id, nranks, r));
  }
  int failed = 0;
  for (int r = 0; r < nranks; r++) {
    int st = 0;
    wait(&st);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      fprintf(stderr, "a rank ended with status %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
      failed = 1;
    }
  }
  if (!failed) printf("ok %d ranks\n", nranks);
  return failed;
}
