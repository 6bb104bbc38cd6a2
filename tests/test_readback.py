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
from foxhunt.reference.backend import READBACK_FIELDS, DeferredReadback, StepScalars
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.trainer import Trainer

VALUE_FIELDS = (*READBACK_FIELDS, "flags")


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


# ------------------------------------------------------------------ the rule and the block, alone
def test_readback_fields_are_the_step_scalars_values_in_declaration_order():
    names = [f.name for f in dataclasses.fields(StepScalars)]
    assert names[:3] == ["step", "read_at", "fresh"] and names[-1] == "flags"
    assert READBACK_FIELDS == tuple(names[3:-1])
    # cuda_src/step.cu writes indices 0..11 (loss .. mean_target_q); the second-wave scalars
    # follow them, so the core block keeps its layout.
    assert READBACK_FIELDS[0] == "loss" and READBACK_FIELDS[11] == "mean_target_q"
    assert READBACK_FIELDS[12:] == ("iqn_loss", "iqn_norm_pre", "iqn_norm_post", "ens_loss",
                                    "ens_norm_pre", "ens_norm_post", "aux_next_bar_loss",
                                    "aux_regime_loss", "mse_loss", "mse_weight")


def test_from_readback_reads_a_block_in_field_order():
    block = np.arange(1, len(READBACK_FIELDS) + 1, dtype=np.float32)
    got = StepScalars.from_readback(7, block, np.array([0, 3], np.int32))
    assert (got.step, got.read_at, got.fresh, got.flags) == (7, 7, True, (0, 3))
    for i, name in enumerate(READBACK_FIELDS):
        want = True if name == "safety_clip_fired" else float(i + 1)
        assert getattr(got, name) == want and type(getattr(got, name)) is type(want), name
    block[READBACK_FIELDS.index("safety_clip_fired")] = 0.0
    assert StepScalars.from_readback(7, block, []).safety_clip_fired is False
    with pytest.raises(ValueError, match=f"readback block: 3 values, expected {len(READBACK_FIELDS)}"):
        StepScalars.from_readback(7, block[:3], [])


def test_zero_scalars_before_any_read():
    zero = StepScalars.zero(3)
    assert (zero.step, zero.read_at, zero.fresh, zero.flags) == (0, 0, False, (0, 0, 0))
    assert all(getattr(zero, f) == 0 for f in READBACK_FIELDS) and zero.all_finite()
    assert zero.safety_clip_fired is False


def _block(finite: bool) -> list[float]:
    values = [1.0] * len(READBACK_FIELDS)
    if not finite:
        values[READBACK_FIELDS.index("loss")] = float("nan")
    return values


def test_deferred_readback_reads_only_when_due():
    """Interval 3, the read of step 3 non-finite: reads at 3, 4 (forced), 6 and at end_epoch;
    stale scalars keep the last read's step in read_at."""
    rule = DeferredReadback(3, 1)
    reads = []

    def reader(step: int):
        def read():
            reads.append(step)
            return StepScalars.from_readback(step, _block(step != 3), [0])
        return read

    got = [rule.after_step(k, reader(k)) for k in range(1, 8)]
    assert reads == [3, 4, 6]
    assert [(s.step, s.fresh, s.read_at) for s in got] == [
        (1, False, 0), (2, False, 0), (3, True, 3), (4, True, 4), (5, False, 4), (6, True, 6),
        (7, False, 6)]
    end = rule.end_epoch(7, reader(7))
    assert reads[-1] == 7 and (end.step, end.fresh, end.read_at) == (7, True, 7)
    rule.reset()
    again = rule.end_epoch(7, reader(99))
    assert reads[-1] == 7 and (again.step, again.fresh, again.read_at) == (7, False, 0)
    with pytest.raises(ValueError, match="readback_interval: 0; expected an int >= 1"):
        DeferredReadback(0, 1)


def test_as_stale_is_replace_without_touching_the_read():
    """``as_stale`` builds what ``dataclasses.replace(step=, fresh=False)`` builds: a new frozen
    ``StepScalars`` equal to it field for field, the original unchanged."""
    read = StepScalars.from_readback(6, [float(i) + 0.5 for i in range(len(READBACK_FIELDS))],
                                     [1, 0, 2])
    stale = read.as_stale(9)
    assert stale == dataclasses.replace(read, step=9, fresh=False)
    assert (stale.step, stale.read_at, stale.fresh, stale.flags) == (9, 6, False, (1, 0, 2))
    assert (read.step, read.fresh) == (6, True) and stale is not read
    with pytest.raises(dataclasses.FrozenInstanceError):
        stale.step = 10
