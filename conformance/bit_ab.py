"""Bitwise A/B of kernels between two revisions: do the changed kernels still give the same bits?

    python conformance/bit_ab.py dump OUT.npz KERNEL[,KERNEL...] [--backend fast|reference]
    python conformance/bit_ab.py compare BASE.npz HEAD.npz

``dump`` runs every sample shape case and every extremal case of the named kernels
(``registry.SPECS``: the conformance suite's own inputs, drawn from the same seeded generators
as ``conformance/test_kernels.py``) through the fast test entry (or the reference twin) of the
``foxhunt`` it imports, and saves each output array as ``<kernel>/<s|x>/<case>.<output>`` in an
npz. Run it once with the base revision's ``foxhunt`` first on the path (e.g. an install of
``git archive BASE`` into a folder put before the rest of ``PYTHONPATH``) and once with the
head's; ``compare`` then prints, per kernel, how many output arrays are byte for byte equal and
which differ (with the number of differing elements), and exits 1 if any array differs or is
missing on one side. A kernel rewrite that keeps every operation and its order must pass it; the
conformance suite alone would accept a rewrite that changed bits within its tolerance.
"""

from __future__ import annotations

import argparse
import sys
import zlib
from collections.abc import Sequence

import numpy as np


def _rng(*key: str) -> np.random.Generator:
    """conformance/test_kernels.py's generator for a (kernel, case) key."""
    return np.random.default_rng(zlib.crc32("/".join(key).encode()))


def case_outputs(names: Sequence[str], backend: str = "fast") -> dict[str, np.ndarray]:
    """Every sample and extremal case's outputs of the kernels ``names``, keyed
    ``<kernel>/<s|x>/<case>.<output>``."""
    from foxhunt.conformance import registry

    unknown = [n for n in names if n not in registry.SPECS]
    if unknown:
        raise ValueError(f"kernels: {unknown} are not in the conformance registry")
    if backend not in ("fast", "reference"):
        raise ValueError(f"backend: {backend!r}; expected 'fast' or 'reference'")
    out = {}
    for name in names:
        spec = registry.SPECS[name]
        entry = spec.fast if backend == "fast" else spec.ref
        if entry is None:
            raise ValueError(f"{name}: no {backend} entry")
        cases = [("s", c, spec.sample_inputs(c, _rng(name, c))) for c in spec.shape_cases]
        cases += [("x", c, spec.extremal_case(c, _rng(name, c))) for c in spec.extremal_labels()]
        for kind, label, kwargs in cases:
            with np.errstate(all="ignore"):
                result = entry(**{k: v.copy() if isinstance(v, np.ndarray) else v
                                  for k, v in kwargs.items()})
            for key, value in spec.split_outputs(result).items():
                out[f"{name}/{kind}/{label}.{key}"] = np.asarray(value)
    return out


def compare(base: dict, head: dict) -> tuple[dict[str, list[int]], list[str]]:
    """Per kernel ``[equal, different]`` array counts, and one line per array that differs
    (shape, dtype or bytes) or exists on one side only."""
    per, problems = {}, []
    for key in sorted(set(base) | set(head)):
        counts = per.setdefault(key.split("/")[0], [0, 0])
        if key not in base or key not in head:
            counts[1] += 1
            problems.append(f"{key}: only in {'head' if key in head else 'base'}")
            continue
        a, b = np.asarray(base[key]), np.asarray(head[key])
        if a.shape != b.shape or a.dtype != b.dtype:
            counts[1] += 1
            problems.append(f"{key}: {a.dtype}{a.shape} against {b.dtype}{b.shape}")
        elif a.tobytes() != b.tobytes():
            counts[1] += 1
            width = max(a.dtype.itemsize, 1)
            rows_a = np.frombuffer(a.tobytes(), np.uint8).reshape(-1, width)
            rows_b = np.frombuffer(b.tobytes(), np.uint8).reshape(-1, width)
            differ = np.flatnonzero((rows_a != rows_b).any(axis=1))
            problems.append(f"{key}: {differ.size} of {a.size} elements differ (first at "
                            f"{differ[:4].tolist()})")
        else:
            counts[0] += 1
    return per, problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dump = sub.add_parser("dump", help="every case's outputs of the named kernels into an npz")
    dump.add_argument("out")
    dump.add_argument("kernels", help="comma-separated kernel names")
    dump.add_argument("--backend", default="fast", choices=("fast", "reference"))
    cmp = sub.add_parser("compare", help="two dumps, byte for byte")
    cmp.add_argument("base")
    cmp.add_argument("head")
    args = parser.parse_args(argv)
    if args.command == "dump":
        outputs = case_outputs([n for n in args.kernels.split(",") if n], args.backend)
        np.savez(args.out, **outputs)
        print(f"{args.out}: {len(outputs)} arrays")
        return 0
    with np.load(args.base) as a, np.load(args.head) as b:
        per, problems = compare({k: a[k] for k in a.files}, {k: b[k] for k in b.files})
    for line in problems:
        print("DIFF", line)
    for name, (same, differ) in per.items():
        print(f"{name:<40} {same} equal, {differ} differ")
    print("bitwise A/B:", "OK" if not problems else f"{len(problems)} arrays differ")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
