"""``foxhunt eval --checkpoint PATH [--data CSV]``: the same metrics for a saved policy."""

import json
import math
import statistics
from dataclasses import asdict

import numpy as np
import pytest

from foxhunt.reference import runs
from foxhunt.reference.cli import cuda_status, main
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.loop import LoopSettings, choose_windows, run
from foxhunt.reference.market import SyntheticMarket, feature_warmup

TINY = DQNConfig.preset("tiny")
SETTINGS = LoopSettings(folds=2, epochs=2, steps_per_epoch=6, n_envs=2, warmup_transitions=32,
                        replay_capacity=128, seed=4)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished run directory (loop outputs plus the config.json the train CLI writes)."""
    out = tmp_path_factory.mktemp("run")
    bars = SyntheticMarket.preset("default", seed=3, n_bars=1200).generate()
    data = {**runs.synthetic_source("default", 1200, 3), "sha256": runs.bars_sha256(bars)}
    runs.write_run_config(out, runs.RunConfig(config=TINY, settings=SETTINGS, data=data))
    return out, run(TINY, bars, SETTINGS, out_dir=out)


def _eval(capsys, *args):
    code = main(["eval", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_eval_of_a_best_checkpoint_reproduces_the_runs_fold_metrics(trained, tmp_path, capsys):
    out, result = trained
    code, stdout, err = _eval(capsys, "--checkpoint", out / "checkpoints" / "fold1_best.safetensors",
                              "--out", tmp_path)
    assert code == 0, err
    assert "fold 1" in stdout and "test segment" in stdout and "buy-and-hold" in stdout
    report = json.loads((tmp_path / "eval.json").read_text())
    fold = result.folds[1]
    assert report["segments"]["test"]["bars"] == list(fold.segments.test)
    assert report["segments"]["validation"]["bars"] == list(fold.segments.val)
    # The saved policy, evaluated again, gives the metrics the run recorded at its best epoch.
    for seg, name in (("validation", "val"), ("test", "test")):
        assert report["segments"][seg]["policy"] == asdict(fold.best[name])
        assert report["segments"][seg]["flat"] == asdict(fold.flat[name])
        assert report["segments"][seg]["buy-and-hold"] == asdict(fold.buy_hold[name])
    assert report["bars_per_year"] == 252 * 23 * 60


def test_eval_on_a_daily_csv_annualises_with_sqrt_252(trained, tmp_path, capsys):
    out, _ = trained
    syn = SyntheticMarket.preset("default", seed=9, n_bars=400).generate()
    ts = 1_600_000_000 + 86_400 * np.arange(len(syn))
    csv = tmp_path / "daily.csv"
    rows = ["timestamp,open,high,low,close,volume"] + [
        f"{t},{o!r},{h!r},{lo!r},{c!r},{v!r}" for t, o, h, lo, c, v in
        zip(ts, syn.open.tolist(), syn.high.tolist(), syn.low.tolist(), syn.close.tolist(), syn.volume.tolist())]
    csv.write_text("\n".join(rows) + "\n")
    code, stdout, err = _eval(capsys, "--checkpoint", out / "checkpoints" / "last.safetensors",
                              "--data", csv, "--out", tmp_path)
    assert code == 0, err
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["bars_per_year"] == 252 and "252 bars a year" in stdout
    a, b = feature_warmup(choose_windows(TINY.state_dim)), len(syn)
    assert report["segments"]["data"]["bars"] == [a, b]
    close = syn.close.astype(np.float64)
    r = (close[a + 1:b] - close[a:b - 1]) / close[a:b - 1]
    r[0] -= 1e-4 + 1e-4 + 0.1 * (float(syn.high[a]) - float(syn.low[a])) / close[a]  # the entry
    bh = report["segments"]["data"]["buy-and-hold"]
    assert bh["sharpe"] == pytest.approx(statistics.mean(r) / statistics.stdev(r) * math.sqrt(252), rel=1e-5)
    assert report["segments"]["data"]["flat"]["sharpe"] == 0.0


@pytest.mark.parametrize("case", ["missing", "garbage", "outside-run", "bad-fold", "fold-with-data",
                                  "fast-without-gpu"])
def test_eval_usage_errors_are_one_line(trained, tmp_path, capsys, case):
    out, _ = trained
    ckpt = out / "checkpoints" / "fold0_best.safetensors"
    args, expect = {
        "missing": (["--checkpoint", tmp_path / "nope.safetensors"], "nope.safetensors"),
        "garbage": (["--checkpoint", tmp_path / "junk.safetensors"], "junk.safetensors"),
        "outside-run": (["--checkpoint", tmp_path / "copy.safetensors"], "pass --data CSV"),
        "bad-fold": (["--checkpoint", ckpt, "--fold", "5"], "--fold 5: the run has folds 0..1"),
        "fold-with-data": (["--checkpoint", ckpt, "--fold", "0", "--data", tmp_path / "x.csv"],
                           "--fold applies to the run's own data"),
        "fast-without-gpu": (["--checkpoint", ckpt, "--backend", "fast"], "--backend fast needs"),
    }[case]
    if case == "fast-without-gpu" and cuda_status()[0]:
        pytest.skip("this machine has a usable GPU: --backend fast is no error here")
    if case == "garbage":
        (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    if case == "outside-run":
        (tmp_path / "copy.safetensors").write_bytes(ckpt.read_bytes())
    code, stdout, err = _eval(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expect in lines[0], err
    assert lines[0].startswith("foxhunt eval: ")


def test_eval_pins_the_blas_threads(trained, capsys, monkeypatch):
    from threadpoolctl import threadpool_info

    from foxhunt.reference import eval_cli

    def blas_threads():
        return sorted({p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"})
    assert blas_threads(), "numpy has no BLAS pool threadpoolctl can see"
    real, seen = eval_cli.evaluate_checkpoint, []

    def spy(*args, **kwargs):
        seen.append(blas_threads())
        return real(*args, **kwargs)
    monkeypatch.setattr(eval_cli, "evaluate_checkpoint", spy)
    checkpoint = trained[0] / "checkpoints" / "fold0_best.safetensors"
    for n in (1, 2):
        code, _, err = _eval(capsys, "--checkpoint", checkpoint, "--threads", n)
        assert code == 0, err
    assert seen == [[1], [2]]
    with pytest.raises(SystemExit) as exit_:
        _eval(capsys, "--checkpoint", checkpoint, "--threads", 0)
    assert exit_.value.code == 2 and "--threads: 0 is not allowed" in capsys.readouterr().err
