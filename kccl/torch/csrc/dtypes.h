// How a torch dtype and c10d ReduceOp become a KCCL reduction: KCCL reduces int8,
// uint8, int32, uint32, int64, uint64, float16, bfloat16, float32 and float64
// with SUM, PROD, MAX, MIN and AVG.  Other torch types are reduced in a type KCCL
// has (int16 in int32, uint16 in uint32, complex as pairs of reals, bool as uint8
// 0/1 with SUM and MAX an OR and PRODUCT and MIN an AND, the results gloo gives);
// what makes no sense (MIN of complex numbers, AVG of bools) or that KCCL lacks
// (bitwise ops, PREMUL_SUM) is refused with NotImplementedError / ValueError.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "kccl.h"

namespace kccl_torch {

struct ReducePlan {
  kcclDataType_t type;         // what KCCL reduces
  kcclRedOp_t op;
  at::ScalarType staging;      // the element type of the buffer KCCL reads (after view_as_real)
  bool as_real = false;        // complex: reduce the real view
  // true when the tensor's own memory can go to KCCL as it is (contiguous aside)
  bool direct() const { return !as_real && staging_is_own; }
  bool staging_is_own = true;
};

// Throws (ValueError / NotImplementedError) naming the collective when the pair is refused.
ReducePlan reduce_plan(at::ScalarType dtype, const c10d::ReduceOp& op, const char* collective);

// The KCCL type of a dtype KCCL reduces natively, or -1.
int native_type(at::ScalarType dtype);

size_t type_size(kcclDataType_t t);

}  // namespace kccl_torch
