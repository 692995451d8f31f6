"""The one decode loop (generate.generate) over the backend protocol (kie_engine/lanes/backend.py):
a backend that returns logits is sampled on the host; one with tokens() (the GPU engine)
gives its own picks, and the loop closes that iterator when it stops (EOS or the limit),
which is where a backend running ahead settles."""
import numpy as np
import pytest

from kie_engine.lanes.backend import check_kernel
from kie_engine.errors import KieError
from kie_engine.generate import Sampling, generate


class Picking:
    """A backend that picks its own tokens: 10, 11, 12, ... (like the GPU engine)."""
    max_seq = 64

    def __init__(self):
        self.resets, self.closed, self.given = 0, False, 0

    def reset(self):
        self.resets += 1

    def tokens(self, prompt_ids, max_new_tokens, sampling):
        assert list(prompt_ids) == [1, 2, 3] and max_new_tokens == 6
        try:
            t = 10
            while True:
                self.given += 1
                yield t
                t += 1
        finally:
            self.closed = True

    def prefill(self, ids, chunk=None):
        raise AssertionError("the loop must take tokens() instead")

    decode_step = prefill


class Logits:
    """A backend that returns logits favouring token (step + 5)."""
    max_seq = 64

    def __init__(self):
        self.step = 0

    def reset(self):
        self.step = 0

    def _z(self):
        z = np.zeros(32, np.float32)
        z[self.step + 5] = 1
        self.step += 1
        return z

    def prefill(self, ids, chunk=None):
        return self._z()

    def decode_step(self, tok):
        return self._z()


@pytest.mark.parametrize("eos,want", [(None, [10, 11, 12, 13, 14, 15]), (12, [10, 11, 12])])
def test_tokens_backend_is_read_until_the_stop_and_closed(eos, want):
    b = Picking()
    seen = []
    res = generate(b, [1, 2, 3], 6, eos_id=eos, on_token=seen.append)
    assert res.tokens == want == seen and b.closed and b.given == len(want)
    assert res.stopped_on_eos == (eos is not None) and res.decode_s >= 0 and res.prefill_s >= 0


def test_logits_backend_is_sampled_on_the_host():
    res = generate(Logits(), [1], 5, Sampling())
    assert res.tokens == [5, 6, 7, 8, 9]


def test_kernel_choice():
    assert check_kernel("cpu", None) == "native" and check_kernel("cuda", None) == "graph"
    assert check_kernel("cpu", "numpy") == "numpy"
    with pytest.raises(KieError, match="GPU kernel"):
        check_kernel("cpu", "mono")
    with pytest.raises(KieError, match="runs on the CPU"):
        check_kernel("cuda", "native")
