// One KCCL host communicator as the backend uses it: the calls of kccl.h behind
// a mutex (a communicator is one thread's at a time; torch may wait a Work from
// another thread), the split-phase all-reduces still outstanding, and kccl.h's
// result codes turned into torch's exceptions.  A GPU communicator (the CUDA
// half, later) is a sibling of this class with stream-ordered calls.
#pragma once

#include <chrono>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>

#include "kccl_api.h"

namespace kccl_torch {

// A kcclAllReduceStart not yet known to be complete.
struct PendingOp {
  uint64_t request = 0;
  bool done = false;
  std::exception_ptr error;
};

class HostComm {
 public:
  // Collective over the group: blocks until every rank joined or config.timeout_ms passed.
  HostComm(int rank, int size, const kcclUniqueId& id, const kcclConfig_t& config, const kcclPlacement_t& placement);
  ~HostComm();

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t buffer_bytes() const { return buffer_bytes_; }

  // Blocking collectives (each first completes every outstanding split-phase all-reduce).
  void all_reduce(const void* send, void* recv, size_t count, kcclDataType_t type, kcclRedOp_t op, const char* what);
  void all_gather(const void* send, void* recv, size_t sendcount, kcclDataType_t type, const char* what);
  void reduce_scatter(const void* send, void* recv, size_t recvcount, kcclDataType_t type, kcclRedOp_t op,
                      const char* what);
  void broadcast(const void* send, void* recv, size_t count, kcclDataType_t type, int root, const char* what);
  void barrier(const char* what);

  // Split phase (one-shot, at most KCCL_BUFFER_BYTES; send may be reused on return).  When
  // KCCL_MAX_OUTSTANDING operations are already out, the oldest is completed first.
  std::shared_ptr<PendingOp> start_all_reduce(const void* send, void* recv, size_t count, kcclDataType_t type,
                                              kcclRedOp_t op);
  // Completes op and every older one (rethrows the error that ended op, if any).
  void complete(const std::shared_ptr<PendingOp>& op);
  // Never blocks: true once op has completed (then complete() returns at once).
  bool test(const std::shared_ptr<PendingOp>& op);

  // kcclSuccess while usable.
  kcclResult_t async_error();
  // Local and immediate: peers blocked with this rank fail; outstanding operations fail.
  void abort();
  // Completes what is outstanding (errors swallowed), then releases the communicator.
  void destroy();
  bool closed();

 private:
  [[noreturn]] void fail(kcclResult_t rc, const char* what);
  kcclComm_t handle(const char* what);  // with mu_ held
  void drain_locked();
  void complete_locked(const std::shared_ptr<PendingOp>& op);
  void finish_through(uint64_t request, std::exception_ptr error);
  // The communicator is gone (abort / destroy): every outstanding Work fails, saying why.
  void closed_locked(const char* why);

  std::mutex mu_;
  kcclComm_t comm_ = nullptr;
  std::string why_closed_ = "never opened";
  int rank_, size_;
  size_t buffer_bytes_;
  int max_outstanding_;
  std::deque<std::shared_ptr<PendingOp>> pending_;
};

}  // namespace kccl_torch
