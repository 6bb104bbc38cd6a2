"""Population members' runs in lockstep: one population step takes one batch of every member
(SPEC 12, issue 24 item 4).

A population (``foxhunt.fast.population.Population``, its CPU twin ``CpuPopulation``, or the
reference twin ``reference.population.Population``) steps all its members at once:
``pop.step(batches)`` with one batch per member. A member's run is the single-run code path
(``train_cli._train`` -> ``loop.run``: folds, collection, epochs, evaluation, files), which
calls ``trainer.step(batch)`` one batch at a time. :func:`run_lockstep` joins the two: each
member's run goes in a thread of its own with a :class:`MemberProxy` as its trainer:

- ``proxy.step(batch)`` deposits the batch at the rendezvous (:class:`Lockstep`) and waits;
  when every *active* member has deposited, the thread that completes the round (the last to
  deposit, or a member leaving) calls ``pop.step(batches)`` and each waiting member gets its own ``StepScalars``. An exception
  in ``pop.step`` is raised in every waiting member (:class:`PopulationStepError`, caused by
  it).
- A member whose run ends (completed, halted, failed, stopped) leaves the rendezvous when its
  thread ends; the population steps on with the others. A departed member's slot gets its last
  batch (or, if it never stepped, the batch of the lowest active member: the members share one
  architecture, so it is valid there); its results are ignored (its run wrote everything).
- Every other trainer call (``q_values``, ``end_epoch``, ``fold_boundary``, ``state_dict``,
  ``save``, the properties, ...) is member ``i``'s own (``pop.member(i)``), made under the
  same lock as ``pop.step``: ONE lock guards every call into the population (its GPU side is
  not re-entrant). A member's own ``step`` is never called.
- With a :class:`PopulationThread` (``call=``), every one of those calls runs in that one
  thread, which also builds and closes the population: a CUDA driver context is current only
  in the thread that made it current (the fast population's, in the thread that built it).

No deadlock: a member blocked in ``step`` cannot leave, and every other active member either
reaches ``step`` (deposits) or ends (leaves); the last of these completes the round.

Signals are the caller's: handlers run in the main thread only, so the main thread installs
them (``train_cli.StopRequest``, shared by every member's ``should_stop``) and waits for the
member threads with timed joins (a signal delivered to another thread wakes it at the next
timeout). Output: while the members run, each complete line a member thread writes to stdout
or stderr (its table, its messages, its traceback) is prefixed with its label
(:class:`PrefixedLines`); the main thread's lines are not.
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from .backend import StepScalars
from .batch import Batch
from .plot_worker import PlotWorkers

#: Seconds between the main thread's timed joins of a member thread (its signal handlers run
#: at the latest then).
JOIN_POLL_S = 0.2


class PopulationStepError(RuntimeError):
    """``pop.step`` raised while this member waited for it (the cause is that exception)."""


def call_here(fn: Callable, /, *args, **kwargs):
    """``fn(*args, **kwargs)`` in the calling thread (``Lockstep``'s default ``call``)."""
    return fn(*args, **kwargs)


class PopulationThread:
    """The one thread that builds, calls and closes a population: ``call(fn, *args)`` runs
    ``fn(*args)`` there and returns its value (or raises its exception) in the caller. A
    context manager; leaving it ends the thread."""

    def __init__(self):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="foxhunt-population")

    def call(self, fn: Callable, /, *args, **kwargs):
        return self._executor.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> PopulationThread:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Lockstep:
    """The rendezvous of the members' ``step`` calls and the one lock of every population call
    (module docstring). ``lock`` is a ``threading.Condition``: the population's lock and the
    rendezvous' wake-up in one. ``call(fn, *args)`` makes each population call (default: in
    the calling thread; ``PopulationThread.call``: in that thread)."""

    def __init__(self, population, call: Callable = call_here):
        self.population, self.call = population, call
        self.lock = threading.Condition()
        self.n = len(population)
        self.active = set(range(self.n))
        self._deposited: dict[int, Batch] = {}  # this round's batches, by member
        self._last: list[Batch | None] = [None] * self.n  # each slot's batch of the last round
        self._outcome: dict[int, StepScalars | BaseException] = {}  # by waiting member

    def member(self, i: int) -> MemberProxy:
        """Member ``i``'s trainer for its run (:class:`MemberProxy`)."""
        return MemberProxy(self, i)

    def step(self, i: int, batch: Batch) -> StepScalars:
        """Member ``i``'s step on ``batch``: deposit, wait for the round, take its scalars."""
        with self.lock:
            if i not in self.active:
                raise RuntimeError(f"member {i} has left the lockstep; its run may not step")
            self._deposited[i] = batch
            self._step_if_complete()
            while i not in self._outcome:
                self.lock.wait()
            outcome = self._outcome.pop(i)
        if isinstance(outcome, BaseException):
            raise PopulationStepError(f"the population step failed: "
                                      f"{type(outcome).__name__}: {outcome}") from outcome
        return outcome

    def leave(self, i: int) -> None:
        """Member ``i``'s run ended: the rounds go on without it (and the one waiting for it
        completes now)."""
        with self.lock:
            self.active.discard(i)
            self._step_if_complete()

    def _step_if_complete(self) -> None:
        """With the lock held: one ``pop.step`` when every active member has deposited."""
        if not self._deposited or not self.active <= self._deposited.keys():
            return
        any_batch = self._deposited[min(self._deposited)]  # for a slot that never stepped
        batches = []
        for j in range(self.n):
            batch = self._deposited.get(j, self._last[j])
            batches.append(any_batch if batch is None else batch)
        try:
            results: Sequence[Any] = self.call(self.population.step, batches)
        except BaseException as exc:  # every waiting member raises it (PopulationStepError)
            results = [exc] * self.n
        self._last = batches
        for j in self._deposited:
            self._outcome[j] = results[j]
        self._deposited.clear()
        self.lock.notify_all()


class MemberProxy:
    """Member ``i`` of a :class:`Lockstep` population as the one trainer of its run: ``step``
    goes through the rendezvous; every other attribute is ``pop.member(i)``'s, read (and, for
    a method, called) under the population's lock. ``backend_name`` is the member's, so
    ``collector.fold_collector`` and ``evaluator.segment_evaluator`` choose for it as they
    choose for the member (a fast population's ``"fast-member"``: the host collector, and the
    member's own device walk, ``device_segments``, whose evaluator is ``Marshaled``)."""

    def __init__(self, lockstep: Lockstep, i: int):
        self._lockstep, self._index = lockstep, i
        with lockstep.lock:
            self._member = lockstep.call(lockstep.population.member, i)

    def step(self, batch: Batch) -> StepScalars:
        return self._lockstep.step(self._index, batch)

    def __getattr__(self, name: str):
        if name in ("_lockstep", "_index", "_member"):  # before __init__ set them
            raise AttributeError(name)
        # An object the member makes on the population's device (its device walk) is used the
        # same way: every later call on it in the population's thread, under the lock.
        wrap = functools.partial(Marshaled, lockstep=self._lockstep) \
            if name in MARSHALED_RESULTS else None
        return locked_attribute(self._lockstep, self._member, name, wrap)


#: Member methods whose result holds the population's device resources (``MemberProxy``).
MARSHALED_RESULTS = frozenset({"device_segments"})


def locked_attribute(lockstep: Lockstep, target, name: str, wrap: Callable | None = None):
    """``target.name`` read in the population's thread under its lock (``Lockstep.call``); a
    method comes back as a function calling it there under the lock, its result through
    ``wrap`` (when given)."""
    lock, call = lockstep.lock, lockstep.call
    with lock:
        value = call(getattr, target, name)
    if not callable(value):
        return value

    @functools.wraps(value)
    def locked(*args, **kwargs):
        with lock:
            made = call(value, *args, **kwargs)
        return made if wrap is None else wrap(made)
    return locked


class Marshaled:
    """``target`` (made in the population's thread) whose attributes are read, and methods
    called, in that thread under the population's lock (``locked_attribute``)."""

    def __init__(self, target, lockstep: Lockstep):
        self._target, self._lockstep = target, lockstep

    def __getattr__(self, name: str):
        if name in ("_target", "_lockstep"):
            raise AttributeError(name)
        return locked_attribute(self._lockstep, self._target, name)


class PrefixedLines(io.TextIOBase):
    """A text stream in place of ``sys.stdout`` / ``sys.stderr`` while member threads run: a
    thread with a prefix (:meth:`set_prefix`) has each of its complete lines written to
    ``target`` as prefix + line (a partial line waits in that thread's buffer for its newline,
    or for :meth:`end_thread`); other threads write to ``target`` as they are. Not a terminal
    (``isatty`` False): no member draws a progress bar."""

    def __init__(self, target):
        self.target = target
        self._local = threading.local()
        self._write_lock = threading.Lock()  # whole lines, never interleaved mid-line

    def set_prefix(self, prefix: str) -> None:
        self._local.prefix, self._local.partial = prefix, ""

    def write(self, text: str) -> int:
        prefix = getattr(self._local, "prefix", None)
        if prefix is None:
            return self.target.write(text)
        *lines, self._local.partial = (self._local.partial + text).split("\n")
        if lines:
            with self._write_lock:
                self.target.write("".join(f"{prefix}{line}\n" if line else f"{prefix.rstrip()}\n"
                                          for line in lines))
        return len(text)

    def end_thread(self) -> None:
        """The calling thread's partial line (if any) written, with its prefix; then none."""
        if getattr(self._local, "partial", ""):
            self.write("\n")
        self._local.prefix = None
        self.flush()

    def flush(self) -> None:
        self.target.flush()

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    @property
    def encoding(self):
        return getattr(self.target, "encoding", "utf-8")

    def fileno(self) -> int:
        return self.target.fileno()


class SharedPlotWorkers(PlotWorkers):
    """One pool of plot workers for every member (``PlotWorkers`` is one run's: its ``write``
    closes it), so a population of N starts ``default_workers()`` processes, not N times as
    many. :meth:`share` gives a member's run its view; the owner (a context manager, as
    ``PlotWorkers``) closes the pool."""

    def share(self) -> PlotWorkers:
        return _PlotShare(self)


class _PlotShare(PlotWorkers):
    """A member's view of a ``SharedPlotWorkers`` pool: ``PlotWorkers.write`` on that pool;
    its ``close`` (``write`` and the ``with`` block call it) closes the view, not the pool."""

    def __init__(self, owner: SharedPlotWorkers):  # not PlotWorkers.__init__: no pool of its own
        self.n, self._pool, self.started = owner.n, owner._pool, owner.started

    def close(self) -> None:
        self._pool = None


def run_lockstep(population, jobs: Sequence[Callable[[MemberProxy], Any]],
                 labels: Sequence[str], *, call: Callable = call_here,
                 poll_s: float = JOIN_POLL_S) -> list[Any]:
    """``jobs[i](trainer)`` for every member ``i`` of ``population``, each in a thread of its
    own, ``trainer`` its :class:`MemberProxy`, stepping in lockstep (module docstring; every
    population call made by ``call``); the member threads' lines prefixed with ``labels[i]``. The calling thread (the main thread,
    whose signal handlers stop the jobs through their ``should_stop``) waits for all of them.
    Returns, per member, what its job returned or the exception it raised (its traceback
    printed, prefixed)."""
    lockstep = Lockstep(population, call)
    if len(jobs) != lockstep.n or len(labels) != lockstep.n:
        raise ValueError(f"jobs: {len(jobs)}, labels: {len(labels)}; allowed: one each per "
                         f"member ({lockstep.n})")
    trainers = [lockstep.member(i) for i in range(lockstep.n)]
    outcomes: list[Any] = [None] * lockstep.n
    out, err = PrefixedLines(sys.stdout), PrefixedLines(sys.stderr)

    def member(i: int) -> None:
        out.set_prefix(labels[i])
        err.set_prefix(labels[i])
        try:
            outcomes[i] = jobs[i](trainers[i])
        except BaseException as exc:  # a bug or a broken machine: the others run on
            traceback.print_exc()
            outcomes[i] = exc
        finally:
            lockstep.leave(i)
            out.end_thread()
            err.end_thread()

    threads = [threading.Thread(target=member, args=(i,), name=f"foxhunt-member{i}", daemon=True)
               for i in range(lockstep.n)]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(poll_s)
    return outcomes


__all__ = ["JOIN_POLL_S", "MARSHALED_RESULTS", "Lockstep", "Marshaled", "MemberProxy",
           "PopulationStepError", "PopulationThread", "PrefixedLines", "SharedPlotWorkers",
           "call_here", "locked_attribute", "run_lockstep"]
