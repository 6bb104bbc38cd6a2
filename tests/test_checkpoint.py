"""Checkpoints: bit-exact round trip, fingerprint and layout mismatches, interrupted saves,
file modes, integrity (damaged, truncated, random files) and the format before hashes."""

import errno
import hashlib
import json
import logging
import math
import os
import stat

import numpy as np
import pytest
import safetensors.numpy as st_numpy

from foxhunt.reference import checkpoint
from foxhunt.reference import isv as isv_mod
from foxhunt.reference.batch import Batch
from foxhunt.reference.checkpoint import (CheckpointError, CheckpointFingerprintMismatch,
                                          CheckpointNotFound, check_compatible, load_checkpoint,
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
        with pytest.raises(CheckpointFingerprintMismatch) as err:
            load(path)
        assert isinstance(err.value, isv_mod.FingerprintMismatch)  # either class catches it
        msg = str(err.value)
        assert f"{FAKE_FINGERPRINT:016x}" in msg.lower() and ours in msg.lower()
        assert str(path) in msg


def _rewrite(path, tensors=None, **changes):
    """Rewrite checkpoint ``path`` with ``tensors`` (default: its own) and metadata ``changes``,
    under a valid integrity hash: the later checks (format, fingerprint, layout) are reached."""
    meta = read_metadata(path)
    meta.update(changes)
    tensors = st_numpy.load_file(str(path)) if tensors is None else tensors
    meta[checkpoint.HASH_KEY] = checkpoint.integrity_hash(meta, tensors)
    st_numpy.save_file(tensors, str(path), metadata=meta)


def test_fingerprint_mismatch_in_isv_slots_names_both(trained):
    """Metadata intact, but the ISV vector's fingerprint slots hand-edited in the file."""
    trainer, _, path = trained
    trainer.save(path)
    tensors = st_numpy.load_file(str(path))
    isv_mod.write_fingerprint(tensors["isv"], FAKE_FINGERPRINT)
    _rewrite(path, tensors)
    with pytest.raises(CheckpointFingerprintMismatch) as err:
        Trainer.load(path)
    msg = str(err.value)
    assert f"{FAKE_FINGERPRINT:016x}" in msg.lower()
    assert f"{isv_mod.LAYOUT_FINGERPRINT:016x}" in msg.lower() and str(path) in msg


def test_layout_mismatch_names_both_shapes(trained):
    trainer, _, path = trained
    trainer.save(path)
    check_compatible(trainer.config, path)  # same layout: no error
    seed = DQNConfig()  # the seed sizes, core step
    assert param_count(seed) == SEED_PARAMS
    with pytest.raises(CheckpointError) as err:
        check_compatible(seed, path)
    msg = str(err.value)
    assert str(param_count(trainer.config)) in msg and str(SEED_PARAMS) in msg


def test_param_layout_edited_in_metadata_is_rejected(trained):
    trainer, _, path = trained
    trainer.save(path)
    _rewrite(path, param_layout="0|w_s1|16x16|0")
    with pytest.raises(CheckpointError, match="layout"):
        Trainer.load(path)


def test_unknown_format_is_rejected(trained):
    trainer, _, path = trained
    trainer.save(path)
    _rewrite(path, format="foxhunt-checkpoint-0")
    with pytest.raises(CheckpointError, match="foxhunt-checkpoint-0") as err:
        Trainer.load(path)
    assert str(path) in str(err.value)


def test_config_of_another_version_is_a_checkpoint_error(trained):
    trainer, _, path = trained
    trainer.save(path)
    config = json.loads(read_metadata(path)["config"])
    _rewrite(path, config=json.dumps({**config, "warp_factor": 9}))
    with pytest.raises(CheckpointError, match="warp_factor") as err:
        Trainer.load(path)
    assert str(path) in str(err.value)


def test_missing_checkpoint(tmp_path):
    path = tmp_path / "nope.safetensors"
    for load in (load_checkpoint, Trainer.load, read_metadata):
        with pytest.raises(CheckpointNotFound) as err:
            load(path)
        assert isinstance(err.value, CheckpointError) and isinstance(err.value, FileNotFoundError)
        assert str(path) in str(err.value) and "does not exist" in str(err.value)


ENOSPC = OSError(errno.ENOSPC, "No space left on device")


def _failing_save(monkeypatch, path, where: str, exc: BaseException) -> list:
    """Patch the ``os`` function ``where`` (``write``, ``fsync`` or ``replace``) so that the next
    save fails there with ``exc``; ``write`` first writes half of what it is given (a disk that
    fills up mid-write). Returns the directory listings seen at the failure."""
    seen: list = []
    real = getattr(os, where)

    def failing(*args, **kwargs):
        seen.append(sorted(os.listdir(path.parent)))
        if where == "write" and len(seen) == 1:
            fd, data = args
            return real(fd, bytes(data[: len(data) // 2]))
        raise exc
    monkeypatch.setattr(os, where, failing)
    return seen


FAILURES = {  # id: (os function that fails, exception)
    "write_oserror": ("write", ENOSPC),
    "write_keyboardinterrupt": ("write", KeyboardInterrupt()),
    "fsync_oserror": ("fsync", ENOSPC),
    "replace_oserror": ("replace", OSError(errno.EACCES, "Permission denied")),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_interrupted_save_keeps_the_previous_checkpoint(trained, monkeypatch, case):
    where, exc = FAILURES[case]
    trainer, batch, path = trained
    trainer.save(path)
    good = path.read_bytes()
    good_state = trainer.state_dict()
    trainer.step(batch)  # the state now differs from the file

    with monkeypatch.context() as m:
        seen = _failing_save(m, path, where, exc)
        with pytest.raises(type(exc)):
            trainer.save(path)
    assert seen  # the patched function was reached
    # ... while a temporary file beside the intact checkpoint was being written:
    tmp = [n for n in seen[0] if n != path.name]
    assert len(tmp) == 1 and tmp[0].startswith(f".{path.name}.") and tmp[0].endswith(".tmp")
    assert path.read_bytes() == good
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp files left
    loaded = Trainer.load(path)
    assert_state_bitwise_equal(loaded.state_dict(), good_state)


def test_interrupted_first_save_leaves_nothing(tmp_path, monkeypatch):
    trainer = Trainer(DQNConfig.preset("tiny"))
    path = tmp_path / "first.safetensors"
    seen = _failing_save(monkeypatch, path, "write", OSError("disk gone"))
    with pytest.raises(OSError, match="disk gone"):
        trainer.save(path)
    monkeypatch.undo()
    assert len(seen) == 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes and umask")
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)],
                         ids=["umask022", "umask002", "umask077"])
def test_checkpoint_mode_follows_the_umask(tmp_path, umask, mode):
    trainer = Trainer(DQNConfig.preset("tiny"))
    path = tmp_path / "mode.safetensors"
    path.write_bytes(b"an older file of mode 0600")
    path.chmod(0o600)  # replaced by the save, so its mode does not carry over
    old = os.umask(umask)
    try:
        trainer.save(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    Trainer.load(path)


def test_extra_metadata_may_not_replace_the_hash(trained):
    trainer, _, path = trained
    with pytest.raises(ValueError, match="sha256"):
        save_checkpoint(path, trainer.config, trainer.state_dict(), backend="reference",
                        extra={"sha256": "0" * 64})


# ------------------------------------------------------------------ integrity
def test_integrity_hash_is_the_documented_recipe(trained):
    """Recomputed here from the module docstring's recipe with hashlib, from the tensors as
    safetensors decodes them: any tool can verify a checkpoint without foxhunt."""
    trainer, _, path = trained
    trainer.save(path)
    meta = read_metadata(path)
    tensors = st_numpy.load_file(str(path))
    names = sorted(tensors)
    described = {"metadata": {k: v for k, v in meta.items() if k != "sha256"},
                 "tensors": [[n, tensors[n].dtype.str, list(tensors[n].shape)] for n in names]}
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, separators=(",", ":"))
                            .encode("utf-8"))
    for n in names:
        digest.update(tensors[n].tobytes())
    assert meta["sha256"] == digest.hexdigest()
    assert len(names) == len(trainer.state_dict()) and "params" in names


def _safetensors_layout(data: bytes) -> tuple[int, dict]:
    """``(n, header)``: the header length and JSON header of safetensors bytes, read from the
    format's definition (u64 little-endian length, JSON header, then the data)."""
    n = int.from_bytes(data[:8], "little")
    return n, json.loads(data[8:8 + n])


def _flip(data: bytes, i: int, bit: int = 0) -> bytes:
    out = bytearray(data)
    out[i] ^= 1 << bit
    return bytes(out)


def _damaged(good: bytes) -> dict[str, tuple[bytes, str]]:
    """id: (file contents, a phrase the error must hold)."""
    n, header = _safetensors_layout(good)
    start, end = header["params"]["data_offsets"]
    in_params = 8 + n + (start + end) // 2
    in_config = good.index(b'"config":') + 40  # inside the config JSON string
    assert in_config < 8 + n
    random = np.random.default_rng(0).integers(0, 256, len(good), dtype=np.uint8).tobytes()
    return {
        "empty": (b"", "empty (0 bytes)"),
        "truncated_in_length": (good[:5], "truncated"),
        "truncated_in_header": (good[: 8 + n // 2], "truncated"),
        "truncated_in_data": (good[:-7], "truncated"),
        "random": (random, "not a safetensors checkpoint"),
        "bytes_appended": (good + bytes(8), "after its last tensor"),
        "flip_in_tensor_data": (_flip(good, in_params), "integrity hash"),
        "flip_in_metadata": (_flip(good, in_config), "integrity hash"),
        "flip_in_header_length": (_flip(good, 0), "damaged"),
    }


DAMAGES = ("empty", "truncated_in_length", "truncated_in_header", "truncated_in_data", "random",
           "bytes_appended", "flip_in_tensor_data", "flip_in_metadata", "flip_in_header_length")


@pytest.mark.parametrize("case", DAMAGES)
def test_damaged_checkpoint_raises_checkpoint_error_naming_the_file(trained, case):
    trainer, _, path = trained
    trainer.save(path)
    damages = _damaged(path.read_bytes())
    assert sorted(damages) == sorted(DAMAGES)
    contents, phrase = damages[case]
    path.write_bytes(contents)
    for load in (load_checkpoint, Trainer.load):
        with pytest.raises(CheckpointError) as err:  # not safetensors' own error class
            load(path)
        msg = str(err.value)
        assert str(path) in msg and phrase in msg, msg
        assert "\n" not in msg


def test_every_single_bit_flip_is_caught(trained):
    """One bit flipped at each byte of the header (length field, JSON, padding) and at 512
    places spread over the tensor data: every one raises CheckpointError naming the file."""
    trainer, _, path = trained
    trainer.save(path)
    good = path.read_bytes()
    n, _ = _safetensors_layout(good)
    places = list(range(8 + n)) + list(np.linspace(8 + n, len(good) - 1, 512).astype(int))
    missed = []
    for k, i in enumerate(places):
        path.write_bytes(_flip(good, i, bit=k % 8))
        try:
            load_checkpoint(path)
            missed.append((i, "loaded"))
        except CheckpointError as exc:
            if str(path) not in str(exc):
                missed.append((i, str(exc)))
    assert missed == [], missed[:5]


def test_a_hashed_format_without_its_hash_is_damaged(trained):
    trainer, _, path = trained
    trainer.save(path)
    meta = read_metadata(path)
    del meta["sha256"]
    st_numpy.save_file(st_numpy.load_file(str(path)), str(path), metadata=meta)
    with pytest.raises(CheckpointError, match="integrity hash is missing") as err:
        Trainer.load(path)
    assert str(path) in str(err.value)


def test_checkpoint_from_before_integrity_hashes_loads_with_a_warning(trained, caplog,
                                                                      monkeypatch):
    """Decision: format-1 files (no hash) still load, fingerprint and layout checked, with one
    warning naming the file; saving again writes the current, hashed format."""
    trainer, _, path = trained
    trainer.save(path)
    meta = read_metadata(path)
    del meta["sha256"]
    meta["format"] = "foxhunt-checkpoint-1"
    st_numpy.save_file(st_numpy.load_file(str(path)), str(path), metadata=meta)
    monkeypatch.setattr(logging.getLogger("foxhunt"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="foxhunt"):
        loaded = Trainer.load(path)
    assert_state_bitwise_equal(loaded.state_dict(), trainer.state_dict())
    [record] = [r for r in caplog.records if r.name == "foxhunt"]
    assert record.levelno == logging.WARNING
    assert str(path) in record.getMessage() and "predates integrity hashes" in record.getMessage()

    loaded.save(path)
    assert read_metadata(path)["format"] == checkpoint.FORMAT != "foxhunt-checkpoint-1"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="foxhunt"):
        Trainer.load(path)
    assert [r for r in caplog.records if r.name == "foxhunt"] == []


def test_read_metadata_of_a_damaged_header(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes((4).to_bytes(8, "little") + b"{no}")
    with pytest.raises(CheckpointError, match="header is not valid") as err:
        read_metadata(path)
    assert str(path) in str(err.value)


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
