/* kccl_bench_nogpu.c - the GPU half when the extension was built without nvcc:
 * every call says so (a GPU communicator's calls reach here only then). */
#include "kccl_bench.h"

#define NO_CUDA kb_fail(kcclInvalidUsage, "the benchmark extension was built without CUDA (no nvcc)")

kcclResult_t kbg_load(int device) { (void)device; return NO_CUDA; }
kcclResult_t kbg_sync(int device) { (void)device; return NO_CUDA; }
kcclResult_t kbg_check_ptr(int device, const void *p, size_t bytes, const char *what) {
  (void)device; (void)p; (void)bytes; (void)what;
  return NO_CUDA;
}
kcclResult_t kbg_selftest(const struct kb_gpu *g, const void *in, void *out, size_t count, int dtype, int op,
                          int iters, int blocks, void *stream) {
  (void)g; (void)in; (void)out; (void)count; (void)dtype; (void)op; (void)iters; (void)blocks; (void)stream;
  return NO_CUDA;
}
kcclResult_t kbg_chain(const struct kb_gpu *g, void *buf, size_t count, int dtype, int iters, int blocks,
                       double *us_per_call) {
  (void)g; (void)buf; (void)count; (void)dtype; (void)iters; (void)blocks; (void)us_per_call;
  return NO_CUDA;
}
kcclResult_t kbg_phases(const struct kb_gpu *g, void *buf, size_t count, int dtype, int iters, int blocks,
                        double phases[4]) {
  (void)g; (void)buf; (void)count; (void)dtype; (void)iters; (void)blocks; (void)phases;
  return NO_CUDA;
}
kcclResult_t kbg_flag_hop(const struct kb_gpu *g, int iters, int mode, double *us_per_hop) {
  (void)g; (void)iters; (void)mode; (void)us_per_hop;
  return NO_CUDA;
}
kcclResult_t kbg_residency(const struct kb_gpu *g, int blocks, int timeout_ms, int foreign, int carveout,
                           int out[4], int *sm_out) {
  (void)g; (void)blocks; (void)timeout_ms; (void)foreign; (void)carveout; (void)out; (void)sm_out;
  return NO_CUDA;
}
kcclResult_t kbg_group_selftest(const struct kb_gpu *g, int dtype, int op, int count, int calls, int blocks,
                                int reducers, int barrier, int global_data, int cancel, int cancel_after_us,
                                int *out, double *ms) {
  (void)g; (void)dtype; (void)op; (void)count; (void)calls; (void)blocks; (void)reducers; (void)barrier;
  (void)global_data; (void)cancel; (void)cancel_after_us; (void)out; (void)ms;
  return NO_CUDA;
}
