"""Run directories, the writer lock, provenance and JSON output (issue 21 items 2 and 7)."""

import datetime as dt
import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from foxhunt.reference import jsonio, runs
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.loop import LoopSettings
from foxhunt.reference.market import Bars, SyntheticMarket


def strict_loads(text):
    """json.loads that refuses NaN / Infinity (what jq and JSON.parse do)."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


# ---------------------------------------------------------------------------------- jsonio
def test_dumps_writes_non_finite_values_as_null_everywhere():
    obj = {"a": math.nan, "b": [1.0, math.inf, -math.inf], "c": {"d": np.float32("nan")},
           "e": np.array([1.5, np.nan]), "f": (np.int64(3), np.bool_(True)), 4: "key"}
    assert strict_loads(jsonio.dumps(obj)) == {
        "a": None, "b": [1.0, None, None], "c": {"d": None}, "e": [1.5, None],
        "f": [3, True], "4": "key"}


def test_dumps_refuses_unknown_types():
    with pytest.raises(TypeError, match="object"):
        jsonio.dumps({"x": object()})


def test_write_json_is_atomic_and_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "summary.json"
    jsonio.write_json(path, {"v": 1})
    with pytest.raises(TypeError):
        jsonio.write_json(path, {"v": object()})  # fails while serialising
    assert strict_loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary left


def test_write_json_failing_midway_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    jsonio.write_json(path, {"v": 1})

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError, match="No space"):
        jsonio.write_json(path, {"v": 2})
    assert strict_loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_write_json_honours_the_umask_not_0600(tmp_path, umask):
    old = os.umask(umask)
    try:
        path = jsonio.write_json(tmp_path / "a.json", {})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_append_jsonl_one_valid_line_per_record(tmp_path):
    path = tmp_path / "m.jsonl"
    jsonio.append_jsonl(path, {"loss": math.nan, "i": 0})
    jsonio.append_jsonl(path, {"loss": 1.5, "i": 1})
    lines = path.read_text().splitlines()
    assert [strict_loads(x) for x in lines] == [{"loss": None, "i": 0}, {"loss": 1.5, "i": 1}]
    assert jsonio.read_jsonl(path) == [{"loss": None, "i": 0}, {"loss": 1.5, "i": 1}]


# ---------------------------------------------------------------------------------- directories
def test_new_run_dirs_never_collide(tmp_path):
    now = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    a = runs.new_run_dir(tmp_path / "runs", 7, now)
    b = runs.new_run_dir(tmp_path / "runs", 7, now)
    assert a.name == "20260102T030405Z-seed7"
    assert b.name == "20260102T030405Z-seed7-2"
    assert a.is_dir() and b.is_dir()


def test_point_latest_replaces_the_link_atomically(tmp_path):
    root = tmp_path / "runs"
    a = runs.new_run_dir(root, 0)
    b = runs.new_run_dir(root, 1)
    assert runs.point_latest(root, a)
    assert (root / "latest").resolve() == a.resolve()
    assert runs.point_latest(root, b)
    assert (root / "latest").resolve() == b.resolve()
    assert os.readlink(root / "latest") == b.name  # relative: the tree can be moved
    assert sorted(p.name for p in root.iterdir()) == sorted([a.name, b.name, "latest"])


def test_point_latest_leaves_a_real_directory_alone(tmp_path):
    root = tmp_path / "runs"
    (root / "latest").mkdir(parents=True)
    (root / "latest" / "metrics.jsonl").write_text("{}\n")
    assert not runs.point_latest(root, runs.new_run_dir(root, 0))
    assert (root / "latest" / "metrics.jsonl").read_text() == "{}\n"


def test_check_out_dir_refuses_non_empty_unless_overwrite_or_resume(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(runs.UsageError, match="not empty.*--overwrite"):
        runs.check_out_dir(out, overwrite=False, resume=False)
    assert runs.check_out_dir(out, overwrite=True, resume=False) == out
    assert runs.check_out_dir(out, overwrite=False, resume=True) == out
    assert runs.check_out_dir(tmp_path / "new" / "deeper", overwrite=False, resume=False).is_dir()


def test_overwrite_refuses_a_directory_that_holds_no_run(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(runs.UsageError, match="holds no foxhunt run"):
        runs.check_out_dir(tmp_path, overwrite=True, resume=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_clear_run_dir_removes_everything_but_the_lock(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "fold3_best.safetensors").write_bytes(b"old")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / runs.LOCK_NAME).touch()
    runs.clear_run_dir(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [runs.LOCK_NAME]


def test_truncate_lines_keeps_the_first_n_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"i": 0}\n{"i": 1}\n\n{"i": 2}\n')
    assert runs.truncate_lines(path, 2) == 2
    assert path.read_text() == '{"i": 0}\n{"i": 1}\n'
    assert runs.truncate_lines(tmp_path / "absent.jsonl", 3) == 0


# ---------------------------------------------------------------------------------- the lock
def test_lock_two_lock_objects_in_one_process(tmp_path):
    first = runs.lock_run_dir(tmp_path)
    with pytest.raises(runs.UsageError, match="another foxhunt process is writing"):
        runs.lock_run_dir(tmp_path)
    first.release()
    runs.lock_run_dir(tmp_path).release()  # free again once released


def test_lock_held_by_another_process(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from foxhunt.reference import runs
            lock = runs.lock_run_dir(Path({str(tmp_path)!r}))
            print("locked", flush=True)
            sys.stdin.readline()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(runs.UsageError, match=str(tmp_path)):
            runs.lock_run_dir(tmp_path)
    finally:
        holder.stdin.close()  # the holder exits; the OS releases its lock
        holder.wait(timeout=30)
    runs.lock_run_dir(tmp_path).release()


# ---------------------------------------------------------------------------------- provenance
def test_bars_hash_depends_on_every_value_and_not_on_the_source():
    bars = SyntheticMarket(3, 300).generate()
    same = Bars(bars.timestamp.copy(), bars.open.copy(), bars.high.copy(), bars.low.copy(),
                bars.close.copy(), bars.volume.copy(), bars.regime)
    assert runs.bars_sha256(same) == runs.bars_sha256(bars)
    changed = bars.close.copy()
    changed[-1] = np.nextafter(changed[-1], np.float32(np.inf))
    other = Bars(bars.timestamp, bars.open, bars.high, bars.low, changed, bars.volume, bars.regime)
    assert runs.bars_sha256(other) != runs.bars_sha256(bars)


def test_git_commit_of_a_checkout_and_its_dirty_flag(tmp_path, monkeypatch):
    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / "runs.py").write_text("# a stand-in checkout\n")
    git("init", "-q")
    git("add", "reference/runs.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    monkeypatch.setattr(runs, "__file__", str(tmp_path / "reference" / "runs.py"))
    assert runs.git_commit() == {"commit": git("rev-parse", "HEAD"), "dirty": False}
    (tmp_path / "reference" / "runs.py").write_text("# changed\n")
    assert runs.git_commit() == {"commit": git("rev-parse", "HEAD"), "dirty": True}


def test_git_commit_is_none_outside_a_checkout(tmp_path, monkeypatch):
    (tmp_path / "reference").mkdir()
    monkeypatch.setattr(runs, "__file__", str(tmp_path / "reference" / "runs.py"))
    assert runs.git_commit() is None


def test_run_config_round_trip(tmp_path):
    bars = SyntheticMarket(1, 200).generate()
    source = {**runs.synthetic_source("default", 200, 1), "sha256": runs.bars_sha256(bars)}
    rc = runs.RunConfig(config=DQNConfig.preset("tiny", gamma=(0.9, 0.95), lr=3e-4),
                        settings=LoopSettings(epochs=4, seed=1), data=source, backend="reference",
                        preset="tiny", threads=2)
    runs.write_run_config(tmp_path, rc)
    assert strict_loads((tmp_path / "config.json").read_text())["config"]["gamma"] == [0.9, 0.95]
    assert runs.read_run_config(tmp_path) == rc
    assert runs.bars_sha256(runs.load_bars(source)) == source["sha256"]


def test_load_bars_refuses_changed_data(tmp_path):
    bars = SyntheticMarket(1, 200).generate()
    source = {**runs.synthetic_source("default", 200, 2), "sha256": runs.bars_sha256(bars)}
    with pytest.raises(runs.UsageError, match="data changed"):
        runs.load_bars(source)


@pytest.mark.parametrize("text,match", [
    ("", "cannot read"), ('{"format": 99}', "format 99"), ('{"format": 1}', "no 'config'"),
])
def test_read_run_config_errors_name_the_file(tmp_path, text, match):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(runs.UsageError, match=match) as excinfo:
        runs.read_run_config(tmp_path)
    assert "config.json" in str(excinfo.value)
