// One KCCL GPU communicator (config.device >= 0) as the backend uses it for CUDA
// tensors: every collective is enqueued on torch's current stream of the
// communicator's device and returns at once (nothing waits on the host, so a CUDA
// graph can capture it).  Several ranks of a group may share one GPU (under MPS).
// Calls go behind a mutex, as on the host: a communicator is one thread's at a time.
#pragma once

#include <c10/core/Device.h>

#include <mutex>
#include <string>

#include "transport.h"

namespace kccl_torch {

class GpuComm : public Transport {
 public:
  // Collective over the group: every rank joins with its own CUDA device.
  GpuComm(int rank, int size, c10::Device device, const kcclUniqueId& id, kcclConfig_t config);
  ~GpuComm() override;

  c10::Device device() const { return device_; }

  bool on_gpu() const override { return true; }
  bool reduces(kcclDataType_t type) const override {
    return type == kcclFloat32 || type == kcclFloat16 || type == kcclBfloat16;
  }
  void all_reduce(const void* send, void* recv, size_t count, kcclDataType_t type, kcclRedOp_t op,
                  const char* what) override;
  void all_gather(const void* send, void* recv, size_t sendcount, kcclDataType_t type, const char* what) override;
  void reduce_scatter(const void* send, void* recv, size_t recvcount, kcclDataType_t type, kcclRedOp_t op,
                      const char* what) override;
  void broadcast(const void* send, void* recv, size_t count, kcclDataType_t type, int root,
                 const char* what) override;
  kcclResult_t async_error() override;
  void abort() override;
  void destroy() override;

 private:
  kcclComm_t handle(const char* what);  // with mu_ held

  std::mutex mu_;
  kcclComm_t comm_ = nullptr;
  std::string why_closed_ = "never opened";
  int rank_;
  c10::Device device_;
};

}  // namespace kccl_torch
