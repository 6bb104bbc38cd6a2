"""``foxhunt eval``: the metrics report of a saved policy (SPEC 10).

``foxhunt eval --checkpoint PATH [--data CSV] [--fold K] [--out DIR]`` loads the trainer in
``PATH`` and walks its greedy policy, and the flat and buy-and-hold baselines, over bars:

- with ``--data CSV``: every bar of the CSV after the feature warm-up, as one segment;
- without: the run's own data (``config.json`` of the run directory that holds
  ``PATH`` in its ``checkpoints/``: the synthetic market or CSV it was trained on), on fold
  ``K``'s validation and test segments. ``K`` defaults to the fold in the checkpoint's name
  (``fold{K}_best.safetensors``), else the run's last fold (``last.safetensors`` of a
  finished run).

It prints, per segment, the policy's and the baselines' Sharpe (annualised from the bars'
own spacing), total return, max drawdown, turnover and costs (``metrics``); with ``--out`` it
also writes them to ``DIR/eval.json``. Exit status 2 with one line on stderr for a missing or
damaged checkpoint, a missing run configuration or an unreadable CSV.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from threadpoolctl import threadpool_limits

from .market import Bars, feature_warmup, market_features
from .metrics import METRIC_NAMES, bar_seconds, bars_per_year
from .train_cli import int_at_least

#: The policies of the report, in order: the checkpoint's greedy policy, then the baselines.
POLICIES = (("policy", "greedy"), ("flat", "flat"), ("buy-and-hold", "buy_hold"))


def register(sub) -> None:
    p = sub.add_parser("eval", help="the metrics report of a saved policy",
                       description=__doc__.split("\n\n")[1].replace("``", ""),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True, metavar="PATH",
                   help="a checkpoint (.safetensors) written by foxhunt train")
    p.add_argument("--data", type=Path, default=None, metavar="CSV",
                   help="OHLCV CSV to evaluate on (default: the run's own data, fold K's "
                        "validation and test segments)")
    p.add_argument("--fold", type=int, default=None, metavar="K",
                   help="the fold whose segments to use without --data (default: from the "
                        "checkpoint's name fold{K}_best, else the last fold)")
    p.add_argument("--backend", choices=("reference", "fast"), default="reference",
                   help="backend that runs the policy (default: reference)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="also write the report to DIR/eval.json")
    p.add_argument("--threads", metavar="N", type=int_at_least(1), default=1,
                   help="BLAS threads of the evaluation's NumPy, as for train (default: %(default)s)")
    p.set_defaults(func=cmd_eval)


def _run_dir(checkpoint: Path) -> Path | None:
    parent = checkpoint.resolve().parent
    return parent.parent if parent.name == "checkpoints" else None


def _fold_of(checkpoint: Path, folds: int, requested: int | None) -> int:
    if requested is None:
        m = re.fullmatch(r"fold(\d+)_best\.safetensors", checkpoint.name)
        requested = int(m.group(1)) if m else folds - 1
    if not 0 <= requested < folds:
        raise ValueError(f"--fold {requested}: the run has folds 0..{folds - 1}")
    return requested


def evaluate_checkpoint(trainer, bars: Bars, segments: dict[str, tuple[int, int]]) -> dict:
    """``{"bar_seconds", "bars_per_year", "segments": {name: {"bars": [start, stop],
    <policy>: SegmentMetrics as a dict for each of POLICIES}}}`` for ``trainer``'s greedy
    policy and the baselines over each ``[start, stop)`` of ``segments``."""
    from .loop import choose_windows, evaluate_segment

    config = trainer.config
    feats = market_features(bars, choose_windows(config.state_dim))
    spacing = bar_seconds(bars.timestamp)
    per_year = bars_per_year(spacing)
    out = {"bar_seconds": spacing, "bars_per_year": per_year, "segments": {}}
    for name, seg in segments.items():
        row = {"bars": list(seg)}
        for label, policy in POLICIES:
            metrics, _ = evaluate_segment(trainer, bars, feats, config, seg, policy, per_year)
            row[label] = dataclasses.asdict(metrics)
        out["segments"][name] = row
    return out


def evaluation_text(evaluation: dict) -> str:
    """The report of ``evaluate_checkpoint``: one table per segment, then the annualisation."""
    from .report import format_metrics_row, metrics_header

    lines = []
    for name, row in evaluation["segments"].items():
        lines.append(f"{name} segment: bars {row['bars'][0]}-{row['bars'][1]}")
        lines.append("  " + metrics_header())
        for label, _ in POLICIES:
            lines.append("  " + format_metrics_row(label, row[label]))
    lines.append(f"Sharpe annualised with {evaluation['bars_per_year']:,.0f} bars a year (bars "
                 f"{evaluation['bar_seconds']:g} s apart)")
    return "\n".join(lines)


def _load(args) -> tuple:
    """``(trainer, bars, segments, source text)`` for ``args``; ``ValueError`` (one line) on
    a mistake the user can fix."""
    from . import runs
    from .backend import get_backend
    from .loop import fold_segments

    if args.backend == "fast":
        from .cli import cuda_status

        ok, reason = cuda_status()
        if not ok:
            raise ValueError(f"--backend fast needs an NVIDIA GPU with CUDA, and this machine has "
                             f"none usable ({reason}); use --backend reference")
    trainer = get_backend(args.backend).load(args.checkpoint)
    if args.data is not None:
        if args.fold is not None:
            raise ValueError("--fold applies to the run's own data, not to --data")
        bars = runs.load_bars(runs.csv_source(args.data))
        warmup = feature_warmup(_windows(trainer))
        if len(bars) < warmup + 3:
            raise ValueError(f"--data {args.data}: {len(bars)} bars; need more than the "
                             f"{warmup}-bar feature warm-up + 2")
        return trainer, bars, {"data": (warmup, len(bars))}, f"CSV {args.data}"
    run_dir = _run_dir(args.checkpoint)
    if run_dir is None or not (run_dir / runs.CONFIG_NAME).is_file():
        raise ValueError(f"--checkpoint {args.checkpoint}: not inside a run directory's "
                         f"checkpoints/ with a {runs.CONFIG_NAME}; pass --data CSV")
    run = runs.read_run_config(run_dir)
    bars = runs.load_bars(run.data)
    settings = run.settings
    fold = _fold_of(args.checkpoint, settings.folds, args.fold)
    seg = fold_segments(len(bars), feature_warmup(_windows(trainer)), settings.folds,
                        settings.val_frac, settings.test_frac)[fold]
    return (trainer, bars, {"validation": seg.val, "test": seg.test},
            f"{runs.describe_source(run.data)}, fold {fold}")


def _windows(trainer):
    from .loop import choose_windows

    return choose_windows(trainer.config.state_dim)


def cmd_eval(args: argparse.Namespace) -> int:
    from . import jsonio

    try:
        trainer, bars, segments, source = _load(args)
    except (ValueError, FileNotFoundError) as exc:  # CheckpointError, UsageError are ValueErrors
        print(f"foxhunt eval: {exc}", file=sys.stderr)
        return 2
    print(f"foxhunt eval: {args.checkpoint} on {source}")
    with threadpool_limits(limits=args.threads, user_api="blas"):
        evaluation = evaluate_checkpoint(trainer, bars, segments)
    print(evaluation_text(evaluation))
    if args.out is not None:
        try:
            args.out.mkdir(parents=True, exist_ok=True)
            path = jsonio.write_json(args.out / "eval.json", {
                "checkpoint": str(args.checkpoint), "data": source,
                "metrics": list(METRIC_NAMES), **evaluation})
        except OSError as exc:
            print(f"foxhunt eval: --out {args.out}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"wrote {path}")
    return 0
