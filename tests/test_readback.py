"""Deferred readback (SPEC 9): which step's scalars each ``step`` / ``end_epoch`` returns.

The oracle is a twin trainer with ``readback_interval=1`` (fresh every step) fed the same
batches from the same seed: the interval does not enter the arithmetic, so the twin's scalars
at step k are the values a readback at step k must return.
"""

import copy
import dataclasses

import numpy as np
import pytest

from foxhunt.reference import sentinels
from foxhunt.reference.backend import StepScalars
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.trainer import Trainer

VALUE_FIELDS = ("loss", "c51_loss", "cql_loss", "grad_norm", "c51_norm_pre", "c51_norm_post",
                "cql_norm_pre", "cql_norm_post", "clip_bound", "safety_clip_fired", "mean_q",
                "mean_target_q", "flags")


def values(s: StepScalars) -> tuple:
    """The read values (not the step/read_at/fresh bookkeeping); NaN compares equal to NaN."""
    return tuple("nan" if isinstance(v, float) and np.isnan(v) else v
                 for v in (getattr(s, f) for f in VALUE_FIELDS))


def assert_read(got: StepScalars, *, step: int, read_at: int, fresh: bool, like: StepScalars):
    assert (got.step, got.read_at, got.fresh) == (step, read_at, fresh), got
    assert values(got) == values(like)


def with_nan_reward(batch: Batch) -> Batch:
    r = batch.r.copy()
    r[3] = np.nan
    return dataclasses.replace(batch, r=r)


class Pair:
    """The trainer under test (``interval``) and its fresh-every-step twin, same seed."""

    def __init__(self, interval: int, seed: int = 4):
        self.config = DQNConfig.preset("tiny", readback_interval=interval)
        self.trainer = Trainer(self.config, seed=seed)
        self.twin = Trainer(self.config.replace(readback_interval=1), seed=seed)
        self.rng = np.random.default_rng(seed)

    def step(self, poison: bool = False) -> tuple[StepScalars, StepScalars]:
        batch = Batch.random(self.config, self.rng)
        if poison:
            batch = with_nan_reward(batch)
        with np.errstate(all="ignore"):
            got, ref = self.trainer.step(batch), self.twin.step(batch)
        assert ref.fresh and ref.read_at == self.twin.step_count
        return got, ref


@pytest.fixture(scope="module")
def _warm_pair_99():
    pair = Pair(100)
    for _ in range(99):
        pair.step()
    return pair


@pytest.fixture
def warm_pair_99(_warm_pair_99):
    """A ``Pair(100)`` after 99 clean steps (a private copy per test)."""
    return copy.deepcopy(_warm_pair_99)


def test_interval_100_sequence_then_end_epoch():
    pair = Pair(100)
    zero = pair.trainer.end_epoch()  # before any step: nothing read yet
    assert (zero.step, zero.read_at, zero.fresh) == (0, 0, False)
    assert zero.loss == 0.0 and zero.grad_norm == 0.0
    assert not any(zero.flags)

    read = {}
    for k in range(1, 200):
        got, ref = pair.step()
        read[k] = ref
        if k < 100:
            assert_read(got, step=k, read_at=0, fresh=False, like=zero)
        elif k == 100:
            assert_read(got, step=100, read_at=100, fresh=True, like=ref)
            assert got.loss > 0 and got.grad_norm > 0  # real values, not the initial zeros
        else:
            assert_read(got, step=k, read_at=100, fresh=False, like=read[100])
    assert values(read[199]) != values(read[100])  # staleness is observable

    end = pair.trainer.end_epoch()
    assert_read(end, step=199, read_at=199, fresh=True, like=read[199])
    got, ref = pair.step()
    assert_read(got, step=200, read_at=200, fresh=True, like=ref)
    got, _ = pair.step()
    assert_read(got, step=201, read_at=200, fresh=False, like=ref)


def test_end_epoch_mid_interval_becomes_the_last_read():
    pair = Pair(100)
    for _ in range(30):
        pair.step()
    ref30 = pair.twin.end_epoch()
    end = pair.trainer.end_epoch()
    assert_read(end, step=30, read_at=30, fresh=True, like=ref30)
    assert_read(pair.trainer.end_epoch(), step=30, read_at=30, fresh=True, like=ref30)
    for k in range(31, 36):
        got, _ = pair.step()
        assert_read(got, step=k, read_at=30, fresh=False, like=ref30)


def test_nonfinite_read_forces_a_fresh_read_on_the_next_step(warm_pair_99):
    """Step 100 (a readback step) has a NaN reward: its fresh read has a NaN loss, so step 101
    is read fresh too; step 102 is stale again."""
    pair = warm_pair_99
    got, ref = pair.step(poison=True)
    assert_read(got, step=100, read_at=100, fresh=True, like=ref)
    assert np.isnan(got.loss) and np.isnan(got.c51_loss) and not got.all_finite()
    assert "rewards" in sentinels.flagged_names(np.array(got.flags, np.int32))

    got, ref101 = pair.step()
    assert np.isfinite(ref101.loss)
    assert_read(got, step=101, read_at=101, fresh=True, like=ref101)
    got, _ = pair.step()
    assert_read(got, step=102, read_at=101, fresh=False, like=ref101)


def test_consecutive_nonfinite_reads_keep_forcing(warm_pair_99):
    pair = warm_pair_99
    for k, poison in ((100, True), (101, True), (102, False)):
        got, ref = pair.step(poison=poison)
        assert_read(got, step=k, read_at=k, fresh=True, like=ref)
        assert np.isnan(got.loss) == poison
    got, _ = pair.step()
    assert_read(got, step=103, read_at=102, fresh=False, like=ref)


def test_nonfinite_value_between_readbacks_is_not_read_but_flags_stick():
    """A NaN at step 50 is never read (SPEC 9: only readback steps are inspected), so step 51
    stays stale; the sentinel flag it set is sticky and shows at the step-100 read."""
    pair = Pair(100)
    for k in range(1, 101):
        got, ref = pair.step(poison=(k == 50))
        if k in (50, 51):
            assert not got.fresh and got.read_at == 0
    assert_read(got, step=100, read_at=100, fresh=True, like=ref)
    assert np.isfinite(got.loss)
    assert "rewards" in sentinels.flagged_names(np.array(got.flags, np.int32))


def test_nonfinite_end_epoch_read_forces_the_next_step():
    pair = Pair(100)
    for _ in range(9):
        pair.step()
    pair.step(poison=True)
    end = pair.trainer.end_epoch()
    assert end.fresh and end.read_at == 10 and np.isnan(end.loss)
    got, ref = pair.step()
    assert_read(got, step=11, read_at=11, fresh=True, like=ref)


@pytest.mark.parametrize("interval", [1, 3])
def test_small_intervals(interval):
    pair = Pair(interval)
    last = None
    for k in range(1, 8):
        got, ref = pair.step()
        if k % interval == 0:
            assert_read(got, step=k, read_at=k, fresh=True, like=ref)
            last = ref
        else:
            assert not got.fresh and got.read_at == (last.read_at if last else 0)
