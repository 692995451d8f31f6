// The Works the backend returns.
//
// KcclWork (CPU tensors): blocking collectives return one already complete.  A
// split-phase all-reduce, or a send / receive, returns one that is pending until
// wait() (blocks in KCCL), is_completed() (polls) or anything else finishes its
// operations (see HostComm).  A batch of sends and receives (batch_isend_irecv)
// is one Work over several operations.  get_future() never blocks: on a pending
// Work its future is completed by whoever finishes the last operation, with the
// outputs or the first error.
//
// CudaWork (CUDA tensors): the collective is already enqueued on the stream that
// was current; an event recorded after it tells is_completed(), and wait() /
// synchronize() make the caller's current stream wait for it (no host wait), as
// NCCL's Works do.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "host_comm.h"

namespace kccl_torch {

class KcclWork : public c10d::Work {
 public:
  // Complete at once.
  KcclWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs);
  // Pending on operations of comm.
  KcclWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, std::shared_ptr<HostComm> comm,
           std::vector<std::shared_ptr<PendingOp>> ops);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override {}
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // The operations still pending (a batch's Work takes those of its members).
  std::vector<std::shared_ptr<PendingOp>> pending_ops() const;

 private:
  // ops have finished: keep the first error, let go of them and of the communicator.
  void record(const std::vector<std::shared_ptr<PendingOp>>& ops);

  // Guards the members below: torch may wait, poll and ask for the future from several
  // threads; never held across a call into the communicator.
  mutable std::mutex work_mu_;
  // false once no operation is pending (then error_ no longer changes): wait() and
  // is_completed() of a finished Work take no lock
  std::atomic<bool> pending_{false};
  const std::vector<at::Tensor> outputs_;
  std::shared_ptr<HostComm> comm_;  // null once finished
  std::vector<std::shared_ptr<PendingOp>> ops_;
  std::exception_ptr error_;
  int source_ = -1;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class CudaWork : public c10d::Work {
 public:
  // `stream`: where the collective was enqueued, just before.
  CudaWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, const c10::Stream& stream);

  bool isCompleted() override;
  bool isSuccess() const override { return true; }  // a failure on the GPU is raised by the group's next call
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  const std::vector<at::Tensor> outputs_;
  c10::Stream stream_;
  c10::Event done_;
  std::mutex future_mu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace kccl_torch
