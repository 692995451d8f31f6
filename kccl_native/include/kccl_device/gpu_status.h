/* kccl_device/gpu_status.h (internal, as all of kccl_device/) - the host-mapped record that a rank's host code and its
 * kernels share (plain C: included by the C core and by the device API). */
#ifndef KCCL_GPU_STATUS_H_
#define KCCL_GPU_STATUS_H_
#include <stdint.h>

/* Why a GPU wait gave up (kcclGpuStatus.what); CANCELLED: the kernel that
 * called the device API ended the call (kcclDevGroup.cancel). */
enum { KCCL_GPU_OK = 0, KCCL_GPU_TIMEOUT = 1, KCCL_GPU_MISMATCH = 2, KCCL_GPU_STOPPED = 3, KCCL_GPU_CANCELLED = 4 };

#define KCCL_GPU_BYTES_UNKNOWN 0xffffffffu

/* Why the host's watcher stopped the kernels (kcclGpuStatus.stop). */
enum { KCCL_STOP_NONE = 0, KCCL_STOP_DEAD = 1, KCCL_STOP_ABORTED = 2, KCCL_STOP_CLOSED = 3, KCCL_STOP_FAILED = 4,
       KCCL_STOP_SELF = 5 };

typedef struct {
  volatile int32_t stop;       /* KCCL_STOP_*: set by the host; waiting kernels give up */
  volatile int32_t stop_peer;  /* the rank that caused it */
  volatile int32_t code;       /* kcclResult_t of the first kernel-side failure; written last */
  volatile int32_t what;       /* KCCL_GPU_* */
  volatile int32_t peer;       /* the rank waited for */
  volatile uint32_t sig_mine, sig_peer, epoch; /* epoch: the LL epoch, or the chunked step */
  /* A mismatch: each side's bytes per block (KCCL_GPU_BYTES_UNKNOWN where the
   * wait saw only the peer's signature: the one-shot).  A chunked timeout: bytes_mine is
   * how many of the peer's blocks had begun the step, bytes_peer the step of
   * the peer's same block (record_chunked_timeout). */
  volatile uint32_t bytes_mine, bytes_peer;
  /* Where the failing wait was, for the message: the block, the grid's block
   * count, and the chunked kernels' flag stage (0, 1; -1: the one-shot / device API). */
  volatile int32_t block, grid, stage;
} kcclGpuStatus;

#endif
