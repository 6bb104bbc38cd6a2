"""The main job on the GPU (issue 20, SPEC 11): collection + training, greedy evaluation, and
``foxhunt train --backend fast`` end to end, ``seed`` preset, in one run.

Benches (pytest-benchmark groups; GPU only: without a GPU each skips with the reason):

(a) ``main-job-epoch-seed-<precision>``: one epoch (300 steps, then ``end_epoch()``, whose
    readback synchronises) three ways on one trainer, timed interleaved in the same process:

    - ``step-only``: 300 launches of one captured graph holding the trainer's graphs 1 and 2
      (the step with its batch already on the device: no upload, no collection), each
      followed by the trainer's step bookkeeping (``step_enqueued``: deferred readback);
    - ``step-upload``: 300 ``trainer.step(batch)`` from a pool of host batches (the upload
      graph + graphs 1 and 2: ``benches/bench_epoch.py``'s epoch);
    - ``main-job``: 300 ``FastCollector.cycle_step`` on the first fold's walks (one graph per
      cycle: act, env step, replay add, prefix sums, sampling, gather into the batch, graphs 1
      and 2, priority update, cycle advance), after the replay warm-up, eps 0.5.

    ``extra_info`` carries ``main-job / step-only`` (target: at most 1.3) and ``main-job /
    step-upload``.
(b) ``greedy-eval-10000-<precision>``: ``DeviceEvaluator.walk`` of the greedy policy over
    10,000 bars, one readback and synchronisation each, graphs built before timing (target: at
    most 20 ms): ``mode="graph"`` (begin, ``ceil(10,000 / K)`` launches of the K-bar chunk
    graph, eval_metrics) for K in ``CHUNKS``, and ``mode="fused"`` (the span walk: its time
    depends on the policy, how long it holds a position; the table gives each agent's position
    changes). Two agents: the trainer of (a) (it also stepped on random batches) and one
    trained by ``TRAINED_EPOCHS`` main-job epochs only (the policy ``foxhunt train`` makes;
    main entry only). Peer: the host walk (``loop.evaluate_segment``: the host environment
    and one ``q_values`` round trip per bar), one round.
(c) ``train-cli-defaults``: wall time of the subprocess ``foxhunt train --backend fast`` with
    the defaults (``seed`` bf16, 20,000 bars, 2 folds x 3 epochs of 300 steps), after one
    untimed run that warms the kernel cache and Python's bytecode cache (target: at most 3 s);
    ``extra_info`` also has the run's own ``summary.json`` wall time and the sums of its
    epochs' ``train_s`` / ``eval_s``. The one-command entry first times the defaults with
    ``PYTHONDONTWRITEBYTECODE=1`` (``cli_env``: no ``.pyc`` written, as the H200 machine's
    environment sets it; they are still read, so this measures compiling from source only
    where no earlier run wrote them), reported without a target.
(d) ``train-cli-long``: the same for 20 epochs on 60,000 bars (``LONG_RUN_ARGS``: the default
    2 folds x 10 epochs; target: at most 6 s).

Peers: (b) has the fair one (the host walk it replaces, on the same trainer). (a) has none: a
PyTorch main job would need a PyTorch environment and replay, which do not exist; a PyTorch
step fed by the host NumPy environment would measure the host environment, which the device
collection removes (the step-only peers are in ``bench_epoch.py``). (c) and (d) have none: the
reference backend runs the same CLI in minutes to hours on the CPU, which says nothing about
the GPU path.

One command for the lead (prints a table, writes JSON)::

    python benches/bench_main_job.py --out bench_main_job.json
    python benches/bench_main_job.py --out f.json --precisions bf16,f32 --rounds 10

Without a GPU it says so and exits 0. ``test_main_job_plumbing_on_the_cpu_executor`` runs
(a) and (b)'s code on the CPU executor with the ``tiny`` preset (the plumbing, not timings).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from foxhunt.reference import loop, runs
from foxhunt.reference.batch import Batch
from foxhunt.reference.collector import fold_collector
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.jsonio import write_json
from foxhunt.reference.kernels.env import market_tables
from foxhunt.reference.market import SyntheticMarket, feature_warmup, market_features
from foxhunt.reference.metrics import bar_seconds, bars_per_year
from foxhunt.reference.train_cli import SYNTHETIC_FLAGS

PRECISIONS = ("bf16", "f32")
EPOCH_KINDS = ("step-only", "step-upload", "main-job")
#: Bars of the greedy evaluation bench, and the chunk sizes (bars per graph launch) timed.
EVAL_BARS = 10_000
CHUNKS = (32, 64, 128)
#: The evaluator modes timed: ``graph`` (the chunk graphs above) and ``fused`` (one
#: ``greedy_walk`` launch per segment; its chunk size is irrelevant and reported as "fused").
FUSED = "fused"
#: Exploration rate of the timed main-job epochs (both branches of env_act are taken).
EPSILON = 0.5
#: Host batches the ``step-upload`` epoch cycles through.
BATCH_POOL = 8
#: SPEC 11's targets.
TARGETS = {"main_job_ratio": 1.3, "greedy_eval_s": 0.020, "train_defaults_s": 3.0,
           "train_long_s": 6.0}
#: (d): 20 epochs on 60,000 bars: the default 2 folds x 10 epochs.
LONG_RUN_ARGS = ("--bars", "60000", "--epochs", "10")
#: Main-job epochs of the second agent (b) evaluates: the policy `foxhunt train` makes.
TRAINED_EPOCHS = 2
#: Timed rounds: epochs per kind, evaluations per chunk size, CLI runs.
ROUNDS = {"epoch": 5, "eval": 20, "train": 3, "long": 1}


def gpu_available() -> tuple[bool, str]:
    try:
        from foxhunt import fast

        return fast.cuda_available()
    except Exception as exc:  # noqa: BLE001 - the fast package failing to import is "no GPU"
        return False, f"foxhunt.fast unavailable: {exc}"


def _median(values) -> float:
    return float(statistics.median(values))


def _timed(run, rounds: int) -> list[float]:
    """Wall seconds of ``rounds`` calls of ``run`` (each synchronises before it returns)."""
    out = []
    for _ in range(rounds):
        tic = time.perf_counter()
        run()
        out.append(time.perf_counter() - tic)
    return out


class MainJob:
    """A fast trainer (``trainer_cls``: ``foxhunt.fast.Trainer``, or ``CpuTrainer`` for the CPU
    plumbing test) on the default synthetic market, its first fold's collector warmed up, and
    the step-only graph; ``epoch(kind)`` and ``evaluator(chunk)`` are what (a) and (b) time."""

    def __init__(self, trainer_cls, config: DQNConfig, settings: loop.LoopSettings, *,
                 n_bars: int = SYNTHETIC_FLAGS["bars"], eval_bars: int = EVAL_BARS):
        self.config, self.settings, self.eval_bars = config, settings, eval_bars
        self.trainer = trainer_cls(config, seed=settings.seed)
        self.bars = SyntheticMarket.preset("default", seed=settings.seed, n_bars=n_bars).generate()
        windows = loop.choose_windows(config.state_dim)
        self.feats = market_features(self.bars, windows)
        self.warmup = feature_warmup(windows)
        segments = loop.fold_segments(len(self.bars), self.warmup, settings.folds,
                                      settings.val_frac, settings.test_frac)
        self.per_year = bars_per_year(bar_seconds(self.bars.timestamp))
        self.collector = fold_collector(self.trainer, config, self.bars, self.feats,
                                        segments[0].train, settings, 0)
        self.collector.warmup(self.trainer, max(settings.warmup_transitions, config.batch_size))
        self.collector.begin_epoch(EPSILON)
        gen = np.random.default_rng(0)
        self.batches = [Batch.random(config, gen) for _ in range(BATCH_POOL)]
        self._step_only, self._close_step = _step_only(self.trainer)
        self._evaluators: dict[int, object] = {}

    def epoch(self, kind: str):
        """One epoch of ``kind`` (``EPOCH_KINDS``) as a callable; it ends with ``end_epoch()``."""
        steps, trainer = self.settings.steps_per_epoch, self.trainer
        # untimed: a priority update the collector left pending reads the td that the step-only
        # kinds overwrite (``FastCollector.flush``)
        self.collector.flush()

        def step_only():
            for _ in range(steps):
                self._step_only()
                trainer.step_enqueued()
            trainer.end_epoch()

        def step_upload():
            for i in range(steps):
                trainer.step(self.batches[i % len(self.batches)])
            trainer.end_epoch()

        def main_job():
            for _ in range(steps):
                self.collector.cycle_step(trainer)
            trainer.end_epoch()

        return {"step-only": step_only, "step-upload": step_upload, "main-job": main_job}[kind]

    def epochs(self, rounds: int) -> dict:
        """Each kind ``rounds`` times, interleaved (one warm-up round first); medians, ratios."""
        times = {kind: [] for kind in EPOCH_KINDS}
        for r in range(rounds + 1):
            for kind in EPOCH_KINDS:
                seconds = _timed(self.epoch(kind), 1)
                if r:
                    times[kind] += seconds
        med = {kind: _median(t) for kind, t in times.items()}
        return {"epoch_s": med, "all_s": times, "steps": self.settings.steps_per_epoch,
                "main_job_over_step_only": med["main-job"] / med["step-only"],
                "main_job_over_step_upload": med["main-job"] / med["step-upload"]}

    def evaluator(self, chunk):
        """A ``DeviceEvaluator`` with ``chunk`` bars per graph (or ``FUSED``: the one-launch
        ``greedy_walk`` mode), its greedy graphs built."""
        from foxhunt.fast.evaluator import DeviceEvaluator

        if chunk not in self._evaluators:
            kw = {"mode": "fused"} if chunk == FUSED else {"chunk": chunk, "mode": "graph"}
            ev = DeviceEvaluator(self.trainer, market_tables(self.bars, self.feats),
                                 max_steps=self.eval_steps, **kw)
            ev.walk(*self.eval_segment, self.per_year)  # builds begin, chunk and end graphs
            self._evaluators[chunk] = ev
        return self._evaluators[chunk]

    @property
    def eval_steps(self) -> int:
        return min(self.eval_bars, len(self.bars) - self.warmup - 1)

    @property
    def eval_segment(self) -> tuple[int, int]:
        """``[start, stop)`` of ``eval_steps`` steps, from the first full feature row."""
        return self.warmup, self.warmup + self.eval_steps + 1

    def greedy_eval(self, chunks, rounds: int, *, peer: bool) -> dict:
        out = {"bars": self.eval_steps, "chunks": {}}
        for chunk in chunks:
            ev = self.evaluator(chunk)
            times = _timed(lambda: ev.walk(*self.eval_segment, self.per_year), rounds)
            out["chunks"][chunk] = {"median_s": _median(times), "all_s": times,
                                    "nodes": ev.node_counts()}
        held = self.evaluator(chunks[-1])._device.arenas[0].download("walk_rec_held")
        out["position_changes"] = int(np.count_nonzero(np.diff(held[:self.eval_steps, 0])))
        if peer:
            out["host_walk_s"] = _timed(self.host_walk, 1)[0]
        return out

    def host_walk(self):
        """The peer of (b): ``loop.evaluate_segment`` (one ``q_values`` round trip per bar)."""
        return loop.evaluate_segment(self.trainer, self.bars, self.feats, self.config,
                                     self.eval_segment, "greedy", self.per_year)

    def close(self) -> None:
        for ev in self._evaluators.values():
            ev.close()
        self.collector.close()
        self._close_step()
        self.trainer.close()


def _step_only(trainer):
    """``(run, close)``: graphs 1 and 2 of ``trainer`` without the upload, as one graph on the
    trainer's stream (the CPU executor: its ``CpuGraph`` s on the trainer's arena)."""
    from foxhunt.fast.cpu_executor import CpuEngine, CpuGraph, Memory

    engine = trainer.engine
    plans = [trainer.plans["graph1"], trainer.plans["graph2"]]
    if isinstance(engine, CpuEngine):
        mem = Memory([(engine.layout, engine.arena)], {})
        graphs = [CpuGraph(ops, engine.branch_order) for ops in plans]
        return (lambda: [g.replay(mem) for g in graphs]), (lambda: None)
    from foxhunt.fast.graphs import GraphCapture

    graph = GraphCapture(engine.stream, max_branches=0)  # branches come from the pool
    with graph:
        for ops in plans:
            engine.lowering.enqueue(ops, engine.stream, engine.pool)
    return graph.replay, graph.close


# ------------------------------------------------------------------------------ (c), (d)
def cli_env(bytecode: bool) -> dict:
    """The CLI subprocess's environment: this one, with Python's bytecode cache allowed
    (``bytecode``: ``PYTHONDONTWRITEBYTECODE`` removed, as a normal install runs: the warm-up
    run writes the ``.pyc`` files the timed runs read) or forbidden (set to 1: a process
    compiles every module it imports that has no ``.pyc`` yet, about 0.9 s on the H200 machine,
    whose environment sets it)."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if not bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def train_once(extra_args, out_dir: Path, bytecode: bool = True) -> dict:
    """One ``foxhunt train --backend fast`` subprocess; its wall time and what it recorded."""
    cmd = [sys.executable, "-m", "foxhunt.reference.cli", "train", "--backend", "fast",
           "--no-progress", *extra_args, "--out", str(out_dir)]
    tic = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(bytecode))
    wall = time.perf_counter() - tic
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    summary = json.loads((out_dir / runs.SUMMARY_NAME).read_text())
    records = [json.loads(line) for line in
               (out_dir / runs.METRICS_NAME).read_text().splitlines() if line.strip()]
    return {"wall_s": wall, "in_process_s": summary["wall_time_s"], "epochs": len(records),
            "train_s": sum(r["train_s"] for r in records),
            "eval_s": sum(r["eval_s"] for r in records)}


def train_wall(extra_args, rounds: int, bytecode: bool = True) -> dict:
    """``rounds`` timed runs after one untimed run (the kernel cache warm, and with
    ``bytecode`` the ``.pyc`` files written: ``cli_env``)."""
    with tempfile.TemporaryDirectory(prefix="bench_main_job_") as tmp:
        first = train_once(extra_args, Path(tmp) / "warm", bytecode)
        timed = [train_once(extra_args, Path(tmp) / f"run{i}", bytecode) for i in range(rounds)]
    return {"args": list(extra_args), "bytecode": bytecode, "first_run": first, "runs": timed,
            "median_wall_s": _median([r["wall_s"] for r in timed])}


# ------------------------------------------------------------------------------ pytest
_JOBS: dict[str, MainJob] = {}


def _job(trainer_cls, precision: str) -> MainJob:
    if precision not in _JOBS:
        _JOBS[precision] = MainJob(trainer_cls, DQNConfig.preset("seed", precision=precision),
                                   loop.LoopSettings())
    return _JOBS[precision]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", EPOCH_KINDS)
def test_epoch(benchmark, fast_trainer_cls, precision, kind):
    job = _job(fast_trainer_cls, precision)
    benchmark.group = f"main-job-epoch-seed-{precision}"
    benchmark.pedantic(job.epoch(kind), rounds=ROUNDS["epoch"], iterations=1, warmup_rounds=1)
    info = {"impl": f"fast-{kind}", "precision": precision, "unit": "epoch",
            "steps": job.settings.steps_per_epoch}
    if kind == "main-job":  # the ratios, timed interleaved in this same run
        pair = job.epochs(ROUNDS["epoch"])
        info.update({k: pair[k] for k in ("epoch_s", "main_job_over_step_only",
                                          "main_job_over_step_upload")},
                    target_ratio=TARGETS["main_job_ratio"])
    benchmark.extra_info.update(info)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("chunk", (*CHUNKS, FUSED))
def test_greedy_eval(benchmark, fast_trainer_cls, precision, chunk):
    job = _job(fast_trainer_cls, precision)
    ev = job.evaluator(chunk)
    benchmark.group = f"greedy-eval-{EVAL_BARS}-{precision}"
    benchmark.pedantic(lambda: ev.walk(*job.eval_segment, job.per_year), rounds=ROUNDS["eval"],
                       iterations=1, warmup_rounds=1)
    benchmark.extra_info.update({"impl": f"fast-chunk{chunk}", "bars": job.eval_steps,
                                 "nodes": ev.node_counts(), "target_s": TARGETS["greedy_eval_s"]})


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_greedy_eval_host_walk_peer(benchmark, fast_trainer_cls, precision):
    job = _job(fast_trainer_cls, precision)
    benchmark.group = f"greedy-eval-{EVAL_BARS}-{precision}"
    benchmark.pedantic(job.host_walk, rounds=1, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update({"impl": "host-walk (q_values per bar)", "bars": job.eval_steps})


@pytest.mark.gpu
@pytest.mark.parametrize("name, args, rounds", [
    ("defaults", (), ROUNDS["train"]), ("long", LONG_RUN_ARGS, ROUNDS["long"])])
def test_train_cli(benchmark, fast_trainer_cls, tmp_path, name, args, rounds):
    done = []
    count = iter(range(1000))
    benchmark.group = f"train-cli-{name}"
    benchmark.pedantic(lambda: done.append(train_once(args, tmp_path / f"run{next(count)}")),
                       rounds=rounds, iterations=1, warmup_rounds=1)  # warm-up: the kernel cache
    last = done[-1]
    benchmark.extra_info.update({"impl": "foxhunt train --backend fast", "args": list(args),
                                 "target_s": TARGETS[f"train_{name}_s"], **last})


def test_main_job_plumbing_on_the_cpu_executor(tmp_path):
    """(a) and (b)'s code on the CPU executor (``tiny`` preset, a few steps, short walks): every
    epoch kind runs its steps, the device walk equals the host walk (the peer), and the table
    and JSON of the one-command entry are written. Not a timing."""
    from foxhunt.fast.cpu_executor import CpuTrainer

    settings = loop.LoopSettings(steps_per_epoch=3, n_envs=4, warmup_transitions=64,
                                 replay_capacity=256)
    job = MainJob(CpuTrainer, DQNConfig.preset("tiny"), settings, n_bars=700, eval_bars=40)
    try:
        before = job.trainer.step_count
        pair = job.epochs(1)
        assert job.trainer.step_count - before == 2 * len(EPOCH_KINDS) * settings.steps_per_epoch
        assert pair["main_job_over_step_only"] > 0
        ev = job.greedy_eval((8, 32, FUSED), 1, peer=True)
        assert ev["bars"] == 40 and set(ev["chunks"]) == {8, 32, FUSED}
        walk = job.evaluator(8).walk(*job.eval_segment, job.per_year)
        assert walk.metrics[0] == np.float32(job.host_walk()[0].sharpe)
        result = {"precisions": {"f32": {"epochs": pair, "greedy_eval": ev}}}
        text = table(result)
        assert "main-job / step-only" in text and "greedy eval" in text
        write_result(tmp_path / "out.json", result)
        assert json.loads((tmp_path / "out.json").read_text())["precisions"]["f32"]["epochs"]
    finally:
        job.close()


# ------------------------------------------------------------------------------ one command
def _verdict(value: float, target: float) -> str:
    return "ok" if value <= target else "MISSED"


def table(result: dict) -> str:
    """The one-command entry's table: one line per figure, its target and verdict."""
    lines = [f"{'bench':<44} {'value':>12} {'target':>10}  verdict"]

    def row(name, value, unit, target=None):
        shown = f"{value * 1e3:.2f} ms" if unit == "ms" else f"{value:.2f} {unit}"
        goal = "" if target is None else (f"{target * 1e3:.0f} ms" if unit == "ms"
                                          else f"{target:g} {unit}")
        verdict = "" if target is None else _verdict(value, target)
        lines.append(f"{name:<44} {shown:>12} {goal:>10}  {verdict}")

    for precision, res in result.get("precisions", {}).items():
        if "epochs" in res:
            ep = res["epochs"]
            for kind in EPOCH_KINDS:
                row(f"{kind} epoch ({ep['steps']} steps) {precision}", ep["epoch_s"][kind], "ms")
            row(f"main-job / step-only {precision}", ep["main_job_over_step_only"], "x",
                TARGETS["main_job_ratio"])
            row(f"main-job / step-upload {precision}", ep["main_job_over_step_upload"], "x")
        for key, agent in (("greedy_eval", "the epochs' trainer"),
                           ("greedy_eval_trained", f"{TRAINED_EPOCHS} main-job epochs")):
            if key not in res:
                continue
            ev = res[key]
            lines.append(f"greedy eval, {agent}: {ev['position_changes']} position changes "
                         f"in {ev['bars']:,} bars {precision}")
            for chunk, c in ev["chunks"].items():
                row(f"  {ev['bars']:,} bars K={chunk} {precision}", c["median_s"], "ms",
                    TARGETS["greedy_eval_s"])
            if "host_walk_s" in ev:
                row(f"  peer: host walk {ev['bars']:,} bars {precision}", ev["host_walk_s"], "ms")
    for name, key in (("defaults", "train_defaults_s"), ("defaults_no_bytecode", None),
                      ("long", "train_long_s")):
        if name in result.get("train", {}):
            t = result["train"][name]
            cache = "" if t.get("bytecode", True) else ", PYTHONDONTWRITEBYTECODE=1"
            row(f"train --backend fast {' '.join(t['args']) or '(defaults)'}{cache}",
                t["median_wall_s"], "s", TARGETS.get(key))
            last = t["runs"][-1]
            row(f"  in process (summary.json), {last['epochs']} epochs", last["in_process_s"], "s")
            row("  sum of the epochs' train_s", last["train_s"], "s")
            row("  sum of the epochs' eval_s", last["eval_s"], "s")
    return "\n".join(lines)


def write_result(path: Path, result: dict) -> None:
    write_json(path, result)  # atomic: a temporary file in the same directory, then replace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    parser.add_argument("--precisions", default="bf16",
                        help="comma-separated, of bf16,f32 (default bf16)")
    parser.add_argument("--rounds", type=int, default=ROUNDS["epoch"],
                        help=f"timed epochs per kind (default {ROUNDS['epoch']})")
    parser.add_argument("--no-cli", action="store_true", help="skip (c) and (d)")
    parser.add_argument("--no-peer", action="store_true", help="skip the host-walk peer of (b)")
    args = parser.parse_args(argv)
    precisions = [p for p in args.precisions.split(",") if p]
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad:
        parser.error(f"--precisions {args.precisions}: {bad[0]!r} is not allowed; use {PRECISIONS}")
    ok, reason = gpu_available()
    if not ok:
        print(f"bench_main_job: skipped, no GPU ({reason})")
        return 0
    from foxhunt.fast import Trainer

    result: dict = {"targets": TARGETS, "precisions": {}, "train": {}}
    for precision in precisions:
        job = MainJob(Trainer, DQNConfig.preset("seed", precision=precision), loop.LoopSettings())
        try:
            result["precisions"][precision] = {
                "epochs": job.epochs(args.rounds),
                "greedy_eval": job.greedy_eval((*CHUNKS, FUSED), ROUNDS["eval"],
                                               peer=not args.no_peer)}
        finally:
            job.close()
        # The agent `foxhunt train` makes (main-job epochs only), whose walk differs: the
        # epochs' trainer above also stepped on random batches.
        job = MainJob(Trainer, DQNConfig.preset("seed", precision=precision), loop.LoopSettings())
        try:
            for _ in range(TRAINED_EPOCHS):
                job.epoch("main-job")()
            result["precisions"][precision]["greedy_eval_trained"] = job.greedy_eval(
                (FUSED,), ROUNDS["eval"], peer=False)
        finally:
            job.close()
        print(table({"precisions": {precision: result["precisions"][precision]}}), flush=True)
        write_result(args.out, result)  # what is measured so far survives a later failure
    if not args.no_cli:
        # Without bytecode first: PYTHONDONTWRITEBYTECODE stops writing .pyc files, not reading
        # them, so these runs compile foxhunt from source only before any run has written them.
        result["train"]["defaults_no_bytecode"] = train_wall((), ROUNDS["train"], bytecode=False)
        write_result(args.out, result)
        result["train"]["defaults"] = train_wall((), ROUNDS["train"])
        write_result(args.out, result)
        result["train"]["long"] = train_wall(LONG_RUN_ARGS, ROUNDS["long"])
    print(table(result))
    write_result(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
