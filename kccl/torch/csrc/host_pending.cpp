// How HostComm's pending operations finish: completing and testing them, watching
// them for a future, the background thread, and running their callbacks.
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "host_comm.h"

namespace kccl_torch {

namespace {

// Callbacks touch Python objects (a .then() callback, the last reference to a tensor that
// has a Python object), which a thread other than Python's may not do once the
// interpreter is finalizing: it would be ended inside our frames.  quiesce_callbacks(),
// run by an atexit hook before that, stops new runs and waits for those under way;
// afterwards callbacks and what they hold are left alone (the process is ending).
std::atomic<bool> g_quiescing{false};
std::atomic<int> g_running{0};

}  // namespace

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

void quiesce_callbacks(std::chrono::milliseconds bound) {
  g_quiescing.store(true);
  const auto until = std::chrono::steady_clock::now() + bound;
  while (g_running.load() > 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

void HostComm::finish_op(PendingOp& op, std::exception_ptr error) {
  op.done = true;
  op.error = error;
  if (!error && op.on_data) {
    try {
      op.on_data();
    } catch (...) {
      op.error = std::current_exception();
    }
  }
  op.on_data = nullptr;
  if (op.on_done) {
    ready_.emplace_back(std::move(op.on_done), op.error);
    op.on_done = nullptr;
  }
}

void HostComm::finish_through(uint64_t request, std::exception_ptr error) {
  while (!pending_.empty() && pending_.front()->request <= request) {
    finish_op(*pending_.front(), error);
    pending_.pop_front();
  }
}

void HostComm::finish_p2p(const std::shared_ptr<PendingOp>& op, std::exception_ptr error) {
  finish_op(*op, error);
  p2p_.erase(std::remove(p2p_.begin(), p2p_.end(), op), p2p_.end());
}

void HostComm::complete_locked(const std::shared_ptr<PendingOp>& op) {
  if (op->done) return;
  kcclComm_t c = handle(op->kind == PendingOp::kP2P ? "send / recv wait" : "all_reduce (async) wait");
  if (op->kind == PendingOp::kP2P) {
    int source = -1;
    kcclResult_t rc = kcclP2PWait(c, op->request, &source);
    op->source = source;
    finish_p2p(op, rc == kcclSuccess ? nullptr : error_of(rc, "send / recv"));
    return;
  }
  kcclResult_t rc = kcclAllReduceWait(c, op->request);
  finish_through(op->request, rc == kcclSuccess ? nullptr : error_of(rc, "all_reduce (async)"));
}

void HostComm::drain_locked() {
  if (!pending_.empty()) complete_locked(pending_.back());
}

void HostComm::complete(const std::shared_ptr<PendingOp>& op) {
  {
    Guard guard(*this);
    if (!op->done) {
      if (!comm_) {
        op->done = true;
        try {
          handle("wait");
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
  if (op->kind == PendingOp::kP2P) {
    int source = -1;
    kcclResult_t rc = kcclP2PTest(comm_, op->request, &done, &source);
    if (rc != kcclSuccess) {
      finish_p2p(op, error_of(rc, "send / recv"));
      return true;
    }
    if (done) {
      op->source = source;
      finish_p2p(op, nullptr);
    }
    return done != 0;
  }
  kcclResult_t rc = kcclAllReduceTest(comm_, op->request, &done);
  if (rc != kcclSuccess) {
    finish_through(op->request, error_of(rc, "all_reduce (async)"));
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
      handle("wait");
    } catch (...) {
      op->error = std::current_exception();
    }
    return false;
  }
  op->poll_until = timeout_ms_ > 0 ? std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms_)
                                   : std::chrono::steady_clock::time_point::max();
  op->on_done = std::move(on_done);
  ensure_background_locked();
  return true;
}

void HostComm::ensure_background_locked() {
  if (background_running_) return;
  background_stop_ = false;
  // It holds this communicator until it ends, so it never outlives it; it waits for mu_ first.
  std::thread(&HostComm::background, shared_from_this()).detach();
  background_running_ = true;
}

void HostComm::background() {
  // It sleeps on a condition of its own and only tries mu_: a caller inside the communicator
  // is moving the operations itself, and a thread queued on mu_ would cost that caller a
  // wake-up when it lets go (and, on few cores, the core a peer needs).  Its pause grows
  // while nothing it does matters and shortens again when it moved pieces or finished a
  // watched operation (one that only a future waits for); it also does nothing when a
  // caller called in since its last look.  With nothing outstanding it lingers IDLE_LINGER
  // (a stream of operations then starts no thread per operation) and ends.
  const auto first_pause = std::chrono::microseconds(20), longest_pause = std::chrono::microseconds(1000);
  const std::chrono::microseconds idle_linger(100000);
  auto pause = first_pause;
  auto idle_since = std::chrono::steady_clock::time_point::max();
  uint64_t calls_seen = ~uint64_t(0);
  Callbacks ready;
  std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
  for (;;) {
    {
      std::unique_lock<std::mutex> sleep(background_mu_);
      background_wake_.wait_for(sleep, pause, [this] { return background_stop_.load(); });
    }
    pause = std::min(pause * 2, longest_pause);
    if (!lock.try_lock()) continue;
    const auto now = std::chrono::steady_clock::now();
    // The oldest watched all-reduce: completion is in start order, so finishing it finishes every older one.
    std::shared_ptr<PendingOp> target;
    for (const auto& p : pending_)
      if (p->on_done) {
        target = p;
        break;
      }
    bool moved = false;
    if (!comm_) {
      break;
    } else if (!target && p2p_.empty()) {
      if (idle_since == std::chrono::steady_clock::time_point::max()) idle_since = now;
      if (now - idle_since >= idle_linger) break;
    } else if (calls_ != calls_seen) {
      idle_since = std::chrono::steady_clock::time_point::max();
      calls_seen = calls_;
    } else {
      idle_since = std::chrono::steady_clock::time_point::max();
      if (target) {
        if (test_locked(target)) {
          moved = true;
        } else if (now >= target->poll_until) {
          complete_locked(target);  // a peer late past KCCL_TIMEOUT_MS: the wait itself times out
          moved = true;
        }
      }
      if (!p2p_.empty() && comm_) {
        int pieces = 0;
        if (kcclP2PProgress(comm_, &pieces) == kcclSuccess && pieces) moved = true;
        for (const auto& op : std::vector<std::shared_ptr<PendingOp>>(p2p_)) {
          if (!comm_) break;
          const bool watched = static_cast<bool>(op->on_done);
          if (test_locked(op)) {
            moved |= watched;
          } else if (watched && now >= op->poll_until) {
            complete_locked(op);
            moved = true;
          }
        }
      }
    }
    if (moved) pause = first_pause;
    ready.swap(ready_);
    lock.unlock();
    run_callbacks(ready);
  }
  background_running_ = false;  // under mu_: ensure_background_locked() starts a new one from here on
  ready.swap(ready_);
  lock.unlock();
  run_callbacks(ready);
}

void HostComm::closed_locked(const char* why) {
  comm_ = nullptr;
  why_closed_ = why;
  std::exception_ptr err;
  try {
    handle("wait");
  } catch (...) {
    err = std::current_exception();
  }
  finish_through(UINT64_MAX, err);
  for (const auto& op : std::vector<std::shared_ptr<PendingOp>>(p2p_)) finish_p2p(op, err);
  background_stop_ = true;
  background_wake_.notify_all();
}

}  // namespace kccl_torch
