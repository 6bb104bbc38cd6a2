"""The fused evaluation walk's twin (reference/kernels/walk.py), its launch plan and its
conformance samples, on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from foxhunt.conformance.kernel_spec import case_dims
from foxhunt.conformance.specs.walk import ENTRIES
from foxhunt.fast.kernels.walk import plan_greedy_walk, walk_shared_floats
from foxhunt.reference import network
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.env import ExecutionCosts
from foxhunt.reference.kernels import walk
from foxhunt.reference.kernels.env import MarketTables
from foxhunt.reference.kernels.env_walk import greedy_walk as kernels_walk
from foxhunt.reference.layout import ParamLayout

F32 = np.float32
SPEC = {e.name: e for e in ENTRIES}["greedy_walk"]


def _sample(case="tiny", seed=0, **changes):
    kwargs = SPEC.sample(case_dims(case), np.random.default_rng(seed))
    kwargs.update(changes)
    return kwargs


def test_dot_lanes_sums_each_lane_in_order_then_the_halving_tree():
    # lane 0 holds 1 (k=0) and 1 (k=32), lane 16 holds 2^24: lanes first gives 2 + 2^24
    # exactly; the sum in k order would lose both ones (2^24 + 1 rounds to 2^24).
    w = np.zeros((1, 64), F32)
    w[0, 0] = w[0, 32] = 1.0
    w[0, 16] = 2.0**24
    assert walk.dot_lanes(np.ones(64, F32), w)[0] == F32(2.0**24 + 2)
    rng = np.random.default_rng(1)
    x, m = rng.integers(-8, 8, 37).astype(F32), rng.integers(-8, 8, (5, 37)).astype(F32)
    np.testing.assert_array_equal(walk.dot_lanes(x, m), (m.astype(np.float64) @ x).astype(F32))


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_forward_row_is_the_network_forward(precision):
    c = DQNConfig.preset("tiny", precision=precision)
    lay = ParamLayout(c)
    rng = np.random.default_rng(2)
    p = (rng.standard_normal(lay.num_elements) * 0.3).astype(F32)
    x = rng.standard_normal((1, c.state_dim)).astype(F32)
    z = np.linspace(c.v_min, c.v_max, c.num_atoms, dtype=F32)
    bound = F32(2.5)
    ref = network.q_values(c, network.forward(c, lay, p, x, h2_bound=bound), z)
    qs = walk.forward_row(p, walk.walk_offsets(lay, c.n_branches), walk.walk_dims(c), c.branches,
                          precision == "bf16", z, bound, x[0])
    for q, r in zip(qs, ref):
        assert q.shape == r.shape
        np.testing.assert_allclose(q, r, rtol=0, atol=walk.q_error_bound(z, precision == "bf16"))


def test_the_walk_is_the_kernels_greedy_walk_up_to_the_first_near_tie():
    c = DQNConfig.preset("tiny", precision="f32")
    k = _sample(bf16=False)
    lay = ParamLayout(c)
    bound = np.float32(k["h2_clamp_mult"] * max(k["isv"][k["isv_index"]], 1.0))

    def q_values(obs):
        return network.q_values(c, network.forward(c, lay, k["params"], obs, h2_bound=bound), k["z"])

    T = k["close"].shape[0]
    tables = MarketTables(k["close"], k["high"], k["low"], k["features"], np.zeros(T, np.int32))
    ref = kernels_walk(q_values, tables, ExecutionCosts(), c.branches, c.state_dim, k["start"],
                       k["start"] + k["n_steps"] + 1)
    got = walk.greedy_walk(**k)
    tie = walk.first_near_tie(got.margins, k["z"], False)
    assert tie > k["n_steps"] // 2  # the sample decides most bars
    for a, b in zip(got[:3], ref):
        np.testing.assert_array_equal(a[:tie], b[:tie])


@pytest.mark.parametrize("case", ["tiny", "seed"])
def test_samples_are_decided_by_clear_margins(case):
    k = _sample(case)
    rec = walk.greedy_walk(**k)
    assert walk.first_near_tie(rec.margins, k["z"], k["bf16"]) > k["n_steps"] // 2
    if case == "tiny":  # the walk trades (the seed sample holds one position: margins only)
        assert np.unique(rec.positions).size >= 2


def test_a_non_finite_feature_zeroes_h2_so_the_rest_of_its_row_does_not_matter():
    k = _sample()
    a, b = k["features"].copy(), k["features"].copy()
    bar = k["start"] + 5
    a[bar, 0] = np.nan
    b[bar] = np.random.default_rng(9).standard_normal(b.shape[1])
    b[bar, 1] = np.inf
    ra, rb = walk.greedy_walk(**{**k, "features": a}), walk.greedy_walk(**{**k, "features": b})
    for x, y in zip(ra, rb):
        np.testing.assert_array_equal(x, y)
    assert np.isfinite(ra.rewards).all()


def test_errors_name_the_argument():
    k = _sample()
    with pytest.raises(ValueError, match="n_steps"):
        walk.greedy_walk(**{**k, "n_steps": k["close"].shape[0]})
    with pytest.raises(ValueError, match="param_offsets"):
        walk.greedy_walk(**{**k, "param_offsets": k["param_offsets"][:-1]})


def test_plan_is_one_block_with_the_shared_layout_counted_by_hand():
    c = DQNConfig.preset("seed")
    dims = walk.walk_dims(c)
    # x 128 + h1 256 + h2 256 + hidden 128 + 3 * 128 + outputs 51 * (1 + 8) + q 8 + 2 * 32 * 51
    assert walk_shared_floats(dims, c.branches) == 4883
    assert plan_greedy_walk(dims, c.branches) == ((1,), (1024,), 4 * 4883)
    with pytest.raises(ValueError, match="shared memory"):
        plan_greedy_walk((128, 4096, 4096, 128, 128, 51), c.branches)
