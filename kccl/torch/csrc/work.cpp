#include "work.h"

#include <ATen/core/jit_type.h>

namespace kccl_torch {

KcclWork::KcclWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type), outputs_(std::move(outputs)) {}

KcclWork::KcclWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, std::shared_ptr<HostComm> comm,
                   std::shared_ptr<PendingOp> op)
    : c10d::Work(rank, type), outputs_(std::move(outputs)), comm_(std::move(comm)), op_(std::move(op)) {}

bool KcclWork::isCompleted() {
  if (!op_) return true;
  if (!comm_->test(op_)) return false;
  error_ = op_->error;
  op_.reset();
  comm_.reset();
  return true;
}

bool KcclWork::isSuccess() const { return !op_ && !error_; }

std::exception_ptr KcclWork::exception() const { return error_; }

bool KcclWork::wait(std::chrono::milliseconds /*timeout: KCCL_TIMEOUT_MS bounds every wait*/) {
  if (op_) {
    try {
      comm_->complete(op_);
    } catch (...) {
      error_ = std::current_exception();
    }
    op_.reset();
    comm_.reset();
  }
  if (error_) std::rethrow_exception(error_);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> KcclWork::getFuture() {
  if (!future_) {
    if (op_) {
      try {
        wait();
      } catch (...) {
      }
    }
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    if (error_)
      future_->setError(error_);
    else
      future_->markCompleted(c10::IValue(outputs_));
  }
  return future_;
}

}  // namespace kccl_torch
