"""Population throughput (issue 24): aggregate steps per second of ``fast.Population`` against one
fast ``Trainer``, in one process on one GPU.

    python benches/bench_population.py [--preset seed] [--precision bf16] [--members 1 16 64]
                                       [--steps 200] [--gemm-workspace none] [--out FILE.json]

For the single trainer and for a population of each ``--members`` N (seeds 0 .. N-1), after two
warm-up steps on random batches:

- ``gpu_us``: the device time of one step (the upload graph, graph 1 and graph 2 enqueued by
  the engine's ``launch`` from a filled staging buffer), ``--steps`` of them between two CUDA
  events on the step stream (``fast.device.driver_event_time``): what the GPU can do;
- ``wall_us``: the host's time per step of ``step(batches)`` over ``--steps`` steps, then one
  synchronisation: the batches' checks and their copy into the staging buffer included (a
  training loop whose batches come from the host pays it);
- ``steps/s``: ``N / gpu_us`` (members' steps per second) and ``x single``: that over the single
  trainer's steps per second (issue 24 asks for 10x at N = 16 and 30x at N = 64, and N = 1 no
  slower than the single trainer).

The N = 1 population runs the member build (every kernel with its member parameters) so that
row is the cost of the member dimension itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from foxhunt.reference.config import PRECISIONS

ROOT = Path(__file__).resolve().parents[1]


def _time_steps(step, sync, steps: int) -> float:
    tic = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - tic) / steps


def measure(config, members: int | None, steps: int, gemm_workspace: str = "none") -> dict:
    """One row: the single trainer (``members`` None) or a population of ``members``."""
    from foxhunt.fast import Trainer
    from foxhunt.fast.device import driver_event_time
    from foxhunt.fast.population import Population
    from foxhunt.reference.batch import Batch

    rng = np.random.default_rng(0)
    n = 1 if members is None else members
    batches = [Batch.random(config, rng) for _ in range(n)]
    if members is None:
        owner = Trainer(config, seed=0, gemm_workspace=gemm_workspace)
        step = lambda: owner.step(batches[0])  # noqa: E731
    else:
        owner = Population(config, list(range(members)), gemm_workspace=gemm_workspace)
        step = lambda: owner.step(batches)  # noqa: E731
    try:
        engine = owner.engine
        for _ in range(2):
            step()
        engine.synchronize()
        wall = _time_steps(step, engine.synchronize, steps)
        engine.synchronize()
        gpu = driver_event_time(engine.stream, lambda: engine.launch(0), steps)
        engine.forget_uploads()
        return {"impl": "single" if members is None else f"population N={members}",
                "members": n, "gpu_us": gpu * 1e6, "wall_us": wall * 1e6,
                "steps_per_s": n / gpu, "host_steps_per_s": n / wall}
    finally:
        owner.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="seed")
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS)
    parser.add_argument("--members", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--gemm-workspace", default="none", choices=("none", "default"),
                        help="the trainers' cuBLASLt workspace policy (step_program)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from foxhunt.fast.device import Device, cuda_available
    from foxhunt.reference.config import DQNConfig

    ok, reason = cuda_available()
    if not ok:
        print(f"bench_population: no CUDA device ({reason})", file=sys.stderr)
        return 2
    config = DQNConfig.preset(args.preset, precision=args.precision)
    rows = [measure(config, n, args.steps, args.gemm_workspace) for n in (None, *args.members)]
    single = rows[0]["steps_per_s"]
    print(f"population throughput: {Device(0).name}, preset {args.preset}, {args.precision}, "
          f"{args.steps} steps per row, GEMM workspace {args.gemm_workspace}")
    print(f"{'impl':<20}{'gpu_us':>10}{'wall_us':>10}{'steps/s':>12}{'x single':>10}{'host x':>8}")
    for r in rows:
        r["x_single"] = r["steps_per_s"] / single
        r["host_x_single"] = r["host_steps_per_s"] / rows[0]["host_steps_per_s"]
        print(f"{r['impl']:<20}{r['gpu_us']:>10.1f}{r['wall_us']:>10.1f}{r['steps_per_s']:>12.0f}"
              f"{r['x_single']:>10.2f}{r['host_x_single']:>8.2f}")
    if args.out:
        args.out.write_text(json.dumps({"preset": args.preset, "precision": args.precision,
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
