"""PNG plots of a run: loss, per-component gradient norms, validation/test Sharpe, test equity.

The loss and gradient-norm plots draw a second-wave source (IQN, ensemble, auxiliary heads,
MSE warm-up) only when it is on (some value > 0); C51 and CQL are always drawn.

Every plot marks the fold boundaries (dotted vertical lines); the Sharpe and equity plots
draw the flat and buy-and-hold baselines of each fold's test segment next to the policy.

Each figure has fixed margins (``MARGINS``) instead of ``tight_layout``, which draws the whole
figure once more to measure its text (about a third of the plotting time, measured on the
CPU), and is written atomically (a temporary file beside it, then ``os.replace``).
``plot_worker.PlotWorkers`` draws these same figures in helper processes.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .atomic import open_temporary
from .config import BUDGET_SOURCES

#: Figure margins (fractions of the 7 x 4 inch figure): room for the tick labels, the axis
#: labels and the title at the default font sizes.
MARGINS = {"left": 0.11, "right": 0.98, "bottom": 0.12, "top": 0.92}
FIGSIZE = (7, 4)
DPI = 110


def _fold_starts(records) -> list[int]:
    """The global epoch at which each fold after the first begins (a boundary line there)."""
    return [b.global_epoch for a, b in zip(records, records[1:]) if b.fold != a.fold]


def _boundaries(ax, at, label="fold boundary") -> None:
    for i, b in enumerate(at):
        ax.axvline(b, ls=":", color="0.4", lw=1, label=label if i == 0 else None)


def _epochs(result):
    """(x: the records' global epochs, the fold boundaries between epochs)."""
    recs = result.records
    return np.array([r.global_epoch for r in recs]), [g - 0.5 for g in _fold_starts(recs)]


def _loss(ax, result) -> None:
    recs = result.records
    x, bounds = _epochs(result)
    ax.plot(x, [r.loss for r in recs], "o-", label="total")
    ax.plot(x, [r.c51_loss for r in recs], "s--", label="C51")
    ax.plot(x, [r.cql_loss for r in recs], "^--", label="CQL")
    for key, label in (("iqn_loss", "IQN"), ("ens_loss", "ensemble"),
                       ("aux_next_bar_loss", "aux next bar"), ("aux_regime_loss", "aux regime"),
                       ("mse_loss", "MSE warm-up")):
        values = [getattr(r, key) for r in recs]
        if any(v != 0 for v in values):
            ax.plot(x, values, ".:", label=label)
    _boundaries(ax, bounds)
    ax.set(xlabel="epoch (all folds)", ylabel="loss (last step of epoch)", title="Loss")
    ax.legend()


def _grad_norms(ax, result) -> None:
    from matplotlib import ticker

    recs = result.records
    x, bounds = _epochs(result)
    for src, marker in zip(BUDGET_SOURCES, "osDv"):
        pre = [getattr(r, f"{src}_norm_pre") for r in recs]
        if src not in ("c51", "cql") and not any(v > 0 for v in pre):
            continue  # a second-wave source that is off (its norms are 0)
        name = src.upper() if src != "ens" else "ensemble"
        ax.plot(x, pre, f"{marker}-", label=f"{name} before clip")
        ax.plot(x, [getattr(r, f"{src}_norm_post") for r in recs], f"{marker}:",
                label=f"{name} after clip")
    ax.plot(x, [r.grad_norm for r in recs], "k^-", label="into Adam")
    _boundaries(ax, bounds)
    ax.set(xlabel="epoch (all folds)", ylabel="L2 norm", title="Per-component gradient norms", yscale="log")
    # Plain "1e-03" tick labels: the default log labels are mathtext, whose first use in a
    # process cost seconds on the H200 machine (profile of foxhunt train --backend fast).
    ax.yaxis.set_major_formatter(ticker.LogFormatter())
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.legend(fontsize=8)


def _sharpe(ax, result) -> None:
    recs = result.records
    x, bounds = _epochs(result)
    ax.plot(x, [r.val_sharpe for r in recs], "o-", color="C0", label="policy, validation")
    ax.plot(x, [r.test_sharpe for r in recs], "s--", color="C1", label="policy, test")
    for i, f in enumerate(result.folds):
        span = [r.global_epoch for r in recs if r.fold == f.fold]
        if not span:
            continue
        lo, hi = min(span) - 0.4, max(span) + 0.4
        ax.hlines(f.flat["test"].sharpe, lo, hi, colors="0.5", linestyles=":",
                  label="flat, test" if i == 0 else None)
        ax.hlines(f.buy_hold["test"].sharpe, lo, hi, colors="C2", linestyles="-.",
                  label="buy-and-hold, test" if i == 0 else None)
        if f.best_epoch is not None:
            g = next(r.global_epoch for r in recs if r.fold == f.fold and r.epoch == f.best_epoch)
            ax.plot([g], [f.best["test"].sharpe], "*", color="C3", ms=12,
                    label="best on validation" if i == 0 else None)
    _boundaries(ax, bounds)
    ax.set(xlabel="epoch (all folds)", ylabel=f"annualised Sharpe ({result.bars_per_year:,.0f} bars/yr)",
           title="Greedy policy: validation and test Sharpe")
    ax.legend(fontsize=8)


def _equity(ax, result) -> None:
    for i, f in enumerate(result.folds):
        start = f.segments.test[0]
        if f.best_epoch is not None:
            eq = np.asarray(f.best_equity)
            ax.plot(start + 1 + np.arange(len(eq)), eq, color=f"C{i % 10}",
                    label=f"fold {f.fold}: epoch {f.best_epoch}, Sharpe {f.best['test'].sharpe:+.2f}")
        bh = np.asarray(f.buy_hold_equity)
        ax.plot(start + 1 + np.arange(len(bh)), bh, "--", color=f"C{i % 10}", alpha=0.6,
                label=f"fold {f.fold}: buy-and-hold, Sharpe {f.buy_hold['test'].sharpe:+.2f}")
    ax.axhline(1.0, ls=":", color="gray", label="flat")
    _boundaries(ax, [f.segments.train[0] for f in result.folds[1:]])
    ax.set(xlabel="bar", ylabel="equity (1 at each test segment's start)",
           title="Test segments: policy at the validation-chosen epoch vs buy-and-hold")
    ax.legend(fontsize=7)


#: The plots, in the order ``write_plots`` writes them: file name -> drawing function.
PLOTS = {"loss.png": _loss, "grad_norms.png": _grad_norms, "sharpe.png": _sharpe,
         "equity.png": _equity}


def write_plots(out: Path, result, names=tuple(PLOTS)) -> list[Path]:
    """Write the plots ``names`` (default: all of ``PLOTS``: ``loss.png``, ``grad_norms.png``,
    ``sharpe.png``, ``equity.png``) for ``result`` (a ``loop.RunResult``) under ``out``;
    returns the paths. Nothing is written for a run with no finished epoch."""
    if not result.records:
        return []
    unknown = [n for n in names if n not in PLOTS]
    if unknown:
        raise ValueError(f"plots {unknown} are not allowed; the plots are {', '.join(PLOTS)}")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    paths = []
    for name in names:
        # A bare Figure (no pyplot): nothing to close, no global figure registry to keep.
        fig = Figure(figsize=FIGSIZE)
        fig.subplots_adjust(**MARGINS)
        PLOTS[name](fig.add_subplot(), result)
        path = Path(out) / name
        fd, tmp = open_temporary(path)
        try:
            with os.fdopen(fd, "wb") as fh:
                fig.savefig(fh, format="png", dpi=DPI)
            os.replace(tmp, path)
        except BaseException:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise
        paths.append(path)
    return paths
