/* gpu_none.c - the GPU interface of a build without CUDA: nothing is there,
 * and every entry says so.  setup.py leaves this file out when it compiles
 * the CUDA sources (KCCL_HAVE_CUDA). */
#ifndef KCCL_HAVE_CUDA
#include "gpu_api.h"

#define NO_CUDA kccl_err(kcclInvalidUsage, "this KCCL was built without CUDA")

int kgpu_built(void) { return 0; }
kcclResult_t kgpu_device_count(int *n) { *n = 0; return kcclSuccess; }
kcclResult_t kgpu_create(int device, const kgpu_shape *shape, struct kgpu **out, kgpu_export *exp,
                         kcclGpuStatus **status) {
  (void)device; (void)shape; (void)exp; (void)status;
  *out = 0;
  return NO_CUDA;
}
kcclResult_t kgpu_connect(struct kgpu *g, const kgpu_export *peers) { (void)g; (void)peers; return NO_CUDA; }
size_t kgpu_oneshot_max_bytes(struct kgpu *g) { (void)g; return 0; }
kcclResult_t kgpu_sync(struct kgpu *g) { (void)g; return NO_CUDA; }
void kgpu_destroy(struct kgpu *g, int free_own) { (void)g; (void)free_own; }
kcclResult_t kgpu_check_ptr(struct kgpu *g, const void *p, size_t bytes, const char *what) {
  (void)g; (void)p; (void)bytes; (void)what;
  return NO_CUDA;
}
kcclResult_t kgpu_allreduce(struct kgpu *g, const void *send, void *recv, size_t count, int dtype, int op,
                            int twoshot, uint32_t sig, void *stream) {
  (void)g; (void)send; (void)recv; (void)count; (void)dtype; (void)op; (void)twoshot; (void)sig; (void)stream;
  return NO_CUDA;
}
kcclResult_t kgpu_gather(struct kgpu *g, const void *send, void *recv, size_t bytes, int root, uint32_t sig,
                         void *stream) {
  (void)g; (void)send; (void)recv; (void)bytes; (void)root; (void)sig; (void)stream;
  return NO_CUDA;
}
kcclResult_t kgpu_reduce_scatter(struct kgpu *g, const void *send, void *recv, size_t recvcount, int dtype,
                                 int op, uint32_t sig, void *stream) {
  (void)g; (void)send; (void)recv; (void)recvcount; (void)dtype; (void)op; (void)sig; (void)stream;
  return NO_CUDA;
}
kcclResult_t kgpu_get_devcomm(struct kgpu *g, void *out, size_t bytes) { (void)g; (void)out; (void)bytes; return NO_CUDA; }
void kgpu_flag_replicas(struct kgpu *g, int *state, char *note, size_t bytes) {
  (void)g;
  *state = 0;
  if (note && bytes) note[0] = 0;
}
kcclResult_t kgpu_split_fork(struct kgpu *g, int slot, void *stream, void **side) {
  (void)g; (void)slot; (void)stream; *side = 0;
  return NO_CUDA;
}
kcclResult_t kgpu_split_done(struct kgpu *g, int slot) { (void)g; (void)slot; return NO_CUDA; }
kcclResult_t kgpu_split_join(struct kgpu *g, int slot, void *stream) { (void)g; (void)slot; (void)stream; return NO_CUDA; }
#endif
