"""GPU failure behaviour with real processes (run on a GPU machine, under MPS
for several ranks on one GPU):

    python tests/gpu/failures.py [scenario ...]

Scenarios (2 ranks on GPU 0, spawned with multiprocessing so a rank can be
SIGKILLed without an MPI launcher tearing the job down; "the last rank" is rank 1):
  kill      the last rank is SIGKILLed while rank 0's kernel waits for it
  abort     the last rank calls abort() while rank 0's kernel waits for it
  mismatch  the ranks all-reduce different counts
  mismatchop, mismatchdtype  the same bytes with another operation (sum / max) or
            type (float16 / bfloat16): only the call signature tells them apart
  timeout   the last rank stays alive but never calls; KCCL_TIMEOUT_MS=1500
  kill+4ranks, mismatch+4ranks, mismatchop+4ranks, timeout+4ranks: the same with 4
            ranks (the last is rank 3) and KCCL_GPU_LL_HOPS=2, so the waits that fail are
            the two-hop path's
  close     use after close
  kill+replicas, mismatch+replicas, timeout+replicas: the same on a two-shot
            communicator with per-L2-partition flag replicas (KCCL_GPU_FLAG_REPLICAS=1),
            so the waits that fail are the chunked path's, polling a replica
  blocks, pull, llthreads, llhops, chunkthreads  the ranks ask for different
            KCCL_GPU_BLOCKS / KCCL_GPU_PULL / KCCL_GPU_LL_THREADS / KCCL_GPU_LL_HOPS /
            KCCL_GPU_CHUNK_THREADS: init fails on both
Each prints PASS/FAIL with what rank 0 saw and how long it took; the last
line is `GPU FAILURES: n passed, m failed`; exit 1 on any failure."""
import multiprocessing as mp
import os
import signal
import sys
import time

DETECT_S = 2.0
# scenario: (the setting, its value on rank 0 and on rank 1)
UNEQUAL = {"blocks": ("KCCL_GPU_BLOCKS", 0, 1), "pull": ("KCCL_GPU_PULL", 0, 1),
           "llthreads": ("KCCL_GPU_LL_THREADS", 256, 128), "llhops": ("KCCL_GPU_LL_HOPS", 1, 2),
           "chunkthreads": ("KCCL_GPU_CHUNK_THREADS", 256, 512)}


def ranks_of(scenario):
    return 4 if "+4ranks" in scenario else 2


def worker(scenario, uid, rank, q):
    import torch
    import kccl
    torch.cuda.set_device(0)
    nranks = ranks_of(scenario)
    last = nranks - 1
    scenario, _, variant = scenario.partition("+")
    cfg = {"KCCL_TIMEOUT_MS": 1500 if scenario == "timeout" else 20000}
    if variant == "replicas":
        cfg.update(KCCL_ALGO="twoshot", KCCL_GPU_FLAG_REPLICAS=1)
    if variant == "4ranks":
        cfg.update(KCCL_GPU_LL_HOPS=2)
    if scenario in UNEQUAL:  # settings that must be equal on all ranks, and are not
        name, v0, v1 = UNEQUAL[scenario]
        cfg.update({name: v1 if rank else v0, "KCCL_TIMEOUT_MS": 5000})
        try:
            kccl.Communicator(nranks, kccl.UniqueId(uid), rank, device=0, config=cfg).close()
            q.put({"rank": rank, "err": "none"})
        except kccl.KcclError as e:
            q.put({"rank": rank, "err": type(e).__name__, "msg": str(e)})
        return
    comm = kccl.Communicator(nranks, kccl.UniqueId(uid), rank, device=0, config=cfg)
    x = torch.ones(1024, device="cuda")
    comm.all_reduce(x)  # one good call first
    torch.cuda.synchronize()
    out = {"rank": rank, "first": float(x[0].item())}
    if variant == "replicas":
        out["replicas"] = comm.gpu_flag_replicas()["enabled"]
    try:
        if scenario in ("kill", "abort", "timeout") and rank == last:
            time.sleep(0.5)
            q.put({"rank": last, "t_event": time.monotonic()})
            if scenario == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif scenario == "abort":
                comm.abort()
                time.sleep(1.0)
                return
            else:
                time.sleep(4.0)  # alive, never calling
                comm.close()
                return
        if scenario == "mismatch":
            y = torch.ones(1000 + rank * 24, device="cuda")
            comm.all_reduce(y)
        elif scenario == "mismatchop":
            y = torch.ones(1024, device="cuda")
            comm.all_reduce(y, op=kccl.SUM if rank == 0 else kccl.MAX)
        elif scenario == "mismatchdtype":
            y = torch.ones(1024, device="cuda", dtype=torch.float16 if rank == 0 else torch.bfloat16)
            comm.all_reduce(y)
        elif scenario == "close":
            comm.close()
            try:
                comm.all_reduce(x)
                out["err"] = "none"
            except kccl.KcclError as e:
                out["err"] = type(e).__name__
                out["msg"] = str(e)
            q.put(out)
            return
        try:
            if not scenario.startswith("mismatch") and scenario != "close":
                comm.all_reduce(x)  # rank 0: the peer never answers this one
            torch.cuda.synchronize()
            # The failure recorded on the GPU surfaces here at the latest; it may
            # already surface at the call above (the watcher can record a dead
            # peer before that call is launched: seen with two-shot + replicas).
            comm.all_reduce(x)
            torch.cuda.synchronize()
            out["err"] = "none"
        except kccl.KcclError as e:
            out["err"] = type(e).__name__
            out["msg"] = str(e)
        out["t_err"] = time.monotonic()
        out["async"] = type(comm.async_error()).__name__ if not comm.closed else None
        comm.abort() if out["err"] != "none" else comm.close()
    except Exception as e:  # anything unexpected is a failure
        out["err"] = "unexpected " + type(e).__name__
        out["msg"] = str(e)
    q.put(out)


EXPECT = {"kill": "KcclRemoteError", "abort": "KcclRemoteError", "mismatch": "KcclRemoteError",
          "mismatchop": "KcclRemoteError", "mismatchdtype": "KcclRemoteError",
          "timeout": "KcclTimeout", "close": "KcclInvalidUsage", "kill+replicas": "KcclRemoteError",
          "mismatch+replicas": "KcclRemoteError", "timeout+replicas": "KcclTimeout", "blocks": "KcclInvalidUsage",
          "pull": "KcclInvalidUsage", "llthreads": "KcclInvalidUsage", "llhops": "KcclInvalidUsage",
          "chunkthreads": "KcclInvalidUsage", "kill+4ranks": "KcclRemoteError", "mismatch+4ranks": "KcclRemoteError",
          "mismatchop+4ranks": "KcclRemoteError", "timeout+4ranks": "KcclTimeout"}


def spawn_ranks(target, head, nranks, done, timeout_s):
    """Runs target(*head, uid, rank, q) in nranks spawned processes sharing a fresh KCCL
    unique id, and gathers their messages ({"rank": r, ...}, merged per rank) until
    done(got), every process is gone, or timeout_s; stragglers are killed."""
    import kccl
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = bytes(kccl.get_unique_id())
    procs = [ctx.Process(target=target, args=(*head, uid, r, q)) for r in range(nranks)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done(got):
        try:
            m = q.get(timeout=1)
        except Exception:
            if all(not p.is_alive() for p in procs):
                break
            continue
        got.setdefault(m["rank"], {}).update(m)
    for p in procs:
        p.join(timeout=20)
        if p.is_alive():
            p.kill()
    return got


def run(scenario):
    nranks = ranks_of(scenario)
    last = nranks - 1
    base = scenario.partition("+")[0]
    waited = range(1) if base in ("kill", "abort", "timeout") else range(nranks)
    got = spawn_ranks(worker, (scenario,), nranks, lambda got: all("err" in got.get(r, {}) for r in waited), 60)
    r0 = got.get(0, {})
    ok = r0.get("err") == EXPECT[scenario]
    why = f"rank 0 got {r0.get('err')}: {r0.get('msg', '')[:200]}"
    if "replicas" in r0:
        why += f"; replicas {'in use' if r0['replicas'] else 'NOT in use (calibration refused them)'}"
    if ok and base != "close" and base not in UNEQUAL and r0.get("async") != EXPECT[scenario]:
        ok = False
        why += f"; async_error() gave {r0.get('async')}"
    if ok and base in ("kill", "abort") and "t_event" in got.get(last, {}):
        delay = r0["t_err"] - got[last]["t_event"]
        why += f" ({delay:.2f} s after the event)"
        ok = delay < DETECT_S  # t_event is taken just before the kill / abort
    if ok and base in UNEQUAL:
        rl = got.get(last, {})
        ok = UNEQUAL[base][0] in r0.get("msg", "") and rl.get("err") == EXPECT[scenario]
        why += f"; rank {last} got {rl.get('err')}"
    if ok and base.startswith("mismatch"):  # every rank made a call that matches no other's
        others = [got.get(r, {}).get("err") for r in range(1, nranks)]
        ok = all(e == EXPECT[scenario] for e in others) and "mismatch" in r0.get("msg", "")
        why += f"; ranks 1..{last} got {others}"
    leftover = [n for n in os.listdir("/dev/shm") if n.startswith("kccl-")]
    if leftover:
        ok = False
        why += f"; /dev/shm leftovers {leftover}"
    print(("PASS " if ok else "FAIL ") + scenario + ": " + why, flush=True)
    return ok


def main(argv):
    scenarios = argv or list(EXPECT)
    results = [run(s) for s in scenarios]
    print(f"GPU FAILURES: {sum(results)} passed, {len(results) - sum(results)} failed", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
