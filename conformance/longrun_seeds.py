"""The long-run parity test's noise floor: ``test_longrun``'s 50-epoch run over several seeds and
implementation variants, and the criteria applied pair by pair.

The parity criteria (``test_longrun.TOLERANCES``) compare one BF16 run with one F32 run. Their
trajectories diverge chaotically from the first step, so a criterion means something only if two
*F32* runs that differ in nothing but the order of their floating-point sums meet it. This tool
measures that::

    # one JSON line per run (appended and flushed as each run ends)
    python -m foxhunt.conformance.longrun_seeds run --precision f32 --seeds 0-7 --out f32.jsonl
    python -m foxhunt.conformance.longrun_seeds run --precision f32 --seeds 0-7 \\
        --gemm-workspace default --out f32_alt.jsonl    # other cuBLASLt algorithms, same math
    python -m foxhunt.conformance.longrun_seeds run --precision bf16 --seeds 0-7 --out bf16.jsonl
    # each criterion per seed, relative to the first file's run of that seed
    python -m foxhunt.conformance.longrun_seeds compare f32.jsonl f32_alt.jsonl
    python -m foxhunt.conformance.longrun_seeds compare f32.jsonl bf16.jsonl

``--gemm-workspace default`` plans every GEMM with cuBLASLt's default workspace limit instead
of none (``fast.step_plan.GEMM_WORKSPACE_LIMIT``): cuBLASLt then picks other algorithms (split-K
among them) and the head backward GEMMs take the DRELU_BGRAD epilogue instead of the plain GEMM
plus ``relu_mask_bias_grad``: the same step within its conformance bounds, summed in another
order. ``--backend reference`` runs the NumPy reference on the CPU (about 11 minutes per F32
run on 2 cores). The market is always ``LONGRUN_SEED``'s; ``--seeds`` seed everything else.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from foxhunt.conformance.test_longrun import TOLERANCES, relative_difference, train

VARIANT_KEYS = ("backend", "precision", "gemm_workspace")


def parse_seeds(text: str) -> list[int]:
    """``"0-7"``, ``"3"`` or ``"0,2,5-6"`` -> the listed seeds in order (non-negative integers)."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"--seeds={text!r}: expected integers and ranges like '0-7' or '0,3'") from None
        if first < 0 or last < first:
            raise ValueError(f"--seeds={text!r}: range {part.strip()!r} must run from a "
                             "non-negative integer up to one at least as large")
        seeds.extend(range(first, last + 1))
    return seeds


def run_seeds(precision: str, seeds: list[int], backend: str, gemm_workspace: str, out: Path) -> None:
    if gemm_workspace == "default":
        if backend != "fast":
            raise ValueError(f"--gemm-workspace default: only for --backend fast, not {backend!r}")
        from foxhunt.fast import step_plan

        step_plan.GEMM_WORKSPACE_LIMIT = None
    for seed in seeds:
        summary = train(precision, seed=seed, backend=backend).__dict__
        summary.update(seed=seed, backend=backend, gemm_workspace=gemm_workspace)
        with open(out, "a") as fh:
            fh.write(json.dumps(summary) + "\n")
        print(f"seed {seed}: final Sharpe {summary['final_sharpe']:.4g}, mean Q "
              f"{summary['mean_q']:.4g}, gradient norm mean {summary['grad_norm_mean']:.4g}, "
              f"max {summary['grad_norm_max']:.4g}", flush=True)


def load_runs(path: Path) -> dict[int, dict]:
    """The runs of one JSON-lines file by seed; every run must be of the same variant."""
    runs: dict[int, dict] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        run_ = json.loads(line)
        missing = [k for k in ("seed", *VARIANT_KEYS, *TOLERANCES) if k not in run_]
        if missing:
            raise ValueError(f"{path}:{n}: not a longrun_seeds record (missing {', '.join(missing)})")
        first = next(iter(runs.values()), run_)
        if any(run_[k] != first[k] for k in VARIANT_KEYS):
            raise ValueError(f"{path}:{n}: mixes variants ({', '.join(f'{k}={run_[k]}' for k in VARIANT_KEYS)})")
        if run_["seed"] in runs:
            raise ValueError(f"{path}:{n}: seed {run_['seed']} appears twice")
        runs[run_["seed"]] = run_
    if not runs:
        raise ValueError(f"{path}: no runs")
    return runs


def compare(base: dict[int, dict], other: dict[int, dict]) -> tuple[list[str], dict[str, int], int]:
    """Per seed in both: each criterion's relative difference of ``other`` from ``base`` (the
    F32 run), marked ``*`` where it is beyond its tolerance. Returns the table lines, how many
    seeds met each criterion, and the number of seeds compared."""
    seeds = sorted(set(base) & set(other))
    if not seeds:
        raise ValueError("the two files have no seed in common")
    met = dict.fromkeys(TOLERANCES, 0)
    lines = ["| seed | " + " | ".join(f"{k} (tolerance {t:.0%})" for k, t in TOLERANCES.items()) + " |",
             "|---|" + "---|" * len(TOLERANCES)]
    for seed in seeds:
        cells = []
        for key, tol in TOLERANCES.items():
            a, b = base[seed][key], other[seed][key]
            rel = relative_difference(b, a)
            ok = math.isfinite(a) and math.isfinite(b) and rel <= tol
            met[key] += ok
            cells.append(f"{a:.4g} vs {b:.4g}: {rel:.1%}{'' if ok else ' *'}")
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    lines.append("| within tolerance | " + " | ".join(f"{met[k]} of {len(seeds)}" for k in TOLERANCES) + " |")
    return lines, met, len(seeds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m foxhunt.conformance.longrun_seeds",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="50-epoch long runs, one per seed, appended to --out")
    r.add_argument("--precision", choices=("f32", "bf16"), required=True)
    r.add_argument("--seeds", default="0", help="e.g. 0-7 or 0,3 (default 0)")
    r.add_argument("--backend", choices=("fast", "reference"), default="fast")
    r.add_argument("--gemm-workspace", choices=("none", "default"), default="none")
    r.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("compare", help="the criteria per seed, relative to the first file")
    c.add_argument("base", type=Path)
    c.add_argument("other", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            run_seeds(args.precision, parse_seeds(args.seeds), args.backend, args.gemm_workspace, args.out)
        else:
            lines, _, _ = compare(load_runs(args.base), load_runs(args.other))
            print("\n".join(lines))
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
