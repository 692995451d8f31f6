/* kccl_bench.c - the benchmarks' entry points: argument checks, the host
 * all-reduce loop, and the GPU half's callers. */
#include "kccl_bench.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static __thread char kb_msg[512];

kcclResult_t kb_fail(kcclResult_t code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(kb_msg, sizeof kb_msg, fmt, ap);
  va_end(ap);
  return code;
}

kcclResult_t kb_lib(kcclResult_t code) {
  const char *text = kcclGetLastError(NULL);
  snprintf(kb_msg, sizeof kb_msg, "%s", text && *text ? text : "kccl call failed");
  return code;
}

const char *kb_last_error(void) { return kb_msg; }

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* A failure a kernel recorded in the communicator's status counts now, as the
 * library's next call on it would report. */
static kcclResult_t after(kcclComm_t comm, kcclResult_t r) {
  if (r != kcclSuccess) return r;
  kcclResult_t async = kcclSuccess;
  KB_LIB(kcclCommGetAsyncError(comm, &async));
  return async == kcclSuccess ? kcclSuccess : kb_lib(async);
}

kcclResult_t kb_bench_all_reduce(const void *send, void *recv, size_t count, int dtype, int op, kcclComm_t comm,
                                 int iters, double *us_per_call) {
  kb_msg[0] = 0;
  if (iters < 1 || !us_per_call) return kb_fail(kcclInvalidArgument, "iters must be >= 1 and usPerCall non-NULL");
  const int64_t t0 = now_ns();
  for (int i = 0; i < iters; i++) KB_LIB(kcclAllReduce(send, recv, count, dtype, op, comm, NULL));
  int device = -1;
  KB_LIB(kcclCommCuDevice(comm, &device));
  if (device >= 0) { /* GPU calls only enqueue: the time is the kernels' */
    kcclResult_t r = after(comm, kbg_sync(device));
    if (r != kcclSuccess) return r;
  }
  *us_per_call = (double)(now_ns() - t0) / 1e3 / iters;
  return kcclSuccess;
}

/* The communicator as a GPU one (the library refuses a host or broken one). */
static kcclResult_t gpu_comm(kcclComm_t comm, struct kb_gpu *g) {
  KB_LIB(kcclCommGetDevComm(comm, g->dc, sizeof g->dc));
  KB_LIB(kcclCommCuDevice(comm, &g->device));
  KB_LIB(kcclCommUserRank(comm, &g->rank));
  KB_LIB(kcclCommCount(comm, &g->nranks));
  g->comm = comm;
  kcclResult_t r = kbg_load(g->device);
  return r;
}

static size_t elem_bytes(int dtype) {
  return dtype == kcclFloat32 ? 4 : dtype == kcclFloat16 || dtype == kcclBfloat16 ? 2 : 0;
}

kcclResult_t kb_dev_selftest(const void *inputs, void *outputs, size_t count, int dtype, int op, int iters,
                             int blocks, kcclComm_t comm, void *stream) {
  kb_msg[0] = 0;
  struct kb_gpu g;
  kcclResult_t r = gpu_comm(comm, &g);
  if (r != kcclSuccess) return r;
  if (iters < 1) return kb_fail(kcclInvalidArgument, "iters=%d: at least 1", iters);
  const size_t b = count * elem_bytes(dtype);
  if (b && ((r = kbg_check_ptr(g.device, inputs, b, "inputs")) ||
            (r = kbg_check_ptr(g.device, outputs, b * (size_t)iters, "outputs"))))
    return r;
  if (op < 0 || op >= kcclNumOps) return kb_fail(kcclInvalidArgument, "unknown op %d", op);
  return after(comm, kbg_selftest(&g, inputs, outputs, count, dtype, op, iters, blocks, stream));
}

kcclResult_t kb_bench_dev_all_reduce(void *buf, size_t count, int dtype, int iters, int blocks, kcclComm_t comm,
                                     double *us_per_call) {
  kb_msg[0] = 0;
  struct kb_gpu g;
  kcclResult_t r = gpu_comm(comm, &g);
  if (r != kcclSuccess) return r;
  if (iters < 1 || !us_per_call) return kb_fail(kcclInvalidArgument, "iters >= 1 and usPerCall needed");
  if ((r = kbg_check_ptr(g.device, buf, count * elem_bytes(dtype), "buf"))) return r;
  return after(comm, kbg_chain(&g, buf, count, dtype, iters, blocks, us_per_call));
}

kcclResult_t kb_bench_dev_all_reduce_phases(void *buf, size_t count, int dtype, int iters, int blocks,
                                            kcclComm_t comm, double phases[4]) {
  kb_msg[0] = 0;
  if (iters < 1 || !phases) return kb_fail(kcclInvalidArgument, "iters >= 1 and phases[4] needed");
  struct kb_gpu g;
  kcclResult_t r = gpu_comm(comm, &g);
  if (r != kcclSuccess) return r;
  if ((r = kbg_check_ptr(g.device, buf, count * elem_bytes(dtype), "buf"))) return r;
  return after(comm, kbg_phases(&g, buf, count, dtype, iters, blocks, phases));
}

kcclResult_t kb_bench_residency(kcclComm_t comm, int blocks, int timeout_ms, int foreign, int carveout, int out[4],
                                int *sm_out) {
  kb_msg[0] = 0;
  if (!out) return kb_fail(kcclInvalidArgument, "out[4] needed");
  if (blocks < 1 || blocks > 4096) return kb_fail(kcclInvalidArgument, "blocks=%d: 1..4096", blocks);
  if (timeout_ms < 1 || timeout_ms > 60000)
    return kb_fail(kcclInvalidArgument, "timeoutMs=%d: 1..60000", timeout_ms);
  if (foreign < 0 || foreign > 2)
    return kb_fail(kcclInvalidArgument, "foreign=%d: 0 (none), 1 (no shared memory) or 2 (40 KB of it)", foreign);
  if (carveout < -1 || carveout > 100)
    return kb_fail(kcclInvalidArgument, "carveout=%d: -1 (the driver's choice) or 0..100 percent", carveout);
  struct kb_gpu g;
  kcclResult_t r = gpu_comm(comm, &g);
  if (r != kcclSuccess) return r;
  return after(comm, kbg_residency(&g, blocks, timeout_ms, foreign, carveout, out, sm_out));
}

kcclResult_t kb_bench_flag_hop(kcclComm_t comm, int iters, int mode, double *us_per_hop) {
  kb_msg[0] = 0;
  struct kb_gpu g;
  kcclResult_t r = gpu_comm(comm, &g);
  if (r != kcclSuccess) return r;
  if (iters < 1 || !us_per_hop) return kb_fail(kcclInvalidArgument, "iters >= 1 and usPerHop needed");
  if (mode < 0 || mode > 3) return kb_fail(kcclInvalidArgument, "flag-hop mode %d: 0..3", mode);
  if (g.nranks < 2) return kb_fail(kcclInvalidUsage, "the flag-hop benchmark needs 2 ranks");
  return after(comm, kbg_flag_hop(&g, iters, mode, us_per_hop));
}

/* Argument checks first, on any communicator (the CPU suite reaches them);
 * then the ones that need the GPU communicator's size. */
kcclResult_t kb_dev_group_selftest(int dtype, int op, int count, int calls, int blocks, int reducers, int barrier,
                                   int global_data, int cancel, int cancel_after_us, kcclComm_t comm, int *out,
                                   double *ms) {
  kb_msg[0] = 0;
  if (!out || !ms) return kb_fail(kcclInvalidArgument, "out[KB_GROUP_OUT] and ms needed");
  if (dtype != kcclFloat32 && dtype != kcclFloat16 && dtype != kcclBfloat16)
    return kb_fail(kcclInvalidArgument, "dtype %d: the device API takes float32, float16 or bfloat16", dtype);
  if (op != -1 && op != kcclSum && op != kcclMax)
    return kb_fail(kcclInvalidArgument, "op %d: sum, max or -1 (sum and max in turn)", op);
  const size_t limit = KB_GROUP_MAX_BYTES / elem_bytes(dtype);
  if (count < 1 || (size_t)count > limit)
    return kb_fail(kcclInvalidArgument, "count=%d: 1..%zu (%d bytes per call)", count, limit, KB_GROUP_MAX_BYTES);
  if (calls < 1 || calls > 10000) return kb_fail(kcclInvalidArgument, "calls=%d: 1..10000", calls);
  if (blocks < 1 || blocks > KB_GROUP_MAX_BLOCKS)
    return kb_fail(kcclInvalidArgument, "blocks=%d: 1..%d", blocks, KB_GROUP_MAX_BLOCKS);
  if (reducers < 1 || reducers > blocks || reducers > KB_GROUP_MAX_SLOTS)
    return kb_fail(kcclInvalidArgument, "reducers=%d: 1..min(blocks=%d, %d slots)", reducers, blocks,
                   KB_GROUP_MAX_SLOTS);
  if (barrier < 1 || barrier > 15) return kb_fail(kcclInvalidArgument, "barrier=%d: a named barrier, 1..15", barrier);
  if (global_data != 0 && global_data != 1)
    return kb_fail(kcclInvalidArgument, "globalData=%d: 0 (shared memory) or 1 (global memory)", global_data);
  if (cancel < 0 || cancel > 2)
    return kb_fail(kcclInvalidArgument, "cancel=%d: 0 (none), 1 (set while waiting) or 2 (set before)", cancel);
  if (cancel_after_us < 0 || cancel_after_us > 10000000)
    return kb_fail(kcclInvalidArgument, "cancelAfterUs=%d: 0..10000000", cancel_after_us);
  struct kb_gpu g;
  kcclResult_t r = gpu_comm(comm, &g);
  if (r != kcclSuccess) return r;
  if (g.nranks > KB_GROUP_MAX_RANKS)
    return kb_fail(kcclInvalidUsage, "the group self-test runs kcclDevAllReduceGroup<%d>: at most %d ranks, not %d",
                   KB_GROUP_MAX_RANKS, KB_GROUP_MAX_RANKS, g.nranks);
  if (cancel && g.nranks < 2) return kb_fail(kcclInvalidUsage, "the cancel case needs 2 ranks (rank 1 stays away)");
  return after(comm, kbg_group_selftest(&g, dtype, op, count, calls, blocks, reducers, barrier, global_data, cancel,
                                        cancel_after_us, out, ms));
}
