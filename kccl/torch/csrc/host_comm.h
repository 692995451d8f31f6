// One KCCL host communicator as the backend uses it: the calls of kccl.h behind
// a mutex (a communicator is one thread's at a time; torch may wait a Work from
// another thread), the split-phase all-reduces still outstanding, and kccl.h's
// result codes turned into torch's exceptions.  A GPU communicator (the CUDA
// half, later) is a sibling of this class with stream-ordered calls.
//
// Futures: an outstanding operation may carry an on_done callback (a torch
// future's completion).  Whoever finishes the operation (a Work's wait or poll,
// a later collective that completes it first, abort / destroy, or the completer
// thread below) runs the callback, always after releasing the mutex, so that a
// callback may call the communicator again.  Nothing else would finish an
// operation whose only waiter is its future, so watching one starts a completer
// thread that polls (kcclAllReduceTest, which also reports a dead peer, with a
// growing pause) until no watched operation is left, and then ends.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kccl_api.h"

namespace kccl_torch {

// A kcclAllReduceStart not yet known to be complete.
struct PendingOp {
  uint64_t request = 0;
  bool done = false;
  std::exception_ptr error;
  // Set while a future watches this op (see above): run once, with error, when it finishes.
  std::function<void(std::exception_ptr)> on_done;
  // Past this the completer stops polling and waits in kcclAllReduceWait, which KCCL_TIMEOUT_MS bounds.
  std::chrono::steady_clock::time_point poll_until;
};

// From here on, callbacks are no longer run (they and what they hold are leaked); waits up
// to `bound` for those running.  For the interpreter's exit (kccl/torch/__init__.py).
void quiesce_callbacks(std::chrono::milliseconds bound);

class HostComm : public std::enable_shared_from_this<HostComm> {
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
  // Never blocks: false when op has already finished (read op->error then); else on_done will run
  // once when it does, on whichever thread finishes it (see above).
  bool watch(const std::shared_ptr<PendingOp>& op, std::function<void(std::exception_ptr)> on_done);

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
  bool test_locked(const std::shared_ptr<PendingOp>& op);
  void complete_watched();  // the completer thread's body
  class Guard;              // mu_, then the callbacks of what finished meanwhile
  void finish_through(uint64_t request, std::exception_ptr error);
  // finish_through with the error that fail(rc, what) throws.
  void fail_through(uint64_t request, kcclResult_t rc, const char* what);
  // The communicator is gone (abort / destroy): every outstanding Work fails, saying why.
  void closed_locked(const char* why);

  std::mutex mu_;
  kcclComm_t comm_ = nullptr;
  std::string why_closed_ = "never opened";
  int rank_, size_;
  size_t buffer_bytes_;
  int max_outstanding_;
  int timeout_ms_;
  std::deque<std::shared_ptr<PendingOp>> pending_;
  // Callbacks of finished operations, run by whoever holds the Guard when it lets go of mu_.
  std::vector<std::pair<std::function<void(std::exception_ptr)>, std::exception_ptr>> ready_;
  bool completer_running_ = false;
  std::condition_variable completer_wake_;
};

}  // namespace kccl_torch
