#include "work.h"

#include <ATen/core/jit_type.h>

namespace kccl_torch {

namespace {

c10::intrusive_ptr<c10::ivalue::Future> new_future() {
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}

void settle(const c10::intrusive_ptr<c10::ivalue::Future>& f, const std::vector<at::Tensor>& outputs,
            std::exception_ptr error) {
  if (error)
    f->setError(error);
  else
    f->markCompleted(c10::IValue(outputs));
}

}  // namespace

KcclWork::KcclWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type), outputs_(std::move(outputs)) {}

KcclWork::KcclWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, std::shared_ptr<HostComm> comm,
                   std::shared_ptr<PendingOp> op)
    : c10d::Work(rank, type), outputs_(std::move(outputs)), comm_(std::move(comm)), op_(std::move(op)) {}

std::pair<std::shared_ptr<PendingOp>, std::shared_ptr<HostComm>> KcclWork::pending() const {
  std::lock_guard<std::mutex> lock(work_mu_);
  return {op_, comm_};
}

void KcclWork::record(const std::shared_ptr<PendingOp>& op) {
  std::lock_guard<std::mutex> lock(work_mu_);
  if (op_ != op) return;  // another thread recorded it first
  error_ = op->error;
  op_.reset();
  comm_.reset();
}

bool KcclWork::isCompleted() {
  auto [op, comm] = pending();
  if (!op) return true;
  if (!comm->test(op)) return false;
  record(op);
  return true;
}

bool KcclWork::isSuccess() const {
  std::lock_guard<std::mutex> lock(work_mu_);
  return !op_ && !error_;
}

std::exception_ptr KcclWork::exception() const {
  std::lock_guard<std::mutex> lock(work_mu_);
  return error_;
}

bool KcclWork::wait(std::chrono::milliseconds /*timeout: KCCL_TIMEOUT_MS bounds every wait*/) {
  auto [op, comm] = pending();
  if (op) {
    try {
      comm->complete(op);
    } catch (...) {
      // op->error holds it; record() keeps it for exception() and the rethrow below
    }
    record(op);
  }
  std::exception_ptr error = exception();
  if (error) std::rethrow_exception(error);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> KcclWork::getFuture() {
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  std::shared_ptr<PendingOp> op;
  std::shared_ptr<HostComm> comm;
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(work_mu_);
    if (future_) return future_;
    future_ = fut = new_future();
    op = op_;
    comm = comm_;
    error = error_;
  }
  // Settled outside work_mu_: completing a future runs its callbacks, which may use this Work.
  if (op) {
    if (comm->watch(op, [fut, outputs = outputs_](std::exception_ptr e) { settle(fut, outputs, e); })) return fut;
    error = op->error;  // it finished before it could be watched
  }
  settle(fut, outputs_, error);
  return fut;
}

}  // namespace kccl_torch
