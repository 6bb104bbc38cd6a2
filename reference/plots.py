"""PNG plots of a run: loss, per-component gradient norms, Sharpe per epoch and fold, equity."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_plots(out: Path, result) -> list[Path]:
    """Write the four plots for ``result`` (a ``loop.RunResult``) under ``out``; returns the paths.

    Nothing is written for a run with no finished epoch.
    """
    if not result.records:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = result.records
    x = np.array([r.global_epoch for r in recs])
    folds = sorted({r.fold for r in recs})
    paths = []

    def save(fig, name):
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r.loss for r in recs], "o-", label="total")
    ax.plot(x, [r.c51_loss for r in recs], "s--", label="C51")
    ax.plot(x, [r.cql_loss for r in recs], "^--", label="CQL")
    ax.set(xlabel="epoch (all folds)", ylabel="loss (last step of epoch)", title="Loss")
    ax.legend()
    save(fig, "loss.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, style in (("c51_norm_pre", "C51 before clip", "o-"), ("c51_norm_post", "C51 after clip", "o:"),
                              ("cql_norm_pre", "CQL before clip", "s-"), ("cql_norm_post", "CQL after clip", "s:"),
                              ("grad_norm", "into Adam", "k^-")):
        ax.plot(x, [getattr(r, key) for r in recs], style, label=label)
    ax.set(xlabel="epoch (all folds)", ylabel="L2 norm", title="Per-component gradient norms", yscale="log")
    ax.legend(fontsize=8)
    save(fig, "grad_norms.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for f in folds:
        fr = [r for r in recs if r.fold == f]
        ax.plot([r.epoch for r in fr], [r.sharpe for r in fr], "o-", label=f"fold {f}")
        if f in result.flat_sharpe:
            ax.axhline(result.flat_sharpe[f], ls=":", color="gray")
    ax.set(xlabel="epoch in fold", ylabel="annualised Sharpe (held-out)", title="Evaluation Sharpe")
    ax.legend()
    save(fig, "sharpe.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for f, info in sorted(result.best.items()):
        eq = np.asarray(info["equity"])
        ax.plot(np.arange(len(eq)), eq, label=f"fold {f} (epoch {info['epoch']}, Sharpe {info['sharpe']:+.2f})")
    ax.axhline(1.0, ls=":", color="gray")
    ax.set(xlabel="bar of the held-out segment", ylabel="equity", title="Best policy, evaluation segment")
    ax.legend(fontsize=8)
    save(fig, "equity.png")
    return paths
