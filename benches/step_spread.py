"""How much the fast step's time varies from one trainer instance to the next (GPU).

    python benches/step_spread.py [--preset seed] [--precision bf16] [--instances 3]
                                  [--rounds 2] [--steps 400] [--option NAME ...]
                                  [--switch NAME[,NAME...] ...] [SOURCE ...]

Trainers of the same code and config, built one after the other in one process, step at
different speeds, and an instance's speed drifts: on the H200 (session 34) the core bf16 step's
``Trainer.step`` took 101.8, 100.6 and 100.3 us a step in three instances, f32 134.5, 132.7 and
132.5 us, and a spread of that size came back call after call. A comparison of one instance per
side cannot resolve 2-4 us, which is the size of the levers issue 26 has left; this tool is the
comparison with several instances per side and several rounds per instance.

For each step variant (SOURCE, as ``critical_path.py``'s) it builds ``--instances`` trainers of
each arm: ``default`` and, per ``--option NAME``, the trainer with that boolean keyword option
on (``Trainer(config, NAME=True)``: ``fused_trunk``, ...), and per ``--switch NAME[,NAME...]``
the trainer built with those plan switches of ``fast.step_program`` on the other side of their
default (``plan_switches()``: ``FUSE_AUX_TRUNK_GRAD`` off, ``FUSE_HEAD_OUTPUTS`` with f32, ...;
the arm is named by ``NAME=value`` joined with ``+``; the module's values are restored after
each build), in interleaved order (default 0, option 0, default 1, ...), steps each twice to
warm it, then ``--rounds`` times times every instance's ``Trainer.step`` loop in turn
(``step_host.time_loop``: GPU microseconds a step, the median of its loops of ``--steps`` calls
on random batches). It prints each instance's median over the rounds and each arm's mean, min
and max over its instances.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from critical_path import variant_main
from step_host import positive_int, time_loop

#: Random batches each instance steps through in turn.
BATCHES = 8


def trainer_options() -> tuple[str, ...]:
    """The fast ``Trainer``'s boolean keyword options (its signature's keyword-only parameters
    whose default is ``False``): what ``--option`` may name."""
    from foxhunt.fast.trainer import Trainer

    params = inspect.signature(Trainer.__init__).parameters.values()
    return tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is False)


def arms(options: Sequence[str], allowed: Sequence[str]) -> dict[str, dict]:
    """``{arm: Trainer keyword options}``: ``default`` then one arm per option, on; a repeated
    or unknown option is a one-line ``ValueError``."""
    out: dict[str, dict] = {"default": {}}
    for name in options:
        if name not in allowed:
            raise ValueError(f"--option {name!r}: not a boolean Trainer option; allowed: "
                             f"{', '.join(allowed)}")
        if name in out:
            raise ValueError(f"--option {name!r}: given twice")
        out[name] = {name: True}
    return out


def show_switch(value) -> str:
    """A switch value in an arm's name: ``on`` / ``off``, or a set as ``{a,b}``."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return "{" + ",".join(sorted(value)) + "}"


def switch_arms(groups: Sequence[str], allowed: Mapping[str, object]) -> dict[str, dict]:
    """``{arm: {switch: its arm value}}``, one arm per ``--switch`` group (comma-separated names
    of ``allowed``, set together to ``allowed``'s values; the arm is named by ``NAME=value``
    joined with ``+``); an unknown, repeated or empty name, or a group given twice, is a
    one-line ``ValueError``."""
    out: dict[str, dict] = {}
    for group in groups:
        names = group.split(",")
        for name in names:
            if name not in allowed:
                raise ValueError(f"--switch {group!r}: {name!r} is not a plan switch; allowed: "
                                 f"{', '.join(allowed)}")
        if len(set(names)) != len(names):
            raise ValueError(f"--switch {group!r}: a switch named twice")
        arm = "+".join(f"{name}={show_switch(allowed[name])}" for name in names)
        if arm in out:
            raise ValueError(f"--switch {group!r}: given twice")
        out[arm] = {name: allowed[name] for name in names}
    return out


def switch_group(group: str) -> str:
    """``--switch``'s argument type: ``group`` where ``switch_arms`` takes it alone (so a bad
    name is a usage error before any GPU work)."""
    from foxhunt.fast import step_program

    try:
        switch_arms([group], step_program.plan_switches())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[1]) from None
    return group


@contextlib.contextmanager
def switched(module, values: Mapping[str, object]):
    """``module``'s attributes set to ``values`` inside the block, restored after it (also when
    it raises)."""
    old = {name: getattr(module, name) for name in values}
    try:
        for name, value in values.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in old.items():
            setattr(module, name, value)


@dataclass(frozen=True)
class Spread:
    """Per arm, each instance's median microseconds a step (over the rounds), in build order."""

    instances: dict[str, list[float]]

    def summary(self, arm: str) -> tuple[float, float, float]:
        """``(mean, min, max)`` over ``arm``'s instances."""
        times = self.instances[arm]
        return statistics.fmean(times), min(times), max(times)


def spread(build: Callable[[dict], object], arm_options: dict[str, dict], instances: int,
           rounds: int, time_one: Callable[[object], float],
           close: Callable[[object], None] = lambda trainer: None) -> Spread:
    """Build ``instances`` trainers per arm (``build(options)``), interleaved across the arms;
    then ``rounds`` times time every one of them (``time_one(trainer)``: microseconds a step) in
    that same order; each instance's median over the rounds. Every trainer built is closed
    (``close``), also when a build or a timing raises."""
    order = [(arm, i) for i in range(instances) for arm in arm_options]
    built: dict[tuple[str, int], object] = {}
    try:
        for arm, i in order:
            built[arm, i] = build(arm_options[arm])
        times: dict[tuple[str, int], list[float]] = {key: [] for key in order}
        for _ in range(rounds):
            for key in order:
                times[key].append(time_one(built[key]))
    finally:
        for trainer in built.values():
            close(trainer)
    return Spread({arm: [statistics.median(times[arm, i]) for i in range(instances)]
                   for arm in arm_options})


def format_spread(source: str, result: Spread) -> str:
    width = max(len(arm) for arm in result.instances)
    lines = [f"{source}: {'arm':{width}s}  mean us/step   min      max      instances (build order)"]
    for arm, times in result.instances.items():
        mean, lo, hi = result.summary(arm)
        lines.append(f"  {arm:{width}s}  {mean:10.2f} {lo:8.2f} {hi:8.2f}      "
                     + " ".join(f"{t:.1f}" for t in times))
    return "\n".join(lines)


def measure(config, args: argparse.Namespace) -> Spread:
    """``spread`` of ``config``'s fast ``Trainer.step`` over ``args``' arms (GPU)."""
    import numpy as np

    from foxhunt.fast import step_program
    from foxhunt.fast.trainer import Trainer
    from foxhunt.reference.batch import Batch

    rng = np.random.default_rng(0)
    batches = [Batch.random(config, rng) for _ in range(BATCHES)]
    turn = iter(range(1 << 62))

    def build(arm: tuple[dict, dict]) -> Trainer:
        options, switches = arm
        with switched(step_program, switches):
            trainer = Trainer(config, seed=0, **options)
            try:
                for batch in batches[:2]:
                    trainer.step(batch)
            except BaseException:
                trainer.close()
                raise
        return trainer

    def time_one(trainer) -> float:
        step = lambda: trainer.step(batches[next(turn) % BATCHES])  # noqa: E731
        return time_loop(trainer.engine.stream, step, args.steps).gpu_us

    plan = {arm: (options, {}) for arm, options in arms(args.option, trainer_options()).items()}
    for arm, switches in switch_arms(args.switch, step_program.plan_switches()).items():
        plan[arm] = ({}, switches)
    return spread(build, plan, args.instances, args.rounds, time_one,
                  close=lambda trainer: trainer.close())


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instances", type=positive_int, default=3,
                        help="trainers built per arm")
    parser.add_argument("--rounds", type=positive_int, default=2,
                        help="timings of each instance (their median is its time)")
    parser.add_argument("--steps", type=positive_int, default=400, help="calls per loop")
    parser.add_argument("--option", action="append", default=[], choices=trainer_options(),
                        help="an arm with this boolean Trainer option on (repeatable)")
    parser.add_argument("--switch", action="append", default=[], metavar="NAME[,NAME...]",
                        type=switch_group,
                        help="an arm built with these plan switches of fast.step_program on the "
                             "other side of their default (repeatable; "
                             "fast.step_program.plan_switches() names them)")


def main(argv: Sequence[str] | None = None) -> int:
    return variant_main(__doc__, "step_spread", "core", add_options,
                        lambda config, args, source: format_spread(source, measure(config, args)),
                        argv)


if __name__ == "__main__":
    sys.exit(main())
