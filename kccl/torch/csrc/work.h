// The Work a collective returns.  Blocking collectives return one already
// complete.  A split-phase all-reduce returns one that is pending until wait()
// (blocks in kcclAllReduceWait) or is_completed() (polls kcclAllReduceTest)
// finds the sum in the tensor, or until anything else finishes its operation
// (see HostComm).  get_future() never blocks: on a pending Work its future is
// completed by whoever finishes the operation, with the outputs or the error.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <mutex>
#include <vector>

#include "host_comm.h"

namespace kccl_torch {

class KcclWork : public c10d::Work {
 public:
  // Complete at once.
  KcclWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs);
  // Pending on a split-phase all-reduce of comm.
  KcclWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, std::shared_ptr<HostComm> comm,
           std::shared_ptr<PendingOp> op);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override {}
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  // The op still pending (null once this Work has seen it finish) and its communicator.
  std::pair<std::shared_ptr<PendingOp>, std::shared_ptr<HostComm>> pending() const;
  // op has finished: keep its error, let go of the communicator.
  void record(const std::shared_ptr<PendingOp>& op);

  // Guards the members below: torch may wait, poll and ask for the future from several
  // threads; never held across a call into the communicator.
  mutable std::mutex work_mu_;
  const std::vector<at::Tensor> outputs_;
  std::shared_ptr<HostComm> comm_;  // null once finished
  std::shared_ptr<PendingOp> op_;
  std::exception_ptr error_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace kccl_torch
