"""``reference.kernels.step.block_total``: the summation order of ``step_block_total`` (the
kernel's bitwise twin runs in conformance on a GPU); here against independent oracles."""

from __future__ import annotations

import math

import numpy as np
import pytest

from foxhunt.reference.kernels.step import block_total, loss_scalars

F32 = np.float32
MAX = np.finfo(F32).max


@pytest.mark.parametrize("n", [0, 1, 31, 256, 257, 515, 4096 + 3])
def test_block_total_is_a_float32_sum(n):
    x = np.random.default_rng(n).standard_normal(n).astype(F32)
    got = block_total(x)
    assert got.dtype == F32
    exact = math.fsum(float(v) for v in x)
    # float32 accumulation: |error| <= (depth) * eps * sum|x|, depth <= n/256 + 8 + 5
    bound = (n / 256 + 14) * 2.0 ** -24 * float(np.abs(x).sum()) + 1e-30
    assert abs(float(got) - exact) <= bound


def test_block_total_of_nothing_is_plus_zero():
    got = block_total(np.zeros(0, F32))
    assert got == 0 and not np.signbit(got)
    assert not np.signbit(block_total(np.array([-0.0], F32)))  # the final + 0.0


def test_block_total_order_thread_partials_first():
    """+max twice in one thread's partial (positions 0 and 256) overflows before -max
    (position 16, another thread) can cancel it, although the exact sum is max."""
    x = np.zeros(512, F32)
    x[0], x[256], x[16] = MAX, MAX, -MAX
    assert block_total(x) == np.inf
    # lanes 16 apart meet first in the halving butterfly (offsets 16, 8, 4, 2, 1), so -max in
    # lane 16 cancels lane 0 before lane 1's +max joins: the sum is exact
    y = np.zeros(512, F32)
    y[0], y[16], y[1] = MAX, -MAX, MAX
    assert block_total(y) == MAX
    # ... and lanes 0 and 2 meet before lanes 0 and 1: +max in both overflows
    z = np.zeros(512, F32)
    z[0], z[2], z[1] = MAX, MAX, -MAX
    assert block_total(z) == np.inf


def test_loss_scalars_means_use_the_block_order():
    q = np.zeros((2, 256), F32)
    q[0, 0], q[1, 0], q[0, 1] = MAX, MAX, -MAX  # flat positions 0 and 256: one thread
    out = loss_scalars(np.ones(2, F32), np.zeros((2, 256), F32), q, np.ones((2, 256), F32), 1.0)
    assert out.mean_q == np.inf and out.mean_target_q == 1.0 and out.c51_loss == 2.0


def test_double_dqn_row_threads_is_step_cu_s():
    """plan_double_dqn_gather_branches sizes its grid with step.cu's threads per row."""
    import re
    from importlib import resources

    from foxhunt.fast.kernels import step as fast_step

    text = (resources.files("foxhunt.cuda_src") / "step.cu").read_text()
    assert fast_step.DDQN_ROW_THREADS == int(
        re.search(r"#define DDQN_ROW_THREADS (\d+)", text).group(1))


def test_scalar_target_group_is_step_cu_s():
    """plan_scalar_target_q_branches sizes its grid with step.cu's lanes per row."""
    import re
    from importlib import resources

    from foxhunt.fast.kernels import step as fast_step

    text = (resources.files("foxhunt.cuda_src") / "step.cu").read_text()
    assert fast_step.STQ_GROUP == int(re.search(r"#define STQ_GROUP (\d+)", text).group(1))
    grid, block, _ = fast_step.plan_scalar_target_q_branches(3, 256)
    assert grid * block >= 3 * 256 * fast_step.STQ_GROUP and block % 32 == 0
