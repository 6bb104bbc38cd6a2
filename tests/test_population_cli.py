"""``foxhunt train --seeds SPEC`` (issue 24 item 4, CPU part): the SPEC parser and its errors, and
tiny populations on the reference backend: member directories, ``population.json`` against the
members' own ``summary.json``, the spread recomputed here with NumPy, the same bars for every
member, a member that raises, and a signal mid-population."""

import json
import os
import signal

import numpy as np
import pytest
from test_cli import TINY, assert_usage_error, foxhunt, strict_loads, write_csv

from foxhunt.reference import population_cli, runs, train_cli
from foxhunt.reference.market import Bars, SyntheticMarket
from foxhunt.reference.population_cli import parse_seed_spec
from foxhunt.reference.trainer import Trainer

#: The fewest epochs and steps that give every member a validation-chosen epoch.
POP = [*TINY, "--epochs", "1", "--steps-per-epoch", "2"]
MEMBER_FILES = ("config.json", "metrics.jsonl", "summary.json", "checkpoints/fold0_best.safetensors")


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ---------------------------------------------------------------------------------- the SPEC
@pytest.mark.parametrize("spec, seeds", [
    ("0-15", tuple(range(16))), ("0,3,7", (0, 3, 7)), ("0-3,8", (0, 1, 2, 3, 8)),
    ("9,2", (9, 2)), (" 4 , 5-6 ", (4, 5, 6)), ("0-255", tuple(range(256))),
    ("10-11", (10, 11)), ("007,8", (7, 8)),
])
def test_seed_spec_good(spec, seeds):
    assert parse_seed_spec(spec) == seeds


@pytest.mark.parametrize("spec, why", [
    ("0", "1 member; a population needs at least 2"),
    ("5-5", "1 member; a population needs at least 2"),
    ("0-256", "more than 256 seeds"),
    ("0-99999999999", "more than 256 seeds"),  # refused before the range is expanded
    ("0-200,300-400", "more than 256 seeds"),
    ("3-1", "range '3-1' runs backwards"),
    ("0,0-2", "seed 0 is listed twice"),
    ("4,1,4", "seed 4 is listed twice"),
    ("0-", "'0-' is not a seed or a range"),
    ("-1,2", "'-1' is not a seed or a range"),
    ("+1,2", "'+1' is not a seed or a range"),
    ("1.0,2", "'1.0' is not a seed or a range"),
    ("a-b", "'a-b' is not a seed or a range"),
    ("1 2", "'1 2' is not a seed or a range"),
    ("\u0663,1", "'\u0663' is not a seed or a range"),  # an Arabic-Indic 3: int() would take it
    ("0,,1", "an empty item"),
    ("0,1,", "an empty item"),
    ("", "an empty item"),
])
def test_seed_spec_bad(spec, why):
    with pytest.raises(runs.UsageError) as err:
        parse_seed_spec(spec)
    message = str(err.value)
    assert message == f"--seeds {spec!r}: {why}; {population_cli.SEEDS_RULE}"
    assert "\n" not in message
    for rule in ("0-15", "0,3,7", "0-3,8", ">= 0", "no seed twice", "2 to 256 members"):
        assert rule in population_cli.SEEDS_RULE


@pytest.mark.parametrize("extra, fragments", [
    (["--seeds", "0"], ["--seeds '0'", "at least 2"]),
    (["--seeds", "0-1", "--seed", "3"], ["--seeds 0-1 --seed 3", "give one of them"]),
    (["--seeds", "0-1", "--set", "loop.seed=3"], ["--seeds 0-1", "--set seed", "does not apply"]),
    (["--seeds", "0-1", "--resume", "somewhere"], ["--seeds --resume somewhere", "member<seed>"]),
    (["--seeds", "0-1", "--folds", "9"], ["--folds 9"]),  # the single run's own checks still apply
])
def test_usage_errors_write_nothing(in_tmp, capsys, extra, fragments):
    rc, _, err = foxhunt(["train", *POP, *extra], capsys)
    assert_usage_error(rc, err, *fragments)
    assert list(in_tmp.iterdir()) == []


# ---------------------------------------------------------------------------------- populations
def _summaries(pop_dir, seeds):
    return {s: strict_loads((pop_dir / f"member{s}" / "summary.json").read_text()) for s in seeds}


def _row(out, label):
    """The table row that starts with ``label`` (split into cells)."""
    table = out[out.index("population: overall"):]
    rows = [line.split() for line in table.splitlines() if line.split()[:1] == [label]]
    assert len(rows) == 1, (label, table)
    return rows[0]


def _check_population(pop_dir, seeds, out, expected_hash):
    """The member directories, population.json against the summaries, the spread (NumPy), the
    table and one set of bars; returns (population, summaries)."""
    population = strict_loads((pop_dir / "population.json").read_text())
    summaries = _summaries(pop_dir, seeds)
    assert population["status"] == "completed" and population["stopped_by"] is None
    assert population["seeds"] == list(seeds) and population["not_run"] == []
    assert [m["seed"] for m in population["members"]] == list(seeds)
    for member, seed in zip(population["members"], seeds):
        for name in MEMBER_FILES:
            assert (pop_dir / f"member{seed}" / name).is_file(), (seed, name)
        summary = summaries[seed]
        assert summary["seed"] == seed and summary["loop"]["seed"] == seed
        assert summary["status"] == member["status"] == "completed"
        assert member["overall"] == summary["overall"]  # as written there, not recomputed
        assert member["dir"] == f"member{seed}" and member["exit_status"] == 0
        # Same bars: one recorded data source and hash, the one the test builds itself.
        assert summary["data"]["sha256"] == expected_hash
        assert summary["data"] == population["data"]
    keys = set(summaries[seeds[0]]["overall"])
    assert {"test_sharpe", "val_sharpe", "test_total_return", "test_max_drawdown",
            "test_turnover"} <= keys and set(population["spread"]) == keys
    for key in keys:
        values = np.array([summaries[s]["overall"][key] for s in seeds], dtype=np.float64)
        got = population["spread"][key]
        assert got["n"] == len(seeds)
        expected = {"mean": np.mean(values), "std": np.std(values, ddof=1), "min": np.min(values),
                    "median": np.median(values), "max": np.max(values)}
        for stat, value in expected.items():
            assert got[stat] == pytest.approx(value, rel=1e-12, abs=1e-300), (key, stat)
    # The table: each member's test Sharpe first, validation Sharpe last; then the spread.
    for seed in seeds:
        o = summaries[seed]["overall"]
        cells = _row(out, str(seed))
        assert cells[1] == f"{o['test_sharpe']:+.2f}" and cells[-1] == f"{o['val_sharpe']:+.2f}"
        assert cells[2] == f"{100 * o['test_total_return']:+.2f}%"
    sharpes = [summaries[s]["overall"]["test_sharpe"] for s in seeds]
    assert _row(out, "mean")[1] == f"{np.mean(sharpes):+.2f}"
    assert _row(out, "std")[1] == f"{np.std(sharpes, ddof=1):.2f}"
    assert _row(out, "median")[1] == f"{np.median(sharpes):+.2f}"
    return population, summaries


def test_two_members_same_bars_own_seeds(in_tmp, capsys):
    rc, out, err = foxhunt(["train", *POP, "--seeds", "5,2", "--out", "pop"], capsys)
    assert rc == 0, err
    # The market of the first listed seed, 5 (a single run's market takes the run's seed).
    expected = runs.bars_sha256(SyntheticMarket.preset("default", seed=5, n_bars=800).generate())
    population, summaries = _check_population(in_tmp / "pop", (5, 2), out, expected)
    assert population["market_seed"] == 5 and population["data"]["seed"] == 5
    assert sorted(p.name for p in (in_tmp / "pop").iterdir()) == [".foxhunt.lock", "member2",
                                                                  "member5", "population.json"]
    # Each member's checkpoint loads into a trainer; the seeds made different networks.
    a, b = (Trainer.load(in_tmp / "pop" / f"member{s}" / "checkpoints" / "fold0_best.safetensors")
            for s in (5, 2))
    assert a.config == b.config and not np.array_equal(a.params, b.params)
    # A member is a run directory of its own: it records the population's bars and settings.
    for s in (5, 2):
        recorded = runs.read_run_config(in_tmp / "pop" / f"member{s}")
        assert recorded.settings.seed == s and recorded.data == population["data"]


def test_three_members_on_a_csv_and_runs_latest(in_tmp, capsys):
    bars = SyntheticMarket(4, 800).generate()
    csv = write_csv(in_tmp / "bars.csv", bars)
    argv = [a for a in POP if a not in ("--bars", "800")]
    rc, out, err = foxhunt(["train", *argv, "--data", str(csv), "--seeds", "0-1,7"], capsys)
    assert rc == 0, err
    made = sorted((in_tmp / "runs").glob("*-seeds0-1,7"))
    assert len(made) == 1 and (in_tmp / "runs" / "latest").resolve() == made[0].resolve()
    as_read = Bars(bars.timestamp, bars.open, bars.high, bars.low, bars.close, bars.volume)
    population, _ = _check_population(made[0], (0, 1, 7), out, runs.bars_sha256(as_read))
    assert population["market_seed"] is None and population["data"]["kind"] == "csv"


def test_a_failing_member_leaves_the_others(in_tmp, capsys, monkeypatch):
    real_run = train_cli.run

    def run_or_fail(config, bars, settings, **kwargs):
        if settings.seed == 3:
            raise RuntimeError("injected failure\nsecond line")
        return real_run(config, bars, settings, **kwargs)
    monkeypatch.setattr(train_cli, "run", run_or_fail)
    rc, out, err = foxhunt(["train", *POP, "--seeds", "3,4", "--out", "pop"], capsys)
    assert rc == 1, err
    assert "Traceback" in err and "injected failure" in err  # a bug keeps its traceback
    population = strict_loads((in_tmp / "pop" / "population.json").read_text())
    failed, done = population["members"]
    assert failed["seed"] == 3 and failed["status"] == "failed"
    assert failed["error"] == "RuntimeError: injected failure" and failed["overall"] is None
    assert not (in_tmp / "pop" / "member3" / "summary.json").exists()
    summary = strict_loads((in_tmp / "pop" / "member4" / "summary.json").read_text())
    assert done["seed"] == 4 and done["status"] == "completed" and done["overall"] == summary["overall"]
    assert population["status"] == "completed"  # every member ran, one of them failed
    spread = population["spread"]["test_sharpe"]
    assert spread["n"] == 1 and spread["std"] is None
    assert spread["mean"] == spread["median"] == summary["overall"]["test_sharpe"]
    assert "failed: RuntimeError: injected failure" in " ".join(_row(out, "3"))


@pytest.mark.parametrize("epochs, member1", [("2", "interrupted"), ("1", "completed")])
def test_a_signal_writes_the_partial_population(in_tmp, capsys, monkeypatch, epochs, member1):
    """Ctrl-C at member 1's first epoch record: with 2 epochs it stops member 1, with 1 (the
    signal after its last step) member 1 completes; either way member 2 never starts."""
    real_append = train_cli.jsonio.append_jsonl

    def append_then_signal(path, obj):
        real_append(path, obj)
        if os.path.basename(os.path.dirname(path)) == "member1":
            os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(train_cli.jsonio, "append_jsonl", append_then_signal)
    rc, out, err = foxhunt(["train", *POP, "--epochs", epochs, "--seeds", "0-2", "--out", "pop"],
                           capsys)
    assert rc == 128 + signal.SIGINT, err
    assert "Traceback" not in err
    population = strict_loads((in_tmp / "pop" / "population.json").read_text())
    assert population["status"] == "partial" and population["stopped_by"] == "SIGINT"
    assert population["seeds"] == [0, 1, 2] and population["not_run"] == [2]
    first, second = population["members"]
    assert (first["status"], second["status"]) == ("completed", member1)
    assert second["exit_status"] == (128 + signal.SIGINT if member1 == "interrupted" else 0)
    assert second["stopped_by"] == "SIGINT" and first["stopped_by"] is None
    summaries = _summaries(in_tmp / "pop", (0, 1))
    assert [first["overall"], second["overall"]] == [summaries[0]["overall"], summaries[1]["overall"]]
    assert summaries[1]["stopped_by"] == "SIGINT"
    assert not (in_tmp / "pop" / "member2").exists()
    n_done = 1 + (member1 == "completed")  # the spread is over the completed members
    assert population["spread"]["val_sharpe"]["n"] == n_done
    assert "not run: seeds 2" in out and "partial" in out
    assert json.loads((in_tmp / "pop" / "member1" / "config.json").read_text())["loop"]["seed"] == 1
