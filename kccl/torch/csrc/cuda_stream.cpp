#include "cuda_stream.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace kccl_torch {

c10::Stream current_stream(c10::Device device) {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device);
}

void* raw_stream(const c10::Stream& stream) { return stream.native_handle(); }

c10::Event record_event(const c10::Stream& stream) {
  c10::Event ev(c10::DeviceType::CUDA);
  ev.record(stream);
  return ev;
}

}  // namespace kccl_torch
