"""Resume (issue 21 item 3): an interrupted run resumed from its run directory ends bitwise where
the uninterrupted run ends; ``should_stop``; failed checkpoint writes; stale temporary files."""

import dataclasses
import errno
import logging

import numpy as np
import pytest

from foxhunt.reference import checkpoint as checkpoint_mod
from foxhunt.reference import loop_state
from foxhunt.reference.checkpoint import load_checkpoint
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.loop import TIMING_FIELDS, LoopSettings, resume_epochs, run
from foxhunt.reference.market import SyntheticMarket

# readback_interval 5 with 12 steps per epoch: fresh reads fall inside epochs and across their
# ends, so the deferred readback's held values are exercised too.
CONFIG = DQNConfig.preset("tiny", readback_interval=5)
SETTINGS = LoopSettings(folds=2, epochs=3, steps_per_epoch=12, n_envs=4, warmup_transitions=64,
                        replay_capacity=256, seed=5)
BARS = SyntheticMarket.preset("default", seed=3, n_bars=1200).generate()
STEPS_PER_FOLD = SETTINGS.epochs * SETTINGS.steps_per_epoch


def _untimed(records):
    return [{k: v for k, v in dataclasses.asdict(r).items() if k not in TIMING_FIELDS} for r in records]


def _scalars(stream):
    return [(i, dataclasses.asdict(s)) for i, s in stream]


class Stopper:
    """``should_stop`` that turns True after ``after_steps`` training steps (counted through
    ``on_step``) or after ``after_epochs`` finished epochs (through ``on_epoch``)."""

    def __init__(self, after_steps=None, after_epochs=None):
        self.after_steps, self.after_epochs = after_steps, after_epochs
        self.steps = self.epochs = 0
        self.stream, self.new_records = [], []

    def on_step(self, i, scalars):
        self.steps += 1
        self.stream.append((i, scalars))

    def on_epoch(self, rec):
        self.epochs += 1
        self.new_records.append(rec)

    def __call__(self):
        return ((self.after_steps is not None and self.steps >= self.after_steps)
                or (self.after_epochs is not None and self.epochs >= self.after_epochs))

    def run(self, out_dir, resume=False):
        return run(CONFIG, BARS, SETTINGS, out_dir=out_dir, on_step=self.on_step,
                   on_epoch=self.on_epoch, should_stop=self, resume=resume)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    full = Stopper()
    result = full.run(out)
    assert result.status == "completed" and len(result.records) == SETTINGS.folds * SETTINGS.epochs
    _, state = load_checkpoint(out / "checkpoints" / "last.safetensors")
    return result, state, full.stream


def _assert_same_end(out, result, reference):
    ref_result, ref_state, _ = reference
    assert result.status == "completed"
    _, state = load_checkpoint(out / "checkpoints" / "last.safetensors")
    assert sorted(state) == sorted(ref_state)
    for k in ref_state:
        assert state[k].dtype == ref_state[k].dtype
        assert np.array_equal(state[k], ref_state[k]), k
    assert _untimed(result.records) == _untimed(ref_result.records)
    ref_dir = ref_result.folds[0].checkpoint.rsplit("/checkpoints/")[0]
    assert _folds(result.folds, out) == _folds(ref_result.folds, ref_dir)


def _folds(folds, out_dir):
    """The fold results with each checkpoint path relative to its run directory."""
    items = [dataclasses.asdict(f) for f in folds]
    for item in items:
        assert item["checkpoint"].startswith(str(out_dir))
        item["checkpoint"] = item["checkpoint"][len(str(out_dir)):]
    return items


# Stop points: inside fold 0 (epoch 1, replay and walks restored), at an epoch end, inside fold
# 1's first epoch (fold boundary on resume) and inside its last epoch.
@pytest.mark.parametrize("stop", [
    {"after_steps": SETTINGS.steps_per_epoch + 7},
    {"after_epochs": 1},
    {"after_epochs": SETTINGS.epochs},
    {"after_steps": STEPS_PER_FOLD + 3},
    {"after_steps": STEPS_PER_FOLD + 2 * SETTINGS.steps_per_epoch + 11},
], ids=["fold0-mid-epoch1", "fold0-after-epoch0", "fold-end", "fold1-mid-epoch0", "fold1-mid-epoch2"])
def test_interrupted_then_resumed_ends_bitwise_where_the_uninterrupted_run_ends(tmp_path, reference_run, stop):
    first = Stopper(**stop)
    interrupted = first.run(tmp_path)
    assert interrupted.interrupted and interrupted.status == "interrupted"
    done = first.epochs
    assert len(interrupted.records) == done and resume_epochs(tmp_path) == done
    # The epoch in progress was not recorded: the records are the uninterrupted run's first ones.
    assert _untimed(interrupted.records) == _untimed(reference_run[0].records[:done])

    second = Stopper()
    resumed = second.run(tmp_path, resume=True)
    _assert_same_end(tmp_path, resumed, reference_run)
    assert _untimed(second.new_records) == _untimed(reference_run[0].records[done:])
    # The resumed steps see the same scalars as the uninterrupted run's (stale ones included).
    ref_stream = reference_run[2]
    assert _scalars(second.stream) == _scalars(ref_stream[len(ref_stream) - len(second.stream):])


def test_interrupted_twice_still_ends_where_the_uninterrupted_run_ends(tmp_path, reference_run):
    Stopper(after_steps=5).run(tmp_path)  # before the first epoch ends: nothing saved yet
    with pytest.raises(loop_state.ResumeError, match="no resume state"):
        resume_epochs(tmp_path)
    Stopper(after_epochs=2).run(tmp_path)
    again = Stopper(after_steps=SETTINGS.steps_per_epoch * 2 + 1)
    again.run(tmp_path, resume=True)
    assert resume_epochs(tmp_path) == 4
    _assert_same_end(tmp_path, Stopper().run(tmp_path, resume=True), reference_run)


def test_resuming_a_finished_run_returns_its_records(tmp_path, reference_run):
    Stopper().run(tmp_path)
    again = Stopper()
    result = again.run(tmp_path, resume=True)
    assert again.new_records == [] and again.steps == 0
    _assert_same_end(tmp_path, result, reference_run)


def test_resume_refuses_another_run(tmp_path):
    Stopper(after_epochs=1).run(tmp_path)
    with pytest.raises(loop_state.ResumeError, match=r"epochs=4 \(saved 3\)"):
        run(CONFIG, BARS, dataclasses.replace(SETTINGS, epochs=4), out_dir=tmp_path, resume=True)
    with pytest.raises(loop_state.ResumeError, match=r"lr=0.5 \(saved"):
        run(CONFIG.replace(lr=0.5), BARS, SETTINGS, out_dir=tmp_path, resume=True)
    other = SyntheticMarket.preset("default", seed=4, n_bars=1200).generate()
    with pytest.raises(loop_state.ResumeError, match="other bars"):
        run(CONFIG, other, SETTINGS, out_dir=tmp_path, resume=True)
    with pytest.raises(ValueError, match="needs out_dir"):
        run(CONFIG, BARS, SETTINGS, resume=True)


def test_a_torn_resume_pair_is_refused(tmp_path):
    Stopper(after_epochs=1).run(tmp_path)
    ckpt = tmp_path / "checkpoints"
    Stopper(after_epochs=2).run(tmp_path / "b")
    (tmp_path / "b" / "checkpoints" / "last.safetensors").replace(ckpt / "last.safetensors")
    with pytest.raises(loop_state.ResumeError, match="at step 24 but .* at step 12"):
        run(CONFIG, BARS, SETTINGS, out_dir=tmp_path, resume=True)


def test_a_failed_checkpoint_write_warns_and_the_run_goes_on(tmp_path, monkeypatch, caplog, reference_run):
    def disk_full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint_mod, "save_checkpoint", disk_full)
    with caplog.at_level(logging.WARNING, logger="foxhunt"):
        result = Stopper().run(tmp_path)
    assert result.status == "completed"
    assert _untimed(result.records) == _untimed(reference_run[0].records)
    warnings = [r.getMessage() for r in caplog.records if r.name == "foxhunt"]
    # Per epoch: the resume pair; per new best: the best checkpoint.
    assert len([w for w in warnings if "last.safetensors" in w]) == len(result.records)
    best_warnings = [w for w in warnings if "_best.safetensors" in w]
    assert best_warnings and all("No space left on device" in w for w in warnings)
    assert all(f.checkpoint is None for f in result.folds)
    assert all(len(w.splitlines()) == 1 for w in warnings)
    # Nothing half-written stays behind.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == []


def test_stale_temporary_files_are_removed_when_the_loop_starts(tmp_path):
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    stale = [ckpt / ".last.loop.npz.k3j2.tmp", ckpt / "..last.safetensors.pending.tmp.x1.tmp",
             ckpt / ".fold0_best.safetensors.ab12.tmp"]
    for path in stale:
        path.write_bytes(b"half")
    keep = ckpt / "notes.txt"
    keep.write_text("mine")
    Stopper(after_steps=1).run(tmp_path)
    assert not any(p.exists() for p in stale)
    assert keep.read_text() == "mine"


def test_should_stop_is_checked_before_the_first_epoch(tmp_path):
    calls = []
    result = run(CONFIG, BARS, SETTINGS, out_dir=tmp_path, should_stop=lambda: calls.append(1) or True,
                 on_step=lambda i, s: pytest.fail("no step should run"))
    assert result.interrupted and result.records == [] and calls == [1]
