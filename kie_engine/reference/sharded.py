"""The numpy reference model on lanes: `Lanes` (its sums and the vocabulary gather over a
kccl.Communicator) and a lane's share of a checkpoint's weights, as lanes/plan.py plans
it."""
import numpy as np

from ..lanes.plan import lane_plan
from .model import LayerWeights, Model, Weights, stack_t


class Lanes:
    """The model's lane operations over a kccl.Communicator."""

    def __init__(self, comm):
        self.comm, self.size, self.rank = comm, comm.size, comm.rank

    def sum(self, y):
        return self.comm.all_reduce(y)

    def sum_start(self, y):
        return self.comm.all_reduce_start(y)

    def vocab(self, logits):
        t, part = logits.shape
        out = np.empty((self.size, t, part), np.float32)
        self.comm.all_gather(logits, out)
        return out.transpose(1, 0, 2).reshape(t, self.size * part)



def load_lane_weights(ckpt, rank, size, uneven=False):
    """Lane `rank` of `size`'s share of a checkpoint (reads only those rows/columns)."""
    cfg = ckpt.config
    lp = lane_plan(cfg, rank, size, uneven)
    nhl, nkvl, q_rows, kv_rows, c0, c1 = lp.n_heads, lp.n_kv_heads, lp.q_rows, lp.kv_rows, lp.c0, lp.c1
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        t = lambda n, rows=None, cols=None: ckpt.tensor(p + n, rows, cols)  # noqa: E731
        layers.append(LayerWeights(
            attn_norm=t("input_layernorm.weight"),
            wqkv=stack_t(t("self_attn.q_proj.weight", q_rows), t("self_attn.k_proj.weight", kv_rows),
                         t("self_attn.v_proj.weight", kv_rows)),
            wo=stack_t(t("self_attn.o_proj.weight", cols=q_rows)), mlp_norm=t("post_attention_layernorm.weight"),
            w_gate_up=stack_t(t("mlp.gate_proj.weight", slice(c0, c1)), t("mlp.up_proj.weight", slice(c0, c1))),
            w_down=stack_t(t("mlp.down_proj.weight", cols=slice(c0, c1)))))
    embed = ckpt.tensor("model.embed_tokens.weight")
    part, v0, v1 = lp.part, lp.v0, lp.v1
    head = embed[v0:v1] if cfg.tie_word_embeddings else ckpt.tensor("lm_head.weight", slice(v0, v1))
    if v1 - v0 < part:  # the last slice: zero rows up to the common size (cut off after the gather)
        head = np.concatenate([head, np.zeros((part - (v1 - v0), cfg.hidden_size), np.float32)])
    return Weights(embed, layers, ckpt.tensor("model.norm.weight"), stack_t(head), nhl, nkvl)


def load_model(ckpt, comm=None, max_seq=None, uneven=False):
    """A Model of the checkpoint on this rank: whole without a communicator (or with one
    of size 1), else this rank's lane (uneven: lane_plan's KV-group split where the even
    one does not fit)."""
    if comm is None or comm.size == 1:
        from .model import load_weights
        return Model(ckpt.config, load_weights(ckpt), max_seq=max_seq)
    return Model(ckpt.config, load_lane_weights(ckpt, comm.rank, comm.size, uneven), Lanes(comm), max_seq=max_seq)
