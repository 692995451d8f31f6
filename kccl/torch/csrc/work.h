// The Work a collective returns.  Blocking collectives return one already
// complete.  A split-phase all-reduce returns one that is pending until wait()
// (blocks in kcclAllReduceWait) or is_completed() (polls kcclAllReduceTest)
// finds the sum in the tensor.  get_future() on a pending one completes it
// first: nothing else would drive a future that only its waiter watches, and a
// future that never completes would hang the waiter.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
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
  std::vector<at::Tensor> outputs_;
  std::shared_ptr<HostComm> comm_;  // null once finished
  std::shared_ptr<PendingOp> op_;
  std::exception_ptr error_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace kccl_torch
