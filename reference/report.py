"""What a run reports: the per-epoch table, the summary text and the JSON-ready run summary.

Every figure comes from ``loop.RunResult`` (whose metrics are ``metrics.segment_metrics``):
per fold, the best epoch is the one with the best **validation** Sharpe, and the fold's result
is that epoch's **test** metrics, next to the flat and buy-and-hold baselines on the same test
segment. ``overall`` is the mean over the folds that finished at least one epoch. The
per-epoch table shows each epoch's time in two parts: ``train s`` (experience collection and
training steps: on the fast backend one graph per cycle runs both, so only their sum exists)
and ``eval s`` (the greedy walks over the validation and test segments).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .metrics import METRIC_NAMES

#: The per-epoch table's header. ``train s``: the epoch's experience collection and training
#: steps (``EpochRecord.train_s``; on the fast backend one graph per cycle runs both, so only
#: their sum is measured); ``eval s``: the greedy walks over the validation and test segments
#: (``eval_s``).
TABLE_HEADER = (f"{'fold':>4} {'epoch':>5} {'loss':>9} {'c51|g|':>8} {'cql|g|':>8} {'|g|':>8} "
                f"{'mean Q':>8} {'val Sh':>8} {'test Sh':>8} {'train s':>8} {'eval s':>7}  flagged")


def format_row(r) -> str:
    """One line of the per-epoch table for ``r`` (a ``loop.EpochRecord``), under ``TABLE_HEADER``."""
    return (f"{r.fold:>4} {r.epoch:>5} {r.loss:>9.4f} {r.c51_norm_pre:>8.4f} {r.cql_norm_pre:>8.4f} "
            f"{r.grad_norm:>8.4f} {r.mean_q:>8.3f} {r.val_sharpe:>8.2f} {r.test_sharpe:>8.2f} "
            f"{r.train_s:>8.2f} {r.eval_s:>7.2f}  {', '.join(r.flagged) or '-'}")


def _finite(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _metrics_dict(m) -> dict:
    return {k: (_finite(v) if isinstance(v, float) else v) for k, v in dataclasses.asdict(m).items()}


def _chosen(result) -> list:
    """The folds that have a validation-chosen epoch."""
    return [f for f in result.folds if f.best_epoch is not None]


def overall(result) -> dict[str, float | None]:
    """Means over the folds with a chosen epoch: ``test_<m>`` and ``val_<m>`` for every metric
    ``m`` at that epoch, and the baselines' ``flat_test_sharpe``, ``buy_hold_test_sharpe``
    (None when no fold finished an epoch, or for a non-finite mean)."""
    folds = _chosen(result)
    values = {}
    for seg in ("test", "val"):
        for m in METRIC_NAMES:
            values[f"{seg}_{m}"] = [getattr(f.best[seg], m) for f in folds]
    values["flat_test_sharpe"] = [f.flat["test"].sharpe for f in folds]
    values["buy_hold_test_sharpe"] = [f.buy_hold["test"].sharpe for f in folds]
    return {k: (_finite(np.mean(v)) if v else None) for k, v in values.items()}


def run_summary(result) -> dict:
    """JSON-ready summary of ``result`` (finite floats or None): ``status`` ("completed" |
    "interrupted" | "halted"), ``halted`` (the reason or None), ``epochs_completed``, the bar
    spacing and annualisation, ``folds`` (per fold: segments as ``[start, stop)`` bar
    indices, ``best_epoch``, ``checkpoint``, ``val`` and ``test`` metrics at the best epoch,
    ``flat`` and ``buy_hold`` metrics per segment) and ``overall`` (``overall(result)``)."""
    folds = []
    for f in result.folds:
        folds.append({
            "fold": f.fold,
            "segments": {k: list(v) for k, v in dataclasses.asdict(f.segments).items()},
            "best_epoch": f.best_epoch,
            "checkpoint": f.checkpoint,
            **{seg: (_metrics_dict(f.best[seg]) if seg in f.best else None) for seg in ("val", "test")},
            "flat": {seg: _metrics_dict(m) for seg, m in f.flat.items()},
            "buy_hold": {seg: _metrics_dict(m) for seg, m in f.buy_hold.items()},
        })
    return {
        "status": result.status,
        "halted": result.halted,
        "epochs_completed": len(result.records),
        "bar_seconds": _finite(result.bar_seconds),
        "bars_per_year": _finite(result.bars_per_year),
        "folds": folds,
        "overall": overall(result),
    }


def _pct(x, sign: str = "+") -> str:
    """``x`` as a percentage; ``sign="+"`` for returns, ``""`` for losses shown as magnitudes
    (drawdown, costs)."""
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:{sign}.2f}%"


def signed_number(x, fmt: str = "+.2f") -> str:
    """``x`` formatted (signed, 2 decimals by default); ``n/a`` for None or a non-finite value."""
    return "n/a" if x is None or not math.isfinite(x) else format(x, fmt)


def metrics_header() -> str:
    """The header of a per-policy metrics table (``format_metrics_row``)."""
    return (f"{'':<14} {'Sharpe':>8} {'return':>9} {'max DD':>8} {'turnover':>9} {'costs':>9} "
            f"{'bars':>6}")


def format_metrics_row(label: str, m: dict, signed: bool = True) -> str:
    """One row of a metrics table: ``m`` is a ``SegmentMetrics`` as a dict; ``signed=False``
    for a row of magnitudes (a standard deviation): no ``+`` on the Sharpe and the return."""
    sign = "+" if signed else ""
    return (f"{label:<14} {signed_number(m['sharpe'], sign + '.2f'):>8} "
            f"{_pct(m['total_return'], sign):>9} "
            f"{_pct(m['max_drawdown'], ''):>8} {signed_number(m['turnover'], '.1f'):>9} {_pct(m['costs'], ''):>9} "
            f"{m['bars']:>6}")


def summary_text(result) -> str:
    """Per fold: the segments, the best epoch on validation with its validation and test Sharpe,
    the test return, max drawdown, turnover and costs, the flat and buy-and-hold test Sharpe;
    then the overall line and how the Sharpe is annualised."""
    lines = []
    for f in result.folds:
        s = f.segments
        head = (f"fold {f.fold} (bars: train {s.train[0]}-{s.train[1]}, validation "
                f"{s.val[0]}-{s.val[1]}, test {s.test[0]}-{s.test[1]})")
        base = (f"  baselines on test: flat Sharpe {signed_number(f.flat['test'].sharpe)}, buy-and-hold "
                f"Sharpe {signed_number(f.buy_hold['test'].sharpe)} (return {_pct(f.buy_hold['test'].total_return)})")
        if f.best_epoch is None:
            lines += [f"{head}: no finished epoch", base]
            continue
        val, test = f.best["val"], f.best["test"]
        lines += [
            f"{head}: best epoch {f.best_epoch} on validation (Sharpe {signed_number(val.sharpe)})",
            f"  test: Sharpe {signed_number(test.sharpe)}, return {_pct(test.total_return)}, max drawdown "
            f"{_pct(test.max_drawdown, '')}, turnover {signed_number(test.turnover, '.1f')}, "
            f"costs {_pct(test.costs, '')}",
            base,
        ]
    o = overall(result)
    n = len(_chosen(result))
    if n:
        lines.append(
            f"overall (mean of {n} fold{'s' if n > 1 else ''} at the validation-chosen epoch): test "
            f"Sharpe {signed_number(o['test_sharpe'])}, return {_pct(o['test_total_return'])}, max drawdown "
            f"{_pct(o['test_max_drawdown'], '')}, turnover {signed_number(o['test_turnover'], '.1f')}, costs "
            f"{_pct(o['test_costs'], '')}; validation Sharpe {signed_number(o['val_sharpe'])}; flat "
            f"{signed_number(o['flat_test_sharpe'])}, buy-and-hold {signed_number(o['buy_hold_test_sharpe'])}")
    else:
        lines.append("overall: no finished epoch")
    lines.append(f"Sharpe annualised with {result.bars_per_year:,.0f} bars a year (bars "
                 f"{result.bar_seconds:g} s apart)")
    return "\n".join(lines)
