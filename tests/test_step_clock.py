"""The graph path's step clock summed (bench/gpu/step_clock.py): synthetic marks of one
layer's step, whose critical path, PDL waits, staging and early starts are known."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "gpu"))
import step_clock  # noqa: E402

BLOCKS = 8


def step(launches):
    """launches: per launch, a list of (start, waited, staged, end) per block that marked."""
    t = np.zeros((len(launches), 4, BLOCKS))
    for i, blocks in enumerate(launches):
        for b, marks in enumerate(blocks):
            t[i, :, b] = marks
    return t


# One layer (QKV, attention, o, gate/up, down) and the head, 1000 us into the clock.
LAUNCHES = [
    [(1000, 1001, 1004, 1010), (1000, 1001, 1003, 1012)],   # qkv: ends at 1012
    [(1011, 1013, 1013, 1018)],                             # attention: waited 1 us after qkv, ends 1018
    [(1015, 1019, 1020, 1021), (1019, 1019, 1020, 1022)],   # o: one block started early
    [(1022, 1023, 1027, 1050), (1022, 1023, 1026, 1049)],   # gate/up
    [(1045, 1051, 1052, 1060), (1050, 1052, 1053, 1061)],   # down
    [(1060, 1062, 1063, 1066)],                             # head
]


def test_the_kinds_add_up_to_the_step_and_each_figure_is_what_it_says():
    out = step_clock.summarize(step(LAUNCHES), layers=1)
    assert out["total"] == 66.0  # first start 1000, head's end 1066
    assert out["attention"]["crit"] == 6.0 and out["attention"]["pdl"] == 1.0 and out["attention"]["after"] == 5.0
    assert out["o"]["crit"] == 4.0 and out["o"]["lead"] == 3.0 and out["o"]["landed"] == 0.5
    assert out["gate_up"]["stage_x"] == 3.5 and out["gate_up"]["spread"] == 1.0
    assert out["down"]["landed"] == 0.5 and out["down"]["pdl"] == 1.0  # 1050 is not before 1050
    assert out["qkv"]["crit"] == 0.0  # the first launch has no launch before it in the step
    crit = sum(out[k]["crit"] for k in ("qkv", "attention", "o", "gate_up", "down", "head"))
    assert crit == 1066 - 1012  # every launch after the first, end to end


def test_a_normed_gemvs_staging_splits_into_its_loads_and_its_sum():
    """Six marks a block: the normed GEMVs' loads landed and sum done; the others' stay 0."""
    t = np.concatenate([step(LAUNCHES), np.zeros((len(LAUNCHES), 2, BLOCKS))], axis=1)
    t[3, 4, :2], t[3, 5, :2] = (1024, 1025), (1025.5, 1025.5)  # gate/up: waited at 1023 both
    out = step_clock.summarize(t, layers=1)
    assert out["gate_up"]["x_loaded"] == 1.5 and out["gate_up"]["x_summed"] == 1.0
    assert out["o"]["x_loaded"] == 0.0 and out["o"]["x_summed"] == 0.0
    assert {k: v for k, v in out.items() if k != "gate_up"} == \
        {k: v for k, v in step_clock.summarize(step(LAUNCHES), layers=1).items() if k != "gate_up"}


def test_the_attentions_time_splits_into_its_rows_landed_and_its_values_done():
    """The attention marks its rows and queries in shared memory (LOADED) and its values done
    (SUMMED): x_loaded is its wait to its input, x_summed the scores, softmax and values."""
    t = np.concatenate([step(LAUNCHES), np.zeros((len(LAUNCHES), 2, BLOCKS))], axis=1)
    t[1, 4, 0], t[1, 5, 0] = 1013.5, 1017  # waited at 1013, staged (softmax done) at 1013
    out = step_clock.summarize(t, layers=1)
    assert out["attention"]["x_loaded"] == 0.5 and out["attention"]["x_summed"] == 3.5


def test_marks_of_an_earlier_step_are_left_out():
    """A block without work this step keeps what it marked in an earlier one."""
    launches = [list(b) for b in LAUNCHES]
    launches[1] = launches[1] + [(400, 401, 401, 990)]  # stale: before this step's first start
    assert step_clock.summarize(step(launches), layers=1) == step_clock.summarize(step(LAUNCHES), layers=1)


def test_a_launch_without_marks_breaks_the_chain_instead_of_inventing_a_gap():
    launches = [list(b) for b in LAUNCHES]
    launches[1] = []  # e.g. the split items, which mark nothing
    out = step_clock.summarize(step(launches), layers=1)
    assert out["attention"]["crit"] == 0.0 and out["o"]["crit"] == 0.0 and out["o"]["landed"] == 0.0
    assert out["gate_up"]["crit"] == pytest.approx(1050 - 1022)


def test_the_bench_reads_as_many_marks_as_the_kernels_write():
    """bench/kie_bench.py's CLK_MARKS / CLK_BLOCKS are kie_kernels.h's (it reads them without a GPU build)."""
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    header = open(os.path.join(root, "kie_engine", "gpu", "csrc", "kie_kernels.h")).read()
    bench = open(os.path.join(root, "bench", "kie_bench.py")).read()
    marks = int(re.search(r"KIE_CLK_MARKS = (\d+)", header).group(1))
    blocks = int(re.search(r"#define KIE_CLK_BLOCKS (\d+)", header).group(1))
    got = tuple(int(x) for x in re.search(r"^CLK_MARKS, CLK_BLOCKS = (\d+), (\d+)", bench, re.M).groups())
    assert got == (marks, blocks)


# The monokernel's stage clock (step_clock.summarize_mono): per stage and block (start, input
# staged, end, first tile issued); the attention's block marks (start, scores done, end, values
# done), the blocks without an item nothing.
MONO_LAYER = [
    [(1000, 1002, 1010, 995), (1000, 1003, 1012, 996), (1001, 1002, 1011, 997)],         # qkv: ends 1012
    [(1013, 1015, 1020, 1017), (0, 0, 0, 0), (0, 0, 0, 0)],                            # attention: ends 1020
    [(1021.5, 1022, 1025, 1005), (1021, 1021.5, 1024, 1006), (1022, 1023, 1026, 1007)],  # o: ends 1026
    [(1027, 1028, 1040, 1010), (1026.5, 1027, 1041, 1011), (1028, 1029, 1039, 1012)],    # gate/up: ends 1041
    [(1042, 1043, 1050, 1030), (1041.5, 1042, 1051, 1031), (1043, 1044, 1049, 1032)],    # down: ends 1051
]
MONO_HEAD = [(1052, 1053, 1055, 1045), (1051.5, 1052, 1056, 1046), (1052, 1053, 1054, 1047)]


def mono_step(stages):
    t = np.zeros((len(stages), 4, 3))
    for i, blocks in enumerate(stages):
        for b, marks in enumerate(blocks):
            t[i, :, b] = marks
    return t


def test_the_monokernels_stages_add_up_to_the_step_and_each_figure_is_what_it_says():
    out = step_clock.summarize_mono(mono_step(MONO_LAYER + [MONO_HEAD]), layers=1)
    assert out["total"] == 56.0
    assert sum(out[k]["crit"] for k in ("qkv", "attention", "o", "gate_up", "down", "head")) == 56.0
    assert out["qkv"]["crit"] == 12.0 and out["qkv"]["wait"] == 0.0 and out["qkv"]["seen"] == 0.0
    assert out["qkv"]["stage_x"] == 2.0 and out["qkv"]["spread"] == 2.0 and out["qkv"]["lead"] == 4.3
    att = out["attention"]
    assert att["crit"] == 8.0 and att["wait"] == 3.0 and att["seen"] == 1.0  # QKV's last end 1012
    assert (att["scores"], att["values"], att["rest"]) == (2.0, 2.0, 3.0)
    # o: each block's wait from its own last end (block 0's attention, the others' QKV), while
    # seen counts from the attention's end for all three
    assert out["o"]["wait"] == pytest.approx(7.2) and out["o"]["seen"] == 1.5
    assert out["o"]["run"] == 2.8 and out["o"]["lead"] == 15.5
    assert out["gate_up"]["seen"] == 1.2 and out["down"]["seen"] == 1.2 and out["head"]["seen"] == 0.8


def test_the_monokernels_run_spread_by_block_and_by_noise():
    """Two layers in which block 0 runs gate/up 20 % over the mean in both: a difference that
    stays with the block, none that changes from layer to layer."""
    second = [[tuple(v + 56 if v else 0 for v in marks) for marks in blocks] for blocks in MONO_LAYER]
    head = [tuple(v + 56 for v in marks) for marks in MONO_HEAD]
    t = mono_step(MONO_LAYER + second + [head])
    for i in (3, 8):  # gate/up: runs 12, 9, 9 from its staged mark
        t[i, 2] = t[i, 1] + np.array([12.0, 9.0, 9.0])
    out = step_clock.summarize_mono(t, layers=2)
    assert out["gate_up"]["run_cv_block"] == pytest.approx(float(np.std([1.2, 0.9, 0.9])), abs=1e-4)
    assert out["gate_up"]["run_cv_noise"] == 0.0
    assert "run_cv_block" in out["down"] and "run_cv_block" not in out["head"]
