// torch's current CUDA stream and events, through c10's device-guard interface:
// the extension includes no CUDA header and links no CUDA library, so one build
// serves a CPU-only torch (where no CUDA tensor can reach these functions) and a
// CUDA one (where torch's own CUDA guard implementation answers them).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

namespace kccl_torch {

// The current stream of `device` (a CUDA device) for this thread, as torch sees it.
c10::Stream current_stream(c10::Device device);
// Its cudaStream_t, as kccl.h's stream argument takes it.
void* raw_stream(const c10::Stream& stream);
// An event recorded on `stream` now (also inside a CUDA graph capture).
c10::Event record_event(const c10::Stream& stream);

}  // namespace kccl_torch
