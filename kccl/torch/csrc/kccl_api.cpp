#include "kccl_api.h"

#include <stdexcept>

namespace kccl_torch {

Api api;

static const char* const kNames[] = {
#define KCCL_TORCH_NAME(name) #name,
    KCCL_TORCH_API_FUNCTIONS(KCCL_TORCH_NAME)
#undef KCCL_TORCH_NAME
        nullptr};

const char* const* api_names() { return kNames; }

void bind_api(const std::unordered_map<std::string, uintptr_t>& addresses) {
  Api filled;
#define KCCL_TORCH_BIND(name)                                                        \
  {                                                                                  \
    auto it = addresses.find(#name);                                                 \
    if (it == addresses.end() || it->second == 0)                                    \
      throw std::invalid_argument("kccl.torch: no address for " #name " in the table"); \
    filled.name = reinterpret_cast<decltype(filled.name)>(it->second);               \
  }
  KCCL_TORCH_API_FUNCTIONS(KCCL_TORCH_BIND)
#undef KCCL_TORCH_BIND
  api = filled;
}

bool api_bound() { return api.kcclAllReduce != nullptr; }

}  // namespace kccl_torch
