"""``q_quantile_update`` on the GPU: both of its exact methods (the shared-memory sort up to
``SHARED_DEFAULT``, the rank count beyond) give the reference's bits, on values with ties,
-0, NaN and Inf; and its launch plan (host, runs in CI)."""

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
