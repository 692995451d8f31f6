// The kccl.h functions the backend calls, as a table of pointers into the KCCL
// copy that the Python package loaded (its cffi module).  One copy of the core
// per process: the settings warnings, the registry that refuses a rank joining
// the same communicator twice, and the error text all live in one place, and the
// extension needs no libkccl.so at link or load time.  Filled once, at import, by
// bind_api (kccl/torch/__init__.py passes kccl.capi.function addresses).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>

#include "kccl.h"

namespace kccl_torch {

#define KCCL_TORCH_API_FUNCTIONS(X) \
  X(kcclGetUniqueId)                \
  X(kcclCommInitRankPlacement)      \
  X(kcclCommDestroy)                \
  X(kcclCommAbort)                  \
  X(kcclCommGetAsyncError)          \
  X(kcclAllReduce)                  \
  X(kcclAllGather)                  \
  X(kcclReduceScatter)              \
  X(kcclBroadcast)                  \
  X(kcclBarrier)                    \
  X(kcclAllReduceStart)             \
  X(kcclAllReduceWait)              \
  X(kcclAllReduceTest)              \
  X(kcclSendStart)                  \
  X(kcclRecvStart)                  \
  X(kcclP2PWait)                    \
  X(kcclP2PTest)                    \
  X(kcclP2PProgress)                \
  X(kcclGetErrorString)             \
  X(kcclGetLastError)

struct Api {
#define KCCL_TORCH_FIELD(name) decltype(&::name) name = nullptr;
  KCCL_TORCH_API_FUNCTIONS(KCCL_TORCH_FIELD)
#undef KCCL_TORCH_FIELD
};

extern Api api;

// Names every function of the table to a Python caller (its keys) ...
const char* const* api_names();
// ... and fills it; throws naming the first missing one.
void bind_api(const std::unordered_map<std::string, uintptr_t>& addresses);
bool api_bound();

}  // namespace kccl_torch
