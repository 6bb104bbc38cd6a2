"""Tests of the device-resident replay ring's reference kernels (``replay_add``,
``replay_sample``, ``replay_gather``, ``replay_update_priorities``): values checked by hand or by
an independent computation (a Python loop, float64 formulas, the Philox generator directly)."""

from __future__ import annotations

import numpy as np
import pytest

from foxhunt.reference.kernels import replay, rng

F32, I32 = np.float32, np.int32


def empty_ring(capacity: int, state_dim: int = 3, n_branches: int = 2) -> dict:
    return {"ring_s": np.zeros((capacity, state_dim), F32), "ring_a": np.zeros((capacity, n_branches), I32),
            "ring_r": np.zeros(capacity, F32), "ring_s2": np.zeros((capacity, state_dim), F32),
            "ring_done": np.zeros(capacity, F32), "ring_next_ret": np.zeros(capacity, F32),
            "ring_regime": np.zeros(capacity, I32), "ring_discount": np.zeros(capacity, F32),
            "priority": np.zeros(capacity, F32),
            "ring_pos": np.zeros(2, I32)}


def transitions(n: int, start: int, state_dim: int = 3, n_branches: int = 2) -> dict:
    """``n`` transitions whose every field encodes its number ``start + k``."""
    k = np.arange(start, start + n)
    return {"s": np.repeat(k[:, None], state_dim, 1).astype(F32),
            "a": np.repeat(k[:, None] % 3, n_branches, 1).astype(I32), "r": (k * 0.5).astype(F32),
            "s2": np.repeat(-k[:, None], state_dim, 1).astype(F32), "done": (k % 2).astype(F32),
            "next_ret": (k * 0.01).astype(F32), "regime": (k % 3).astype(I32),
            "discount": (1.0 / (k + 1)).astype(F32)}


def add(ring: dict, tr: dict, max_priority: float, n_valid=None) -> dict:
    out = replay.replay_add(**tr, **ring, max_priority=np.array([max_priority], F32),
                            n_valid=n_valid)
    return out._asdict()


# ----------------------------------------------------------------------------- replay_add


def test_replay_add_writes_at_the_cursor_and_wraps():
    ring = empty_ring(5)
    ring = add(ring, transitions(3, 0), 1.0)
    assert ring["ring_pos"].tolist() == [3, 3]
    ring = add(ring, transitions(4, 3), 2.0)  # rows 3, 4, then 0, 1 (overwriting 0 and 1)
    assert ring["ring_pos"].tolist() == [2, 5]
    assert ring["ring_s"][:, 0].tolist() == [5, 6, 2, 3, 4]
    assert ring["ring_s2"][:, 1].tolist() == [-5, -6, -2, -3, -4]
    assert ring["ring_r"].tolist() == [2.5, 3.0, 1.0, 1.5, 2.0]
    assert ring["ring_a"][:, 1].tolist() == [2, 0, 2, 0, 1]
    assert ring["ring_regime"].tolist() == [2, 0, 2, 0, 1]
    assert ring["ring_done"].tolist() == [1, 0, 0, 1, 0]
    assert ring["ring_discount"].tolist() == [F32(1 / 6), F32(1 / 7), F32(1 / 3), F32(1 / 4), F32(1 / 5)]
    assert ring["priority"].tolist() == [2.0, 2.0, 1.0, 2.0, 2.0]


def test_replay_add_with_a_device_count_writes_only_the_first_rows():
    """``n_valid`` (nstep_window's count): rows 0 .. n_valid - 1 of the given rows go in and
    the cursor moves by n_valid; 0 writes nothing."""
    ring = add(empty_ring(5), transitions(4, 0), 1.0, n_valid=np.array([2], I32))
    assert ring["ring_pos"].tolist() == [2, 2]
    assert ring["ring_s"][:, 0].tolist() == [0, 1, 0, 0, 0]
    assert ring["priority"].tolist() == [1.0, 1.0, 0, 0, 0]
    ring = add(ring, transitions(4, 10), 3.0, n_valid=np.array([0], I32))
    assert ring["ring_pos"].tolist() == [2, 2] and ring["ring_s"][:, 0].tolist() == [0, 1, 0, 0, 0]
    ring = add(ring, transitions(4, 20), 3.0, n_valid=np.array([4], I32))  # wraps
    assert ring["ring_pos"].tolist() == [1, 5]
    assert ring["ring_s"][:, 0].tolist() == [23, 1, 20, 21, 22]
    with pytest.raises(ValueError, match="n_valid"):
        add(ring, transitions(4, 0), 1.0, n_valid=np.array([5], I32))


def test_replay_add_leaves_its_inputs_alone():
    ring = empty_ring(4)
    before = {k: v.copy() for k, v in ring.items()}
    add(ring, transitions(2, 0), 1.0)
    assert all(np.array_equal(ring[k], before[k]) for k in ring)


def test_replay_add_rejects_a_cursor_outside_the_ring_and_too_many_transitions():
    ring = empty_ring(4)
    ring["ring_pos"] = np.array([4, 0], I32)
    with pytest.raises(ValueError, match="ring_pos"):
        add(ring, transitions(1, 0), 1.0)
    with pytest.raises(ValueError, match="5 transitions not allowed"):
        add(empty_ring(4), transitions(5, 0), 1.0)


# -------------------------------------------------------------------------- replay_sample


def test_replay_sample_is_the_first_prefix_above_the_philox_target_among_filled_rows():
    gen = np.random.default_rng(3)
    cap, size, n, key, cycle = 50, 37, 64, 2**40 + 7, 123_456
    p = np.zeros(cap, F32)
    p[:size] = gen.uniform(0.1, 2.0, size).astype(F32)
    p[gen.choice(size, 5, replace=False)] = 0  # zero priorities are never sampled
    prefix = np.cumsum(p, dtype=F32)
    idx = replay.replay_sample(prefix, np.array([size % cap, size], I32), key,
                               np.array([cycle], np.int64), n)
    u = rng.uniform(key, rng.STREAMS["replay_sample"], cycle, np.arange(n))
    for k in range(n):
        target = F32(u[k] * prefix[size - 1])
        want = next(i for i in range(size) if prefix[i] > target)  # a linear scan
        assert idx[k] == want
    assert p[idx].min() > 0


def test_replay_sample_draws_change_with_the_cycle_and_the_key():
    prefix = np.cumsum(np.ones(1000, F32), dtype=F32)
    pos = np.array([0, 1000], I32)
    first = replay.replay_sample(prefix, pos, 1, np.array([5], np.int64), 32)
    assert not np.array_equal(first, replay.replay_sample(prefix, pos, 1, np.array([6], np.int64), 32))
    assert not np.array_equal(first, replay.replay_sample(prefix, pos, 2, np.array([5], np.int64), 32))
    assert np.array_equal(first, replay.replay_sample(prefix, pos, 1, np.array([5], np.int64), 32))


def test_replay_sample_with_a_nan_total_stays_on_the_filled_rows():
    """A NaN total (a poisoned priority) makes every comparison false: the clamp gives the last
    filled row, never an empty one."""
    p = np.zeros(10, F32)
    p[:4] = [1, np.nan, 1, 1]
    idx = replay.replay_sample(np.cumsum(p, dtype=F32), np.array([4, 4], I32), 0,
                               np.zeros(1, np.int64), 8)
    assert idx.tolist() == [3] * 8


# -------------------------------------------------------------------------- replay_gather


def test_replay_gather_lays_rows_out_like_the_step_batch():
    ring = add(empty_ring(6, state_dim=3, n_branches=2), transitions(6, 10), 1.0)
    ring = {k: v for k, v in ring.items() if k not in ("priority", "ring_pos")}
    idx = np.array([4, 0, 4], I32)
    g = replay.replay_gather(idx, **ring)
    assert g.x.shape == (6, 3)
    assert g.x[:, 0].tolist() == [14, 10, 14, -14, -10, -14]  # s rows, then s2 rows
    assert g.a.shape == (2, 3) and g.a.tolist() == [[2, 1, 2], [2, 1, 2]]  # one row per branch
    assert g.r.tolist() == [7.0, 5.0, 7.0]
    assert g.done.tolist() == [0, 0, 0]
    assert g.next_ret.tolist() == [F32(0.14), F32(0.10), F32(0.14)]
    assert g.regime.tolist() == [2, 1, 2]
    assert g.discount.tolist() == [F32(1 / 15), F32(1 / 11), F32(1 / 15)]


def test_replay_gather_rejects_an_index_outside_the_ring():
    ring = {k: v for k, v in empty_ring(4).items() if k not in ("priority", "ring_pos")}
    with pytest.raises(ValueError, match=r"capacity=4"):
        replay.replay_gather(np.array([4], I32), **ring)


# ---------------------------------------------------------------- replay_update_priorities


def test_update_priorities_last_write_wins_and_non_finite_takes_the_old_maximum():
    priority = np.full(8, 0.5, F32)
    td = np.array([1.0, np.nan, 3.0, -2.0, np.inf], F32)
    idx = np.array([2, 5, 2, 6, 7], I32)
    out = replay.replay_update_priorities(td, idx, priority, np.array([1.5], F32), 0.5, 0.25)

    def pw(t):  # float64 formula on the float32 sum, rounded once
        return float(np.float32(np.float64(np.float32(abs(t) + np.float32(0.25))) ** 0.5))

    p = out.priority
    assert abs(float(p[2]) - pw(3.0)) <= np.spacing(F32(pw(3.0)))  # the later of the two writes
    assert p[5] == F32(1.5) and p[7] == F32(1.5)  # non-finite: the maximum before the update
    assert abs(float(p[6]) - pw(-2.0)) <= np.spacing(F32(pw(-2.0)))
    assert p[[0, 1, 3, 4]].tolist() == [0.5] * 4  # rows not sampled keep their priority
    assert out.max_priority.tolist() == [max(1.5, float(p[2]), float(p[6]))]


def test_update_priorities_max_never_decreases_and_replaces_a_nan():
    out = replay.replay_update_priorities(np.array([0.0], F32), np.array([0], I32), np.ones(2, F32),
                                          np.array([np.nan], F32), 1.0, 1e-3)
    assert out.max_priority[0] == F32(1e-3)
    out = replay.replay_update_priorities(np.array([0.0], F32), np.array([0], I32), np.ones(2, F32),
                                          np.array([7.0], F32), 1.0, 1e-3)
    assert out.max_priority[0] == F32(7.0)


def test_last_occurrence_marks_the_final_position_of_each_value():
    assert replay.last_occurrence(np.array([3, 1, 3, 2, 1], I32)).tolist() == [False, False, True, True, True]


def test_cycle_advance_adds_one_and_rejects_a_negative_or_unsigned_counter():
    assert replay.cycle_advance(np.array([41], np.int64)).tolist() == [42]
    with pytest.raises(ValueError, match="cycle"):
        replay.cycle_advance(np.array([-1], np.int64))
    with pytest.raises(ValueError, match="cycle"):
        replay.cycle_advance(np.array([1], np.uint64))
