"""Statistics of a `bench/decode.py --paired` result file: for each TP size, the
per-round ratio delay 0 / delay d (ms/token; > 1 means delay d is faster), its
median with a bootstrap 95 % interval, and a one-sided sign test.

    python bench/paired_stats.py bench/results/kie_decode_dtp_paired_tp2_60rounds.txt"""
import re
import sys

import numpy as np

from benchlib import median_ci, sign_test_p


def main(path):
    text = open(path).read()
    for tp, d0, dd in re.findall(r"raw ms/token per round, TP=(\d+): d0: ([\d.,]+); d\d: ([\d.,]+)", text):
        a = np.array([float(x) for x in d0.split(",")])
        b = np.array([float(x) for x in dd.split(",")])
        r = a / b
        _med, lo, hi = median_ci(r)
        k, n = int((r > 1).sum()), len(r)
        p = sign_test_p(k, n)
        print(f"TP={tp}: {n} rounds, median ratio {np.median(r):.3f} (bootstrap 95 % interval {lo:.3f}-{hi:.3f}), "
              f"delay d faster in {k} of {n} (one-sided sign test p = {p:.3f})")


if __name__ == "__main__":
    main(sys.argv[1])
