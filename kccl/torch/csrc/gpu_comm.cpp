#include "gpu_comm.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "cuda_stream.h"

namespace kccl_torch {

GpuComm::GpuComm(int rank, int size, c10::Device device, const kcclUniqueId& id, kcclConfig_t config)
    : rank_(rank), device_(device) {
  config.device = device.index();
  // The GPU transport keeps its flags in device memory: no host replicas to place.
  kcclPlacement_t one{};
  one.size = sizeof one;
  one.ndomains = 1;
  for (auto& n : one.numaNode) n = -1;
  // The init makes device_ current; torch's current device is restored.  (A torch without
  // CUDA has no guard for it: then KCCL's init says what is missing.)
  c10::OptionalDeviceGuard guard;
  if (c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) guard.reset_device(device_);
  kcclComm_t c = nullptr;
  kcclResult_t rc = kcclCommInitRankPlacement(&c, size, id, rank, &config, &one);
  if (rc != kcclSuccess) throw_result(rc, rank_, "init of the GPU communicator");
  comm_ = c;
  why_closed_.clear();
}

GpuComm::~GpuComm() { destroy(); }

kcclComm_t GpuComm::handle(const char* what) {
  if (!comm_)
    C10_THROW_ERROR(DistBackendError, std::string("kccl: ") + what + " on rank " + std::to_string(rank_) +
                                          ": the GPU communicator is " + why_closed_);
  return comm_;
}

#define KCCL_TORCH_GPU_CALL(what, call)                     \
  std::lock_guard<std::mutex> lock(mu_);                   \
  kcclComm_t c = handle(what);                             \
  c10::DeviceGuard guard(device_);                         \
  void* stream = raw_stream(current_stream(device_));      \
  kcclResult_t rc = (call);                                \
  if (rc != kcclSuccess) throw_result(rc, rank_, what)

void GpuComm::all_reduce(const void* send, void* recv, size_t count, kcclDataType_t type, kcclRedOp_t op,
                         const char* what) {
  KCCL_TORCH_GPU_CALL(what, kcclAllReduce(send, recv, count, type, op, c, stream));
}

void GpuComm::all_gather(const void* send, void* recv, size_t sendcount, kcclDataType_t type, const char* what) {
  KCCL_TORCH_GPU_CALL(what, kcclAllGather(send, recv, sendcount, type, c, stream));
}

void GpuComm::reduce_scatter(const void* send, void* recv, size_t recvcount, kcclDataType_t type, kcclRedOp_t op,
                             const char* what) {
  KCCL_TORCH_GPU_CALL(what, kcclReduceScatter(send, recv, recvcount, type, op, c, stream));
}

void GpuComm::broadcast(const void* send, void* recv, size_t count, kcclDataType_t type, int root,
                        const char* what) {
  KCCL_TORCH_GPU_CALL(what, kcclBroadcast(send, recv, count, type, root, c, stream));
}

#undef KCCL_TORCH_GPU_CALL

kcclResult_t GpuComm::async_error() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!comm_) return kcclInvalidUsage;
  kcclResult_t e = kcclSuccess;
  kcclCommGetAsyncError(comm_, &e);
  return e;
}

void GpuComm::abort() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!comm_) return;
  kcclCommAbort(comm_);
  comm_ = nullptr;
  why_closed_ = "aborted";
}

void GpuComm::destroy() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!comm_) return;
  c10::DeviceGuard guard(device_);
  kcclCommDestroy(comm_);
  comm_ = nullptr;
  why_closed_ = "destroyed (destroy_process_group or shutdown)";
}

}  // namespace kccl_torch
