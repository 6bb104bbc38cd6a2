"""The training loop and `foxhunt train`: folds, outputs, checkpoints, learning, CLI errors."""

import json
import math
import statistics
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


def test_fold_segments_are_train_then_validation_then_test_in_time_order():
    segs = fold_segments(10_000, 480, 3, 0.125, 0.25)
    assert len(segs) == 3
    width = (10_000 - 480) // 3
    for f, seg in enumerate(segs):
        assert seg.train[0] == 480 + f * width
        assert seg.train[1] == seg.val[0] and seg.val[1] == seg.test[0]
        assert seg.test[1] == seg.train[0] + width
        assert seg.val[1] - seg.val[0] == int(width * 0.125)
        assert seg.test[1] - seg.test[0] == int(width * 0.25)
        if f + 1 < len(segs):
            assert seg.test[1] == segs[f + 1].train[0]
    with pytest.raises(ValueError, match="need at least 64 per fold"):
        fold_segments(600, 480, 3, 0.125, 0.125)
    # 200-bar folds, but 10-bar validation segments: too short to measure anything.
    with pytest.raises(ValueError, match=r"\(10 validation, 50 test\); need .* 16 per validation"):
        fold_segments(1080, 480, 3, 0.05, 0.25)


def test_choose_windows_fits_state_dim():
    assert choose_windows(128) == (5, 15, 60, 240)
    assert choose_windows(16) == (5,)
    with pytest.raises(ValueError, match="state_dim=8"):
        choose_windows(8)


def test_loop_settings_validation_names_the_field():
    with pytest.raises(ValueError, match="folds=0"):
        LoopSettings(folds=0)
    with pytest.raises(ValueError, match=r"val_frac=0.5: allowed range is \[0.05, 0.45\]"):
        LoopSettings(val_frac=0.5)
    with pytest.raises(ValueError, match="test_frac=0.01"):
        LoopSettings(test_frac=0.01)
    assert LoopSettings(val_frac=0.45, test_frac=0.45).val_frac == 0.45  # training keeps 10%
    with pytest.raises(ValueError, match="seed=-1"):
        LoopSettings(seed=-1)
    with pytest.raises(ValueError, match="reward_scale"):
        LoopSettings(reward_scale=-1.0)
    with pytest.raises(ValueError, match="val_frac='0.1'"):
        LoopSettings(val_frac="0.1")


def test_replay_priorities_drive_sampling():
    cfg = DQNConfig.preset("tiny", batch_size=8)
    buf = ReplayBuffer(cfg, 64)
    rng = np.random.default_rng(0)
    b = Batch.random(cfg.replace(batch_size=64), rng)
    buf.add(b.s, b.a, b.r, b.s2, b.done, next_ret=b.next_ret, regime=b.regime)
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
    buf.add(b.s[:10], b.a[:10], b.r[:10], b.s2[:10], b.done[:10], next_ret=b.next_ret[:10],
            regime=b.regime[:10])
    assert len(buf) == 64 and buf.cursor == 10


def test_trained_policy_beats_flat_on_a_learnable_market():
    bars = SyntheticMarket.strong_trend(seed=1, n_bars=4000).generate()
    cfg = DQNConfig.preset("tiny", lr=1e-3, gamma=0.9, cql_alpha=0.1)
    res = run(cfg, bars, LoopSettings(folds=1, epochs=3, steps_per_epoch=150, seed=1))
    assert res.status == "completed"
    assert len(res.records) == 3
    fold = res.folds[0]
    assert fold.flat["test"].sharpe == 0.0 and fold.flat["test"].turnover == 0.0
    # Reported on the test segment, at the epoch chosen on validation.
    assert fold.best["test"].sharpe > fold.flat["test"].sharpe + 10.0
    assert fold.best["test"].total_return > 0


def _foxhunt(*args, cwd):
    return subprocess.run([sys.executable, "-m", "foxhunt.reference.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_train_cli_end_to_end_writes_metrics_plots_and_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = _foxhunt("train", "--preset", "tiny", "--epochs", "1", "--folds", "1",
                    "--steps-per-epoch", "30", "--bars", "3000", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "fold epoch" in proc.stdout and "best epoch" in proc.stdout
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
    assert summary["status"] == "interrupted" and summary["epochs_completed"] == len(lines)
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


# ------------------------------------------------------------------ validation / test / report
from foxhunt.reference import loop as loop_mod  # noqa: E402
from foxhunt.reference import report  # noqa: E402
from foxhunt.reference.market import Bars  # noqa: E402
from foxhunt.reference.metrics import SegmentMetrics  # noqa: E402

TINY = DQNConfig.preset("tiny")
SHORT = LoopSettings(folds=2, epochs=3, steps_per_epoch=4, n_envs=2, warmup_transitions=32,
                     replay_capacity=128, seed=2)


def _scripted_run(monkeypatch):
    """A short run whose greedy evaluations return scripted Sharpes: validation 1, 3, 2 then
    4, 2, 0; test 5, 1, 9 then 7, 8, 6 (baselines evaluated for real)."""
    val, test = iter([1.0, 3.0, 2.0, 4.0, 2.0, 0.0]), iter([5.0, 1.0, 9.0, 7.0, 8.0, 6.0])
    real = loop_mod.evaluate_segment
    order = []

    def fake(trainer, bars, feats, config, segment, policy, per_year):
        if policy != "greedy":
            return real(trainer, bars, feats, config, segment, policy, per_year)
        kind = "val" if len(order) % 2 == 0 else "test"
        order.append((kind, segment))
        s = next(val if kind == "val" else test)
        return SegmentMetrics(s, s / 100, s / 1000, 2 * s, s / 10_000, 7), np.full(3, 1 + s)

    monkeypatch.setattr(loop_mod, "evaluate_segment", fake)
    bars = SyntheticMarket.preset("default", seed=3, n_bars=1200).generate()
    return run(TINY, bars, SHORT), order


def test_best_epoch_is_chosen_on_validation_and_reported_on_test(monkeypatch):
    res, order = _scripted_run(monkeypatch)
    # Each epoch evaluates the fold's validation segment, then its test segment.
    assert [k for k, _ in order] == ["val", "test"] * 6
    assert [seg for _, seg in order[:2]] == [res.folds[0].segments.val, res.folds[0].segments.test]
    f0, f1 = res.folds
    assert (f0.best_epoch, f0.best["val"].sharpe, f0.best["test"].sharpe) == (1, 3.0, 1.0)
    assert (f1.best_epoch, f1.best["val"].sharpe, f1.best["test"].sharpe) == (0, 4.0, 7.0)
    assert f0.best_equity == [2.0, 2.0, 2.0]  # the chosen epoch's test equity (1 + its Sharpe)
    summary = report.run_summary(res)
    assert summary["status"] == "completed" and summary["epochs_completed"] == 6
    assert [f["best_epoch"] for f in summary["folds"]] == [1, 0]
    o = summary["overall"]
    assert o["test_sharpe"] == (1.0 + 7.0) / 2 and o["val_sharpe"] == (3.0 + 4.0) / 2
    assert o["test_total_return"] == pytest.approx((0.01 + 0.07) / 2)
    assert o["test_turnover"] == (2.0 + 14.0) / 2
    assert o["flat_test_sharpe"] == 0.0
    bh = [f.buy_hold["test"].sharpe for f in res.folds]
    assert o["buy_hold_test_sharpe"] == pytest.approx(np.mean(bh), rel=1e-12)
    json.dumps(summary, allow_nan=False)
    text = report.summary_text(res)
    assert "fold 0 (bars: train" in text and "best epoch 1 on validation (Sharpe +3.00)" in text
    assert "test: Sharpe +1.00, return +1.00%" in text and "overall (mean of 2 folds" in text
    assert "347,760 bars a year (bars 60 s apart)" in text


def test_table_row_lines_up_with_its_header(monkeypatch):
    res, _ = _scripted_run(monkeypatch)
    rec = res.records[1]
    head, row = report.TABLE_HEADER, report.format_row(rec)
    # Every numeric column ends where its header ends.
    for name, value in (("epoch", rec.epoch), ("val Sh", rec.val_sharpe), ("test Sh", rec.test_sharpe)):
        end = head.index(name) + len(name)
        assert row[:end].split()[-1] == (f"{value:.2f}" if isinstance(value, float) else str(value))


def test_run_summary_turns_non_finite_values_into_null(monkeypatch):
    res, _ = _scripted_run(monkeypatch)
    res.folds[0].best["test"] = SegmentMetrics(float("nan"), 0.0, 0.0, 0.0, 0.0, 7)
    summary = report.run_summary(res)
    assert summary["folds"][0]["test"]["sharpe"] is None
    assert summary["overall"]["test_sharpe"] is None
    json.dumps(summary, allow_nan=False)


def test_interrupted_run_reports_the_folds_it_reached():
    bars = SyntheticMarket.preset("default", seed=3, n_bars=1200).generate()
    steps = []
    res = run(TINY, bars, SHORT, on_step=lambda i, s: steps.append(i),
              should_stop=lambda: len(steps) >= SHORT.epochs * SHORT.steps_per_epoch + 1)
    assert res.status == "interrupted" and len(res.records) == SHORT.epochs
    assert [f.best_epoch is None for f in res.folds] == [False, True]
    summary = report.run_summary(res)
    assert summary["status"] == "interrupted" and summary["folds"][1]["test"] is None
    text = report.summary_text(res)
    assert "fold 1 (bars" in text and "no finished epoch" in text


def test_daily_bars_report_the_textbook_buy_and_hold_sharpe():
    """The issue's case: daily bars. The buy-and-hold baseline's test Sharpe against one computed
    here from the closes (one market entry at the segment's first bar) with sqrt(252)."""
    syn = SyntheticMarket.preset("default", seed=3, n_bars=1200).generate()
    day = 86_400
    bars = Bars(1_600_000_000 + day * np.arange(len(syn)), syn.open, syn.high, syn.low, syn.close,
                syn.volume)
    res = run(TINY, bars, LoopSettings(folds=1, epochs=1, steps_per_epoch=2, n_envs=2,
                                       warmup_transitions=32, replay_capacity=64))
    assert res.bar_seconds == day and res.bars_per_year == 252
    a, b = res.folds[0].segments.test
    close = bars.close.astype(np.float64)
    r = (close[a + 1:b] - close[a:b - 1]) / close[a:b - 1]
    # One market order at bar a: fee + half spread + slippage coefficient x the bar's range.
    r[0] -= 1e-4 + 1e-4 + 0.1 * (float(bars.high[a]) - float(bars.low[a])) / close[a]
    want = statistics.mean(r) / statistics.stdev(r) * math.sqrt(252)
    got = res.folds[0].buy_hold["test"]
    assert got.sharpe == pytest.approx(want, rel=1e-5)
    assert got.total_return == pytest.approx(np.prod(1 + r) - 1, rel=1e-5, abs=1e-9)
    assert got.turnover == 1.0 and got.bars == b - a - 1
    assert res.records[0].test_sharpe == res.folds[0].best["test"].sharpe


def test_plots_mark_fold_boundaries_and_draw_the_baselines(monkeypatch, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from foxhunt.reference.plots import write_plots

    res, _ = _scripted_run(monkeypatch)
    vlines, hlines = [], []
    real_axvline, real_hlines = Axes.axvline, Axes.hlines
    monkeypatch.setattr(Axes, "axvline", lambda ax, x=0, *a, **k: vlines.append(x) or real_axvline(ax, x, *a, **k))
    monkeypatch.setattr(Axes, "hlines", lambda ax, y, *a, **k: hlines.append(y) or real_hlines(ax, y, *a, **k))
    paths = write_plots(tmp_path, res)
    assert [p.name for p in paths] == ["loss.png", "grad_norms.png", "sharpe.png", "equity.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    # Fold 1 starts at global epoch 3: a boundary at 2.5 on the three per-epoch plots, and at
    # fold 1's first bar on the equity plot.
    assert vlines == [2.5, 2.5, 2.5, res.folds[1].segments.train[0]]
    assert hlines == [v for f in res.folds for v in (f.flat["test"].sharpe, f.buy_hold["test"].sharpe)]
