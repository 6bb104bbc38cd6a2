"""What ``foxhunt sweep --trials-per-gpu K`` gives on one GPU: K ``foxhunt train --backend fast``
processes at once (one process per trial, as the sweep's Ray tasks start them), for K = 1, 2, 4, 8.

Each round starts K trials of the same sweep plan through ``sweep.run_trial`` (the sweep's own
subprocess, environment and BLAS-thread pinning, without Ray), K at a time, and reports the
aggregate training steps per second (all K trials' steps over the round's wall time, start-up
and kernel-cache loading included) and its ratio to K = 1; also the median of the trials'
per-epoch ``steps_per_s`` (``metrics.jsonl``: the steps alone). The default of
``--trials-per-gpu`` is the K past which the aggregate stops growing by more than 10%.

Run it on a GPU machine (a few minutes on an H200)::

    python benches/bench_sweep.py                     # K = 1,2,4,8; writes bench_sweep.json
    python benches/bench_sweep.py --ks 1,2 --epochs 1 # shorter
    FOXHUNT_BENCH_FULL=1 pytest benches/bench_sweep.py

Without a GPU it says so and exits 0; under pytest the test skips with that reason (and without
``FOXHUNT_BENCH_FULL=1``, since it takes minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from foxhunt.reference import sweep

KS = (1, 2, 4, 8)
#: A trial's plan: the ``seed`` preset's fast training, one fold (what a seed sweep runs).
FOLDS, EPOCHS, STEPS_PER_EPOCH = 1, 3, 300
#: The smallest relative gain in aggregate throughput that justifies more trials per GPU.
WORTH_IT = 1.10


def gpu_available() -> tuple[bool, str]:
    try:
        from foxhunt import fast

        return fast.cuda_available()
    except Exception as exc:  # the fast package failing to import is also "no GPU"
        return False, f"foxhunt.fast unavailable: {exc}"


def run_round(k: int, root: Path, epochs: int) -> dict:
    """K trials (seeds 0..K-1) at once; their aggregate steps per second."""
    spec = sweep.SweepSpec(backend="fast", seeds=tuple(range(k)), trials_per_gpu=k, common=(
        ("folds", FOLDS), ("epochs", epochs), ("steps_per_epoch", STEPS_PER_EPOCH)))
    trials = sweep.expand(spec)
    sweep_dir = root / f"k{k}"
    tic = time.perf_counter()
    with ThreadPoolExecutor(max_workers=k) as pool:
        records = list(pool.map(lambda t: sweep.run_trial(t, spec, sweep_dir), trials))
    wall = time.perf_counter() - tic
    failed = [r for r in records if r["status"] != "completed"]
    if failed:
        raise RuntimeError(f"K={k}: {failed[0]['trial']}: {failed[0].get('error')}")
    epoch_rates = [json.loads(line)["steps_per_s"] for r in records
                   for line in (Path(r["run_dir"]) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = k * FOLDS * epochs * STEPS_PER_EPOCH
    return {"k": k, "wall_s": wall, "steps": steps, "aggregate_steps_per_s": steps / wall,
            "median_epoch_steps_per_s": statistics.median(epoch_rates),
            "trial_wall_s": [r["wall_time_s"] for r in records]}


def recommend(rows: list[dict]) -> int:
    """The K past which one more doubling gains less than ``WORTH_IT`` in aggregate throughput."""
    best = rows[0]
    for row in rows[1:]:
        if row["aggregate_steps_per_s"] < WORTH_IT * best["aggregate_steps_per_s"]:
            break
        best = row
    return best["k"]


def measure(ks=KS, epochs: int = EPOCHS, log=print) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_sweep_") as tmp:
        for k in ks:
            rows.append(run_round(k, Path(tmp), epochs))
            row = rows[-1]
            log(f"K={k}: {row['aggregate_steps_per_s']:.0f} steps/s aggregate "
                f"({row['aggregate_steps_per_s'] / rows[0]['aggregate_steps_per_s']:.2f}x K={rows[0]['k']}), "
                f"median epoch {row['median_epoch_steps_per_s']:.0f} steps/s per trial, round {row['wall_s']:.1f} s")
    return {"rows": rows, "recommended_trials_per_gpu": recommend(rows),
            "plan": {"preset": "seed", "folds": FOLDS, "epochs": epochs, "steps_per_epoch": STEPS_PER_EPOCH}}


@pytest.mark.gpu
@pytest.mark.slow
def test_trials_per_gpu():
    ok, reason = gpu_available()
    if not ok:
        pytest.skip(f"needs an NVIDIA GPU: {reason}")
    if os.environ.get("FOXHUNT_BENCH_FULL") != "1":
        pytest.skip("K = 1, 2, 4, 8 trials on one GPU take minutes: set FOXHUNT_BENCH_FULL=1 to run it")
    result = measure()
    rows = result["rows"]
    assert all(r["aggregate_steps_per_s"] > 0 for r in rows)
    assert result["recommended_trials_per_gpu"] in KS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default=",".join(map(str, KS)), help="trials per GPU to try (default 1,2,4,8)")
    parser.add_argument("--epochs", type=int, default=EPOCHS, help=f"epochs per trial (default {EPOCHS})")
    parser.add_argument("--out", type=Path, default=Path("bench_sweep.json"))
    args = parser.parse_args(argv)
    ok, reason = gpu_available()
    if not ok:
        print(f"bench_sweep: skipped, no GPU ({reason})")
        return 0
    result = measure(tuple(int(k) for k in args.ks.split(",")), args.epochs)
    print(f"recommended --trials-per-gpu: {result['recommended_trials_per_gpu']}")
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
