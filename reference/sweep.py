"""``foxhunt sweep``: many independent trainings (seeds x configurations) on Ray (SPEC 12).

A sweep is a ``SweepSpec``: a command (``train``: one ``foxhunt train`` run per trial;
``longrun``: one 50-epoch parity run of ``foxhunt.conformance.longrun_seeds``, SPEC 8), the
seeds, the configurations (the cartesian product of ``grid`` times the explicit ``configs``,
each plus the ``common`` overrides) and the resources of one trial. ``expand`` turns it into
``Trial`` s (configuration-major, then seed), each with a stable id that names its directories.

Each trial runs as one Ray task (``num_cpus=threads``; with ``--backend fast`` also
``num_gpus=1/trials_per_gpu``) that starts the command as a subprocess of the same Python, so
a crash or a signal in a trial cannot take the sweep down and Ray's ``CUDA_VISIBLE_DEVICES``
reaches it; BLAS threads are pinned per trial (``BLAS_THREAD_VARS``, and ``foxhunt train
--threads``). A failed trial is retried once (``MAX_ATTEMPTS``); ``halted`` (a NaN or
collapsed-gradient halt) is the configuration's own outcome, deterministic, and not retried.

The sweep directory::

    sweep.json          the plan (``--resume`` reads it back: the same trials, the same ids)
    trials/<id>/        each trial's run directory (``foxhunt train --out``)
    logs/<id>.log       each trial's output, every attempt
    results.jsonl       one line per finished trial, rewritten whole (atomically) as each ends
    results.png         the metric by configuration: every seed a point, mean +- std over seeds

A trial is done when its run directory's ``summary.json`` says ``"completed"`` (or
``"halted"``), or its results line says ``"early_stopped"``; ``--resume`` runs the rest.

With ``population`` (``--population``) each configuration's seeds run as ONE trial, a
``sweep_population.PopulationTrial``: one ``foxhunt train --seeds`` run (a population: in
lockstep on one GPU with ``--backend fast``, one member after the other with ``reference``) in
``trials/<id>/``, its members in ``trials/<id>/member<seed>/``. ``results.jsonl`` still has one
line per configuration and seed (``expand``'s trials), filled from the population's
``population.json`` (``reference/sweep_population.py``).

This module needs no Ray: the plan, one trial (``run_trial``, what each Ray task runs) and the
results. ``sweep_cli`` drives Ray (tasks, or Tune trials with ``--early-stop``).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from . import jsonio
from .cli import DIE_WITH_PARENT_ENV
from .runs import METRICS_NAME, SUMMARY_NAME
from .seeds import MAX_SEEDS, seed_ranges

#: How many times a trial is started before it counts as failed (a failure is retried once).
MAX_ATTEMPTS = 2
#: Seconds a stopped trial (Ctrl-C, a cancelled task) gets to write its summary after SIGTERM.
STOP_GRACE_S = 60.0
#: Seconds between checks of a running trial (its exit, new lines of its metrics).
POLL_S = 0.5
#: Pinned to the trial's ``threads`` in every trial's environment, so parallel trials do not
#: oversubscribe the CPU (read by the BLAS libraries when NumPy loads).
BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
#: A run's ``summary.json`` statuses after which its trial is not run again (``halted``: a NaN
#: or collapsed-gradient halt, the configuration's own deterministic outcome). A trial that
#: ``--early-stop`` stopped is not run again either (its results line says ``early_stopped``).
RUN_DONE_STATUSES = ("completed", "halted")
#: The per-epoch metric that ``--early-stop`` (Tune's ASHA) maximises, a ``metrics.jsonl`` field.
EARLY_STOP_METRIC = "val_sharpe"
BACKENDS = ("reference", "fast")
#: Fast trials sharing one GPU when the sweep does not say: ``benches/bench_sweep.py`` on the
#: H200 (2026-12-01, 8a63a4f; 3-epoch ``seed`` trials, one process each) gave an aggregate
#: 70 / 159 / 221 / 264 steps/s at K = 1 / 2 / 4 / 8 (3.76x at 8; each doubling still gains
#: more than 10%). The trials' loop runs on the host, so K follows the CPU cores as much as the
#: GPU (16 cores there; one CPU per trial by default). Records: .readme/sweep/.
DEFAULT_TRIALS_PER_GPU = 8


class SweepError(ValueError):
    """A mistake the user can fix: one line naming the field, the value and what is allowed."""


# ------------------------------------------------------------------------------ commands
@dataclass(frozen=True)
class Command:
    """How one trial of a kind of sweep runs: ``python argv(...)`` (this Python) writing into
    the trial's run directory, the settings a configuration may give, and how the outcome is
    read."""

    name: str
    #: The metric a sweep of this command reports by default (a key of ``overall``).
    default_metric: str
    #: ``(trial, spec, run_dir, resume) -> [the arguments after "python"]``.
    argv: Callable[..., list[str]]
    #: ``(key, value, text) -> typed value``: a setting of a configuration, checked and typed
    #: (``text``: as written on the command line); ``SweepError`` naming the key otherwise.
    typed: Callable[[str, Any, bool], Any]
    #: ``(run_dir) -> bool``: whether a stopped earlier attempt can be continued.
    resumable: Callable[[Path], bool] = lambda run_dir: False
    #: ``(run_dir, returncode) -> None``: writes ``summary.json`` for commands that do not.
    finish: Callable[[Path, int], None] | None = None
    #: ``(sweep_dir, trials) -> [paths]``: files gathered from the trials after the sweep.
    gather: Callable[[Path, list], list[Path]] | None = None
    #: Whether a run writes ``metrics.jsonl`` epoch by epoch (what ``--early-stop`` reads).
    epoch_metrics: bool = False
    #: ``(population_trial, spec, run_dir) -> [the arguments after "python"]``: one run training
    #: all the seeds of one configuration (``--population``); None: the command has no such form.
    population_argv: Callable[..., list[str]] | None = None


def _train_typed(key: str, value: Any, text: bool) -> Any:
    from .settings_io import resolve, typed_value

    try:
        setting = resolve(key)
        if setting.name == "seed":
            raise SweepError(f"{key}: the sweep's seeds set it (--seeds, or 'seeds' in a sweep file)")
        return typed_value(setting, value, text=text, origin="sweep")
    except SweepError:
        raise
    except ValueError as exc:
        raise SweepError(str(exc)) from None


def _train_argv(trial: "Trial", spec: "SweepSpec", run_dir: Path, resume: bool) -> list[str]:
    if resume:  # the run's own config.json holds its configuration
        return ["-m", "foxhunt.reference.cli", "train", "--resume", str(run_dir), "--threads",
                str(spec.threads), "--no-progress"]
    return _train_new_argv(["--seed", str(trial.seed)], trial.overrides, spec, run_dir)


def _train_population_argv(population, spec: "SweepSpec", run_dir: Path) -> list[str]:
    """``foxhunt train --seeds`` of every seed of ``population`` (a ``PopulationTrial``); a
    population is never resumed: a new attempt starts again from nothing."""
    return _train_new_argv(["--seeds", ",".join(map(str, population.seeds))], population.overrides,
                           spec, run_dir)


def _train_new_argv(seed_args: list[str], overrides, spec: "SweepSpec", run_dir: Path) -> list[str]:
    out = ["-m", "foxhunt.reference.cli", "train", "--out", str(run_dir), "--backend", spec.backend,
           *seed_args, "--threads", str(spec.threads), "--no-progress"]
    if run_dir.is_dir() and any(run_dir.iterdir()):
        out.append("--overwrite")  # a failed attempt's files: start again from nothing
    out += list(spec.args)
    for key, value in overrides:
        out += ["--set", f"{key}={format_value(value)}"]
    return out


def _train_resumable(run_dir: Path) -> bool:
    from .loop import resume_epochs

    try:
        return resume_epochs(run_dir) > 0
    except (ValueError, OSError):
        return False


def _longrun_typed(key: str, value: Any, text: bool) -> Any:
    from foxhunt.conformance.longrun_seeds import VARIANTS

    if key != "variant":
        raise SweepError(f"{key}: a longrun sweep sets only 'variant' ({', '.join(VARIANTS)})")
    if value not in VARIANTS:
        raise SweepError(f"variant={value!r}: allowed values are {', '.join(VARIANTS)}")
    return value


def _longrun_argv(trial: "Trial", spec: "SweepSpec", run_dir: Path, resume: bool) -> list[str]:
    variant = dict(trial.overrides).get("variant", "f32")
    return ["-m", LONGRUN_MODULE, "one", "--variant", variant, "--seed", str(trial.seed),
            "--backend", spec.backend,
            "--record", str(run_dir / LONGRUN_RECORD), *spec.args]


#: The long-run tool (SPEC 8) and what its ``one --record`` writes in the trial's run directory.
LONGRUN_MODULE = "foxhunt.conformance.longrun_seeds"
LONGRUN_RECORD = "record.json"


def _longrun_finish(run_dir: Path, returncode: int) -> None:
    """``longrun_seeds one`` writes ``record.json``; the sweep writes ``summary.json`` from it:
    ``status`` completed, ``overall`` its numbers, ``record`` the record itself."""
    record_path = run_dir / LONGRUN_RECORD
    if returncode != 0 or not record_path.is_file():
        return
    record = json.loads(record_path.read_text())
    overall = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    jsonio.write_json(run_dir / SUMMARY_NAME, {"status": "completed", "overall": overall, "record": record})


def _longrun_gather(sweep_dir: Path, trials: list["Trial"]) -> list[Path]:
    """``SWEEP_DIR/longrun/<variant>.jsonl``: the completed trials' records by variant, in seed
    order, the files ``python -m foxhunt.conformance.longrun_seeds compare`` reads."""
    from foxhunt.conformance.longrun_seeds import variant_file

    by_file: dict[Path, list[dict]] = {}
    for trial in sorted(trials, key=lambda t: t.seed):
        summary = read_summary(run_dir_of(sweep_dir, trial))
        if summary and summary.get("status") == "completed" and "record" in summary:
            record = summary["record"]
            path = variant_file(Path(sweep_dir) / "longrun", dict(trial.overrides).get("variant", "f32"),
                                record.get("backend", "fast"))
            by_file.setdefault(path, []).append(record)
    for path, records in by_file.items():
        path.parent.mkdir(exist_ok=True)
        jsonio.write_text_atomic(path, "".join(jsonio.dumps(r) + "\n" for r in records))
    return sorted(by_file)


COMMANDS: dict[str, Command] = {
    "train": Command("train", "test_sharpe", _train_argv, _train_typed, resumable=_train_resumable,
                     epoch_metrics=True, population_argv=_train_population_argv),
    "longrun": Command("longrun", "final_sharpe", _longrun_argv, _longrun_typed,
                       finish=_longrun_finish, gather=_longrun_gather),
}


# ------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class Trial:
    """One run: a seed and a configuration (``overrides``: the ``common`` ones, then the
    configuration's own, each ``(key, value)``); ``label`` names the configuration."""

    index: int
    seed: int
    overrides: tuple[tuple[str, Any], ...]
    label: str

    @property
    def trial_id(self) -> str:
        return f"{self.index:03d}-{slug(self.label)}-seed{self.seed}"


def slug(label: str) -> str:
    """A configuration's label as part of a directory name."""
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", label)[:80]


@dataclass(frozen=True)
class SweepSpec:
    command: str = "train"
    backend: str = "reference"
    seeds: tuple[int, ...] = (0,)
    #: ``((key, (v1, v2, ...)), ...)``: the cartesian product, in this order.
    grid: tuple[tuple[str, tuple], ...] = ()
    #: Explicit configurations (each a ``((key, value), ...)``), crossed with the grid.
    configs: tuple[tuple[tuple[str, Any], ...], ...] = ()
    #: Overrides every trial gets (``--set``).
    common: tuple[tuple[str, Any], ...] = ()
    #: Arguments given to every trial's command as they are (e.g. ``--preset tiny``).
    args: tuple[str, ...] = ()
    #: BLAS threads and Ray CPUs of one trial.
    threads: int = 1
    #: Trials sharing one GPU (``--backend fast`` only; ``None``: ``DEFAULT_TRIALS_PER_GPU``).
    trials_per_gpu: int | None = None
    #: The ``overall`` key the table and plot report (``None``: the command's default).
    metric: str | None = None
    early_stop: bool = False
    #: Each configuration's seeds as one trial: one population run (``Command.population_argv``),
    #: asking Ray for a whole GPU with ``--backend fast``.
    population: bool = False
    #: The directory trials run in (relative paths in ``args`` are read from there); ``None``:
    #: the Ray worker's. ``foxhunt sweep`` records the directory it was started in.
    workdir: str | None = None

    FIELDS = ("command", "backend", "seeds", "grid", "configs", "set", "args", "threads",
              "trials_per_gpu", "metric", "early_stop", "population", "workdir")

    def __post_init__(self) -> None:
        if self.command not in COMMANDS:
            raise SweepError(f"command={self.command!r}: allowed values are {', '.join(COMMANDS)}")
        if self.backend not in BACKENDS:
            raise SweepError(f"backend={self.backend!r}: allowed values are {', '.join(BACKENDS)}")
        if not self.seeds or any(not _is_int(s) or s < 0 for s in self.seeds):
            raise SweepError(f"seeds={list(self.seeds)!r}: need at least one seed, each an integer >= 0")
        if len(set(self.seeds)) != len(self.seeds):
            raise SweepError(f"seeds={list(self.seeds)!r}: a seed is listed twice")
        if not _is_int(self.threads) or self.threads < 1:
            raise SweepError(f"threads={self.threads!r}: must be an integer >= 1")
        if self.trials_per_gpu is not None:
            if self.backend != "fast":
                raise SweepError(f"trials_per_gpu={self.trials_per_gpu!r}: only with backend 'fast' "
                                 f"(the {self.backend} backend runs on CPUs: use threads)")
            if not _is_int(self.trials_per_gpu) or self.trials_per_gpu < 1:
                raise SweepError(f"trials_per_gpu={self.trials_per_gpu!r}: must be an integer >= 1")
        if self.early_stop and not COMMANDS[self.command].epoch_metrics:
            raise SweepError(f"early_stop: not for command {self.command!r} (its runs report no "
                             "per-epoch metrics.jsonl); use it with 'train'")
        if self.population:
            self._check_population()
        # Every setting checked and typed by the command (e.g. lr=1 becomes 1.0), once, here.
        typed = lambda key, value: COMMANDS[self.command].typed(key, value, False)  # noqa: E731
        common = tuple((k, typed(k, v)) for k, v in self.common)
        grid = tuple((k, tuple(typed(k, v) for v in values)) for k, values in self.grid)
        configs = tuple(tuple((k, typed(k, v)) for k, v in config) for config in self.configs)
        for key, values in grid:
            if not values:
                raise SweepError(f"grid {key}: needs at least one value")
            if len(set(map(format_value, values))) != len(values):
                raise SweepError(f"grid {key}: a value is listed twice ({format_value(values)})")
        owners = [("set", k) for k, _ in common] + [("grid", k) for k, _ in grid]
        owners += [("configs", k) for config in configs for k, _ in config]
        for i, (where, key) in enumerate(owners):
            for other, key2 in owners[:i]:
                if key2 == key and (where, other) != ("configs", "configs"):
                    raise SweepError(f"{key}: given in both {other} and {where}; keep one")
        object.__setattr__(self, "common", common)
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "configs", configs)

    def _check_population(self) -> None:
        from .population_cli import MAX_MEMBERS, MIN_MEMBERS, seeds_label

        if COMMANDS[self.command].population_argv is None:
            raise SweepError(f"population: not for command {self.command!r} (its runs train one "
                             "seed each); use it with 'train'")
        if not MIN_MEMBERS <= len(self.seeds) <= MAX_MEMBERS:
            raise SweepError(f"seeds={seeds_label(self.seeds)}: population needs {MIN_MEMBERS} to "
                             f"{MAX_MEMBERS} seeds (each configuration's seeds train as one "
                             f"foxhunt train --seeds population), not {len(self.seeds)}")
        if self.trials_per_gpu is not None:
            raise SweepError(f"trials_per_gpu={self.trials_per_gpu}: not with population (a "
                             "population trial asks Ray for one whole GPU); drop one of them")
        if self.early_stop:
            raise SweepError("early_stop: not with population (ASHA stops one trial early; a "
                             "population trains its seeds in one run and cannot stop one member)")

    @property
    def metric_name(self) -> str:
        return self.metric or COMMANDS[self.command].default_metric

    @property
    def gpus_per_trial(self) -> float:
        """Ray's GPU request of one trial: a population trial's GPU is its own (its members
        share it in one graph), other fast trials share one ``effective_trials_per_gpu`` ways."""
        if self.backend != "fast":
            return 0.0
        return 1.0 if self.population else 1.0 / self.effective_trials_per_gpu

    @property
    def effective_trials_per_gpu(self) -> int:
        return self.trials_per_gpu or DEFAULT_TRIALS_PER_GPU

    def to_mapping(self) -> dict[str, Any]:
        """The sweep-file form (``from_mapping`` reads it back)."""
        return {"command": self.command, "backend": self.backend, "seeds": list(self.seeds),
                "grid": {k: list(v) for k, v in self.grid}, "configs": [dict(c) for c in self.configs],
                "set": dict(self.common), "args": list(self.args), "threads": self.threads,
                "trials_per_gpu": self.trials_per_gpu, "metric": self.metric, "early_stop": self.early_stop,
                "population": self.population, "workdir": self.workdir}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "sweep file") -> "SweepSpec":
        """A spec from a sweep file's (or ``sweep.json``'s) top-level table; every key optional."""
        unknown = [k for k in data if k not in cls.FIELDS]
        if unknown:
            raise SweepError(f"{source}: unknown key {unknown[0]!r}; allowed keys are {', '.join(cls.FIELDS)}")
        kw: dict[str, Any] = {}
        for key in ("command", "backend", "metric", "workdir"):
            if data.get(key) is not None:
                kw[key] = _expect(data[key], str, key, source)
        if "seeds" in data:
            kw["seeds"] = parse_seeds(data["seeds"], source)
        if "grid" in data:
            grid = _expect(data["grid"], dict, "grid", source)
            kw["grid"] = tuple((k, tuple(_expect(v, list, f"grid.{k}", source))) for k, v in grid.items())
        if "configs" in data:
            configs = _expect(data["configs"], list, "configs", source)
            kw["configs"] = tuple(tuple(_expect(c, dict, "configs[]", source).items()) for c in configs)
        if "set" in data:
            kw["common"] = tuple(_expect(data["set"], dict, "set", source).items())
        if "args" in data:
            args = _expect(data["args"], list, "args", source)
            kw["args"] = tuple(_expect(a, str, "args[]", source) for a in args)
        for key in ("threads", "trials_per_gpu"):
            if key in data and data[key] is not None:
                kw[key] = _expect(data[key], int, key, source)
        for key in ("early_stop", "population"):
            if key in data:
                kw[key] = _expect(data[key], bool, key, source)
        return cls(**kw)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _expect(value: Any, kind: type, key: str, source: str) -> Any:
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise SweepError(f"{source}: {key}={value!r}: expected {'an' if kind is int else 'a'} "
                         f"{ {str: 'string', int: 'integer', bool: 'boolean', list: 'array', dict: 'table'}[kind] }")
    return value


def parse_seeds(value: Any, source: str = "--seeds") -> tuple[int, ...]:
    """``"0-3"``, ``"0,2,5-6"``, ``3`` or ``[0, 1]`` -> the seeds in order."""
    if _is_int(value):
        return (value,)
    if isinstance(value, list) and all(_is_int(v) for v in value):
        return tuple(value)
    if not isinstance(value, str):
        raise SweepError(f"{source}: seeds={value!r}: expected a range like '0-3', a list of "
                         "integers or an integer")
    try:
        return seed_ranges(value, MAX_SEEDS)
    except ValueError as exc:
        raise SweepError(f"{source}: seeds={value!r}: {exc}; expected integers and ranges like "
                         "'0-3' or '0,3'") from None


def format_value(value: Any) -> str:
    """A value as ``--set key=value`` spells it: booleans ``true``/``false``, arrays
    comma-separated (``branches=3,3,2``), numbers as Python prints them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(format_value(v) for v in value)
    return str(value)


def configurations(spec: SweepSpec) -> list[tuple[tuple[str, Any], ...]]:
    """The configurations' own overrides: every grid point crossed with every ``configs`` entry
    (grid keys first, in order); one empty configuration when there are neither."""
    keys = [k for k, _ in spec.grid]
    points = [tuple(zip(keys, values)) for values in itertools.product(*(v for _, v in spec.grid))]
    return [point + tuple(extra) for point in points for extra in (spec.configs or ((),))]


def expand(spec: SweepSpec) -> list[Trial]:
    """Every trial of the sweep: configuration-major, then seed (so the first results cover
    every seed of one configuration)."""
    trials = []
    for config in configurations(spec):
        label = " ".join(f"{k}={format_value(v)}" for k, v in config) or "defaults"
        for seed in spec.seeds:
            trials.append(Trial(len(trials), seed, tuple(spec.common) + config, label))
    return trials


# ------------------------------------------------------------------------------ one trial
def run_dir_of(sweep_dir: Path, trial: Trial) -> Path:
    return Path(sweep_dir) / "trials" / trial.trial_id


def log_of(sweep_dir: Path, trial: Trial) -> Path:
    return Path(sweep_dir) / "logs" / f"{trial.trial_id}.log"


def read_summary(run_dir: Path) -> dict | None:
    """The run's ``summary.json``, or None when it is missing or not valid JSON."""
    return jsonio.read_object(Path(run_dir) / SUMMARY_NAME)


def trial_record(trial: Trial, run_dir: Path, **fields: Any) -> dict:
    """A results line: the trial's identity, then ``fields`` (status, overall, timing, ...)."""
    return {"trial": trial.trial_id, "config": trial.label, "seed": trial.seed,
            "overrides": {k: v for k, v in trial.overrides}, "run_dir": str(run_dir), **fields}


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    """``proc``'s exit code, or None if it is still running after ``timeout`` seconds."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the run writes its summary and plots and exits), then SIGKILL after the grace."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class MetricsTail:
    """New complete lines of a growing JSON-lines file (a running trial's ``metrics.jsonl``)."""

    def __init__(self, path: Path):
        self.path, self.offset = Path(path), 0

    def new(self) -> Iterator[dict]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next call
        self.offset += end
        for line in chunk[:end].decode("utf-8").splitlines():
            if line.strip():
                yield json.loads(line)


def run_trial(trial: Trial, spec: SweepSpec, sweep_dir: Path, *, attempt: int = 1,
              on_epoch: Callable[[dict], None] | None = None) -> dict:
    """Run one trial as a subprocess of this Python (``run_command``) and return its results
    line. ``on_epoch`` gets each new line of the run's ``metrics.jsonl`` while it runs. Status:
    ``completed`` or ``halted`` from the run's ``summary.json`` (written by this attempt),
    otherwise ``failed`` with an ``error`` line (exit code, status, the log's last line).
    """
    command = COMMANDS[spec.command]
    run_dir, log = run_dir_of(sweep_dir, trial), log_of(sweep_dir, trial)
    run_dir.mkdir(parents=True, exist_ok=True)
    resume = command.resumable(run_dir)
    (run_dir / SUMMARY_NAME).unlink(missing_ok=True)  # the outcome read below must be this attempt's
    tic = time.perf_counter()
    returncode = run_command(command.argv(trial, spec, run_dir, resume), spec, log,
                             f"attempt {attempt}{' (resumed)' if resume else ''}",
                             tail=(run_dir / METRICS_NAME, on_epoch) if on_epoch else None)
    if command.finish is not None:
        command.finish(run_dir, returncode)
    summary = read_summary(run_dir) or {}
    status = summary.get("status")
    fields: dict[str, Any] = {"status": status if status in RUN_DONE_STATUSES else "failed",
                              "returncode": returncode, "attempts": attempt,
                              "wall_time_s": time.perf_counter() - tic, "overall": summary.get("overall")}
    if status == "completed" and returncode != 0:
        fields["status"] = "failed"
    if fields["status"] == "failed":
        fields["error"] = f"exit code {returncode}, summary status {status or 'missing'}" + last_line(log)
    return trial_record(trial, run_dir, **fields)


def run_command(args: list[str], spec: SweepSpec, log: Path, header: str, *,
                tail: tuple[Path, Callable[[dict], None]] | None = None) -> int:
    """``python args`` (this Python) with its output appended to ``log`` after a ``# header:``
    line; returns its exit code. BLAS threads pinned to ``spec.threads``, the working directory
    ``spec.workdir``; ``tail``: ``(path, on_line)``, each new line of that JSON-lines file while
    it runs. Any exception here (KeyboardInterrupt from a cancelled Ray task among them) stops
    the subprocess with SIGTERM first."""
    argv = [sys.executable, *args]
    env = {**os.environ, **dict.fromkeys(BLAS_THREAD_VARS, str(spec.threads)),
           DIE_WITH_PARENT_ENV: "1"}  # a worker killed outright takes its run with it
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"# {header}: {shlex.join(argv)}\n")
        out.flush()
        cwd = spec.workdir if spec.workdir and Path(spec.workdir).is_dir() else None
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=cwd)
        lines, on_line = (MetricsTail(tail[0]), tail[1]) if tail else (None, None)
        try:
            while (returncode := _wait(proc, POLL_S)) is None:
                for record in lines.new() if lines else ():
                    on_line(record)
            for record in lines.new() if lines else ():
                on_line(record)
        except BaseException:
            _stop(proc)
            raise
    return returncode


def last_line(log: Path) -> str:
    """``": <the log's last non-blank line>"`` (200 characters at most), or "" for none."""
    lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    return f": {lines[-1].strip()[:200]}" if lines else ""


def is_done(sweep_dir: Path, trial: Trial, record: Mapping | None) -> bool:
    """Whether ``--resume`` skips ``trial``: its run says completed/halted, or its results
    line says it was stopped early."""
    summary = read_summary(run_dir_of(sweep_dir, trial))
    if summary is not None and summary.get("status") in RUN_DONE_STATUSES:
        return True
    return record is not None and record.get("status") == "early_stopped"


# ------------------------------------------------------------------------------ results
def results_path(sweep_dir: Path) -> Path:
    return Path(sweep_dir) / "results.jsonl"


def load_results(sweep_dir: Path) -> dict[str, dict]:
    """The results lines of an earlier invocation, by trial id (empty when there are none)."""
    path = results_path(sweep_dir)
    return {r["trial"]: r for r in jsonio.read_jsonl(path)} if path.is_file() else {}

