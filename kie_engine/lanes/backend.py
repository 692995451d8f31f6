"""The engines behind one decode loop (generate.generate).

A backend is an object with
    max_seq               the context it was made for
    reset()               position 0
    prefill(ids)          runs the prompt from the current position -> the last token's logits
    decode_step(token)    one token in -> the next token's logits (float32, the whole vocabulary)
    close()               frees what it holds (idempotent)
Three implement it: the numpy reference (model.Model, "numpy"), the native CPU engine
(cpu.engine.CpuModel, "native", the default on the CPU) and the CUDA engine
(gpu.engine.GpuModel, "graph" or "mono").  A backend may also offer
    tokens(prompt_ids, max_new_tokens, sampling) -> iterator of picked token ids
when it picks tokens itself (the GPU engine samples on the device and runs steps
ahead); generate() then takes the tokens from it instead of sampling logits.

load_backend() picks and builds one for a checkpoint on this rank."""
from ..errors import KieError

CPU_KERNELS = ("native", "numpy")
GPU_KERNELS = ("graph", "mono")
KERNELS = CPU_KERNELS + GPU_KERNELS


def default_kernel(device):
    return "graph" if device == "cuda" else "native"


def check_kernel(device, kernel):
    """The kernel to use (default for the device); KieError when it does not run there."""
    kernel = kernel or default_kernel(device)
    if kernel not in KERNELS:
        raise KieError(f"--kernel {kernel}: choose one of {', '.join(KERNELS)}")
    if device == "cuda" and kernel not in GPU_KERNELS:
        raise KieError(f"--kernel {kernel} runs on the CPU: drop --device cuda (GPU kernels: "
                       f"{', '.join(GPU_KERNELS)})")
    if device != "cuda" and kernel not in CPU_KERNELS:
        raise KieError(f"--kernel {kernel} is a GPU kernel: add --device cuda")
    return kernel


def load_backend(ckpt, comm=None, device="cpu", kernel=None, max_seq=None, threads=None, node_cpu_sets=None,
                 kv="f16", native=None):
    """This rank's backend for `ckpt` (comm: None, or the lanes' kccl.Communicator).
    threads: the native engine's pool size (default threads.choose()); native: more
    keywords of the native engine (cpu.engine.CpuModel: max_rows, kv_limit)."""
    kernel = check_kernel(device, kernel)
    if kernel in GPU_KERNELS:
        from ..gpu.engine import load_gpu_model
        return load_gpu_model(ckpt, comm, max_seq=max_seq, kernel=kernel)
    if kernel == "native":
        from ..cpu.engine import load_cpu_model
        return load_cpu_model(ckpt, comm, max_seq=max_seq, threads=threads, node_cpu_sets=node_cpu_sets, kv=kv,
                              **(native or {}))
    from ..reference.sharded import load_model
    return load_model(ckpt, comm, max_seq=max_seq, uneven=True)
