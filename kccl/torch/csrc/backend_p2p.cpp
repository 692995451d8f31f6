// KcclBackend's point-to-point: send, recv, recv from any source (KCCL's kcclSendStart /
// kcclRecvStart on the host communicator, with torch's tags), their batches, and the
// point-to-point forms of gather, scatter and all-to-all.  CUDA tensors go through host
// memory: a send copies the tensor out when it starts (after the work already on the
// current stream), a receive lands in host memory and is copied to the device when it
// completes.
#include <c10/util/Exception.h>

#include <climits>

#include "backend.h"
#include "cuda_stream.h"
#include "tensors.h"

namespace kccl_torch {

namespace {

// Tags of the collectives built on point-to-point; users' tags stay above them.
constexpr int kTagGather = INT_MIN, kTagScatter = INT_MIN + 1, kTagAllToAll = INT_MIN + 2;
constexpr int kMinUserTag = INT_MIN + 16;

void check_peer(int peer, int size, int rank, const char* what) {
  TORCH_CHECK_VALUE(peer >= 0 && peer < size, "kccl: ", what, ": rank ", peer, " out of range for ", size, " ranks");
  TORCH_CHECK_VALUE(peer != rank, "kccl: ", what, ": rank ", peer, " is this rank");
}

void check_tag(int tag, const char* what) {
  TORCH_CHECK_VALUE(tag >= kMinUserTag, "kccl: ", what, ": tag ", tag, " is below ", kMinUserTag,
                    " (those are kccl's own)");
}

// Keeps a tensor alive until the operation that reads or writes it is done.
void hold(PendingOp& op, const at::Tensor& t) { op.keep = std::make_shared<at::Tensor>(t); }

}  // namespace

c10::intrusive_ptr<c10d::Work> KcclBackend::p2p_work(c10d::OpType type, std::vector<at::Tensor> outputs,
                                                     std::shared_ptr<PendingOp> op) {
  auto w = c10::make_intrusive<KcclWork>(rank_, type, std::move(outputs), host_,
                                         std::vector<std::shared_ptr<PendingOp>>{std::move(op)});
  if (coalescing_) coalesced_.push_back(w);
  return w;
}

c10::intrusive_ptr<c10d::Work> KcclBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  const at::Tensor& t = one(tensors, "send", "tensor");
  check_peer(dstRank, size_, rank_, "send");
  check_tag(tag, "send");
  at::Tensor s = t.device().is_cpu() ? dense(t) : t.to(at::kCPU);
  auto op = host_->start_send(s.data_ptr(), nbytes(s), dstRank, tag, "send");
  if (!op->done) hold(*op, s);
  return p2p_work(c10d::OpType::SEND, tensors, std::move(op));
}

// Into t when it is a contiguous CPU tensor, else into a host buffer copied into t when
// the message is complete.
static std::shared_ptr<PendingOp> start_recv_into(HostComm& host, const at::Tensor& t, int peer, int tag,
                                                  const char* what) {
  if (t.device().is_cpu() && t.is_contiguous()) {
    auto op = host.start_recv(t.data_ptr(), nbytes(t), peer, tag, what);
    hold(*op, t);
    return op;
  }
  if (!t.device().is_cpu()) current_stream(t.device()).synchronize();  // earlier GPU work on t is done first
  at::Tensor buf = at::empty(t.sizes(), t.options().device(at::kCPU));
  auto op = host.start_recv(buf.data_ptr(), nbytes(buf), peer, tag, what, [t, buf] { t.copy_(buf); });
  hold(*op, buf);
  return op;
}

c10::intrusive_ptr<c10d::Work> KcclBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  const at::Tensor& t = one(tensors, "recv", "tensor");
  check_peer(srcRank, size_, rank_, "recv");
  check_tag(tag, "recv");
  return p2p_work(c10d::OpType::RECV, tensors, start_recv_into(*host_, t, srcRank, tag, "recv"));
}

c10::intrusive_ptr<c10d::Work> KcclBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  const at::Tensor& t = one(tensors, "recv", "tensor");
  check_tag(tag, "recv");
  return p2p_work(c10d::OpType::RECVANYSOURCE, tensors, start_recv_into(*host_, t, KCCL_ANY_SOURCE, tag, "recv"));
}

// ---- gather, scatter, all-to-all, point-to-point ----------------------------------------

bool KcclBackend::p2p_worth(const at::Tensor& t, int64_t bytes_per_rank) const {
  return t.device().is_cpu() && size_ > 1 && bytes_per_rank >= p2p_min_bytes_;
}

static void complete_all(HostComm& host, const std::vector<std::shared_ptr<PendingOp>>& ops) {
  std::exception_ptr first;
  for (const auto& op : ops) {
    try {
      host.complete(op);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

void KcclBackend::gather_p2p(const at::Tensor& in, const std::vector<at::Tensor>& outs, int root) {
  p2p_collectives_++;
  at::Tensor s = dense(in);
  if (rank_ != root) {
    host_->complete(host_->start_send(s.data_ptr(), nbytes(s), root, kTagGather, "gather"));
    return;
  }
  std::vector<std::shared_ptr<PendingOp>> ops;
  for (int r = 0; r < size_; r++)
    if (r != root) ops.push_back(start_recv_into(*host_, outs[r], r, kTagGather, "gather"));
  outs[root].copy_(in);
  complete_all(*host_, ops);
}

void KcclBackend::scatter_p2p(const std::vector<at::Tensor>& ins, const at::Tensor& out, int root) {
  p2p_collectives_++;
  if (rank_ != root) {
    host_->complete(start_recv_into(*host_, out, root, kTagScatter, "scatter"));
    return;
  }
  std::vector<std::shared_ptr<PendingOp>> ops;
  std::vector<at::Tensor> keep;
  for (int r = 0; r < size_; r++) {
    if (r == root) continue;
    keep.push_back(dense(ins[r]));
    ops.push_back(host_->start_send(keep.back().data_ptr(), nbytes(keep.back()), r, kTagScatter, "scatter"));
  }
  out.copy_(ins[root]);
  complete_all(*host_, ops);
}

// ins[r] / outs[r]: the bytes for / from rank r (contiguous CPU byte tensors).
void KcclBackend::alltoall_p2p(const std::vector<at::Tensor>& ins, const std::vector<at::Tensor>& outs) {
  p2p_collectives_++;
  std::vector<std::shared_ptr<PendingOp>> ops;
  // receives first, so that every message finds its receive posted; sends from the next
  // rank on, so that the ranks do not all write to rank 0 first
  for (int i = 1; i < size_; i++) {
    int r = (rank_ - i + size_) % size_;
    ops.push_back(host_->start_recv(outs[r].data_ptr(), nbytes(outs[r]), r, kTagAllToAll, "all_to_all"));
  }
  for (int i = 1; i < size_; i++) {
    int r = (rank_ + i) % size_;
    ops.push_back(host_->start_send(ins[r].data_ptr(), nbytes(ins[r]), r, kTagAllToAll, "all_to_all"));
  }
  if (nbytes(ins[rank_])) outs[rank_].copy_(ins[rank_]);
  complete_all(*host_, ops);
}

}  // namespace kccl_torch
