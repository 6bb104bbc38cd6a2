"""Long-run parity as a statistic over seeds (SPEC 8): the 50-epoch run of ``test_longrun`` for
K seeds in three variants of the fast backend, and the spread and bias criteria over them.

The variants (``VARIANTS``), each run once per seed:

- ``f32``: ``precision="f32"``, GEMMs planned without workspace (the default);
- ``f32_alt``: the same F32 step with every GEMM planned with cuBLASLt's default workspace
  limit (the fast ``Trainer``'s ``gemm_workspace="default"``): cuBLASLt then picks other
  algorithms (split-K among them) and the head backward GEMMs take the DRELU_BGRAD epilogue
  instead of the plain GEMM plus ``relu_mask_bias_grad``: the same math within its conformance
  bounds, summed in another order. Its distance from ``f32`` is the reordering noise of one
  50-epoch run;
- ``bf16``: ``precision="bf16"``, GEMMs as in ``f32``.

For each metric m of ``METRICS``, with ``dp_k = m(bf16)_k - m(f32)_k`` and
``dn_k = m(f32_alt)_k - m(f32)_k`` over the K seeds every file has (``parity_statistic``):

- spread: ``median_k |dp_k| <= 2 * median_k |dn_k|``;
- bias: ``|mean(dp) - mean(dn)| <= 3 * sqrt(var(dp)/K + var(dn)/K)``.

Usage::

    # the three variants for seeds 0-15, 12 worker processes sharing the GPU; one JSON line per
    # run appended to DIR/f32.jsonl, DIR/f32_alt.jsonl, DIR/bf16.jsonl as each run ends (a seed
    # already in a file is skipped, so running it again completes what is missing)
    python -m foxhunt.conformance.longrun_seeds run --seeds 0-15 --jobs 12 --out-dir DIR
    # the criteria: one table, exit status 1 when a criterion fails
    python -m foxhunt.conformance.longrun_seeds compare DIR/f32.jsonl DIR/f32_alt.jsonl DIR/bf16.jsonl

``run --backend reference --variants f32,bf16`` runs the NumPy reference on the CPU instead
(about 11 minutes per F32 run on 2 cores) into ``reference_f32.jsonl`` / ``reference_bf16.jsonl``;
it has no ``f32_alt`` variant and ``compare`` takes fast-backend files only. The market is
always ``test_longrun.LONGRUN_SEED``'s; the seed seeds everything else.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from foxhunt.reference.seeds import MAX_SEEDS, seed_ranges

#: The metrics of a run (fields of ``test_longrun.RunSummary``) and how the table names them.
METRICS = {"final_sharpe": "final held-out Sharpe", "mean_q": "mean Q",
           "grad_norm_mean": "gradient-norm mean", "grad_norm_max": "gradient-norm max"}
#: The fields that say which variant a record is.
VARIANT_KEYS = ("backend", "precision", "gemm_workspace")
#: Variant name -> (precision, GEMM workspace); ``compare`` takes them in this order.
VARIANTS = {"f32": ("f32", "none"), "f32_alt": ("f32", "default"), "bf16": ("bf16", "none")}
BACKENDS = ("fast", "reference")
#: Fewest seeds the statistic is computed on (a sample variance and a median need a few).
MIN_SEEDS = 3
#: Worker processes of ``run``: on the H200 runs sharing the GPU are bound by its
#: time-slicing, so more workers only stretch each run.
DEFAULT_JOBS = 12
#: Pinned to one thread in every worker, so that parallel runs do not oversubscribe the CPU.
BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
SPREAD_FACTOR = 2.0
BIAS_STANDARD_ERRORS = 3.0


class RunFailed(ValueError):
    """A run that cannot take part in the statistic (halted, or a non-finite metric): a
    parity failure, not a usage error."""


# ------------------------------------------------------------------------------ records
def parse_seeds(text: str) -> list[int]:
    """``"0-7"``, ``"3"`` or ``"0,2,5-6"`` -> the listed seeds in order (non-negative integers)."""
    try:
        return list(seed_ranges(text, MAX_SEEDS))
    except ValueError as exc:
        raise ValueError(f"--seeds={text!r}: {exc}; expected integers and ranges like '0-7' or "
                         "'0,3'") from None


def variant_fields(variant: str, backend: str = "fast") -> dict[str, str]:
    """The ``VARIANT_KEYS`` values a record of ``variant`` on ``backend`` carries."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: expected one of {', '.join(VARIANTS)}")
    if backend not in BACKENDS:
        raise ValueError(f"--backend={backend!r}: expected one of {', '.join(BACKENDS)}")
    precision, workspace = VARIANTS[variant]
    if backend != "fast" and workspace != "none":
        raise ValueError(f"variant {variant!r} (GEMM workspace {workspace!r}) exists on the fast "
                         f"backend only, not --backend={backend!r}")
    return {"backend": backend, "precision": precision, "gemm_workspace": workspace}


def variant_file(out_dir: Path, variant: str, backend: str = "fast") -> Path:
    """``DIR/f32.jsonl`` etc.; the reference backend's files are ``DIR/reference_f32.jsonl``."""
    return Path(out_dir) / f"{'' if backend == 'fast' else backend + '_'}{variant}.jsonl"


def load_runs(path: Path, variant: str | None = None, backend: str = "fast") -> dict[int, dict]:
    """The runs of one JSON-lines file by seed. Every line needs ``seed``, ``VARIANT_KEYS`` and
    ``METRICS``; every run must be of one variant (``variant`` on ``backend`` when given); a
    seed may appear once. A missing file is an error; an empty one has no runs."""
    path = Path(path)
    expected = variant_fields(variant, backend) if variant is not None else None
    runs: dict[int, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
        missing = [k for k in ("seed", *VARIANT_KEYS, *METRICS) if k not in record]
        if missing:
            raise ValueError(f"{path}:{n}: not a longrun_seeds record (missing {', '.join(missing)})")
        wrong = [f"{k}={record[k]!r}" for k in ("seed", *METRICS)
                 if isinstance(record[k], bool) or not isinstance(record[k], int if k == "seed" else (int, float))]
        if wrong:
            raise ValueError(f"{path}:{n}: {', '.join(wrong)}: the seed must be an integer, a metric a number")
        fields = {k: record[k] for k in VARIANT_KEYS}
        want = expected or {k: next(iter(runs.values()), record)[k] for k in VARIANT_KEYS}
        if fields != want:
            what = f"the {variant} variant" if variant else "the variant of the file's first run"
            raise ValueError(f"{path}:{n}: a run with {_fields(fields)}, not {what} ({_fields(want)})")
        if record["seed"] in runs:
            raise ValueError(f"{path}:{n}: seed {record['seed']} appears twice")
        runs[record["seed"]] = record
    return runs


def _fields(fields: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in fields.items())


# ------------------------------------------------------------------------------ the statistic
@dataclass(frozen=True)
class ParityRow:
    """The SPEC 8 criteria for one metric over K seeds."""

    metric: str
    k: int
    median_dp: float  # median_k |dp_k|
    spread_bound: float  # SPREAD_FACTOR * median_k |dn_k|
    bias: float  # |mean(dp) - mean(dn)|
    bias_bound: float  # BIAS_STANDARD_ERRORS * sqrt(var(dp)/K + var(dn)/K)

    @property
    def spread_ok(self) -> bool:
        return self.median_dp <= self.spread_bound

    @property
    def bias_ok(self) -> bool:
        return self.bias <= self.bias_bound

    @property
    def ok(self) -> bool:
        return self.spread_ok and self.bias_ok


def paired_criteria(metric: str, dp, dn) -> ParityRow:
    """Spread and bias of the precision differences ``dp`` against the reordering differences
    ``dn`` (1-D, one per seed, the same K >= ``MIN_SEEDS`` seeds in the same order, finite):

    - ``median_dp = median(|dp|)``, ``spread_bound = 2 * median(|dn|)``;
    - ``bias = |mean(dp) - mean(dn)|``, ``bias_bound = 3 * sqrt(var(dp)/K + var(dn)/K)``, where
      ``var`` is the sample variance ``sum((x - mean(x))**2) / (K - 1)`` (ddof=1): the bound is
      three standard errors of the difference of the two means (the two samples taken as
      independent).
    """
    dp, dn = np.asarray(dp, np.float64), np.asarray(dn, np.float64)
    if dp.ndim != 1 or dp.shape != dn.shape:
        raise ValueError(f"{metric}: dp and dn must be 1-D and of one length, not {dp.shape} and {dn.shape}")
    k = dp.size
    if k < MIN_SEEDS:
        raise ValueError(f"K={k} seeds: the statistic needs at least {MIN_SEEDS}")
    if not (np.isfinite(dp).all() and np.isfinite(dn).all()):
        raise RunFailed(f"{metric}: non-finite differences (dp {dp.tolist()}, dn {dn.tolist()})")
    return ParityRow(
        metric=metric, k=k,
        median_dp=float(np.median(np.abs(dp))),
        spread_bound=SPREAD_FACTOR * float(np.median(np.abs(dn))),
        bias=abs(float(dp.mean()) - float(dn.mean())),
        bias_bound=BIAS_STANDARD_ERRORS * math.sqrt(dp.var(ddof=1) / k + dn.var(ddof=1) / k))


def common_seeds(*variants: Mapping[int, Mapping]) -> list[int]:
    """The seeds every one of ``variants`` (seed -> record) has, in order."""
    return sorted(set.intersection(*(set(v) for v in variants)))


def parity_statistic(f32: Mapping[int, Mapping], f32_alt: Mapping[int, Mapping],
                     bf16: Mapping[int, Mapping]) -> list[ParityRow]:
    """One ``ParityRow`` per metric of ``METRICS`` over the seeds all three variants have
    (each a mapping seed -> record with the ``METRICS`` fields): ``dp = bf16 - f32``,
    ``dn = f32_alt - f32`` (see ``paired_criteria``). Raises ``ValueError`` for fewer than
    ``MIN_SEEDS`` common seeds and ``RunFailed`` for a halted run or a non-finite metric."""
    runs = {"f32": f32, "f32_alt": f32_alt, "bf16": bf16}
    seeds = common_seeds(*runs.values())
    if len(seeds) < MIN_SEEDS:
        raise ValueError(f"K={len(seeds)} seeds: the statistic needs at least {MIN_SEEDS}")
    values = {}
    for name, by_seed in runs.items():
        for seed in seeds:
            record = by_seed[seed]
            if record.get("halted"):
                raise RunFailed(f"{name} seed {seed}: the run halted ({record['halted']}) after "
                                f"{record.get('epochs', '?')} epochs")
            bad = [f"{m}={record[m]}" for m in METRICS if not math.isfinite(record[m])]
            if bad:
                raise RunFailed(f"{name} seed {seed}: non-finite {', '.join(bad)}")
        values[name] = {m: np.array([by_seed[s][m] for s in seeds], np.float64) for m in METRICS}
    return [paired_criteria(m, values["bf16"][m] - values["f32"][m],
                            values["f32_alt"][m] - values["f32"][m]) for m in METRICS]


def format_table(rows: list[ParityRow], seeds: list[int]) -> str:
    """The rows as one markdown table and an overall line."""
    mark = {True: "pass", False: "**fail**"}
    lines = ["| metric | K | median \\|dp\\| | 2 x median \\|dn\\| | spread "
             "| \\|mean dp - mean dn\\| | 3 standard errors | bias |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {METRICS[r.metric]} | {r.k} | {r.median_dp:.4g} | {r.spread_bound:.4g} | "
                     f"{mark[r.spread_ok]} | {r.bias:.4g} | {r.bias_bound:.4g} | {mark[r.bias_ok]} |")
    failed = [f"{METRICS[r.metric]} {c}" for r in rows
              for c, ok in (("spread", r.spread_ok), ("bias", r.bias_ok)) if not ok]
    lines.append("")
    lines.append(f"K = {len(seeds)} seeds ({format_seeds(seeds)}): "
                 + (f"FAIL ({', '.join(failed)})" if failed else "every criterion passes"))
    return "\n".join(lines)


def format_seeds(seeds: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive seeds
    for s in seeds:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def compare(paths: Mapping[str, Path]) -> tuple[str, bool]:
    """``paths``: variant name -> its file. The table of ``parity_statistic`` over the common
    seeds (with a note naming any seed left out) and whether every criterion passes."""
    runs = {name: load_runs(paths[name], name) for name in VARIANTS}
    seeds = common_seeds(*runs.values())
    rows = parity_statistic(**runs)
    table = format_table(rows, seeds)
    left_out = {name: sorted(set(r) - set(seeds)) for name, r in runs.items()}
    notes = [f"{name}: {format_seeds(s)}" for name, s in left_out.items() if s]
    if notes:
        table += f"\nleft out (not in every file): {'; '.join(notes)}"
    return table, all(r.ok for r in rows)


# ------------------------------------------------------------------------------ the runs
def run_one(variant: str, seed: int, backend: str = "fast") -> dict:
    """One 50-epoch run in this process: ``test_longrun.train``'s summary plus ``seed``,
    ``VARIANT_KEYS`` and ``wall_s`` (seconds of the run itself)."""
    from foxhunt.conformance.test_longrun import train  # the test module imports this one

    fields = variant_fields(variant, backend)
    trainer = backend
    if backend == "fast":  # the fast Trainer with the variant's GEMM workspace policy
        import functools

        from foxhunt.fast import Trainer as FastTrainer

        trainer = functools.partial(FastTrainer, gemm_workspace=fields["gemm_workspace"])
    start = time.perf_counter()
    record = train(fields["precision"], seed=seed, backend=trainer).__dict__
    record.update(seed=seed, **fields, wall_s=time.perf_counter() - start)
    return record


def child_command(variant: str, seed: int, backend: str, record: Path) -> list[str]:
    """The worker process of one run: ``one`` writes its record to ``record``."""
    return [sys.executable, "-m", "foxhunt.conformance.longrun_seeds", "one", "--variant", variant,
            "--seed", str(seed), "--backend", backend, "--record", str(record)]


def run_in_subprocess(variant: str, seed: int, backend: str) -> dict:
    """``run_one`` in a worker process with its BLAS threads pinned to one (``BLAS_THREAD_VARS``).
    Raises ``RunFailed`` with the end of its output when it exits non-zero."""
    env = {**os.environ, **dict.fromkeys(BLAS_THREAD_VARS, "1")}
    with tempfile.TemporaryDirectory(prefix="longrun_") as tmp:
        record = Path(tmp) / "record.json"
        proc = subprocess.run(child_command(variant, seed, backend, record), env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0 or not record.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:] or ["(no output)"]
            # the first line (the summary of ``run``) ends with the last line of the output
            raise RunFailed(f"{variant} seed {seed}: the worker exited with {proc.returncode}: "
                            f"{tail[-1]}\n" + "\n".join(tail))
        return json.loads(record.read_text())


def append_record(path: Path, record: Mapping) -> None:
    """``path`` with one more JSON line, replaced whole (never half-written)."""
    old = path.read_text() if path.exists() else ""
    if old and not old.endswith("\n"):
        old += "\n"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(old + json.dumps(record) + "\n")
    os.replace(tmp, path)


def run_variants(seeds: list[int], out_dir: Path, *, variants: tuple[str, ...] = tuple(VARIANTS),
                 backend: str = "fast", jobs: int = DEFAULT_JOBS,
                 log: Callable[[str], None] = print) -> list[str]:
    """Every (variant, seed) not yet in ``out_dir``'s file of that variant, ``jobs`` at a time,
    each in its own worker process (``run_in_subprocess``); each record is appended to its
    variant's file as its run ends. Returns the failures (one line each; empty when all ran)."""
    if jobs < 1:
        raise ValueError(f"--jobs={jobs}: expected a positive integer")
    if not seeds:
        raise ValueError("--seeds: no seed given")
    files = {v: variant_file(out_dir, v, backend) for v in variants}
    for v in variants:
        variant_fields(v, backend)  # rejects an unknown variant or one the backend lacks
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    done = {v: set(load_runs(f, v, backend)) if f.exists() else set() for v, f in files.items()}
    todo = [(v, s) for s in seeds for v in variants if s not in done[v]]
    skipped = len(seeds) * len(variants) - len(todo)
    log(f"{len(todo)} runs to do, {skipped} already in {out_dir}, {min(jobs, max(len(todo), 1))} at a time")
    failures: list[str] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_in_subprocess, v, s, backend): (v, s) for v, s in todo}
        for future in as_completed(futures):
            v, s = futures[future]
            try:
                record = future.result()
            except RunFailed as exc:
                failures.append(str(exc).splitlines()[0])
                log(str(exc))
                continue
            append_record(files[v], record)
            log(f"{v} seed {s} ({record['wall_s']:.0f} s): " + ", ".join(
                f"{METRICS[m]} {record[m]:.4g}" for m in METRICS))
    return failures


# ------------------------------------------------------------------------------ the CLI
def main(argv: list[str] | None = None) -> int:
    """Exit status 0: done / every criterion passes; 1: a run or a criterion failed;
    2: usage error (argparse)."""
    parser = argparse.ArgumentParser(prog="python -m foxhunt.conformance.longrun_seeds",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="the 50-epoch runs of the variants for --seeds, --jobs at a time")
    r.add_argument("--seeds", default="0-15", help="e.g. 0-15 (the default) or 0,3")
    r.add_argument("--variants", default=",".join(VARIANTS), help=f"default {','.join(VARIANTS)}")
    r.add_argument("--backend", choices=BACKENDS, default="fast")
    r.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help=f"worker processes (default {DEFAULT_JOBS})")
    r.add_argument("--out-dir", type=Path, required=True)
    o = sub.add_parser("one", help="one run in this process (what each worker of `run` does)")
    o.add_argument("--variant", choices=list(VARIANTS), required=True)
    o.add_argument("--seed", type=int, required=True)
    o.add_argument("--backend", choices=BACKENDS, default="fast")
    o.add_argument("--record", type=Path, required=True, help="where the run's JSON record goes")
    c = sub.add_parser("compare", help="the SPEC 8 spread and bias criteria of three variants' files")
    for name in VARIANTS:
        c.add_argument(name, type=Path, help=f"the {name} variant's JSON-lines file")
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            variants = [v.strip() for v in args.variants.split(",")]
            failures = run_variants(parse_seeds(args.seeds), args.out_dir, variants=variants,
                                    backend=args.backend, jobs=args.jobs)
            if failures:
                print(f"{len(failures)} runs failed:\n" + "\n".join(failures), file=sys.stderr)
            return 1 if failures else 0
        if args.command == "one":
            variant_fields(args.variant, args.backend)
            record = run_one(args.variant, args.seed, args.backend)
            tmp = args.record.with_name(f".{args.record.name}.tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, args.record)
            return 0
        table, ok = compare({name: getattr(args, name) for name in VARIANTS})
        print(table)
        return 0 if ok else 1
    except RunFailed as exc:
        print(f"long-run parity failed: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
