"""``foxhunt train``: the main job (SPEC 10).

Trains on the bundled synthetic futures market (or ``--data CSV``), prints a progress bar per
epoch and a per-epoch table, and writes ``metrics.jsonl``, PNG plots, checkpoints and
``summary.json`` under ``--out``. Ctrl-C stops cleanly: what was written stays, the plots and
summary are still produced from the epochs that finished.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from .config import PRESETS, DQNConfig
from .loop import EpochRecord, LoopSettings, run, sharpe_summary, write_jsonl

TABLE_HEADER = (f"{'fold':>4} {'epoch':>5} {'loss':>9} {'c51|g|':>8} {'cql|g|':>8} {'|g|':>8} "
                f"{'mean Q':>8} {'Sharpe':>8} {'time s':>7}  flagged")


def _row(r: EpochRecord) -> str:
    return (f"{r.fold:>4} {r.epoch:>5} {r.loss:>9.4f} {r.c51_norm_pre:>8.4f} {r.cql_norm_pre:>8.4f} "
            f"{r.grad_norm:>8.4f} {r.mean_q:>8.3f} {r.sharpe:>8.2f} {r.epoch_time_s:>7.1f}  "
            f"{', '.join(r.flagged) or '-'}")


def register(sub) -> None:
    p = sub.add_parser("train", help="train on the synthetic market or your CSV bars",
                       description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("reference", "fast"), default="reference")
    p.add_argument("--preset", choices=tuple(PRESETS), default="seed")
    p.add_argument("--precision", choices=("f32", "bf16"), default=None,
                   help="GEMM precision (default: the preset's, bf16)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per fold (default 3)")
    p.add_argument("--folds", type=int, default=2, help="walk-forward folds (default 2)")
    p.add_argument("--steps-per-epoch", type=int, default=300)
    p.add_argument("--bars", type=int, default=20_000, help="synthetic bars (default 20000)")
    p.add_argument("--market", choices=("default", "strong_trend"), default="default")
    p.add_argument("--data", type=Path, default=None, help="OHLCV CSV instead of the synthetic market")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/latest"))
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics (per-component gradient norms) on this port")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)


def _load_bars(args):
    from .market import SyntheticMarket, load_csv

    if args.data is not None:
        if not args.data.is_file():
            raise SystemExit(f"foxhunt train: --data {args.data}: no such file")
        try:
            return load_csv(args.data), f"CSV {args.data}"
        except ValueError as exc:
            raise SystemExit(f"foxhunt train: --data {args.data}: {exc}") from None
    return (SyntheticMarket.preset(args.market, seed=args.seed, n_bars=args.bars).generate(),
            f"synthetic market '{args.market}', {args.bars} bars, seed {args.seed}")


def _metrics_server(port: int | None):
    if port is None:
        return None
    try:
        import prometheus_client as prom
    except ImportError:
        raise SystemExit("foxhunt train: --metrics-port needs prometheus-client "
                         "(pip install 'foxhunt[metrics]')") from None
    registry = prom.CollectorRegistry()
    gauges = {
        "grad_norm": prom.Gauge("foxhunt_grad_norm", "gradient L2 norm by component and stage",
                                ["component", "stage"], registry=registry),
        "loss": prom.Gauge("foxhunt_loss", "training loss by component", ["component"], registry=registry),
        "sharpe": prom.Gauge("foxhunt_eval_sharpe", "evaluation Sharpe of the last epoch", registry=registry),
    }
    prom.start_http_server(port, registry=registry)
    return gauges


def cmd_train(args: argparse.Namespace) -> int:
    from .plots import write_plots

    try:
        config = DQNConfig.preset(args.preset, **({"precision": args.precision} if args.precision else {}))
        settings = LoopSettings(folds=args.folds, epochs=args.epochs,
                                steps_per_epoch=args.steps_per_epoch, seed=args.seed)
    except ValueError as exc:
        print(f"foxhunt train: {exc}", file=sys.stderr)
        return 2
    bars, source = _load_bars(args)
    gauges = _metrics_server(args.metrics_port)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    metrics_path.write_text("")
    (out / "config.json").write_text(config.to_json())
    print(f"foxhunt train: backend={args.backend} preset={args.preset} precision={config.precision} "
          f"B={config.batch_size} folds={settings.folds} epochs/fold={settings.epochs} "
          f"steps/epoch={settings.steps_per_epoch}\n  data: {source}\n  output: {out}")

    progress = None
    show = not args.no_progress and sys.stderr.isatty()

    def on_epoch_start(fold, epoch):
        nonlocal progress
        if show:
            from tqdm import tqdm

            progress = tqdm(total=settings.steps_per_epoch, desc=f"F{fold} E{epoch}", leave=False,
                            unit="step", dynamic_ncols=True)

    def on_step(i, scalars):
        if progress is not None:
            progress.update(1)
            if scalars.fresh or i == 0:
                progress.set_postfix(loss=f"{scalars.loss:.4f}", grad=f"{scalars.grad_norm:.3f}")

    header_printed = False

    def on_epoch(rec: EpochRecord):
        nonlocal header_printed, progress
        if progress is not None:
            progress.close()
            progress = None
        if not header_printed:
            print(TABLE_HEADER)
            header_printed = True
        print(_row(rec), flush=True)
        write_jsonl(metrics_path, rec)
        if gauges:
            for comp in ("c51", "cql"):
                gauges["grad_norm"].labels(comp, "pre").set(getattr(rec, f"{comp}_norm_pre"))
                gauges["grad_norm"].labels(comp, "post").set(getattr(rec, f"{comp}_norm_post"))
                gauges["loss"].labels(comp).set(getattr(rec, f"{comp}_loss"))
            gauges["grad_norm"].labels("total", "adam").set(rec.grad_norm)
            gauges["sharpe"].set(rec.sharpe)

    # A second Ctrl-C during the wrap-up should not corrupt what is being written.
    tic = time.perf_counter()
    result = run(config, bars, settings, backend=args.backend, out_dir=out, on_step=on_step,
                 on_epoch=on_epoch, on_epoch_start=on_epoch_start)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if progress is not None:
            progress.close()
        plots = write_plots(out, result)
        summary = {
            "backend": args.backend, "preset": args.preset, "precision": config.precision,
            "epochs_completed": len(result.records), "interrupted": result.interrupted,
            "halted": result.halted, "wall_time_s": time.perf_counter() - tic,
            "best": {str(k): {kk: vv for kk, vv in v.items() if kk != "equity"} for k, v in result.best.items()},
            "flat_sharpe": {str(k): v for k, v in result.flat_sharpe.items()},
            "plots": [str(p) for p in plots],
            "last_epoch": asdict(result.records[-1]) if result.records else None,
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=True))
    finally:
        signal.signal(signal.SIGINT, previous)
    print(f"\n{sharpe_summary(result)}")
    if result.halted:
        print(f"HALTED: {result.halted}")
    if result.interrupted:
        print("interrupted: kept the epochs that finished")
    print(f"wrote {metrics_path}, {len(plots)} plots, checkpoints in {out / 'checkpoints'}, "
          f"{out / 'summary.json'} ({summary['wall_time_s']:.0f} s)")
    if result.interrupted:
        return 130
    return 1 if result.halted else 0
