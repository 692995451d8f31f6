/* blas.cu - the prefill's matrix products through cuBLAS, loaded at run time.
 *
 * cuBLAS is not linked: the engine builds where only the CUDA compiler and
 * runtime are installed, and a process finds cuBLAS where its Python
 * environment keeps it (PyTorch's wheels) or in the CUDA toolkit, and passes
 * the path to kie_blas_load.  What is used of it is its stable C interface,
 * declared here: a handle, its stream and workspace, and cublasGemmEx. */
#include <dlfcn.h>
#include <pthread.h>
#include <string.h>

#include "engine_internal.h"

namespace {

/* cuBLAS's C interface (cublas_api.h): the enumerators' values are part of its ABI. */
enum { OP_N = 0, OP_T = 1, COMPUTE_32F = 68, GEMM_DEFAULT = -1 };
typedef int (*fn_create)(void **handle);
typedef int (*fn_destroy)(void *handle);
typedef int (*fn_set_stream)(void *handle, cudaStream_t stream);
typedef int (*fn_set_workspace)(void *handle, void *workspace, size_t bytes);
typedef int (*fn_gemm_ex)(void *handle, int transa, int transb, int m, int n, int k, const void *alpha,
                          const void *A, cudaDataType Atype, int lda, const void *B, cudaDataType Btype, int ldb,
                          const void *beta, void *C, cudaDataType Ctype, int ldc, int compute, int algo);

struct Lib {
  void *so;
  fn_create create;
  fn_destroy destroy;
  fn_set_stream set_stream;
  fn_set_workspace set_workspace;
  fn_gemm_ex gemm;
  char path[1024];
};
Lib g_lib;
pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

int load_from(const char *path, char *why, size_t n) {
  void *so = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!so) {
    const char *e = dlerror();
    snprintf(why, n, "%s", e ? e : path);
    return 0;
  }
  Lib l;
  memset(&l, 0, sizeof l);
  l.so = so;
  l.create = (fn_create)dlsym(so, "cublasCreate_v2");
  l.destroy = (fn_destroy)dlsym(so, "cublasDestroy_v2");
  l.set_stream = (fn_set_stream)dlsym(so, "cublasSetStream_v2");
  l.set_workspace = (fn_set_workspace)dlsym(so, "cublasSetWorkspace_v2");
  l.gemm = (fn_gemm_ex)dlsym(so, "cublasGemmEx");
  if (!l.create || !l.destroy || !l.set_stream || !l.set_workspace || !l.gemm) {
    snprintf(why, n, "%s lacks cublasCreate_v2 / cublasSetStream_v2 / cublasSetWorkspace_v2 / cublasGemmEx", path);
    dlclose(so);
    return 0;
  }
  snprintf(l.path, sizeof l.path, "%s", path);
  g_lib = l;
  return 1;
}

}  // namespace

namespace kie_host {

int blas_loaded() { return g_lib.so != nullptr; }

const char *blas_path() { return g_lib.so ? g_lib.path : ""; }

int blas_load(const char *path) {
  pthread_mutex_lock(&g_mu);
  int ok = g_lib.so != nullptr;
  char why[1200] = "", more[600];
  if (!ok && path && *path) {
    ok = load_from(path, why, sizeof why);
  } else if (!ok) {
    for (const char *name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}) {
      if ((ok = load_from(name, more, sizeof more))) break;
      if (!*why) snprintf(why, sizeof why, "%s", more);
    }
  }
  pthread_mutex_unlock(&g_mu);
  return ok ? KIE_OK : fail(KIE_E_NOCUDA, "cuBLAS (for the batched prefill) could not be loaded: %s", why);
}

int blas_create(kie_engine *e) {
  if (!g_lib.so) return fail(KIE_E_NOCUDA, "prefill=1 needs cuBLAS: call kie_blas_load first");
  void *h = nullptr;
  int st = g_lib.create(&h);
  if (st) return fail(KIE_E_CUDA, "cublasCreate: status %d", st);
  if ((st = g_lib.set_stream(h, e->stream)) || (st = g_lib.set_workspace(h, e->pf_ws, e->pf_ws_bytes))) {
    g_lib.destroy(h);
    return fail(KIE_E_CUDA, "cuBLAS handle setup: status %d", st);
  }
  e->blas = h;
  return KIE_OK;
}

void blas_destroy(kie_engine *e) {
  if (e->blas && g_lib.so) g_lib.destroy(e->blas);
  e->blas = nullptr;
}

/* Y[T][N] (ldy) = X[T][K] (ldx) W[N][K]^T (ldw) + beta Y: bf16 X and W, f32 accumulation,
 * Y in f32 (y_f32) or bf16.  cuBLAS is column-major: this is Y^T = W X^T, W transposed. */
int blas_gemm(kie_engine *e, int T, int N, int K, const bf16 *x, int ldx, const bf16 *w, int ldw, void *y, int ldy,
              bool y_f32, float beta) {
  const float alpha = 1.f;
  const int st = g_lib.gemm(e->blas, OP_T, OP_N, N, T, K, &alpha, w, CUDA_R_16BF, ldw, x, CUDA_R_16BF, ldx, &beta, y,
                            y_f32 ? CUDA_R_32F : CUDA_R_16BF, ldy, COMPUTE_32F, GEMM_DEFAULT);
  return st ? fail(KIE_E_CUDA, "cublasGemmEx (%d x %d x %d): status %d", T, N, K, st) : KIE_OK;
}

}  // namespace kie_host
