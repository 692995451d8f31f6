"""Worker-side task of the tensor-parallel engine tests (run through _harness's `call`)."""
import numpy as np


def kie_lane(ctx, uid, nranks, rank, model_dir, delay, prompt, new_tokens):
    """This rank's lane of the checkpoint: all prompt logits (chunked prefill), greedy
    tokens, and the logits of every decode step."""
    import kccl
    from kie_engine.formats.checkpoint import Checkpoint
    from kie_engine.generate import generate
    from kie_engine.lanes.plan import comm_config
    from kie_engine.reference.sharded import load_model
    ckpt = Checkpoint(model_dir, dtp_delay=delay)
    cfg = dict(comm_config(ckpt.config), timeout_ms=20000)
    with kccl.Communicator(nranks, kccl.UniqueId(uid), rank, config=cfg) as comm:
        model = load_model(ckpt, comm)
        prefill = model.prefill(prompt, chunk=5, all_logits=True)
        res = generate(model, prompt, new_tokens)
        model.reset()
        model.prefill(prompt)
        steps = np.stack([model.decode_step(t) for t in res.tokens[:-1]])
    return {"tokens": res.tokens, "prefill": prefill, "steps": steps}


def kie_cpu_lane(ctx, uid, nranks, rank, path, delay, prompt, new_tokens, teacher):
    """This rank's lane of a GGUF file on the native CPU engine (one thread): greedy
    tokens, the logits along `teacher` (the prompt's, then after each of its tokens but
    the last), and (query heads, MLP columns) of its share."""
    import kccl
    from kie_engine.cpu.engine import CpuModel
    from kie_engine.generate import generate
    from kie_engine.formats.gguf_io import GGUFCheckpoint
    from kie_engine.lanes.plan import comm_config
    ck = GGUFCheckpoint(path, dtp_delay=delay)
    cfg = dict(comm_config(ck.config), timeout_ms=60000)
    with kccl.Communicator(nranks, kccl.UniqueId(uid), rank, config=cfg) as comm:
        with CpuModel(ck, comm, max_seq=len(prompt) + new_tokens, threads=1) as m:
            res = generate(m, prompt, new_tokens)
            m.reset()
            logits = [m.prefill(prompt)] + [m.decode_step(t) for t in teacher[:-1]]
            plan = (m.lane.n_heads, m.lane.c1 - m.lane.c0)
            cpus = m.cpus
    return {"tokens": res.tokens, "logits": np.stack(logits), "plan": plan, "cpus": cpus}


def kie_cpu_lane_chunks(ctx, uid, nranks, rank, path, delay, prompt, threads=1):
    """This rank's lane of a GGUF file: the prompt's last logits token by token and in
    chunks of 7 rows; and two sequences decoding together against alone (with threads > 1,
    the batch step's threads take its work in pieces)."""
    import kccl
    from kie_engine.cpu.engine import CpuModel
    from kie_engine.formats.gguf_io import GGUFCheckpoint
    from kie_engine.lanes.plan import comm_config
    ck = GGUFCheckpoint(path, dtp_delay=delay)
    cfg = dict(comm_config(ck.config), timeout_ms=60000)
    with kccl.Communicator(nranks, kccl.UniqueId(uid), rank, config=cfg) as comm:
        with CpuModel(ck, comm, max_seq=len(prompt) + 8, threads=threads, max_rows=16) as m:
            tokens = m.prefill(prompt, chunk=1)
            alone = [m.decode_step(5)]
            m.reset()
            m.prefill([9, 10], chunk=1)
            alone.append(m.decode_step(11))
            m.reset()
            chunked = m.prefill(prompt, chunk=7)
            a, b = m.new_sequence(len(prompt) + 2), m.new_sequence(4)
            m.prefill_sequence(a, prompt)
            m.run_rows([b, b], [9, 10], [0, 0])
            together, _ = m.decode_rows([a, b], [5, 11])
    return {"tokens": tokens, "chunked": chunked, "alone": np.stack(alone), "together": together}
