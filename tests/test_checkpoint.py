"""Checkpoints: bit-exact round trip, fingerprint and layout mismatches, interrupted saves."""

import json
import math

import numpy as np
import pytest
import safetensors.numpy as st_numpy

from foxhunt.reference import checkpoint
from foxhunt.reference import isv as isv_mod
from foxhunt.reference.batch import Batch
from foxhunt.reference.checkpoint import (CheckpointError, check_compatible, load_checkpoint,
                                          read_metadata, save_checkpoint)
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.trainer import Trainer

FAKE_FINGERPRINT = 0x0123456789ABCDEF
SEED_PARAMS = 289_611  # SPEC 3


def assert_state_bitwise_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), f"state[{k!r}] differs"


def param_count(c: DQNConfig) -> int:
    """Parameters of the network of SPEC 3, from the sizes alone (no padding)."""
    dense = lambda n_in, n_out: n_in * n_out + n_out  # noqa: E731
    total = dense(c.state_dim, c.shared_h1) + dense(c.shared_h1, c.shared_h2)
    total += dense(c.shared_h2, c.value_h) + dense(c.value_h, c.num_atoms)
    for n in c.branches:
        total += dense(c.shared_h2, c.adv_h) + dense(c.adv_h, n * c.num_atoms)
    return total


@pytest.fixture
def trained(tmp_path):
    """A tiny trainer after a few steps (with one NaN-flagged step and a NaN-payload ISV slot),
    its next batch, and a path for its checkpoint."""
    config = DQNConfig.preset("tiny", readback_interval=1)
    trainer = Trainer(config, seed=9)
    rng = np.random.default_rng(9)
    for k in range(6):
        batch = Batch.random(config, rng)
        if k == 2:
            r = batch.r.copy()
            r[0] = np.nan
            batch = Batch(s=batch.s, a=batch.a, r=r, s2=batch.s2, done=batch.done, isw=batch.isw)
        with np.errstate(all="ignore"):
            trainer.step(batch)
    # A signalling-NaN payload in an ISV slot no producer touches: bits must survive the file.
    vec = trainer.isv.to_array()
    vec.view(np.uint32)[isv_mod.slot("REWARD_EMA").index] = np.uint32(0x7FA00ABC)
    trainer.isv.from_array(vec)
    assert trainer.flags.any() and trainer.adam_t == 6
    return trainer, Batch.random(config, rng), tmp_path / "ckpt" / "trainer.safetensors"


def test_round_trip_is_bit_exact_and_continues_identically(trained):
    trainer, batch, path = trained
    trainer.save(path)
    assert path.is_file()
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]

    meta = read_metadata(path)
    assert meta["format"] == checkpoint.FORMAT
    assert meta["fingerprint"] == f"{isv_mod.LAYOUT_FINGERPRINT:016x}"
    assert meta["backend"] == "reference"
    assert DQNConfig.from_dict(json.loads(meta["config"])) == trainer.config

    loaded = Trainer.load(path)
    assert isinstance(loaded, Trainer) and loaded.config == trainer.config
    assert_state_bitwise_equal(loaded.state_dict(), trainer.state_dict())
    assert loaded.isv.get_bits("LAYOUT_FINGERPRINT_LO") == trainer.isv.get_bits("LAYOUT_FINGERPRINT_LO")
    assert loaded.params_bf16.tobytes() == trainer.params_bf16.tobytes()
    assert loaded.target_bf16.tobytes() == trainer.target_bf16.tobytes()
    assert loaded.adam_t == trainer.adam_t and loaded.step_count == trainer.step_count

    a, b = trainer.step(batch), loaded.step(batch)
    assert a == b
    assert a.fresh and a.step == 7
    assert_state_bitwise_equal(loaded.state_dict(), trainer.state_dict())


def test_load_checkpoint_returns_config_and_state(trained):
    trainer, _, path = trained
    save_checkpoint(path, trainer.config, trainer.state_dict(), backend="reference",
                    extra={"rng_state": "abc"})
    config, state = load_checkpoint(path)
    assert config == trainer.config
    assert_state_bitwise_equal(state, trainer.state_dict())
    assert read_metadata(path)["rng_state"] == "abc"


def test_fingerprint_mismatch_in_metadata_names_both(trained, monkeypatch):
    trainer, _, path = trained
    with monkeypatch.context() as m:
        m.setattr(isv_mod, "layout_fingerprint", lambda *a, **k: FAKE_FINGERPRINT)
        trainer.save(path)
    ours = f"{isv_mod.LAYOUT_FINGERPRINT:016x}"
    for load in (load_checkpoint, Trainer.load):
        with pytest.raises(isv_mod.FingerprintMismatch) as err:
            load(path)
        msg = str(err.value).lower()
        assert f"{FAKE_FINGERPRINT:016x}" in msg and ours in msg


def test_fingerprint_mismatch_in_isv_slots_names_both(trained):
    """Metadata intact, but the ISV vector's fingerprint slots hand-edited in the file."""
    trainer, _, path = trained
    trainer.save(path)
    meta = read_metadata(path)
    tensors = st_numpy.load_file(str(path))
    isv_mod.write_fingerprint(tensors["isv"], FAKE_FINGERPRINT)
    st_numpy.save_file(tensors, str(path), metadata=meta)
    with pytest.raises(isv_mod.FingerprintMismatch) as err:
        Trainer.load(path)
    msg = str(err.value).lower()
    assert f"{FAKE_FINGERPRINT:016x}" in msg and f"{isv_mod.LAYOUT_FINGERPRINT:016x}" in msg


def _resave_with_metadata(path, **changes):
    meta = read_metadata(path)
    meta.update(changes)
    st_numpy.save_file(st_numpy.load_file(str(path)), str(path), metadata=meta)


def test_layout_mismatch_names_both_shapes(trained):
    trainer, _, path = trained
    trainer.save(path)
    check_compatible(trainer.config, path)  # same layout: no error
    seed = DQNConfig.preset("seed")
    assert param_count(seed) == SEED_PARAMS
    with pytest.raises(CheckpointError) as err:
        check_compatible(seed, path)
    msg = str(err.value)
    assert str(param_count(trainer.config)) in msg and str(SEED_PARAMS) in msg


def test_param_layout_edited_in_metadata_is_rejected(trained):
    trainer, _, path = trained
    trainer.save(path)
    _resave_with_metadata(path, param_layout="0|w_s1|16x16|0")
    with pytest.raises(CheckpointError, match="layout"):
        Trainer.load(path)


def test_unknown_format_is_rejected(trained):
    trainer, _, path = trained
    trainer.save(path)
    _resave_with_metadata(path, format="foxhunt-checkpoint-0")
    with pytest.raises(CheckpointError, match="foxhunt-checkpoint-0"):
        Trainer.load(path)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError):
        Trainer.load(tmp_path / "nope.safetensors")


def _broken_save_file(calls: list, exc: BaseException):
    """A ``save_file`` that writes half of the real serialisation, then raises ``exc``."""
    def broken(tensors, filename, metadata=None):
        data = st_numpy.save(tensors, metadata=metadata)
        with open(filename, "wb") as fh:
            fh.write(data[: len(data) // 2])
        calls.append(str(filename))
        raise exc
    return broken


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()],
                         ids=["oserror", "keyboardinterrupt"])
def test_interrupted_save_keeps_the_previous_checkpoint(trained, monkeypatch, exc):
    trainer, batch, path = trained
    trainer.save(path)
    good = path.read_bytes()
    good_state = trainer.state_dict()
    trainer.step(batch)  # the state now differs from the file

    calls: list[str] = []
    with monkeypatch.context() as m:
        m.setattr(st_numpy, "save_file", _broken_save_file(calls, exc))
        with pytest.raises(type(exc)):
            trainer.save(path)
    assert len(calls) == 1  # the patched writer was the one used
    assert calls[0] != str(path)  # it wrote a temporary file, not over the checkpoint

    assert path.read_bytes() == good
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp files left
    loaded = Trainer.load(path)
    assert_state_bitwise_equal(loaded.state_dict(), good_state)


def test_interrupted_first_save_leaves_nothing(tmp_path, monkeypatch):
    config = DQNConfig.preset("tiny")
    trainer = Trainer(config)
    path = tmp_path / "first.safetensors"
    calls: list[str] = []
    monkeypatch.setattr(st_numpy, "save_file", _broken_save_file(calls, OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):
        trainer.save(path)
    assert len(calls) == 1
    assert list(tmp_path.iterdir()) == []


def test_round_trip_of_a_fresh_trainer_then_training(tmp_path):
    """Save at step 0 (cold ISV, zero Adam state), load, and train both for a few steps."""
    config = DQNConfig.preset("tiny", readback_interval=2)
    a = Trainer(config, seed=3)
    path = tmp_path / "cold.safetensors"
    a.save(path)
    b = Trainer.load(path)
    rng = np.random.default_rng(0)
    for _ in range(4):
        batch = Batch.random(config, rng)
        sa, sb = a.step(batch), b.step(batch)
        assert sa == sb
        assert math.isfinite(sa.loss)
    assert_state_bitwise_equal(a.state_dict(), b.state_dict())
