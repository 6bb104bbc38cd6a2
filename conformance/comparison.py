"""The record of one comparison (:class:`Comparison`: passed or not, with its worst errors and
where they are) and its failure message in the style of ``torch.testing.assert_close``:
mismatch count and %, greatest absolute / relative / ULP difference and its index, the worst
error against its bound. :func:`foxhunt.conformance.tolerance.compare` fills it in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from foxhunt.conformance.tolerance import Tolerance


@dataclass
class Comparison:
    """The facts of one comparison (passed or not); :attr:`message` explains a failure."""

    name: str
    tolerance: Tolerance
    numel: int
    passed: bool = True
    mismatches: int = 0
    nan_map_equal: bool = True
    worst_abs: float = 0.0
    worst_abs_index: tuple | None = None
    worst_rel: float = 0.0
    worst_rel_index: tuple | None = None
    worst_ulp: int | None = None
    worst_ulp_index: tuple | None = None
    worst_ratio: float = 0.0  # max error / allowed over all elements (<= 1 passes)
    worst_ratio_index: tuple | None = None
    bound_at_worst: float | None = None
    rms_rel: float | None = None
    rms_bound: float | None = None
    problems: list[str] = field(default_factory=list)
    message: str = ""

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in (
            "name", "numel", "passed", "mismatches", "nan_map_equal", "worst_abs", "worst_rel",
            "worst_ulp", "worst_ratio", "bound_at_worst", "rms_rel", "rms_bound")}
        for k in ("worst_abs_index", "worst_rel_index", "worst_ulp_index", "worst_ratio_index"):
            idx = getattr(self, k)
            out[k] = None if idx is None else [int(i) for i in idx]
        out["tolerance"] = self.tolerance.describe()
        out["problems"] = list(self.problems)
        return {k: (_jsonable(v)) for k, v in out.items()}


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.floating, float)):
        f = float(v)
        return f if math.isfinite(f) else repr(f)
    if isinstance(v, np.integer):
        return int(v)
    return v


def _fmt_idx(idx: tuple | None) -> str:
    return "n/a" if idx is None else str(idx)


def failure_message(r: Comparison) -> str:
    tol = r.tolerance
    verb = "equal" if tol.kind == "exact" else "close"
    lines = [f"{r.name}: Tensor-likes are not {verb}! (tolerance: {tol.describe()})", ""]
    pct = 100.0 * r.mismatches / r.numel if r.numel else 0.0
    lines.append(f"Mismatched elements: {r.mismatches} / {r.numel} ({pct:.1f}%)")
    lines.append(f"Greatest absolute difference: {r.worst_abs!r} at index {_fmt_idx(r.worst_abs_index)}")
    lines.append(f"Greatest relative difference: {r.worst_rel!r} at index {_fmt_idx(r.worst_rel_index)}")
    if r.worst_ulp is not None:
        lines.append(f"Greatest ULP difference: {r.worst_ulp} at index {_fmt_idx(r.worst_ulp_index)}"
                     f" (up to {tol.max_ulp} allowed)")
    if tol.kind in ("reduction", "gemm") and r.worst_ratio_index is not None:
        lines.append(f"Worst error / bound: {r.worst_ratio:.3g} at index {_fmt_idx(r.worst_ratio_index)}"
                     f" (bound there {r.bound_at_worst!r})")
    lines.extend(r.problems)
    return "\n".join(lines)
