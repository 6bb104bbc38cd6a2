"""The n-step learning check of issue 22, on the CPU: n-step transitions (``--n-step``, 3)
against 1-step ones on the ``strong_trend`` market, the held-out Sharpe per epoch.

Each run is ``foxhunt.reference.loop.run`` (reference backend, one fold, the ``tiny`` preset
unless ``--preset`` says) with the same seed, data and settings but ``n_step``; per epoch the
validation and test Sharpe (the greedy policy on the held-out segments), averaged over
``--seeds`` seeds, and per seed the first epoch at which each run comes within ``1 - reach``
of the 1-step run's best validation Sharpe (its magnitude). The buy-and-hold Sharpe of the same segments is the
market's ceiling for a long-only policy.

    python benches/nstep_learning.py                  # tiny, 8 epochs x 100 steps, 2 seeds
    python benches/nstep_learning.py --epochs 12 --steps 200 --seeds 3
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # the reference step's BLAS, pinned (SPEC 11)

import numpy as np  # noqa: E402

from foxhunt.reference import loop  # noqa: E402
from foxhunt.reference.config import DQNConfig  # noqa: E402
from foxhunt.reference.market import SyntheticMarket  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--steps", type=int, default=100, help="training steps per epoch")
    p.add_argument("--bars", type=int, default=3000)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--n-step", type=int, default=3, help="the n-step run's n (against n = 1)")
    p.add_argument("--n-envs", type=int, default=16)
    p.add_argument("--v-range", type=float, default=None,
                   help="C51 support [-R, R] for both runs (default: the preset's v_min/v_max)")
    p.add_argument("--reach", type=float, default=0.95,
                   help="share of the 1-step runs' best mean validation Sharpe that counts as "
                        "reaching it (policies that are both always long differ by rounding)")
    return p.parse_args(argv)


def one_run(args, n_step: int, seed: int):
    """``(val Sharpe per epoch, test Sharpe per epoch, buy-and-hold val/test Sharpe, seconds)``."""
    overrides = {} if args.v_range is None else {"v_min": -args.v_range, "v_max": args.v_range}
    config = DQNConfig.preset(args.preset, **overrides)
    bars = SyntheticMarket.preset("strong_trend", seed=seed, n_bars=args.bars).generate()
    settings = loop.LoopSettings(folds=1, epochs=args.epochs, steps_per_epoch=args.steps,
                                 n_envs=args.n_envs, warmup_transitions=512,
                                 replay_capacity=20_000, seed=seed, n_step=n_step,
                                 val_frac=0.2, test_frac=0.2)
    tic = time.perf_counter()
    result = loop.run(config, bars, settings, backend="reference")
    seconds = time.perf_counter() - tic
    val = np.array([r.val_sharpe for r in result.records])
    test = np.array([r.test_sharpe for r in result.records])
    bh = result.folds[0].buy_hold
    return val, test, (bh["val"].sharpe, bh["test"].sharpe), seconds


def first_reaching(curve: np.ndarray, level: float) -> str:
    hit = np.flatnonzero(curve >= level)
    return str(int(hit[0])) if hit.size else "never"


def main(argv=None) -> None:
    args = parse(argv)
    runs = {n: [one_run(args, n, seed) for seed in range(args.seeds)] for n in (1, args.n_step)}
    mean = {n: (np.mean([r[0] for r in rs], 0), np.mean([r[1] for r in rs], 0))
            for n, rs in runs.items()}
    bh = np.mean([r[2] for r in runs[1]], 0)
    n = args.n_step
    print(f"strong_trend, preset {args.preset}, {args.bars} bars, {args.epochs} epochs x "
          f"{args.steps} steps, {args.n_envs} envs, mean of {args.seeds} seeds "
          f"(buy-and-hold Sharpe: val {bh[0]:.2f}, test {bh[1]:.2f})")
    print(f"{'epoch':>5} | {'val n=1':>8} {'val n=' + str(n):>8} | {'test n=1':>8} "
          f"{'test n=' + str(n):>9}")
    for e in range(args.epochs):
        print(f"{e:>5} | {mean[1][0][e]:8.2f} {mean[n][0][e]:8.2f} | {mean[1][1][e]:8.2f} "
              f"{mean[n][1][e]:9.2f}")
    print("per seed: the 1-step run's best val Sharpe, and the first epoch at which each run's "
          f"val Sharpe comes within {1 - args.reach:g} of its magnitude")
    for seed in range(args.seeds):
        best = float(runs[1][seed][0].max())
        target = best - (1 - args.reach) * abs(best)
        print(f"  seed {seed}: best {best:8.2f} (n={n} best {float(runs[n][seed][0].max()):8.2f}); "
              f"reached at epoch n=1 {first_reaching(runs[1][seed][0], target)}, "
              f"n={n} {first_reaching(runs[n][seed][0], target)}")
    for k, rs in runs.items():
        print(f"n={k}: wall {sum(r[3] for r in rs):.0f} s")


if __name__ == "__main__":
    main()
