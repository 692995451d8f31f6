/* The smallest KCCL program: NRANKS processes (forked here; any launcher that
 * hands them the unique id works) sum a vector with kcclAllReduce.
 *
 *   cc allreduce.c $(pkg-config --cflags --libs kccl) -o allreduce && ./allreduce 4
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kccl.h"

static int rank_main(kcclUniqueId id, int nranks, int rank) {
  kcclComm_t comm;
  kcclResult_t r = kcclCommInitRank(&comm, nranks, id, rank);
  if (r != kcclSuccess) {
    fprintf(stderr, "rank %d: init: %s (%s)\n", rank, kcclGetErrorString(r), kcclGetLastError(NULL));
    return 1;
  }
  float x[4] = {1.0f, 2.0f, 3.0f, (float)rank};
  r = kcclAllReduce(x, x, 4, kcclFloat32, kcclSum, comm, NULL); /* in place */
  if (r != kcclSuccess) {
    fprintf(stderr, "rank %d: all-reduce: %s (%s)\n", rank, kcclGetErrorString(r), kcclGetLastError(comm));
    kcclCommAbort(comm);
    return 1;
  }
  if (rank == 0) printf("sum over %d ranks: %g %g %g %g\n", nranks, x[0], x[1], x[2], x[3]);
  fflush(stdout); /* the child leaves through _exit, which flushes nothing */
  kcclCommDestroy(comm);
  return x[0] == (float)nranks && x[3] == (float)(nranks * (nranks - 1) / 2) ? 0 : 2;
}

int main(int argc, char **argv) {
  const int nranks = argc > 1 ? atoi(argv[1]) : 2;
  kcclUniqueId id;
  if (nranks < 1 || kcclGetUniqueId(&id) != kcclSuccess) return 1;
  fflush(NULL);
  for (int r = 0; r < nranks; r++)
    if (fork() == 0) _exit(rank_main(id, nranks, r));
  int failed = 0;
  for (int r = 0; r < nranks; r++) {
    int status = 0;
    wait(&status);
    failed |= !WIFEXITED(status) || WEXITSTATUS(status) != 0;
  }
  return failed;
}
