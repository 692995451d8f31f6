/* none.c - the engine's interface in a build without CUDA (no nvcc at install
 * time, or KCCL_CUDA=0): every entry says so, so that `--device cuda` fails
 * with a clear message instead of an import error. */
#include <stddef.h>

#include "kie_gpu.h"

static const char *why = "this KIE was built without CUDA (reinstall where nvcc and a GPU driver are, or "
                         "with KCCL_CUDA=1)";

int kie_built(void) { return 0; }
int kie_device_count(int *n) { *n = 0; return KIE_OK; }
const char *kie_last_error(void) { return why; }
int kie_plan_bytes(const kie_shape *s, int device, size_t *bytes) { (void)s; (void)device; *bytes = 0; return KIE_E_NOCUDA; }
int kie_create(const kie_shape *s, kcclComm_t comm, int device, kie_engine **out) {
  (void)s; (void)comm; (void)device;
  *out = NULL;
  return KIE_E_NOCUDA;
}
void kie_destroy(kie_engine *e) { (void)e; }
int kie_upload(kie_engine *e, int kind, int layer, const void *src, size_t rows, size_t cols, int on_device) {
  (void)e; (void)kind; (void)layer; (void)src; (void)rows; (void)cols; (void)on_device;
  return KIE_E_NOCUDA;
}
int kie_reset(kie_engine *e) { (void)e; return KIE_E_NOCUDA; }
int kie_set_sampling(kie_engine *e, float temperature, int top_k, float top_p, uint64_t seed) {
  (void)e; (void)temperature; (void)top_k; (void)top_p; (void)seed;
  return KIE_E_NOCUDA;
}
int kie_prefill(kie_engine *e, const int32_t *tokens, int n, int mode) { (void)e; (void)tokens; (void)n; (void)mode; return KIE_E_NOCUDA; }
int kie_set_token(kie_engine *e, int32_t token) { (void)e; (void)token; return KIE_E_NOCUDA; }
int kie_decode(kie_engine *e, int n, int mode, int use_graph) { (void)e; (void)n; (void)mode; (void)use_graph; return KIE_E_NOCUDA; }
int kie_wait_token(kie_engine *e, int step, int timeout_ms, int32_t *token) {
  (void)e; (void)step; (void)timeout_ms; (void)token;
  return KIE_E_NOCUDA;
}
int kie_logits(kie_engine *e, float *out, size_t n) { (void)e; (void)out; (void)n; return KIE_E_NOCUDA; }
int kie_sync(kie_engine *e) { (void)e; return KIE_E_NOCUDA; }
int kie_get_info(kie_engine *e, kie_info *info) { (void)e; (void)info; return KIE_E_NOCUDA; }
int kie_blas_load(const char *path) { (void)path; return KIE_E_NOCUDA; }
const char *kie_blas_path(void) { return ""; }
