#include "tensors.h"

#include <c10/util/Exception.h>

namespace kccl_torch {

void check_tensor(const at::Tensor& t, const char* coll, const char* what) {
  TORCH_CHECK_VALUE(t.defined(), "kccl: ", coll, ": ", what, " is an undefined tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu() || t.device().is_cuda(), "kccl: ", coll, ": ", what, " is on ", t.device(),
                    "; this backend takes CPU and CUDA tensors");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "kccl: ", coll, ": ", what, " has layout ", t.layout(),
                    "; only dense (strided) tensors are supported");
}

const at::Tensor& one(const std::vector<at::Tensor>& v, const char* coll, const char* what) {
  TORCH_CHECK_VALUE(v.size() == 1, "kccl: ", coll, " takes one ", what, " tensor, got ", v.size());
  check_tensor(v[0], coll, what);
  return v[0];
}

void check_device(const at::Tensor& a, const at::Tensor& b, const char* coll) {
  TORCH_CHECK_VALUE(a.device() == b.device(), "kccl: ", coll, ": tensors on ", a.device(), " and ", b.device(),
                    " (every tensor of a call needs one device)");
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* coll) {
  check_device(a, b, coll);
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type(), "kccl: ", coll, ": tensors of ", a.scalar_type(), " and ",
                    b.scalar_type(), " (every tensor of a call needs one dtype)");
}

int64_t row_elems(const at::Tensor& t) {
  int64_t n = 1;
  for (int64_t d = 1; d < t.dim(); d++) n *= t.size(d);
  return n;
}

at::Tensor staged_input(const at::Tensor& t, const ReducePlan& p) {
  at::Tensor v = p.as_real ? at::view_as_real(t) : t;
  if (v.scalar_type() != p.staging) return v.to(p.staging).contiguous();
  return dense(v);
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

// The bytes of t, as a flat uint8 tensor (a view when t is contiguous).
static at::Tensor as_bytes(const at::Tensor& t) {
  at::Tensor d = dense(t);
  if (d.scalar_type() == at::kBool) d = d.view(at::kByte);
  if (d.is_complex()) d = at::view_as_real(d);
  return d.reshape({-1}).view(at::kByte);
}

at::Tensor cat_bytes(const std::vector<at::Tensor>& parts) {
  std::vector<at::Tensor> flat;
  flat.reserve(parts.size());
  for (const auto& x : parts) flat.push_back(as_bytes(x));
  return at::cat(flat);
}

void split_bytes(const at::Tensor& flat, const std::vector<at::Tensor>& outs) {
  int64_t pos = 0;
  for (const auto& o : outs) {
    const int64_t n = static_cast<int64_t>(nbytes(o));
    at::Tensor piece = flat.narrow(0, pos, n);
    if (o.is_contiguous()) {
      as_bytes(o).copy_(piece);
    } else {
      at::Tensor tmp = at::empty(o.sizes(), o.options());
      as_bytes(tmp).copy_(piece);
      o.copy_(tmp);
    }
    pos += n;
  }
}

Output::Output(const at::Tensor& t, const ReducePlan& p) {
  view = p.as_real ? at::view_as_real(t) : t;
  buf = (view.is_contiguous() && view.scalar_type() == p.staging)
            ? view
            : at::empty(view.sizes(), view.options().dtype(p.staging));
}

void Output::finish() {
  if (buf.data_ptr() != view.data_ptr() || !view.is_contiguous()) view.copy_(buf);
}

}  // namespace kccl_torch
