"""``foxhunt sweep``: a grid of trainings (seeds x configurations) on Ray (SPEC 12).

One trial per seed and configuration, each its own ``foxhunt train`` run under the sweep
directory (``reference/sweep.py`` has the plan, one trial and the layout of the directory).
Here: the command line, the Ray engines and the results table and plot.

- ``run_sweep`` starts a local Ray instance (``--num-cpus``, no dashboard) unless one is already
  initialised in this process, or connects to ``--address``; each trial is a Ray task with
  ``num_cpus=threads`` (and ``num_gpus=1/trials_per_gpu`` with ``--backend fast``), a failure
  retried once, each finished trial's line written at once; Ctrl-C (or SIGTERM/SIGHUP)
  cancels the tasks: each stops its run with SIGTERM, so it writes its summary and checkpoint,
  and ``--resume`` continues it.
- ``--early-stop``: the trials are Tune trials instead, each reporting its per-epoch
  validation Sharpe (tailed from ``metrics.jsonl``) to Tune's ASHA scheduler, which stops the
  hopeless ones (status ``early_stopped``).
- ``--population``: one trial per configuration, a population of all the seeds
  (``reference/sweep_population.py``), asking Ray for a whole GPU with ``--backend fast``; its
  task's record holds a results line per seed (``lines_of``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from . import jsonio
from .atomic import open_temporary
from .sweep import (COMMANDS, DEFAULT_TRIALS_PER_GPU, EARLY_STOP_METRIC, MAX_ATTEMPTS, POLL_S,
                    RUN_DONE_STATUSES, STOP_GRACE_S, SweepError, SweepSpec, Trial, expand, is_done,
                    load_results, read_summary, results_path, run_dir_of, run_trial, trial_record)
from .sweep_population import (PopulationTrial, done_lines, lines_of, populations, run_population,
                               with_fields)
from .sweep_population import failure as population_failure

PLAN_NAME = "sweep.json"
PLOT_NAME = "results.png"
#: ASHA's first rung: a trial runs at least this many epochs before it can be stopped.
EARLY_STOP_GRACE_EPOCHS = 2
#: Arguments the sweep gives every trial itself (they may not appear after ``--``).
OWN_TRAIN_ARGS = ("--out", "--seed", "--seeds", "--backend", "--threads", "--resume", "--overwrite",
                  "--no-progress", "--set")


# ------------------------------------------------------------------------------ Ray
def placement() -> dict:
    """Where the calling Ray task runs: its GPU ids, ``CUDA_VISIBLE_DEVICES``, node and host."""
    import socket

    import ray

    return {"gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "node_id": ray.get_runtime_context().get_node_id(), "hostname": socket.gethostname()}


def _trial_task(trial_fn, trial: Trial | PopulationTrial, spec: SweepSpec, sweep_dir: str,
                attempt: int) -> dict:
    """The body of one trial's Ray task: its record, every results line with its placement."""
    # ray.cancel stops a running task through _thread.interrupt_main, which does nothing while
    # SIGINT is ignored, as it is in a sweep started in the background (``nohup ... &``) and so
    # in its Ray workers: let Python handle SIGINT (a KeyboardInterrupt) in the task.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return with_fields(trial_fn(trial, spec, Path(sweep_dir), attempt=attempt), placement())


def _failure(trial: Trial | PopulationTrial, sweep_dir: Path, attempt: int, error: str) -> dict:
    """The record of a trial whose task itself failed (its worker died, ...)."""
    if isinstance(trial, PopulationTrial):
        return population_failure(trial, sweep_dir, attempt, error[:300])
    return trial_record(trial, run_dir_of(sweep_dir, trial), status="failed", attempts=attempt,
                        overall=None, error=error[:300])


def _one_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1].strip() if lines else ''}"


def run_tasks(todo: list, spec: SweepSpec, sweep_dir: Path, trial_fn, on_record, log) -> bool:
    """Every trial of ``todo`` (``Trial`` s or ``PopulationTrial`` s) as a Ray task, a failure
    retried once; ``on_record`` gets each finished trial's record. Ctrl-C cancels the tasks
    (each stops its run with SIGTERM and waits for it) and records what finished meanwhile (a
    task that raised while being cancelled is not recorded: --resume runs it). Returns whether
    it was interrupted."""
    import ray

    task = ray.remote(_trial_task).options(num_cpus=spec.threads, num_gpus=spec.gpus_per_trial,
                                           max_retries=0, name="foxhunt-trial")
    pending: dict[Any, tuple[Trial | PopulationTrial, int]] = {}

    def submit(trial: Trial | PopulationTrial, attempt: int) -> None:
        pending[task.remote(trial_fn, trial, spec, str(sweep_dir), attempt)] = (trial, attempt)

    def collect(ref, stopping: bool) -> None:
        trial, attempt = pending.pop(ref)
        try:
            record = ray.get(ref)
        except ray.exceptions.TaskCancelledError:
            return  # stopped by Ctrl-C before it finished: --resume runs it
        except ray.exceptions.RayError as exc:
            if stopping:  # its task raised while being cancelled (Ray's cancellation can reach
                return  # a task before its run starts, as an error of Ray's): --resume runs it
            record = _failure(trial, sweep_dir, attempt, _one_line(exc))
        if record["status"] == "failed" and not stopping and attempt < MAX_ATTEMPTS:
            log(f"{trial.trial_id}: failed ({record.get('error')}); retrying "
                f"(attempt {attempt + 1} of {MAX_ATTEMPTS})")
            submit(trial, attempt + 1)
        else:
            on_record(record)

    for trial in todo:
        submit(trial, 1)
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            for ref in ready:
                collect(ref, stopping=False)
    except KeyboardInterrupt:
        log(f"interrupted: stopping {len(pending)} trials (they write their summaries; "
            "Ctrl-C again kills them)")
        for ref in pending:
            ray.cancel(ref)
        try:
            ready, late = ray.wait(list(pending), num_returns=len(pending), timeout=STOP_GRACE_S + 10)
        except KeyboardInterrupt:
            ready, late = [], list(pending)
        for ref in late:
            ray.cancel(ref, force=True)
            pending.pop(ref)
        for ref in ready:
            collect(ref, stopping=True)
        return True
    return False


def run_tune(todo: list[Trial], spec: SweepSpec, sweep_dir: Path, trial_fn, on_record, log) -> bool:
    """``--early-stop``: every trial of ``todo`` as a Tune trial under ASHA (validation Sharpe
    per epoch, maximised; a trial runs ``EARLY_STOP_GRACE_EPOCHS`` before it can be stopped).
    A failed run is retried once inside its trial. Returns whether trials are left unfinished
    (Tune stops the experiment on Ctrl-C)."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    by_id = {t.trial_id: t for t in todo}

    def trainable(config: dict) -> None:
        trial, reported, last = by_id[config["trial"]], 0, -math.inf
        for attempt in range(1, MAX_ATTEMPTS + 1):
            seen = 0

            def on_epoch(rec: dict) -> None:
                nonlocal seen, reported, last
                seen += 1
                if seen > reported:  # a retry's first epochs were reported by the first attempt
                    value = rec.get(EARLY_STOP_METRIC)
                    reported, last = seen, -math.inf if value is None else float(value)
                    tune.report({"epoch": reported, EARLY_STOP_METRIC: last})

            record = trial_fn(trial, spec, sweep_dir, attempt=attempt, on_epoch=on_epoch)
            if record["status"] != "failed" or attempt == MAX_ATTEMPTS:
                break
        tune.report({"epoch": reported, EARLY_STOP_METRIC: last,
                     "record": jsonio.dumps({**record, **placement()})})

    finished: set[str] = set()

    class Collect(tune.Callback):
        def on_trial_result(self, iteration, trials, trial, result, **info):
            if "record" in result:
                finished.add(trial.config["trial"])
                on_record(json.loads(result["record"]))

        def on_trial_complete(self, iteration, trials, trial, **info):
            tid = trial.config["trial"]
            if tid not in finished:  # stopped by the scheduler before its run ended
                finished.add(tid)
                last = trial.last_result or {}
                on_record(trial_record(by_id[tid], run_dir_of(sweep_dir, by_id[tid]),
                                       status="early_stopped", overall=None, epochs=last.get("epoch"),
                                       **{EARLY_STOP_METRIC: last.get(EARLY_STOP_METRIC)}))

        def on_trial_error(self, iteration, trials, trial, **info):
            tid = trial.config["trial"]
            finished.add(tid)
            on_record(_failure(by_id[tid], sweep_dir, MAX_ATTEMPTS,
                               f"the Tune trial failed: {trial.error_file}"))

    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    scheduler = ASHAScheduler(time_attr="epoch", metric=EARLY_STOP_METRIC, mode="max",
                              grace_period=EARLY_STOP_GRACE_EPOCHS, max_t=10**6)
    resources = {"cpu": spec.threads, "gpu": spec.gpus_per_trial}
    tuner = tune.Tuner(
        tune.with_resources(trainable, resources),
        param_space={"trial": tune.grid_search(list(by_id))},
        tune_config=tune.TuneConfig(scheduler=scheduler),
        run_config=tune.RunConfig(storage_path=str(Path(sweep_dir).resolve() / "tune"),
                                  name=f"early-stop-{time.strftime('%Y%m%dT%H%M%S')}", verbose=0,
                                  failure_config=tune.FailureConfig(max_failures=0), callbacks=[Collect()]))
    tuner.fit()
    return len(finished) < len(by_id)


def check_fits(spec: SweepSpec) -> None:
    """``SweepError`` when no node of the Ray cluster can hold one trial (Ray would queue its
    tasks forever as infeasible)."""
    import ray

    have = ray.cluster_resources()
    if have.get("CPU", 0) < spec.threads:
        raise SweepError(f"threads={spec.threads}: a trial asks for {spec.threads} CPUs and the Ray "
                         f"cluster has {have.get('CPU', 0):g}; lower --threads (or raise --num-cpus)")
    if have.get("GPU", 0) < spec.gpus_per_trial:
        raise SweepError(f"backend=fast: a trial asks for {spec.gpus_per_trial:g} GPU and the Ray cluster "
                         f"has {have.get('GPU', 0):g} (none that Ray sees); run on a GPU machine or "
                         "cluster, or use --backend reference")


def init_ray(address: str | None, num_cpus: int | None, num_gpus: int | None = None) -> bool:
    """Start a local Ray instance (or connect to ``address``) unless this process already has
    one; returns whether it started one (to shut down after the sweep). ``num_cpus``,
    ``num_gpus``: the local instance's size (None: the machine's; ``num_gpus=1`` on a
    two-GPU machine keeps every trial on GPU 0, as ``benches/bench_sweep_gpus.py`` needs)."""
    import ray

    if ray.is_initialized():
        return False
    if address is None:
        # Not RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper: it makes Ray's
        # processes, this driver included, ignore SIGCHLD, after which every subprocess's exit
        # code reads 0 (a crashed trial looked like exit code 0; seen in the tests). A trial's
        # run dies with its worker through sweep.run_trial's DIE_WITH_PARENT_ENV instead.
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                 logging_level=logging.WARNING)
    elif num_gpus is not None:
        raise SweepError(f"num_gpus={num_gpus}: sizes the local Ray instance; the cluster at "
                         f"{address} has its own GPUs")
    else:
        ray.init(address=address, logging_level=logging.WARNING)
    return True


# ------------------------------------------------------------------------------ the sweep
def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _stop_signals_interrupt() -> dict:
    """SIGTERM and SIGHUP stop the sweep as Ctrl-C does (in the main thread; elsewhere nothing
    changes). Returns the handlers they replace."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}


def write_plan(sweep_dir: Path, spec: SweepSpec) -> None:
    jsonio.write_json(sweep_dir / PLAN_NAME, spec.to_mapping())


def read_plan(sweep_dir: Path) -> SweepSpec:
    path = Path(sweep_dir) / PLAN_NAME
    try:
        data = json.loads(path.read_text())
    except OSError:
        raise SweepError(f"--resume {sweep_dir}: no {PLAN_NAME} there (not a sweep directory)") from None
    except ValueError as exc:
        raise SweepError(f"--resume {sweep_dir}: {PLAN_NAME} is not valid JSON: {exc}") from None
    return SweepSpec.from_mapping(data, str(path))


def _done_before(sweep_dir: Path, unit: Trial | PopulationTrial, earlier: dict[str, dict]) -> list[dict]:
    """``--resume``: the results lines of a trial an earlier invocation finished, each the
    earlier line or, lost in a crash, rebuilt from its run; empty when it is to run."""
    if isinstance(unit, PopulationTrial):
        return done_lines(sweep_dir, unit, earlier)
    if not is_done(sweep_dir, unit, earlier.get(unit.trial_id)):
        return []
    summary = read_summary(run_dir_of(sweep_dir, unit)) or {}
    return [earlier.get(unit.trial_id) or trial_record(
        unit, run_dir_of(sweep_dir, unit), status=summary.get("status"), overall=summary.get("overall"))]


def write_results(sweep_dir: Path, trials: list[Trial], records: dict[str, dict]) -> None:
    """``results.jsonl``: one line per finished trial, in trial order, replaced whole."""
    lines = "".join(jsonio.dumps(records[t.trial_id]) + "\n" for t in trials if t.trial_id in records)
    jsonio.write_text_atomic(results_path(sweep_dir), lines)


def run_sweep(spec: SweepSpec, sweep_dir: Path, *, resume: bool = False, address: str | None = None,
              num_cpus: int | None = None, trial_fn: Callable | None = None,
              log: Callable[[str], None] = print) -> tuple[list[Trial], dict[str, dict], bool]:
    """Run every trial of ``spec`` not yet done in ``sweep_dir``; returns the trials, the results
    lines by trial id (every finished trial, earlier ones included) and whether it was
    interrupted. A new sweep (not ``resume``) writes its plan, ``sweep.json``, first.
    ``trial_fn`` (``run_trial``'s signature; default ``run_trial``, or ``run_population`` with
    ``spec.population``) is what each task runs. With ``spec.population`` a task runs one
    configuration's seeds, and the trials returned are still one per configuration and seed."""
    trial_fn = trial_fn or (run_population if spec.population else run_trial)
    sweep_dir = Path(sweep_dir).resolve()
    if not resume:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        write_plan(sweep_dir, spec)
    trials = expand(spec)
    units = populations(spec) if spec.population else trials
    earlier = load_results(sweep_dir) if resume else {}
    records: dict[str, dict] = {}
    todo = []
    for unit in units:
        lines = _done_before(sweep_dir, unit, earlier)
        records.update((line["trial"], line) for line in lines)
        if not lines:
            todo.append(unit)
    what = (f"{len(units)} population trials (each configuration's {len(spec.seeds)} seeds; "
            f"{len(trials)} runs)" if spec.population else f"{len(trials)} trials")
    gpu = "1" if spec.gpus_per_trial == 1 else f"1/{spec.effective_trials_per_gpu}"
    log(f"foxhunt sweep: {what} ({len(units) - len(todo)} done before), "
        f"{len(todo)} to run; {spec.threads} CPU{'s' if spec.threads > 1 else ''}"
        + (f" and {gpu} GPU" if spec.backend == "fast" else "")
        + f" per trial; output in {sweep_dir}")
    write_results(sweep_dir, trials, records)

    def on_record(record: dict) -> None:
        for line in lines_of(record):
            records[line["trial"]] = line
            log(f"[{len(records)}/{len(trials)}] {trial_line(line, spec.metric_name)}")
        write_results(sweep_dir, trials, records)

    interrupted = False
    if todo:
        started = init_ray(address, num_cpus)
        # After ray.init, which installs its own SIGTERM handler (a stack dump, then exit).
        previous = _stop_signals_interrupt()
        try:
            check_fits(spec)
            engine = run_tune if spec.early_stop else run_tasks
            interrupted = engine(todo, spec, sweep_dir, trial_fn, on_record, log)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if started:
                import ray

                ray.shutdown()
    gather = COMMANDS[spec.command].gather
    for path in gather(sweep_dir, trials) if gather else ():
        log(f"wrote {path}")
    return trials, records, interrupted


# ------------------------------------------------------------------------------ results
def _number(value: Any) -> str:
    return "-" if value is None else f"{value:.4g}"


def trial_line(record: dict, metric: str) -> str:
    where = ", ".join(x for x in (
        f"GPU {','.join(record['gpu_ids'])}" if record.get("gpu_ids") else "",
        record.get("hostname") or "") if x)
    value = (record.get("overall") or {}).get(metric)
    text = f"{record['trial']}: {record['status']}"
    if record["status"] in RUN_DONE_STATUSES:
        text += f", {metric} {_number(value)}"
    if record.get("wall_time_s") is not None:
        text += f" ({record['wall_time_s']:.3g} s{', ' + where if where else ''})"
    return text + (f": {record['error']}" if record.get("error") else "")


def config_stats(trials: list[Trial], records: dict[str, dict], metric: str) -> list[dict]:
    """Per configuration (in order): trials, completed, and the metric's values over its
    completed seeds with their mean, sample standard deviation (n >= 2), min and max."""
    rows: dict[str, dict] = {}
    for t in trials:
        row = rows.setdefault(t.label, {"config": t.label, "trials": 0, "completed": 0, "values": []})
        row["trials"] += 1
        record = records.get(t.trial_id)
        if record and record["status"] == "completed":
            row["completed"] += 1
            value = (record.get("overall") or {}).get(metric)
            if value is not None:
                row["values"].append(float(value))
    for row in rows.values():
        v, n = row["values"], len(row["values"])
        mean = sum(v) / n if n else None
        row.update(mean=mean, min=min(v) if v else None, max=max(v) if v else None,
                   std=math.sqrt(sum((x - mean) ** 2 for x in v) / (n - 1)) if n >= 2 else None)
    return list(rows.values())


def results_table(trials: list[Trial], records: dict[str, dict], metric: str) -> str:
    stats = config_stats(trials, records, metric)
    width = max([len("configuration")] + [len(r["config"]) for r in stats])
    cells = [("configuration", "done", f"{metric} mean", "std", "min", "max")] + [
        (r["config"], f"{r['completed']}/{r['trials']}", *map(_number, (r["mean"], r["std"], r["min"], r["max"])))
        for r in stats]
    lines = [f"{c[0]:<{width}}  {c[1]:>7}  {c[2]:>16}  " + "  ".join(f"{x:>8}" for x in c[3:]) for c in cells]
    bad = [records[t.trial_id] for t in trials
           if records.get(t.trial_id, {}).get("status") not in (None, "completed")]
    lines += [f"  {trial_line(r, metric)}" for r in bad]
    return "\n".join(lines)


def write_plot(path: Path, trials: list[Trial], records: dict[str, dict], metric: str) -> Path:
    """The metric by configuration: each completed seed a point, the mean a bar with +- one
    sample standard deviation over seeds. Written through a temporary file (``os.replace``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = config_stats(trials, records, metric)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(stats) + 2), 4.0))
    for i, row in enumerate(stats):
        if row["values"]:
            ax.bar(i, row["mean"], width=0.6, color="#9ecae1", yerr=row["std"] or 0.0, capsize=4)
            offsets = [0.0] if len(row["values"]) == 1 else [
                -0.15 + 0.3 * k / (len(row["values"]) - 1) for k in range(len(row["values"]))]
            ax.scatter([i + o for o in offsets], row["values"], color="#08519c", zorder=3, s=14)
    ax.set_xticks(range(len(stats)), [r["config"] for r in stats], rotation=30, ha="right")
    ax.axhline(0.0, color="grey", linewidth=0.6)
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} by configuration (points: seeds; bars: mean +- std)")
    fig.tight_layout()
    fd, tmp = open_temporary(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fig.savefig(fh, format="png", dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path


# ------------------------------------------------------------------------------ the command
EPILOG = """\
examples:
  foxhunt sweep --out sweeps/lr --seeds 0-3 --grid lr=1e-3,3e-4 --set epochs=5 -- --preset tiny
  foxhunt sweep --file sweep.toml --out sweeps/s1   (a sweep file: TOML or JSON, below)
  foxhunt sweep --resume sweeps/lr                  (runs only what is missing)
  foxhunt sweep --backend fast --trials-per-gpu 4 --seeds 0-15 --out sweeps/seeds
  foxhunt sweep --backend fast --population --seeds 0-15 --grid lr=1e-3,3e-4 --out sweeps/pop
                                                    (each configuration's seeds: one population)
  foxhunt sweep --address ray://head:10001 ...      (an existing Ray cluster)

sweep file (every key optional; flags override it, --set/--grid add to it):
  command = "train"            # or "longrun": longrun_seeds one per seed x variant
  backend = "reference"
  seeds = "0-3"                # or [0, 1, 2, 3]
  args = ["--preset", "tiny"]  # given to every trial's command as they are
  threads = 1
  metric = "test_sharpe"       # the summary's "overall" key the table and plot report
  population = false           # true: each configuration's seeds as one foxhunt train --seeds
  [set]                        # every trial
  epochs = 5
  [grid]                       # the cartesian product
  lr = [1e-3, 3e-4]
  [[configs]]                  # explicit configurations, crossed with the grid
  gamma = 0.99
"""


def register(sub) -> None:
    p = sub.add_parser("sweep", help="run a grid of trainings (seeds x configurations) on Ray",
                       description=__doc__.splitlines()[0], epilog=EPILOG, allow_abbrev=False,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", dest="sweep_file", type=Path, default=None, metavar="SWEEP_FILE",
                   help="a sweep file (.toml or .json; below)")
    p.add_argument("--out", type=Path, default=None, help="the sweep directory (new or empty)")
    p.add_argument("--resume", type=Path, default=None, metavar="SWEEP_DIR",
                   help="run what is missing in SWEEP_DIR (its plan is its sweep.json)")
    p.add_argument("--command", choices=tuple(COMMANDS), default=None, help="what a trial runs (default train)")
    p.add_argument("--backend", choices=("reference", "fast"), default=None, help="default reference")
    p.add_argument("--seeds", default=None, help="e.g. 0-3 or 0,2,5 (default 0)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="a grid axis (repeatable; values of list settings separated by ';')")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting every trial gets (repeatable)")
    p.add_argument("--threads", type=int, default=None, help="BLAS threads and Ray CPUs per trial (default 1)")
    p.add_argument("--trials-per-gpu", type=int, default=None,
                   help="trials sharing one GPU, --backend fast only (default "
                        f"{DEFAULT_TRIALS_PER_GPU}, measured on an H200)")
    p.add_argument("--metric", default=None, help="the overall metric to report (default test_sharpe)")
    p.add_argument("--early-stop", action="store_true", default=None,
                   help=f"stop hopeless trials (Tune's ASHA on the per-epoch {EARLY_STOP_METRIC})")
    p.add_argument("--population", action="store_true", default=None,
                   help="each configuration's seeds as ONE trial: one foxhunt train --seeds run (a "
                        "population; with --backend fast all members in one graph on a whole GPU); "
                        "results.jsonl still has a line per seed. Needs 2 to 256 seeds; not with "
                        "--trials-per-gpu or --early-stop")
    p.add_argument("--address", default=None, help="an existing Ray cluster (default: a local instance)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray instance (default all)")
    p.add_argument("trial_args", nargs=argparse.REMAINDER,
                   help="after --: arguments for every trial's command (e.g. -- --preset tiny --bars 4000)")
    p.set_defaults(func=cmd_sweep)


def _split_assignment(item: str, flag: str) -> tuple[str, str]:
    key, sep, text = item.partition("=")
    if not sep or not key.strip() or not text.strip():
        raise SweepError(f"{flag} {item!r}: expected key=value, e.g. {flag} lr=3e-4")
    return key.strip(), text.strip()


def read_sweep_file(path: Path) -> dict:
    kind = path.suffix.lower()
    if kind not in (".toml", ".json"):
        raise SweepError(f"sweep file {path}: the name must end in .toml or .json")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise SweepError(f"sweep file {path}: cannot read it: {exc.strerror}") from None
    try:
        if kind == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except ValueError as exc:
        raise SweepError(f"sweep file {path}: not valid {kind[1:].upper()}: {exc}") from None
    if not isinstance(data, dict):
        raise SweepError(f"sweep file {path}: the top level must be a table")
    return data


def spec_from_args(args: argparse.Namespace) -> SweepSpec:
    """The sweep file (if any) with the flags applied over it."""
    data = read_sweep_file(args.sweep_file) if args.sweep_file else {}
    source = f"sweep file {args.sweep_file}" if args.sweep_file else "flags"
    data = dict(data)
    for flag, key in (("command", "command"), ("backend", "backend"), ("threads", "threads"),
                      ("trials_per_gpu", "trials_per_gpu"), ("metric", "metric"), ("early_stop", "early_stop"),
                      ("population", "population")):
        if getattr(args, flag) is not None:
            data[key] = getattr(args, flag)
    if args.seeds is not None:
        data["seeds"] = args.seeds
    command = COMMANDS[data.get("command", "train")] if data.get("command", "train") in COMMANDS else None
    if args.set or args.grid:
        if command is None:
            raise SweepError(f"command={data['command']!r}: allowed values are {', '.join(COMMANDS)}")
        data["set"] = dict(data.get("set") or {})
        data["grid"] = dict(data.get("grid") or {})
        for item in args.set:
            key, text = _split_assignment(item, "--set")
            data["set"][key] = command.typed(key, text, True)
        for item in args.grid:
            key, text = _split_assignment(item, "--grid")
            values = text.split(";" if ";" in text else ",")
            data["grid"][key] = [command.typed(key, v.strip(), True) for v in values]
    if args.trial_args:
        if args.trial_args[0] != "--":
            raise SweepError(f"unexpected argument {args.trial_args[0]!r}: a trial's own arguments go "
                             "after --, e.g. foxhunt sweep --seeds 0-1 -- --preset tiny")
        data["args"] = list(args.trial_args[1:])
    spec = SweepSpec.from_mapping({"workdir": os.getcwd(), **data}, source)
    if spec.command == "train":
        for arg in spec.args:
            if arg.split("=", 1)[0] in OWN_TRAIN_ARGS:
                raise SweepError(f"trial argument {arg}: the sweep sets {arg.split('=', 1)[0]} itself "
                                 "(use --seeds, --backend, --threads, --set)")
    return spec


def cmd_sweep(args: argparse.Namespace) -> int:
    try:
        import ray  # noqa: F401
    except ImportError:
        print("foxhunt sweep: needs Ray: pip install 'foxhunt[distributed]'", file=sys.stderr)
        return 2
    try:
        if args.address is not None and args.num_cpus is not None:
            raise SweepError(f"--num-cpus {args.num_cpus}: sizes the local Ray instance; with "
                             f"--address {args.address} the cluster has its own CPUs")
        if args.resume is not None:
            given = [f"--{k.replace('_', '-')}" for k in ("command", "backend", "seeds", "threads",
                                                          "trials_per_gpu", "metric", "early_stop",
                                                          "population", "out")
                     if getattr(args, k) is not None] + (["--set"] if args.set else []) + (
                     ["--grid"] if args.grid else []) + (["--file"] if args.sweep_file else []) + (
                     ["trial arguments"] if args.trial_args else [])
            if given:
                raise SweepError(f"--resume {args.resume}: the plan comes from its {PLAN_NAME}; "
                                 f"drop {', '.join(given)}")
            sweep_dir, spec = args.resume, read_plan(args.resume)
        else:
            if args.out is None:
                raise SweepError("--out: required (the sweep directory), or --resume SWEEP_DIR")
            spec, sweep_dir = spec_from_args(args), args.out
            if sweep_dir.exists() and (not sweep_dir.is_dir() or any(sweep_dir.iterdir())):
                raise SweepError(f"--out {sweep_dir}: exists and is not an empty directory; choose "
                                 "another, or --resume it if it is a sweep")
    except SweepError as exc:
        print(f"foxhunt sweep: {exc}", file=sys.stderr)
        return 2
    try:
        trials, records, interrupted = run_sweep(spec, sweep_dir, resume=args.resume is not None,
                                                 address=args.address, num_cpus=args.num_cpus)
    except SweepError as exc:
        print(f"foxhunt sweep: {exc}", file=sys.stderr)
        return 2
    metric = spec.metric_name
    print("\n" + results_table(trials, records, metric))
    plot = write_plot(Path(sweep_dir) / PLOT_NAME, trials, records, metric)
    missing = len(trials) - len(records)
    print(f"wrote {results_path(sweep_dir)} ({len(records)} trials) and {plot}")
    if missing:
        print(f"{missing} trials did not finish: foxhunt sweep --resume {shlex.quote(str(sweep_dir))} "
              "runs them")
    if interrupted:
        return 130
    failed = [r for r in records.values() if r["status"] == "failed"]
    return 1 if failed or missing else 0
