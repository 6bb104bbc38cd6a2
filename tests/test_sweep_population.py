"""``foxhunt sweep --population`` (reference/sweep_population.py): the plan (one trial per
configuration), its usage errors, a fake population command on the local Ray instance (retries,
halts, failed members, a crash, resume, a whole GPU per trial) and real tiny sweeps of
``foxhunt train`` against the same sweep without ``--population``."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from foxhunt.reference import sweep, sweep_cli, sweep_population
from foxhunt.reference.cli import main
from foxhunt.reference.market import SyntheticMarket
from foxhunt.reference.sweep import SweepError, SweepSpec
from foxhunt.reference.sweep_population import PopulationTrial

from test_cli import write_csv
from test_sweep import _args, _calls, _results, ray_local  # noqa: F401 (a fixture, used by name)

# ------------------------------------------------------------------------------ the plan


def test_populations_are_one_trial_per_configuration_holding_its_seeds():
    spec = SweepSpec(seeds=(3, 5, 9), grid=(("lr", (1e-3, 3e-4)),), configs=(
        (("tau", 0.01),), (("tau", 0.02),)), common=(("epochs", 2),), population=True)
    pops = sweep_population.populations(spec)
    # By hand: 2 lr x 2 tau = 4 configurations, each one trial with the 3 seeds, whose members
    # are the trials (ids, seeds, overrides) a sweep without --population runs.
    plain = sweep.expand(SweepSpec(seeds=(3, 5, 9), grid=spec.grid, configs=spec.configs,
                                   common=spec.common))
    assert len(pops) == 4 and len(plain) == 12
    for k, pop in enumerate(pops):
        assert pop.index == k and pop.seeds == (3, 5, 9)
        assert pop.members == tuple(plain[3 * k:3 * k + 3])
        assert pop.overrides == plain[3 * k].overrides and pop.label == plain[3 * k].label
    assert [p.trial_id for p in pops] == [
        "000-lr=0.001_tau=0.01-seeds3,5,9", "001-lr=0.001_tau=0.02-seeds3,5,9",
        "002-lr=0.0003_tau=0.01-seeds3,5,9", "003-lr=0.0003_tau=0.02-seeds3,5,9"]
    consecutive = sweep_population.populations(SweepSpec(seeds=(0, 1, 2, 3), population=True))
    assert [p.trial_id for p in consecutive] == ["000-defaults-seeds0-3"]


def test_population_argv_is_foxhunt_train_seeds(tmp_path):
    spec = SweepSpec(backend="fast", seeds=(7, 2), grid=(("lr", (3e-4,)),),
                     common=(("branches", (3, 3, 2)),), args=("--preset", "tiny"), threads=2,
                     population=True)
    pop = sweep_population.populations(spec)[0]
    argv = sweep.COMMANDS["train"].population_argv(pop, spec, tmp_path / "run")
    assert argv == ["-m", "foxhunt.reference.cli", "train", "--out", str(tmp_path / "run"),
                    "--backend", "fast", "--seeds", "7,2", "--threads", "2", "--no-progress",
                    "--preset", "tiny", "--set", "branches=3,3,2", "--set", "lr=0.0003"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "population.json").write_text("{}")  # a failed attempt's files
    again = sweep.COMMANDS["train"].population_argv(pop, spec, tmp_path / "run")
    assert again == argv[:12] + ["--overwrite"] + argv[12:]


def test_a_population_trial_asks_for_a_whole_gpu():
    assert SweepSpec(backend="fast", seeds=(0, 1), population=True).gpus_per_trial == 1.0
    assert SweepSpec(backend="reference", seeds=(0, 1), population=True).gpus_per_trial == 0.0
    assert SweepSpec(backend="fast", seeds=(0, 1)).gpus_per_trial == 1 / sweep.DEFAULT_TRIALS_PER_GPU


def test_population_round_trips_through_the_plan_and_the_sweep_file(tmp_path):
    spec = SweepSpec(backend="fast", seeds=(0, 1), population=True, workdir="/tmp")
    assert spec.to_mapping()["population"] is True
    assert SweepSpec.from_mapping(json.loads(json.dumps(spec.to_mapping()))) == spec
    # A plan written before the key existed reads as a sweep without it.
    old = {k: v for k, v in spec.to_mapping().items() if k != "population"}
    assert SweepSpec.from_mapping(old).population is False
    toml_file = tmp_path / "s.toml"
    toml_file.write_text('seeds = "0-1"\npopulation = true\n')
    from_file = sweep_cli.spec_from_args(_args(["--file", str(toml_file)]))
    from_flags = sweep_cli.spec_from_args(_args(["--seeds", "0-1", "--population"]))
    assert from_file == from_flags and from_file.population is True


@pytest.mark.parametrize("argv, expected", [
    (["--seeds", "0", "--population"],
     "seeds=0: population needs 2 to 256 seeds (each configuration's seeds train as one "
     "foxhunt train --seeds population), not 1"),
    (["--seeds", "0-256", "--population"], "seeds=0-256: population needs 2 to 256 seeds"),
    (["--seeds", "0-1", "--population", "--backend", "fast", "--trials-per-gpu", "2"],
     "trials_per_gpu=2: not with population (a population trial asks Ray for one whole GPU)"),
    (["--seeds", "0-1", "--population", "--early-stop"],
     "early_stop: not with population (ASHA stops one trial early"),
    (["--seeds", "0-1", "--population", "--command", "longrun"],
     "population: not for command 'longrun'"),
    (["--seeds", "0-1", "--population", "--", "--seeds", "0-3"],
     "trial argument --seeds: the sweep sets --seeds itself"),
    (["--population", "--resume", "x"], "--resume x: the plan comes from its sweep.json; drop --population"),
])
def test_population_usage_errors_are_one_line(tmp_path, capsys, argv, expected):
    out = [] if "--resume" in argv else ["--out", str(tmp_path / "out")]
    assert main(["sweep", *out, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("foxhunt sweep: ") and expected in err, err
    assert not (tmp_path / "out").exists()


def test_population_in_a_sweep_file_must_be_a_boolean(tmp_path, capsys):
    (tmp_path / "s.toml").write_text('seeds = "0-1"\npopulation = 1\n')
    assert main(["sweep", "--file", str(tmp_path / "s.toml"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "population=1: expected a boolean" in err, err


# ------------------------------------------------------------------------------ a fake population
FAKE_POPULATION = '''\
"""A fake ``foxhunt train --seeds``: member directories, their summary.json and population.json
as the real one writes them, per its settings (mode, x)."""
import json, os, sys, time
from pathlib import Path

run_dir, seeds = Path(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")]
kv = dict(a.split("=", 1) for a in sys.argv[3:])
mode, x = kv.get("mode", "ok"), float(kv.get("x", "0"))
sweep_dir = run_dir.parent.parent
fixed = (sweep_dir / "fixed").exists()
with open(sweep_dir / "calls.log", "a") as fh:
    fh.write(run_dir.name + "\\n")
if mode == "barrier":  # wait (at most 30 s) until n populations of the sweep run at once
    (sweep_dir / "barrier").mkdir(exist_ok=True)
    (sweep_dir / "barrier" / run_dir.name).write_text("")
    deadline = time.monotonic() + 30
    while len(os.listdir(sweep_dir / "barrier")) < int(kv["n"]) and time.monotonic() < deadline:
        time.sleep(0.05)
if mode == "crash" and not fixed:
    print("boom: the fake population crashed")
    sys.exit(1)
members = []
for seed in seeds:
    status = "completed"
    if mode == "halt" and seed == seeds[-1]:
        status = "halted"
    if mode == "member_fails" and seed == seeds[0] and not fixed:
        status = "failed"
    member = run_dir / f"member{seed}"
    member.mkdir(exist_ok=True)
    overall = None if status == "failed" else {"test_sharpe": x + seed / 10}
    if status != "failed":
        (member / "summary.json").write_text(json.dumps({
            "status": status, "overall": overall, "wall_time_s": 0.25 + seed,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}))
    members.append({"seed": seed, "dir": member.name, "status": status,
                    "exit_status": None if status == "failed" else int(status == "halted"),
                    "error": {"failed": "RuntimeError: injected", "halted": "NaN in the loss"}.get(status),
                    "stopped_by": None, "overall": overall})
(run_dir / "population.json").write_text(json.dumps({"status": "completed", "seeds": seeds,
                                                     "members": members}))
sys.exit(0 if all(m["status"] == "completed" for m in members) else 1)
'''


@pytest.fixture
def fake_population(tmp_path, monkeypatch):
    """A command ``fake`` whose population form runs FAKE_POPULATION, and the trial function
    of the Ray tasks (``run_population`` with the command registered in the worker too)."""
    script = tmp_path / "fake_population.py"
    script.write_text(FAKE_POPULATION)
    kinds = {"x": float, "mode": str, "n": int}

    def typed(key, value, text):
        if key not in kinds:
            raise SweepError(f"{key}: the fake population's settings are {', '.join(kinds)}")
        return kinds[key](value)

    def population_argv(pop, spec, run_dir):
        return [str(script), str(run_dir), ",".join(map(str, pop.seeds)),
                *(f"{k}={v}" for k, v in pop.overrides)]

    def no_single_runs(trial, spec, run_dir, resume):
        raise AssertionError("a population sweep ran a single trial")

    command = sweep.Command("fake", "test_sharpe", no_single_runs, typed,
                            population_argv=population_argv)
    monkeypatch.setitem(sweep.COMMANDS, "fake", command)

    def trial_fn(unit, spec, sweep_dir, *, attempt=1, on_epoch=None):
        assert isinstance(unit, PopulationTrial)
        sweep.COMMANDS[command.name] = command
        return sweep_population.run_population(unit, spec, sweep_dir, attempt=attempt, on_epoch=on_epoch)

    return trial_fn


@pytest.mark.usefixtures("ray_local")
def test_fake_population_retries_failures_keeps_halts_and_resumes(fake_population, tmp_path):
    spec = SweepSpec(command="fake", seeds=(0, 1), population=True, configs=(
        (("mode", "ok"), ("x", 1.0)), (("mode", "halt"), ("x", 2.0)),
        (("mode", "member_fails"), ("x", 3.0)), (("mode", "crash"), ("x", 4.0))))
    out, logs = tmp_path / "s", []
    trials, records, interrupted = sweep_cli.run_sweep(spec, out, trial_fn=fake_population,
                                                       log=logs.append)
    assert not interrupted and len(trials) == 8
    pops = sweep_population.populations(spec)
    # ok and halt: once; member_fails and crash: failed, retried whole once, failed again.
    assert sorted(_calls(out)) == sorted([p.trial_id for p in pops] + [p.trial_id for p in pops[2:]])
    assert sum("retrying (attempt 2 of 2)" in line for line in logs) == 2
    lines = _results(out)
    assert [r["trial"] for r in lines] == [t.trial_id for t in trials]  # one line per seed
    assert [(r["status"], r["attempts"]) for r in lines] == [
        ("completed", 1), ("completed", 1), ("completed", 1), ("halted", 1),
        ("failed", 2), ("completed", 2), ("failed", 2), ("failed", 2)]
    # The members' numbers as the fake wrote them (x + seed / 10, wall time 0.25 + seed).
    assert [r["overall"] and r["overall"]["test_sharpe"] for r in lines] == [
        1.0, 1.1, 2.0, 2.1, None, 3.1, None, None]
    assert [r["wall_time_s"] for r in lines[:6]] == [0.25, 1.25, 0.25, 1.25, None, 1.25]
    assert [r["returncode"] for r in lines[:6]] == [0, 0, 0, 1, None, 0]
    assert "error" not in lines[3]  # halted, as a single trial's line: no error
    assert lines[4]["error"] == "exit status None, member status failed: RuntimeError: injected"
    assert lines[6]["error"] == lines[7]["error"] == (
        "not trained: exit code 1, population status missing: boom: the fake population crashed")
    assert lines[6]["returncode"] == 1
    assert lines[0]["run_dir"] == str(out.resolve() / "trials" / pops[0].trial_id / "member0")
    assert all(r["gpu_ids"] == [] and r["hostname"] and r["node_id"] for r in lines)
    assert set(lines[0]) == {"trial", "config", "seed", "overrides", "run_dir", "status", "returncode",
                             "attempts", "wall_time_s", "overall", "gpu_ids", "cuda_visible_devices",
                             "node_id", "hostname"}
    table = sweep_cli.results_table(trials, records, "test_sharpe").splitlines()
    assert table[1].split() == ["mode=ok", "x=1.0", "2/2", "1.05", "0.07071", "1", "1.1"]
    assert table[3].split()[:4] == ["mode=member_fails", "x=3.0", "1/2", "3.1"]
    # --resume: the finished populations stay; the others run again, whole, and complete.
    (out / "fixed").write_text("")
    before = _calls(out)
    trials, records, _ = sweep_cli.run_sweep(spec, out, resume=True, trial_fn=fake_population,
                                             log=lambda s: None)
    assert sorted(_calls(out)[len(before):]) == [pops[2].trial_id, pops[3].trial_id]
    again = _results(out)
    assert again[:4] == lines[:4]  # kept as they were
    assert [r["status"] for r in again[4:]] == ["completed"] * 4
    assert [r["overall"]["test_sharpe"] for r in again[4:]] == [3.0, 3.1, 4.0, 4.1]
    # A results line lost in a crash is rebuilt from population.json and the member's summary.
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in again[1:]))
    sweep_cli.run_sweep(spec, out, resume=True, trial_fn=fake_population, log=lambda s: None)
    rebuilt = _results(out)[0]
    assert len(_calls(out)) == len(before) + 2
    assert (rebuilt["trial"], rebuilt["status"], rebuilt["overall"], rebuilt["wall_time_s"]) == (
        lines[0]["trial"], "completed", {"test_sharpe": 1.0}, 0.25)


@pytest.mark.usefixtures("ray_local")
def test_a_partial_population_is_not_done(fake_population, tmp_path):
    spec = SweepSpec(command="fake", seeds=(0, 1), population=True, configs=((("x", 1.0),),))
    out = tmp_path / "s"
    sweep_cli.run_sweep(spec, out, trial_fn=fake_population, log=lambda s: None)
    pop = sweep_population.populations(spec)[0]
    path = out / "trials" / pop.trial_id / "population.json"
    written = json.loads(path.read_text())
    # As a signal leaves it: one member ran, the population says partial.
    path.write_text(json.dumps({**written, "status": "partial", "members": written["members"][:1]}))
    (out / "results.jsonl").write_text("")
    assert sweep_population.done_lines(out, pop, {}) == []
    sweep_cli.run_sweep(spec, out, resume=True, trial_fn=fake_population, log=lambda s: None)
    assert _calls(out) == [pop.trial_id] * 2
    assert [r["status"] for r in _results(out)] == ["completed"] * 2


@pytest.mark.usefixtures("ray_local")
def test_each_population_trial_takes_a_whole_gpu(fake_population, tmp_path):
    # Two populations at once (a barrier in the fake) on the instance's two logical GPUs: each
    # gets one GPU of its own, and every member line carries its population's placement.
    spec = SweepSpec(command="fake", backend="fast", seeds=(0, 1, 2), population=True,
                     common=(("mode", "barrier"), ("n", 2)), configs=((("x", 1.0),), (("x", 2.0),)))
    out = tmp_path / "s"
    trials, records, _ = sweep_cli.run_sweep(spec, out, trial_fn=fake_population, log=lambda s: None)
    gpus = [records[t.trial_id]["gpu_ids"] for t in trials]
    assert gpus[:3] == [gpus[0]] * 3 and gpus[3:] == [gpus[3]] * 3
    assert sorted(gpus[0] + gpus[3]) == ["0", "1"]
    for t in trials:
        seen = json.loads((Path(records[t.trial_id]["run_dir"]) / "summary.json").read_text())
        assert [seen["cuda_visible_devices"]] == records[t.trial_id]["gpu_ids"]


# ------------------------------------------------------------------------------ foxhunt train
TINY = ["--set", "folds=1", "--set", "epochs=1", "--set", "steps_per_epoch=5", "--grid", "lr=1e-3,3e-4"]
#: Fields of a results line that differ between two runs of the same sweep: where and how long.
UNSTABLE = ("run_dir", "wall_time_s")


@pytest.fixture(scope="module")
def tiny_sweeps(request, tmp_path_factory):
    """2 learning rates x seeds 0-1 of the tiny preset (5 steps) on one CSV, with and without
    --population: (plain sweep dir, population sweep dir, what the plain sweep printed). The
    plain sweep is also the end-to-end test of ``foxhunt sweep`` of ``foxhunt train`` (CI runs
    the four tiny runs once for both)."""
    request.getfixturevalue("ray_local")  # the sweeps run on the module's Ray instance
    root = tmp_path_factory.mktemp("tiny_sweeps")
    # A CSV: every member of a population trains on the same bars, and so here does every run.
    # 800 bars (test_cli's tiny runs'): one fold's validation and test walks are a quarter of
    # 3000 bars' (most of a 5-step run's compute), and what is compared does not depend on it.
    csv = write_csv(root / "bars.csv", SyntheticMarket(4, 800).generate())
    printed = {}
    for name, extra in (("plain", []), ("population", ["--population"])):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            code = main(["sweep", "--out", str(root / name), "--seeds", "0-1", *TINY, *extra,
                         "--", "--preset", "tiny", "--data", str(csv)])
        printed[name] = out.getvalue()
        assert code == 0, f"{name}: {printed[name]}"
    return root / "plain", root / "population", printed["plain"]


def test_tiny_sweep_of_foxhunt_train_end_to_end(tiny_sweeps):
    """2 seeds x 2 learning rates of the tiny preset, 5 steps, on the local Ray instance: a line
    per run, each run's own configuration and checkpoint, the table and the plot."""
    out, _, text = tiny_sweeps
    lines = _results(out)
    common = {"folds": 1, "epochs": 1, "steps_per_epoch": 5}
    assert [(r["status"], r["seed"], r["overrides"]) for r in lines] == [
        ("completed", 0, {**common, "lr": 1e-3}), ("completed", 1, {**common, "lr": 1e-3}),
        ("completed", 0, {**common, "lr": 3e-4}), ("completed", 1, {**common, "lr": 3e-4})]
    for r in lines:
        config = json.loads((Path(r["run_dir"]) / "config.json").read_text())
        assert config["config"]["lr"] == r["overrides"]["lr"] and config["loop"]["seed"] == r["seed"]
        assert config["loop"]["folds"] == 1 and config["loop"]["steps_per_epoch"] == 5
        assert config["preset"] == "tiny" and config["threads"] == 1
        assert set(r["overall"]) >= {"test_sharpe", "val_sharpe"} and r["wall_time_s"] > 0
        assert sweep.COMMANDS["train"].resumable(Path(r["run_dir"]))  # its checkpoint is there
    table = text[text.index("configuration"):].splitlines()
    assert [row.split()[:2] for row in table[1:3]] == [["lr=0.001", "2/2"], ["lr=0.0003", "2/2"]]
    assert (out / "results.png").is_file() and not sweep.COMMANDS["train"].resumable(out)


def test_population_sweep_gives_the_lines_of_the_plain_sweep(tiny_sweeps):
    plain_dir, pop_dir, _ = tiny_sweeps
    plain, pop = _results(plain_dir), _results(pop_dir)
    assert [r["status"] for r in pop] == ["completed"] * 4
    assert [list(r) for r in pop] == [list(r) for r in plain]  # the same keys, in order
    for a, b in zip(plain, pop):
        assert {k: v for k, v in a.items() if k not in UNSTABLE} == {
            k: v for k, v in b.items() if k not in UNSTABLE}  # metrics bitwise (JSON floats)
        assert {"test_sharpe", "val_sharpe"} <= set(b["overall"]) and b["wall_time_s"] > 0
    # Two population runs (one per learning rate), each trained both seeds: foxhunt train --seeds.
    pops = sorted(p.name for p in (pop_dir / "trials").iterdir())
    assert pops == ["000-lr=0.001-seeds0-1", "001-lr=0.0003-seeds0-1"]
    for r in pop:
        run_dir = Path(r["run_dir"])
        assert run_dir.parent.parent == pop_dir / "trials" and run_dir.name == f"member{r['seed']}"
        config = json.loads((run_dir / "config.json").read_text())
        assert config["config"]["lr"] == r["overrides"]["lr"] and config["loop"]["seed"] == r["seed"]
    for name in pops:
        log = (pop_dir / "logs" / f"{name}.log").read_text()
        assert log.count("# attempt") == 1 and "--seeds 0,1" in log
    plan = json.loads((pop_dir / "sweep.json").read_text())
    assert plan["population"] is True and plan["seeds"] == [0, 1]
    assert (pop_dir / "results.png").stat().st_size > 1000


def test_resume_runs_a_partial_population_again_whole(tiny_sweeps, tmp_path):
    _, done_dir, _ = tiny_sweeps
    out = tmp_path / "s"
    shutil.copytree(done_dir, out)
    before = _results(out)
    # As a SIGTERM during seed 1 of the second population leaves it: member 0 done, member 1
    # stopped and not recorded, population.json partial; the sweep recorded no line of it.
    second = out / "trials" / "001-lr=0.0003-seeds0-1"
    written = json.loads((second / "population.json").read_text())
    shutil.rmtree(second / "member1")
    (second / "population.json").write_text(json.dumps({
        **written, "status": "partial", "stopped_by": "SIGTERM", "members": written["members"][:1],
        "not_run": [1]}))
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in before[:2]))
    assert main(["sweep", "--resume", str(out)]) == 0
    after = _results(out)
    assert after[:2] == before[:2]  # the first population was not run again
    assert (out / "logs" / "000-lr=0.001-seeds0-1.log").read_text().count("# attempt") == 1
    assert (out / "logs" / "001-lr=0.0003-seeds0-1.log").read_text().count("# attempt") == 2
    for a, b in zip(before[2:], after[2:]):  # the second, trained again from nothing: the same
        assert {k: v for k, v in a.items() if k not in UNSTABLE} == {
            k: v for k, v in b.items() if k not in UNSTABLE}
    assert json.loads((second / "population.json").read_text())["status"] == "completed"
