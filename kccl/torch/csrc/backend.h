// KcclBackend: torch.distributed's c10d::Backend for CPU tensors over a KCCL host
// communicator.  Every collective runs in the calling thread and is done when it
// returns, except an async all-reduce that fits KCCL's split phase (see
// allreduce).  Collectives KCCL lacks are built from those it has (reduce,
// gather, scatter, all_to_all: see backend.cpp); point-to-point is refused.
// The CUDA half will add a GPU communicator beside host_ and pick by device.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>

#include "host_comm.h"
#include "work.h"

namespace kccl_torch {

class KcclBackend : public c10d::Backend {
 public:
  // config / placement: kcclConfig_t and kcclPlacement_t as the Python package resolved them
  // (KCCL_* settings, KCCL_TOPO).  The unique id travels through store (rank 0 sets it).
  KcclBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
              const kcclConfig_t& config, const kcclPlacement_t& placement);
  ~KcclBackend() override;

  const std::string getBackendName() const override { return "kccl"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override { coalescing_ = true; }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  c10d::ErrorType getError() override;
  void abort() override;
  void shutdown() override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  // For tests and tools: the split-phase all-reduces started so far.
  int64_t async_started() const { return async_started_; }

 private:
  c10::intrusive_ptr<c10d::Work> done(c10d::OpType type, std::vector<at::Tensor> outputs);
  void reduce_tensor(const at::Tensor& in, const at::Tensor& out, const c10d::ReduceOp& op, const char* what);
  void gather_bytes(const at::Tensor& in, at::Tensor& flat, const char* what);
  void alltoallv_bytes(const uint8_t* in, const std::vector<int64_t>& send_bytes, uint8_t* out,
                       const std::vector<int64_t>& recv_bytes, const char* what);

  std::shared_ptr<HostComm> host_;
  std::chrono::milliseconds timeout_;
  bool coalescing_ = false;
  int64_t async_started_ = 0;
};

}  // namespace kccl_torch
