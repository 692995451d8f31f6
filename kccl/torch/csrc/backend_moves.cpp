// KcclBackend's data-moving collectives (any dtype: they move bytes): broadcast, the
// all-gather family, barrier, and gather / scatter / all-to-all as KCCL collectives
// (the point-to-point forms, for larger messages on the CPU, are in backend_p2p.cpp).
#include <c10/util/Exception.h>

#include <algorithm>

#include "backend.h"
#include "tensors.h"

namespace kccl_torch {

c10::intrusive_ptr<c10d::Work> KcclBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                      const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = one(tensors, "broadcast", "input");
  TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "kccl: broadcast: root ", opts.rootRank,
                    " out of range for ", size_, " ranks");
  Transport& tr = transport(t, "broadcast");
  at::Tensor s = dense(t);
  tr.broadcast(s.data_ptr(), s.data_ptr(), nbytes(s), kcclUint8, (int)opts.rootRank, "broadcast");
  if (!s.is_same(t)) t.copy_(s);
  return done(tr, c10d::OpType::BROADCAST, tensors);
}

// flat (world size x in's bytes, on in's device) gets every rank's in, in rank order.
void KcclBackend::gather_bytes(Transport& t, const at::Tensor& in, const at::Tensor& flat, const char* what) {
  at::Tensor s = dense(in);
  t.all_gather(s.data_ptr(), flat.data_ptr(), nbytes(s), kcclUint8, what);
}

c10::intrusive_ptr<c10d::Work> KcclBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                            const c10d::AllgatherOptions&) {
  const char* what = "all_gather_into_tensor";
  check_tensor(output, what, "output");
  check_tensor(input, what, "input");
  check_same(output, input, what);
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size_, "kccl: ", what, ": output has ", output.numel(),
                    " elements, needs world size x input = ", input.numel() * size_);
  Transport& tr = transport(output, what);
  if (output.is_contiguous()) {
    gather_bytes(tr, input, output, what);
  } else {
    at::Tensor flat = at::empty(output.sizes(), output.options());
    gather_bytes(tr, input, flat, what);
    output.copy_(flat);
  }
  return done(tr, c10d::OpType::_ALLGATHER_BASE, {output});
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
  Transport& tr = transport(in, what);
  at::Tensor flat = at::empty({(int64_t)nbytes(in) * size_}, in.options().dtype(at::kByte));
  gather_bytes(tr, in, flat, what);
  split_bytes(flat, outputs[0]);
  return done(tr, c10d::OpType::ALLGATHER, outputs[0]);
}

// torch's layout, as gloo's: outputs[r][i] receives rank r's inputs[i].  One KCCL
// all-gather of every input's bytes back to back.
c10::intrusive_ptr<c10d::Work> KcclBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                std::vector<at::Tensor>& inputs,
                                                                const c10d::AllgatherOptions&) {
  const char* what = "all_gather_coalesced";
  TORCH_CHECK_VALUE(!inputs.empty(), "kccl: ", what, " takes at least one input tensor");
  TORCH_CHECK_VALUE((int)outputs.size() == size_, "kccl: ", what, " takes world-size (", size_,
                    ") output lists (output_tensor_lists[rank][input]), got ", outputs.size());
  for (const auto& x : inputs) {
    check_tensor(x, what, "input");
    check_device(x, inputs[0], what);
  }
  for (int r = 0; r < size_; r++) {
    TORCH_CHECK_VALUE(outputs[r].size() == inputs.size(), "kccl: ", what, ": output list ", r, " has ",
                      outputs[r].size(), " tensors for ", inputs.size(), " inputs");
    for (size_t i = 0; i < inputs.size(); i++) {
      check_tensor(outputs[r][i], what, "output");
      check_same(outputs[r][i], inputs[i], what);
      TORCH_CHECK_VALUE(outputs[r][i].numel() == inputs[i].numel(), "kccl: ", what, ": output [", r, "][", i,
                        "] has ", outputs[r][i].numel(), " elements, input ", i, " has ", inputs[i].numel());
    }
  }
  Transport& tr = transport(inputs[0], what);
  at::Tensor in = cat_bytes(inputs);
  const int64_t b = in.numel();
  at::Tensor flat = at::empty({b * size_}, in.options());
  gather_bytes(tr, in, flat, what);
  std::vector<at::Tensor> all;
  for (int r = 0; r < size_; r++) {
    split_bytes(flat.narrow(0, r * b, b), outputs[r]);
    all.insert(all.end(), outputs[r].begin(), outputs[r].end());
  }
  return done(tr, c10d::OpType::ALLGATHER_COALESCED, std::move(all));
}

c10::intrusive_ptr<c10d::Work> KcclBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                            std::vector<at::Tensor>& inputs,
                                                                            const c10d::AllgatherOptions& opts) {
  const char* what = "allgather_into_tensor_coalesced";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size() && !inputs.empty(), "kccl: ", what, ": ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  for (const auto& x : inputs) {
    check_tensor(x, what, "input");
    check_device(x, inputs[0], what);
  }
  for (size_t i = 0; i < inputs.size(); i++) _allgather_base(outputs[i], inputs[i], opts);
  return done(transport(inputs[0], what), c10d::OpType::ALLGATHER_COALESCED, outputs);
}

// gather: point-to-point from p2p_min_bytes_ per rank on the CPU, else an all-gather
// whose result only the root keeps.
c10::intrusive_ptr<c10d::Work> KcclBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                   std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  const char* what = "gather";
  const at::Tensor& in = one(inputs, what, "input");
  TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "kccl: gather: root ", opts.rootRank,
                    " out of range for ", size_, " ranks");
  const int root = (int)opts.rootRank;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1 && (int)outputs[0].size() == size_, "kccl: gather: the root takes one "
                      "list of world-size (", size_, ") output tensors");
    for (const auto& o : outputs[0]) {
      check_tensor(o, what, "output");
      check_same(o, in, what);
      TORCH_CHECK_VALUE(o.numel() == in.numel(), "kccl: gather: an output has ", o.numel(),
                        " elements, the input ", in.numel());
    }
  }
  std::vector<at::Tensor> outs = rank_ == root ? outputs[0] : std::vector<at::Tensor>{};
  Transport& tr = transport(in, what);
  if (p2p_worth(in, (int64_t)nbytes(in))) {
    gather_p2p(in, outs, root);
    return done(tr, c10d::OpType::GATHER, outs);
  }
  at::Tensor flat = at::empty({(int64_t)nbytes(in) * size_}, in.options().dtype(at::kByte));
  gather_bytes(tr, in, flat, what);
  if (rank_ == root) split_bytes(flat, outs);
  return done(tr, c10d::OpType::GATHER, outs);
}

// scatter: point-to-point from p2p_min_bytes_ per rank on the CPU, else the root's
// inputs, concatenated, broadcast; every rank keeps its slice.
c10::intrusive_ptr<c10d::Work> KcclBackend::scatter(std::vector<at::Tensor>& outputs,
                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                    const c10d::ScatterOptions& opts) {
  const char* what = "scatter";
  const at::Tensor& out = one(outputs, what, "output");
  TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "kccl: scatter: root ", opts.rootRank,
                    " out of range for ", size_, " ranks");
  const int root = (int)opts.rootRank;
  const int64_t b = (int64_t)nbytes(out);
  if (rank_ == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1 && (int)inputs[0].size() == size_, "kccl: scatter: the root takes one "
                      "list of world-size (", size_, ") input tensors");
    for (const auto& x : inputs[0]) {
      check_tensor(x, what, "input");
      check_same(x, out, what);
      TORCH_CHECK_VALUE(x.numel() == out.numel(), "kccl: scatter: an input has ", x.numel(), " elements, the output ",
                        out.numel());
    }
  }
  Transport& tr = transport(out, what);
  if (p2p_worth(out, b)) {
    scatter_p2p(rank_ == root ? inputs[0] : std::vector<at::Tensor>{}, out, root);
    return done(tr, c10d::OpType::SCATTER, outputs);
  }
  at::Tensor flat = rank_ == root ? cat_bytes(inputs[0]) : at::empty({b * size_}, out.options().dtype(at::kByte));
  tr.broadcast(flat.data_ptr(), flat.data_ptr(), nbytes(flat), kcclUint8, root, what);
  split_bytes(flat.narrow(0, rank_ * b, b), {out});
  return done(tr, c10d::OpType::SCATTER, outputs);
}

// all-to-all: first every rank's send and receive sizes, all-gathered on the host (so
// that a mismatch is found, and raised, on every rank, and every rank takes the same
// path).  Then point-to-point when the largest block reaches p2p_min_bytes_ on the
// CPU; otherwise every rank's whole send buffer, padded to the largest, all-gathered,
// and each rank copies out the blocks addressed to it (world size times the bytes,
// one step: right for the small messages of inference).
void KcclBackend::alltoallv_bytes(Transport& t, const at::Tensor& in, const std::vector<int64_t>& send_bytes,
                                  const at::Tensor& out, const std::vector<int64_t>& recv_bytes, const char* what) {
  const int n = size_;
  std::vector<int64_t> mine(2 * n), all(2 * (size_t)n * n);
  std::copy(send_bytes.begin(), send_bytes.end(), mine.begin());
  std::copy(recv_bytes.begin(), recv_bytes.end(), mine.begin() + n);
  host_->all_gather(mine.data(), all.data(), 2 * n, kcclInt64, what);
  auto sends = [&](int s, int d) { return all[(size_t)s * 2 * n + d]; };
  auto expects = [&](int d, int s) { return all[(size_t)d * 2 * n + n + s]; };
  int64_t widest = 0, largest_block = 0;
  for (int s = 0; s < n; s++) {
    int64_t total = 0;
    for (int d = 0; d < n; d++) {
      TORCH_CHECK_VALUE(sends(s, d) == expects(d, s), "kccl: ", what, ": rank ", s, " sends ", sends(s, d),
                        " bytes to rank ", d, ", whose output split expects ", expects(d, s));
      total += sends(s, d);
      largest_block = std::max(largest_block, sends(s, d));
    }
    widest = std::max(widest, total);
  }
  at::Tensor src = dense(in).reshape({-1}).view(at::kByte), dst = out.reshape({-1}).view(at::kByte);
  if (p2p_worth(in, largest_block)) {
    std::vector<at::Tensor> ins, outs;
    int64_t at_in = 0, at_out = 0;
    for (int r = 0; r < n; r++) {
      ins.push_back(src.narrow(0, at_in, send_bytes[r]));
      outs.push_back(dst.narrow(0, at_out, recv_bytes[r]));
      at_in += send_bytes[r];
      at_out += recv_bytes[r];
    }
    alltoall_p2p(ins, outs);
    return;
  }
  int64_t my_total = 0;
  for (int d = 0; d < n; d++) my_total += send_bytes[d];
  at::Tensor padded = at::zeros({widest}, src.options());
  if (my_total) padded.narrow(0, 0, my_total).copy_(src.narrow(0, 0, my_total));
  at::Tensor flat = at::empty({widest * n}, src.options());
  t.all_gather(padded.data_ptr(), flat.data_ptr(), widest, kcclUint8, what);
  int64_t pos = 0;
  for (int s = 0; s < n; s++) {
    int64_t off = 0;
    for (int d = 0; d < rank_; d++) off += sends(s, d);
    if (sends(s, rank_)) dst.narrow(0, pos, sends(s, rank_)).copy_(flat.narrow(0, s * widest + off, sends(s, rank_)));
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
  Transport& tr = transport(input, what);
  at::Tensor o = output.is_contiguous() ? output : at::empty(output.sizes(), output.options());
  alltoallv_bytes(tr, input, send, o, recv, what);
  if (!o.is_same(output)) output.copy_(o);
  return done(tr, c10d::OpType::ALLTOALL_BASE, {output});
}

c10::intrusive_ptr<c10d::Work> KcclBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                     const c10d::AllToAllOptions&) {
  const char* what = "all_to_all";
  TORCH_CHECK_VALUE((int)outputs.size() == size_ && (int)inputs.size() == size_, "kccl: ", what, " takes world-size (",
                    size_, ") lists of inputs and outputs, got ", inputs.size(), " and ", outputs.size());
  std::vector<int64_t> send(size_), recv(size_);
  int64_t recv_bytes = 0;
  for (int i = 0; i < size_; i++) {
    check_tensor(inputs[i], what, "input");
    check_tensor(outputs[i], what, "output");
    check_same(inputs[i], inputs[0], what);
    check_same(outputs[i], inputs[0], what);
    send[i] = nbytes(inputs[i]);
    recv[i] = nbytes(outputs[i]);
    recv_bytes += recv[i];
  }
  Transport& tr = transport(inputs[0], what);
  at::Tensor in = cat_bytes(inputs);
  at::Tensor out = at::empty({recv_bytes}, in.options());
  alltoallv_bytes(tr, in, send, out, recv, what);
  split_bytes(out, outputs);
  return done(tr, c10d::OpType::ALLTOALL, outputs);
}

// Host ranks meet; a CUDA caller's GPU work is not ordered by it (as gloo's).
c10::intrusive_ptr<c10d::Work> KcclBackend::barrier(const c10d::BarrierOptions&) {
  host_->barrier("barrier");
  return c10::make_intrusive<KcclWork>(rank_, c10d::OpType::BARRIER, std::vector<at::Tensor>{});
}

}  // namespace kccl_torch
