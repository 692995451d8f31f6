"""Command line:

    python -m kie_engine init --config tiny|small|2b --dtp-delay D --out DIR [--seed S] [--force]
    [mpiexec -n N] python -m kie_engine generate --model DIR --prompt TEXT [--max-new-tokens 64]
        [--temperature T --top-k K --top-p P --seed S] [--ignore-eos] [--blas-threads N]

Under mpiexec every rank is a lane (tensor parallelism over KCCL); N = 1 needs no
mpiexec.  Rank 0 streams the text and prints the timing line."""
import argparse
import os
import sys

from .errors import KieError


def _world():
    """(size, rank) from the MPI launcher's environment (MPICH/Hydra or Open MPI), else (1, 0)."""
    for size_var, rank_var in (("PMI_SIZE", "PMI_RANK"), ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")):
        if size_var in os.environ:
            return int(os.environ[size_var]), int(os.environ.get(rank_var, 0))
    return 1, 0


def cmd_init(a):
    from .config import preset
    from .init import Progress, checkpoint_bytes, write_checkpoint
    cfg = preset(a.config, dtp_delay=a.dtp_delay)
    write_checkpoint(cfg, a.out, seed=a.seed, force=a.force,
                     progress=Progress(checkpoint_bytes(cfg), f"writing {a.out}"))
    print(f"wrote {a.out}: {a.config} ({cfg.n_params / 1e6:.1f} M parameters, {cfg.torch_dtype}), "
          f"dtp_delay={cfg.dtp_delay}")
    return 0


def cmd_generate(a):
    from .checkpoint import Checkpoint
    from .generate import Sampling, check_request, generate, printable
    from .threads import choose, my_cpus, set_blas_threads
    from .tokenizer import StreamDecoder, load_tokenizer
    from .tp import comm_config, load_model, plan, prefill_chunk
    size, rank = _world()
    # Everything that can be refused is checked before the first byte of output.
    sampling = Sampling(a.temperature, a.top_k, a.top_p, a.seed)
    ckpt = Checkpoint(a.model)
    cfg = ckpt.config
    tok = load_tokenizer(ckpt.tokenizer_path())
    plan(cfg, size)  # a bad split fails here, on every rank alike, before any rank connects
    ids = tok.encode(a.prompt).ids
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    if max(ids) >= cfg.vocab_size:
        raise KieError(f"the tokenizer produced id {max(ids)}, outside the model's vocab_size={cfg.vocab_size}")
    check_request(len(ids), a.max_new_tokens, cfg.max_position_embeddings)
    choose(a.blas_threads)  # a bad override fails here
    comm, node_cpus = None, None
    if size > 1:
        from mpi4py import MPI
        import kccl
        node_cpus = MPI.COMM_WORLD.allgather(sorted(my_cpus()))  # KCCL's ranks share one host
        comm = kccl.Communicator.from_mpi(MPI.COMM_WORLD, config=comm_config(cfg))
    threads = choose(a.blas_threads, node_cpus)[0]
    reported = sorted(set(set_blas_threads(threads).values()))
    blas = f"{threads} BLAS thread{'s' if threads > 1 else ''} per rank"
    if reported != [threads]:  # say so when the BLAS did not take it (or none was found to ask)
        blas += f" asked, the BLAS reports {reported or 'nothing'}"
    show = rank == 0
    if show:  # a byte that the terminal's encoding lacks is escaped, not an error
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        model = load_model(ckpt, comm)
        stream = StreamDecoder(tok)

        def on_token(t):
            if show:
                sys.stdout.write(printable(stream.push(t)))
                sys.stdout.flush()
        if show:
            sys.stdout.write(a.prompt)
        try:
            res = generate(model, ids, a.max_new_tokens, sampling, None if a.ignore_eos else cfg.eos_token_id,
                           on_token, prefill_chunk(cfg))
        finally:
            if show:  # what is held back, and the line ends before a summary or an error
                sys.stdout.write(printable(stream.flush()) + "\n")
                sys.stdout.flush()
        if show:
            lanes = f", {size} lanes" if size > 1 else ""
            print(f"[{res.summary()}; dtp_delay={cfg.dtp_delay}{lanes}, {blas}]", flush=True)
    finally:
        if comm is not None:
            comm.close()
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m kie_engine",
                                description="KIE: numpy inference of Laneformer models (Llama-format models whose "
                                            "config may add dtp_delay, Delayed Tensor Parallelism) over KCCL")
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init", help="write a randomly initialised checkpoint")
    i.add_argument("--config", required=True, choices=["tiny", "small", "2b"],
                   help="preset: tiny (tests), small (169 M parameters), 2b (1.9 B)")
    i.add_argument("--dtp-delay", type=int, default=0,
                   help="DTP delay written to config.json: 0 = plain Llama, d = sums consumed d sublayers late")
    i.add_argument("--out", required=True, help="directory to write (must not exist or be empty)")
    i.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    i.add_argument("--force", action="store_true", help="replace the checkpoint in a non-empty --out directory")
    g = sub.add_parser("generate", help="generate text from a prompt",
                       description="Streams the prompt and its continuation to stdout, then a line of timings. "
                                   "Under mpiexec -n N every rank holds 1/N of the model (tensor parallelism).")
    g.add_argument("--model", required=True, help="checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 (default) picks the most likely token (greedy)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens only; 0 = all")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens whose probabilities add up to P; 1 = all")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampler (same seed, same text)")
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    g.add_argument("--blas-threads", metavar="N",
                   help="BLAS threads per rank (default: this rank's CPUs over the ranks sharing them; "
                        "also KIE_BLAS_THREADS)")
    a = p.parse_args(argv)
    try:
        return (cmd_init if a.cmd == "init" else cmd_generate)(a)
    except (KieError, ValueError, FileNotFoundError) as e:
        if _world()[1] == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
