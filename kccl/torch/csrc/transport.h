// What the backend's collectives run on: a KCCL communicator of the host transport
// (HostComm, CPU tensors, blocking) or of the GPU transport (GpuComm, CUDA tensors,
// enqueued on torch's current stream).  The backend writes each collective once,
// against this interface; the tensors it allocates take the device of the caller's.
#pragma once

#include <cstddef>
#include <string>

#include "kccl.h"

namespace kccl_torch {

class Transport {
 public:
  virtual ~Transport() = default;
  virtual bool on_gpu() const = 0;
  // Whether this transport reduces `type` itself (the GPU one: float32, float16, bfloat16).
  virtual bool reduces(kcclDataType_t type) const = 0;
  virtual void all_reduce(const void* send, void* recv, size_t count, kcclDataType_t type, kcclRedOp_t op,
                          const char* what) = 0;
  virtual void all_gather(const void* send, void* recv, size_t sendcount, kcclDataType_t type, const char* what) = 0;
  virtual void reduce_scatter(const void* send, void* recv, size_t recvcount, kcclDataType_t type, kcclRedOp_t op,
                              const char* what) = 0;
  virtual void broadcast(const void* send, void* recv, size_t count, kcclDataType_t type, int root,
                         const char* what) = 0;
  // kcclSuccess while usable.
  virtual kcclResult_t async_error() = 0;
  // Local and immediate: peers blocked with this rank fail.
  virtual void abort() = 0;
  // Completes what is outstanding (errors swallowed), then releases the communicator.
  virtual void destroy() = 0;
};

// kccl.h's result as torch's exception: ValueError for a bad argument, DistBackendError
// (a RuntimeError) for a dead or mismatched peer, a timeout or the system.
[[noreturn]] void throw_result(kcclResult_t rc, int rank, const char* what);

}  // namespace kccl_torch
