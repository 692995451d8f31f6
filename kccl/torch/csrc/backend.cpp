// KcclBackend: construction, the device's communicator, life cycle, and the reducing
// collectives (all_reduce and its coalesced and async forms, reduce, reduce_scatter).
#include "backend.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <type_traits>

#include "cuda_stream.h"
#include "tensors.h"

namespace kccl_torch {

namespace {

// torch's OpType for reduce_scatter_tensor_coalesced: torch 2.11 has no such member (its
// ProcessGroups report COALESCED there), later ones do.  Detected, not gated on a version
// number, so that the one source builds against every torch the backend supports.
template <typename E, typename = void>
struct has_rs_coalesced : std::false_type {};
template <typename E>
struct has_rs_coalesced<E, std::void_t<decltype(E::REDUCE_SCATTER_TENSOR_COALESCED)>> : std::true_type {};
template <typename E>
constexpr E rs_coalesced_op() {
  if constexpr (has_rs_coalesced<E>::value) return E::REDUCE_SCATTER_TENSOR_COALESCED;
  else return E::COALESCED;
}

// From this many bytes per rank gather / scatter / all_to_all go point-to-point on the CPU
// (backend_p2p.cpp), below it they are KCCL collectives (all-gather / broadcast).  Point-to-
// point measured faster from 4 KB to 4 MB at 2 and 4 ranks (bench/torch_p2p.py; at 4 KB
// 1.3-3.3x), and never moves more than the receivers need, so it is taken at every size;
// tests set it to exercise the collective form, which CUDA tensors always take.
constexpr int64_t kP2PMinBytes = 0;

}  // namespace

KcclBackend::KcclBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                         std::chrono::milliseconds timeout, const kcclConfig_t& config,
                         const kcclPlacement_t& placement)
    : c10d::Backend(rank, size), store_(store), config_(config), timeout_(timeout), p2p_min_bytes_(kP2PMinBytes) {
  host_ = std::make_shared<HostComm>(rank, size, exchange_id("kccl/unique_id"), config, placement);
}

KcclBackend::~KcclBackend() = default;  // the communicators go with their last Work

kcclUniqueId KcclBackend::exchange_id(const std::string& key) {
  kcclUniqueId id;
  if (rank_ == 0) {
    kcclResult_t rc = kcclGetUniqueId(&id);
    if (rc != kcclSuccess)
      C10_THROW_ERROR(DistBackendError, std::string("kccl: rank 0 could not make a unique id: ") +
                                            kcclGetLastError(nullptr));
    store_->set(key, std::vector<uint8_t>(id.internal, id.internal + sizeof id.internal));
    return id;
  }
  try {
    store_->wait({key}, timeout_);
  } catch (const std::exception& e) {
    C10_THROW_ERROR(DistBackendError, "kccl: rank " + std::to_string(rank_) + " waited " +
                                          std::to_string(timeout_.count()) + " ms for rank 0's unique id (" + key +
                                          ") in the store: " + e.what());
  }
  std::vector<uint8_t> v = store_->get(key);
  TORCH_CHECK(v.size() == sizeof id.internal, "kccl: the unique id in the store has ", v.size(), " bytes, not ",
              sizeof id.internal);
  std::memcpy(id.internal, v.data(), v.size());
  return id;
}

GpuComm& KcclBackend::gpu(c10::Device device, const char* what) {
  std::lock_guard<std::mutex> lock(gpu_mu_);
  if (!gpu_) {
    // every rank tries as often as the others (a collective call), so the key names the try
    const std::string key = "kccl/cuda_unique_id/" + std::to_string(gpu_tries_++);
    gpu_ = std::make_shared<GpuComm>(rank_, size_, device, exchange_id(key), config_);
  } else {
    TORCH_CHECK_VALUE(gpu_->device() == device, "kccl: ", what, ": this group's GPU communicator is on ",
                      gpu_->device(), " and the tensor on ", device,
                      "; a group serves one GPU per rank (make another group for the other device)");
  }
  return *gpu_;
}

Transport& KcclBackend::transport(const at::Tensor& t, const char* what) {
  if (t.device().is_cpu()) return *host_;
  return gpu(t.device(), what);
}

c10::intrusive_ptr<c10d::Work> KcclBackend::done(Transport& t, c10d::OpType type, std::vector<at::Tensor> outputs) {
  if (t.on_gpu()) {
    auto& g = static_cast<GpuComm&>(t);
    return c10::make_intrusive<CudaWork>(rank_, type, std::move(outputs), current_stream(g.device()));
  }
  return c10::make_intrusive<KcclWork>(rank_, type, std::move(outputs));
}

c10::intrusive_ptr<c10d::Backend::Options> KcclBackend::getBackendOptions() {
  return c10::make_intrusive<Options>("kccl", timeout_);
}

void KcclBackend::startCoalescing() {
  coalescing_ = true;
  coalesced_.clear();
}

// A batch (batch_isend_irecv): one Work over every send and receive started in it; the
// collectives of a batch have already run.
c10::intrusive_ptr<c10d::Work> KcclBackend::endCoalescing() {
  coalescing_ = false;
  std::vector<std::shared_ptr<PendingOp>> ops;
  std::vector<at::Tensor> outputs;
  for (const auto& w : coalesced_)
    for (auto& op : w->pending_ops()) ops.push_back(op);
  coalesced_.clear();
  if (ops.empty()) return c10::make_intrusive<KcclWork>(rank_, c10d::OpType::COALESCED, std::move(outputs));
  return c10::make_intrusive<KcclWork>(rank_, c10d::OpType::COALESCED, std::move(outputs), host_, std::move(ops));
}

c10d::ErrorType KcclBackend::getError() {
  kcclResult_t e = host_->async_error();
  {
    std::lock_guard<std::mutex> lock(gpu_mu_);
    if (e == kcclSuccess && gpu_) e = gpu_->async_error();
  }
  if (e == kcclSuccess) return c10d::ErrorType::SUCCESS;
  if (e == kcclTimeout) return c10d::ErrorType::TIMEOUT;
  if (e == kcclRemoteError) return c10d::ErrorType::REMOTE_ERROR;
  return c10d::ErrorType::COMM_ERROR;
}

void KcclBackend::abort() {
  {
    std::lock_guard<std::mutex> lock(gpu_mu_);
    if (gpu_) gpu_->abort();
  }
  host_->abort();
}

void KcclBackend::shutdown() {
  {
    std::lock_guard<std::mutex> lock(gpu_mu_);
    if (gpu_) gpu_->destroy();
  }
  host_->destroy();
}

double KcclBackend::time_host_allreduce(const at::Tensor& t, int64_t iters) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
                    "time_host_allreduce takes a contiguous float32 CPU tensor");
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; i++)
    host_->all_reduce(t.data_ptr(), t.data_ptr(), t.numel(), kcclFloat32, kcclSum, "all_reduce");
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---- reductions ---------------------------------------------------------------------

void KcclBackend::reduce_tensor(Transport& t, const at::Tensor& in, const at::Tensor& out, const c10d::ReduceOp& op,
                                const char* what) {
  const ReducePlan p = reduce_plan(in.scalar_type(), op, what);
  if (!t.reduces(p.type)) {
    // A type the GPU does not reduce: through host memory (synchronous, so not capturable).
    at::Tensor ci = in.to(at::kCPU), co = in.is_same(out) ? ci : at::empty(out.sizes(), out.options().device(at::kCPU));
    reduce_tensor(*host_, ci, co, op, what);
    out.copy_(co);
    return;
  }
  at::Tensor s = staged_input(in, p);
  if (in.is_same(out)) {
    // in place: s is in's memory when in is contiguous in its own type, else a copy to write back
    t.all_reduce(s.data_ptr(), s.data_ptr(), s.numel(), p.type, p.op, what);
    at::Tensor v = p.as_real ? at::view_as_real(in) : in;
    if (s.data_ptr() != v.data_ptr() || !v.is_contiguous()) v.copy_(s);
    return;
  }
  Output o(out, p);
  t.all_reduce(s.data_ptr(), o.buf.data_ptr(), s.numel(), p.type, p.op, what);
  o.finish();
}

c10::intrusive_ptr<c10d::Work> KcclBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) {
  const at::Tensor& t = one(tensors, "all_reduce", "input");
  if (t.device().is_cpu()) {
    const size_t nb = nbytes(t);
    // async_op=True: KCCL's split phase when the tensor fits one slot as it is; the sum
    // then lands while the caller computes, and Work.wait() collects it.
    if (opts.asyncOp && !coalescing_ && nb > 0 && nb <= host_->buffer_bytes() && t.is_contiguous()) {
      const ReducePlan p = reduce_plan(t.scalar_type(), opts.reduceOp, "all_reduce");
      if (p.direct()) {
        void* ptr = t.data_ptr();
        auto op = host_->start_all_reduce(ptr, ptr, t.numel(), p.type, p.op);
        async_started_++;
        return c10::make_intrusive<KcclWork>(rank_, c10d::OpType::ALLREDUCE, tensors, host_,
                                             std::vector<std::shared_ptr<PendingOp>>{std::move(op)});
      }
    }
    const ReducePlan p = reduce_plan(t.scalar_type(), opts.reduceOp, "all_reduce");
    if (p.direct() && t.is_contiguous())  // the common case, without reduce_tensor's staging
      host_->all_reduce(t.data_ptr(), t.data_ptr(), t.numel(), p.type, p.op, "all_reduce");
    else
      reduce_tensor(*host_, t, t, opts.reduceOp, "all_reduce");
    return c10::make_intrusive<KcclWork>(rank_, c10d::OpType::ALLREDUCE, tensors);
  }
  Transport& tr = transport(t, "all_reduce");
  reduce_tensor(tr, t, t, opts.reduceOp, "all_reduce");
  return done(tr, c10d::OpType::ALLREDUCE, tensors);
}

c10::intrusive_ptr<c10d::Work> KcclBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                const c10d::AllreduceCoalescedOptions& opts) {
  const char* what = "all_reduce_coalesced";
  TORCH_CHECK_VALUE(!tensors.empty(), "kccl: ", what, " takes at least one tensor");
  for (const auto& t : tensors) {
    check_tensor(t, what, "input");
    check_device(t, tensors[0], what);
  }
  Transport& tr = transport(tensors[0], what);
  for (const auto& t : tensors) reduce_tensor(tr, t, t, opts.reduceOp, what);
  return done(tr, c10d::OpType::ALLREDUCE_COALESCED, tensors);
}

// reduce: KCCL has no rooted reduce; an all-reduce whose result only the root keeps
// (the other ranks reduce into scratch, so their tensors stay as they were).
c10::intrusive_ptr<c10d::Work> KcclBackend::reduce(std::vector<at::Tensor>& tensors,
                                                   const c10d::ReduceOptions& opts) {
  const at::Tensor& t = one(tensors, "reduce", "input");
  TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "kccl: reduce: root ", opts.rootRank,
                    " out of range for ", size_, " ranks");
  Transport& tr = transport(t, "reduce");
  if (rank_ == opts.rootRank) {
    reduce_tensor(tr, t, t, opts.reduceOp, "reduce");
  } else {
    at::Tensor scratch = at::empty_like(t, at::MemoryFormat::Contiguous);
    reduce_tensor(tr, t, scratch, opts.reduceOp, "reduce");
  }
  return done(tr, c10d::OpType::REDUCE, tensors);
}

// in: every rank's blocks (world size x out's elements), of out's dtype and device.
void KcclBackend::reduce_scatter_tensor(Transport& t, const at::Tensor& in, const at::Tensor& out,
                                        const c10d::ReduceOp& op, const char* what) {
  const ReducePlan p = reduce_plan(out.scalar_type(), op, what);
  if (!t.reduces(p.type)) {
    at::Tensor ci = in.to(at::kCPU), co = at::empty(out.sizes(), out.options().device(at::kCPU));
    reduce_scatter_tensor(*host_, ci, co, op, what);
    out.copy_(co);
    return;
  }
  at::Tensor s = staged_input(in, p);
  Output o(out, p);
  t.reduce_scatter(s.data_ptr(), o.buf.data_ptr(), o.buf.numel(), p.type, p.op, what);
  o.finish();
}

c10::intrusive_ptr<c10d::Work> KcclBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::ReduceScatterOptions& opts) {
  const char* what = "reduce_scatter_tensor";
  check_tensor(output, what, "output");
  check_tensor(input, what, "input");
  check_same(output, input, what);
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size_, "kccl: ", what, ": input has ", input.numel(),
                    " elements, needs world size x output = ", output.numel() * size_);
  Transport& tr = transport(output, what);
  reduce_scatter_tensor(tr, input, output, opts.reduceOp, what);
  return done(tr, c10d::OpType::_REDUCE_SCATTER_BASE, {output});
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
  Transport& tr = transport(out, what);
  reduce_scatter_tensor(tr, flatten_cat(inputs[0], nullptr), out, opts.reduceOp, what);
  return done(tr, c10d::OpType::REDUCE_SCATTER, outputs);
}

c10::intrusive_ptr<c10d::Work> KcclBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  const char* what = "reduce_scatter_tensor_coalesced";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size() && !inputs.empty(), "kccl: ", what, ": ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); i++) {
    check_tensor(outputs[i], what, "output");
    check_tensor(inputs[i], what, "input");
    check_same(outputs[i], inputs[i], what);
    check_device(inputs[i], inputs[0], what);
    TORCH_CHECK_VALUE(inputs[i].numel() == outputs[i].numel() * size_, "kccl: ", what, ": input ", i, " has ",
                      inputs[i].numel(), " elements, needs world size x output = ", outputs[i].numel() * size_);
  }
  Transport& tr = transport(inputs[0], what);
  for (size_t i = 0; i < inputs.size(); i++) reduce_scatter_tensor(tr, inputs[i], outputs[i], opts.reduceOp, what);
  return done(tr, rs_coalesced_op<c10d::OpType>(), outputs);
}

}  // namespace kccl_torch
