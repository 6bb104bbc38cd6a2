"""``q_quantile_update`` on the GPU: both of its exact methods (the shared-memory sort up to
``SHARED_DEFAULT``, the rank count beyond) give the reference's bits, on values with ties,
-0, NaN and Inf; and its launch plan (host, runs in CI). ``isv_signal_build`` gives the
reference's bits on every block size, and its plan."""

from __future__ import annotations

import numpy as np
import pytest

from foxhunt.fast.device import cuda_available
from foxhunt.reference import isv as reg
from foxhunt.fast.kernels.isv_producers import SELECT_THREADS, SHARED_DEFAULT, plan_q_quantile_update

_OK, _REASON = cuda_available()
F32 = np.float32


@pytest.mark.parametrize("count, padded", [(1, 32), (32, 32), (33, 64), (768, 1024),
                                           (8192, 8192), (8193, 16384)])
def test_the_plan_sorts_what_fits_the_default_shared_memory(count, padded):
    grid, block, shared = plan_q_quantile_update(count)
    assert grid == 1 and block == min(SELECT_THREADS, padded) and block % 32 == 0
    assert shared == (padded * 4 if padded * 4 <= SHARED_DEFAULT else 0)


def _values(rng, rows: int, cols: int) -> np.ndarray:
    q = np.round(rng.standard_normal((rows, cols)) * 3, 1).astype(F32)  # ties
    flat = q.reshape(-1)
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, -0.0, np.nan], F32)
    flat[:min(flat.size, specials.size)] = specials[:flat.size]
    return q


@pytest.mark.gpu
@pytest.mark.skipif(not _OK, reason=f"no CUDA device/driver: {_REASON}")
@pytest.mark.parametrize("rows, cols", [(256, 3), (256, 2), (5, 1),
                                        (SHARED_DEFAULT // 4 // 3 + 1, 3)])  # the last counts
def test_both_methods_give_the_references_bits(rows, cols):
    from foxhunt.fast.kernels import isv_producers as fast
    from foxhunt.reference.kernels import isv_producers as ref

    rng = np.random.default_rng(rows * cols)
    q = _values(rng, rows, cols)
    isv = reg.ISVBus().to_array()
    for slots in (reg.Q_P05_INDICES, reg.Q_P95_INDICES):  # blended from non-trivial values
        isv[list(slots)] = rng.standard_normal(len(slots)).astype(F32)
    for branch in range(3):
        want = ref.q_quantile_update(isv, q, branch, 0.05)
        got = fast.q_quantile_update(isv, q, branch, 0.05)
        assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()


# ------------------------------------------------------------------ isv_signal_build's block
@pytest.mark.parametrize("nb, B, na, threads", [(4, 256, 51, 1024), (1, 32, 51, 96),
                                                (4, 256, 300, 1024), (3, 37, 7, 128)])
def test_the_signal_build_plan_covers_samples_and_pairs(nb, B, na, threads):
    from foxhunt.fast.kernels.isv_producers import plan_isv_signal_build

    assert plan_isv_signal_build(nb, B, na) == (1, threads, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _OK, reason=f"no CUDA device/driver: {_REASON}")
@pytest.mark.parametrize("nb, B, na", [(4, 256, 51), (3, 37, 7), (2, 700, 11)])
def test_signal_build_gives_the_references_bits_on_any_block(nb, B, na):
    """The work is spread over the block; every block size (and so every chunking of the
    variances and every share of the pairs) gives the reference's bits, NaN and Inf included."""
    from foxhunt.fast.kernels.isv_producers import signal_build_block
    from foxhunt.reference.kernels import isv_producers as ref

    rng = np.random.default_rng(nb * B + na)
    isv = reg.ISVBus().to_array()
    isv[list(ref.Q_EMA_SLOTS)] = rng.standard_normal(len(ref.Q_EMA_SLOTS)).astype(F32)
    isv[3] = F32(0.25)
    logits = rng.standard_normal((nb, B, na)).astype(F32) * 3
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    p = p.astype(F32)
    p[0, 1, 2], p[nb - 1, B - 1, 0] = np.nan, np.inf  # one sample's variance NaN, one pair's sum
    z = np.sort(rng.standard_normal((nb, na)).astype(F32) * 5, axis=1)
    q_taken = rng.standard_normal((nb, B)).astype(F32)
    q_taken[0, 3] = np.nan
    td, r = rng.standard_normal(B).astype(F32), rng.standard_normal(B).astype(F32)
    r[5] = -np.inf
    want = ref.isv_signal_build(isv, q_taken, td, r, p, z, 2.5, 0.75)
    for threads in (32, 96, 256, 1024, None):
        got = signal_build_block(threads, isv, q_taken, td, r, p, z, 2.5, 0.75)
        assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist(), threads
