#include "work.h"

#include <ATen/core/jit_type.h>
#include <c10/core/StreamGuard.h>

#include "cuda_stream.h"

namespace kccl_torch {

namespace {

c10::intrusive_ptr<c10::ivalue::Future> new_future(std::vector<c10::Device> devices = {}) {
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()), std::move(devices));
}

void complete_future(const c10::intrusive_ptr<c10::ivalue::Future>& f, const std::vector<at::Tensor>& outputs,
            std::exception_ptr error) {
  if (error)
    f->setError(error);
  else
    f->markCompleted(c10::IValue(outputs));
}

// A future over several operations: settled once the last one finishes, with the first error.
struct Countdown {
  std::mutex mu;
  size_t left;
  std::exception_ptr error;
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  std::vector<at::Tensor> outputs;
  void one_done(std::exception_ptr e) {
    bool last;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (e && !error) error = e;
      last = --left == 0;
    }
    if (last) complete_future(fut, outputs, error);
  }
};

}  // namespace

KcclWork::KcclWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type), outputs_(std::move(outputs)) {}

KcclWork::KcclWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, std::shared_ptr<HostComm> comm,
                   std::vector<std::shared_ptr<PendingOp>> ops)
    : c10d::Work(rank, type), outputs_(std::move(outputs)), comm_(std::move(comm)) {
  for (auto& op : ops)
    if (!op->done) ops_.push_back(op);
  pending_ = !ops_.empty();
  record(ops);  // those already done: their errors and source
}

std::vector<std::shared_ptr<PendingOp>> KcclWork::pending_ops() const {
  std::lock_guard<std::mutex> lock(work_mu_);
  return ops_;
}

void KcclWork::record(const std::vector<std::shared_ptr<PendingOp>>& ops) {
  std::lock_guard<std::mutex> lock(work_mu_);
  for (const auto& op : ops) {
    if (!op->done) continue;
    if (op->error && !error_) error_ = op->error;
    if (op->kind == PendingOp::kP2P && op->source >= 0 && source_ < 0) source_ = op->source;
    ops_.erase(std::remove(ops_.begin(), ops_.end(), op), ops_.end());
  }
  if (ops_.empty()) {
    comm_.reset();
    pending_.store(false, std::memory_order_release);
  }
}

bool KcclWork::isCompleted() {
  if (!pending_.load(std::memory_order_acquire)) return true;
  std::shared_ptr<HostComm> comm;
  std::vector<std::shared_ptr<PendingOp>> ops;
  {
    std::lock_guard<std::mutex> lock(work_mu_);
    if (ops_.empty()) return true;
    comm = comm_;
    ops = ops_;
  }
  bool all = true;
  for (const auto& op : ops) all &= comm->test(op);
  record(ops);
  return all;
}

bool KcclWork::isSuccess() const {
  std::lock_guard<std::mutex> lock(work_mu_);
  return ops_.empty() && !error_;
}

std::exception_ptr KcclWork::exception() const {
  std::lock_guard<std::mutex> lock(work_mu_);
  return error_;
}

int KcclWork::sourceRank() const {
  std::lock_guard<std::mutex> lock(work_mu_);
  TORCH_CHECK(source_ >= 0, "kccl: sourceRank() of a Work that is not a completed receive");
  return source_;
}

bool KcclWork::wait(std::chrono::milliseconds /*timeout: KCCL_TIMEOUT_MS bounds every wait*/) {
  if (!pending_.load(std::memory_order_acquire)) {
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  std::shared_ptr<HostComm> comm;
  std::vector<std::shared_ptr<PendingOp>> ops;
  {
    std::lock_guard<std::mutex> lock(work_mu_);
    comm = comm_;
    ops = ops_;
  }
  for (const auto& op : ops) {
    try {
      comm->complete(op);
    } catch (...) {
      // op->error holds it; record() keeps it for exception() and the rethrow below
    }
  }
  record(ops);
  std::exception_ptr error = exception();
  if (error) std::rethrow_exception(error);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> KcclWork::getFuture() {
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  std::vector<std::shared_ptr<PendingOp>> ops;
  std::shared_ptr<HostComm> comm;
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(work_mu_);
    if (future_) return future_;
    future_ = fut = new_future();
    ops = ops_;
    comm = comm_;
    error = error_;
  }
  // Settled outside work_mu_: completing a future runs its callbacks, which may use this Work.
  if (ops.empty()) {
    complete_future(fut, outputs_, error);
    return fut;
  }
  auto count = std::make_shared<Countdown>();
  count->left = ops.size() + 1;  // + 1: released below, once every op is watched or found done
  count->error = error;
  count->fut = fut;
  count->outputs = outputs_;
  for (const auto& op : ops)
    if (!comm->watch(op, [count](std::exception_ptr e) { count->one_done(e); })) count->one_done(op->error);
  count->one_done(nullptr);
  return fut;
}

CudaWork::CudaWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, const c10::Stream& stream)
    : c10d::Work(rank, type), outputs_(std::move(outputs)), stream_(stream), done_(record_event(stream)) {}

bool CudaWork::isCompleted() { return done_.query(); }

bool CudaWork::wait(std::chrono::milliseconds) {
  synchronize();
  return true;
}

void CudaWork::synchronize() {
  const c10::Stream now = current_stream(stream_.device());
  if (now != stream_) done_.block(now);  // on the collective's own stream, stream order already waits
}

c10::intrusive_ptr<c10::ivalue::Future> CudaWork::getFuture() {
  std::lock_guard<std::mutex> lock(future_mu_);
  if (!future_) {
    // Marked complete on the collective's stream: a waiter's stream then waits for it there.
    c10::StreamGuard on(stream_);
    future_ = new_future({stream_.device()});
    future_->markCompleted(c10::IValue(outputs_));
  }
  return future_;
}

}  // namespace kccl_torch
