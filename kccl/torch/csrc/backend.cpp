#include "backend.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "dtypes.h"

namespace kccl_torch {

namespace {

void check_tensor(const at::Tensor& t, const char* coll, const char* what) {
  TORCH_CHECK_VALUE(t.defined(), "kccl: ", coll, ": ", what, " is an undefined tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu(), "kccl: ", coll, ": ", what, " is on ", t.device(),
                    "; this backend takes CPU tensors (for GPU tensors name a second backend: "
                    "init_process_group('cpu:kccl,cuda:nccl'))");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "kccl: ", coll, ": ", what, " has layout ", t.layout(),
                    "; only dense (strided) tensors are supported");
}

const at::Tensor& one(const std::vector<at::Tensor>& v, const char* coll, const char* what) {
  TORCH_CHECK_VALUE(v.size() == 1, "kccl: ", coll, " takes one ", what, " tensor, got ", v.size());
  check_tensor(v[0], coll, what);
  return v[0];
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* coll) {
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type(), "kccl: ", coll, ": tensors of ", a.scalar_type(), " and ",
                    b.scalar_type(), " (every tensor of a call needs one dtype)");
}

at::Tensor dense(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

size_t nbytes(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

// t as KCCL reads it under plan p: contiguous, of p's staging type (may share t's memory).
at::Tensor staged_input(const at::Tensor& t, const ReducePlan& p) {
  at::Tensor v = p.as_real ? at::view_as_real(t) : t;
  if (v.scalar_type() != p.staging) return v.to(p.staging).contiguous();
  return dense(v);
}

// Where KCCL writes a result meant for t under plan p: t's own memory when it can, else a
// buffer that finish() copies into t.
struct Output {
  at::Tensor view, buf;
  Output(const at::Tensor& t, const ReducePlan& p) {
    view = p.as_real ? at::view_as_real(t) : t;
    buf = (view.is_contiguous() && view.scalar_type() == p.staging)
              ? view
              : at::empty(view.sizes(), view.options().dtype(p.staging));
  }
  void finish() {
    if (buf.data_ptr() != view.data_ptr() || !view.is_contiguous()) view.copy_(buf);
  }
};

int64_t row_elems(const at::Tensor& t) {
  int64_t n = 1;
  for (int64_t d = 1; d < t.dim(); d++) n *= t.size(d);
  return n;
}

at::Tensor flatten_cat(const std::vector<at::Tensor>& parts, const ReducePlan* p) {
  std::vector<at::Tensor> flat;
  flat.reserve(parts.size());
  for (const auto& x : parts) {
    at::Tensor v = (p && p->as_real) ? at::view_as_real(x) : x;
    if (p && v.scalar_type() != p->staging) v = v.to(p->staging);
    flat.push_back(v.reshape({-1}));
  }
  return at::cat(flat);
}

}  // namespace

KcclBackend::KcclBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                         std::chrono::milliseconds timeout, const kcclConfig_t& config,
                         const kcclPlacement_t& placement)
    : c10d::Backend(rank, size), timeout_(timeout) {
  TORCH_CHECK(api_bound(), "kccl: the kccl.h table is not bound (import kccl.torch, which binds it)");
  kcclUniqueId id;
  static const std::string key = "kccl/unique_id";
  if (rank == 0) {
    kcclResult_t rc = api.kcclGetUniqueId(&id);
    if (rc != kcclSuccess)
      C10_THROW_ERROR(DistBackendError, std::string("kccl: rank 0 could not make a unique id: ") +
                                            api.kcclGetLastError(nullptr));
    store->set(key, std::vector<uint8_t>(id.internal, id.internal + sizeof id.internal));
  } else {
    try {
      store->wait({key}, timeout);
    } catch (const std::exception& e) {
      C10_THROW_ERROR(DistBackendError, "kccl: rank " + std::to_string(rank) + " waited " +
                                            std::to_string(timeout.count()) +
                                            " ms for rank 0's unique id in the store: " + e.what());
    }
    std::vector<uint8_t> v = store->get(key);
    TORCH_CHECK(v.size() == sizeof id.internal, "kccl: the unique id in the store has ", v.size(), " bytes, not ",
                sizeof id.internal);
    std::memcpy(id.internal, v.data(), v.size());
  }
  host_ = std::make_shared<HostComm>(rank, size, id, config, placement);
}

KcclBackend::~KcclBackend() = default;  // host_ goes with its last Work

c10::intrusive_ptr<c10d::Backend::Options> KcclBackend::getBackendOptions() {
  return c10::make_intrusive<Options>("kccl", timeout_);
}

c10::intrusive_ptr<c10d::Work> KcclBackend::done(c10d::OpType type, std::vector<at::Tensor> outputs) {
  return c10::make_intrusive<KcclWork>(rank_, type, std::move(outputs));
}

c10::intrusive_ptr<c10d::Work> KcclBackend::endCoalescing() {
  coalescing_ = false;
  return done(c10d::OpType::COALESCED, {});
}

c10d::ErrorType KcclBackend::getError() {
  kcclResult_t e = host_->async_error();
  if (e == kcclSuccess) return c10d::ErrorType::SUCCESS;
  if (e == kcclTimeout) return c10d::ErrorType::TIMEOUT;
  if (e == kcclRemoteError) return c10d::ErrorType::REMOTE_ERROR;
  return c10d::ErrorType::COMM_ERROR;
}

void KcclBackend::abort() { host_->abort(); }

void KcclBackend::shutdown() { host_->destroy(); }

// ---- reductions ---------------------------------------------------------------------

void KcclBackend::reduce_tensor(const at::Tensor& in, const at::Tensor& out, const c10d::ReduceOp& op,
                                const char* what) {
  const ReducePlan p = reduce_plan(in.scalar_type(), op, what);
  at::Tensor s = staged_input(in, p);
  if (in.is_same(out)) {
    // in place: s is in's memory when in is contiguous in its own type, else a copy to write back
    host_->all_reduce(s.data_ptr(), s.data_ptr(), s.numel(), p.type, p.op, what);
    at::Tensor v = p.as_real ? at::view_as_real(in) : in;
    if (s.data_ptr() != v.data_ptr() || !v.is_contiguous()) v.copy_(s);
    return;
  }
  Output o(out, p);
  host_->all_reduce(s.data_ptr(), o.buf.data_ptr(), s.numel(), p.type, p.op, what);
  o.finish();
}

c10::intrusive_ptr<c10d::Work> KcclBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) {
  const at::Tensor& t = one(tensors, "all_reduce", "input");
  const size_t nb = nbytes(t);
  // async_op=True: KCCL's split phase when the tensor fits one slot as it is; the sum
  // then lands while the caller computes, and Work.wait() collects it.
  if (opts.asyncOp && !coalescing_ && nb > 0 && nb <= host_->buffer_bytes() && t.is_contiguous()) {
    const ReducePlan p = reduce_plan(t.scalar_type(), opts.reduceOp, "all_reduce");
    if (p.direct()) {
      void* ptr = t.data_ptr();
      auto op = host_->start_all_reduce(ptr, ptr, t.numel(), p.type, p.op);
      async_started_++;
      return c10::make_intrusive<KcclWork>(rank_, c10d::OpType::ALLREDUCE, tensors, host_, std::move(op));
    }
  }
  reduce_tensor(t, t, opts.reduceOp, "all_reduce");
  return done(c10d::OpType::ALLREDUCE, tensors);
}

c10::intrusive_ptr<c10d::Work> KcclBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                const c10d::AllreduceCoalescedOptions& opts) {
  for (const auto& t : tensors) check_tensor(t, "all_reduce_coalesced", "input");
  for (const auto& t : tensors) reduce_tensor(t, t, opts.reduceOp, "all_reduce_coalesced");
  return done(c10d::OpType::ALLREDUCE_COALESCED, tensors);
}

// reduce: KCCL has no rooted reduce; an all-reduce whose result only the root keeps
// (the other ranks reduce into scratch, so their tensors stay as they were).
c10::intrusive_ptr<c10d::Work> KcclBackend::reduce(std::vector<at::Tensor>& tensors,
                                                   const c10d::ReduceOptions& opts) {
  const at::Tensor& t = one(tensors, "reduce", "input");
  TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "kccl: reduce: root ", opts.rootRank,
                    " out of range for ", size_, " ranks");
  if (rank_ == opts.rootRank) {
    reduce_tensor(t, t, opts.reduceOp, "reduce");
  } else {
    at::Tensor scratch = at::empty_like(t, at::MemoryFormat::Contiguous);
    reduce_tensor(t, scratch, opts.reduceOp, "reduce");
  }
  return done(c10d::OpType::REDUCE, tensors);
}

c10::intrusive_ptr<c10d::Work> KcclBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::ReduceScatterOptions& opts) {
  const char* what = "reduce_scatter_tensor";
  check_tensor(output, what, "output");
  check_tensor(input, what, "input");
  check_same(output, input, what);
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size_, "kccl: ", what, ": input has ", input.numel(),
                    " elements, needs world size x output = ", output.numel() * size_);
  const ReducePlan p = reduce_plan(input.scalar_type(), opts.reduceOp, what);
  at::Tensor s = staged_input(input, p);
  Output o(output, p);
  host_->reduce_scatter(s.data_ptr(), o.buf.data_ptr(), o.buf.numel(), p.type, p.op, what);
  o.finish();
  return done(c10d::OpType::_REDUCE_SCATTER_BASE, {output});
}

c10::intrusive_ptr<c10d::Work> KcclBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                           std::vector<std::vector<at::Tensor>>& inputs,
                                                           const c10d::ReduceScatterOptions& opts) {
  const char* what = "reduce_scatter";
  const at::Tensor& out = one(outputs, what, "output");
  TORCH_CHECK_VALUE(inputs.size() == 1 && (int)inputs[0].size() == size_, "kccl: ", what,
                    " takes one list of world-size (", size_, ") input tensors");
  for (const auto& x : inputs[0]) {
    check_tensor(x, what, "input");
    check_same(out, x, what);
    TORCH_CHECK_VALUE(x.numel() == out.numel(), "kccl: ", what, ": an input has ", x.numel(),
                      " elements, the output ", out.numel());
  }
  const ReducePlan p = reduce_plan(out.scalar_type(), opts.reduceOp, what);
  at::Tensor flat = flatten_cat(inputs[0], &p);
  Output o(out, p);
  host_->reduce_scatter(flat.data_ptr(), o.buf.data_ptr(), o.buf.numel(), p.type, p.op, what);
  o.finish();
  return done(c10d::OpType::REDUCE_SCATTER, outputs);
}

c10::intrusive_ptr<c10d::Work> KcclBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "kccl: reduce_scatter_tensor_coalesced: ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); i++) _reduce_scatter_base(outputs[i], inputs[i], opts);
  return done(c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED, outputs);
}

// ---- data movement (any dtype: bytes) -----------------------------------------------------

c10::intrusive_ptr<c10d::Work> KcclBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                      const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = one(tensors, "broadcast", "input");
  TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "kccl: broadcast: root ", opts.rootRank,
                    " out of range for ", size_, " ranks");
  at::Tensor s = dense(t);
  host_->broadcast(s.data_ptr(), s.data_ptr(), nbytes(s), kcclUint8, (int)opts.rootRank, "broadcast");
  if (!s.is_same(t)) t.copy_(s);
  return done(c10d::OpType::BROADCAST, tensors);
}

void KcclBackend::gather_bytes(const at::Tensor& in, at::Tensor& flat, const char* what) {
  at::Tensor s = dense(in);
  host_->all_gather(s.data_ptr(), flat.data_ptr(), nbytes(s), kcclUint8, what);
}

c10::intrusive_ptr<c10d::Work> KcclBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                            const c10d::AllgatherOptions&) {
  const char* what = "all_gather_into_tensor";
  check_tensor(output, what, "output");
  check_tensor(input, what, "input");
  check_same(output, input, what);
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size_, "kccl: ", what, ": output has ", output.numel(),
                    " elements, needs world size x input = ", input.numel() * size_);
  if (output.is_contiguous()) {
    gather_bytes(input, output, what);
  } else {
    at::Tensor flat = at::empty(output.sizes(), output.options());
    gather_bytes(input, flat, what);
    output.copy_(flat);
  }
  return done(c10d::OpType::_ALLGATHER_BASE, {output});
}

c10::intrusive_ptr<c10d::Work> KcclBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions&) {
  const char* what = "all_gather";
  const at::Tensor& in = one(inputs, what, "input");
  TORCH_CHECK_VALUE(outputs.size() == 1 && (int)outputs[0].size() == size_, "kccl: ", what,
                    " takes one list of world-size (", size_, ") output tensors");
  for (const auto& o : outputs[0]) {
    check_tensor(o, what, "output");
    check_same(o, in, what);
    TORCH_CHECK_VALUE(o.numel() == in.numel(), "kccl: ", what, ": an output has ", o.numel(),
                      " elements, the input ", in.numel());
  }
  const int64_t n = in.numel();
  at::Tensor flat = at::empty({n * size_}, in.options());
  gather_bytes(in, flat, what);
  for (int r = 0; r < size_; r++) outputs[0][r].copy_(flat.narrow(0, r * n, n).view(outputs[0][r].sizes()));
  return done(c10d::OpType::ALLGATHER, outputs[0]);
}

c10::intrusive_ptr<c10d::Work> KcclBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                std::vector<at::Tensor>& inputs,
                                                                const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "kccl: all_gather_coalesced: ", outputs.size(),
                    " output lists for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); i++) {
    std::vector<std::vector<at::Tensor>> o{outputs[i]};
    std::vector<at::Tensor> in{inputs[i]};
    allgather(o, in, opts);
  }
  return done(c10d::OpType::ALLGATHER_COALESCED, {});
}

c10::intrusive_ptr<c10d::Work> KcclBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                            std::vector<at::Tensor>& inputs,
                                                                            const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "kccl: allgather_into_tensor_coalesced: ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); i++) _allgather_base(outputs[i], inputs[i], opts);
  return done(c10d::OpType::ALLGATHER_COALESCED, outputs);
}

// gather: an all-gather whose result only the root keeps.
c10::intrusive_ptr<c10d::Work> KcclBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                   std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  const char* what = "gather";
  const at::Tensor& in = one(inputs, what, "input");
  TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "kccl: gather: root ", opts.rootRank,
                    " out of range for ", size_, " ranks");
  const bool root = rank_ == opts.rootRank;
  if (root) {
    TORCH_CHECK_VALUE(outputs.size() == 1 && (int)outputs[0].size() == size_, "kccl: gather: the root takes one "
                      "list of world-size (", size_, ") output tensors");
    for (const auto& o : outputs[0]) {
      check_tensor(o, what, "output");
      check_same(o, in, what);
      TORCH_CHECK_VALUE(o.numel() == in.numel(), "kccl: gather: an output has ", o.numel(),
                        " elements, the input ", in.numel());
    }
  }
  const int64_t n = in.numel();
  at::Tensor flat = at::empty({n * size_}, in.options());
  gather_bytes(in, flat, what);
  if (root)
    for (int r = 0; r < size_; r++) outputs[0][r].copy_(flat.narrow(0, r * n, n).view(outputs[0][r].sizes()));
  return done(c10d::OpType::GATHER, root ? outputs[0] : std::vector<at::Tensor>{});
}

// scatter: the root's inputs, concatenated, broadcast; every rank keeps its slice.
c10::intrusive_ptr<c10d::Work> KcclBackend::scatter(std::vector<at::Tensor>& outputs,
                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                    const c10d::ScatterOptions& opts) {
  const char* what = "scatter";
  const at::Tensor& out = one(outputs, what, "output");
  TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "kccl: scatter: root ", opts.rootRank,
                    " out of range for ", size_, " ranks");
  const bool root = rank_ == opts.rootRank;
  const int64_t n = out.numel();
  at::Tensor flat;
  if (root) {
    TORCH_CHECK_VALUE(inputs.size() == 1 && (int)inputs[0].size() == size_, "kccl: scatter: the root takes one "
                      "list of world-size (", size_, ") input tensors");
    for (const auto& x : inputs[0]) {
      check_tensor(x, what, "input");
      check_same(x, out, what);
      TORCH_CHECK_VALUE(x.numel() == n, "kccl: scatter: an input has ", x.numel(), " elements, the output ", n);
    }
    flat = flatten_cat(inputs[0], nullptr);
  } else {
    flat = at::empty({n * size_}, out.options());
  }
  host_->broadcast(flat.data_ptr(), flat.data_ptr(), nbytes(flat), kcclUint8, (int)opts.rootRank, what);
  out.copy_(flat.narrow(0, rank_ * n, n).view(out.sizes()));
  return done(c10d::OpType::SCATTER, outputs);
}

// all-to-all from all-gathers: first every rank's send and receive sizes (so that a
// mismatch is found, and raised, on every rank), then every rank's whole send buffer
// padded to the largest; each rank copies out the blocks addressed to it.  Moves
// world-size times the bytes a real all-to-all would: right for the small messages of
// inference, a known cost for large ones (docs/torch.md).
void KcclBackend::alltoallv_bytes(const uint8_t* in, const std::vector<int64_t>& send_bytes, uint8_t* out,
                                  const std::vector<int64_t>& recv_bytes, const char* what) {
  const int n = size_;
  std::vector<int64_t> mine(2 * n), all(2 * (size_t)n * n);
  std::copy(send_bytes.begin(), send_bytes.end(), mine.begin());
  std::copy(recv_bytes.begin(), recv_bytes.end(), mine.begin() + n);
  host_->all_gather(mine.data(), all.data(), 2 * n, kcclInt64, what);
  auto sends = [&](int s, int d) { return all[(size_t)s * 2 * n + d]; };
  auto expects = [&](int d, int s) { return all[(size_t)d * 2 * n + n + s]; };
  int64_t widest = 0;
  for (int s = 0; s < n; s++) {
    int64_t total = 0;
    for (int d = 0; d < n; d++) {
      TORCH_CHECK_VALUE(sends(s, d) == expects(d, s), "kccl: ", what, ": rank ", s, " sends ", sends(s, d),
                        " bytes to rank ", d, ", whose output split expects ", expects(d, s));
      total += sends(s, d);
    }
    widest = std::max(widest, total);
  }
  int64_t my_total = 0;
  for (int d = 0; d < n; d++) my_total += send_bytes[d];
  at::Tensor padded = at::empty({widest}, at::kByte);
  if (my_total) std::memcpy(padded.data_ptr(), in, my_total);
  at::Tensor flat = at::empty({widest * n}, at::kByte);
  host_->all_gather(padded.data_ptr(), flat.data_ptr(), widest, kcclUint8, what);
  const uint8_t* f = flat.data_ptr<uint8_t>();
  int64_t pos = 0;
  for (int s = 0; s < n; s++) {
    int64_t off = 0;
    for (int d = 0; d < rank_; d++) off += sends(s, d);
    if (sends(s, rank_)) std::memcpy(out + pos, f + (size_t)s * widest + off, sends(s, rank_));
    pos += sends(s, rank_);
  }
}

c10::intrusive_ptr<c10d::Work> KcclBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                          std::vector<int64_t>& outputSplits,
                                                          std::vector<int64_t>& inputSplits,
                                                          const c10d::AllToAllOptions&) {
  const char* what = "all_to_all_single";
  check_tensor(output, what, "output");
  check_tensor(input, what, "input");
  check_same(output, input, what);
  const int64_t es = input.element_size();
  auto splits = [&](const at::Tensor& t, std::vector<int64_t>& given, const char* which) {
    std::vector<int64_t> rows(size_);
    const int64_t dim0 = t.dim() ? t.size(0) : t.numel();
    if (given.empty()) {
      TORCH_CHECK_VALUE(dim0 % size_ == 0, "kccl: ", what, ": ", which, " has ", dim0,
                        " rows, not a multiple of the world size ", size_, " (pass split sizes)");
      std::fill(rows.begin(), rows.end(), dim0 / size_);
    } else {
      TORCH_CHECK_VALUE((int)given.size() == size_, "kccl: ", what, ": ", given.size(), " ", which,
                        " split sizes for ", size_, " ranks");
      int64_t sum = 0;
      for (auto r : given) {
        TORCH_CHECK_VALUE(r >= 0, "kccl: ", what, ": negative ", which, " split size ", r);
        sum += r;
      }
      TORCH_CHECK_VALUE(sum == dim0, "kccl: ", what, ": ", which, " split sizes add up to ", sum, ", the tensor has ",
                        dim0, " rows");
      rows = given;
    }
    std::vector<int64_t> bytes(size_);
    const int64_t rowb = (t.dim() ? row_elems(t) : 1) * es;
    for (int i = 0; i < size_; i++) bytes[i] = rows[i] * rowb;
    return bytes;
  };
  std::vector<int64_t> send = splits(input, inputSplits, "input"), recv = splits(output, outputSplits, "output");
  at::Tensor s = dense(input);
  at::Tensor o = output.is_contiguous() ? output : at::empty(output.sizes(), output.options());
  alltoallv_bytes(static_cast<const uint8_t*>(s.data_ptr()), send, static_cast<uint8_t*>(o.data_ptr()), recv, what);
  if (!o.is_same(output)) output.copy_(o);
  return done(c10d::OpType::ALLTOALL_BASE, {output});
}

c10::intrusive_ptr<c10d::Work> KcclBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                     const c10d::AllToAllOptions&) {
  const char* what = "all_to_all";
  TORCH_CHECK_VALUE((int)outputs.size() == size_ && (int)inputs.size() == size_, "kccl: ", what, " takes world-size (",
                    size_, ") lists of inputs and outputs, got ", inputs.size(), " and ", outputs.size());
  std::vector<int64_t> send(size_), recv(size_);
  int64_t recv_elems = 0;
  for (int i = 0; i < size_; i++) {
    check_tensor(inputs[i], what, "input");
    check_tensor(outputs[i], what, "output");
    check_same(inputs[i], inputs[0], what);
    check_same(outputs[i], inputs[0], what);
    send[i] = nbytes(inputs[i]);
    recv[i] = nbytes(outputs[i]);
    recv_elems += outputs[i].numel();
  }
  at::Tensor in = flatten_cat(inputs, nullptr);
  at::Tensor out = at::empty({recv_elems}, inputs[0].options());
  alltoallv_bytes(static_cast<const uint8_t*>(in.data_ptr()), send, static_cast<uint8_t*>(out.data_ptr()), recv, what);
  int64_t pos = 0;
  for (int i = 0; i < size_; i++) {
    const int64_t n = outputs[i].numel();
    outputs[i].copy_(out.narrow(0, pos, n).view(outputs[i].sizes()));
    pos += n;
  }
  return done(c10d::OpType::ALLTOALL, outputs);
}

c10::intrusive_ptr<c10d::Work> KcclBackend::barrier(const c10d::BarrierOptions&) {
  host_->barrier("barrier");
  return done(c10d::OpType::BARRIER, {});
}

// ---- refused ------------------------------------------------------------------------------

static const char* kNoP2P =
    " is not supported: KCCL has collectives only, no point-to-point; use a gloo group for "
    "send/recv (dist.new_group(backend='gloo')) beside the kccl one";

c10::intrusive_ptr<c10d::Work> KcclBackend::send(std::vector<at::Tensor>&, int, int) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "kccl: send", kNoP2P);
}

c10::intrusive_ptr<c10d::Work> KcclBackend::recv(std::vector<at::Tensor>&, int, int) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "kccl: recv", kNoP2P);
}

c10::intrusive_ptr<c10d::Work> KcclBackend::recvAnysource(std::vector<at::Tensor>&, int) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "kccl: recv from any source", kNoP2P);
}

}  // namespace kccl_torch
