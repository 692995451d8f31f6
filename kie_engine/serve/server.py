"""`python -m kie_engine serve`: loads the model once (every rank its lane), then rank 0
serves HTTP with uvicorn while the other ranks follow its requests (lanes.py).

Shutdown (SIGTERM or SIGINT; under mpiexec every rank gets it, the lanes leave it to rank
0): no new requests, the waiting ones get 503, the running one may finish within
--shutdown-grace seconds and is cut after that; open connections get a few seconds more to
read their end; then the engine thread tells the lanes to stop, every rank closes its
KCCL communicator, and each process returns 0."""
import asyncio
import os
import signal
import socket
import sys
import time

SHUTDOWN_CONNECTIONS_S = 3  # after the engine stopped: time for clients to read their last bytes


def served_name(model):
    """The model id clients name: the short name as given, else the file or directory name."""
    base = os.path.basename(os.path.normpath(model))
    return base[:-5] if base.endswith(".gguf") else base


def _listen(host, port):
    """A listening socket on host:port; an address that cannot be had (in use, not this
    machine's, not an address) is an OSError naming it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(256)
    except OSError as e:
        sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise OSError(f"cannot listen on {where}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock


def serve(a, world):
    from ..lanes.start import Lane
    from ..lanes.plan import prefill_chunk
    from .engine_runner import EngineRunner
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port must be in 0..65535 (0 picks a free one), got {a.port}")
    if a.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {a.max_queue}")
    if not a.shutdown_grace >= 0:
        raise ValueError(f"--shutdown-grace must be >= 0, got {a.shutdown_grace}")
    if a.max_batch is not None and a.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {a.max_batch}")
    if a.kv_memory is not None and not a.kv_memory > 0:
        raise ValueError(f"--kv-memory must be > 0 (MiB), got {a.kv_memory}")
    check_http_stack(a)
    lane = Lane(a, world)
    ckpt, cfg, size, rank = lane.ckpt, lane.cfg, lane.size, lane.rank
    tok = ckpt.tokenizer()
    template = ckpt.chat_template()
    max_batch = batch_size(a, lane.kernel, size)
    if rank == 0:  # before the model loads: a taken port fails at once
        sock = _listen(a.host, a.port)
    link, runner = None, None
    try:
        lane.connect()
        if size > 1:
            from mpi4py import MPI
            from .lanes import LaneLink
            link = LaneLink(MPI.COMM_WORLD)
        context = cfg.max_position_embeddings
        kv_bytes = kv_limit(a)
        model = lane.load(context, native={"kv_limit": kv_bytes} if max_batch > 1 else None)
        runner = EngineRunner(model, context, lane.gpu, prefill_chunk(cfg), link, source=ckpt.dir)
        if rank != 0:
            link.follow(runner)
            return 0
        stop = {cfg.eos_token_id} - {None}
        chat_stop = set(stop)
        if template is not None:
            eot = template.end_of_turn(tok)
            if eot is not None:
                chat_stop.add(eot)
        return _serve_http(a, sock, size, cfg, tok, template, stop, chat_stop, runner, context, max_batch, ckpt.dir,
                           kv_bytes)
    finally:
        if link is not None and link.leader:
            link.finish()  # whatever happened on rank 0, the lanes must not wait forever
        if runner is not None:
            runner.close()
        lane.close()


# Sequences per step when --max-batch is not given, for the native CPU engine on one lane:
# on the 2-core machine of bench/RESULTS.md a step of 8 sequences costs about what 2.5
# single steps do (the weights are read once), 4 about 1.4-1.7.
DEFAULT_MAX_BATCH = 8


def batch_size(a, kernel, lanes):
    """--max-batch, checked: continuous batching needs the native CPU engine on one lane."""
    if a.max_batch is None:
        return DEFAULT_MAX_BATCH if kernel == "native" and lanes == 1 else 1
    if a.max_batch > 1 and (kernel != "native" or lanes > 1):
        raise ValueError(f"--max-batch {a.max_batch}: several requests per step run on the native CPU engine on one "
                         f"lane (this server: --kernel {kernel}, {lanes} lanes); use --max-batch 1")
    return a.max_batch


def kv_limit(a):
    """Bytes the requests' KV caches may take together: --kv-memory MiB, else half of the
    memory available now."""
    if a.kv_memory is not None:
        return int(a.kv_memory * (1 << 20))
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        avail = 8 << 30
    return avail // 2


def _installed(module):
    import importlib.util
    return importlib.util.find_spec(module) is not None


def check_http_stack(a):
    """--http httptools and --loop uvloop need their modules: a ValueError before the model
    loads, not uvicorn's failure once it does."""
    for flag, name in (("--http", getattr(a, "http", "auto")), ("--loop", getattr(a, "loop", "auto"))):
        if name in ("httptools", "uvloop") and not _installed(name):
            raise ValueError(f"{flag} {name}: {name} is not installed (pip install {name}, or {flag} auto)")


def _loop_factory(name):
    """The event loop's constructor for --loop (checked in serve): uvloop's where asked for or
    (auto) installed; None is asyncio's own."""
    if name == "asyncio" or not _installed("uvloop"):
        return None
    import uvloop
    return uvloop.new_event_loop


def _run(coro, factory):
    """asyncio.run on factory's loop (None: asyncio's own): asyncio.Runner from Python 3.11, by
    hand on 3.10."""
    if factory is None:
        return asyncio.run(coro)
    if hasattr(asyncio, "Runner"):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(coro)
    loop = factory()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _serve_http(a, sock, size, cfg, tok, template, stop, chat_stop, runner, context, max_batch, source, kv_bytes):
    import uvicorn
    from .app import ServeState, build_app
    from .metrics import Metrics
    from .scheduler import Scheduler
    model_id = a.served_model_name or served_name(a.model)
    metrics = Metrics(model_id)
    server_box = []

    def fatal(e):  # the lanes broke: no request can run any more, so the server ends (exit 1)
        if server_box:
            server_box[0].failed = e
            server_box[0].should_exit = True

    if max_batch > 1:
        from .batcher import BatchScheduler
        scheduler = BatchScheduler(runner.model, tok, metrics, max_batch, a.max_queue, source=source, on_fatal=fatal,
                                   kv_limit=kv_bytes)
    else:
        scheduler = Scheduler(runner, tok, metrics, a.max_queue, on_fatal=fatal)
    st = ServeState(model_id, context, cfg.vocab_size, tok, template, frozenset(stop), frozenset(chat_stop),
                    scheduler, metrics, size, int(time.time()))
    app = build_app(st)

    class Server(uvicorn.Server):
        failed = None

        def handle_exit(self, sig, frame):
            # uvicorn's own handler also re-raises the signal once serving ends, which
            # would end the process by the signal instead of exit status 0.
            scheduler.shutdown(a.shutdown_grace)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    config = uvicorn.Config(app, log_level=a.log_level, access_log=a.log_level in ("debug", "info"),
                            timeout_graceful_shutdown=a.shutdown_grace + SHUTDOWN_CONNECTIONS_S, lifespan="off",
                            http=getattr(a, "http", "auto"))
    server = Server(config)
    server_box.append(server)
    scheduler.start()
    host, port = sock.getsockname()[:2]
    where = f"[{host}]" if ":" in host else host
    lanes = f", {size} lanes" if size > 1 else ""
    batch = f", batches of up to {max_batch}" if max_batch > 1 else ""
    print(f"KIE serving {model_id} ({a.device}{lanes}, context {context}{batch}) at http://{where}:{port}", flush=True)
    try:
        _run(server.serve(sockets=[sock]), _loop_factory(getattr(a, "loop", "auto")))
    finally:
        scheduler.shutdown(0)
        if not scheduler.join(timeout=60):
            print("kie serve: the engine thread did not stop", file=sys.stderr, flush=True)
    if server.failed is not None:
        print(f"kie serve: stopped: the engine failed ({type(server.failed).__name__}: {server.failed})",
              file=sys.stderr, flush=True)
        return 1
    print("KIE server stopped", flush=True)
    return 0
