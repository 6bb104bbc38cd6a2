"""The host side of ``Trainer.step``: what paces the step beyond its graphs (GPU).

    python benches/step_host.py [--preset seed] [--precision bf16] [--steps 400] [SOURCE ...]

``critical_path.py --measure`` times the step's graphs; ``Trainer.step(batch)`` also checks the
batch on the host (``Batch.validate``), writes it into a pinned staging buffer (after waiting for
that buffer's previous upload), enqueues the upload graph and the step graph (``launch``) and
keeps the deferred readback. When that host work takes as long as the graphs, the GPU waits for
the host. For each step variant, after two warm-up steps, loops of ``--steps`` calls run between
two CUDA events on the step stream (the median of ``ROUNDS`` loops, the GPU idle before each):

- ``Trainer.step``: the real thing, on ``BATCHES`` random batches in turn;
- ``engine.launch``: the upload graph and the step graph as ``Trainer.step`` enqueues them,
  without the batch work (the staging buffers keep their last batch);
- ``step graph``: the step graph alone, replayed back to back;

each as GPU microseconds a step and host microseconds a step (the loop's wall time: equal to
the GPU's when the host is the one waiting). Then ``Trainer.step`` again, ``ROUNDS`` x
``--steps`` calls, with its phases timed (``check_step_batch``, ``engine.staging``,
``write_batch`` and ``engine.launch`` wrapped with ``time.perf_counter``; ``rest``: the readback
bookkeeping and the call itself): the mean host microseconds a step in each. The batches'
values do not matter: these are timings only.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from critical_path import variant_main, warmed_trainer

#: Loops per timing (their median is reported) and random batches stepped in turn.
ROUNDS = 5
BATCHES = 8
#: ``Trainer.step``'s phases as the wrappers name them (``rest``: everything else in the call).
PHASES = ("check", "staging", "write", "launch", "rest")


@dataclass(frozen=True)
class Loop:
    """One loop's microseconds a step: on the GPU (between the events) and on the host."""

    gpu_us: float
    host_us: float


def time_loop(stream, run: Callable[[], None], steps: int) -> Loop:
    """``run`` ``steps`` times between two CUDA events on ``stream``, ``ROUNDS`` times (the
    context synchronised before each): the median loop's GPU and host microseconds a step."""
    from foxhunt.fast.device import _driver, call, driver_event_time

    loops = []
    for _ in range(ROUNDS):
        call(_driver().cuCtxSynchronize)
        t0 = time.perf_counter()
        gpu_s = driver_event_time(stream, run, steps)
        loops.append(Loop(gpu_s * 1e6, (time.perf_counter() - t0) * 1e6 / steps))
    return sorted(loops, key=lambda loop: loop.gpu_us)[len(loops) // 2]


@contextlib.contextmanager
def phase_clocks(trainer):
    """Wrap ``Trainer.step``'s four callees (``fast.trainer``'s ``check_step_batch`` and
    ``write_batch``, the engine's ``staging`` and ``launch``) with clocks; yields the dict of
    seconds spent in each, restores them on exit."""
    from foxhunt.fast import trainer as fast_trainer

    spent = dict.fromkeys(PHASES[:-1], 0.0)

    def clocked(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper

    engine = trainer.engine
    module_fns = {"check_step_batch": "check", "write_batch": "write"}
    saved = {name: getattr(fast_trainer, name) for name in module_fns}
    own = {name: engine.__dict__.get(name) for name in ("staging", "launch")}  # a caller's patch
    try:
        for name, phase in module_fns.items():
            setattr(fast_trainer, name, clocked(phase, saved[name]))
        for name in own:
            setattr(engine, name, clocked(name, getattr(engine, name)))
        yield spent
    finally:
        for name, fn in saved.items():
            setattr(fast_trainer, name, fn)
        for name, fn in own.items():
            if fn is None:
                engine.__dict__.pop(name, None)
            else:
                setattr(engine, name, fn)


@dataclass(frozen=True)
class HostReport:
    """Per loop name its ``Loop``; ``phases``: mean host microseconds a step per ``PHASES``."""

    loops: dict
    phases: dict


def measure(config, *, steps: int = 400, seed: int = 0) -> HostReport:
    """The loops of the module docstring for ``config``'s fast ``Trainer`` (GPU)."""
    import numpy as np

    from foxhunt.fast.trainer import STAGING_RING
    from foxhunt.reference.batch import Batch

    rng = np.random.default_rng(seed)
    trainer = warmed_trainer(config, seed=seed)
    try:
        batches = [Batch.random(config, rng) for _ in range(BATCHES)]
        engine, stream = trainer.engine, trainer.engine.stream
        turn = iter(range(1 << 62))
        loops = {
            "Trainer.step": lambda: trainer.step(batches[next(turn) % BATCHES]),
            "engine.launch": lambda: engine.launch(next(turn) % STAGING_RING),
            "step graph": engine.replay_step_graphs,
        }
        timed = {name: time_loop(stream, run, steps) for name, run in loops.items()}
        return HostReport(timed, step_phases(trainer, loops["Trainer.step"], ROUNDS * steps))
    finally:
        trainer.close()


def step_phases(trainer, step: Callable[[], None], calls: int) -> dict:
    """Mean host microseconds a call of ``step`` (``trainer``'s ``Trainer.step``) spends in each
    of ``PHASES`` over ``calls`` calls (``rest``: the call's wall time minus the four)."""
    trainer.engine.synchronize()
    with phase_clocks(trainer) as spent:
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        wall = time.perf_counter() - t0
    trainer.engine.synchronize()
    phases = {name: spent[name] * 1e6 / calls for name in PHASES[:-1]}
    phases["rest"] = wall * 1e6 / calls - sum(phases.values())
    return phases


def format_report(source: str, report: HostReport) -> str:
    lines = [f"{source}: loop            GPU us/step  host us/step"]
    lines += [f"  {name:18s} {loop.gpu_us:10.1f} {loop.host_us:12.1f}"
              for name, loop in report.loops.items()]
    lines.append("  Trainer.step's phases (host us/step): " + ", ".join(
        f"{name} {us:.1f}" for name, us in report.phases.items()))
    return "\n".join(lines)


def positive_int(text: str) -> int:
    """An ``argparse`` type: an int of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: need at least 1")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    return variant_main(
        __doc__, "step_host", "core",
        lambda parser: parser.add_argument("--steps", type=positive_int, default=400,
                                           help="calls per loop"),
        lambda config, args, source: format_report(source, measure(config, steps=args.steps)),
        argv)


if __name__ == "__main__":
    sys.exit(main())
