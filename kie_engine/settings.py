"""Every KIE_* environment variable, one entry each: the only place where a setting's
name, type, default, range and meaning are written (as kccl_settings.def is for
KCCL_*).  The engines read them through value(); the CUDA engine gets them in its
kie_shape, so its C code reads no environment.  The one the C code of the CPU kernels
reads itself, KIE_CPU_HIDE (its dispatcher picks a level at the first kernel call, in
any program that links it), is checked here when Python loads those kernels
(kie_engine/cpu/_native.py), so a bad value is refused before it can be misread.  A name that starts with KIE_ and is
no setting (a misspelling) is ignored, with one line on stderr per process (per job
where the launcher tells the ranks apart) naming the closest setting.

    python -m kie_engine.settings     # every setting, its value and where it came from
"""
import os
import sys
from dataclasses import dataclass
from typing import Optional, Tuple

from .errors import GpuArgumentError, SettingError


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str                  # "int" (lo..hi, or one of `values`), "flag" (0 or 1), "choice", "count" (>= 1),
    #                            "names" (a comma-separated set of `values`, any order; given in `values`' order)
    default: object            # None: decided at run time, as `doc` says
    doc: str
    lo: int = 0
    hi: int = 0
    values: Tuple = ()         # "int": the only integers allowed; "choice": the names
    error: type = SettingError  # what a bad value raises (the CUDA engine's are GpuArgumentError)


_GPU = dict(error=GpuArgumentError)

SETTINGS = (
    Setting("KIE_CPU_HIDE", "names", "",
            "CPU engine: instruction sets its kernels must not use, as if the CPU lacked them: avx512, avx2, or "
            "both, comma-separated (hiding avx2 also hides avx512, which needs it). Shows what an older CPU gets; "
            "read by the kernels' dispatcher (kie_engine/cpu/csrc/kq_dispatch.c) at their first use. Unset: the "
            "fastest level this CPU runs.", values=("avx512", "avx2")),
    Setting("KIE_BLAS_THREADS", "count", None,
            "Threads of each rank's BLAS pool (the CPU engine's products). Unset: OPENBLAS_NUM_THREADS, "
            "MKL_NUM_THREADS or OMP_NUM_THREADS when set, else the rank's CPUs over the ranks sharing them, "
            "capped by the idle ones (kie_engine/lanes/threads.py). `generate --blas-threads` wins over it."),
    Setting("KIE_GPU_KERNEL", "choice", "graph",
            "CUDA engine: how a decode step runs: graph (a kernel per GEMV and attention, replayed as a CUDA "
            "graph) or mono (one persistent kernel per step). `generate --kernel` wins over it.",
            values=("graph", "mono"), **_GPU),
    Setting("KIE_GPU_PDL", "flag", None,
            "CUDA engine: 1 launches its kernels with programmatic dependent launch (Hopper). Unset: 1 when the "
            "lane has its GPU to itself, 0 when lanes share one (MPS).", 0, 1, **_GPU),
    Setting("KIE_GPU_PREFETCH", "int", 2,
            "CUDA engine: what a GEMV does before waiting for the kernel before it: 0 nothing, 1 an L2 prefetch "
            "of its first rows, 2 its first loads into registers.", 0, 2, **_GPU),
    Setting("KIE_GPU_GEMV_BLOCKS_PER_SM", "int", 0, "CUDA engine: GEMV blocks per SM; 0 = auto.", 0, 16, **_GPU),
    Setting("KIE_GPU_GEMV_U", "int", 0,
            "CUDA engine: 16-byte loads per row per lane in one batch of a GEMV without pipelining: 4 or 8; "
            "0 = auto (8).", values=(0, 4, 8), **_GPU),
    Setting("KIE_GPU_ATT_CHUNK", "int", 0,
            "CUDA engine: keys per attention block at least, of the monokernel and of KIE_GPU_DECODE_ATTN=1; "
            "0 = auto (32, the fastest of 16..256 on the 2b shape).", 0, 1 << 20, **_GPU),
    Setting("KIE_GPU_DECODE_ATTN", "int", 0,
            "CUDA engine, graph path: its decode attention: 0 = auto (2), 1 = the monokernel's split items (keys "
            "per split KIE_GPU_ATT_CHUNK, the last split combining; bit for bit the monokernel's), 2 = a block "
            "holding its keys' K and V in shared memory, the rows of earlier steps copied before it waits for "
            "the QKV kernel.", 0, 2, **_GPU),
    Setting("KIE_GPU_ATT_KEYS", "int", 0,
            "CUDA engine, KIE_GPU_DECODE_ATTN=2: keys one block holds at most (a longer context is cut into equal "
            "splits); 0 = auto (the most that fit: 192 for head size 128, 256 below, 96 above).", 0, 256, **_GPU),
    Setting("KIE_GPU_ATT_SPLIT_KEYS", "int", 0,
            "CUDA engine, KIE_GPU_DECODE_ATTN=2: keys a split takes at most when the context passes "
            "KIE_GPU_ATT_KEYS; 0 = auto (96, or KIE_GPU_ATT_KEYS if less).", 0, 256, **_GPU),
    Setting("KIE_GPU_ATT_SPLITS", "int", 0,
            "CUDA engine, KIE_GPU_DECODE_ATTN=2: splits of a context at most (a longer split walks its keys in "
            "chunks of KIE_GPU_ATT_KEYS' most); 0 = auto (48).", 0, 1 << 16, **_GPU),
    Setting("KIE_GPU_ATT_HEADS", "int", 0,
            "CUDA engine, KIE_GPU_DECODE_ATTN=2: query heads a block; 0 = auto (one while the context fits one "
            "block, past it 2), 1 = one (a block each, the keys read once for each), 2 = every query head of a "
            "KV head, up to 8, sharing its keys.", 0, 2, **_GPU),
    Setting("KIE_GPU_GEMV_PIPE", "flag", 1,
            "CUDA engine: 1 has a GEMV load the next round's weights while it uses this round's.", 0, 1, **_GPU),
    Setting("KIE_GPU_L2_EVICT_FIRST", "int", -1,
            "CUDA engine: the weights' stream with L2's evict_first policy, so that the small data every step "
            "reads again (the norms' gamma, the RoPE row, the KV cache) stays in L2 beside them: 1 = the GEMVs' "
            "loads and the monokernel's ring copies, 0 = neither (the hardware's default policy), -1 = auto "
            "(the GEMVs' loads: 2 % faster on an H100; not the monokernel's copies).", -1, 1, **_GPU),
    Setting("KIE_GPU_GEMV_X_L1", "flag", 0,
            "CUDA engine: 1 has the o and down GEMVs read x through L1; 0 stages it in shared memory (3 % more "
            "tokens/s on an H100, 2b shape).", 0, 1, **_GPU),
    Setting("KIE_GPU_MONO_PREFETCH", "int", -1,
            "Monokernel: weight tiles past its shared-memory ring asked of L2 ahead of use; -1 = auto (none: "
            "5 and 16 tiles were 11 % and 30 % slower on the 2b shape, bench/RESULTS.md).", -1, 64, **_GPU),
    Setting("KIE_GPU_MONO_ATTN", "int", 0,
            "Monokernel: its attention stage: 0 = auto (2), 1 = split items (keys per split KIE_GPU_ATT_CHUNK, "
            "the last split combining; bit for bit KIE_GPU_DECODE_ATTN=1), 2 = a block's keys in shared memory, "
            "the rows of earlier steps copied before it waits for the QKV stage (KIE_GPU_DECODE_ATTN=2's "
            "arithmetic; keys a block KIE_GPU_ATT_KEYS, auto: the most that leave the weight ring 3 slots, and "
            "splits at most one a block per KV head).", 0, 2, **_GPU),
    Setting("KIE_GPU_MONO_WAIT_MS", "int", 0,
            "Monokernel: the bound on each of its waits (a stage's inputs, a weight tile, the lanes' sums), ms; "
            "a wait past it ends the step with a GpuError naming the stage. 0 = auto (2,000). Raise it to run "
            "under compute-sanitizer or a debugger, which slow the kernel past the default.", 0, 3600000, **_GPU),
    Setting("KIE_GPU_PREFILL", "choice", "auto",
            "CUDA engine: how a prompt runs: gemm (each weight matrix one cuBLAS product over a chunk of tokens), "
            "gemv (decode-shaped passes of a few tokens), or auto (gemm where cuBLAS can be loaded, else gemv).",
            values=("auto", "gemm", "gemv"), **_GPU),
    Setting("KIE_GPU_PREFILL_CHUNK", "int", 0,
            "CUDA engine: tokens of one batched prefill pass at most (its activations are allocated for them); "
            "0 = auto (1024, at most the context).", 0, 1 << 20, **_GPU),
    Setting("KIE_GPU_PREFILL_ATTN", "int", 0,
            "CUDA engine: the batched prefill's attention blocks: 0 = auto (split), 1 = launch order (a head's "
            "query tiles in turn), 2 = zigzag (the longest tiles first, then the shortest, so that the blocks an "
            "SM runs together add up to similar work), 3 = split (the longer half of the query tiles take two "
            "blocks, each half of the keys, the second to finish adding the other's share; heaviest blocks "
            "first).", 0, 3, **_GPU),
    Setting("KIE_GPU_PREFILL_F32_SUMS", "flag", 0,
            "CUDA engine, batched prefill with one lane and no delay: 1 has the o and down GEMMs add their "
            "products to the f32 residual themselves; 0 has them write bf16, which the next norm adds (as "
            "PyTorch's bf16 models do).", 0, 1, **_GPU),
    Setting("KIE_GPU_PREFILL_ATTN_KEYS", "int", 0,
            "CUDA engine: keys per tile of the batched prefill's attention: 0 = auto (32), 32, or 64 (two "
            "stages of tiles in shared memory instead of three; head sizes 64 and 128, others take 32).",
            0, 64, **_GPU),
    Setting("KIE_GPU_MONO_BLOCKS", "int", 0,
            "Monokernel: blocks of its grid; 0 = auto (every SM, or a share of them when lanes share the GPU).",
            0, 1 << 16, **_GPU),
)
BY_NAME = {s.name: s for s in SETTINGS}


def parse(setting, text):
    """The value of `text` for `setting` (surrounding blanks dropped), else its error naming both."""
    s = str(text).strip()
    if setting.kind == "choice":
        if s.lower() in setting.values:
            return s.lower()
        raise setting.error(f"{setting.name}={text!r}: expected one of {', '.join(setting.values)}")
    if setting.kind == "names":
        given = {part.strip().lower() for part in s.split(",")} - {""}
        if not given <= set(setting.values):
            raise setting.error(f"{setting.name}={text!r}: expected some of {', '.join(setting.values)}, "
                                f"comma-separated")
        return ",".join(v for v in setting.values if v in given)
    v = int(s, 10) if s.isascii() and s.lstrip("+-").isdigit() and len(s) <= 12 else None
    if setting.kind == "count":
        return parse_count(text, setting.name, setting.error)
    if setting.values:
        if v not in setting.values:
            raise setting.error(f"{setting.name}={text!r}: expected one of {', '.join(map(str, setting.values))}")
        return v
    if v is None or not setting.lo <= v <= setting.hi:
        what = "0 or 1" if setting.kind == "flag" else f"an integer in {setting.lo}..{setting.hi}"
        raise setting.error(f"{setting.name}={text!r}: expected {what}")
    return v


def parse_count(text, where, error=SettingError):
    """A positive whole number (a thread count), from the environment or a flag `where`."""
    s = str(text).strip()
    # ASCII digits only (str.isdigit also takes '²', which int() refuses), and a count a
    # BLAS's C int holds
    if not (s.isascii() and s.isdigit() and len(s) <= 6) or int(s) < 1:
        raise error(f"{where}={text!r}: expected a positive whole number")
    return int(s)


def _read(setting, environ):
    text = environ.get(setting.name, "")
    return None if text.strip() == "" else parse(setting, text)


def value(name, environ=None, default=None):
    """Setting `name` from the environment, parsed; its default (or `default` where the
    table's is decided at run time) when unset or blank."""
    environ = os.environ if environ is None else environ
    if environ is os.environ:
        warn_unknown()
    s = BY_NAME[name]
    v = _read(s, environ)
    if v is not None:
        return v
    return s.default if s.default is not None else default


def _edit_distance(a, b):
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        diag, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            diag, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diag + (ca != cb))
    return row[-1]


def closest(name) -> Optional[str]:
    """The setting nearest to `name` (itself when it is one; within 3 edits and fewer than
    half the letters after KIE_), else None."""
    best, best_d = None, 4
    for s in SETTINGS:
        d = _edit_distance(name, s.name)
        if d < best_d and 2 * d < len(name) - 4:
            best, best_d = s.name, d
    return best


# The launchers' rank variables (MPICH / Intel MPI, Open MPI, PMIx, Slurm, torchrun), as KCCL reads them.
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "RANK")
_warned = False


def unknown(environ=None):
    """The KIE_* variables of the environment that are no setting."""
    environ = os.environ if environ is None else environ
    return sorted(k for k in environ if k.startswith("KIE_") and k not in BY_NAME)


def warning_line(environ=None):
    """The line warn_unknown prints (None when every KIE_* variable is a setting)."""
    names = unknown(environ)
    if not names:
        return None
    parts = [f"{n} (did you mean {closest(n)}?)" if closest(n) else n for n in names]
    what = "not a KIE setting" if len(names) == 1 else "not KIE settings"
    return f"[kie pid {os.getpid()}] WARN {', '.join(parts)}: {what}, ignored (python -m kie_engine.settings lists them)"


def warn_unknown():
    """Prints warning_line() on stderr once per process; not on a rank other than 0 where
    the launcher names the ranks, so a job gets one line."""
    global _warned
    if _warned:
        return
    _warned = True
    for var in _RANK_VARS:
        if os.environ.get(var, "") != "":
            if os.environ[var] != "0":
                return
            break
    line = warning_line()
    if line:
        print(line, file=sys.stderr, flush=True)


def describe(environ=None):
    environ = os.environ if environ is None else environ
    w = max(len(s.name) for s in SETTINGS)
    lines = [f"{'setting':<{w}}  {'value':>8}  {'source':<8}  meaning"]
    for s in SETTINGS:
        v = _read(s, environ)
        shown = str(v if v is not None else "auto" if s.default is None else s.default) or '""'
        lines.append(f"{s.name:<{w}}  {shown:>8}  {'env' if v is not None else 'default':<8}  {s.doc}")
    extra = warning_line(environ)
    return "\n".join(lines + ([extra] if extra else []))


def main():
    try:
        print(describe())
    except (SettingError, GpuArgumentError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
