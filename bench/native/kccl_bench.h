/* kccl_bench.h - KCCL's benchmarks and device self-test, outside the library.
 *
 * Everything here calls the library through kccl.h only: the extension links the
 * libkccl.so that Python's kccl package loaded, so the communicators it is handed
 * (kccl.capi.handle) are that library's.  The GPU half (kccl_bench_gpu.cu;
 * kccl_bench_nogpu.c without nvcc) uses the device API of kccl_device.cuh on the
 * kcclDevComm that kcclCommGetDevComm gives. */
#ifndef KCCL_BENCH_H_
#define KCCL_BENCH_H_
#include <stddef.h>
#include <stdint.h>
#include "kccl.h"

#ifdef __cplusplus
extern "C" {
#endif

/* This extension's error text: kb_fail sets it; kb_lib copies the library's. */
kcclResult_t kb_fail(kcclResult_t code, const char *fmt, ...);
kcclResult_t kb_lib(kcclResult_t code);
#define KB_LIB(call)                              \
  do {                                            \
    kcclResult_t r_ = (call);                     \
    if (r_ != kcclSuccess) return kb_lib(r_);     \
  } while (0)

/* The entry points (Python's, through cffi: bench/native/build.py's CDEF).  Each
 * returns a kcclResult_t; kb_last_error() says why when it is not kcclSuccess. */
const char *kb_last_error(void);
kcclResult_t kb_bench_all_reduce(const void *send, void *recv, size_t count, int dtype, int op, kcclComm_t comm,
                                 int iters, double *us_per_call);
kcclResult_t kb_dev_selftest(const void *inputs, void *outputs, size_t count, int dtype, int op, int iters,
                             int blocks, kcclComm_t comm, void *stream);
kcclResult_t kb_bench_dev_all_reduce(void *buf, size_t count, int dtype, int iters, int blocks, kcclComm_t comm,
                                     double *us_per_call);
kcclResult_t kb_bench_dev_all_reduce_phases(void *buf, size_t count, int dtype, int iters, int blocks,
                                            kcclComm_t comm, double phases[4]);
kcclResult_t kb_bench_residency(kcclComm_t comm, int blocks, int timeout_ms, int foreign, int carveout, int out[4],
                                int *sm_out);
kcclResult_t kb_bench_flag_hop(kcclComm_t comm, int iters, int mode, double *us_per_hop);
kcclResult_t kb_dev_group_selftest(int dtype, int op, int count, int calls, int blocks, int reducers, int barrier,
                                   int global_data, int cancel, int cancel_after_us, kcclComm_t comm, int *out,
                                   double *ms);

/* kcclDevAllReduceGroup's self-test (kb_dev_group_selftest): what one rank's
 * kernel saw, out[KB_GROUP_OUT], in this order. */
enum {
  KB_GROUP_WRONG,      /* elements whose result is not the exact expected value */
  KB_GROUP_GUARD,      /* bytes past a call's data that the call changed */
  KB_GROUP_CALL_ERRS,  /* calls that returned an error (a block stops calling after one) */
  KB_GROUP_FIRST_CODE, /* the kcclResult_t of the first of them */
  KB_GROUP_BYSTANDER,  /* bystander warps that gave up waiting for their group, or left no marker */
  KB_GROUP_CALLS_OK,   /* calls that returned kcclSuccess, over every block */
  KB_GROUP_BAD_SLOT,   /* the first wrong element: its slot, call, index, and the result's and */
  KB_GROUP_BAD_CALL,   /* expected value's bits in the data type (-1: none wrong) */
  KB_GROUP_BAD_INDEX,
  KB_GROUP_BAD_GOT,
  KB_GROUP_BAD_WANT,
  KB_GROUP_CLAIM, /* device-side only: the first wrong element's claim */
  KB_GROUP_OUT
};
/* The test's limits, the device API's (kccl_bench_gpu.cu checks they agree):
 * bytes per call and slots. */
#define KB_GROUP_MAX_BYTES 8192
#define KB_GROUP_MAX_SLOTS 32
#define KB_GROUP_MAX_RANKS 8 /* the copy it runs, kcclDevAllReduceGroup<8>, as the monokernel's */
#define KB_GROUP_MAX_BLOCKS 256

/* A GPU communicator as the device API sees it. */
struct kb_gpu {
  kcclComm_t comm;
  int device, rank, nranks;
  char dc[KCCL_DEV_COMM_BYTES]; /* the kcclDevComm */
};

/* GPU half.  Each launches on the legacy default stream unless a stream is given,
 * and returns once its kernel finished (kernel failures: see kb_after). */
kcclResult_t kbg_load(int device);
kcclResult_t kbg_sync(int device);
kcclResult_t kbg_check_ptr(int device, const void *p, size_t bytes, const char *what);
kcclResult_t kbg_selftest(const struct kb_gpu *g, const void *in, void *out, size_t count, int dtype, int op,
                          int iters, int blocks, void *stream);
kcclResult_t kbg_chain(const struct kb_gpu *g, void *buf, size_t count, int dtype, int iters, int blocks,
                       double *us_per_call);
kcclResult_t kbg_phases(const struct kb_gpu *g, void *buf, size_t count, int dtype, int iters, int blocks,
                        double phases[4]);
kcclResult_t kbg_flag_hop(const struct kb_gpu *g, int iters, int mode, double *us_per_hop);
kcclResult_t kbg_residency(const struct kb_gpu *g, int blocks, int timeout_ms, int foreign, int carveout,
                           int out[4], int *sm_out);
kcclResult_t kbg_group_selftest(const struct kb_gpu *g, int dtype, int op, int count, int calls, int blocks,
                                int reducers, int barrier, int global_data, int cancel, int cancel_after_us,
                                int *out, double *ms);

#ifdef __cplusplus
}
#endif
#endif
