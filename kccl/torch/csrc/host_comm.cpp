// HostComm's calls into kccl.h: init, the blocking collectives, the starts of
// split-phase all-reduces and point-to-point operations, abort and destroy.  How
// pending operations finish is in host_pending.cpp.
#include "host_comm.h"

#include <c10/util/Exception.h>

namespace kccl_torch {

void throw_result(kcclResult_t rc, int rank, const char* what) {
  std::string msg = std::string("kccl: ") + what + " failed on rank " + std::to_string(rank) + ": " +
                    kcclGetLastError(nullptr) + " (" + kcclGetErrorString(rc) + ")";
  if (rc == kcclInvalidArgument) C10_THROW_ERROR(ValueError, msg);
  C10_THROW_ERROR(DistBackendError, msg);
}

HostComm::HostComm(int rank, int size, const kcclUniqueId& id, const kcclConfig_t& config,
                   const kcclPlacement_t& placement)
    : rank_(rank),
      size_(size),
      buffer_bytes_(config.buffer_bytes),
      max_outstanding_(config.max_outstanding),
      timeout_ms_(config.timeout_ms) {
  kcclComm_t c = nullptr;
  kcclResult_t rc = kcclCommInitRankPlacement(&c, size, id, rank, &config, &placement);
  if (rc != kcclSuccess) fail(rc, "init");
  comm_ = c;
  why_closed_.clear();
}

HostComm::~HostComm() { destroy(); }

void HostComm::fail(kcclResult_t rc, const char* what) { throw_result(rc, rank_, what); }

std::exception_ptr HostComm::error_of(kcclResult_t rc, const char* what) {
  try {
    fail(rc, what);
  } catch (...) {
    return std::current_exception();
  }
}

kcclComm_t HostComm::handle(const char* what) {
  if (!comm_)
    C10_THROW_ERROR(DistBackendError, std::string("kccl: ") + what + " on rank " + std::to_string(rank_) +
                                          ": the communicator is " + why_closed_);
  return comm_;
}

#define KCCL_TORCH_CALL(what, call)            \
  Guard guard(*this);                          \
  kcclComm_t c = handle(what);                 \
  drain_locked();                              \
  kcclResult_t rc = (call);                    \
  if (rc != kcclSuccess) fail(rc, what)

void HostComm::all_reduce(const void* send, void* recv, size_t count, kcclDataType_t type, kcclRedOp_t op,
                          const char* what) {
  KCCL_TORCH_CALL(what, kcclAllReduce(send, recv, count, type, op, c, nullptr));
}

void HostComm::all_gather(const void* send, void* recv, size_t sendcount, kcclDataType_t type, const char* what) {
  KCCL_TORCH_CALL(what, kcclAllGather(send, recv, sendcount, type, c, nullptr));
}

void HostComm::reduce_scatter(const void* send, void* recv, size_t recvcount, kcclDataType_t type, kcclRedOp_t op,
                              const char* what) {
  KCCL_TORCH_CALL(what, kcclReduceScatter(send, recv, recvcount, type, op, c, nullptr));
}

void HostComm::broadcast(const void* send, void* recv, size_t count, kcclDataType_t type, int root,
                         const char* what) {
  KCCL_TORCH_CALL(what, kcclBroadcast(send, recv, count, type, root, c, nullptr));
}

void HostComm::barrier(const char* what) { KCCL_TORCH_CALL(what, kcclBarrier(c, nullptr)); }

#undef KCCL_TORCH_CALL

std::shared_ptr<PendingOp> HostComm::start_all_reduce(const void* send, void* recv, size_t count,
                                                      kcclDataType_t type, kcclRedOp_t op) {
  Guard guard(*this);
  kcclComm_t c = handle("all_reduce (async)");
  if ((int)pending_.size() >= max_outstanding_) complete_locked(pending_.front());
  auto p = std::make_shared<PendingOp>();
  kcclResult_t rc = kcclAllReduceStart(send, recv, count, type, op, c, &p->request);
  if (rc != kcclSuccess) fail(rc, "all_reduce (async start)");
  pending_.push_back(p);
  return p;
}

std::shared_ptr<PendingOp> HostComm::start_send(const void* buf, size_t bytes, int peer, int tag, const char* what) {
  Guard guard(*this);
  kcclComm_t c = handle(what);
  auto p = std::make_shared<PendingOp>();
  p->kind = PendingOp::kP2P;
  kcclResult_t rc = kcclSendStart(buf, bytes, kcclUint8, peer, tag, c, &p->request);
  if (rc != kcclSuccess) fail(rc, what);
  // A message that fits the ring's free slots is all there now: done, nothing to keep moving.
  int done = 0;
  rc = kcclP2PTest(c, p->request, &done, nullptr);
  if (rc != kcclSuccess) fail(rc, what);
  if (done) {
    p->done = true;
    return p;
  }
  p2p_.push_back(p);
  ensure_background_locked();
  return p;
}

std::shared_ptr<PendingOp> HostComm::start_recv(void* buf, size_t bytes, int peer, int tag, const char* what,
                                                std::function<void()> on_data) {
  Guard guard(*this);
  kcclComm_t c = handle(what);
  auto p = std::make_shared<PendingOp>();
  p->kind = PendingOp::kP2P;
  p->on_data = std::move(on_data);
  kcclResult_t rc = kcclRecvStart(buf, bytes, kcclUint8, peer, tag, c, &p->request);
  if (rc != kcclSuccess) fail(rc, what);
  p2p_.push_back(p);
  ensure_background_locked();
  return p;
}

kcclResult_t HostComm::async_error() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!comm_) return kcclInvalidUsage;
  kcclResult_t e = kcclSuccess;
  kcclCommGetAsyncError(comm_, &e);
  return e;
}

void HostComm::abort() {
  Guard guard(*this);
  if (!comm_) return;
  kcclCommAbort(comm_);
  closed_locked("aborted");
}

void HostComm::destroy() {
  Guard guard(*this);
  if (!comm_) return;
  try {
    drain_locked();
  } catch (...) {
  }
  kcclCommDestroy(comm_);
  closed_locked("destroyed (destroy_process_group or shutdown)");
}

bool HostComm::closed() {
  std::lock_guard<std::mutex> lock(mu_);
  return comm_ == nullptr;
}

}  // namespace kccl_torch
