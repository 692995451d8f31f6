/* gpu_api.h - the interface between the C core (gpu_host.c: bootstrap,
 * watcher, checks) and the CUDA side (src/gpu/ CUDA files: memory, IPC, kernels).  Plain
 * C on both sides; built without CUDA, gpu_none.c implements it with errors. */
#ifndef KCCL_GPU_API_H_
#define KCCL_GPU_API_H_
#include <stddef.h>
#include <stdint.h>

#include "kccl.h"
#include "kccl_device/gpu_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KGPU_IPC_BYTES 64
#define KGPU_PCI_BYTES 32
#define KCCL_GPU_MAX_BLOCKS 132 /* blocks per rank of the chunked kernels, at most (KCCL_GPU_BLOCKS) */
/* Threads per chunked block, at most (KCCL_GPU_CHUNK_THREADS): their launch
 * bounds keep 80 registers (65536 / 768, rounded down to whole units), the
 * count of (256, 3) they had before, so one block of 768 fits on an SM. */
#define KCCL_GPU_MAX_CHUNK_THREADS 768

struct kgpu; /* opaque: one rank's GPU state */

/* What a rank publishes to its peers through its host segment. */
typedef struct {
  int32_t sms;                  /* multiprocessors of its GPU */
  int8_t ts_per_sm[KCCL_GPU_MAX_CHUNK_THREADS / 32]; /* [w - 1]: blocks of w warps of a chunked kernel
                                   that fit on one multiprocessor */
  int32_t ll_per_sm;            /* blocks of the one-shot kernel that fit on one multiprocessor */
  int32_t flag_replicas;        /* KGPU_REP_*: asked for per-L2-partition flag replicas, and how its
                                   calibration went (its tables are in its buffer when OK) */
  uint64_t bytes;               /* size of its exported buffer */
  char pci[KGPU_PCI_BYTES];     /* PCI bus id: ranks with equal ids share a GPU */
  uint8_t ipc[KGPU_IPC_BYTES];  /* cudaIpcMemHandle_t of the buffer */
} kgpu_export;

/* kgpu_export.flag_replicas: not asked for; calibrated; or why this rank's calibration refused. */
#define KGPU_REP_OFF 0
#define KGPU_REP_OK 1
#define KGPU_REP_FEW_SMS 2      /* fewer than 2 SMs measured (or the probe ran out of time) */
#define KGPU_REP_ONE_GROUP 3    /* the SMs do not split into two groups */
#define KGPU_REP_FEW_LINES 4    /* too few lines clearly near one group */

/* This rank's config and the sizes every rank must agree on (derived from the
 * config and all exports).  The CUDA side reads the GPU settings (KCCL_GPU_* of
 * kccl_settings.def) from cfg itself, so a new one needs no field here. */
typedef struct {
  int nranks, rank;
  kcclConfig_t cfg;
  int ts_blocks;                /* blocks of the two-shot / gather kernels */
  int ts_threads;               /* threads per block of the two-shot / gather kernels */
  int ll_blocks;                /* blocks of the one-shot kernel, at most */
  int ll_room;                  /* one-shot blocks that fit at once: a call's and its PDL successor's */
} kgpu_shape;

int kgpu_built(void);
kcclResult_t kgpu_device_count(int *n);
/* Allocates this rank's buffer on `device` and fills *exp. */
kcclResult_t kgpu_create(int device, const kgpu_shape *shape, struct kgpu **out, kgpu_export *exp,
                         kcclGpuStatus **status);
/* Maps every peer's buffer (peers[rank] is this rank's own export). */
kcclResult_t kgpu_connect(struct kgpu *g, const kgpu_export *peers);
/* Waits for this process's work on the device (cudaDeviceSynchronize). */
kcclResult_t kgpu_sync(struct kgpu *g);
/* Unmaps peers; frees the own buffer only when free_own (peers may still write it). */
void kgpu_destroy(struct kgpu *g, int free_own);

/* 1 when [p, p+bytes) is device memory of this communicator's GPU. */
kcclResult_t kgpu_check_ptr(struct kgpu *g, const void *p, size_t bytes, const char *what);

/* The largest all-reduce the one-shot kernel takes (ll_blocks x 8 KB). */
size_t kgpu_oneshot_max_bytes(struct kgpu *g);
kcclResult_t kgpu_allreduce(struct kgpu *g, const void *send, void *recv, size_t count, int dtype, int op,
                            int twoshot, uint32_t sig, void *stream);
/* root < 0: all-gather of `bytes` per rank; else broadcast of `bytes` from root. */
kcclResult_t kgpu_gather(struct kgpu *g, const void *send, void *recv, size_t bytes, int root, uint32_t sig,
                         void *stream);
kcclResult_t kgpu_reduce_scatter(struct kgpu *g, const void *send, void *recv, size_t recvcount, int dtype,
                                 int op, uint32_t sig, void *stream);

/* Split-phase all-reduce on the GPU (kcclAllReduceStartStream): a side stream and
 * one pair of events per outstanding slot (KCCL_MAX_OUTSTANDING of them). */
#define KGPU_SPLIT_SLOTS 8
kcclResult_t kgpu_split_fork(struct kgpu *g, int slot, void *stream, void **side);
kcclResult_t kgpu_split_done(struct kgpu *g, int slot);
kcclResult_t kgpu_split_join(struct kgpu *g, int slot, void *stream);

kcclResult_t kgpu_get_devcomm(struct kgpu *g, void *out, size_t bytes);
/* Flag replicas of this communicator: *state 1 in use, 0 not asked for, -1 asked for but
 * disabled; note says why (gpu_l2map.cu). */
void kgpu_flag_replicas(struct kgpu *g, int *state, char *note, size_t bytes);

/* error.c */
kcclResult_t kccl_err(kcclResult_t code, const char *fmt, ...);
void kccl_log(int level, const char *fmt, ...);

#ifdef __cplusplus
}
#endif
#endif
