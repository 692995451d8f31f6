"""The server's counters in Prometheus' text exposition format (version 0.0.4), kept by
hand: a few counters, gauges and histograms need no client library.  Updated from the
event loop and from the engine thread, hence the lock."""
import threading

# Seconds; TTFT includes the wait in the queue.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
# Sequences per engine step (continuous batching)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


class Histogram:
    def __init__(self, buckets):
        self.bounds = tuple(buckets)
        self.counts = [0] * len(self.bounds)
        self.sum, self.count = 0.0, 0

    def observe(self, v):
        for i, b in enumerate(self.bounds):
            if v <= b:
                self.counts[i] += 1
                break
        self.sum += v
        self.count += 1

    def lines(self, name):
        acc = 0
        for b, c in zip(self.bounds, self.counts):
            acc += c
            yield f'{name}_bucket{{le="{b:g}"}} {acc}'
        yield f'{name}_bucket{{le="+Inf"}} {self.count}'
        yield f"{name}_sum {self.sum:.9g}"
        yield f"{name}_count {self.count}"


def _label(v):
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self, model_id):
        self.model_id = model_id
        self.lock = threading.Lock()
        self.requests = {}       # (endpoint, status code) -> count
        self.finished = {}       # finish reason (stop, length, cancelled, error, shutdown) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.batch = Histogram(BATCH_BUCKETS)
        self.batch_rows = 0      # rows (prompt and generated tokens) over all steps
        self.queue_length = lambda: 0
        self.running = lambda: 0
        self.kv_bytes = lambda: 0  # KV cache the running requests hold (continuous batching)
        self.sequences = lambda: 0  # the engine's live sequences (continuous batching)

    def request(self, endpoint, status):
        with self.lock:
            k = (endpoint, int(status))
            self.requests[k] = self.requests.get(k, 0) + 1

    def finish(self, reason, prompt_tokens, generation_tokens):
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens

    def first_token(self, seconds):
        with self.lock:
            self.ttft.observe(seconds)

    def next_token(self, seconds):
        with self.lock:
            self.itl.observe(seconds)

    def batch_step(self, sequences, rows):
        """One engine step over `sequences` sequences and `rows` rows (batching only)."""
        with self.lock:
            self.batch.observe(sequences)
            self.batch_rows += rows

    def render(self):
        m = f'model="{_label(self.model_id)}"'
        with self.lock:
            out = ["# HELP kie_requests_total HTTP requests answered, by endpoint and status code.",
                   "# TYPE kie_requests_total counter"]
            out += [f'kie_requests_total{{{m},endpoint="{_label(e)}",code="{c}"}} {n}'
                    for (e, c), n in sorted(self.requests.items())]
            out += ["# HELP kie_requests_finished_total Generations ended, by how they ended.",
                    "# TYPE kie_requests_finished_total counter"]
            out += [f'kie_requests_finished_total{{{m},reason="{_label(r)}"}} {n}'
                    for r, n in sorted(self.finished.items())]
            out += ["# HELP kie_prompt_tokens_total Prompt tokens of the generations run.",
                    "# TYPE kie_prompt_tokens_total counter", f"kie_prompt_tokens_total{{{m}}} {self.prompt_tokens}",
                    "# HELP kie_generation_tokens_total Tokens generated.",
                    "# TYPE kie_generation_tokens_total counter",
                    f"kie_generation_tokens_total{{{m}}} {self.generation_tokens}",
                    "# HELP kie_time_to_first_token_seconds From a request's arrival (queue wait included) "
                    "to its first generated token.",
                    "# TYPE kie_time_to_first_token_seconds histogram"]
            out += [_with_label(x, m) for x in self.ttft.lines("kie_time_to_first_token_seconds")]
            out += ["# HELP kie_inter_token_latency_seconds Between consecutive generated tokens of a request.",
                    "# TYPE kie_inter_token_latency_seconds histogram"]
            out += [_with_label(x, m) for x in self.itl.lines("kie_inter_token_latency_seconds")]
            out += ["# HELP kie_batch_size_per_step Sequences in each engine step (continuous batching; the mean "
                    "over any window: the _sum's rate over the _count's).",
                    "# TYPE kie_batch_size_per_step histogram"]
            out += [_with_label(x, m) for x in self.batch.lines("kie_batch_size_per_step")]
            out += ["# HELP kie_batch_rows_total Rows (prompt and generated tokens) the engine steps ran.",
                    "# TYPE kie_batch_rows_total counter", f"kie_batch_rows_total{{{m}}} {self.batch_rows}"]
        out += ["# HELP kie_queue_length Requests waiting for the engine (not counting the one running).",
                "# TYPE kie_queue_length gauge", f"kie_queue_length{{{m}}} {self.queue_length()}",
                "# HELP kie_requests_running Requests the engine is running (up to --max-batch).",
                "# TYPE kie_requests_running gauge", f"kie_requests_running{{{m}}} {self.running()}",
                "# HELP kie_batch_size Sequences in the engine's batch now (the requests running; 0 when idle).",
                "# TYPE kie_batch_size gauge", f"kie_batch_size{{{m}}} {self.running()}",
                "# HELP kie_kv_cache_bytes KV cache the running requests hold (continuous batching).",
                "# TYPE kie_kv_cache_bytes gauge", f"kie_kv_cache_bytes{{{m}}} {self.kv_bytes()}",
                "# HELP kie_engine_sequences Sequences (KV caches) the engine holds for requests.",
                "# TYPE kie_engine_sequences gauge", f"kie_engine_sequences{{{m}}} {self.sequences()}"]
        return "\n".join(out) + "\n"


def _with_label(line, label):
    """Adds the model label to a histogram line (with or without labels of its own)."""
    name, rest = line.split(" ", 1)
    if "{" in name:
        return name.replace("{", "{" + label + ",", 1) + " " + rest
    return f"{name}{{{label}}} {rest}"
