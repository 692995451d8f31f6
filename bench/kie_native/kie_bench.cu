/* kie_bench.cu - benchmarks and the monokernel's profile of KIE's GPU engine, out of
 * the engine: bench/kie_bench.py calls them on a GpuModel's engine (its handle),
 * and on the engine's own C functions (addresses from kie_engine.gpu.engine).
 * Built by build.py with the engine's GEMV kernels (gemv.cu: the bench's own copy,
 * same source and flags) and its host headers: the engine's struct is read here,
 * never changed except by the engine's own calls. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "step_args.h"

namespace kie_host {
namespace {

/* The engine's C functions (kie_gpu.h), bound by kb_bind. */
struct {
  int (*decode)(kie_engine *, int, int, int);
  int (*sync)(kie_engine *);
  const char *(*last_error)(void);
} g_kie;

/* An engine call's result, its error text copied here. */
int engine_rc(int rc) {
  return rc == KIE_OK ? KIE_OK : fail(rc, "%s", g_kie.last_error ? g_kie.last_error() : "");
}

/* This module's copy of the GEMV kernels gets the engine's shared-memory limit. */
int own_kernels_ready() {
  static int done;
  if (!done) CU(kie_gemv_attributes(XS_MAX, 0));
  done = 1;
  return KIE_OK;
}

int time_graph(kie_engine *e, cudaGraphExec_t x, int reps, double *ms_median) {
  cudaEvent_t a, b;
  CU(cudaEventCreate(&a));
  CU(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int r = 0; r < reps; r++) {
    CU(cudaEventRecord(a, e->stream));
    CU(cudaGraphLaunch(x, e->stream));
    CU(cudaEventRecord(b, e->stream));
    CU(cudaEventSynchronize(b));
    float t = 0.f;
    CU(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  *ms_median = ms[ms.size() / 2];
  return KIE_OK;
}

/* Captures `iters` calls of enqueue(i) as one graph and times its replays
 * (two to warm up, then the median of seven); *ms: one replay. */
template <typename F>
int bench_graph(kie_engine *e, int iters, F enqueue, double *ms) {
  cudaGraphExec_t xg = nullptr;
  TRY(capture_graph(e, [&] {
    int rc = KIE_OK;
    for (int i = 0; i < iters && rc == KIE_OK; i++) rc = enqueue(i);
    return rc;
  }, &xg, nullptr));
  int rc = time_graph(e, xg, 2, ms);
  if (rc == KIE_OK) rc = time_graph(e, xg, 7, ms);
  cudaGraphExecDestroy(xg);
  return rc;
}

}  // namespace
}  // namespace kie_host

using namespace kie_host;

extern "C" {

const char *kb_last_error(void) { return g_err; }

int kb_bind(const char *name, uintptr_t fn) {
  if (!strcmp(name, "kie_decode")) g_kie.decode = (int (*)(kie_engine *, int, int, int))fn;
  else if (!strcmp(name, "kie_sync")) g_kie.sync = (int (*)(kie_engine *))fn;
  else if (!strcmp(name, "kie_last_error")) g_kie.last_error = (const char *(*)(void))fn;
  else return 0;
  return 1;
}

int kb_bench_gemv(kie_engine *e, int rows, int cols, int iters, double *us_per_call) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  TRY(own_kernels_ready());
  if (rows < 2 || cols < 8 || cols % 8 || iters < 1)
    return fail(KIE_E_ARG, "bench_gemv: rows >= 2, cols a positive multiple of 8, iters >= 1");
  CU(cudaSetDevice(e->device));
  /* Enough matrices to rotate through that none is still in L2 (50 MB) when it
   * comes round again. */
  const size_t mbytes = (size_t)rows * cols * 2;
  const int nmat = (int)std::max<size_t>(2, (512u << 20) / mbytes);
  bf16 *w = nullptr;
  float *x = nullptr, *y = nullptr;
  CU(cudaMalloc((void **)&w, mbytes * nmat));
  CU(cudaMalloc((void **)&x, (size_t)cols * 4));
  CU(cudaMalloc((void **)&y, (size_t)rows * 4));
  CU(cudaMemsetAsync(x, 0, (size_t)cols * 4, e->stream));
  CU(kie_launch_fill_random(w, mbytes / 2 * nmat, 1234u, 0.1f, e->stream));
  CU(kie_launch_fill_random((bf16 *)x, (size_t)cols, 99u, 1.0f, e->stream));
  double ms = 0;
  const int rc = bench_graph(e, iters, [&](int i) {
    GemvArgs a = plain(e, 1, x, cols, cols);
    a.w = w + (size_t)(i % nmat) * rows * cols;
    a.rows = rows;
    a.out = y;
    a.out_ld = rows;
    return gemv(e, a, EPI_STORE);
  }, &ms);
  cudaFree(w);
  cudaFree(x);
  cudaFree(y);
  TRY(rc);
  *us_per_call = 1000.0 * ms / iters;
  return KIE_OK;
}

int kb_bench_layer_gemvs(kie_engine *e, int iters, double *us_per_layer) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  TRY(own_kernels_ready());
  TRY(weights_loaded(e));
  if (iters < 1) return fail(KIE_E_ARG, "iters >= 1");
  if (e->pos_h >= e->s.max_seq) return fail(KIE_E_STATE, "the context is full");
  CU(cudaSetDevice(e->device));
  const Layer &y = e->L[0];
  double ms = 0;
  TRY(bench_graph(e, iters, [&](int) {
    GemvArgs a = normed(e, 1, e->R[0], e->R[1], y.n1);
    qkv_args(e, 0, a);
    GemvArgs o = partial_sum_args(e, 1, e->att, e->qdim, e->qdim, y.wo, e->sums);
    GemvArgs b = normed(e, 1, e->R[1], e->R[0], y.n2);
    gate_up_args(e, 0, b);
    GemvArgs dn = partial_sum_args(e, 1, e->act, e->s.inter, e->inter_pad, y.wd, e->sums);
    int rc = gemv(e, a, EPI_QKV);
    if (rc == KIE_OK) rc = gemv(e, o, EPI_STORE);
    if (rc == KIE_OK) rc = gemv(e, b, EPI_SWIGLU);
    if (rc == KIE_OK) rc = gemv(e, dn, EPI_STORE);
    return rc;
  }, &ms));
  *us_per_layer = 1000.0 * ms / iters;
  return KIE_OK;
}

int kb_bench_steps(kie_engine *e, int iters, int mode, double *us_per_step) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  if (!g_kie.decode || !g_kie.sync || !g_kie.last_error) return fail(KIE_E_STATE, "kb_bind the engine's functions first");
  if (iters < 1) return fail(KIE_E_ARG, "iters >= 1");
  CU(cudaSetDevice(e->device));
  /* The engine checks the mode, the weights and the context, and captures the
   * step's graph (zero steps: nothing runs), so the timed launches below are
   * the graph replays alone, as in its own generate(). */
  TRY(engine_rc(g_kie.decode(e, 0, mode, 1)));
  cudaEvent_t a, b;
  CU(cudaEventCreate(&a));
  CU(cudaEventCreate(&b));
  CU(cudaEventRecord(a, e->stream));
  const int rc = engine_rc(g_kie.decode(e, iters, mode, 1));
  CU(cudaEventRecord(b, e->stream));
  CU(cudaEventSynchronize(b));
  float ms = 0.f;
  CU(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  TRY(rc);
  *us_per_step = 1000.0 * ms / iters;
  return engine_rc(g_kie.sync(e)); /* a device or lane error of those steps */
}

/* The monokernel's clocks of its last step: [stages][4][grid] (mono.cu's MARK_*). */
int kb_mono_marks(kie_engine *e, uint64_t *out, size_t n) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  if (!e->mono_ready) return fail(KIE_E_STATE, "mono_marks: the monokernel has not run");
  const size_t want = 4 * (size_t)e->mono_n * e->mono_grid;
  if (n < want) return fail(KIE_E_ARG, "mono_marks: %zu slots, the step has %zu", n, want);
  CU(cudaSetDevice(e->device));
  CU(cudaStreamSynchronize(e->stream));
  CU(cudaMemcpy(out, e->mono_marks, want * 8, cudaMemcpyDeviceToHost));
  return KIE_OK;
}

/* The graph path's step clock of its last pass: [launches][KIE_CLK_MARKS][KIE_CLK_BLOCKS]
 * (kie_kernels.h's KIE_CLK_*; the engine made with kie_shape.step_clock = 1). */
int kb_graph_marks(kie_engine *e, uint64_t *out, size_t n) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  if (!e->step_marks) return fail(KIE_E_STATE, "graph_marks: the engine was made without step_clock=1");
  const size_t want = (size_t)e->mono_n * KIE_CLK_MARKS * KIE_CLK_BLOCKS;
  if (n < want) return fail(KIE_E_ARG, "graph_marks: %zu slots, the step has %zu", n, want);
  CU(cudaSetDevice(e->device));
  CU(cudaStreamSynchronize(e->stream));
  CU(cudaMemcpy(out, e->step_marks, want * 8, cudaMemcpyDeviceToHost));
  return KIE_OK;
}

}  // extern "C"
