"""The resume pair written in the background (``loop_state.CheckpointStore``): a snapshot taken
at ``save_resume``, joined before the next save, before the loop returns and before a read;
a writer's error is raised, not lost."""

import json
import threading
import time

import numpy as np
import pytest

from foxhunt.reference import checkpoint as checkpoint_mod
from foxhunt.reference import loop_state
from foxhunt.reference.checkpoint import load_checkpoint
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.loop import LoopSettings, resume_epochs, run
from foxhunt.reference.market import SyntheticMarket
from foxhunt.reference.trainer import Trainer

CONFIG = DQNConfig.preset("tiny")
SETTINGS = LoopSettings(folds=1, epochs=2, steps_per_epoch=4, n_envs=4, warmup_transitions=64,
                        replay_capacity=256, seed=5)
BARS = SyntheticMarket.preset("default", seed=3, n_bars=1200).generate()


def _fixture(tmp_path):
    trainer = Trainer(CONFIG, seed=0)
    progress = loop_state.Progress(fold=0, epoch=0, last_scalars=trainer.end_epoch())
    return loop_state.CheckpointStore(tmp_path), trainer, progress


def _save(store, trainer, progress):
    # epoch 0 of the next fold: no collector state is part of the pair
    return store.save_resume(trainer, progress, CONFIG, SETTINGS, BARS, collector=None)


def test_the_pair_written_is_the_snapshot_taken_at_save_resume(tmp_path, monkeypatch):
    store, trainer, progress = _fixture(tmp_path)
    expected = trainer.state_dict()
    go = threading.Event()
    real_save = checkpoint_mod.save_checkpoint

    def held(*args, **kwargs):  # the writer waits until the test has changed everything
        assert go.wait(10)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint_mod, "save_checkpoint", held)
    assert _save(store, trainer, progress) is True  # no previous write
    assert not (store.dir / loop_state.LAST_TRAINER).exists()  # returned before writing
    trainer.params += 1.0  # the next epoch trains on ...
    trainer.step_count += 7
    progress.low_grad_epochs = 3
    go.set()
    assert store.wait() is True
    _, state = load_checkpoint(store.dir / loop_state.LAST_TRAINER)
    assert set(state) == set(expected)
    for name in expected:
        np.testing.assert_array_equal(state[name], expected[name], err_msg=name)
    meta, arrays = store.read()
    assert (meta["trainer_step"], meta["low_grad_epochs"]) == (0, 0) and arrays == {}
    assert sorted(p.name for p in store.dir.iterdir()) == sorted([loop_state.LAST_TRAINER, loop_state.LAST_LOOP])


def test_a_writer_bug_is_raised_by_wait_and_leaves_no_temporary(tmp_path, monkeypatch):
    store, trainer, progress = _fixture(tmp_path)

    def bug(*args, **kwargs):
        raise RuntimeError("a bug in the writer")

    monkeypatch.setattr(checkpoint_mod, "save_checkpoint", bug)
    _save(store, trainer, progress)
    with pytest.raises(RuntimeError, match="a bug in the writer"):
        store.wait()
    assert store.wait() is True  # raised once; nothing pending any more
    assert list(store.dir.iterdir()) == []
    # ... and a bug in the write before the next save is raised by that save.
    _save(store, trainer, progress)
    with pytest.raises(RuntimeError, match="a bug in the writer"):
        _save(store, trainer, progress)
    store.wait()


def test_a_failed_write_is_reported_by_the_next_save(tmp_path, monkeypatch):
    store, trainer, progress = _fixture(tmp_path)

    failed = threading.Event()

    def disk_full(*args, **kwargs):
        failed.set()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_mod, "save_checkpoint", disk_full)
    assert _save(store, trainer, progress) is True
    assert failed.wait(10)
    monkeypatch.undo()
    assert _save(store, trainer, progress) is False  # the first write failed (warned)
    assert store.wait() is True  # the second one did not
    assert json.loads(str(np.load(store.dir / loop_state.LAST_LOOP)["meta"][()]))["fold"] == 0


def test_each_save_waits_for_the_previous_write(tmp_path, monkeypatch):
    store, trainer, progress = _fixture(tmp_path)
    events = []
    real_save = checkpoint_mod.save_checkpoint

    def slow(path, config, state, **kwargs):
        events.append(("start", int(state["step"][0])))
        time.sleep(0.2)
        real_save(path, config, state, **kwargs)
        events.append(("end", int(state["step"][0])))

    monkeypatch.setattr(checkpoint_mod, "save_checkpoint", slow)
    for step in (1, 2, 3):
        trainer.step_count = step
        _save(store, trainer, progress)
    store.wait()
    assert events == [(e, s) for s in (1, 2, 3) for e in ("start", "end")]
    assert store.read()[0]["trainer_step"] == 3


def test_the_loop_returns_with_its_last_pair_on_disk(tmp_path, monkeypatch):
    real_save = checkpoint_mod.save_checkpoint
    pending = []

    def slow(path, *args, **kwargs):
        if ".pending" in str(path):  # the resume pair's trainer file
            pending.append(path)
            time.sleep(0.3)
        return real_save(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_mod, "save_checkpoint", slow)
    stops = iter([False] * 7 + [True] * 100)  # stops during the second epoch
    result = run(CONFIG, BARS, SETTINGS, out_dir=tmp_path, should_stop=lambda: next(stops))
    assert result.interrupted and len(result.records) == 1 and len(pending) == 1
    assert resume_epochs(tmp_path) == 1  # written before run returned
    _, state = load_checkpoint(tmp_path / "checkpoints" / loop_state.LAST_TRAINER)
    assert int(state["step"][0]) == SETTINGS.steps_per_epoch
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "checkpoints").iterdir())
