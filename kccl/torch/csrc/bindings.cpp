// The Python module of the backend: makes backends for kccl/torch/__init__.py's
// creator function.
#include <pybind11/chrono.h>
#include <torch/python.h>

#include <cstring>

#include "backend.h"

namespace py = pybind11;

namespace {

template <class T>
T from_bytes(const std::string& b, const char* what) {
  T v;
  TORCH_CHECK(b.size() == sizeof v, "kccl: ", what, " has ", b.size(), " bytes, this build expects ", sizeof v,
              " (kccl.h of another version?)");
  std::memcpy(&v, b.data(), sizeof v);
  return v;
}

kccl_torch::KcclBackend* kccl(const c10::intrusive_ptr<c10d::Backend>& b) {
  auto* k = dynamic_cast<kccl_torch::KcclBackend*>(b.get());
  TORCH_CHECK_VALUE(k, "not a kccl backend");
  return k;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "KCCL's c10d backend for CPU and CUDA tensors (see kccl.torch)";
  m.def(
      "create_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, int64_t timeout_ms,
         const std::string& config, const std::string& placement) -> c10::intrusive_ptr<c10d::Backend> {
        return c10::make_intrusive<kccl_torch::KcclBackend>(
            store, rank, size, std::chrono::milliseconds(timeout_ms), from_bytes<kcclConfig_t>(config, "config"),
            from_bytes<kcclPlacement_t>(placement, "placement"));
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "quiesce_callbacks", [](int64_t bound_ms) { kccl_torch::quiesce_callbacks(std::chrono::milliseconds(bound_ms)); },
      py::call_guard<py::gil_scoped_release>());
  m.def("async_started", [](const c10::intrusive_ptr<c10d::Backend>& b) { return kccl(b)->async_started(); });
  m.def("p2p_collectives", [](const c10::intrusive_ptr<c10d::Backend>& b) { return kccl(b)->p2p_collectives(); });
  m.def("set_p2p_min_bytes",
        [](const c10::intrusive_ptr<c10d::Backend>& b, int64_t bytes) { kccl(b)->set_p2p_min_bytes(bytes); });
  // bench/torch_small_cost.py: the backend's and KCCL's own cost of a small all-reduce, in C++ loops
  m.def(
      "time_backend_allreduce",
      [](const c10::intrusive_ptr<c10d::Backend>& b, const at::Tensor& t, int64_t iters) {
        std::vector<at::Tensor> v{t};
        c10d::AllreduceOptions opts;
        opts.asyncOp = false;  // as torch.distributed.all_reduce asks for it
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t i = 0; i < iters; i++) b->allreduce(v, opts)->wait();
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "time_host_allreduce",
      [](const c10::intrusive_ptr<c10d::Backend>& b, const at::Tensor& t, int64_t iters) {
        return kccl(b)->time_host_allreduce(t, iters);
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "make_gpu_comm", [](const c10::intrusive_ptr<c10d::Backend>& b, int index) { kccl(b)->make_gpu_comm(index); },
      py::call_guard<py::gil_scoped_release>());
}
