"""``foxhunt train --seeds SPEC``: a population of main jobs and its spread (SPEC 12, issue 24).

Each member is one ``foxhunt train`` run with the population's settings but its own ``seed``,
trained by the one-run code path (``train_cli._train``: the loop, the per-epoch table, the
plots, the report and the writers) into ``RUN_DIR/member<seed>/``, a run directory like any
other: ``config.json``, ``metrics.jsonl``, checkpoints (loadable by either backend), plots
and ``summary.json``; ``foxhunt train --resume RUN_DIR/member<seed>`` continues one member.

**How the members train.** ``--backend reference``: one after the other. ``--backend fast``:
in lockstep on one ``foxhunt.fast.population.Population`` (all members stepped by one graph
replay per step; ``population_runner``): each member's run goes in a thread of its own, and
one population step takes one batch of every member still running. The command, its files
and its report are the same either way. While members run in lockstep, each line they print
(their tables, messages, tracebacks) starts with ``[seed <seed>]``.

**Same bars.** A single run's synthetic market takes the run's seed; a population's market is
built once, from the first listed seed, and every member trains on those bars (each member's
``config.json`` records that source and the bars' SHA-256). A CSV is the CSV.

**population.json** (``RUN_DIR/population.json``, written atomically after every member, or
once all have ended when they train in lockstep):
``status`` ("completed": every member ran; "partial": stopped by a signal, with
``stopped_by`` and ``not_run``), ``seeds``, ``market_seed`` (None for a CSV), ``data``, and per
member started: ``seed``, ``dir``, ``status`` (its summary's "completed" / "halted" /
"interrupted", or "failed" when it raised), ``exit_status``, ``error`` (the one-line reason of
a failed or halted member) and ``overall`` (its ``summary.json``'s ``overall`` as written there:
``test_<metric>``, ``val_<metric>`` and the test baselines, ``report.overall``). ``spread``: per
``overall`` key, over the completed members whose value is finite: ``n``, ``mean``, ``std``
(sample standard deviation, n - 1 in the denominator; None for n < 2), ``min``, ``median``,
``max`` (all None for n = 0).

Exit status: 0 every member completed; 1 a member failed (raised) or was halted by a safety
check (the others still run); 2 a usage error (one line, nothing written); 128 + the signal
number when SIGINT / SIGTERM / SIGHUP stopped it: the member in progress (in lockstep: every
member) stops as a single run does (its summary and plots written; a signal after its last step
lets it complete), no other member starts, and population.json is written, marked partial.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import signal
import statistics
import traceback
from pathlib import Path

from . import jsonio, population_runner, runs, train_cli
from .seeds import seed_ranges
from .metrics import METRIC_NAMES
from .report import format_metrics_row, metrics_header, signed_number
from .run_outputs import DEFAULT_METRICS_HOST, PrometheusGauges, TensorBoardScalars
from .runs import UsageError

POPULATION_NAME = "population.json"
#: ``population.json`` format version (bumped when a key changes meaning).
POPULATION_FORMAT = 1
MIN_MEMBERS, MAX_MEMBERS = 2, 256
#: The spread's statistics, in the table's row order.
SPREAD_STATS = ("mean", "std", "min", "median", "max")
#: The segment of the table's metric columns (all of ``METRIC_NAMES``) and of its last column.
TABLE_SEGMENT, TABLE_LAST = "test", ("val", "sharpe")
SEEDS_RULE = (f"allowed: seeds and inclusive ranges separated by commas (0-15, 0,3,7, 0-3,8), "
              f"each an integer >= 0, no seed twice, {MIN_MEMBERS} to {MAX_MEMBERS} members")


def add_seeds_argument(group) -> None:
    group.add_argument(
        "--seeds", metavar="SPEC", default=None,
        help="train a population: one run per seed (e.g. 0-15, 0,3,7 or 0-3,8; 2 to "
             f"{MAX_MEMBERS} seeds), one after the other (reference backend) or in lockstep on "
             "one GPU population (fast backend), into RUN_DIR/member<seed>/, then "
             f"RUN_DIR/{POPULATION_NAME} and a table of each member and the spread. Every "
             "member trains on the same bars: the synthetic market is built from the first "
             "listed seed. Not with --seed or --resume")


# ---------------------------------------------------------------------------------- the seeds
def parse_seed_spec(text: str) -> tuple[int, ...]:
    """``"0-3,8"`` -> ``(0, 1, 2, 3, 8)``, in the order written; ``UsageError`` (one line naming
    ``--seeds``, the value and ``SEEDS_RULE``) for anything else. A range is counted before it
    is expanded, so ``0-999999999`` is refused at once."""
    def bad(why: str) -> UsageError:
        return UsageError(f"--seeds {text!r}: {why}; {SEEDS_RULE}")

    try:
        seeds = list(seed_ranges(text, MAX_MEMBERS))
    except ValueError as exc:
        raise bad(str(exc)) from None
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise bad(f"seed {twice[0]} is listed twice")
    if len(seeds) < MIN_MEMBERS:
        raise bad(f"{len(seeds)} member; a population needs at least {MIN_MEMBERS}")
    return tuple(seeds)


def seeds_label(seeds) -> str:
    """The seeds as ranges (``0-3,8``): the default population directory's name."""
    parts, start = [], 0
    for i in range(1, len(seeds) + 1):
        if i == len(seeds) or seeds[i] != seeds[i - 1] + 1:
            parts.append(str(seeds[start]) if i - 1 == start else f"{seeds[start]}-{seeds[i - 1]}")
            start = i
    label = ",".join(parts)
    return label if len(label) <= 40 else f"{seeds[0]}..{seeds[-1]}-n{len(seeds)}"


# ---------------------------------------------------------------------------------- the plan
def _check_population_flags(args) -> None:
    if args.seed is not None:
        raise UsageError(f"--seeds {args.seeds} --seed {args.seed}: give one of them "
                         "(each member's seed is its own)")
    if args.resume is not None:
        raise UsageError(f"--seeds --resume {args.resume}: a population is not resumed as a whole; "
                         f"resume one member with --resume {args.resume}/member<seed>")
    if any(setting.key == "loop.seed" for setting, _ in train_cli.settings_io.parse_set(args.set)):
        raise UsageError(f"--seeds {args.seeds}: --set seed=... does not apply "
                         "(each member's seed is its own)")


def member_plans(base: train_cli.Plan, seeds) -> list[train_cli.Plan]:
    """Each member's plan: ``base`` with ``loop.seed`` = the member's seed, on ``base``'s bars."""
    return [train_cli.Plan(dataclasses.replace(
        base.run, settings=dataclasses.replace(base.run.settings, seed=seed)), base.bars, None)
        for seed in seeds]


# ---------------------------------------------------------------------------------- the command
def fast_population(config, seeds, **kwargs):
    """``foxhunt.fast.population.Population(config, seeds, **kwargs)``, imported only when a
    run asks for it (the GPU)."""
    from foxhunt.fast.population import Population

    return Population(config, seeds, **kwargs)


def cmd_train_population(args: argparse.Namespace, population_factory=None) -> int:
    """``foxhunt train --seeds SPEC``: everything checked before anything is written, as
    ``train_cli.cmd_train`` does; then the members: in lockstep on ``fast_population`` with
    ``--backend fast``, one after the other with ``--backend reference``.

    ``population_factory`` (tests: the lockstep path on the CPU, with the reference twin or
    ``CpuPopulation``): ``(config, seeds, **n_step) -> population``; given, the members train in
    lockstep on its population whatever the backend (``_train_lockstep``)."""
    shared_sinks: list = []
    lock = None
    try:
        seeds = parse_seed_spec(args.seeds)
        _check_population_flags(args)
        train_cli._check_flags(args)
        # The first seed builds the market (and is member 0's own seed).
        base = train_cli._plan_new(argparse.Namespace(**{**vars(args), "seed": seeds[0]}))
        plans = member_plans(base, seeds)
        train_cli._check_backend(base.run.backend)
        if args.metrics_port is not None:
            # One server; each member writes under its own seed label (train_member).
            shared_sinks.append(PrometheusGauges(args.metrics_port,
                                                 args.metrics_host or DEFAULT_METRICS_HOST,
                                                 seed=seeds[0]))
        if args.tensorboard:
            TensorBoardScalars.writer_class()  # missing: say so before a directory exists
        # "s" + label: new_run_dir names it "<UTC time>-seeds0-15".
        pop_dir, lock = train_cli._open_run_dir(args, base, name_seed=f"s{seeds_label(seeds)}")
    except ValueError as exc:  # UsageError, and the settings' own one-line validation errors
        return train_cli.refuse(exc, shared_sinks, lock)
    if population_factory is None and base.run.backend == "fast":
        population_factory = fast_population
    try:
        if population_factory is not None:
            return _train_lockstep(args, plans, pop_dir, shared_sinks, population_factory)
        return _train_population(args, plans, pop_dir, shared_sinks)
    finally:
        for sink in shared_sinks:
            sink.close()
        lock.release()


def train_member(args, plan: train_cli.Plan, member_dir: Path, shared_sinks: list,
                 **hosted) -> int:
    """One member: a new run directory, its ``config.json``, then ``train_cli._train`` (the
    one-run path; ``hosted``: its ``trainer``, ``stop`` and ``plotter`` keywords, for a member
    in lockstep); returns its exit status. Exceptions propagate to the caller."""
    member_dir.mkdir()
    lock = runs.lock_run_dir(member_dir)
    own: list = []
    try:
        runs.write_run_config(member_dir, plan.run)
        if args.tensorboard:
            own.append(TensorBoardScalars(member_dir / "tensorboard"))
        shared = [sink.member(plan.run.settings.seed) if isinstance(sink, PrometheusGauges) else sink
                  for sink in shared_sinks]
        return train_cli._train(args, plan, member_dir, 0, [*shared, *own], **hosted)
    finally:
        for sink in own:
            sink.close()
        lock.release()


def _announce(plans: list, pop_dir: Path, how: str) -> None:
    seeds, data = [p.run.settings.seed for p in plans], plans[0].run.data
    print(f"foxhunt train: a population of {len(seeds)} members (seeds {seeds_label(seeds)}), "
          f"trained {how} on the same bars: {runs.describe_source(data)}"
          f"{' (the first seed builds the market)' if data['kind'] == 'synthetic' else ''}\n"
          f"  population directory: {pop_dir}")


def _train_population(args, plans: list, pop_dir: Path, shared_sinks: list) -> int:
    """The members one after the other, population.json after each (module docstring)."""
    seeds = [p.run.settings.seed for p in plans]
    _announce(plans, pop_dir, "one after the other")
    members: list[dict] = []
    signum = None
    between = train_cli.StopRequest()  # a signal between members; during one, the member's own
    with between.installed():
        for i, plan in enumerate(plans):
            if between.signum is not None:
                break
            seed = seeds[i]
            print(f"\n=== member {i + 1}/{len(seeds)}: seed {seed} ===", flush=True)
            member_dir = pop_dir / f"member{seed}"
            try:
                code = train_member(args, plan, member_dir, shared_sinks)
            except Exception as exc:  # a bug or a broken machine: report it, run the others
                traceback.print_exc()
                members.append(_failed(seed, member_dir, _one_line(exc)))
            else:
                members.append(_member_record(seed, member_dir, code))
                if members[-1]["stopped_by"]:  # also a signal after its last step: it completed
                    signum = signal.Signals[members[-1]["stopped_by"]]
            signum = signum or between.signum
            _write(pop_dir, plans, members, signum)
            if signum is not None:
                break
        signum = signum or between.signum
    return _finish(pop_dir, plans, members, signum)


def _train_lockstep(args, plans: list, pop_dir: Path, shared_sinks: list,
                    population_factory) -> int:
    """Every member at once, in lockstep on ``population_factory``'s population
    (``population_runner``; built, called and closed in one ``PopulationThread``);
    population.json once they have all ended."""
    from threadpoolctl import threadpool_limits

    seeds = [p.run.settings.seed for p in plans]
    _announce(plans, pop_dir, "in lockstep (one population step: one batch of every member)")
    dirs = [pop_dir / f"member{seed}" for seed in seeds]
    settings, config = plans[0].run.settings, plans[0].run.config
    n_step = {"n_step": settings.n_step} if settings.n_step > 1 else {}  # as loop.run builds one
    stop = train_cli.StopRequest()  # the main thread's handlers; every member's should_stop
    # The members' BLAS limit (each _train sets the same) is set here first, so a member's exit
    # from threadpool_limits restores it, not the process's default, while the others run.
    with stop.installed(), threadpool_limits(limits=args.threads, user_api="blas"), \
            population_runner.SharedPlotWorkers() as plots, \
            population_runner.PopulationThread() as on_population:
        try:
            population = on_population.call(population_factory, config, seeds, **n_step)
        except Exception as exc:  # no member can train: each says why
            traceback.print_exc()
            why = f"the population was not built: {_one_line(exc)}"
            members = [_failed(seed, d, why) for seed, d in zip(seeds, dirs)]
        else:
            try:
                outcomes = population_runner.run_lockstep(
                    population, [functools.partial(_member_job, args, plan, d, shared_sinks, stop,
                                                   plots) for plan, d in zip(plans, dirs)],
                    [f"[seed {seed}] " for seed in seeds], call=on_population.call)
            finally:
                close = getattr(population, "close", None)  # the reference twin holds nothing
                if close is not None:
                    on_population.call(close)
            members = [_failed(seed, d, _one_line(o)) if isinstance(o, BaseException)
                       else _member_record(seed, d, o) for seed, d, o in zip(seeds, dirs, outcomes)]
    return _finish(pop_dir, plans, members, stop.signum)


def _member_job(args, plan, member_dir, shared_sinks, stop, plots, trainer) -> int:
    """A member's run in lockstep (``run_lockstep``'s job): ``train_member`` on ``trainer``."""
    return train_member(args, plan, member_dir, shared_sinks, trainer=trainer, stop=stop,
                        plotter=plots.share())


def _finish(pop_dir: Path, plans: list, members: list[dict], signum: int | None) -> int:
    """population.json, the table and the exit status (module docstring)."""
    seeds = [p.run.settings.seed for p in plans]
    population = _write(pop_dir, plans, members, signum)
    print(f"\n{population_table(population)}")
    partial = population["status"] == "partial"  # only a signal stops a population early
    if partial:
        print(f"stopped by {signal.Signals(signum).name}: {len(members)} of {len(seeds)} "
              "member(s) ran; the population summary is partial")
    print(f"wrote {pop_dir / POPULATION_NAME}")
    if partial:
        return 128 + int(signum)
    return 0 if all(m["status"] == "completed" for m in members) else 1


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _failed(seed: int, member_dir: Path, error: str) -> dict:
    return {"seed": seed, "dir": member_dir.name, "status": "failed", "exit_status": None,
            "error": error, "stopped_by": None, "overall": None, "test_bars": None}


def _member_record(seed: int, member_dir: Path, code: int) -> dict:
    """A member that returned: its summary's status and ``overall`` as written there."""
    path = member_dir / runs.SUMMARY_NAME
    if not path.is_file():  # the loop refused the run before it started (exit status 2)
        return {**_failed(seed, member_dir, f"refused before training (exit status {code}; "
                                            "its message is above)"), "exit_status": code}
    summary = json.loads(path.read_text(encoding="utf-8"))
    return {"seed": seed, "dir": member_dir.name, "status": summary["status"], "exit_status": code,
            "error": summary["halted"], "stopped_by": summary["stopped_by"],
            "overall": summary["overall"],
            "test_bars": sum(f["test"]["bars"] for f in summary["folds"] if f["test"] is not None)}


# ---------------------------------------------------------------------------------- population.json
def spread(values: list) -> dict:
    """``n``, ``mean``, sample ``std`` (None for n < 2), ``min``, ``median``, ``max`` of the
    finite values (None entries, JSON's non-finite, are left out); all None for none."""
    x = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not x:
        return {"n": 0, **{k: None for k in SPREAD_STATS}}
    return {"n": len(x), "mean": statistics.fmean(x),
            "std": statistics.stdev(x) if len(x) >= 2 else None,
            "min": min(x), "median": statistics.median(x), "max": max(x)}


def population_summary(plans: list, members: list[dict], signum: int | None) -> dict:
    """The content of ``population.json`` (module docstring)."""
    seeds = [p.run.settings.seed for p in plans]
    rc, data = plans[0].run, plans[0].run.data
    done = [m for m in members if m["status"] == "completed"]
    keys = list(done[0]["overall"]) if done else []
    return {
        "format": POPULATION_FORMAT, "foxhunt_version": runs.foxhunt_version(),
        "status": "partial" if len(members) < len(seeds) or any(
            m["status"] == "interrupted" for m in members) else "completed",
        "stopped_by": signal.Signals(signum).name if signum else None,
        "seeds": seeds,
        "not_run": seeds[len(members):],
        "market_seed": data["seed"] if data["kind"] == "synthetic" else None,
        "data": data, "backend": rc.backend, "preset": rc.preset,
        "members": members,
        "spread_over": "completed members",
        "spread": {k: spread([m["overall"][k] for m in done]) for k in keys},
    }


def _write(pop_dir: Path, plans: list, members: list[dict], signum: int | None) -> dict:
    population = population_summary(plans, members, signum)
    jsonio.write_json(pop_dir / POPULATION_NAME, population)
    return population


# ---------------------------------------------------------------------------------- the table
def _columns(values: dict) -> tuple[dict, object]:
    """A row's cells from ``overall``-keyed values (``report.overall``'s ``<segment>_<metric>``):
    the ``TABLE_SEGMENT`` metrics as ``format_metrics_row`` takes them, and the last column."""
    cells = {m: values.get(f"{TABLE_SEGMENT}_{m}") for m in METRIC_NAMES}
    return cells, values.get("_".join(TABLE_LAST))


def population_table(population: dict) -> str:
    """One row per member (the single-run report's metrics table, ``format_metrics_row``, of
    its overall test metrics, then its validation Sharpe and, unless completed, its status),
    then one row per spread statistic over the completed members."""
    n_done = sum(m["status"] == "completed" for m in population["members"])
    lines = [f"population: overall {TABLE_SEGMENT} metrics of each member (means over its folds at "
             f"the validation-chosen epochs); spread over {n_done} completed member(s)",
             # metrics_header() opens with the blank label column of format_metrics_row
             "seed" + metrics_header()[len("seed"):] + f" {' '.join(TABLE_LAST):>10}"]
    for m in population["members"]:
        label = f"{m['seed']}"
        if m["overall"] is None:
            lines.append(f"{label:<14} {m['status']}: {m['error']}")
            continue
        cells, last = _columns(m["overall"])
        tail = "" if m["status"] == "completed" else f"  {m['status']}" + (
            f": {m['error']}" if m["error"] else "")
        lines.append(format_metrics_row(label, {**cells, "bars": m["test_bars"]})
                     + f" {signed_number(last):>10}{tail}")
    if population["not_run"]:
        lines.append(f"not run: seeds {seeds_label(population['not_run'])}")
    for stat in SPREAD_STATS:
        cells, last = _columns({k: v[stat] for k, v in population["spread"].items()})
        signed = stat != "std"  # a spread, not a signed value
        lines.append(format_metrics_row(stat, {**cells, "bars": ""}, signed)
                     + f" {signed_number(last, '+.2f' if signed else '.2f'):>10}")
    return "\n".join(line.rstrip() for line in lines)
