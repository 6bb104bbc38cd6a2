"""``foxhunt sweep`` (reference/sweep.py, reference/sweep_cli.py): the plan, sweep files and their
errors, and sweeps on one local Ray instance shared by the module (fake trials: a small script
run as each trial's subprocess; and one real sweep of ``foxhunt train`` runs)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import _thread
import time
from pathlib import Path

import pytest

from foxhunt.reference import sweep, sweep_cli
from foxhunt.reference.cli import main
from foxhunt.reference.sweep import SweepError, SweepSpec

# ------------------------------------------------------------------------------ the plan


def test_expand_is_seeds_times_grid_times_configs_with_common_settings():
    spec = SweepSpec(seeds=(3, 5), grid=(("lr", (1e-3, 3e-4)), ("gamma", (0.9, 0.99))),
                     configs=((("tau", 0.01),), (("tau", 0.02),)), common=(("epochs", 2),))
    trials = sweep.expand(spec)
    # By hand: 2 lr x 2 gamma x 2 configs = 8 configurations, grid keys first, then the configs
    # entry; each with both seeds; every trial also gets epochs=2 (first).
    expected_configs = [(lr, g, tau) for lr in (1e-3, 3e-4) for g in (0.9, 0.99) for tau in (0.01, 0.02)]
    assert len(trials) == 16
    for i, t in enumerate(trials):
        lr, g, tau = expected_configs[i // 2]
        assert t.index == i
        assert t.seed == (3, 5)[i % 2]
        assert t.overrides == (("epochs", 2), ("lr", lr), ("gamma", g), ("tau", tau))
        assert t.label == f"lr={lr} gamma={g} tau={tau}"
    assert len({t.trial_id for t in trials}) == 16
    assert trials[0].trial_id == "000-lr=0.001_gamma=0.9_tau=0.01-seed3"


def test_expand_without_grid_is_one_configuration_per_seed():
    trials = sweep.expand(SweepSpec(seeds=(0, 1, 2)))
    assert [(t.seed, t.overrides, t.label) for t in trials] == [(s, (), "defaults") for s in (0, 1, 2)]


def test_settings_are_typed_through_settings_io():
    spec = SweepSpec(grid=(("lr", (1, 2)),), common=(("branches", [3, 3, 2]),))
    assert spec.grid == (("lr", (1.0, 2.0)),) and all(type(v) is float for v in spec.grid[0][1])
    assert spec.common == (("branches", (3, 3, 2)),)


def test_train_argv_passes_seed_overrides_and_trial_args(tmp_path):
    spec = SweepSpec(seeds=(7,), grid=(("lr", (3e-4,)),), common=(("branches", (3, 3, 2)),),
                     args=("--preset", "tiny"), threads=2)
    trial = sweep.expand(spec)[0]
    argv = sweep.COMMANDS["train"].argv(trial, spec, tmp_path / "run", False)
    assert argv == ["-m", "foxhunt.reference.cli", "train", "--out", str(tmp_path / "run"),
                    "--backend", "reference", "--seed", "7", "--threads", "2", "--no-progress",
                    "--preset", "tiny", "--set", "branches=3,3,2", "--set", "lr=0.0003"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")  # a failed attempt's files
    again = sweep.COMMANDS["train"].argv(trial, spec, tmp_path / "run", False)
    assert again == argv[:12] + ["--overwrite"] + argv[12:]
    assert sweep.COMMANDS["train"].argv(trial, spec, tmp_path / "run", True) == [
        "-m", "foxhunt.reference.cli", "train", "--resume", str(tmp_path / "run"), "--threads", "2",
        "--no-progress"]


def test_spec_round_trips_through_its_mapping():
    spec = SweepSpec(command="longrun", backend="fast", seeds=(0, 1, 2), grid=(("variant", ("f32", "bf16")),),
                     threads=1, trials_per_gpu=4, metric="mean_q", workdir="/tmp")
    assert SweepSpec.from_mapping(json.loads(json.dumps(spec.to_mapping()))) == spec


SWEEP_TOML = """\
backend = "reference"
seeds = "0-1"
args = ["--preset", "tiny"]
threads = 2
[set]
epochs = 2
[grid]
lr = [1e-3, 3e-4]
branches = [[3, 3, 2], [2, 2, 2]]
"""


def _args(argv):
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    sweep_cli.register(sub)
    return parser.parse_args(["sweep", *argv])


def test_sweep_file_toml_json_and_flags_give_the_same_spec(tmp_path):
    toml_file = tmp_path / "s.toml"
    toml_file.write_text(SWEEP_TOML)
    json_file = tmp_path / "s.json"
    json_file.write_text(json.dumps({"backend": "reference", "seeds": [0, 1], "args": ["--preset", "tiny"],
                                     "threads": 2, "set": {"epochs": 2},
                                     "grid": {"lr": [1e-3, 3e-4], "branches": [[3, 3, 2], [2, 2, 2]]}}))
    flags = ["--seeds", "0-1", "--threads", "2", "--set", "epochs=2", "--grid", "lr=1e-3,3e-4",
             "--grid", "branches=3,3,2;2,2,2", "--", "--preset", "tiny"]
    specs = [sweep_cli.spec_from_args(_args(a)) for a in (["--file", str(toml_file)], ["--file", str(json_file)], flags)]
    assert specs[0] == specs[1] == specs[2]
    assert specs[0].grid == (("lr", (1e-3, 3e-4)), ("branches", ((3, 3, 2), (2, 2, 2))))
    assert specs[0].common == (("epochs", 2),) and specs[0].seeds == (0, 1)
    # Flags override the file; --set adds to its [set].
    over = sweep_cli.spec_from_args(_args(["--file", str(toml_file), "--seeds", "4", "--set", "tau=0.01"]))
    assert over.seeds == (4,) and over.common == (("epochs", 2), ("tau", 0.01))


BAD_FILES = {
    "unknown_key.toml": ('seed = 3\n', "unknown key 'seed'"),
    "bad_toml.toml": ('seeds = [0,\n', "not valid TOML"),
    "bad_json.json": ('{"seeds": }', "not valid JSON"),
    "string_float.toml": ('[set]\nlr = "0.1"\n', "lr=\"0.1\": expected a number"),
    "unknown_setting.toml": ('[grid]\nlrr = [1, 2]\n', "unknown setting 'lrr'"),
    "seed_setting.toml": ('[set]\nseed = 1\n', "the sweep's seeds set it"),
    "bad_seeds.toml": ('seeds = "3-1"\n', "range '3-1'"),
    "dup_seeds.toml": ('seeds = [1, 1]\n', "a seed is listed twice"),
    "tpg_reference.toml": ('trials_per_gpu = 2\n', "only with backend 'fast'"),
    "empty_grid.toml": ('[grid]\nlr = []\n', "needs at least one value"),
    "dup_grid.toml": ('[grid]\nlr = [0.1, 0.1]\n', "a value is listed twice"),
    "both.toml": ('[set]\nlr = 0.1\n[grid]\nlr = [0.2]\n', "given in both set and grid"),
    "threads.toml": ('threads = 0\n', "threads=0: must be an integer >= 1"),
    "grid_type.toml": ('grid = [1]\n', "grid=[1]: expected a table"),
    "command.toml": ('command = "eval"\n', "command='eval': allowed values are train, longrun"),
    "variant.toml": ('command = "longrun"\n[grid]\nvariant = ["f64"]\n', "variant='f64'"),
    "early_longrun.toml": ('command = "longrun"\nearly_stop = true\n', "early_stop: not for command 'longrun'"),
    "sweep.yaml": ('seeds = 1\n', "must end in .toml or .json"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_sweep_file_errors_are_one_line(tmp_path, capsys, name):
    text, expected = BAD_FILES[name]
    path = tmp_path / name
    path.write_text(text)
    assert main(["sweep", "--file", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("foxhunt sweep: ") and expected in err, err
    assert not (tmp_path / "out").exists()  # nothing created for a plan that was refused


@pytest.mark.parametrize("argv, expected", [
    (["--grid", "lr"], "--grid 'lr': expected key=value"),
    (["--set", "epochs=two"], "epochs=two: expected an integer"),
    (["--seeds", "a"], "expected integers and ranges"),
    (["--", "--out", "x"], "trial argument --out: the sweep sets --out itself"),
    (["--", "--set=lr=1"], "trial argument --set=lr=1"),
    (["--address", "ray://head:10001", "--num-cpus", "4"], "--num-cpus 4: sizes the local Ray instance"),
    (["--file", "tiny.toml", "--resume", "x"], "--resume x: the plan comes from its sweep.json; drop --out, --file"),
])
def test_flag_errors_are_one_line(tmp_path, capsys, argv, expected):
    argv = [a.replace("tiny.toml", str(tmp_path / "tiny.toml")) for a in argv]
    (tmp_path / "tiny.toml").write_text("")
    assert main(["sweep", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err


def test_out_must_be_new_or_empty_and_resume_needs_a_sweep(tmp_path, capsys):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    assert main(["sweep", "--out", str(tmp_path / "used")]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert main(["sweep", "--resume", str(tmp_path / "used")]) == 2
    assert "no sweep.json there" in capsys.readouterr().err


# ------------------------------------------------------------------------------ fake trials
FAKE_TRIAL = '''\
"""A fake trial: writes what foxhunt train would (metrics.jsonl, summary.json), per its settings."""
import json, os, signal, sys, time
from pathlib import Path

run_dir, seed = Path(sys.argv[1]), int(sys.argv[2])
kv = dict(a.split("=", 1) for a in sys.argv[3:])
mode, x = kv.get("mode", "ok"), float(kv.get("x", "0"))
sweep_dir = run_dir.parent.parent
with open(sweep_dir / "calls.log", "a") as fh:
    fh.write(run_dir.name + "\\n")
(run_dir / "pid").write_text(str(os.getpid()))


def summary(status):
    (run_dir / "summary.json").write_text(json.dumps({
        "status": status, "overall": {"test_sharpe": x + seed / 10},
        "omp_threads": os.environ.get("OMP_NUM_THREADS"), "cwd": os.getcwd(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}))


if mode == "barrier":  # wait (at most 30 s) until n trials of the sweep run at once
    (sweep_dir / "barrier").mkdir(exist_ok=True)
    (sweep_dir / "barrier" / run_dir.name).write_text("")
    deadline = time.monotonic() + 30
    while len(os.listdir(sweep_dir / "barrier")) < int(kv["n"]) and time.monotonic() < deadline:
        time.sleep(0.05)


if mode == "flaky" and not (run_dir / "failed_once").exists():
    (run_dir / "failed_once").write_text("")
    print("flaky: the first attempt fails")
    sys.exit(3)
if mode == "crash" and not (sweep_dir / "fixed").exists():
    print("boom: the fake trial crashed")
    sys.exit(1)
if mode == "halt":
    summary("halted")
    sys.exit(1)
if mode == "slow":
    signal.signal(signal.SIGTERM, lambda *a: (summary("interrupted"), sys.exit(143)))
    (run_dir / "started").write_text("")
    if not (sweep_dir / "fixed").exists():
        time.sleep(120)
for epoch in range(int(kv.get("epochs", "0"))):
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"epoch": epoch, "val_sharpe": x}) + "\\n")
    time.sleep(float(kv.get("pause", "0")))
summary("completed")
'''


def make_fake_command(script: Path) -> sweep.Command:
    """A command running ``script RUN_DIR SEED key=value...``; its settings are x (a number),
    mode, epochs (an integer) and pause (a number)."""
    kinds = {"x": float, "mode": str, "epochs": int, "pause": float, "n": int}

    def typed(key, value, text):
        if key not in kinds:
            raise SweepError(f"{key}: the fake trial's settings are {', '.join(kinds)}")
        return kinds[key](value)

    def argv(trial, spec, run_dir, resume):
        return [str(script), str(run_dir), str(trial.seed), *(f"{k}={v}" for k, v in trial.overrides)]

    return sweep.Command("fake", "test_sharpe", argv, typed, epoch_metrics=True)


def with_command(command: sweep.Command):
    """A trial function for the Ray tasks: ``run_trial`` with ``command`` registered in the
    worker process too (the closure travels to it by value)."""

    def trial_fn(trial, spec, sweep_dir, *, attempt=1, on_epoch=None):
        sweep.COMMANDS[command.name] = command
        return sweep.run_trial(trial, spec, sweep_dir, attempt=attempt, on_epoch=on_epoch)

    return trial_fn


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray", reason="foxhunt sweep needs the distributed extra (Ray)")
    # 4 logical CPUs and 2 logical GPUs (none physical): Ray's accounting places trials on them
    # and sets each trial's CUDA_VISIBLE_DEVICES as it would on a machine with two GPUs.
    # Started with SIGINT ignored, as a sweep started in the background (nohup ... &) is: its
    # workers inherit that, and ray.cancel must still stop a running trial (the Ctrl-C test).
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, logging_level=logging.WARNING)
    finally:
        signal.signal(signal.SIGINT, previous)
    yield ray
    ray.shutdown()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    script = tmp_path / "fake_trial.py"
    script.write_text(FAKE_TRIAL)
    command = make_fake_command(script)
    monkeypatch.setitem(sweep.COMMANDS, "fake", command)
    return with_command(command)


def _calls(sweep_dir: Path) -> list[str]:
    path = sweep_dir / "calls.log"
    return path.read_text().split() if path.exists() else []


def _results(sweep_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (sweep_dir / "results.jsonl").read_text().splitlines()]


def test_retry_once_and_failure_isolation(ray_local, fake, tmp_path):
    spec = SweepSpec(command="fake", seeds=(0, 1), configs=(
        (("mode", "ok"), ("x", 1.0)), (("mode", "flaky"), ("x", 2.0)),
        (("mode", "crash"), ("x", 3.0)), (("mode", "halt"), ("x", 4.0))), threads=1)
    logs: list[str] = []
    out = tmp_path / "s"
    trials, records, interrupted = sweep_cli.run_sweep(spec, out, trial_fn=fake, log=logs.append)
    assert not interrupted
    status = {t.trial_id: (records[t.trial_id]["status"], records[t.trial_id]["attempts"]) for t in trials}
    # ok: once; flaky: failed, retried, completed; crash: failed twice; halt: not retried.
    assert [status[t.trial_id] for t in trials] == [
        ("completed", 1), ("completed", 1), ("completed", 2), ("completed", 2),
        ("failed", 2), ("failed", 2), ("halted", 1), ("halted", 1)]
    calls = _calls(out)
    assert sorted(calls) == sorted([t.trial_id for t in trials] + [t.trial_id for t in trials[2:6]])
    lines = _results(out)
    assert [r["trial"] for r in lines] == [t.trial_id for t in trials]
    crash = lines[4]
    assert crash["error"].startswith("exit code 1, summary status missing: boom: the fake trial crashed")
    assert crash["overrides"] == {"mode": "crash", "x": 3.0} and crash["seed"] == 0
    # The completed trials' metric is what each run wrote (x + seed / 10), with placement.
    assert [r["overall"]["test_sharpe"] for r in lines[:4]] == [1.0, 1.1, 2.0, 2.1]
    assert all(r["gpu_ids"] == [] and r["node_id"] and r["hostname"] for r in lines)
    assert all(r["wall_time_s"] > 0 for r in lines)
    assert sum("retrying (attempt 2 of 2)" in line for line in logs) == 4
    # BLAS threads pinned to the trial's threads; the log keeps both attempts.
    assert sweep.read_summary(out / "trials" / trials[0].trial_id)["omp_threads"] == "1"
    assert (out / "logs" / f"{trials[2].trial_id}.log").read_text().count("# attempt") == 2
    table = sweep_cli.results_table(trials, records, "test_sharpe").splitlines()
    assert table[1].split() == ["mode=ok", "x=1.0", "2/2", "1.05", f"{0.1 / 2 ** 0.5:.4g}", "1", "1.1"]
    assert table[3].split() == ["mode=crash", "x=3.0", "0/2", "-", "-", "-", "-"]
    assert table[5].startswith("  004-mode=crash_x=3.0-seed0: failed")  # the failures, listed


def test_resume_runs_only_what_is_missing(ray_local, fake, tmp_path):
    spec = SweepSpec(command="fake", seeds=(0, 1), grid=(("mode", ("ok", "crash")),))
    out = tmp_path / "s"
    trials, records, _ = sweep_cli.run_sweep(spec, out, trial_fn=fake, log=lambda s: None)
    assert [records[t.trial_id]["status"] for t in trials] == ["completed", "completed", "failed", "failed"]
    # A results line lost (a crash between a trial's end and the write): the run dir says done.
    lines = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text("\n".join(lines[1:]) + "\n")
    (out / "fixed").write_text("")
    before = len(_calls(out))
    trials, records, _ = sweep_cli.run_sweep(spec, out, resume=True, trial_fn=fake, log=lambda s: None)
    assert sorted(_calls(out)[before:]) == sorted([trials[2].trial_id, trials[3].trial_id])
    assert [r["status"] for r in _results(out)] == ["completed"] * 4
    assert _results(out)[0]["overall"] == {"test_sharpe": 0.0}  # rebuilt from its summary.json


def _interrupt_when(condition) -> dict:
    """Ctrl-C (``_thread.interrupt_main``) from a thread once ``condition()`` holds (at most
    60 s); the returned dict then holds what the interrupt saw, for a failure message."""
    sent: dict = {}

    def watch():
        tic = time.monotonic()
        while time.monotonic() < tic + 60 and not condition():
            time.sleep(0.1)
        sent.update(after_s=round(time.monotonic() - tic, 1),
                    sigint_handler=signal.getsignal(signal.SIGINT))
        _thread.interrupt_main()

    threading.Thread(target=watch, daemon=True).start()
    return sent


def _recorded(sweep_dir: Path) -> bool:
    """The sweep wrote a results line (not only a trial's run)."""
    path = sweep_dir / "results.jsonl"
    return path.exists() and bool(path.read_text().strip())


def test_ctrl_c_stops_trials_cleanly_and_resume_finishes_them(ray_local, fake, tmp_path):
    spec = SweepSpec(command="fake", seeds=(0,), configs=(
        (("mode", "ok"),), (("mode", "slow"), ("x", 1.0)), (("mode", "slow"), ("x", 2.0))))
    out = tmp_path / "s"
    trials = sweep.expand(spec)
    ok_dir, slow_dirs = sweep.run_dir_of(out, trials[0]), [sweep.run_dir_of(out, t) for t in trials[1:]]
    # Ctrl-C once the fast trial is done and recorded and a slow one runs.
    sent = _interrupt_when(lambda: (ok_dir / "summary.json").exists() and _recorded(out)
                           and any((d / "started").exists() for d in slow_dirs))
    logs: list[str] = []
    _, records, interrupted = sweep_cli.run_sweep(spec, out, trial_fn=fake, log=logs.append)
    assert interrupted, f"the interrupt did not stop the sweep: {sent}; its log: {logs}"
    assert [r["status"] for r in _results(out)] == ["completed"]
    started = [d for d in slow_dirs if (d / "started").exists()]
    assert started
    for d in started:  # SIGTERM reached the run: it wrote its summary, and it is gone
        assert sweep.read_summary(d)["status"] == "interrupted"
        with pytest.raises(ProcessLookupError):
            os.kill(int((d / "pid").read_text()), 0)
    (out / "fixed").write_text("")
    _, records, interrupted = sweep_cli.run_sweep(spec, out, resume=True, trial_fn=fake, log=lambda s: None)
    assert not interrupted and [r["status"] for r in _results(out)] == ["completed"] * 3
    assert _calls(out).count(trials[0].trial_id) == 1


def test_a_task_that_raises_while_the_sweep_stops_is_no_failure(ray_local, fake, tmp_path):
    """Ray's cancellation can reach a task before its run starts, where the task then fails
    with an error of Ray's (seen: ``TypeError: 'Handlers' object is not callable``, a worker
    with SIGINT ignored interrupted inside Ray's argument deserialisation). The sweep stops
    it as it stops the others: no results line, and --resume runs it."""
    spec = SweepSpec(command="fake", seeds=(0,), configs=((("mode", "ok"),), (("mode", "slow"), ("x", 1.0))))
    out = tmp_path / "s"

    def trial_fn(trial, spec, sweep_dir, *, attempt=1, on_epoch=None):
        if dict(trial.overrides)["mode"] == "slow":  # the error, raised before the run starts
            (sweep_dir / "waiting").write_text("")
            try:
                for _ in range(1200):  # short sleeps: the interrupt is seen between two
                    time.sleep(0.1)
            except KeyboardInterrupt:
                raise TypeError("'Handlers' object is not callable") from None
        return fake(trial, spec, sweep_dir, attempt=attempt, on_epoch=on_epoch)

    sent = _interrupt_when(lambda: (out / "waiting").exists() and _recorded(out))
    logs: list[str] = []
    _, records, interrupted = sweep_cli.run_sweep(spec, out, trial_fn=trial_fn, log=logs.append)
    assert interrupted, f"the interrupt did not stop the sweep: {sent}; its log: {logs}"
    assert [r["status"] for r in _results(out)] == ["completed"]
    (out / "fixed").write_text("")  # the slow trial's run then completes at once
    _, records, interrupted = sweep_cli.run_sweep(spec, out, resume=True, trial_fn=fake, log=lambda s: None)
    assert not interrupted and [r["status"] for r in _results(out)] == ["completed"] * 2


def test_plot_and_cli_exit_status(ray_local, fake, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sweep_cli, "run_trial", fake)  # what run_sweep's tasks run by default
    out = tmp_path / "s"
    monkeypatch.chdir(tmp_path)
    code = main(["sweep", "--command", "fake", "--out", str(out), "--seeds", "0-2", "--grid", "x=1,2"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert (out / "results.png").stat().st_size > 1000
    table = text[text.index("configuration"):].splitlines()
    # By hand: x + seed / 10 over seeds 0-2 -> mean x + 0.1, sample std 0.1, min x, max x + 0.2.
    assert table[1].split() == ["x=1.0", "3/3", "1.1", "0.1", "1", "1.2"]
    assert table[2].split() == ["x=2.0", "3/3", "2.1", "0.1", "2", "2.2"]
    plan = json.loads((out / "sweep.json").read_text())
    assert plan["grid"] == {"x": [1.0, 2.0]} and plan["workdir"] == str(tmp_path)
    assert sweep.read_summary(out / "trials" / "000-x=1.0-seed0")["cwd"] == str(tmp_path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):  # FileNotFoundError: reaped in between
        return False


def test_early_stop_stops_the_hopeless_trial(ray_local, fake, tmp_path):
    # threads=4 on the 4-CPU instance: one trial at a time, in order. ASHA's first rung is epoch
    # 2 (EARLY_STOP_GRACE_EPOCHS): the first trial reaches it alone and goes on; the second's
    # validation Sharpe (-5) is below the first's (1) there, so it is stopped.
    spec = SweepSpec(command="fake", seeds=(0,), threads=4, early_stop=True, common=(
        ("epochs", 6), ("pause", 0.3)), configs=((("x", 1.0),), (("x", -5.0),)))
    out = tmp_path / "s"
    trials, records, interrupted = sweep_cli.run_sweep(spec, out, trial_fn=fake, log=lambda s: None)
    assert not interrupted
    good, bad = (records[t.trial_id] for t in trials)
    assert good["status"] == "completed" and good["overall"] == {"test_sharpe": 1.0}
    assert good["hostname"] and good["attempts"] == 1
    assert bad["status"] == "early_stopped" and bad["val_sharpe"] == -5.0
    assert sweep_cli.EARLY_STOP_GRACE_EPOCHS <= bad["epochs"] < 6
    assert [r["status"] for r in _results(out)] == ["completed", "early_stopped"]
    # The stopped trial's run does not go on without its trial.
    pid = int((sweep.run_dir_of(out, trials[1]) / "pid").read_text())
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid)
    # --resume does not run an early-stopped trial again.
    before = len(_calls(out))
    sweep_cli.run_sweep(spec, out, resume=True, trial_fn=fake, log=lambda s: None)
    assert len(_calls(out)) == before


# ------------------------------------------------------------------------------ long runs
FAKE_LONGRUN = '''\
"""A fake ``longrun_seeds one``: the record of a 50-epoch run, made up from the seed."""
import json, sys
a = dict(zip(sys.argv[2::2], sys.argv[3::2]))  # argv[1] is "one"
assert sys.argv[1] == "one", sys.argv
precision, workspace = {"f32": ("f32", "none"), "f32_alt": ("f32", "default"), "bf16": ("bf16", "none")}[a["--variant"]]
seed = int(a["--seed"])
shift = {"f32": 0.0, "f32_alt": 0.01, "bf16": 0.02}[a["--variant"]] * (1 + seed % 2)
with open(a["--record"], "w") as fh:
    json.dump({"final_sharpe": 1.0 + shift + seed, "mean_q": 2.0 + shift, "grad_norm_mean": 3.0 + shift,
               "grad_norm_max": 4.0 + shift, "seed": seed, "backend": a["--backend"],
               "precision": precision, "gemm_workspace": workspace, "wall_s": 0.1}, fh)
'''


def test_longrun_sweep_gathers_the_files_longrun_seeds_compare_reads(ray_local, tmp_path):
    from foxhunt.conformance import longrun_seeds

    (tmp_path / "fake_longrun.py").write_text(FAKE_LONGRUN)
    path = str(tmp_path)

    def trial_fn(trial, spec, sweep_dir, *, attempt=1, on_epoch=None):
        # In the worker: the sweep's real longrun command, with the tool replaced by the fake.
        sweep.LONGRUN_MODULE = "fake_longrun"
        os.environ["PYTHONPATH"] = path
        return sweep.run_trial(trial, spec, sweep_dir, attempt=attempt, on_epoch=on_epoch)

    spec = SweepSpec(command="longrun", backend="fast", seeds=(0, 1, 2),
                     grid=(("variant", ("f32", "f32_alt", "bf16")),))
    out = tmp_path / "s"
    trials, records, _ = sweep_cli.run_sweep(spec, out, trial_fn=trial_fn, log=lambda s: None)
    assert [records[t.trial_id]["status"] for t in trials] == ["completed"] * 9
    assert records[trials[4].trial_id]["overall"]["final_sharpe"] == pytest.approx(1.0 + 0.01 * 2 + 1)
    files = {v: out / "longrun" / f"{v}.jsonl" for v in ("f32", "f32_alt", "bf16")}
    for variant, file in files.items():
        runs = longrun_seeds.load_runs(file, variant)  # the tool's own reader accepts them
        assert sorted(runs) == [0, 1, 2]
    table, _ = longrun_seeds.compare(files)
    assert "final held-out Sharpe" in table


def test_longrun_argv_is_longrun_seeds_one(tmp_path):
    spec = SweepSpec(command="longrun", backend="reference", seeds=(4,), grid=(("variant", ("bf16",)),))
    trial = sweep.expand(spec)[0]
    assert sweep.COMMANDS["longrun"].argv(trial, spec, tmp_path, False) == [
        "-m", "foxhunt.conformance.longrun_seeds", "one", "--variant", "bf16", "--seed", "4",
        "--backend", "reference", "--record", str(tmp_path / "record.json")]


# ------------------------------------------------------------------------------ foxhunt train
# The end-to-end sweep of four tiny runs of ``foxhunt train`` is
# ``test_sweep_population.test_tiny_sweep_of_foxhunt_train_end_to_end`` (its runs are also the
# plain side of the population comparison there: CI runs them once).


def test_fast_trials_share_gpus_by_fractional_requests(ray_local, fake, tmp_path):
    # 4 trials of 1/2 GPU each, all running at once (a barrier in the fake trial): Ray's
    # accounting puts two on each of the instance's two GPUs, and each trial's process sees its
    # own GPU in CUDA_VISIBLE_DEVICES.
    spec = SweepSpec(command="fake", backend="fast", trials_per_gpu=2, seeds=(0, 1, 2, 3),
                     common=(("mode", "barrier"), ("n", 4)))
    out = tmp_path / "s"
    trials, records, _ = sweep_cli.run_sweep(spec, out, trial_fn=fake, log=lambda s: None)
    gpus = [records[t.trial_id]["gpu_ids"] for t in trials]
    assert sorted(g for ids in gpus for g in ids) == ["0", "0", "1", "1"]
    for t in trials:
        seen = sweep.read_summary(sweep.run_dir_of(out, t))["cuda_visible_devices"]
        assert [seen] == records[t.trial_id]["gpu_ids"] == [records[t.trial_id]["cuda_visible_devices"]]


def test_fast_trials_default_to_the_measured_share_of_a_gpu():
    # The default (set from benches/bench_sweep.py on the H200) applies to fast trials only; an
    # explicit --trials-per-gpu wins; reference trials ask for no GPU.
    assert sweep.DEFAULT_TRIALS_PER_GPU == 8
    assert SweepSpec(backend="fast").gpus_per_trial == 0.125
    assert SweepSpec(backend="fast", trials_per_gpu=2).gpus_per_trial == 0.5
    assert SweepSpec(backend="reference").gpus_per_trial == 0.0


def test_a_trial_the_cluster_cannot_hold_is_a_usage_error(ray_local, fake, tmp_path, monkeypatch):
    with pytest.raises(SweepError, match=r"^threads=5: a trial asks for 5 CPUs and the Ray cluster has 4;"):
        sweep_cli.run_sweep(SweepSpec(command="fake", threads=5), tmp_path / "a", trial_fn=fake)
    sweep_cli.check_fits(SweepSpec(command="fake", backend="fast"))  # 1/8 GPU of 2: fits
    monkeypatch.setattr(ray_local, "cluster_resources", lambda: {"CPU": 4.0})  # a cluster without GPUs
    with pytest.raises(SweepError, match=r"^backend=fast: a trial asks for 0.25 GPU and the Ray cluster has 0 "):
        sweep_cli.check_fits(SweepSpec(command="fake", backend="fast", trials_per_gpu=4))


def test_a_local_ray_instance_leaves_subprocess_exit_codes_alone(tmp_path):
    # Ray's raylet-subreaper option made the driver (and its workers) ignore SIGCHLD, after
    # which every subprocess's exit code read 0: a crashed trial, and every later test of this
    # process that checks an exit code. In a child Python, so this process keeps its own.
    pytest.importorskip("ray", reason="foxhunt sweep needs the distributed extra (Ray)")
    code = ("import subprocess, sys\n"
            "from foxhunt.reference import sweep_cli\n"
            "assert sweep_cli.init_ray(None, 1)\n"
            "import ray\n"
            "ray.shutdown()\n"
            "print(subprocess.run([sys.executable, '-c', 'raise SystemExit(3)']).returncode)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "3"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_run_started_by_the_sweep_dies_with_its_parent(tmp_path):
    # The parent starts a child that calls die_with_parent (as foxhunt's CLI does when
    # DIE_WITH_PARENT_ENV is 1) and sleeps, prints the child's pid and exits: the child gets
    # SIGTERM. A child without the call outlives the parent (the control).
    def orphan(call: str) -> subprocess.Popen:
        child = f"from foxhunt.reference import cli\n{call}\nimport time\ntime.sleep(60)\n"
        parent = ("import subprocess, sys\n"
                  f"p = subprocess.Popen([sys.executable, '-c', {child!r}], "
                  "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
                  "import time\ntime.sleep(2)\nprint(p.pid)\n")
        return subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)

    def pid_after_exit(parent: subprocess.Popen) -> int:  # the child's pid, once its parent is gone
        out, _ = parent.communicate(timeout=60)
        return int(out.split()[-1])

    def running(pid: int) -> bool:  # a zombie nobody reaped yet counts as gone
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return False
        return "\nState:\tZ" not in status

    def alive(pid: int) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not running(pid):
                return False
            time.sleep(0.1)
        return True

    # Both parents at once (each sleeps 2 s before it exits).
    parents = orphan("cli.die_with_parent()"), orphan("pass")
    dying, control = (pid_after_exit(p) for p in parents)
    try:
        assert not alive(dying)
        assert alive(control)
    finally:
        for pid in (dying, control):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
