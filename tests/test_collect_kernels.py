"""Tests of the collection cycle's fused reference kernels (``reference.kernels.collect``):
values worked out by hand on tiny cases (a two-env walk with fixed prices, a ring whose
priority sits on one row), independently of the kernels they compose; and the registry
wiring of the new area (the CUDA kernels, the fast entries, the conformance entries)."""

from __future__ import annotations

import numpy as np
import pytest

from foxhunt.reference.env import ExecutionCosts
from foxhunt.reference.kernels import collect, replay
from foxhunt.reference.kernels import env as K

F32, I32 = np.float32, np.int32
KEY = 12345
COSTS = ExecutionCosts(fee=0.0, passive_fee=0.0, half_spread=0.0, slippage_coef=0.0,
                       patient_slippage_scale=1.0)
CLOSE = [100.0, 110.0, 99.0, 99.0, 99.0, 99.0]


def _ring(capacity: int, state_dim: int, nb: int) -> dict:
    return {"ring_s": np.full((capacity, state_dim), -1.0, F32),
            "ring_a": np.full((capacity, nb), -1, I32), "ring_r": np.full(capacity, -1.0, F32),
            "ring_s2": np.full((capacity, state_dim), -1.0, F32),
            "ring_done": np.full(capacity, -1.0, F32),
            "ring_next_ret": np.full(capacity, -1.0, F32),
            "ring_regime": np.full(capacity, -1, I32),
            "ring_discount": np.full(capacity, -1.0, F32), "priority": np.zeros(capacity, F32)}


def _transition(q, *, n_step=1, capacity=5, cursor=3, size=3, win_len=(0, 0)):
    """Two envs at bar 0, flat; the features are the bar number in column 0 and 0.5 in 1."""
    n, sd, nb = 2, 6, 1
    close = np.array(CLOSE, F32)
    features = np.stack([np.arange(len(CLOSE), dtype=F32), np.full(len(CLOSE), 0.5, F32)], 1)
    windows = {k: np.zeros(shape, dtype) for k, (dtype, shape)
               in replay.nstep_buffers(n, n_step, sd, nb).items() if k.startswith("win_")}
    windows["win_len"] = np.array(win_len, I32)
    return collect.collect_transition(
        np.array(q, F32), (3,), 0.0, KEY, np.array([7], np.int64), close, close, close, features,
        np.array([2, 1, 0, 0, 0, 0], I32), np.zeros(n, I32), np.zeros(n, I32), np.zeros(n, I32),
        np.zeros(n, F32), np.zeros(n, F32), K.cost_table(COSTS), len(CLOSE), 0, 2, 0, 10.0, sd,
        np.arange(n * sd, dtype=F32).reshape(n, sd), **windows, n_step=n_step, gamma_ref=0.9,
        **_ring(capacity, sd, nb), ring_pos=np.array([cursor, size], I32),
        max_priority=np.array([4.0], F32))


def test_one_step_transitions_go_to_the_ring_at_the_cursor_and_wrap():
    # greedy (eps 0): env 0 argmax 2 (long), env 1 argmax 0 (short); market orders, no costs
    out = _transition([0.0, 1.0, 3.0, 5.0, 1.0, 2.0])
    assert out.actions.tolist() == [[2], [0]]
    ret = F32(F32(110.0 - 100.0) / F32(100.0))  # (C' - P) / P of bar 0 -> 1
    assert out.r.tolist() == [F32(ret * F32(10.0)), F32(-ret * F32(10.0))]
    assert out.ring_pos.tolist() == [0, 5]  # rows 3 and 4 written, the cursor wrapped
    rows = [3, 4]
    np.testing.assert_array_equal(out.ring_s[rows], np.arange(12, dtype=F32).reshape(2, 6))
    assert out.ring_a[rows, 0].tolist() == [2, 0]
    assert out.ring_r[rows].tolist() == out.r.tolist()
    assert out.ring_discount[rows].tolist() == [F32(0.9)] * 2  # n_step 1: gamma_ref
    assert out.ring_regime[rows].tolist() == [2, 2]  # bar 0's label
    assert out.priority.tolist() == [0, 0, 0, 4.0, 4.0]
    assert np.all(out.ring_s[:3] == -1) and np.all(out.ring_r[:3] == -1)  # other rows kept
    # s2: bar 1's features, the position taken, tanh(100 pnl) with pnl = +-(110 - 100) / 100
    # (entered at bar 0's close), tanh(1 / 64) (one bar held), zero padding
    assert out.ring_s2[3, :3].tolist() == [1.0, 0.5, 1.0]
    assert out.ring_s2[4, :3].tolist() == [1.0, 0.5, -1.0]
    np.testing.assert_allclose(out.ring_s2[rows, 3], [np.tanh(10.0), -np.tanh(10.0)], rtol=1e-6)
    np.testing.assert_allclose(out.ring_s2[rows, 4], [np.tanh(1 / 64)] * 2, rtol=1e-6)
    assert out.ring_s2[rows, 5].tolist() == [0.0, 0.0]
    np.testing.assert_array_equal(out.obs, out.s2)  # no episode ended: obs = s2
    assert out.t.tolist() == [1, 1] and out.position.tolist() == [1.0, -1.0]


def test_n_step_windows_hold_the_step_until_they_fill():
    out = _transition([0.0, 1.0, 3.0, 5.0, 1.0, 2.0], n_step=2, win_len=(0, 1))
    # env 0 starts its window (nothing out); env 1's window fills: its two-step transition out
    assert out.win_len.tolist() == [1, 1]
    assert out.ring_pos.tolist() == [4, 4]
    assert out.priority.tolist() == [0, 0, 0, 4.0, 0]
    assert out.ring_discount[3] == F32(F32(0.9) * F32(0.9))
    # the window's old entry (zeros: state, action, reward) then this step's reward * gamma
    assert out.ring_r[3] == F32(F32(0.9) * out.r[1])
    assert out.ring_a[3, 0] == 0 and np.all(out.ring_s[3] == 0)
    np.testing.assert_array_equal(out.ring_s2[3], out.s2[1])
    np.testing.assert_array_equal(out.win_s[0, 0], np.arange(6, dtype=F32))  # obs of env 0


def test_replay_batch_samples_the_only_positive_row_with_unit_weights():
    cap, sd, nb = 1500, 3, 2  # two tiles of the ring scan
    ring = _ring(cap, sd, nb)
    ring["ring_s"] = np.arange(cap * sd, dtype=F32).reshape(cap, sd)
    ring["ring_s2"] = -ring["ring_s"]
    ring["ring_a"] = np.arange(cap * nb, dtype=I32).reshape(cap, nb) % 7
    ring["ring_r"] = np.arange(cap, dtype=F32)
    prio = ring.pop("priority")
    prio[1234] = 0.25  # in the second tile
    tiles = replay.scan_tiles(prio)
    out = collect.replay_batch(tiles.s, tiles.block_sums, np.array([0, cap], I32), KEY,
                               np.array([3], np.int64), 4, prio, 0.4, **ring)
    assert out.idx.tolist() == [1234] * 4
    assert out.w.tolist() == [1.0] * 4
    np.testing.assert_array_equal(out.x[:4], np.repeat(ring["ring_s"][[1234]], 4, 0))
    np.testing.assert_array_equal(out.x[4:], np.repeat(ring["ring_s2"][[1234]], 4, 0))
    assert out.a.tolist() == [[ring["ring_a"][1234, 0]] * 4, [ring["ring_a"][1234, 1]] * 4]
    assert out.r.tolist() == [1234.0] * 4


def test_replay_batch_errors_name_the_argument():
    ring = _ring(8, 2, 1)
    prio = ring.pop("priority") + 1
    tiles = replay.scan_tiles(prio)
    with pytest.raises(ValueError, match="priority"):
        collect.replay_batch(tiles.s, tiles.block_sums, np.array([0, 8], I32), KEY,
                             np.array([0], np.int64), 4, prio[:-1], 0.4, **ring)


def test_the_collect_area_is_registered_everywhere():
    from foxhunt.conformance.specs import SPEC_TABLE
    from foxhunt.fast.cuda_parse import parse_cuda_dir
    from foxhunt.fast.kernels import KERNELS as FAST
    from foxhunt.reference.kernels import KERNELS as REF
    from foxhunt.conformance.registry import default_cuda_dir

    cuda = parse_cuda_dir(default_cuda_dir())
    for name in collect.KERNELS:
        assert name in REF and name in FAST and name in SPEC_TABLE and name in cuda, name
        assert cuda[name].where.startswith("collect.cu"), cuda[name].where
