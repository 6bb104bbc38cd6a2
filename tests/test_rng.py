"""The counter-based generator (``reference/kernels/rng.py``, ``cuda_src/rng.cuh``): Philox4x32-10
against Random123's published known answers, the vectorised NumPy rounds against a scalar
pure-Python Philox, the exact uniform map, the word packing, the streams, and the CUDA header's
constants against the Python ones. (The CUDA kernel ``philox_uniform`` is compared bit for bit
with the reference by the conformance suite on a GPU; NVRTC compiles it in
``tests/test_fast_build.py``.)
"""

from __future__ import annotations

import re
from fractions import Fraction
from importlib import resources

import numpy as np
import pytest

from foxhunt.reference.kernels import rng

U32 = np.uint32
MASK32 = 0xFFFFFFFF

# Random123's kat_vectors for philox4x32 with 10 rounds: counter (4 words), key (2 words),
# expected output (4 words). Copied from D. E. Shaw Research's own unit test, which quotes the
# kat_vectors file of the Random123 distribution (github.com/DEShawResearch/fs123,
# core123/ut/ut_philox.cpp, test_kat_philox4x32).
KAT_PHILOX4X32_10 = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def philox_scalar(ctr, key, rounds=10):
    """Philox4x32 written from the paper with Python integers (an independent implementation)."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0 = (k0 + 0x9E3779B9) & MASK32
            k1 = (k1 + 0xBB67AE85) & MASK32
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32)
    return c0, c1, c2, c3


def uniform_scalar(key, stream, offset, index):
    """The documented packing and map, from the scalar Philox, as an exact fraction."""
    word = philox_scalar((index, stream, offset & MASK32, offset >> 32), (key & MASK32, key >> 32))[0]
    return Fraction(2 * (word >> 9) + 1, 2**24)


# --------------------------------------------------------------------------------- Philox
@pytest.mark.parametrize("ctr, key, expected", KAT_PHILOX4X32_10)
def test_philox4x32_10_matches_random123_known_answers(ctr, key, expected):
    out = rng.philox4x32(np.array(ctr, U32), np.array(key, U32))
    assert out.dtype == U32
    assert [hex(int(w)) for w in out] == [hex(w) for w in expected]


def test_scalar_philox_of_this_test_also_matches_the_known_answers():
    """The independent implementation below is itself right (so agreeing with it means something)."""
    for ctr, key, expected in KAT_PHILOX4X32_10:
        assert philox_scalar(ctr, key) == expected


def test_vectorised_philox_matches_the_scalar_one_with_broadcasting():
    gen = np.random.default_rng(7)
    ctr = gen.integers(0, 2**32, size=(6, 5, 4), dtype=np.uint64).astype(U32)
    key = gen.integers(0, 2**32, size=(5, 2), dtype=np.uint64).astype(U32)  # broadcast over 6
    out = rng.philox4x32(ctr, key)
    assert out.shape == (6, 5, 4)
    for i in range(6):
        for j in range(5):
            expected = philox_scalar(tuple(int(w) for w in ctr[i, j]), tuple(int(w) for w in key[j]))
            assert tuple(int(w) for w in out[i, j]) == expected


@pytest.mark.parametrize("ctr, key", [
    (np.zeros(4, np.int64), np.zeros(2, U32)),
    (np.zeros(3, U32), np.zeros(2, U32)),
    (np.zeros(4, U32), np.zeros(3, U32)),
    ([0, 0, 0, 0], np.zeros(2, U32)),
])
def test_philox_rejects_bad_words(ctr, key):
    with pytest.raises(ValueError, match="ctr|key"):
        rng.philox4x32(ctr, key)


# ----------------------------------------------------------------------------- the map
def test_u32_to_uniform_is_exact_and_strictly_inside_the_unit_interval():
    words = np.array([0, 1, 511, 512, 0x7FFFFFFF, 0x80000000, 0xFFFFFE00, 0xFFFFFFFF,
                      *np.random.default_rng(3).integers(0, 2**32, 1000)], dtype=np.uint64).astype(U32)
    got = rng.u32_to_uniform(words)
    assert got.dtype == np.float32
    for w, g in zip(words.tolist(), got.tolist()):
        assert Fraction(g) == Fraction(2 * (w >> 9) + 1, 2**24)  # exact, no rounding
    assert got[0] == np.float32(2.0**-24) and got[7] == np.float32(1 - 2.0**-24)
    assert np.all(got > 0) and np.all(got < 1)


def test_u32_to_uniform_is_monotone_and_symmetric():
    """``u`` and ``~u`` map to ``x`` and ``1 - x`` exactly (the grid is symmetric about 1/2)."""
    words = np.random.default_rng(4).integers(0, 2**32, 4096, dtype=np.uint64).astype(U32)
    x = rng.u32_to_uniform(words).astype(np.float64)
    y = rng.u32_to_uniform(~words).astype(np.float64)
    assert np.array_equal(x + y, np.ones_like(x))
    order = np.argsort(words)
    assert np.all(np.diff(x[order]) >= 0)


def test_u32_to_uniform_rejects_other_dtypes():
    with pytest.raises(ValueError, match="u: expected a uint32"):
        rng.u32_to_uniform(np.zeros(3, np.int64))


# ------------------------------------------------------------------------ the packing
@pytest.mark.parametrize("key, stream, offset", [
    (0, 1, 0),
    (12345, rng.STREAMS["iqn_tau_target"], 999),
    (2**64 - 1, rng.STREAMS["explore_action"], 2**64 - 1),
    (0xDEADBEEF_00C0FFEE, rng.STREAMS["replay_sample"], 2**32 + 17),
])
def test_uniform_follows_the_documented_packing(key, stream, offset):
    index = np.array([0, 1, 2, 255, 256, 70_000, 2**32 - 1], np.int64)
    got = rng.uniform(key, stream, offset, index)
    assert got.dtype == np.float32 and got.shape == index.shape
    for i, g in zip(index.tolist(), got.tolist()):
        assert Fraction(g) == uniform_scalar(key, stream, offset, i)


def test_uniform_of_a_scalar_index_is_a_0d_array():
    got = rng.uniform(5, 1, 2, 3)
    assert got.shape == () and Fraction(float(got)) == uniform_scalar(5, 1, 2, 3)


def test_every_argument_word_changes_the_draws():
    base = rng.uniform(1, 1, 1, np.arange(64))
    for changed in (rng.uniform(2, 1, 1, np.arange(64)),              # key low word
                    rng.uniform(1 + 2**32, 1, 1, np.arange(64)),      # key high word
                    rng.uniform(1, 2, 1, np.arange(64)),              # stream
                    rng.uniform(1, 1, 2, np.arange(64)),              # offset low word
                    rng.uniform(1, 1, 1 + 2**32, np.arange(64)),      # offset high word
                    rng.uniform(1, 1, 1, np.arange(1, 65))):          # index
        assert np.count_nonzero(changed == base) <= 1  # 2**23 values: a tie is a coincidence


@pytest.mark.parametrize("kwargs, field", [
    (dict(key=-1, stream=1, offset=0, index=0), "key"),
    (dict(key=2**64, stream=1, offset=0, index=0), "key"),
    (dict(key=0, stream=-1, offset=0, index=0), "stream"),
    (dict(key=0, stream=2**32, offset=0, index=0), "stream"),
    (dict(key=0, stream=1, offset=2**64, index=0), "offset"),
    (dict(key=0, stream=1, offset=0, index=2**32), "index"),
    (dict(key=0, stream=1, offset=0, index=np.array([-1])), "index"),
    (dict(key=0, stream=1, offset=0, index=np.array([0.5])), "index"),
    (dict(key=0.0, stream=1, offset=0, index=0), "key"),
])
def test_uniform_rejects_out_of_range_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        rng.uniform(**kwargs)


# --------------------------------------------------------------------------- streams
def test_streams_are_the_contracts_distinct_nonzero_ids():
    assert dict(rng.STREAMS) == {"iqn_tau_online": 1, "iqn_tau_target": 2, "explore": 3,
                                 "replay_sample": 4, "episode_start": 5, "explore_action": 6}
    with pytest.raises(TypeError):
        rng.STREAMS["new"] = 7  # read-only: one place defines the ids


def test_draws_look_uniform_and_streams_uncorrelated():
    """A chi-square over 64 bins of 2**16 draws, and the correlation of two streams. Bounds:
    chi-square with 63 degrees of freedom has mean 63 and sd sqrt(126) ~ 11.2; 63 + 6 sd = 130
    is far in the tail (a fixed key, so the test is deterministic either way). The correlation
    of 2**16 independent pairs has sd 2**-8 ~ 0.004; the bound is 6 sd."""
    n = 2**16
    x = rng.uniform(2024, rng.STREAMS["iqn_tau_online"], 0, np.arange(n)).astype(np.float64)
    y = rng.uniform(2024, rng.STREAMS["iqn_tau_target"], 0, np.arange(n)).astype(np.float64)
    counts = np.bincount((x * 64).astype(int), minlength=64)
    chi2 = float(np.sum((counts - n / 64) ** 2 / (n / 64)))
    assert chi2 < 130, chi2
    assert abs(np.corrcoef(x, y)[0, 1]) < 6 * 2.0**-8
    assert abs(x.mean() - 0.5) < 6 * np.sqrt(1 / 12 / n)


# ------------------------------------------------------------------------ kernel twin
def test_philox_uniform_is_uniform_over_the_index_range():
    got = rng.philox_uniform(300, 0x89ABCDEF, 0x01234567, 3, 0xFFFFFFFF, 2)
    want = rng.uniform(0x01234567_89ABCDEF, 3, 2 * 2**32 + 0xFFFFFFFF, np.arange(300))
    assert got.dtype == np.float32 and got.tobytes() == want.tobytes()
    assert rng.philox_uniform(0, 0, 0, 1, 0, 0).shape == (0,)


@pytest.mark.parametrize("bad, field", [
    (dict(n=-1), "n"), (dict(key_lo=2**32), "key_lo"), (dict(key_hi=-1), "key_hi"),
    (dict(stream=2**32), "stream"), (dict(offset_lo=1.0), "offset_lo"), (dict(offset_hi=True), "offset_hi"),
])
def test_philox_uniform_rejects_bad_words(bad, field):
    args = dict(n=4, key_lo=0, key_hi=0, stream=1, offset_lo=0, offset_hi=0) | bad
    with pytest.raises(ValueError, match=field):
        rng.philox_uniform(**args)


def test_cuda_header_constants_are_the_python_ones():
    """rng.cuh mirrors rng.py: the same multipliers, increments, rounds and uniform map."""
    text = (resources.files("foxhunt.cuda_src") / "rng.cuh").read_text()
    defines = dict(re.findall(r"#define (RNG_\w+) (\S+)", text))
    as_int = {k: int(v.rstrip("u"), 0) for k, v in defines.items() if k != "RNG_UNIFORM_SCALE"}
    assert as_int == {"RNG_PHILOX_M0": rng.PHILOX_M0, "RNG_PHILOX_M1": rng.PHILOX_M1,
                      "RNG_PHILOX_W0": rng.PHILOX_W0, "RNG_PHILOX_W1": rng.PHILOX_W1,
                      "RNG_PHILOX_ROUNDS": rng.PHILOX_ROUNDS, "RNG_UNIFORM_SHIFT": rng.UNIFORM_SHIFT}
    assert float.fromhex(defines["RNG_UNIFORM_SCALE"].rstrip("f")) == float(rng.UNIFORM_SCALE)
    # The packing: index, stream, offset low, offset high; key low, key high.
    assert "make_uint4(index, stream, (unsigned int)(offset & 0xffffffffull)" in text
    assert "make_uint2(key_lo, key_hi)" in text
