"""``foxhunt sweep --population``: each configuration's seeds as one population trial (SPEC 12,
issue 24).

A ``PopulationTrial`` is one configuration with all the sweep's seeds, run as ONE command
(``Command.population_argv``: ``foxhunt train --seeds <seeds>``, which with ``--backend fast``
steps every member in lockstep on one GPU population engine, one graph replay per step, and
with ``--backend reference`` trains them one after the other) in ``trials/<id>/``; its members
are ordinary run directories, ``trials/<id>/member<seed>/``. Its output goes to
``logs/<id>.log``.

Results: ``results.jsonl`` keeps one line per configuration and seed, with the keys and the
trial ids of a sweep without ``--population`` (``sweep.expand``'s trials), so the table, the
plot and every reader work unchanged. A member's line comes from the population's
``population.json`` (its status, exit status, error and ``overall``) and the member's
``summary.json`` (its ``wall_time_s``); its ``run_dir`` is the member's directory. A member
``completed`` or ``halted`` keeps that status; ``interrupted``, ``failed`` or never trained is
``failed``, with an ``error``.

A population trial's task returns a *record*: ``{"trial": <its id>, "status", ["error"],
"lines": [a results line per member]}`` (``lines_of`` gives the lines of either kind of
record). Its status is ``completed`` when this attempt's ``population.json`` says
``"completed"`` (every member ran), every member completed or halted and the exit status is
the one that implies (0 all completed, 1 some halted); otherwise ``failed``, and the whole
population is retried once (``sweep.MAX_ATTEMPTS``). ``--resume`` skips a population trial
whose ``population.json`` meets the same test (``done_lines``) and runs any other again, whole,
from nothing: a population is never resumed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from . import jsonio
from .population_cli import POPULATION_NAME, seeds_label
from .sweep import (COMMANDS, RUN_DONE_STATUSES, SweepSpec, Trial, expand, last_line, log_of,
                    read_summary, run_command, run_dir_of, slug, trial_record)

#: The key of a population trial's record that holds its members' results lines.
LINES = "lines"


@dataclass(frozen=True)
class PopulationTrial:
    """One configuration's trials (one per seed, in the sweep's seed order), run as one
    population; ``index`` numbers the configurations."""

    index: int
    members: tuple[Trial, ...]

    @property
    def seeds(self) -> tuple[int, ...]:
        return tuple(t.seed for t in self.members)

    @property
    def overrides(self) -> tuple[tuple[str, Any], ...]:
        return self.members[0].overrides

    @property
    def label(self) -> str:
        return self.members[0].label

    @property
    def trial_id(self) -> str:
        return f"{self.index:03d}-{slug(self.label)}-seeds{seeds_label(self.seeds)}"


def populations(spec: SweepSpec) -> list[PopulationTrial]:
    """``expand(spec)`` grouped by configuration: one population trial per configuration, in
    order (``expand`` is configuration-major, each configuration's trials one per seed)."""
    trials, n = expand(spec), len(spec.seeds)
    return [PopulationTrial(k, tuple(trials[k * n:(k + 1) * n])) for k in range(len(trials) // n)]


# ------------------------------------------------------------------------------ one trial
def run_population(population: PopulationTrial, spec: SweepSpec, sweep_dir: Path, *,
                   attempt: int = 1, on_epoch: Callable[[dict], None] | None = None) -> dict:
    """Run one population trial as a subprocess of this Python (``sweep.run_command``) and
    return its record (module docstring). ``on_epoch`` must be None: a population reports no
    per-epoch metrics to stop it early (``SweepSpec`` refuses ``early_stop`` with it)."""
    if on_epoch is not None:
        raise ValueError("a population trial reports no per-epoch metrics (no early stop)")
    run_dir, log = run_dir_of(sweep_dir, population), log_of(sweep_dir, population)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / POPULATION_NAME).unlink(missing_ok=True)  # the outcome read below must be this attempt's
    tic = time.perf_counter()
    argv = COMMANDS[spec.command].population_argv(population, spec, run_dir)
    returncode = run_command(argv, spec, log, f"attempt {attempt} (population)")
    return outcome(population, run_dir, returncode, attempt, time.perf_counter() - tic,
                   last_line(log))


def read_population(run_dir: Path) -> dict | None:
    """The population's ``population.json``, or None when it is missing or not valid JSON."""
    return jsonio.read_object(Path(run_dir) / POPULATION_NAME)


def _members(population: PopulationTrial, written: dict | None) -> dict[int, dict]:
    """``population.json``'s member entries by seed (empty when it is not this population's)."""
    if written is None or written.get("seeds") != list(population.seeds):
        return {}
    return {m["seed"]: m for m in written.get("members", ())}


def _complete(population: PopulationTrial, written: dict | None) -> bool:
    """Every member ran (``population.json`` says completed) and completed or halted."""
    members = _members(population, written)
    return (written is not None and written.get("status") == "completed"
            and len(members) == len(population.seeds)
            and all(m["status"] in RUN_DONE_STATUSES for m in members.values()))


def member_line(trial: Trial, run_dir: Path, member: Mapping | None, attempt: int | None, *,
                returncode: int | None = None, missing: str = "") -> dict:
    """The results line of one member: from its ``population.json`` entry ``member`` and its
    ``summary.json``; a member with no entry (never trained) failed: ``returncode`` the
    population's, ``missing`` why."""
    if member is None:
        return trial_record(trial, run_dir, status="failed", returncode=returncode, attempts=attempt,
                            wall_time_s=None, overall=None, error=f"not trained: {missing}")
    member_dir = run_dir / member["dir"]
    status = member["status"] if member["status"] in RUN_DONE_STATUSES else "failed"
    fields: dict[str, Any] = {"status": status, "returncode": member["exit_status"],
                              "attempts": attempt,
                              "wall_time_s": (read_summary(member_dir) or {}).get("wall_time_s"),
                              "overall": member["overall"]}
    if status == "failed":
        fields["error"] = (f"exit status {member['exit_status']}, member status {member['status']}"
                           + (f": {member['error']}" if member["error"] else ""))
    return trial_record(trial, member_dir, **fields)


def outcome(population: PopulationTrial, run_dir: Path, returncode: int, attempt: int,
            wall_time_s: float, log_tail: str = "") -> dict:
    """The record of an attempt that ended with ``returncode`` (module docstring);
    ``log_tail``: ``sweep.last_line`` of its log, for the error."""
    written = read_population(run_dir)
    members = _members(population, written)
    record: dict[str, Any] = {"trial": population.trial_id, "status": "failed",
                              "returncode": returncode, "attempts": attempt,
                              "wall_time_s": wall_time_s}
    if _complete(population, written):
        halted = any(m["status"] != "completed" for m in members.values())
        if returncode == int(halted):  # foxhunt train --seeds: 1 when a member halted
            record["status"] = "completed"
    if record["status"] == "failed":
        status = written.get("status") if written else None
        record["error"] = f"exit code {returncode}, population status {status or 'missing'}" + log_tail
    record[LINES] = [member_line(t, run_dir, members.get(t.seed), attempt, returncode=returncode,
                                 missing=record.get("error", "")) for t in population.members]
    return record


def failure(population: PopulationTrial, sweep_dir: Path, attempt: int, error: str) -> dict:
    """The record of a population trial whose task itself failed (its worker died, ...)."""
    run_dir = run_dir_of(sweep_dir, population)
    return {"trial": population.trial_id, "status": "failed", "attempts": attempt, "error": error,
            LINES: [trial_record(t, run_dir, status="failed", attempts=attempt, overall=None,
                                 error=error) for t in population.members]}


def done_lines(sweep_dir: Path, population: PopulationTrial, earlier: Mapping[str, dict]) -> list[dict]:
    """``--resume``: the members' results lines when an earlier invocation finished the
    population (its ``population.json`` passes the test of ``outcome``), each the earlier line
    or, lost in a crash, rebuilt from the files; empty when it is to run again."""
    run_dir = run_dir_of(sweep_dir, population)
    written = read_population(run_dir)
    if not _complete(population, written):
        return []
    members = _members(population, written)
    return [earlier.get(t.trial_id) or member_line(t, run_dir, members[t.seed], None)
            for t in population.members]


# ------------------------------------------------------------------------------ records
def lines_of(record: dict) -> list[dict]:
    """The results lines of a task's record: a population trial's members, or the record."""
    return record[LINES] if LINES in record else [record]


def with_fields(record: dict, fields: Mapping[str, Any]) -> dict:
    """``record`` with ``fields`` added (e.g. where its task ran), to each line of a population
    trial's record too."""
    out = {**record, **fields}
    if LINES in record:
        out[LINES] = [{**line, **fields} for line in record[LINES]]
    return out
