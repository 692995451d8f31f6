// Argument checks and tensor plumbing shared by the backend's collectives.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "dtypes.h"

namespace kccl_torch {

// Defined, dense, on a CPU or CUDA device (ValueError naming the collective otherwise).
void check_tensor(const at::Tensor& t, const char* coll, const char* what);
// The one tensor of a one-tensor list, checked.
const at::Tensor& one(const std::vector<at::Tensor>& v, const char* coll, const char* what);
// Every tensor of a call on one device and of one dtype (same_dtype) as `first`.
void check_same(const at::Tensor& a, const at::Tensor& b, const char* coll);
void check_device(const at::Tensor& a, const at::Tensor& b, const char* coll);

inline at::Tensor dense(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }
inline size_t nbytes(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }
int64_t row_elems(const at::Tensor& t);

// t as KCCL reads it under plan p: contiguous, of p's staging type (may share t's memory).
at::Tensor staged_input(const at::Tensor& t, const ReducePlan& p);
// parts flattened and concatenated (converted to p's staging type when p is given).
at::Tensor flatten_cat(const std::vector<at::Tensor>& parts, const ReducePlan* p);
// All of parts as one contiguous byte tensor on their device.
at::Tensor cat_bytes(const std::vector<at::Tensor>& parts);
// Copies consecutive pieces of `flat` (bytes) into each of outs.
void split_bytes(const at::Tensor& flat, const std::vector<at::Tensor>& outs);

// Where KCCL writes a result meant for t under plan p: t's own memory when it can, else a
// buffer that finish() copies into t.
struct Output {
  at::Tensor view, buf;
  Output(const at::Tensor& t, const ReducePlan& p);
  void finish();
};

}  // namespace kccl_torch
