"""Command line:

    python -m kie_engine init --config tiny|small|2b --dtp-delay D --out DIR [--seed S] [--force]
    [mpiexec -n N] python -m kie_engine generate --model DIR|FILE.gguf|smollm2 --prompt TEXT [--chat]
        [--max-new-tokens N] [--temperature T --top-k K --top-p P --seed S] [--ignore-eos]
        [--threads N] [--blas-threads N] [--device cpu|cuda] [--kernel native|numpy|graph|mono]
        [--kv-cache f16|f32]
    python -m kie_engine convert --model FILE.gguf|smollm2 --out DIR [--dtype bfloat16|float32]
    python -m kie_engine convert --model FILE.gguf|smollm2 --quantize q8_0|q4_0|q4_1|q4_k --out FILE.gguf
    [mpiexec -n N] python -m kie_engine serve --model DIR|FILE.gguf|smollm2 [--host 127.0.0.1] [--port 8000]
        [--max-queue 32] [--device ... --kernel ... --threads N --kv-cache ...] (an OpenAI-compatible HTTP
        server; docs/serving.md)
    [mpiexec -n N] python -m kie_engine perplexity --model M --file TEXT [--tokens 512] [--kernel ...] [--reference]
        (docs/numerics.md)

generate, serve and perplexity share the flags that say which model runs where (--model, --device,
--kernel, --threads, --blas-threads, --kv-cache: lane.add_lane_args) and a rank's start-up (lane.Lane).

Under mpiexec every rank is a lane (tensor parallelism over KCCL); N = 1 needs no
mpiexec.  Rank 0 streams the text and prints the timing line."""
import argparse
import os
import sys

from .errors import CheckpointError, KieError
from .lanes.start import add_lane_args

COMPLETION_MAX_NEW_TOKENS = 64
CHAT_MAX_NEW_TOKENS = 512  # an answer of a few paragraphs; most end earlier, at the end of turn


def _world():
    """(size, rank) from the MPI launcher's environment (MPICH/Hydra or Open MPI), else (1, 0)."""
    for size_var, rank_var in (("PMI_SIZE", "PMI_RANK"), ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")):
        if size_var in os.environ:
            size, rank = os.environ[size_var].strip(), os.environ.get(rank_var, "0").strip()
            if not (size.isascii() and size.isdigit() and rank.isascii() and rank.isdigit()
                    and 0 <= int(rank) < int(size) <= 1 << 20):
                raise KieError(f"{size_var}={size!r}, {rank_var}={rank!r}: the MPI launcher's world size and "
                               f"rank are not a rank in 0..size-1")
            return int(size), int(rank)
    return 1, 0


def default_max_new_tokens(chat, n_prompt, context):
    """--max-new-tokens when not given: a completion's 64; a chat answer runs to its end of
    turn, so CHAT_MAX_NEW_TOKENS or what the context leaves after the prompt (at least 1: a
    prompt that fills the context is then refused as too long)."""
    if not chat:
        return COMPLETION_MAX_NEW_TOKENS
    return max(1, min(CHAT_MAX_NEW_TOKENS, context - n_prompt))


def cmd_init(a):
    from .formats.config import preset
    from .formats.init import Progress, checkpoint_bytes, write_checkpoint
    cfg = preset(a.config, dtp_delay=a.dtp_delay)
    write_checkpoint(cfg, a.out, seed=a.seed, force=a.force,
                     progress=Progress(checkpoint_bytes(cfg), f"writing {a.out}"))
    print(f"wrote {a.out}: {a.config} ({cfg.n_params / 1e6:.1f} M parameters, {cfg.torch_dtype}), "
          f"dtp_delay={cfg.dtp_delay}")
    return 0


def cmd_convert(a):
    if a.quantize:
        from .formats.gguf_write import quantize_gguf
        from .formats.sources import resolve
        kinds = quantize_gguf(resolve(a.model), a.out, a.quantize)
        counts = {}
        for t in kinds.values():
            counts[t] = counts.get(t, 0) + 1
        print(f"wrote {a.out}: {len(kinds)} tensors, " + ", ".join(f"{n} {t}" for t, n in sorted(counts.items())))
        return 0
    from .formats.convert import convert
    from .formats.sources import open_checkpoint
    ckpt = open_checkpoint(a.model)
    convert(ckpt, a.out, a.dtype)
    print(f"wrote {a.out}: {ckpt.config.n_params / 1e6:.1f} M parameters, {a.dtype}")
    return 0


def cmd_generate(a):
    from .generate import Sampling, SamplingError, check_request, generate, printable
    from .lanes.start import Lane
    from .formats.tokenizer import StreamDecoder
    from .lanes.plan import prefill_chunk
    # Everything that can be refused is checked before the first byte of output.
    try:
        sampling = Sampling(a.temperature, a.top_k, a.top_p, a.seed)
    except SamplingError as e:  # named as the flag the user typed
        raise ValueError(f"--{e.param.replace('_', '-')} {e.rule}, got {e.value}") from None
    lane = Lane(a, _world())
    ckpt, cfg, kernel = lane.ckpt, lane.cfg, lane.kernel
    tok = ckpt.tokenizer()
    stop = {cfg.eos_token_id} - {None}
    if a.chat:
        template = ckpt.chat_template()
        if template is None:
            raise CheckpointError(f"{a.model}: --chat needs a chat template, and this model has none")
        ids = template.encode(tok, a.prompt)
        eot = template.end_of_turn(tok)
        if eot is not None:
            stop.add(eot)
    else:
        ids = tok.encode(a.prompt).ids
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    if max(ids) >= cfg.vocab_size:
        raise KieError(f"the tokenizer produced id {max(ids)}, outside the model's vocab_size={cfg.vocab_size}")
    if a.max_new_tokens is None:
        a.max_new_tokens = default_max_new_tokens(a.chat, len(ids), cfg.max_position_embeddings)
    check_request(len(ids), a.max_new_tokens, cfg.max_position_embeddings)
    show = lane.rank == 0
    if show:  # a byte that the terminal's encoding lacks is escaped, not an error
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        # sized for this request, not the context the checkpoint claims (its RoPE tables are dense)
        model = lane.load(min(cfg.max_position_embeddings, len(ids) + a.max_new_tokens))
        threads, why, native = lane.threads, lane.why, lane.native
        blas = f"{threads} BLAS thread{'s' if threads > 1 else ''} per rank ({why})"
        if lane.blas_reported != [threads] and not native:  # say so when the BLAS did not take it
            blas += f" asked, the BLAS reports {lane.blas_reported or 'nothing'}"
        if native:
            info = model.info()
            blas = (f"native CPU engine ({info['kernels']} kernels), {threads} thread{'s' if threads > 1 else ''} "
                    f"per rank ({why})")
        stream = StreamDecoder(tok)

        def on_token(t):
            if show:
                sys.stdout.write(printable(stream.push(t)))
                sys.stdout.flush()
        if show and not a.chat:  # a completion continues the prompt; a chat answer stands alone
            sys.stdout.write(a.prompt)
        stop_ids = None if a.ignore_eos else stop
        try:
            res = generate(model, ids, a.max_new_tokens, sampling, stop_ids, on_token, prefill_chunk(cfg),
                           source=ckpt.dir)
        finally:
            if show:  # what is held back, and the line ends before a summary or an error
                sys.stdout.write(printable(stream.flush()) + "\n")
                sys.stdout.flush()
        if show:
            lanes = f", {lane.size} lanes" if lane.size > 1 else ""
            where = f"cuda, {kernel} kernel" if lane.gpu else blas if kernel != "numpy" else f"numpy, {blas}"
            cut = ""
            if not res.stopped_on_eos and not a.ignore_eos:  # say so: the text ends mid-answer
                cut = f"; cut at --max-new-tokens {a.max_new_tokens} before the end of {'turn' if a.chat else 'text'}"
            print(f"[{res.summary()}{cut}; dtp_delay={cfg.dtp_delay}{lanes}, {where}]", flush=True)
    finally:
        lane.close()
    return 0


def cmd_perplexity(a):
    import json
    from .lanes.start import Lane
    from .perplexity import check_file, describe_engine, reference_logprobs, report_lines, score, text_ids
    check_file(a.file)
    lane = Lane(a, _world())
    ckpt, cfg = lane.ckpt, lane.cfg
    ids = text_ids(ckpt.tokenizer(), a.file, a.tokens)
    if max(ids) >= cfg.vocab_size:
        raise KieError(f"the tokenizer produced id {max(ids)}, outside the model's vocab_size={cfg.vocab_size}")
    if len(ids) > cfg.max_position_embeddings:
        raise ValueError(f"--tokens {a.tokens}: the model's context holds {cfg.max_position_embeddings}")
    try:
        lane.connect()
        ref = reference_logprobs(ckpt, ids) if a.reference and lane.rank == 0 else None
        model = lane.load(len(ids))
        s = score(model, ids, ref, source=ckpt.dir).summary()
        if lane.rank == 0:
            for line in report_lines(s, a.reference):
                print(line, flush=True)
            if a.json:
                s.update(model=a.model, file=a.file, kernel=describe_engine(model, lane.kernel, lane.size),
                         lanes=lane.size)
                with open(a.json, "w") as f:
                    json.dump(s, f, indent=1)
    finally:
        lane.close()
    return 0


def cmd_serve(a):
    try:
        from .serve.server import serve
    except ImportError as e:
        raise KieError(f"serve needs the serve extra (pip install -e '.[serve]'): {e}") from None
    return serve(a, _world())


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m kie_engine",
                                description="KIE: inference of Laneformer models (Llama-format models whose config "
                                            "may add dtp_delay, Delayed Tensor Parallelism) over KCCL, in numpy "
                                            "or on CUDA GPUs")
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
    add_lane_args(g)
    g.add_argument("--prompt", required=True, help="text to continue (with --chat: the user's message)")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template (one user turn); stop at its end of turn")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"tokens to generate at most (default {COMPLETION_MAX_NEW_TOKENS}; with --chat "
                        f"{CHAT_MAX_NEW_TOKENS}, or what the context leaves after the prompt if less); the "
                        "timing line says when it cut the text short")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 (default) picks the most likely token (greedy)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens only; 0 = all")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens whose probabilities add up to P; 1 = all")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampler (same seed, same text)")
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    c = sub.add_parser("convert", help="write a model (GGUF file, short name) as a Hugging Face safetensors directory, "
                                       "or (--quantize) as a GGUF file in other block types")
    c.add_argument("--model", required=True, help="a .gguf file, or smollm2")
    c.add_argument("--out", required=True)
    c.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    c.add_argument("--quantize", choices=["q8_0", "q4_0", "q4_1", "q4_k"],
                   help="write a GGUF file (--out FILE.gguf) with the matrices in these blocks instead of a "
                        "safetensors directory (q4_k: llama.cpp's Q4_K_M mix of Q4_K and Q6_K)")
    s = sub.add_parser("serve", help="serve the model over HTTP (OpenAI-compatible API and a chat page)",
                       description="An OpenAI-compatible server: /v1/chat/completions, /v1/completions, /v1/models, "
                                   "/health, /metrics, and a chat page at /.  Up to --max-batch requests decode "
                                   "together; the others wait in a FIFO queue.  Under mpiexec -n N rank 0 serves and every rank is a lane.")
    add_lane_args(s)
    s.add_argument("--served-model-name", help="the model id clients name (default: the --model name)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one, printed)")
    s.add_argument("--max-queue", type=int, default=32,
                   help="requests that may wait behind the running one; more get 429 (default 32)")
    s.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help="requests that decode together, one pass over the weights per step (continuous batching: "
                        "the native CPU engine on one lane; default 8 there, else 1)")
    s.add_argument("--kv-memory", type=float, default=None, metavar="MIB",
                   help="MiB the running requests' KV caches may take together (default: half the memory "
                        "available at start); a request that cannot fit even alone gets 400")
    s.add_argument("--shutdown-grace", type=float, default=1.0,
                   help="on SIGTERM, seconds the running request may still take before it is cut (default 1)")
    s.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="warning",
                   help="uvicorn's log level; info and debug also log every request (default warning)")
    s.add_argument("--http", choices=["auto", "h11", "httptools"], default="auto",
                   help="uvicorn's HTTP implementation (default auto: httptools where installed, else h11)")
    s.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                   help="the event loop (default auto: uvloop where installed, else asyncio's)")
    q = sub.add_parser("perplexity", help="how well the model predicts a text file, and (--reference) how far this "
                                          "engine is from the float32 reference",
                       description="The first --tokens tokens of the file (with BOS where the tokenizer adds one) "
                                   "in one teacher-forced pass; prints 'perplexity X over N-1 tokens'.  Under "
                                   "mpiexec -n N every rank is a lane.")
    add_lane_args(q)
    q.add_argument("--file", required=True, help="a UTF-8 text file")
    q.add_argument("--tokens", type=int, default=512, help="tokens of the file to use, N (default 512): N - 1 "
                                                           "predictions are scored")
    q.add_argument("--reference", action="store_true",
                   help="also the mean KL divergence and top-1 agreement against the float32 reference (the numpy "
                        "engine at TP = 1, on rank 0)")
    q.add_argument("--json", metavar="FILE", help="also write the figures to FILE (JSON)")
    a = p.parse_args(argv)
    try:
        return {"init": cmd_init, "generate": cmd_generate, "convert": cmd_convert, "serve": cmd_serve,
                "perplexity": cmd_perplexity}[a.cmd](a)
    except (KieError, ValueError, FileNotFoundError, OSError) as e:
        try:
            rank = _world()[1]
        except KieError:  # the launcher's variables are what is wrong
            rank = 0
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
