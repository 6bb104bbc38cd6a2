"""Plots drawn in helper processes (``plot_worker``) and written atomically (``plots``)."""

import dataclasses
import logging
import os

import numpy as np
import pytest

from foxhunt.reference import plots
from foxhunt.reference.loop import EpochRecord, FoldResult, FoldSegments, RunResult
from foxhunt.reference.metrics import SegmentMetrics
from foxhunt.reference.plot_worker import PlotWorkerError, PlotWorkers

NAMES = ["loss.png", "grad_norms.png", "sharpe.png", "equity.png"]


def _result(folds=2, epochs=3, best_epoch=1) -> RunResult:
    """A hand-made RunResult: every record field a distinct number, 50-bar equity curves."""
    rng = np.random.default_rng(0)
    recs = []
    for f in range(folds):
        for e in range(epochs):
            d = {fl.name: float(rng.uniform(0.01, 1)) for fl in dataclasses.fields(EpochRecord)}
            d.update(fold=f, epoch=e, global_epoch=f * epochs + e, steps=300, flagged=[])
            recs.append(EpochRecord(**d))

    def metrics():
        return SegmentMetrics(*(float(v) for v in rng.normal(size=5)), bars=50)

    out = []
    for f in range(folds):
        s = 100 + 400 * f
        out.append(FoldResult(
            fold=f, segments=FoldSegments(train=(s, s + 300), val=(s + 300, s + 350), test=(s + 350, s + 400)),
            flat={"val": metrics(), "test": metrics()}, buy_hold={"val": metrics(), "test": metrics()},
            buy_hold_equity=list(np.cumprod(1 + rng.normal(0, 1e-3, 49))), best_epoch=best_epoch,
            best={"val": metrics(), "test": metrics()},
            best_equity=list(np.cumprod(1 + rng.normal(0, 1e-3, 49)))))
    return RunResult(recs, None, False, out, 60.0, 525_600.0)


def test_workers_write_the_same_files_as_drawing_in_process(tmp_path):
    res = _result()
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    local = plots.write_plots(here, res)
    with PlotWorkers(3) as workers:  # 3 workers for 4 plots: one draws two
        remote = workers.write(there, res)
    assert [p.name for p in local] == [p.name for p in remote] == NAMES
    for a, b in zip(local, remote):
        assert a.read_bytes() == b.read_bytes(), a.name  # Agg draws the same pixels anywhere
    assert sorted(os.listdir(there)) == sorted(NAMES)  # no temporary left behind


def test_a_worker_error_is_raised_with_its_traceback(tmp_path):
    # best_epoch 7 is no record's epoch: the Sharpe plot cannot find it (StopIteration).
    with PlotWorkers(1) as workers, pytest.raises(PlotWorkerError, match="StopIteration") as err:
        workers.write(tmp_path, _result(best_epoch=7))
    assert "plots.py" in str(err.value)  # the worker's own traceback, not just the message


def _processes(workers):
    """The pool's worker processes, once every one has started."""
    for job in workers.started:
        job.result(timeout=60)
    return list(workers._pool._processes.values())


def test_a_dead_worker_is_replaced_by_drawing_here(tmp_path, caplog):
    workers = PlotWorkers(2)
    victim = _processes(workers)[0]
    victim.kill()
    victim.join()
    with caplog.at_level(logging.WARNING, logger="foxhunt"):
        paths = workers.write(tmp_path, _result())
    assert [p.name for p in paths] == NAMES
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    assert "drawn in this process" in caplog.text


def test_close_reaps_unused_workers_and_no_records_means_no_plots(tmp_path):
    workers = PlotWorkers(2)
    procs = _processes(workers)
    assert len(procs) == 2 and len({p.pid for p in procs}) == 2
    assert workers.write(tmp_path, dataclasses.replace(_result(), records=[])) == []
    assert all(p.exitcode is not None for p in procs)
    assert os.listdir(tmp_path) == []
    workers.close()  # idempotent


def test_a_failed_plot_write_leaves_neither_the_file_nor_a_temporary(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    def broken(self, fh, **kw):
        fh.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(OSError, match="disk full"):
        plots.write_plots(tmp_path, _result(), ("sharpe.png",))
    assert os.listdir(tmp_path) == []


def test_unknown_plot_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="'nope.png'"):
        plots.write_plots(tmp_path, _result(), ("nope.png",))


def test_workers_ignore_ctrl_c(tmp_path, caplog):
    # The terminal's Ctrl-C reaches the whole process group; foxhunt train's stop path decides.
    import signal
    import time

    with PlotWorkers(2) as workers, caplog.at_level(logging.WARNING, logger="foxhunt"):
        procs = _processes(workers)
        for proc in procs:
            os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert all(p.is_alive() for p in procs)
        paths = workers.write(tmp_path, _result())
    assert [p.name for p in paths] == NAMES and all(p.stat().st_size > 0 for p in paths)
    assert "drawn in this process" not in caplog.text  # the workers drew them
