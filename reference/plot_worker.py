"""Draw a run's plots in worker processes that import matplotlib while the run trains.

Importing matplotlib and drawing the four figures take about a second of one CPU (measured on
a 2-core CPU machine: 0.4-0.5 s import, 0.5 s drawing). ``foxhunt train`` enters
``PlotWorkers`` before training: a ``concurrent.futures.ProcessPoolExecutor`` (``spawn``
start method: no fork of a process that holds CUDA, threads or locks) whose workers import
matplotlib and draw a warm-up figure at once (``_warm_up``, the pool's initializer). At the end
``write(out, result)`` hands each worker its share of ``plots.PLOTS`` (round robin) and waits
for all of them: the figures are drawn in parallel, and the import is paid while the GPU (or
the other cores) trains instead of after it.

Errors: a worker's exception is raised in the parent as ``PlotWorkerError`` with the worker's
traceback; a pool that broke (a worker killed or unable to start) is replaced by drawing in
this process (logged as a warning), so a run always gets its plots or an error. Workers
ignore SIGINT: the terminal's Ctrl-C reaches the whole process group, and ``foxhunt train``'s
stop path, not its workers, decides what happens (it still writes the plots). ``close()``
(also the context manager's exit) shuts the pool down.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

LOG = logging.getLogger("foxhunt")
#: At most one worker per plot; with fewer CPUs, one fewer worker than CPUs (at least one).
MAX_WORKERS = 4


class PlotWorkerError(RuntimeError):
    """A plot worker failed while drawing (the message holds its traceback)."""


def default_workers() -> int:
    return max(1, min(MAX_WORKERS, (os.cpu_count() or 1) - 1))


def _warm_up() -> None:
    """The pool's initializer: ignore Ctrl-C, import matplotlib and draw a first figure (the
    first figure of a process takes about twice as long as the next ones: fonts, caches)."""
    import io

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    for name in ("loop", "plots"):  # what the jobs are made of (unpickled here), loaded now
        importlib.import_module(f"foxhunt.reference.{name}")

    fig = Figure(figsize=(2, 2))
    ax = fig.add_subplot()
    ax.plot([1, 2], [1, 10], "o-", label="warm-up")
    ax.set(title="warm-up", xlabel="x", ylabel="y", yscale="log")
    ax.legend()
    fig.savefig(io.BytesIO(), format="png")


def _pid() -> int:
    return os.getpid()


class PlotWorkers:
    """``PlotWorkers(n)``: ``n`` worker processes started now; ``write`` as ``plots.write_plots``."""

    def __init__(self, n: int | None = None):
        self.n = default_workers() if n is None else n
        self._pool: ProcessPoolExecutor | None = None
        self.started: list = []  # futures of the workers' pids (done once each has started)
        try:
            self._pool = ProcessPoolExecutor(self.n, multiprocessing.get_context("spawn"),
                                             initializer=_warm_up)
            # One job each makes the pool start all n workers now.
            self.started = [self._pool.submit(_pid) for _ in range(self.n)]
        except OSError as exc:
            LOG.warning("could not start the plot workers (%s); plots are drawn in this process",
                        exc)
            self.close()

    def write(self, out: Path, result) -> list[Path]:
        """The plots of ``result`` under ``out`` (``plots.write_plots``'s files, in its order)."""
        from .plots import PLOTS, write_plots

        names = tuple(PLOTS)
        if not result.records:
            self.close()
            return []
        try:
            if self._pool is None:
                raise BrokenProcessPool("no plot workers")
            shares = [names[i::self.n] for i in range(min(self.n, len(names)))]
            jobs = [self._pool.submit(write_plots, Path(out), result, s) for s in shares]
            errors = [job.exception() for job in jobs]
        except BrokenProcessPool as exc:
            LOG.warning("the plot workers are gone (%s); the plots are drawn in this process", exc)
            errors = []
            write_plots(out, result, names)
        finally:
            self.close()
        for exc in errors:
            if isinstance(exc, BrokenProcessPool):
                LOG.warning("a plot worker died (%s); the plots are drawn in this process", exc)
                write_plots(out, result, names)
                break
            if exc is not None:  # the worker's traceback is the cause (concurrent.futures)
                raise PlotWorkerError(f"a plot worker failed: {exc!r}\n{exc.__cause__ or ''}") \
                    from exc
        return [Path(out) / n for n in names]

    def close(self) -> None:
        """Shut the pool down, cancelling what has not started (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> PlotWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
