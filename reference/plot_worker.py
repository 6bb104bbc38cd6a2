"""Draw a run's plots in helper processes that import matplotlib while the run trains.

Importing matplotlib and drawing the four figures take about a second of one CPU (measured on
a 2-core CPU machine: 0.4-0.5 s import, 0.5 s drawing). ``foxhunt train`` starts
``PlotWorkers`` before training: each worker is ``python -m foxhunt.reference.plot_worker``,
which imports matplotlib and the plotting code at once, then waits on its stdin. At the end
``write(out, result)`` sends each worker the run's result and its share of ``plots.PLOTS``
(round robin), and waits for all of them: the figures are drawn in parallel, and the import
is paid while the GPU (or the other cores) trains instead of after it.

Protocol: the parent writes one pickle, ``(out, result, names)``, to the worker's stdin; the
worker answers one line of JSON on stdout, ``{"paths": [...]}`` or ``{"error": traceback}``,
and exits. A worker error is raised in the parent (``PlotWorkerError``, with the worker's
traceback); a worker that could not start, or died without an answer, is replaced by drawing
its share in this process (logged as a warning), so a run always gets its plots or an error.

Workers run in their own session (``start_new_session``): the terminal's Ctrl-C reaches only
``foxhunt train``, whose stop path still writes the plots. A worker whose parent dies reads
end-of-file on its stdin and exits. ``close()`` (also the context manager's exit) kills and
reaps workers that were not used.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import traceback
from pathlib import Path

LOG = logging.getLogger("foxhunt")
#: At most one worker per plot; with fewer CPUs, one fewer worker than CPUs (at least one).
MAX_WORKERS = 4


class PlotWorkerError(RuntimeError):
    """A plot worker failed while drawing (the message holds its traceback)."""


def default_workers() -> int:
    return max(1, min(MAX_WORKERS, (os.cpu_count() or 1) - 1))


class PlotWorkers:
    """``PlotWorkers(n)``: ``n`` worker processes started now; ``write`` as ``plots.write_plots``."""

    def __init__(self, n: int | None = None):
        self._procs: list[subprocess.Popen | None] = []
        for _ in range(default_workers() if n is None else n):
            try:
                proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, start_new_session=True)
            except OSError as exc:
                LOG.warning("could not start a plot worker (%s); plots are drawn in this process", exc)
                proc = None
            self._procs.append(proc)

    def write(self, out: Path, result) -> list[Path]:
        """The plots of ``result`` under ``out`` (``plots.write_plots``'s files, in its order)."""
        from .plots import PLOTS, write_plots

        if not result.records:
            self.close()
            return []
        names = tuple(PLOTS)
        shares = [names[i::max(1, len(self._procs))] for i in range(max(1, len(self._procs)))]
        local: list[str] = []
        sent = []
        for proc, share in zip(self._procs or [None], shares):
            if not share:
                continue
            if proc is not None and _send(proc, (Path(out), result, share)):
                sent.append((proc, share))
                continue
            if proc is not None:
                LOG.warning("a plot worker exited (status %s) before its job; %s drawn in this "
                            "process instead", proc.poll(), ", ".join(share))
            local.extend(share)
        errors = []
        for proc, share in sent:
            answer = _answer(proc)
            if answer is None:
                LOG.warning("a plot worker exited (status %s) without an answer; %s drawn in "
                            "this process instead", proc.returncode, ", ".join(share))
                local.extend(share)
            elif "error" in answer:
                errors.append(answer["error"])
        self.close()
        if errors:
            raise PlotWorkerError("a plot worker failed:\n" + "\n".join(errors))
        if local:
            write_plots(out, result, tuple(n for n in names if n in local))
        return [Path(out) / n for n in names]

    def close(self) -> None:
        """Kill and reap every worker still running (idempotent)."""
        for proc in self._procs:
            if proc is None:
                continue
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None and not pipe.closed:
                    try:
                        pipe.close()
                    except OSError:  # a broken pipe: the worker is gone, nothing to flush
                        pass
        self._procs = [None] * len(self._procs)

    def __enter__(self) -> PlotWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _send(proc: subprocess.Popen, job) -> bool:
    """Write ``job`` to the worker and close its stdin; False if the worker is gone."""
    try:
        pickle.dump(job, proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        proc.stdin.close()
        return True
    except (BrokenPipeError, OSError):
        return False


def _answer(proc: subprocess.Popen) -> dict | None:
    """The worker's JSON answer, or None if it exited without one."""
    line = proc.stdout.readline()
    proc.wait()
    try:
        answer = json.loads(line)
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def _worker() -> int:
    """The worker's side (module docstring)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from foxhunt.reference import loop  # noqa: F401  (what the pickled result is made of)
    from foxhunt.reference.plots import write_plots

    # Warm-up: a first drawing loads the font and fills matplotlib's caches (measured: the
    # first figure of a process takes about twice as long as the next ones).
    fig = Figure(figsize=(2, 2))
    ax = fig.add_subplot()
    ax.plot([1, 2], [1, 10], "o-", label="warm-up")
    ax.set(title="warm-up", xlabel="x", ylabel="y", yscale="log")
    ax.legend()
    fig.savefig(io.BytesIO(), format="png")

    try:
        out, result, names = pickle.load(sys.stdin.buffer)
    except EOFError:  # the parent finished (or died) without plots for this worker
        return 0
    try:
        paths = write_plots(out, result, names)
        answer = {"paths": [str(p) for p in paths]}
    except Exception:  # noqa: BLE001  (reported to the parent, which raises it)
        answer = {"error": traceback.format_exc()}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_worker())
