"""conformance/bit_ab.py on the CPU: a dump of the reference twins compares equal to itself,
and a changed bit, a changed shape or a missing array is reported with exit code 1."""

from __future__ import annotations

import numpy as np
import pytest

from foxhunt.conformance import bit_ab

KERNELS = "relu_mask,clamp_finite"


def test_two_dumps_of_the_same_code_are_equal(tmp_path, capsys):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    assert bit_ab.main(["dump", str(a), KERNELS, "--backend", "reference"]) == 0
    assert bit_ab.main(["dump", str(b), KERNELS, "--backend", "reference"]) == 0
    assert bit_ab.main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "bitwise A/B: OK" in out and "relu_mask" in out and "clamp_finite" in out
    with np.load(a) as dump:
        assert any(k.startswith("clamp_finite/x/") for k in dump.files)  # extremal cases too


def test_a_changed_bit_shape_or_array_is_reported():
    base = {"k/s/tiny.out": np.array([1.0, 2.0, np.nan], np.float32),
            "k/s/odd.out": np.zeros(3, np.float32), "k/x/nan.out": np.ones(2, np.float32)}
    head = dict(base)
    flipped = base["k/s/tiny.out"].copy()
    flipped.view(np.uint32)[2] ^= 1  # another NaN payload: equal under a NaN-aware compare
    head["k/s/tiny.out"] = flipped
    head["k/s/odd.out"] = np.zeros(4, np.float32)
    del head["k/x/nan.out"]
    per, problems = bit_ab.compare(base, head)
    assert per == {"k": [0, 3]}
    assert any("tiny.out: 1 of 3 elements differ (first at [2])" in p for p in problems)
    assert any("odd.out: float32(3,) against float32(4,)" in p for p in problems)
    assert any("nan.out: only in base" in p for p in problems)


def test_unknown_kernel_and_backend_are_refused():
    with pytest.raises(ValueError, match="^kernels: \\['no_such_kernel'\\]"):
        bit_ab.case_outputs(["no_such_kernel"])
    with pytest.raises(ValueError, match="^backend: 'cpu'"):
        bit_ab.case_outputs(["relu_mask"], "cpu")
