"""``foxhunt train``: the main job (SPEC 10).

Trains on the bundled synthetic futures market (or ``--data CSV``), prints a progress bar per
epoch and a per-epoch table, and writes into a run directory (``runs/<UTC time>-seed<N>`` with
``runs/latest`` pointing at it, or ``--out``): ``config.json`` (everything needed to rebuild
the run), ``metrics.jsonl``, checkpoints (the last epoch's with the loop state, for
``--resume``, and each fold's best), PNG plots and ``summary.json``. The table's ``train s``
is an epoch's experience collection and training steps together (one graph per cycle on the
fast backend), ``eval s`` its greedy validation and test walks.

SIGINT (Ctrl-C), SIGTERM and SIGHUP stop the run after the training step in progress: the
epochs that finished stay, the plots and summary are written, and the exit status is
128 + the signal number (130, 143, 129). A second such signal stops at once (the files
written so far are whole: every write is atomic). Exit status 2 is a usage error (one line
on stderr), 1 a run halted by a safety check.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import jsonio, runs, settings_io
from .config import PRECISIONS, PRESETS
from .loop import EpochRecord, LoopSettings, resume_epochs, run
from .market import Bars
from .report import TABLE_HEADER, format_row, run_summary, summary_text
from .run_outputs import DEFAULT_METRICS_HOST, PrometheusGauges, TensorBoardScalars
from .runs import UsageError

#: Flags that set a setting (flag dest -> setting key); they override --config, --set wins.
FLAG_SETTINGS = {"epochs": "loop.epochs", "folds": "loop.folds",
                 "steps_per_epoch": "loop.steps_per_epoch", "seed": "loop.seed",
                 "precision": "config.precision", "n_step": "loop.n_step"}
#: Loop settings whose default depends on the preset (below the config file, flags and --set):
#: n-step transitions (issue 22) for the seed preset.
PRESET_LOOP_DEFAULTS = {"seed": {"loop.n_step": 3}}
#: Flags that choose the data; with --data only --data applies.
SYNTHETIC_FLAGS = {"bars": 20_000, "market": "default"}
#: Flags that make no sense with --resume (the run's config.json decides).
NOT_WITH_RESUME = ("config", "set", "preset", "out", "overwrite", "bars", "market",
                   *FLAG_SETTINGS)
DEFAULT_PRESET = "seed"
DEFAULT_BACKEND = "reference"
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                     if hasattr(signal, name))


# ---------------------------------------------------------------------------------- arguments
def int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is not allowed; must be an integer >= {minimum}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


def _port(text: str) -> int:
    value = int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port; allowed 0..65535 (0: any free port)")
    return value


EPILOG = f"""\
Settings are applied in this order, a later one winning: the preset (--preset), the
--config file (TOML or JSON), the flags (--epochs, --folds, --steps-per-epoch, --seed,
--precision, --n-step), then each --set in order. The seed preset sets n_step=3 (n-step
returns; every other preset keeps the loop default n_step=1). A --set or config-file key is
a field name, or config.<name> / loop.<name>. Every setting, with its default (the seed preset's):
{settings_io.settings_help()}

Exit status: 0 done, 1 halted by a safety check (with --seeds: a member halted or failed),
2 usage error, 128 + signal number when stopped by SIGINT (130), SIGTERM (143) or SIGHUP (129)."""


def register(sub) -> None:
    loop_defaults = LoopSettings()
    p = sub.add_parser("train", help="train on the synthetic market or your CSV bars",
                       description=__doc__.split("\n\n")[1].replace("``", ""), epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to train")
    g.add_argument("--backend", choices=("reference", "fast"), default=None,
                   help=f"reference: NumPy on the CPU; fast: CUDA (default: {DEFAULT_BACKEND}, "
                        "or the run's with --resume)")
    g.add_argument("--preset", choices=tuple(PRESETS), default=None,
                   help=f"network size (default: {DEFAULT_PRESET})")
    g.add_argument("--config", type=Path, metavar="FILE", default=None,
                   help="settings from a TOML or JSON file (default: none)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="set one setting, e.g. --set lr=3e-4 --set branches=3,3,2 (repeatable)")
    g.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="GEMM precision (default: the preset's, bf16)")
    g.add_argument("--epochs", metavar="N", type=int_at_least(1), default=None,
                   help=f"epochs per fold (default: {loop_defaults.epochs})")
    g.add_argument("--folds", metavar="N", type=int_at_least(1), default=None,
                   help=f"walk-forward folds (default: {loop_defaults.folds})")
    g.add_argument("--steps-per-epoch", metavar="N", type=int_at_least(1), default=None,
                   help=f"training steps per epoch (default: {loop_defaults.steps_per_epoch})")
    g.add_argument("--seed", metavar="N", type=int_at_least(0), default=None,
                   help=f"seed of the network, exploration and synthetic market "
                        f"(default: {loop_defaults.seed})")
    from .population_cli import add_seeds_argument  # it imports this module: import it late

    add_seeds_argument(g)
    g.add_argument("--n-step", metavar="N", type=int_at_least(1), default=None,
                   help="environment steps per transition (n-step returns, at most 16; default: "
                        f"{PRESET_LOOP_DEFAULTS['seed']['loop.n_step']} for the seed preset, "
                        f"else {loop_defaults.n_step})")
    g = p.add_argument_group("data")
    g.add_argument("--data", type=Path, default=None, metavar="CSV",
                   help="OHLCV CSV (UTF-8, optionally gzipped) instead of the synthetic market")
    g.add_argument("--bars", metavar="N", type=int_at_least(2), default=None,
                   help=f"synthetic bars (default: {SYNTHETIC_FLAGS['bars']}; not with --data)")
    g.add_argument("--market", choices=runs.MARKETS, default=None,
                   help=f"synthetic market (default: {SYNTHETIC_FLAGS['market']}; not with --data)")
    g = p.add_argument_group("run directory")
    g.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help=f"run directory (default: a new {runs.RUNS_ROOT}/<UTC time>-seed<N>, "
                        f"with {runs.RUNS_ROOT}/{runs.LATEST} pointing at it); must be new or empty")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the run in a non-empty --out (its files are deleted first)")
    g.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its last finished epoch")
    g = p.add_argument_group("outputs")
    g.add_argument("--threads", metavar="N", type=int_at_least(1), default=1,
                   help="BLAS threads of this run's NumPy (default: %(default)s)")
    g.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                   help="serve Prometheus metrics on this port (default: off; needs foxhunt[metrics])")
    g.add_argument("--metrics-host", default=None, metavar="HOST",
                   help=f"address the metrics server binds (default: {DEFAULT_METRICS_HOST}: "
                        "this machine only; 0.0.0.0: every interface)")
    g.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard scalars to RUN_DIR/tensorboard "
                        "(needs foxhunt[tensorboard])")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)


def _given(args, dest: str) -> bool:
    value = getattr(args, dest)
    return value not in (None, False, [])


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


# ---------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Plan:
    """Everything resolved before anything is written: the run's config, its bars, and the
    run directory to resume (None for a new run)."""

    run: runs.RunConfig
    bars: Bars
    resume_dir: Path | None


def _check_flags(args) -> None:
    if args.metrics_host is not None and args.metrics_port is None:
        raise UsageError("--metrics-host applies only with --metrics-port")
    if args.resume is not None:
        bad = [_flag(d) for d in NOT_WITH_RESUME if _given(args, d)]
        if bad:
            raise UsageError(f"--resume: {', '.join(bad)} {'does' if len(bad) == 1 else 'do'} "
                             f"not apply: the run's {runs.CONFIG_NAME} decides its settings and data")
    elif args.data is not None:
        bad = [_flag(d) for d in SYNTHETIC_FLAGS if _given(args, d)]
        if bad:
            raise UsageError(f"--data: {', '.join(bad)} {'applies' if len(bad) == 1 else 'apply'} "
                             "only to the synthetic market; drop it or drop --data")
    if args.overwrite and args.out is None:
        raise UsageError("--overwrite applies only with --out (a new run directory is always new)")


def _plan_new(args) -> Plan:
    layers = []
    preset = None
    if args.config is not None:
        file = settings_io.read_config_file(args.config)
        preset = file.preset
        layers.append(file.values)
    table = settings_io.all_settings()
    layers.append([(table[key], getattr(args, dest)) for dest, key in FLAG_SETTINGS.items()
                   if getattr(args, dest) is not None])
    layers.append(settings_io.parse_set(args.set))
    preset = args.preset or preset or DEFAULT_PRESET
    layers.insert(0, [(table[key], value) for key, value in PRESET_LOOP_DEFAULTS.get(preset, {}).items()])
    config, settings = settings_io.build(preset, layers)
    if args.data is not None:
        source = runs.csv_source(args.data)
    else:
        source = runs.synthetic_source(args.market or SYNTHETIC_FLAGS["market"],
                                       args.bars or SYNTHETIC_FLAGS["bars"], settings.seed)
    bars = runs.load_bars(source)
    source["sha256"] = runs.bars_sha256(bars)
    _check_folds(config, settings, bars)
    run_config = runs.RunConfig(config=config, settings=settings, data=source,
                                backend=args.backend or DEFAULT_BACKEND, preset=preset,
                                threads=args.threads)
    return Plan(run_config, bars, None)


def _plan_resume(args) -> Plan:
    run_dir = args.resume
    if not run_dir.is_dir():
        raise UsageError(f"--resume {run_dir}: no such run directory")
    recorded = runs.read_run_config(run_dir)
    source = dict(recorded.data)
    if args.data is not None:
        if source["kind"] != "csv":
            raise UsageError(f"--resume {run_dir} --data: the run trained on "
                             f"{runs.describe_source(source)}, not a CSV")
        source["path"] = str(args.data.resolve())
    bars = runs.load_bars(source)
    run_config = runs.RunConfig(config=recorded.config, settings=recorded.settings, data=source,
                                backend=args.backend or recorded.backend, preset=recorded.preset,
                                threads=args.threads)
    return Plan(run_config, bars, run_dir)


def _check_folds(config, settings, bars) -> None:
    """Too few bars for the folds is a usage error before any file is written."""
    from .loop import choose_windows, fold_segments
    from .market import feature_warmup

    try:
        fold_segments(len(bars), feature_warmup(choose_windows(config.state_dim)), settings.folds,
                      settings.val_frac, settings.test_frac)
    except ValueError as exc:
        raise UsageError(f"--folds {settings.folds}: {exc}") from None


def _check_backend(name: str) -> None:
    if name == "fast":
        from .cli import cuda_status

        ok, reason = cuda_status()
        if not ok:
            raise UsageError(f"--backend fast needs an NVIDIA GPU with CUDA, and this machine has "
                             f"none usable ({reason}); use --backend reference")


def refuse(exc: Exception, sinks, lock) -> int:
    """A usage error before training starts: close ``sinks``, release ``lock`` (if any), print
    the one line on stderr; exit code 2."""
    for sink in sinks:
        sink.close()
    if lock is not None:
        lock.release()
    print(f"foxhunt train: {exc}", file=sys.stderr)
    return 2


def _open_run_dir(args, plan: Plan, name_seed=None):
    """(run dir, its lock): created, checked, cleared for --overwrite; UsageError otherwise.
    A new directory is named after ``name_seed`` (``runs.new_run_dir``), default the run's seed."""
    if plan.resume_dir is not None:
        run_dir = plan.resume_dir
        lock = runs.lock_run_dir(run_dir)
        return run_dir, lock
    if args.out is None:
        run_dir = runs.new_run_dir(runs.RUNS_ROOT, plan.run.settings.seed if name_seed is None
                                   else name_seed)
        lock = runs.lock_run_dir(run_dir)
        if not runs.point_latest(runs.RUNS_ROOT, run_dir):
            print(f"foxhunt train: note: {runs.RUNS_ROOT / runs.LATEST} is not a symlink "
                  "(an older foxhunt's run?); left as it is", file=sys.stderr)
        return run_dir, lock
    run_dir = runs.check_out_dir(args.out, overwrite=args.overwrite, resume=False)
    lock = runs.lock_run_dir(run_dir)
    if args.overwrite:
        runs.clear_run_dir(run_dir)
    return run_dir, lock


# ---------------------------------------------------------------------------------- signals
class StopRequest:
    """``should_stop`` for the loop: set by SIGINT / SIGTERM / SIGHUP. The handler only records
    the signal (printing from a handler can re-enter a half-written stderr); a second signal
    restores the default action and re-sends itself, stopping the process at once."""

    def __init__(self):
        self.signum: int | None = None
        self._announced = False

    def handle(self, signum, frame) -> None:
        if self.signum is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum

    def __call__(self) -> bool:
        if self.signum is not None and not self._announced:
            self._announced = True
            print(f"\nfoxhunt train: {signal.Signals(self.signum).name}: stopping; writing the "
                  "summary and plots (send it again to stop at once)", file=sys.stderr, flush=True)
        return self.signum is not None

    @contextlib.contextmanager
    def installed(self):
        previous = {s: signal.signal(s, self.handle) for s in STOP_SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


# ---------------------------------------------------------------------------------- the command
def cmd_train(args: argparse.Namespace) -> int:
    sinks: list = []
    lock = None
    if args.backend == "fast":  # the device's set-up overlaps the data (fast.prewarm)
        from foxhunt.fast.prewarm import start

        start()
    if args.seeds is not None:  # a population: each member a run of this module's _train
        from .population_cli import cmd_train_population

        return cmd_train_population(args)
    try:
        _check_flags(args)
        plan = _plan_resume(args) if args.resume is not None else _plan_new(args)
        _check_backend(plan.run.backend)
        if args.metrics_port is not None:
            sinks.append(PrometheusGauges(args.metrics_port, args.metrics_host or DEFAULT_METRICS_HOST,
                                          seed=plan.run.settings.seed))
        if args.tensorboard:
            TensorBoardScalars.writer_class()  # missing: say so before a run directory exists
        run_dir, lock = _open_run_dir(args, plan)
        done_epochs = 0
        if plan.resume_dir is not None:
            done_epochs = _prepare_resume(run_dir)
        else:
            runs.write_run_config(run_dir, plan.run)
        if args.tensorboard:
            sinks.append(TensorBoardScalars(run_dir / "tensorboard"))
    except ValueError as exc:  # UsageError, and the settings' own one-line validation errors
        return refuse(exc, sinks, lock)
    try:
        return _train(args, plan, run_dir, done_epochs, sinks)
    finally:
        for sink in sinks:
            sink.close()
        lock.release()


def _prepare_resume(run_dir: Path) -> int:
    """Cut ``metrics.jsonl`` back to the epochs the resume state holds; returns that count."""
    try:
        n = resume_epochs(run_dir)
    except (ValueError, OSError) as exc:
        raise UsageError(f"--resume {run_dir}: {exc}") from None
    runs.truncate_lines(run_dir / runs.METRICS_NAME, n)
    return n


def _train(args, plan: Plan, run_dir: Path, done_epochs: int, sinks: list, *, trainer=None,
           stop: StopRequest | None = None, plotter=None) -> int:
    """The run (``loop.run``), its table, plots and summary. A population member in lockstep
    (``population_runner``) runs this in a thread of its own with its ``trainer``, the main
    thread's ``stop`` (signal handlers are the main thread's) and the shared ``plotter``."""
    from threadpoolctl import threadpool_limits

    from .plot_worker import PlotWorkers

    rc, settings, config = plan.run, plan.run.settings, plan.run.config
    metrics_path = run_dir / runs.METRICS_NAME
    metrics_path.touch()
    print(f"foxhunt train: backend={rc.backend} preset={rc.preset} precision={config.precision} "
          f"B={config.batch_size} folds={settings.folds} epochs/fold={settings.epochs} "
          f"steps/epoch={settings.steps_per_epoch} threads={args.threads}\n"
          f"  data: {runs.describe_source(rc.data)}\n  run directory: {run_dir}")
    for sink in sinks:
        if isinstance(sink, PrometheusGauges):
            host, port = sink.address
            print(f"  metrics: http://{host}:{port}/metrics")
    if done_epochs:
        print(f"  resuming after {done_epochs} finished epoch(s)")

    progress = None
    show = not args.no_progress and sys.stderr.isatty()

    started = False

    def on_epoch_start(fold, epoch):
        nonlocal progress, started
        started = True
        if show:
            from tqdm import tqdm

            progress = tqdm(total=settings.steps_per_epoch, desc=f"F{fold} E{epoch}", leave=False,
                            unit="step", dynamic_ncols=True)

    def on_step(i, scalars):
        if progress is not None:
            progress.update(1)
            if scalars.fresh or i == 0:
                progress.set_postfix(loss=f"{scalars.loss:.4f}", grad=f"{scalars.grad_norm:.3f}")
        if scalars.fresh:
            for sink in sinks:
                sink.step(scalars)

    header_printed = False

    def on_epoch(rec: EpochRecord):
        nonlocal header_printed, progress
        if progress is not None:
            progress.close()
            progress = None
        if not header_printed:
            print(TABLE_HEADER)
            header_printed = True
        print(format_row(rec), flush=True)
        jsonio.append_jsonl(metrics_path, asdict(rec))
        for sink in sinks:
            sink.epoch(rec)

    own_stop, stop = stop is None, StopRequest() if stop is None else stop
    git = _in_background(runs.git_commit)  # three git commands: they run while the run trains
    tic = time.perf_counter()
    # The plot workers import matplotlib while the run trains (plot_worker's docstring).
    with stop.installed() if own_stop else contextlib.nullcontext(), \
            threadpool_limits(limits=args.threads, user_api="blas"), \
            PlotWorkers() if plotter is None else contextlib.nullcontext(plotter) as plotter:
        try:
            result = run(config, plan.bars, settings, backend=rc.backend, out_dir=run_dir,
                         on_step=on_step, on_epoch=on_epoch, on_epoch_start=on_epoch_start,
                         should_stop=stop, resume=plan.resume_dir is not None, trainer=trainer)
        except ValueError as exc:
            if started:  # a ValueError once training runs is a bug: keep its traceback
                raise
            # What the loop refuses before it starts (e.g. a resume state that is not this
            # run's) is the user's to fix, like any other usage error.
            print(f"foxhunt train: {exc}", file=sys.stderr)
            return 2
        if progress is not None:
            progress.close()
        plots = plotter.write(run_dir, result)
        summary = _summary(rc, result, plots, time.perf_counter() - tic, stop.signum, git())
        jsonio.write_json(run_dir / runs.SUMMARY_NAME, summary)
    print(f"\n{summary_text(result)}")
    if result.halted:
        print(f"HALTED: {result.halted}")
    if result.interrupted:
        print("interrupted: kept the epochs that finished")
    print(f"wrote {metrics_path}, {len(plots)} plots, checkpoints in {run_dir / 'checkpoints'}, "
          f"{run_dir / runs.SUMMARY_NAME} ({summary['wall_time_s']:.0f} s)")
    if result.interrupted:
        return 128 + (stop.signum or signal.SIGINT)
    return 1 if result.halted else 0


def _in_background(fn):
    """Start ``fn()`` on a thread now; returns a function that joins it and returns its value
    (``fn`` must not raise: ``runs.git_commit`` answers None for every failure)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()), name=f"foxhunt-{fn.__name__}",
                              daemon=True)
    thread.start()

    def result():
        thread.join()
        return out[0] if out else None
    return result


def _summary(rc: runs.RunConfig, result, plots, wall_time_s: float, signum: int | None,
             git: dict | None) -> dict:
    """``summary.json``: the run's provenance (``git``: ``runs.git_commit()``) and settings,
    then ``report.run_summary`` (status, per-fold and overall metrics at the validation-chosen
    epochs)."""
    return {
        "foxhunt_version": runs.foxhunt_version(),
        "git": git,
        "backend": rc.backend, "preset": rc.preset, "seed": rc.settings.seed,
        "threads": rc.threads,
        "config": rc.config.to_dict(), "loop": asdict(rc.settings), "data": rc.data,
        "stopped_by": signal.Signals(signum).name if signum else None,
        "wall_time_s": wall_time_s,
        "plots": [str(p) for p in plots],
        **run_summary(result),
    }
