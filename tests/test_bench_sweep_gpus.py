"""``benches/bench_sweep_gpus.py`` (issue 25) on a CPU: its plumbing with fake trials and Ray's
accounting of two logical GPUs (none physical), as ``test_sweep.py``'s GPU placement test.

Each fake trial is a small script that writes what ``foxhunt train`` would (``metrics.jsonl``,
one line per epoch; ``summary.json`` with ``test_sharpe = seed / 10`` and the
``CUDA_VISIBLE_DEVICES`` it saw). It waits (a barrier, at most 30 s) until as many trials of its
sweep have started as the sweep can run at once, so every GPU slot fills: the bench names its
sweep directories ``gpus<N>``, and with 2 trials per GPU the capacity is 2 N.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import pytest

from foxhunt.reference import sweep, sweep_cli
from foxhunt.reference.sweep import SweepError, SweepSpec

_PATH = Path(__file__).resolve().parents[1] / "benches" / "bench_sweep_gpus.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_sweep_gpus", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_sweep_gpus", mod)
    spec.loader.exec_module(mod)
    return mod


bench = _module()

FAKE_TRIAL = '''\
import json, os, sys, time
from pathlib import Path

run_dir, seed = Path(sys.argv[1]), int(sys.argv[2])
kv = dict(a.split("=", 1) for a in sys.argv[3:])
sweep_dir = run_dir.parent.parent
if sweep_dir.name.startswith("gpus"):  # the bench's run on N GPUs: wait for 2 N trials at once
    capacity = 2 * int(sweep_dir.name[4:])
    (sweep_dir / "barrier").mkdir(exist_ok=True)
    (sweep_dir / "barrier" / run_dir.name).write_text("")
    deadline = time.monotonic() + 30
    while len(os.listdir(sweep_dir / "barrier")) < capacity and time.monotonic() < deadline:
        time.sleep(0.05)
for epoch in range(int(kv["epochs"])):
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"epoch": epoch, "val_sharpe": 0.0}) + "\\n")
(run_dir / "summary.json").write_text(json.dumps({
    "status": "completed", "overall": {"test_sharpe": seed / 10},
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}))
'''
TRIALS, EPOCHS, STEPS_PER_EPOCH = 8, 2, 5


def make_command(script: Path) -> sweep.Command:
    """``script RUN_DIR SEED key=value...``, taking the bench's three settings."""

    def typed(key, value, text):
        if key not in ("folds", "epochs", "steps_per_epoch"):
            raise SweepError(f"{key}: the fake trial's settings are folds, epochs, steps_per_epoch")
        return int(value)

    def argv(trial, spec, run_dir, resume):
        return [str(script), str(run_dir), str(trial.seed), *(f"{k}={v}" for k, v in trial.overrides)]

    return sweep.Command("gpufake", "test_sharpe", argv, typed)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The trial function: ``run_trial`` with the fake command registered in the Ray worker
    too (the closure travels to it by value)."""
    pytest.importorskip("ray", reason="foxhunt sweep needs the distributed extra (Ray)")
    script = tmp_path / "fake_trial.py"
    script.write_text(FAKE_TRIAL)
    command = make_command(script)
    monkeypatch.setitem(sweep.COMMANDS, command.name, command)

    def trial_fn(trial, spec, sweep_dir, *, attempt=1, on_epoch=None):
        sweep.COMMANDS[command.name] = command
        return sweep.run_trial(trial, spec, sweep_dir, attempt=attempt, on_epoch=on_epoch)

    return trial_fn


def _seen(run: dict) -> list[str]:
    """The CUDA_VISIBLE_DEVICES each trial's own process saw, from its summary.json."""
    return [json.loads((Path(r["run_dir"]) / "summary.json").read_text())["cuda_visible_devices"]
            for r in run["records"]]


def test_two_gpu_run_uses_both_gpus_one_gpu_run_one_and_the_ratio_is_from_the_records(fake, tmp_path, capsys):
    spec = SweepSpec(command="gpufake", backend="fast", trials_per_gpu=2, seeds=tuple(range(TRIALS)),
                     common=(("folds", 1), ("epochs", EPOCHS), ("steps_per_epoch", STEPS_PER_EPOCH)))
    result = bench.measure(spec, tmp_path / "bench", 2, num_cpus=4, trial_fn=fake, log=lambda s: None)
    two, one = result["runs"]

    # The warm-up: one trial of one epoch, outside both sweeps.
    warm = list((tmp_path / "bench" / "warmup" / "trials").iterdir())
    assert len(warm) == 1 and len((warm[0] / "metrics.jsonl").read_text().splitlines()) == 1
    assert result["warmup_s"] > 0

    # Placement: a fresh Ray instance of 2 GPUs, then of 1; each trial's process saw the GPU
    # Ray gave it.
    assert (two["gpus"], two["ray_gpus"], one["gpus"], one["ray_gpus"]) == (2, 2.0, 1, 1.0)
    for run in (two, one):
        assert [r["seed"] for r in run["records"]] == list(range(TRIALS))
        assert _seen(run) == [r["cuda_visible_devices"] for r in run["records"]]
        assert [[s] for s in _seen(run)] == [r["gpu_ids"] for r in run["records"]]
        assert run["trials_by_gpu"] == dict(Counter(_seen(run)))
    assert set(_seen(two)) == {"0", "1"} and set(_seen(one)) == {"0"}
    assert one["trials_by_gpu"] == {"0": TRIALS}

    # Throughput: by hand, 8 trials x 2 epochs x 5 steps in each run, over its wall time, which
    # holds every trial's own wall time.
    for run in (two, one):
        assert run["completed"] == TRIALS and run["steps"] == TRIALS * EPOCHS * STEPS_PER_EPOCH == 80
        assert [r["steps"] for r in run["records"]] == [10] * TRIALS
        assert run["wall_s"] >= max(r["wall_time_s"] for r in run["records"])
        assert run["aggregate_steps_per_s"] == pytest.approx(80 / run["wall_s"])
    assert result["ratio"] == pytest.approx(one["wall_s"] / two["wall_s"])  # same steps in both

    # The results table: test_sharpe = seed / 10 over seeds 0..7.
    values = [s / 10 for s in range(TRIALS)]
    row = [line.split() for line in two["table"].splitlines() if line.startswith("defaults")]
    assert row == [["defaults", "8/8", f"{statistics.mean(values):.4g}", f"{statistics.stdev(values):.4g}",
                    "0", "0.7"]]

    # What is printed and written.
    out = tmp_path / "bench.json"
    assert bench.finish(result, out) == 0
    text = capsys.readouterr().out
    assert two["table"] in text
    for r in two["records"]:
        assert f"{r['trial']:<24} {r['gpu_ids'][0]:>4} {r['cuda_visible_devices']:>21}" in text
    per_gpu = ", ".join(f"GPU {g}: {n}" for g, n in sorted(Counter(_seen(two)).items()))
    assert f"2 GPU(s): 8/8 completed; trials per GPU {per_gpu}; 80 steps in" in text
    assert "1 GPU(s): 8/8 completed; trials per GPU GPU 0: 8; 80 steps in" in text
    met = "met" if one["wall_s"] / two["wall_s"] >= 1.8 else "NOT met"
    assert f"ratio 2 GPUs / 1 GPU: {one['wall_s'] / two['wall_s']:.2f}x (target >= 1.8: {met})" in text
    written = json.loads(out.read_text())
    assert written["ratio"] == pytest.approx(result["ratio"])
    assert [run["trials_by_gpu"] for run in written["runs"]] == [two["trials_by_gpu"], {"0": TRIALS}]
    assert "table" not in written["runs"][0] and written["plan"]["seeds"] == list(range(TRIALS))


def test_a_run_with_a_failed_trial_exits_1(tmp_path, capsys):
    run = {"gpus": 1, "trials": 2, "completed": 1, "steps": 10, "wall_s": 2.0, "aggregate_steps_per_s": 5.0,
           "trials_by_gpu": {"0": 2}, "table": "table", "records": []}
    assert bench.finish({"runs": [run], "ratio": None, "target": 1.8}, tmp_path / "b.json") == 1
    assert "1 GPU(s): 1/2 completed" in capsys.readouterr().out


@pytest.mark.parametrize("found, argv, reason", [
    ((0, "the CUDA driver reports no device"), [], "the CUDA driver reports no device"),
    ((1, "1 CUDA device(s)"), [], "this machine has one; --allow-one runs the one-GPU half"),
])
def test_without_two_gpus_it_says_so_and_exits_0(tmp_path, capsys, monkeypatch, found, argv, reason):
    monkeypatch.setattr(bench, "gpu_count", lambda: found)
    out = tmp_path / "b.json"
    assert bench.main([*argv, "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"bench_sweep_gpus: skipped, needs two GPUs ({reason})\n"
    assert not out.exists()


def test_warmup_is_one_short_trial_of_the_same_plan():
    spec = bench.sweep_spec(trials_per_gpu=4)
    short = bench.warmup_spec(spec)
    assert (short.backend, short.seeds, short.trials_per_gpu) == ("fast", (0,), 4)
    assert dict(short.common) == {"folds": 1, "epochs": 1, "steps_per_epoch": bench.WARMUP_STEPS}
    assert dict(spec.common) == {"folds": 1, "epochs": 3, "steps_per_epoch": 2000}
    assert spec.seeds == tuple(range(32))


def test_init_ray_num_gpus_is_for_the_local_instance_only():
    ray = pytest.importorskip("ray", reason="foxhunt sweep needs the distributed extra (Ray)")
    assert not ray.is_initialized()
    with pytest.raises(SweepError, match=r"^num_gpus=1: sizes the local Ray instance; the cluster at "
                                         r"ray://head:10001 has its own GPUs$"):
        sweep_cli.init_ray("ray://head:10001", None, num_gpus=1)
    assert not ray.is_initialized()


def test_one_gpu_run_alone_has_no_ratio(fake, tmp_path, capsys):
    spec = SweepSpec(command="gpufake", backend="fast", trials_per_gpu=2, seeds=(0, 1),
                     common=(("folds", 1), ("epochs", 1), ("steps_per_epoch", 3)))
    result = bench.measure(spec, tmp_path / "bench", 1, num_cpus=4, trial_fn=fake, warmup=False,
                           log=lambda s: None)
    assert [run["gpus"] for run in result["runs"]] == [1] and result["ratio"] is None
    assert result["runs"][0]["trials_by_gpu"] == {"0": 2} and result["runs"][0]["steps"] == 6
    assert "warmup_s" not in result and not (tmp_path / "bench" / "warmup").exists()
    assert bench.finish(result, tmp_path / "b.json") == 0
    text = capsys.readouterr().out
    assert "1 GPU(s): 2/2 completed; trials per GPU GPU 0: 2; 6 steps in" in text and "\nratio " not in text


def test_allow_one_runs_the_one_gpu_half_of_the_flags_plan(tmp_path, monkeypatch):
    calls = []

    def measure(spec, root, gpus, *, num_cpus=None):
        calls.append((spec, gpus, num_cpus))
        run = {"gpus": gpus, "trials": 3, "completed": 3, "steps": 90, "wall_s": 3.0,
               "aggregate_steps_per_s": 30.0, "trials_by_gpu": {"0": 3}, "table": "t", "records": []}
        return {"plan": spec.to_mapping(), "runs": [run], "ratio": None, "target": 1.8}

    monkeypatch.setattr(bench, "gpu_count", lambda: (1, "1 CUDA device(s)"))
    monkeypatch.setattr(bench, "measure", measure)
    out = tmp_path / "b.json"
    assert bench.main(["--allow-one", "--trials", "3", "--epochs", "2", "--steps-per-epoch", "15",
                       "--trials-per-gpu", "4", "--num-cpus", "6", "--out", str(out)]) == 0
    [(spec, gpus, num_cpus)] = calls
    assert (gpus, num_cpus, spec.seeds, spec.trials_per_gpu) == (1, 6, (0, 1, 2), 4)
    assert dict(spec.common) == {"folds": 1, "epochs": 2, "steps_per_epoch": 15}
    assert json.loads(out.read_text())["runs"][0]["steps"] == 90
