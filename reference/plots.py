"""PNG plots of a run: loss, per-component gradient norms, validation/test Sharpe, test equity.

The loss and gradient-norm plots draw a second-wave source (IQN, ensemble, auxiliary heads,
MSE warm-up) only when it is on (some value > 0); C51 and CQL are always drawn.

Every plot marks the fold boundaries (dotted vertical lines); the Sharpe and equity plots
draw the flat and buy-and-hold baselines of each fold's test segment next to the policy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .config import BUDGET_SOURCES


def _fold_starts(records) -> list[int]:
    """The global epoch at which each fold after the first begins (a boundary line there)."""
    return [b.global_epoch for a, b in zip(records, records[1:]) if b.fold != a.fold]


def write_plots(out: Path, result) -> list[Path]:
    """Write ``loss.png``, ``grad_norms.png``, ``sharpe.png`` and ``equity.png`` for ``result``
    (a ``loop.RunResult``) under ``out``; returns the paths. Nothing is written for a run with
    no finished epoch."""
    if not result.records:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    recs = result.records
    x = np.array([r.global_epoch for r in recs])
    paths = []

    def boundaries(ax, at, label="fold boundary"):
        for i, b in enumerate(at):
            ax.axvline(b, ls=":", color="0.4", lw=1, label=label if i == 0 else None)

    def save(fig, name):
        path = Path(out) / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    epoch_bounds = [g - 0.5 for g in _fold_starts(recs)]

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r.loss for r in recs], "o-", label="total")
    ax.plot(x, [r.c51_loss for r in recs], "s--", label="C51")
    ax.plot(x, [r.cql_loss for r in recs], "^--", label="CQL")
    for key, label in (("iqn_loss", "IQN"), ("ens_loss", "ensemble"),
                       ("aux_next_bar_loss", "aux next bar"), ("aux_regime_loss", "aux regime"),
                       ("mse_loss", "MSE warm-up")):
        values = [getattr(r, key) for r in recs]
        if any(v != 0 for v in values):
            ax.plot(x, values, ".:", label=label)
    boundaries(ax, epoch_bounds)
    ax.set(xlabel="epoch (all folds)", ylabel="loss (last step of epoch)", title="Loss")
    ax.legend()
    save(fig, "loss.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for src, marker in zip(BUDGET_SOURCES, "osDv"):
        pre = [getattr(r, f"{src}_norm_pre") for r in recs]
        if src not in ("c51", "cql") and not any(v > 0 for v in pre):
            continue  # a second-wave source that is off (its norms are 0)
        name = src.upper() if src != "ens" else "ensemble"
        ax.plot(x, pre, f"{marker}-", label=f"{name} before clip")
        ax.plot(x, [getattr(r, f"{src}_norm_post") for r in recs], f"{marker}:",
                label=f"{name} after clip")
    ax.plot(x, [r.grad_norm for r in recs], "k^-", label="into Adam")
    boundaries(ax, epoch_bounds)
    ax.set(xlabel="epoch (all folds)", ylabel="L2 norm", title="Per-component gradient norms", yscale="log")
    # Plain "1e-03" tick labels: the default log labels are mathtext, whose first use in a
    # process cost seconds on the H200 machine (profile of foxhunt train --backend fast).
    ax.yaxis.set_major_formatter(ticker.LogFormatter())
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.legend(fontsize=8)
    save(fig, "grad_norms.png")

    fig, ax = plt.subplots(figsize=(7, 4))
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
    boundaries(ax, epoch_bounds)
    ax.set(xlabel="epoch (all folds)", ylabel=f"annualised Sharpe ({result.bars_per_year:,.0f} bars/yr)",
           title="Greedy policy: validation and test Sharpe")
    ax.legend(fontsize=8)
    save(fig, "sharpe.png")

    fig, ax = plt.subplots(figsize=(7, 4))
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
    boundaries(ax, [f.segments.train[0] for f in result.folds[1:]])
    ax.set(xlabel="bar", ylabel="equity (1 at each test segment's start)",
           title="Test segments: policy at the validation-chosen epoch vs buy-and-hold")
    ax.legend(fontsize=7)
    save(fig, "equity.png")
    return paths
