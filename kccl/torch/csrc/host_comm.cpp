#include "host_comm.h"

#include <c10/util/Exception.h>

namespace kccl_torch {

HostComm::HostComm(int rank, int size, const kcclUniqueId& id, const kcclConfig_t& config,
                   const kcclPlacement_t& placement)
    : rank_(rank), size_(size), buffer_bytes_(config.buffer_bytes), max_outstanding_(config.max_outstanding) {
  kcclComm_t c = nullptr;
  kcclResult_t rc = api.kcclCommInitRankPlacement(&c, size, id, rank, &config, &placement);
  if (rc != kcclSuccess) fail(rc, "init");
  comm_ = c;
  why_closed_.clear();
}

HostComm::~HostComm() { destroy(); }

void HostComm::fail(kcclResult_t rc, const char* what) {
  std::string msg = std::string("kccl: ") + what + " failed on rank " + std::to_string(rank_) + ": " +
                    api.kcclGetLastError(nullptr) + " (" + api.kcclGetErrorString(rc) + ")";
  switch (rc) {
    case kcclInvalidArgument:
      C10_THROW_ERROR(ValueError, msg);
    case kcclRemoteError:
    case kcclTimeout:
    case kcclSystemError:
      C10_THROW_ERROR(DistBackendError, msg);
    default:
      C10_THROW_ERROR(DistBackendError, msg);
  }
}

kcclComm_t HostComm::handle(const char* what) {
  if (!comm_)
    C10_THROW_ERROR(DistBackendError, std::string("kccl: ") + what + " on rank " + std::to_string(rank_) +
                                          ": the communicator is " + why_closed_);
  return comm_;
}

void HostComm::finish_through(uint64_t request, std::exception_ptr error) {
  while (!pending_.empty() && pending_.front()->request <= request) {
    pending_.front()->done = true;
    pending_.front()->error = error;
    pending_.pop_front();
  }
}

void HostComm::complete_locked(const std::shared_ptr<PendingOp>& op) {
  if (op->done) return;
  kcclComm_t c = handle("all_reduce (async) wait");
  kcclResult_t rc = api.kcclAllReduceWait(c, op->request);
  if (rc == kcclSuccess) {
    finish_through(op->request, nullptr);
    return;
  }
  std::exception_ptr err;
  try {
    fail(rc, "all_reduce (async)");
  } catch (...) {
    err = std::current_exception();
  }
  finish_through(op->request, err);
}

void HostComm::drain_locked() {
  if (!pending_.empty()) complete_locked(pending_.back());
}

#define KCCL_TORCH_CALL(what, call)            \
  std::lock_guard<std::mutex> lock(mu_);       \
  kcclComm_t c = handle(what);                 \
  drain_locked();                              \
  kcclResult_t rc = (call);                    \
  if (rc != kcclSuccess) fail(rc, what)

void HostComm::all_reduce(const void* send, void* recv, size_t count, kcclDataType_t type, kcclRedOp_t op,
                          const char* what) {
  KCCL_TORCH_CALL(what, api.kcclAllReduce(send, recv, count, type, op, c, nullptr));
}

void HostComm::all_gather(const void* send, void* recv, size_t sendcount, kcclDataType_t type, const char* what) {
  KCCL_TORCH_CALL(what, api.kcclAllGather(send, recv, sendcount, type, c, nullptr));
}

void HostComm::reduce_scatter(const void* send, void* recv, size_t recvcount, kcclDataType_t type, kcclRedOp_t op,
                              const char* what) {
  KCCL_TORCH_CALL(what, api.kcclReduceScatter(send, recv, recvcount, type, op, c, nullptr));
}

void HostComm::broadcast(const void* send, void* recv, size_t count, kcclDataType_t type, int root,
                         const char* what) {
  KCCL_TORCH_CALL(what, api.kcclBroadcast(send, recv, count, type, root, c, nullptr));
}

void HostComm::barrier(const char* what) { KCCL_TORCH_CALL(what, api.kcclBarrier(c, nullptr)); }

#undef KCCL_TORCH_CALL

std::shared_ptr<PendingOp> HostComm::start_all_reduce(const void* send, void* recv, size_t count,
                                                      kcclDataType_t type, kcclRedOp_t op) {
  std::lock_guard<std::mutex> lock(mu_);
  kcclComm_t c = handle("all_reduce (async)");
  if ((int)pending_.size() >= max_outstanding_) complete_locked(pending_.front());
  auto p = std::make_shared<PendingOp>();
  kcclResult_t rc = api.kcclAllReduceStart(send, recv, count, type, op, c, &p->request);
  if (rc != kcclSuccess) fail(rc, "all_reduce (async start)");
  pending_.push_back(p);
  return p;
}

void HostComm::complete(const std::shared_ptr<PendingOp>& op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!op->done) {
      if (!comm_) {
        op->done = true;
        try {
          handle("all_reduce (async) wait");
        } catch (...) {
          op->error = std::current_exception();
        }
      } else {
        complete_locked(op);
      }
    }
  }
  if (op->error) std::rethrow_exception(op->error);
}

bool HostComm::test(const std::shared_ptr<PendingOp>& op) {
  std::lock_guard<std::mutex> lock(mu_);
  if (op->done) return true;
  if (!comm_) return false;  // complete() reports the closed communicator
  int done = 0;
  kcclResult_t rc = api.kcclAllReduceTest(comm_, op->request, &done);
  if (rc != kcclSuccess) {
    std::exception_ptr err;
    try {
      fail(rc, "all_reduce (async)");
    } catch (...) {
      err = std::current_exception();
    }
    finish_through(op->request, err);
    return true;
  }
  if (done) finish_through(op->request, nullptr);
  return done != 0;
}

kcclResult_t HostComm::async_error() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!comm_) return kcclInvalidUsage;
  kcclResult_t e = kcclSuccess;
  api.kcclCommGetAsyncError(comm_, &e);
  return e;
}

void HostComm::closed_locked(const char* why) {
  comm_ = nullptr;
  why_closed_ = why;
  std::exception_ptr err;
  try {
    handle("all_reduce (async)");
  } catch (...) {
    err = std::current_exception();
  }
  finish_through(UINT64_MAX, err);
}

void HostComm::abort() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!comm_) return;
  api.kcclCommAbort(comm_);
  closed_locked("aborted");
}

void HostComm::destroy() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!comm_) return;
  try {
    drain_locked();
  } catch (...) {
  }
  api.kcclCommDestroy(comm_);
  closed_locked("destroyed (destroy_process_group or shutdown)");
}

bool HostComm::closed() {
  std::lock_guard<std::mutex> lock(mu_);
  return comm_ == nullptr;
}

}  // namespace kccl_torch
