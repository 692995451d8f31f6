#include "host_comm.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <thread>

namespace kccl_torch {

namespace {

using Callbacks = std::vector<std::pair<std::function<void(std::exception_ptr)>, std::exception_ptr>>;

// Callbacks touch Python objects (a .then() callback, the last reference to a tensor that
// has a Python object), which a thread other than Python's may not do once the
// interpreter is finalizing: it would be ended inside our frames.  quiesce_callbacks(),
// run by an atexit hook before that, stops new runs and waits for those under way;
// afterwards callbacks and what they hold are left alone (the process is ending).
std::atomic<bool> g_quiescing{false};
std::atomic<int> g_running{0};

void run_callbacks(Callbacks& ready) {
  if (ready.empty()) return;
  g_running.fetch_add(1);
  if (g_quiescing.load()) {
    g_running.fetch_sub(1);
    new Callbacks(std::move(ready));  // never freed, on purpose (see above)
    ready.clear();
    return;
  }
  for (auto& [fn, error] : ready) {
    try {
      fn(error);
    } catch (...) {
      // a future's completion has nowhere to report its own failure; the future itself carries it
    }
  }
  ready.clear();
  g_running.fetch_sub(1);
}

}  // namespace

void quiesce_callbacks(std::chrono::milliseconds bound) {
  g_quiescing.store(true);
  const auto until = std::chrono::steady_clock::now() + bound;
  while (g_running.load() > 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// mu_ for one call; on leaving it (by return or throw) the callbacks of the operations the
// call finished run on this thread, after mu_ is released.
class HostComm::Guard {
 public:
  explicit Guard(HostComm& c) : c_(c), lock_(c.mu_) {}
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

HostComm::HostComm(int rank, int size, const kcclUniqueId& id, const kcclConfig_t& config,
                   const kcclPlacement_t& placement)
    : rank_(rank),
      size_(size),
      buffer_bytes_(config.buffer_bytes),
      max_outstanding_(config.max_outstanding),
      timeout_ms_(config.timeout_ms) {
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
  if (rc == kcclInvalidArgument) C10_THROW_ERROR(ValueError, msg);
  C10_THROW_ERROR(DistBackendError, msg);  // a dead or mismatched peer, a timeout, the system
}

void HostComm::fail_through(uint64_t request, kcclResult_t rc, const char* what) {
  std::exception_ptr err;
  try {
    fail(rc, what);
  } catch (...) {
    err = std::current_exception();
  }
  finish_through(request, err);
}

kcclComm_t HostComm::handle(const char* what) {
  if (!comm_)
    C10_THROW_ERROR(DistBackendError, std::string("kccl: ") + what + " on rank " + std::to_string(rank_) +
                                          ": the communicator is " + why_closed_);
  return comm_;
}

void HostComm::finish_through(uint64_t request, std::exception_ptr error) {
  bool watched = false;
  while (!pending_.empty() && pending_.front()->request <= request) {
    PendingOp& op = *pending_.front();
    op.done = true;
    op.error = error;
    if (op.on_done) {
      ready_.emplace_back(std::move(op.on_done), error);
      op.on_done = nullptr;
      watched = true;
    }
    pending_.pop_front();
  }
  if (watched) completer_wake_.notify_all();
}

void HostComm::complete_locked(const std::shared_ptr<PendingOp>& op) {
  if (op->done) return;
  kcclComm_t c = handle("all_reduce (async) wait");
  kcclResult_t rc = api.kcclAllReduceWait(c, op->request);
  if (rc == kcclSuccess)
    finish_through(op->request, nullptr);
  else
    fail_through(op->request, rc, "all_reduce (async)");
}

void HostComm::drain_locked() {
  if (!pending_.empty()) complete_locked(pending_.back());
}

#define KCCL_TORCH_CALL(what, call)            \
  Guard guard(*this);                          \
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
  Guard guard(*this);
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
    Guard guard(*this);
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
  Guard guard(*this);
  return test_locked(op);
}

bool HostComm::test_locked(const std::shared_ptr<PendingOp>& op) {
  if (op->done) return true;
  if (!comm_) return false;  // complete() reports the closed communicator
  int done = 0;
  kcclResult_t rc = api.kcclAllReduceTest(comm_, op->request, &done);
  if (rc != kcclSuccess) {
    fail_through(op->request, rc, "all_reduce (async)");
    return true;
  }
  if (done) finish_through(op->request, nullptr);
  return done != 0;
}

bool HostComm::watch(const std::shared_ptr<PendingOp>& op, std::function<void(std::exception_ptr)> on_done) {
  std::lock_guard<std::mutex> lock(mu_);
  if (op->done) return false;
  if (!comm_) {  // closing finishes every outstanding op, so only an op of another communicator gets here
    op->done = true;
    try {
      handle("all_reduce (async) wait");
    } catch (...) {
      op->error = std::current_exception();
    }
    return false;
  }
  op->poll_until = timeout_ms_ > 0 ? std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms_)
                                   : std::chrono::steady_clock::time_point::max();
  if (!completer_running_) {
    // It holds this communicator until it ends, so it never outlives it; it waits for mu_ first.
    std::thread(&HostComm::complete_watched, shared_from_this()).detach();
    completer_running_ = true;
  }
  op->on_done = std::move(on_done);
  return true;
}

void HostComm::complete_watched() {
  // Polls with a pause that grows to 1 ms: a future finishes at most about 1 ms after its
  // all-reduce, and a thread that waits for a late peer costs next to nothing meanwhile.
  const auto first_pause = std::chrono::microseconds(20), longest_pause = std::chrono::microseconds(1000);
  auto pause = first_pause;
  Callbacks ready;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    // The oldest watched op: completion is in start order, so finishing it finishes every older one.
    std::shared_ptr<PendingOp> target;
    for (const auto& p : pending_)
      if (p->on_done) {
        target = p;
        break;
      }
    if (!target || !comm_) break;
    if (test_locked(target)) {
      pause = first_pause;
    } else if (std::chrono::steady_clock::now() >= target->poll_until) {
      complete_locked(target);  // a peer late past KCCL_TIMEOUT_MS: the wait itself times out
    } else {
      completer_wake_.wait_for(lock, pause);
      pause = std::min(pause * 2, longest_pause);
    }
    if (!ready_.empty()) {
      ready.swap(ready_);
      lock.unlock();
      run_callbacks(ready);
      lock.lock();
    }
  }
  completer_running_ = false;
  ready.swap(ready_);
  lock.unlock();
  run_callbacks(ready);
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
  Guard guard(*this);
  if (!comm_) return;
  api.kcclCommAbort(comm_);
  closed_locked("aborted");
}

void HostComm::destroy() {
  Guard guard(*this);
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
