"""``foxhunt`` / ``foxhunt train`` as a user meets it (issue 21 items 2, 4-9): run directories,
config files and ``--set``, usage errors (one line, status 2, no traceback), signals, outputs,
BLAS threads. Runs are tiny (the ``tiny`` preset, a few steps) and in-process where possible."""

import gzip
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from foxhunt.reference import cli, runs, settings_io, train_cli
from foxhunt.reference.market import Bars, SyntheticMarket

#: A run of a few seconds: 1 fold, 2 epochs of 5 steps, small replay warm-up.
TINY = ["--preset", "tiny", "--folds", "1", "--epochs", "2", "--steps-per-epoch", "5",
        "--bars", "800", "--set", "warmup_transitions=64", "--set", "n_envs=2", "--no-progress"]
#: Wall-clock fields: the only ones that differ between identical runs.
TIMING = ("train_s", "eval_s", "steps_per_s")


def strict_loads(text):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def foxhunt(argv, capsys):
    """Run ``foxhunt argv`` in-process: (exit status, stdout, stderr)."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as exc:  # argparse's own errors, --help, --version
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_usage_error(rc, err, *fragments):
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_csv(path, bars, *, bom=False, gz=False):
    lines = ["timestamp,open,high,low,close,volume"]
    for i in range(len(bars)):
        vals = ",".join(repr(float(getattr(bars, f)[i])) for f in ("open", "high", "low", "close", "volume"))
        lines.append(f"{int(bars.timestamp[i])},{vals}")
    raw = (b"\xef\xbb\xbf" if bom else b"") + ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


# ---------------------------------------------------------------------------------- the parser
def test_version(capsys):
    rc, out, _ = foxhunt(["--version"], capsys)
    assert rc == 0 and out.strip() == f"foxhunt {runs.foxhunt_version()}"


@pytest.mark.parametrize("argv", [["train", "--epoch", "2"], ["train", "--steps", "5"],
                                  ["train", "--metrics", "9000"], ["info", "--verbose"]])
def test_abbreviations_are_refused(argv, capsys):
    rc, _, err = foxhunt(argv, capsys)
    assert_usage_error(rc, err, argv[1])


def test_help_shows_defaults_order_and_every_setting(capsys):
    rc, out, _ = foxhunt(["train", "--help"], capsys)
    assert rc == 0
    flat = " ".join(out.split())
    for text in ("epochs per fold (default: 3)", "walk-forward folds (default: 2)",
                 "(default: 300)", "(default: 0)", "(default: 20000; not with --data)",
                 "BLAS threads of this run's NumPy (default: 1)", "(default: 127.0.0.1",
                 "a later one winning: the preset (--preset), the --config file",
                 "then each --set in order"):
        assert text in flat, text
    for key in settings_io.all_settings().values():
        assert f" {key.name}=" in flat, key.name


# ---------------------------------------------------------------------------------- settings
def plan(argv):
    """The settings ``foxhunt train argv`` would run with (nothing trained or written)."""
    args = cli.build_parser().parse_args(["train", *argv])
    train_cli._check_flags(args)
    return train_cli._plan_new(args).run


@pytest.fixture(autouse=True)
def _commands():
    cli._load_extra_commands()


def test_config_file_flags_and_set_precedence(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('preset = "tiny"\nlr = 0.002\nepochs = 7\nbranches = [3, 3, 2]\n'
                   '[loop]\nfolds = 1\nseed = 5\n[config]\ncql_alpha = 2\n')
    base = ["--bars", "800", "--config", str(cfg)]
    rc = plan(base)
    assert (rc.preset, rc.config.lr, rc.config.branches, rc.config.cql_alpha) == ("tiny", 0.002, (3, 3, 2), 2.0)
    assert (rc.settings.epochs, rc.settings.folds, rc.settings.seed) == (7, 1, 5)
    assert rc.config.batch_size == 32  # the file's preset is the base
    rc = plan(base + ["--epochs", "2", "--seed", "9"])  # flags override the file
    assert (rc.settings.epochs, rc.settings.seed) == (2, 9)
    rc = plan(base + ["--epochs", "2", "--set", "epochs=4", "--set", "loop.epochs=5",
                      "--set", "gamma=0.9,0.95,0.97", "--set", "precision=f32"])
    assert rc.settings.epochs == 5  # --set beats the flag; the last --set wins
    assert rc.config.gamma == (0.9, 0.95, 0.97) and rc.config.precision == "f32"
    assert plan(base + ["--preset", "seed"]).config.batch_size == 256  # the flag's preset wins


def test_n_step_seed_preset_default_flag_and_set(tmp_path):
    """n-step transitions (issue 22): 3 for the seed preset, 1 for tiny; --n-step and --set
    beat the preset's default; a config file's n_step beats it too."""
    base = ["--bars", "800", "--folds", "1"]
    assert plan(base).settings.n_step == 3  # the seed preset is the default
    assert plan(base + ["--preset", "tiny"]).settings.n_step == 1
    assert plan(base + ["--n-step", "5"]).settings.n_step == 5
    assert plan(base + ["--n-step", "5", "--set", "n_step=1"]).settings.n_step == 1
    cfg = tmp_path / "c.toml"
    cfg.write_text("[loop]\nn_step = 2\n")
    assert plan(base + ["--config", str(cfg)]).settings.n_step == 2
    with pytest.raises(ValueError, match=r"n_step=17"):
        plan(base + ["--n-step", "17"])


def test_json_config_file(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"config": {"tau": 0.01, "budgets": [0.4, 0.3, 0.2, 0.1]},
                               "loop": {"n_envs": 4}, "gamma": 0.9, "folds": 1}))
    rc = plan(["--bars", "800", "--config", str(cfg)])
    assert (rc.config.tau, rc.config.budgets, rc.config.gamma) == (0.01, (0.4, 0.3, 0.2, 0.1), 0.9)
    assert (rc.settings.n_envs, rc.settings.folds) == (4, 1)


def test_every_setting_is_reachable_by_set():
    for key, setting in settings_io.all_settings().items():
        default = getattr(settings_io.SECTIONS[setting.section](), setting.name)
        text = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
        (got, value), = settings_io.parse_set([f"{key}={text}"])
        assert got == setting and value == default, key


@pytest.mark.parametrize("text,fragments", [
    ('lr = "0.9"\n', ["lr=\"0.9\"", "expected a number"]),
    ("lr = true\n", ["lr=true", "expected a number"]),
    ("epochs = 3.0\n", ["epochs=3.0", "expected an integer"]),
    ("branches = 3\n", ["branches=3", "list of integers"]),
    ("lrr = 0.1\n", ["unknown setting 'lrr'", "nearest known: lr"]),
    ("[config]\nepochs = 3\n", ["[config]", "loop.epochs"]),
    ('preset = "huge"\n', ["preset='huge'", "'seed'"]),
    ("lr = \n", ["not valid TOML"]),
])
def test_config_file_errors(in_tmp, capsys, text, fragments):
    (in_tmp / "c.toml").write_text(text)
    rc, _, err = foxhunt(["train", *TINY, "--config", "c.toml"], capsys)
    assert_usage_error(rc, err, "--config c.toml", *fragments)
    assert not (in_tmp / "runs").exists()


@pytest.mark.parametrize("item,fragments", [
    ("lr=abc", ["lr=abc", "expected a number"]),
    ("lr=-1", ["lr=-1.0", "> 0"]),
    ("epochs=2.5", ["epochs=2.5", "expected an integer"]),
    ("gama=0.9", ["unknown setting 'gama'", "nearest known: gamma"]),
    ("config.epochs=3", ["config.epochs", "loop.epochs"]),
    ("branches=3,x", ["branches=3,x", "list of integers"]),
    ("lr", ["expected key=value"]),
    ("seed=-1", ["seed=-1", ">= 0"]),
])
def test_set_errors(in_tmp, capsys, item, fragments):
    rc, _, err = foxhunt(["train", *TINY, "--set", item], capsys)
    assert_usage_error(rc, err, *fragments)
    assert not (in_tmp / "runs").exists()


# ---------------------------------------------------------------------------------- usage errors
def test_usage_errors_one_line_status_2(in_tmp, capsys, monkeypatch):
    bars = SyntheticMarket(0, 800).generate()
    csv = write_csv(in_tmp / "bars.csv", bars)
    (in_tmp / "a_file").write_text("x")
    latin1 = in_tmp / "latin1.csv"
    latin1.write_bytes("timestamp,open,high,low,close,volume,name\n1,1,1,1,1,1,Z\xfcrich\n".encode("latin-1"))
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    monkeypatch.setattr(cli, "cuda_status", lambda: (False, "libcuda.so.1 not found"))
    cases = [
        (["--bars", "100"], ["--folds 1", "100 bars give 1 folds", "fewer folds"]),
        (["--bars", "0"], ["--bars", "0 is not allowed", ">= 2"]),
        (["--seed", "-1"], ["--seed", "-1 is not allowed", ">= 0"]),
        (["--epochs", "0"], ["--epochs", ">= 1"]),
        (["--threads", "0"], ["--threads", ">= 1"]),
        (["--out", "a_file"], ["--out a_file", "is a file"]),
        (["--out", "a_file/run"], ["--out a_file/run", "cannot create"]),
        (["--metrics-port", str(port)], [f"127.0.0.1:{port}", "already in use"]),
        (["--metrics-port", "70000"], ["--metrics-port", "0..65535"]),
        (["--metrics-host", "0.0.0.0"], ["--metrics-host", "only with --metrics-port"]),
        (["--backend", "fast"], ["--backend fast", "NVIDIA GPU", "libcuda.so.1 not found",
                                 "--backend reference"]),
        (["--data", str(csv), "--bars", "500"], ["--data", "--bars", "synthetic"]),
        (["--data", str(csv), "--market", "strong_trend"], ["--data", "--market"]),
        (["--data", "missing.csv"], ["missing.csv", "no such file"]),
        (["--data", str(latin1)], [str(latin1), "not UTF-8", "byte offset 55", "line 2"]),
        (["--overwrite"], ["--overwrite", "only with --out"]),
        (["--resume", "nowhere"], ["--resume nowhere", "no such run directory"]),
        (["--resume", "x", "--epochs", "3"], ["--resume", "--epochs", "does not apply"]),
        (["--config", "missing.toml"], ["--config missing.toml", "cannot read"]),
        (["--config", "c.yaml"], ["--config c.yaml", ".toml or .json"]),
    ]
    try:
        for extra, fragments in cases:
            if "--resume" in extra:
                argv = ["--no-progress"]
            elif "--data" in extra:
                argv = [a for a in TINY if a not in ("--bars", "800")]
            else:
                argv = TINY
            rc, _, err = foxhunt(["train", *argv, *extra], capsys)
            assert_usage_error(rc, err, *fragments)
    finally:
        busy.close()
    assert not (in_tmp / "runs").exists()  # nothing was started


def test_out_read_only_is_a_usage_error_even_for_root(in_tmp, capsys, monkeypatch):
    # Root ignores permission bits, so a chmod-ed directory does not fail for root: the
    # permission error is raised where mkdir would raise it, as on a read-only file system.
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if self.name == "ro_run":
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)
    monkeypatch.setattr(Path, "mkdir", read_only)
    rc, _, err = foxhunt(["train", *TINY, "--out", "ro_parent/ro_run"], capsys)
    assert_usage_error(rc, err, "--out ro_parent/ro_run", "Permission denied")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits; the test above "
                    "covers the same error through a patched mkdir")
def test_out_in_a_read_only_directory(in_tmp, capsys):
    (in_tmp / "ro").mkdir(mode=0o555)
    rc, _, err = foxhunt(["train", *TINY, "--out", "ro/run"], capsys)
    assert_usage_error(rc, err, "--out ro/run", "Permission denied")


# ---------------------------------------------------------------------------------- run dirs
def metrics(run_dir):
    return [strict_loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def test_each_run_gets_its_own_directory_and_latest_follows(in_tmp, capsys):
    rc, out, err = foxhunt(["train", *TINY], capsys)
    assert rc == 0, err
    first = sorted((in_tmp / "runs").glob("*-seed0"))
    assert len(first) == 1 and (in_tmp / "runs" / "latest").resolve() == first[0].resolve()
    first_metrics = (first[0] / "metrics.jsonl").read_text()
    rc, _, err = foxhunt(["train", *TINY], capsys)
    assert rc == 0, err
    both = sorted((in_tmp / "runs").glob("*-seed0*"))
    assert len(both) == 2
    assert (in_tmp / "runs" / "latest").resolve() == both[1].resolve()
    assert (first[0] / "metrics.jsonl").read_text() == first_metrics  # untouched
    assert len(metrics(both[1])) == 2


def test_rerun_into_out_is_refused_and_overwrite_leaves_nothing_stale(in_tmp, capsys):
    rc, _, err = foxhunt(["train", *TINY, "--out", "run"], capsys)
    assert rc == 0, err
    before = (in_tmp / "run" / "metrics.jsonl").read_text()
    stale = in_tmp / "run" / "checkpoints" / "fold7_best.safetensors"
    stale.write_bytes(b"an older run's checkpoint")
    rc, _, err = foxhunt(["train", *TINY, "--out", "run", "--epochs", "1"], capsys)
    assert_usage_error(rc, err, "--out run", "not empty", "--overwrite")
    assert (in_tmp / "run" / "metrics.jsonl").read_text() == before  # nothing lost
    rc, _, err = foxhunt(["train", *TINY, "--out", "run", "--epochs", "1", "--overwrite"], capsys)
    assert rc == 0, err
    assert not stale.exists()
    assert len(metrics(in_tmp / "run")) == 1
    assert not (in_tmp / "runs").exists()  # an explicit --out does not move runs/latest


def test_a_second_writer_is_refused(in_tmp, capsys):
    (in_tmp / "run").mkdir()
    (in_tmp / "run" / "config.json").write_text("{}")
    holder = runs.lock_run_dir(in_tmp / "run")  # as another `foxhunt train` would
    try:
        rc, _, err = foxhunt(["train", *TINY, "--out", "run", "--overwrite"], capsys)
        assert_usage_error(rc, err, "another foxhunt process is writing")
        assert (in_tmp / "run" / "config.json").read_text() == "{}"  # not cleared
    finally:
        holder.release()


def test_summary_and_config_record_the_run(in_tmp, capsys):
    rc, _, err = foxhunt(["train", *TINY, "--out", "run", "--seed", "3", "--set", "lr=0.0005"], capsys)
    assert rc == 0, err
    summary = strict_loads((in_tmp / "run" / "summary.json").read_text())
    config = strict_loads((in_tmp / "run" / "config.json").read_text())
    expected_hash = runs.bars_sha256(SyntheticMarket.preset("default", seed=3, n_bars=800).generate())
    assert summary["foxhunt_version"] == runs.foxhunt_version()
    assert summary["git"] == runs.git_commit()
    assert summary["seed"] == 3 and summary["loop"]["seed"] == 3
    assert summary["config"]["lr"] == 0.0005 and summary["config"]["batch_size"] == 32
    assert summary["loop"]["epochs"] == 2 and summary["loop"]["steps_per_epoch"] == 5
    assert summary["data"] == {"kind": "synthetic", "market": "default", "bars": 800, "seed": 3,
                               "sha256": expected_hash}
    assert summary["status"] == "completed" and summary["epochs_completed"] == 2
    assert config["data"] == summary["data"] and config["config"] == summary["config"]
    assert runs.read_run_config(in_tmp / "run").settings.seed == 3


def test_bom_gzip_csv_trains(in_tmp, capsys):
    bars = SyntheticMarket(4, 800).generate()
    path = write_csv(in_tmp / "bars.csv.gz", bars, bom=True, gz=True)
    argv = [a for a in TINY if a not in ("--bars", "800")]
    rc, _, err = foxhunt(["train", *argv, "--data", str(path), "--out", "run"], capsys)
    assert rc == 0, err
    data = strict_loads((in_tmp / "run" / "config.json").read_text())["data"]
    as_read = Bars(bars.timestamp, bars.open, bars.high, bars.low, bars.close, bars.volume)  # a CSV has no regimes
    assert data == {"kind": "csv", "path": str(path.resolve()), "sha256": runs.bars_sha256(as_read)}


# ---------------------------------------------------------------------------------- resume
def test_interrupted_then_resumed_matches_the_uninterrupted_run(in_tmp, capsys, monkeypatch):
    argv = [*TINY, "--epochs", "3"]
    rc, _, err = foxhunt(["train", *argv, "--out", "whole"], capsys)
    assert rc == 0, err
    # Interrupt the second run with SIGTERM to itself right after its first epoch record.
    real_append = train_cli.jsonio.append_jsonl
    sent = []

    def append_then_signal(path, obj):
        real_append(path, obj)
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(train_cli.jsonio, "append_jsonl", append_then_signal)
    rc, _, err = foxhunt(["train", *argv, "--out", "part"], capsys)
    assert rc == 128 + signal.SIGTERM, err
    assert "SIGTERM" in err
    monkeypatch.setattr(train_cli.jsonio, "append_jsonl", real_append)
    summary = strict_loads((in_tmp / "part" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["stopped_by"] == "SIGTERM"
    assert len(metrics(in_tmp / "part")) == 1
    # A record the checkpoint does not hold (written after it, before a crash) is cut on resume.
    with open(in_tmp / "part" / "metrics.jsonl", "a") as fh:
        fh.write('{"fold": 0, "epoch": 99}\n')
    rc, _, err = foxhunt(["train", "--resume", "part", "--no-progress"], capsys)
    assert rc == 0, err
    assert without_timing(metrics(in_tmp / "part")) == without_timing(metrics(in_tmp / "whole"))
    assert strict_loads((in_tmp / "part" / "summary.json").read_text())["status"] == "completed"


def test_resume_refuses_changed_data(in_tmp, capsys):
    bars = SyntheticMarket(4, 800).generate()
    path = write_csv(in_tmp / "bars.csv", bars)
    argv = [a for a in TINY if a not in ("--bars", "800")]
    rc, _, err = foxhunt(["train", *argv, "--data", str(path), "--out", "run"], capsys)
    assert rc == 0, err
    write_csv(path, SyntheticMarket(5, 800).generate())
    rc, _, err = foxhunt(["train", "--resume", "run"], capsys)
    assert_usage_error(rc, err, "data changed")


# ---------------------------------------------------------------------------------- signals
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_signal_stops_a_real_run_with_summary_and_plots(tmp_path, signame):
    signum = getattr(signal, signame)
    proc = subprocess.Popen(
        [sys.executable, "-m", "foxhunt.reference.cli", "train", *TINY, "--epochs", "1000",
         "--out", "run"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics_path = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics_path.exists() and metrics_path.read_text().count("\n") >= 1):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no epoch finished in 120 s"
        time.sleep(0.05)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in err
    summary = strict_loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["stopped_by"] == signame
    assert summary["plots"] and all(Path(tmp_path / p).exists() or Path(p).exists()
                                    for p in summary["plots"])
    assert any(p.suffix == ".png" for p in (tmp_path / "run").iterdir())
    assert len(metrics(tmp_path / "run")) == summary["epochs_completed"] >= 1


# ---------------------------------------------------------------------------------- outputs
def test_metrics_and_summary_are_strict_json_with_nan_as_null(in_tmp, capsys, monkeypatch):
    real = train_cli.jsonio.append_jsonl

    def nan_loss(path, obj):
        real(path, {**obj, "loss": math.nan, "mean_q": math.inf})
    monkeypatch.setattr(train_cli.jsonio, "append_jsonl", nan_loss)
    rc, _, err = foxhunt(["train", *TINY, "--out", "run"], capsys)
    assert rc == 0, err
    records = metrics(in_tmp / "run")  # strict: fails on NaN / Infinity
    assert [r["loss"] for r in records] == [None, None]
    assert [r["mean_q"] for r in records] == [None, None]
    strict_loads((in_tmp / "run" / "summary.json").read_text())
    strict_loads((in_tmp / "run" / "config.json").read_text())


def test_tensorboard_scalars_read_back(in_tmp, capsys):
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    rc, _, err = foxhunt(["train", *TINY, "--out", "run", "--tensorboard",
                          "--set", "readback_interval=2"], capsys)
    assert rc == 0, err
    acc = event_accumulator.EventAccumulator(str(in_tmp / "run" / "tensorboard"))
    acc.Reload()

    def series(tag):
        return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
    records = metrics(in_tmp / "run")
    assert series("epoch/loss") == [(r["global_epoch"], pytest.approx(r["loss"], rel=1e-6))
                                    for r in records]
    assert [s for s, _ in series("epoch/test_sharpe")] == [0, 1]
    # Readback points: every readback_interval steps (steps counted from 1), 10 steps in all.
    steps = [s for s, _ in series("step/grad_norm")]
    assert steps and all(s % 2 == 0 for s in steps) and steps == sorted(set(steps))


def test_metrics_server_binds_localhost_by_default():
    from foxhunt.reference.run_outputs import PrometheusGauges

    gauges = PrometheusGauges(0)
    try:
        host, port = gauges.address
        assert host == "127.0.0.1"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            body = b"".join(iter(lambda: conn.recv(65536), b""))
        assert b"foxhunt_grad_norm" in body
    finally:
        gauges.close()


def _scrape(gauges) -> str:
    host, port = gauges.address
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        return b"".join(iter(lambda: conn.recv(65536), b"")).decode()


def test_population_members_share_the_gauges_server_under_their_own_seeds():
    """Members of ``train --seeds`` write one server's gauges under their seed label: neither
    overwrites the other, and a member's ``close`` leaves the server up for the rest."""
    import dataclasses

    from foxhunt.reference.loop import EpochRecord
    from foxhunt.reference.run_outputs import PrometheusGauges

    zero = {f.name: 0 for f in dataclasses.fields(EpochRecord)}
    recs = {seed: EpochRecord(**{**zero, "grad_norm": 1.5 + seed, "c51_norm_pre": 10.0 + seed,
                                 "val_sharpe": None, "test_sharpe": None})
            for seed in (3, 7)}
    gauges = PrometheusGauges(0, seed=3)
    try:
        members = {seed: gauges.member(seed) for seed in (3, 7)}
        for seed, member in members.items():
            member.epoch(recs[seed])
            member.close()
        lines = _scrape(gauges).splitlines()
        for seed in (3, 7):
            for comp, stage, value in (("total", "adam", 1.5 + seed), ("c51", "pre", 10.0 + seed)):
                # the exposition format sorts the labels by name
                line = f'foxhunt_grad_norm{{component="{comp}",seed="{seed}",stage="{stage}"}}'
                assert [float(l.split()[-1]) for l in lines if l.startswith(line)] == [value], line
    finally:
        gauges.close()


def test_threads_pin_the_blas_pool_inside_the_run(in_tmp, capsys, monkeypatch):
    from threadpoolctl import threadpool_info

    def blas_threads():
        return sorted({p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"})
    outside = blas_threads()
    assert outside, "numpy has no BLAS pool threadpoolctl can see"
    real_run = train_cli.run
    seen = []

    def spy(*args, **kwargs):
        seen.append(blas_threads())
        return real_run(*args, **kwargs)
    monkeypatch.setattr(train_cli, "run", spy)
    for n in (1, 3):
        rc, _, err = foxhunt(["train", *TINY, "--out", f"run{n}", "--threads", str(n),
                              "--epochs", "1"], capsys)
        assert rc == 0, err
    assert seen == [[1], [3]]
    assert blas_threads() == outside  # restored after the run


def test_resume_without_a_resume_state_is_a_usage_error(in_tmp, capsys):
    rc, _, err = foxhunt(["train", *TINY, "--out", "run"], capsys)
    assert rc == 0, err
    for path in sorted((in_tmp / "run" / "checkpoints").iterdir()):
        path.unlink()  # as if the run died before its first epoch ended
    rc, _, err = foxhunt(["train", "--resume", "run"], capsys)
    assert_usage_error(rc, err, "--resume run")


def test_conformance_without_its_test_modules_prints_an_install_hint(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "hypothesis" else real(name, *a))
    rc, _, err = foxhunt(["conformance", "--quick"], capsys)
    assert_usage_error(rc, err, "needs hypothesis", "pip install 'foxhunt[gpu]'")


def test_tensorboard_missing_is_an_install_hint_before_any_run_dir(in_tmp, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard.summary", None)  # import fails
    rc, _, err = foxhunt(["train", *TINY, "--tensorboard"], capsys)
    assert_usage_error(rc, err, "--tensorboard", "pip install 'foxhunt[tensorboard]'")
    assert not (in_tmp / "runs").exists()
