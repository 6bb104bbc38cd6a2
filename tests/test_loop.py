"""The training loop and `foxhunt train`: folds, outputs, checkpoints, learning, CLI errors."""

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import replay as replay_kernels
from foxhunt.reference.loop import LoopSettings, choose_windows, fold_segments, run
from foxhunt.reference.market import SyntheticMarket
from foxhunt.reference.replay import ReplayBuffer, sample_sorted
from foxhunt.reference.trainer import Trainer


def test_fold_segments_are_contiguous_and_in_time_order():
    segs = fold_segments(10_000, 480, 3, 0.75)
    assert len(segs) == 3
    for (a, b, c), nxt in zip(segs, segs[1:] + [None]):
        assert 480 <= a < b < c
        assert b - a == int((c - a) * 0.75)
        if nxt:
            assert c == nxt[0]
    with pytest.raises(ValueError, match="need at least 64"):
        fold_segments(600, 480, 3, 0.75)


def test_choose_windows_fits_state_dim():
    assert choose_windows(128) == (5, 15, 60, 240)
    assert choose_windows(16) == (5,)
    with pytest.raises(ValueError, match="state_dim=8"):
        choose_windows(8)


def test_loop_settings_validation_names_the_field():
    with pytest.raises(ValueError, match="folds=0"):
        LoopSettings(folds=0)
    with pytest.raises(ValueError, match="train_frac=0.99"):
        LoopSettings(train_frac=0.99)
    with pytest.raises(ValueError, match="reward_scale"):
        LoopSettings(reward_scale=-1.0)


def test_replay_priorities_drive_sampling():
    cfg = DQNConfig.preset("tiny", batch_size=8)
    buf = ReplayBuffer(cfg, 64)
    rng = np.random.default_rng(0)
    b = Batch.random(cfg.replace(batch_size=64), rng)
    buf.add(b.s, b.a, b.r, b.s2, b.done)
    assert len(buf) == 64 and np.all(buf.priority == 1.0)
    td = np.zeros(64, np.float32)
    td[5] = 100.0
    buf.update_priorities(np.arange(64), td)
    counts = np.zeros(64)
    for _ in range(200):
        batch, idx = buf.sample(rng)
        counts += np.bincount(idx, minlength=64)
        assert batch.isw.max() == pytest.approx(1.0) and batch.isw.min() > 0
    p = buf.priority / buf.priority.sum()
    assert counts[5] / counts.sum() == pytest.approx(p[5], rel=0.05)
    # Non-finite TD errors keep the old priority.
    old = buf.priority.copy()
    buf.update_priorities(np.array([1, 2]), np.array([np.nan, np.inf], np.float32))
    assert np.array_equal(buf.priority, old)
    # Ring overwrite keeps the size at capacity.
    buf.add(b.s[:10], b.a[:10], b.r[:10], b.s2[:10], b.done[:10])
    assert len(buf) == 64 and buf.cursor == 10


def test_trained_policy_beats_flat_on_a_learnable_market():
    bars = SyntheticMarket.strong_trend(seed=1, n_bars=4000).generate()
    cfg = DQNConfig.preset("tiny", lr=1e-3, gamma=0.9, cql_alpha=0.1)
    res = run(cfg, bars, LoopSettings(folds=1, epochs=3, steps_per_epoch=150, seed=1))
    assert not res.halted and not res.interrupted
    assert len(res.records) == 3
    assert res.flat_sharpe[0] == 0.0
    assert res.best[0]["sharpe"] > res.flat_sharpe[0] + 10.0


def _foxhunt(*args, cwd):
    return subprocess.run([sys.executable, "-m", "foxhunt.reference.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_train_cli_end_to_end_writes_metrics_plots_and_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = _foxhunt("train", "--preset", "tiny", "--epochs", "1", "--folds", "1",
                    "--steps-per-epoch", "30", "--bars", "3000", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "fold epoch" in proc.stdout and "best Sharpe" in proc.stdout
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["fold"] == 0 and rec["epoch"] == 0 and np.isfinite(rec["loss"]) and rec["steps"] == 30
    for name in ("loss.png", "grad_norms.png", "sharpe.png", "equity.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpt = out / "checkpoints" / "fold0_best.safetensors"
    trainer = Trainer.load(ckpt)
    assert trainer.config == DQNConfig.preset("tiny") and trainer.step_count == 30
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs_completed"] == 1 and summary["halted"] is None


def test_train_cli_missing_csv_is_one_clear_line(tmp_path):
    proc = _foxhunt("train", "--data", "missing.csv", cwd=tmp_path)
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "missing.csv" in err[0] and "no such file" in err[0]


def test_train_cli_bad_csv_names_the_row(tmp_path):
    csv = tmp_path / "bars.csv"
    csv.write_text("timestamp,open,high,low,close,volume\n1,1,1,1,1,1\n2,1,1,1,-1,1\n")
    proc = _foxhunt("train", "--data", str(csv), cwd=tmp_path)
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "row" in err[0]


def test_ctrl_c_stops_cleanly_and_keeps_what_was_written(tmp_path):
    import signal
    import time

    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "foxhunt.reference.cli", "train", "--preset", "tiny", "--epochs", "200",
         "--folds", "1", "--steps-per-epoch", "20", "--bars", "3000", "--out", str(out)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stdout
    lines = metrics.read_text().splitlines()
    assert 2 <= len(lines) < 200
    assert all(json.loads(line)["fold"] == 0 for line in lines)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["epochs_completed"] == len(lines)
    assert (out / "loss.png").exists() and (out / "checkpoints" / "fold0_best.safetensors").exists()
    Trainer.load(out / "checkpoints" / "fold0_best.safetensors")


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_replay_buffer_search_is_the_sampling_kernel(data):
    """ReplayBuffer samples with numpy's binary search (``sample_sorted``); on the prefix sums of
    priorities like the buffer's (finite, > 0; ties and tiny values included) it returns exactly
    ``sample_proportional``'s indices, for any uniforms in [0, 1) (0 and the largest float32
    below 1 included)."""
    n = data.draw(st.integers(1, 300))
    levels = data.draw(st.lists(st.floats(float(np.float32(1e-6)), 1e3, width=32), min_size=1, max_size=5))
    prio = np.asarray(data.draw(st.lists(st.sampled_from(levels), min_size=n, max_size=n)),
                      np.float32)
    u = np.asarray(data.draw(st.lists(
        st.one_of(st.floats(0.0, 1.0, width=32, exclude_max=True),
                  st.sampled_from([0.0, float(np.nextafter(np.float32(1), np.float32(0)))])),
        min_size=1, max_size=64)), np.float32)
    prefix = replay_kernels.prefix_sum(prio)
    want = replay_kernels.sample_proportional(prefix, u)
    got = sample_sorted(prefix, u)
    assert got.dtype == np.int32 and np.array_equal(got, want)


def test_replay_buffer_search_breaks_exact_ties_like_the_kernel():
    """A target equal to a prefix sum takes the next item (the first prefix strictly above)."""
    prefix = replay_kernels.prefix_sum(np.ones(4, np.float32))  # 1 2 3 4
    u = np.array([0.0, 0.25, 0.5, 0.75], np.float32)  # targets 0 1 2 3, exact
    want = replay_kernels.sample_proportional(prefix, u)
    assert want.tolist() == [0, 1, 2, 3]
    assert np.array_equal(sample_sorted(prefix, u), want)
