/* api.cu - the engine's C API (kie_gpu.h): life cycle, uploads, steps, the token
 * ring the host reads, and the errors the calls and the device report. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <algorithm>

#include "engine_internal.h"

namespace kie_host {

int check_comm(kie_engine *e) {
  if (e->s.tp_size < 2) return KIE_OK;
  kcclResult_t err = kcclSuccess;
  kcclCommGetAsyncError(e->comm, &err);
  return err ? comm_fail(e, err, "the lanes' communicator") : KIE_OK;
}

/* A monokernel failure between the lanes (KIE_E_COMM): what the kernel
 * reported, and what the communicator says (KCCL recorded the call that
 * failed, or a peer its watcher saw go), when it says anything. */
int lanes_fail(kie_engine *e, const char *what) {
  kcclResult_t err = kcclSuccess;
  if (e->s.tp_size > 1) kcclCommGetAsyncError(e->comm, &err);
  const char *why = err ? kcclGetLastError(e->comm) : nullptr;
  return fail(KIE_E_COMM, "%s%s%s", what, why ? ": " : "", why ? why : "");
}

int device_error(kie_engine *e) {
  const int code = *(volatile int32_t *)&e->ring_h->err;
  if (!code) return KIE_OK;
  const int arg = *(volatile int32_t *)&e->ring_h->err_arg;
  switch (code) {
    case KIE_DERR_POS: return fail(KIE_E_DEVICE, "a kernel was asked for position %d, past the KV cache", arg);
    case KIE_DERR_NAN: return fail(KIE_E_DEVICE, "the logits of step %d are not finite", arg);
    case KIE_DERR_STALL:
      return fail(KIE_E_DEVICE, "a monokernel wait at stage %d ran past its bound; the engine must be closed", arg);
    case KIE_DERR_COMM: {
      char what[160];
      snprintf(what, sizeof what, "the monokernel's sum of the lanes failed (KCCL error %d); the engine must be "
               "closed", arg);
      return lanes_fail(e, what);
    }
    case KIE_DERR_PEER: {
      char what[200];
      snprintf(what, sizeof what, "a monokernel wait for the lanes' sum of stage %d ran past its bound (a lane "
               "stopped, or runs other steps); the engine and its communicator must be closed", arg);
      return lanes_fail(e, what);
    }
    default: return fail(KIE_E_DEVICE, "a kernel reported error %d (argument %d)", code, arg);
  }
}

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

}  // namespace kie_host

using namespace kie_host;

extern "C" {

int kie_built(void) { return 1; }

int kie_blas_load(const char *path) { return blas_load(path); }

const char *kie_blas_path(void) { return blas_path(); }

const char *kie_last_error(void) { return g_err; }

int kie_device_count(int *n) {
  *n = 0;
  if (cudaGetDeviceCount(n) != cudaSuccess) {
    cudaGetLastError();
    *n = 0;
  }
  return KIE_OK;
}

int kie_plan_bytes(const kie_shape *s, int device, size_t *bytes) {
  int n = 0;
  kie_device_count(&n);
  if (device < 0 || device >= n) return fail(KIE_E_NOCUDA, "device %d: this process sees %d CUDA device(s)", device, n);
  int sms = 0;
  CU(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  kie_engine probe;
  TRY(derive(&probe, *s, sms));
  *bytes = layout(&probe, nullptr);
  return KIE_OK;
}

int kie_create(const kie_shape *s, kcclComm_t comm, int device, kie_engine **out) {
  *out = nullptr;
  if (s->tp_size > 1 && !comm) return fail(KIE_E_ARG, "tp_size=%d needs a KCCL communicator", s->tp_size);
  if (s->prefill == 1 && !blas_loaded())
    return fail(KIE_E_NOCUDA, "prefill=1 needs cuBLAS: kie_blas_load did not succeed in this process");
  size_t bytes = 0;
  TRY(kie_plan_bytes(s, device, &bytes));
  kcclDevComm dc;
  memset(&dc, 0, sizeof dc);
  if (s->tp_size > 1 && s->kernel == KIE_KERNEL_MONO) { /* the monokernel sums the lanes itself */
    const int rc = kcclCommGetDevComm(comm, &dc, sizeof dc);
    if (rc) return fail(KIE_E_COMM, "kcclCommGetDevComm: KCCL error %d: %s", rc, kcclGetLastError(comm));
  }
  CU(cudaSetDevice(device));
  size_t free_b = 0, total_b = 0;
  CU(cudaMemGetInfo(&free_b, &total_b));
  if (bytes + (256u << 20) > free_b)
    return fail(KIE_E_MEMORY, "the model needs %.2f GiB on device %d (weights, KV cache for %d positions, "
                "buffers) and %.2f GiB of its %.2f GiB are free", bytes / 1073741824.0, device, s->max_seq,
                free_b / 1073741824.0, total_b / 1073741824.0);
  kie_engine *e = new kie_engine();
  e->device = device;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  derive(e, *s, sms);
  e->comm = s->tp_size > 1 ? comm : nullptr;
  e->dc = dc;
  e->bytes = layout(e, nullptr);
  cudaError_t ce = cudaMalloc((void **)&e->arena, e->bytes);
  if (ce != cudaSuccess) {
    delete e;
    cudaGetLastError();
    return fail(KIE_E_MEMORY, "cudaMalloc of %.2f GiB on device %d: %s", bytes / 1073741824.0, device,
                cudaGetErrorString(ce));
  }
  layout(e, e->arena);
  int rc = KIE_OK;
  /* Every write goes on the engine's stream: it does not wait for the legacy default stream. */
  if ((ce = cudaStreamCreateWithFlags(&e->stream, cudaStreamNonBlocking)) != cudaSuccess ||
      (ce = cudaMemsetAsync(e->arena, 0, e->bytes, e->stream)) != cudaSuccess ||
      (ce = cudaStreamSynchronize(e->stream)) != cudaSuccess ||
      (ce = cudaHostAlloc((void **)&e->ring_h, sizeof(HostRing), cudaHostAllocMapped)) != cudaSuccess ||
      (ce = cudaHostGetDevicePointer((void **)&e->ring_d, e->ring_h, 0)) != cudaSuccess ||
      (ce = kie_gemv_attributes(XS_MAX, s->gemv_carveout)) != cudaSuccess || (ce = kie_attention_smem_attributes()) != cudaSuccess ||
      (e->pf_chunk > 0 && (ce = kie_pf_attention_attributes()) != cudaSuccess))
    rc = fail(KIE_E_CUDA, "device %d setup: %s", device, cudaGetErrorString(ce));
  if (rc == KIE_OK && e->pf_chunk > 0) rc = blas_create(e);
  if (rc != KIE_OK) {
    kie_destroy(e);
    return rc;
  }
  memset(e->ring_h, 0, sizeof(HostRing));
  e->have.assign((size_t)n_uploads(*s), 0);
  *out = e;
  return KIE_OK;
}

void kie_destroy(kie_engine *e) {
  if (!e) return;
  cudaSetDevice(e->device);
  if (e->stream) cudaStreamSynchronize(e->stream);
  for (int m = 0; m < 3; m++)
    if (e->graph[m]) cudaGraphExecDestroy(e->graph[m]);
  blas_destroy(e);
  if (e->stream) cudaStreamDestroy(e->stream);
  if (e->arena) cudaFree(e->arena);
  if (e->ring_h) cudaFreeHost(e->ring_h);
  cudaGetLastError();
  delete e;
}

int kie_upload(kie_engine *e, int kind, int layer, const void *src, size_t rows, size_t cols, int on_device) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  return upload(e, kind, layer, src, rows, cols, on_device);
}

int kie_reset(kie_engine *e) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  CU(cudaSetDevice(e->device));
  CU(cudaStreamSynchronize(e->stream));
  TRY(device_error(e));
  /* On the engine's stream (a plain cudaMemset goes on the legacy stream, which
   * this non-blocking stream does not wait for: the next prefill could start
   * from the old position). */
  CU(cudaMemsetAsync(e->st, 0, sizeof(DevState), e->stream));
  CU(cudaMemsetAsync(e->mono_sync, 0, sizeof(MonoSync), e->stream));
  CU(cudaMemsetAsync(e->mono_cnt, 0, (size_t)e->mono_n * 8, e->stream));
  /* the LL words' tags start again from the epoch's */
  if (e->mono_ll) CU(cudaMemsetAsync(e->mono_ll, 0, mono_ll_words(e) * 8, e->stream));
  /* a launch cut short by an error may have left a count */
  CU(cudaMemsetAsync(e->att_cnt, 0, (size_t)e->tmax * e->s.heads * 4, e->stream));
  if (e->pf_chunk > 0)
    CU(cudaMemsetAsync(e->pf_acnt, 0, PF_QUERY_TILES(e->s.heads, e->pf_chunk) * 4, e->stream));
  CU(cudaStreamSynchronize(e->stream));
  memset(e->ring_h, 0, sizeof(HostRing));
  e->pos_h = e->step_h = 0;
  return KIE_OK;
}

int kie_set_sampling(kie_engine *e, float temperature, int top_k, float top_p, uint64_t seed) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  if (!(temperature > 0.f)) return fail(KIE_E_ARG, "temperature must be > 0 for sampling (0 is greedy)");
  if (top_k < 0) return fail(KIE_E_ARG, "top_k must be >= 0");
  if (!(top_p > 0.f && top_p <= 1.f)) return fail(KIE_E_ARG, "top_p must be in (0, 1]");
  SampParams p;
  memset(&p, 0, sizeof p);
  p.inv_temp = 1.0f / temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.seed = seed;
  CU(cudaSetDevice(e->device));
  CU(cudaMemcpyAsync(e->samp, &p, sizeof p, cudaMemcpyHostToDevice, e->stream));
  CU(cudaStreamSynchronize(e->stream));
  e->sampling_set = 1;
  return KIE_OK;
}

static int check_mode(kie_engine *e, int mode) {
  if (mode < KIE_MODE_ADVANCE || mode > KIE_MODE_SAMPLE) return fail(KIE_E_ARG, "mode %d", mode);
  if (mode == KIE_MODE_SAMPLE && !e->sampling_set) return fail(KIE_E_STATE, "kie_set_sampling first");
  return KIE_OK;
}

int kie_prefill(kie_engine *e, const int32_t *tokens, int n, int mode) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  TRY(check_mode(e, mode));
  TRY(weights_loaded(e));
  if (n < 1) return fail(KIE_E_ARG, "prefill needs at least one token");
  if (e->pos_h + n > e->s.max_seq)
    return fail(KIE_E_STATE, "%d tokens from position %d do not fit the context of %d", n, e->pos_h, e->s.max_seq);
  for (int i = 0; i < n; i++)
    if (tokens[i] < 0 || tokens[i] >= e->s.vocab)
      return fail(KIE_E_ARG, "token %d at prompt index %d is outside the vocabulary of %d", tokens[i], i, e->s.vocab);
  CU(cudaSetDevice(e->device));
  const int chunk = e->pf_chunk > 0 ? e->pf_chunk : e->tmax;
  for (int at = 0; at < n; at += chunk) {
    const int T = std::min(chunk, n - at);
    const int m = at + T == n ? mode : KIE_MODE_ADVANCE;
    if (e->pf_chunk > 0) {
      /* pf_tok feeds this pass's embedding rows; the pick writes the next token to tokbuf */
      CU(cudaMemcpyAsync(e->pf_tok, tokens + at, (size_t)T * 4, cudaMemcpyHostToDevice, e->stream));
      TRY(enqueue_prefill(e, T, m));
    } else {
      CU(cudaMemcpyAsync(e->tokbuf, tokens + at, (size_t)T * 4, cudaMemcpyHostToDevice, e->stream));
      TRY(enqueue_forward(e, T, m));
    }
    e->pos_h += T;
  }
  if (mode != KIE_MODE_ADVANCE) e->step_h++;
  return KIE_OK;
}

int kie_set_token(kie_engine *e, int32_t token) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  if (token < 0 || token >= e->s.vocab) return fail(KIE_E_ARG, "token %d is outside the vocabulary of %d", token, e->s.vocab);
  CU(cudaSetDevice(e->device));
  CU(cudaMemcpyAsync(e->tokbuf, &token, 4, cudaMemcpyHostToDevice, e->stream));
  CU(cudaStreamSynchronize(e->stream));
  return KIE_OK;
}

int kie_decode(kie_engine *e, int n, int mode, int use_graph) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  TRY(check_mode(e, mode));
  TRY(weights_loaded(e));
  if (n < 0) return fail(KIE_E_ARG, "n=%d", n);
  if (e->pos_h + n > e->s.max_seq)
    return fail(KIE_E_STATE, "%d more steps from position %d do not fit the context of %d", n, e->pos_h, e->s.max_seq);
  CU(cudaSetDevice(e->device));
  if (use_graph) TRY(capture(e, mode));
  for (int i = 0; i < n; i++) {
    if (use_graph) CU(cudaGraphLaunch(e->graph[mode], e->stream));
    else TRY(enqueue_step(e, mode));
    e->pos_h++;
    if (mode != KIE_MODE_ADVANCE) e->step_h++;
  }
  return KIE_OK;
}

int kie_wait_token(kie_engine *e, int step, int timeout_ms, int32_t *token) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  if (step < 0 || step >= e->step_h)
    return fail(KIE_E_STATE, "step %d has not been enqueued (%d so far)", step, e->step_h);
  if (e->step_h - step > KIE_RING)
    return fail(KIE_E_STATE, "step %d was overwritten in the ring (%d steps enqueued since)", step, e->step_h - step);
  const double deadline = now_s() + timeout_ms / 1000.0;
  double next_check = 0;
  long spins = 0;
  const volatile uint32_t *seq = &e->ring_h->seq[step % KIE_RING];
  for (;;) {
    if (*seq == (uint32_t)step + 1u) {
      __sync_synchronize();
      *token = *(volatile int32_t *)&e->ring_h->token[step % KIE_RING];
      TRY(device_error(e));
      return KIE_OK;
    }
    TRY(device_error(e));
    const double t = now_s();
    if (t > next_check) {
      next_check = t + 0.001;
      TRY(check_comm(e));
      const cudaError_t q = cudaStreamQuery(e->stream);
      if (q != cudaSuccess && q != cudaErrorNotReady)
        return fail(KIE_E_CUDA, "the decode stream failed: %s", cudaGetErrorString(q));
      if (q == cudaSuccess) { /* all done: the token must be there now */
        __sync_synchronize();
        if (*seq != (uint32_t)step + 1u) {
          TRY(device_error(e));
          return fail(KIE_E_STATE, "the stream is idle but step %d never arrived", step);
        }
        continue;
      }
    }
    if (t > deadline)
      return fail(KIE_E_TIMEOUT, "step %d did not arrive within %d ms", step, timeout_ms);
    if (++spins > 2000) {
      timespec ts = {0, 20000};
      nanosleep(&ts, nullptr);
    }
  }
}

int kie_logits(kie_engine *e, float *out, size_t n) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  CU(cudaSetDevice(e->device));
  CU(cudaStreamSynchronize(e->stream));
  TRY(device_error(e));
  const float *src = e->logits;
  if (e->s.tp_size > 1) {
    const int rc =
        kcclAllGather(e->logits, e->logits_all, (size_t)e->s.vocab_part, kcclFloat32, e->comm, e->stream);
    if (rc) return comm_fail(e, rc, "all-gather of the logits");
    src = e->logits_all;
  }
  const size_t m = std::min(n, (size_t)e->s.vocab);
  CU(cudaMemcpyAsync(out, src, m * 4, cudaMemcpyDeviceToHost, e->stream));
  CU(cudaStreamSynchronize(e->stream));
  return check_comm(e);
}

int kie_sync(kie_engine *e) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  CU(cudaSetDevice(e->device));
  CU(cudaStreamSynchronize(e->stream));
  TRY(device_error(e));
  return check_comm(e);
}

int kie_get_info(kie_engine *e, kie_info *info) {
  if (!e) return fail(KIE_E_ARG, "%s: no engine (closed?)", __func__);
  memset(info, 0, sizeof *info);
  info->sms = e->sms;
  info->nsplit = e->nsplit;
  info->prefill_tokens = e->tmax;
  info->gemv_blocks = e->gemv_grid_max;
  info->device_bytes = e->bytes;
  info->graph_nodes = e->graph_nodes;
  info->kernel = e->s.kernel;
  info->mono_slots = e->mono_ready ? e->mono_nslots : 0;
  info->mono_slot_bytes = e->mono_ready ? e->mono_slot : 0;
  info->mono_smem = e->mono_ready ? (int)e->mono_smem : 0;
  info->mono_stages = e->mono_n;
  info->mono_blocks = e->mono_ready ? e->mono_grid : 0;
  info->mono_reducers = e->mono_ready ? e->mono_nred : 0;
  const bool smem_att = e->mono_ready && e->mono_attn == 2;
  info->mono_att_keys = smem_att ? e->mono_att_keys : 0;
  info->mono_att_split_keys = smem_att ? e->mono_att_split : 0;
  info->mono_att_splits = smem_att ? e->mono_att_splits : 0;
  info->prefill_chunk = e->pf_chunk;
  info->mono_ll_stages = e->mono_ready ? e->mono_ll_n : 0;
  CU(cudaSetDevice(e->device));
  CU(cudaStreamSynchronize(e->stream));
  DevState st;
  CU(cudaMemcpy(&st, e->st, sizeof st, cudaMemcpyDeviceToHost));
  info->pos = st.pos;
  info->step = st.step;
  return KIE_OK;
}

}  // extern "C"
