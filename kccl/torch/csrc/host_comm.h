// One KCCL host communicator as the backend uses it: the calls of kccl.h behind
// a mutex (a communicator is one thread's at a time; torch may wait a Work from
// another thread), the split-phase all-reduces and point-to-point operations still
// outstanding, and kccl.h's result codes turned into torch's exceptions.
//
// Pending operations.  A split-phase all-reduce (kcclAllReduceStart) completes in
// start order; a send or receive (kcclSendStart / kcclRecvStart) whenever its
// pieces have moved.  Whoever finishes an operation (a Work's wait or poll, a later
// collective that completes it first, abort / destroy, or the background thread
// below) records its result, runs its on_data step (a receive's copy out of a
// staging buffer) and then, after releasing the mutex, its on_done callback (a
// torch future's completion), so that a callback may call the communicator again.
//
// The background thread runs while a future watches an operation or a send or
// receive is outstanding: nothing else would finish an operation whose only waiter
// is its future, and a send larger than its ring only moves when this rank calls
// into KCCL (a rank that computes, or waits in another library, would hold up its
// peer).  It polls with a pause that grows from 20 us to 1 ms while nothing moves,
// and ends when nothing is left.
#pragma once

#include <atomic>
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

#include "transport.h"

namespace kccl_torch {

// An operation not yet known to be complete.
struct PendingOp {
  enum Kind { kAllReduce, kP2P } kind = kAllReduce;
  uint64_t request = 0;
  bool done = false;
  int source = -1;  // a receive's sender, once done
  std::exception_ptr error;
  std::function<void()> on_data;
  std::shared_ptr<void> keep;  // what must live until the op is done (a staging tensor)
  // Set while a future watches this op: run once, with error, when it finishes.
  std::function<void(std::exception_ptr)> on_done;
  // Past this the background thread stops polling and waits (KCCL_TIMEOUT_MS bounds that).
  std::chrono::steady_clock::time_point poll_until;
};

using Callbacks = std::vector<std::pair<std::function<void(std::exception_ptr)>, std::exception_ptr>>;
// Runs (and clears) finished operations' callbacks, unless the interpreter is exiting.
void run_callbacks(Callbacks& ready);

// From here on, callbacks are no longer run (they and what they hold are leaked); waits up
// to `bound` for those running.  For the interpreter's exit (kccl/torch/__init__.py).
void quiesce_callbacks(std::chrono::milliseconds bound);

class HostComm : public Transport, public std::enable_shared_from_this<HostComm> {
 public:
  // Collective over the group: blocks until every rank joined or config.timeout_ms passed.
  HostComm(int rank, int size, const kcclUniqueId& id, const kcclConfig_t& config, const kcclPlacement_t& placement);
  ~HostComm() override;

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t buffer_bytes() const { return buffer_bytes_; }

  // Blocking collectives (each first completes every outstanding split-phase all-reduce).
  bool on_gpu() const override { return false; }
  bool reduces(kcclDataType_t) const override { return true; }
  void all_reduce(const void* send, void* recv, size_t count, kcclDataType_t type, kcclRedOp_t op,
                  const char* what) override;
  void all_gather(const void* send, void* recv, size_t sendcount, kcclDataType_t type, const char* what) override;
  void reduce_scatter(const void* send, void* recv, size_t recvcount, kcclDataType_t type, kcclRedOp_t op,
                      const char* what) override;
  void broadcast(const void* send, void* recv, size_t count, kcclDataType_t type, int root,
                 const char* what) override;
  void barrier(const char* what);

  // Split phase (one-shot, at most KCCL_BUFFER_BYTES; send may be reused on return).  When
  // KCCL_MAX_OUTSTANDING operations are already out, the oldest is completed first.
  std::shared_ptr<PendingOp> start_all_reduce(const void* send, void* recv, size_t count, kcclDataType_t type,
                                              kcclRedOp_t op);
  // Point-to-point: bytes of buf to / from `peer` (KCCL_ANY_SOURCE for a receive from any rank).
  std::shared_ptr<PendingOp> start_send(const void* buf, size_t bytes, int peer, int tag, const char* what);
  std::shared_ptr<PendingOp> start_recv(void* buf, size_t bytes, int peer, int tag, const char* what,
                                        std::function<void()> on_data = nullptr);

  // Completes op (an all-reduce: and every older one); rethrows the error that ended it.
  void complete(const std::shared_ptr<PendingOp>& op);
  // Never blocks: true once op has completed (then complete() returns at once).
  bool test(const std::shared_ptr<PendingOp>& op);
  // Never blocks: false when op has already finished (read op->error then); else on_done will run
  // once when it does, on whichever thread finishes it (see above).
  bool watch(const std::shared_ptr<PendingOp>& op, std::function<void(std::exception_ptr)> on_done);

  kcclResult_t async_error() override;
  void abort() override;
  void destroy() override;
  bool closed();

 private:
  [[noreturn]] void fail(kcclResult_t rc, const char* what);
  kcclComm_t handle(const char* what);  // with mu_ held
  void drain_locked();
  void complete_locked(const std::shared_ptr<PendingOp>& op);
  bool test_locked(const std::shared_ptr<PendingOp>& op);
  void background();  // the background thread's body
  void ensure_background_locked();
  // mu_ for one call; on leaving it (by return or throw) the callbacks of the operations the
  // call finished run on this thread, after mu_ is released.
  class Guard {
   public:
    explicit Guard(HostComm& c) : c_(c), lock_(c.mu_) { c_.calls_++; }
    ~Guard() {
      if (c_.ready_.empty()) return;
      Callbacks ready;
      ready.swap(c_.ready_);
      lock_.unlock();
      run_callbacks(ready);
    }

   private:
    HostComm& c_;
    std::unique_lock<std::mutex> lock_;
  };
  void finish_op(PendingOp& op, std::exception_ptr error);
  void finish_through(uint64_t request, std::exception_ptr error);
  void finish_p2p(const std::shared_ptr<PendingOp>& op, std::exception_ptr error);
  // The exception fail(rc, what) throws, as a value.
  std::exception_ptr error_of(kcclResult_t rc, const char* what);
  // The communicator is gone (abort / destroy): every outstanding Work fails, saying why.
  void closed_locked(const char* why);

  std::mutex mu_;
  kcclComm_t comm_ = nullptr;
  std::string why_closed_ = "never opened";
  int rank_, size_;
  size_t buffer_bytes_;
  int max_outstanding_;
  int timeout_ms_;
  std::deque<std::shared_ptr<PendingOp>> pending_;  // split-phase all-reduces, in start order
  std::vector<std::shared_ptr<PendingOp>> p2p_;     // sends and receives not yet seen complete
  // Callbacks of finished operations, run by whoever holds the Guard when it lets go of mu_.
  Callbacks ready_;
  bool background_running_ = false;  // under mu_
  // The background thread sleeps on these, not on mu_ (see host_pending.cpp).
  std::mutex background_mu_;
  std::condition_variable background_wake_;
  std::atomic<bool> background_stop_{false};
  // Calls by callers so far: the background thread stays out of the way of a caller that
  // called in since its last look (it would only contend for mu_).
  uint64_t calls_ = 0;
};

}  // namespace kccl_torch
