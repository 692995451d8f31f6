// KcclBackend: torch.distributed's c10d::Backend over KCCL, for CPU and CUDA tensors.
//
// CPU tensors go to a KCCL host communicator (HostComm): every collective runs in
// the calling thread and is done when it returns, except an async all-reduce that
// fits KCCL's split phase, and sends / receives, which are pending until waited.
// CUDA tensors go to a KCCL GPU communicator (GpuComm), made on the first CUDA call
// of the group: collectives are enqueued on torch's current stream and return at
// once; reductions KCCL's GPU path lacks (other dtypes than float32 / float16 /
// bfloat16) and point-to-point go through host memory and the host communicator.
// Each collective is written once against Transport (backend.cpp: reductions;
// backend_moves.cpp: data movement; backend_p2p.cpp: point-to-point and the rooted
// and all-to-all collectives built on it).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <mutex>

#include "dtypes.h"
#include "gpu_comm.h"
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
  void startCoalescing() override;
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

  // For tests and tools: the split-phase all-reduces started so far; the rooted and
  // all-to-all collectives that went point-to-point.
  int64_t async_started() const { return async_started_; }
  int64_t p2p_collectives() const { return p2p_collectives_; }
  // Bytes per rank from which gather, scatter and all_to_all go point-to-point (tests set it).
  void set_p2p_min_bytes(int64_t bytes) { p2p_min_bytes_ = bytes; }
  // For bench/torch_small_cost.py: seconds for `iters` KCCL all-reduces of t (CPU, float32)
  // on the host communicator, without the backend around them.
  double time_host_allreduce(const at::Tensor& t, int64_t iters);
  // What the group's first collective on CUDA tensors of cuda:index does (for tests).
  void make_gpu_comm(int index) { gpu(c10::Device(c10::DeviceType::CUDA, (c10::DeviceIndex)index), "init"); }

 private:
  // The communicator for tensors on t's device (the GPU one is made on first use).
  Transport& transport(const at::Tensor& t, const char* what);
  GpuComm& gpu(c10::Device device, const char* what);
  // A Work for a collective that `t` has run: complete (host) or stream-ordered (GPU).
  c10::intrusive_ptr<c10d::Work> done(Transport& t, c10d::OpType type, std::vector<at::Tensor> outputs);
  void reduce_tensor(Transport& t, const at::Tensor& in, const at::Tensor& out, const c10d::ReduceOp& op,
                     const char* what);
  void reduce_scatter_tensor(Transport& t, const at::Tensor& in, const at::Tensor& out, const c10d::ReduceOp& op,
                             const char* what);
  void gather_bytes(Transport& t, const at::Tensor& in, const at::Tensor& flat, const char* what);
  void alltoallv_bytes(Transport& t, const at::Tensor& in, const std::vector<int64_t>& send_bytes,
                       const at::Tensor& out, const std::vector<int64_t>& recv_bytes, const char* what);
  // Point-to-point forms (CPU): each moves only the bytes its receiver needs.
  bool p2p_worth(const at::Tensor& t, int64_t bytes_per_rank) const;
  void gather_p2p(const at::Tensor& in, const std::vector<at::Tensor>& outs, int root);
  void scatter_p2p(const std::vector<at::Tensor>& ins, const at::Tensor& out, int root);
  void alltoall_p2p(const std::vector<at::Tensor>& ins, const std::vector<at::Tensor>& outs);
  c10::intrusive_ptr<c10d::Work> p2p_work(c10d::OpType type, std::vector<at::Tensor> outputs,
                                          std::shared_ptr<PendingOp> op);
  kcclUniqueId exchange_id(const std::string& key);

  c10::intrusive_ptr<c10d::Store> store_;
  kcclConfig_t config_;
  std::shared_ptr<HostComm> host_;
  std::mutex gpu_mu_;
  std::shared_ptr<GpuComm> gpu_;
  int gpu_tries_ = 0;
  std::chrono::milliseconds timeout_;
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<KcclWork>> coalesced_;  // sends / receives started while coalescing
  int64_t async_started_ = 0;
  int64_t p2p_collectives_ = 0;
  int64_t p2p_min_bytes_;
};

}  // namespace kccl_torch
