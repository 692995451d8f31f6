"""Tensor parallelism: TP = 2, 3, 4 lanes (real processes over KCCL) give the same tokens
as TP = 1 and the same logits within float tolerance (the lanes add partial sums in a
different order), for DTP delay 0, 1 and 2; every rank gives the same answer."""
import numpy as np
import pytest

pytest.importorskip("tokenizers")  # the kie extra (CI installs it)

import kccl
from kie_engine.formats.checkpoint import Checkpoint
from kie_engine.formats.config import ModelConfig
from kie_engine.errors import ShardingError
from kie_engine.generate import generate
from kie_engine.formats.init import write_checkpoint
from kie_engine.reference.sharded import load_model
from kie_engine.lanes.plan import plan

# A: 12 query / 2 KV heads (TP 2 splits KV heads, TP 4 replicates them), MLP width and
# vocabulary not multiples of the lane count.  B: 6 / 3 heads for TP 3.
MODELS = {
    "A": ModelConfig(vocab_size=263, hidden_size=48, intermediate_size=150, num_hidden_layers=3,
                     num_attention_heads=12, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                     tie_word_embeddings=False, torch_dtype="bfloat16"),
    "B": ModelConfig(vocab_size=270, hidden_size=36, intermediate_size=97, num_hidden_layers=2,
                     num_attention_heads=6, num_key_value_heads=3, head_dim=6, max_position_embeddings=64,
                     tie_word_embeddings=True, torch_dtype="float32"),
}
PROMPT = [256, 10, 200, 33, 7, 99, 150, 3, 18, 250, 42, 11, 64]
NEW = 10


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kie_tp")
    return {k: write_checkpoint(cfg, str(root / k), seed=5) for k, cfg in MODELS.items()}


def _single(path, delay):
    model = load_model(Checkpoint(path, dtp_delay=delay))
    prefill = model.prefill(PROMPT, all_logits=True)
    res = generate(model, PROMPT, NEW)
    model.reset()
    model.prefill(PROMPT)
    return res.tokens, prefill, np.stack([model.decode_step(t) for t in res.tokens[:-1]])


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name,n,delay", [("A", 2, 0), ("A", 2, 1), ("A", 2, 2), ("A", 4, 0), ("A", 4, 1),
                                          ("B", 3, 0), ("B", 3, 1)])
def test_lanes_match_one_lane(farms, ckpt_dirs, name, n, delay):
    tokens, prefill, steps = _single(ckpt_dirs[name], delay)
    res = farms.farm().run("call", range(n), per_worker=[{"rank": r} for r in range(n)], module="_kie_tasks",
                           func="kie_lane", uid=bytes(kccl.get_unique_id()), nranks=n, model_dir=ckpt_dirs[name],
                           delay=delay, prompt=PROMPT, new_tokens=NEW)
    for r, out in enumerate(res):
        assert out["tokens"] == tokens, f"rank {r}"
        assert _rel(out["prefill"], prefill) < 1e-4, f"rank {r}: {_rel(out['prefill'], prefill)}"
        assert _rel(out["steps"], steps) < 1e-4, f"rank {r}"
        # every lane holds the same sums (KCCL reduces in rank order everywhere)
        assert np.array_equal(out["steps"], res[0]["steps"]) and np.array_equal(out["prefill"], res[0]["prefill"])


def test_delays_give_different_models(ckpt_dirs):
    """Sanity: DTP delay changes the function (else the test above would not test it)."""
    _, p0, _ = _single(ckpt_dirs["A"], 0)
    _, p1, _ = _single(ckpt_dirs["A"], 1)
    assert _rel(p1, p0) > 1e-2


@pytest.mark.parametrize("name,n,what", [("A", 5, "num_attention_heads=12"), ("A", 3, "num_key_value_heads=2"),
                                         ("B", 2, "num_key_value_heads=3"), ("B", 4, "num_attention_heads=6")])
def test_bad_split_is_refused(name, n, what):
    with pytest.raises(ShardingError, match=what):
        plan(MODELS[name], n)
