#include "dtypes.h"

#include <c10/util/Exception.h>

namespace kccl_torch {

int native_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kChar: return kcclInt8;
    case at::kByte: return kcclUint8;
    case at::kInt: return kcclInt32;
    case at::kUInt32: return kcclUint32;
    case at::kLong: return kcclInt64;
    case at::kUInt64: return kcclUint64;
    case at::kHalf: return kcclFloat16;
    case at::kBFloat16: return kcclBfloat16;
    case at::kFloat: return kcclFloat32;
    case at::kDouble: return kcclFloat64;
    default: return -1;
  }
}

size_t type_size(kcclDataType_t t) {
  switch (t) {
    case kcclInt8: case kcclUint8: return 1;
    case kcclFloat16: case kcclBfloat16: return 2;
    case kcclInt32: case kcclUint32: case kcclFloat32: return 4;
    default: return 8;
  }
}

static const char* op_name(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

ReducePlan reduce_plan(at::ScalarType dtype, const c10d::ReduceOp& rop, const char* coll) {
  const auto op = rop.op_;
  kcclRedOp_t kop;
  switch (op) {
    case c10d::ReduceOp::SUM: kop = kcclSum; break;
    case c10d::ReduceOp::AVG: kop = kcclAvg; break;
    case c10d::ReduceOp::PRODUCT: kop = kcclProd; break;
    case c10d::ReduceOp::MIN: kop = kcclMin; break;
    case c10d::ReduceOp::MAX: kop = kcclMax; break;
    default:
      TORCH_CHECK_NOT_IMPLEMENTED(false, "kccl: ", coll, " with ReduceOp.", op_name(op),
                                  " is not supported: KCCL reduces with SUM, PRODUCT, MIN, MAX and AVG "
                                  "(use a gloo group for bitwise ops and PREMUL_SUM)");
  }
  ReducePlan p{};
  p.op = kop;
  p.staging = dtype;
  int native = native_type(dtype);
  if (native >= 0) {
    p.type = static_cast<kcclDataType_t>(native);
    return p;
  }
  switch (dtype) {
    case at::kBool:
      // 0/1 bytes: the largest is an OR, the smallest an AND (gloo's sum and product of bools)
      TORCH_CHECK_VALUE(kop != kcclAvg, "kccl: ", coll, ": ReduceOp.AVG of bool tensors makes no sense");
      p.type = kcclUint8;
      p.op = (kop == kcclSum || kop == kcclMax) ? kcclMax : kcclMin;
      return p;
    case at::kShort:
      p.type = kcclInt32, p.staging = at::kInt, p.staging_is_own = false;
      return p;
    case at::kUInt16:
      p.type = kcclUint32, p.staging = at::kUInt32, p.staging_is_own = false;
      return p;
    case at::kComplexHalf:
    case at::kComplexFloat:
    case at::kComplexDouble:
      TORCH_CHECK_VALUE(kop == kcclSum || kop == kcclAvg, "kccl: ", coll, ": ReduceOp.", op_name(op),
                        " of complex tensors makes no sense (SUM and AVG only)");
      p.as_real = true;
      p.staging = dtype == at::kComplexHalf ? at::kHalf : dtype == at::kComplexFloat ? at::kFloat : at::kDouble;
      p.type = static_cast<kcclDataType_t>(native_type(p.staging));
      return p;
    default:
      TORCH_CHECK_NOT_IMPLEMENTED(false, "kccl: ", coll, " of ", dtype,
                                  " tensors is not supported (KCCL reduces int8/16/32/64, uint8/16/32/64, "
                                  "bool, float16, bfloat16, float32, float64 and complex)");
  }
}

}  // namespace kccl_torch
