"""How a model splits over KCCL ranks ("lanes"): what each lane holds, the communicator
settings the lanes need, and whether a number of lanes fits a model.  Plans only: the
engines (reference/sharded.py for the numpy model, cpu/ and gpu/) load their lane's
weights from these plans, and this module imports none of them.

Lane l of N holds:
  attention: query heads [l*H/N, (l+1)*H/N) and the KV heads they use: a contiguous
             share when N divides the KV head count, else (N a multiple of it) the
             one KV head of its query group, replicated on N/KV lanes;
  MLP:       a contiguous range of intermediate columns (gate/up rows, down columns),
             as equal as the size allows (any size works);
  LM head:   a contiguous vocabulary slice, padded to ceil(V/N) rows;
  the embedding table and the norms whole.
Row-parallel outputs (o_proj, down_proj) are partial sums, added up by KCCL's all-reduce
(the only communication of a block); the vocabulary slices are joined with all_gather.
KCCL reduces in rank order on every rank, so all lanes hold bitwise-identical residuals
and logits and pick the same tokens."""
from dataclasses import dataclass

import numpy as np

from ..errors import ShardingError

SLOT_BYTES = 1 << 20  # KCCL_BUFFER_BYTES of the engine's communicator: bounds one split-phase sum


def comm_config(cfg):
    """Communicator settings the engine needs: room for dtp_delay + 1 sums in flight."""
    return {"max_outstanding": cfg.dtp_delay + 1, "buffer_bytes": SLOT_BYTES}


def prefill_chunk(cfg):
    """Prompt tokens per forward pass, so one sublayer's sum fits a KCCL slot."""
    return max(1, SLOT_BYTES // (4 * cfg.hidden_size))


def plan(cfg, size, uneven=False):
    """(query heads per lane, KV heads per lane); ShardingError when N does not fit.
    uneven=True also takes N <= KV heads that does not divide them (lanes then hold
    different numbers of KV groups: kv_group_plan); the result is lane 0's share."""
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if uneven and size <= nkv and nkv % size:
        if cfg.intermediate_size < size:
            raise ShardingError(f"intermediate_size={cfg.intermediate_size} is smaller than the {size} ranks")
        groups = -(-nkv // size)
        return groups * (nh // nkv), groups
    if nh % size:
        raise ShardingError(f"num_attention_heads={nh} is not divisible by the {size} ranks (lanes); "
                            f"use a number of ranks that divides it")
    if nkv % size and size % nkv:
        raise ShardingError(f"num_key_value_heads={nkv} and {size} ranks: one must divide the other "
                            f"(KV heads are split across lanes or replicated on them)")
    if cfg.intermediate_size < size:
        raise ShardingError(f"intermediate_size={cfg.intermediate_size} is smaller than the {size} ranks")
    return nh // size, max(1, nkv // size)


def _bounds(n, size, rank):
    cuts = np.linspace(0, n, size + 1).round().astype(int)  # contiguous, sizes differ by <= 1
    return int(cuts[rank]), int(cuts[rank + 1])


@dataclass(frozen=True)
class LanePlan:
    """What lane `rank` of `size` holds: checkpoint rows of its query and KV heads,
    its MLP columns [c0, c1), its vocabulary slice [v0, v1) padded to `part` rows."""
    n_heads: int
    n_kv_heads: int
    q_rows: slice
    kv_rows: slice
    c0: int
    c1: int
    v0: int
    v1: int
    part: int


def lane_plan(cfg, rank, size, uneven=False, align=1):
    """Lane `rank`'s share: plan's even split, or (uneven=True, when the KV heads are
    not a multiple of the lanes) kv_group_plan's."""
    if uneven and size <= cfg.num_key_value_heads and cfg.num_key_value_heads % size:
        return kv_group_plan(cfg, size, align)[rank]
    nhl, nkvl = plan(cfg, size)
    hd, g = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    kv0 = (rank * nhl) // g  # first KV head used by this lane's query heads
    c0, c1 = _bounds(cfg.intermediate_size, size, rank)
    part = -(-cfg.vocab_size // size)
    v0, v1 = min(cfg.vocab_size, rank * part), min(cfg.vocab_size, (rank + 1) * part)
    return LanePlan(nhl, nkvl, slice(rank * nhl * hd, (rank + 1) * nhl * hd), slice(kv0 * hd, (kv0 + nkvl) * hd),
                    c0, c1, v0, v1, part)


def kv_group_plan(cfg, size, align=1):
    """LanePlans of `size` lanes, size <= KV heads: each lane holds whole KV groups (a KV
    head and its query heads), contiguous, the first nkv % size lanes one more; the MLP
    columns then even out the weights each lane streams (a lane with more attention gets
    fewer columns), cut on multiples of `align` (the down projection's block size, so
    that a lane's columns are whole blocks).  SmolLM2 (9 / 3 heads) on 2 lanes: 6 + 3
    query heads, 672 + 864 of 1536 columns."""
    nh, nkv, hd, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    inter, g = cfg.intermediate_size, nh // nkv
    if not 1 <= size <= nkv or inter < size * align:
        raise ShardingError(f"{size} lanes: a KV-group split needs 1..{nkv} lanes and intermediate_size="
                            f"{inter} of at least {size} x {align} columns")
    groups = [nkv // size + (1 if r < nkv % size else 0) for r in range(size)]
    per_group = (2 * g + 2) * hd * h     # q, k, v rows and o columns of one KV group
    per_col = 3 * h                      # gate and up rows, down column
    total = nkv * per_group + inter * per_col
    cuts, c = [0], 0
    for r in range(size - 1):
        want = (total / size - groups[r] * per_group) / per_col
        c = min(max(c + align, c + int(round(want / align)) * align), inter - (size - 1 - r) * align)
        cuts.append(c)
    cuts.append(inter)
    part = -(-cfg.vocab_size // size)
    out, kv0 = [], 0
    for r in range(size):
        q0 = kv0 * g
        v0, v1 = min(cfg.vocab_size, r * part), min(cfg.vocab_size, (r + 1) * part)
        out.append(LanePlan(groups[r] * g, groups[r], slice(q0 * hd, (q0 + groups[r] * g) * hd),
                            slice(kv0 * hd, (kv0 + groups[r]) * hd), cuts[r], cuts[r + 1], v0, v1, part))
        kv0 += groups[r]
    return out


def head_split_plan(cfg, size, align=1):
    """LanePlans of `size` lanes that split the query heads as evenly as possible (the
    first nh % size lanes one more) and the MLP columns evenly (cut on multiples of
    `align`); a KV group whose query heads fall on two lanes is on both (each computes its
    K and V: a few rows read twice).  Each sublayer is then as even as the heads allow,
    where kv_group_plan evens out only the whole layer (its lanes wait for each other at
    every sum).  SmolLM2 (9 / 3 heads) on 2 lanes: 5 + 4 query heads on KV groups 0-1 and
    1-2, 768 + 768 columns.  A lane's first query head is q_rows.start // head_dim; its
    place in its first group is that minus kv_rows.start // head_dim x the group size."""
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inter, g = cfg.intermediate_size, nh // nkv
    if not 1 <= size <= nh or inter < size * align:
        raise ShardingError(f"{size} lanes: a query-head split needs 1..{nh} lanes and intermediate_size="
                            f"{inter} of at least {size} x {align} columns")
    blocks = inter // align
    part = -(-cfg.vocab_size // size)
    out, h0 = [], 0
    for r in range(size):
        n = nh // size + (1 if r < nh % size else 0)
        k0, k1 = h0 // g, (h0 + n - 1) // g + 1
        c0, c1 = blocks * r // size * align, (blocks * (r + 1) // size * align if r < size - 1 else inter)
        v0, v1 = min(cfg.vocab_size, r * part), min(cfg.vocab_size, (r + 1) * part)
        out.append(LanePlan(n, k1 - k0, slice(h0 * hd, (h0 + n) * hd), slice(k0 * hd, k1 * hd), c0, c1, v0, v1, part))
        h0 += n
    return out
