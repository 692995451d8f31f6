/* dtype.c - sizes and names of data types, ops and collectives, and the signature of a call. */
#include "internal.h"

size_t kccl_dtype_size(kcclDataType_t t) {
  switch (t) {
    case kcclInt8: case kcclUint8: return 1;
    case kcclFloat16: case kcclBfloat16: return 2;
    case kcclInt32: case kcclUint32: case kcclFloat32: return 4;
    case kcclInt64: case kcclUint64: case kcclFloat64: return 8;
    default: return 0;
  }
}

const char *kccl_dtype_name(int t) {
  static const char *n[] = {"int8", "uint8", "int32", "uint32", "int64",
                            "uint64", "float16", "float32", "float64", "bfloat16"};
  return (t >= 0 && t < kcclNumTypes) ? n[t] : "?";
}

const char *kccl_op_name(int op) {
  static const char *n[] = {"sum", "prod", "max", "min", "avg"};
  return (op >= 0 && op < kcclNumOps) ? n[op] : "?";
}

const char *kccl_coll_name(int coll) {
  switch (coll) {
    case COLL_ALLREDUCE: return "all_reduce";
    case COLL_ALLGATHER: return "all_gather";
    case COLL_REDUCESCATTER: return "reduce_scatter";
    case COLL_BROADCAST: return "broadcast";
    case COLL_BARRIER: return "barrier";
    case COLL_ALLREDUCE_NB: return "all_reduce_start";
    case COLL_ALLREDUCE_2SHOT: return "all_reduce_twoshot";
    default: return "nothing";
  }
}

uint32_t kccl_signature(int coll, size_t count, int dtype, int op, int root) {
  uint64_t h = (uint64_t)count * 0x9e3779b97f4a7c15ull;
  h ^= ((uint64_t)coll << 48) ^ ((uint64_t)(uint32_t)dtype << 40) ^ ((uint64_t)(uint32_t)op << 32) ^
       (uint64_t)(uint32_t)root;
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 29;
  return (uint32_t)h ^ (uint32_t)(h >> 32);
}
