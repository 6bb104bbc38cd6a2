"""Results of a conformance run: a pytest plugin that collects one record per test, a table
(kernel/check, cases, worst error vs bound, NaN-map equal, pass/fail) and a JSON report with
the device (GPU name, driver, CUDA and NVRTC versions, or "no GPU").

Tests tag themselves with ``record_property("kernel"|"check"|"case", ...)`` and attach each
:class:`foxhunt.conformance.tolerance.Comparison` as ``record_property("comparison",
result.as_dict())``; tests skipped before their body runs are tagged from their parameters.
"""

from __future__ import annotations

import json
import math
import platform
import shutil
import subprocess
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

import pytest

from foxhunt.conformance.registry import cuda_availability

#: The reference self-checks and registry checks of one kernel share one table row.
SELF_CHECKS = "reference self-checks"

#: Check names of the test functions (other tests are reported per module, kernel "(suite)").
CHECK_NAMES = {
    "test_reference_sample": SELF_CHECKS,
    "test_reference_extremal": SELF_CHECKS,
    "test_reference_errors": SELF_CHECKS,
    "test_reference_injection": SELF_CHECKS,
    "test_spec_inputs_bind_to_the_reference_signature": SELF_CHECKS,
    "test_reference_conforms_to_itself": SELF_CHECKS,
    "test_a_wrong_result_fails_every_tolerance": SELF_CHECKS,
    "test_fast_sample": "fast vs reference: samples",
    "test_fast_extremal": "fast vs reference: extremal",
    "test_fast_errors": "fast vs reference: errors",
    "test_fast_injection": "fast vs reference: injected specials",
    "test_fast_gemm": "cuBLAS GEMM",
    "test_fast_batched_spectral_norm_equals_individual": "fast: batched == individual (bitwise)",
    # test_step.py, test_graphs.py, test_longrun.py
    "test_bounds_accept_a_legitimate_reimplementation": "step bounds accept a legitimate variant",
    "test_fast_step_matches_reference": "fast vs reference: one step",
    "test_fast_step_with_injected_non_finite_values": "fast vs reference: one step, NaN/Inf injected",
    "test_fast_readback_sequence_matches_reference": "fast vs reference: readback sequence",
    "test_fast_checkpoint_interchange": "checkpoint interchange (both ways)",
    "test_kernel_graph_replay_equals_eager": "fast: graph replay == eager (bitwise)",
    "test_gemm_plan_graph_replay_equals_eager": "fast: graph replay == eager (bitwise)",
    "test_fused_nan_check_graph_replay_equals_eager": "fast: graph replay == eager (bitwise)",
    "test_batched_spectral_norm_on_the_seed_matrices": "fast: seed matrices, batched == individual == graph",
    "test_fingerprint_bits_survive_arena_round_trips": "fingerprint bits: device round trip",
    "test_fingerprint_bits_survive_isv_kernels": "fingerprint bits: isv kernels",
    "test_bf16_matches_f32_over_50_epochs": "long-run parity, BF16 vs F32 (50 epochs)",
}
SUITE = "(suite)"


@dataclass
class TestRecord:
    """The outcome of one test id."""

    nodeid: str
    outcome: str  # "passed" | "failed" | "skipped"
    kernel: str
    check: str
    case: str
    comparisons: list[dict] = field(default_factory=list)
    reason: str = ""  # skip reason or the first line of the failure
    duration_s: float = 0.0


def _meta_of(item: pytest.Item) -> tuple[str, str, str]:
    params = getattr(getattr(item, "callspec", None), "params", {})
    name = getattr(item, "originalname", item.name)
    spec = params.get("spec")
    if spec is not None:
        kernel = spec.name
    elif name == "test_fast_gemm":
        kernel = "gemm"
    else:
        kernel = SUITE
    check = CHECK_NAMES.get(name, item.path.stem)
    if name == "test_fast_gemm" and "mode" in params:
        check = f"cuBLAS GEMM ({params['mode']})"
    case = str(params.get("case") or params.get("label") or "")
    return kernel, check, case


def _first_line(longrepr: Any) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    text = str(getattr(longrepr, "reprcrash", None) and longrepr.reprcrash.message or longrepr)
    return text.strip().splitlines()[0] if text.strip() else ""


class ResultsCollector:
    """pytest plugin (``pytest.main(args, plugins=[collector])``): one :class:`TestRecord` per
    test id, in run order."""

    def __init__(self) -> None:
        self.records: list[TestRecord] = []
        self._meta: dict[str, tuple[str, str, str]] = {}
        self._by_id: dict[str, TestRecord] = {}

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            self._meta[item.nodeid] = _meta_of(item)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        record = self._by_id.get(report.nodeid)
        if record is not None:  # a teardown error after the call phase
            if report.failed:
                record.outcome, record.reason = "failed", _first_line(report.longrepr)
            return
        if report.when != "call" and report.passed:
            return
        kernel, check, case = self._meta.get(report.nodeid, (SUITE, report.nodeid, ""))
        props: dict[str, Any] = {}
        comparisons = []
        for key, value in report.user_properties:
            if key == "comparison":
                comparisons.append(value)
            else:
                props[key] = value
        outcome = "skipped" if report.skipped else ("failed" if report.failed else "passed")
        record = TestRecord(
            nodeid=report.nodeid, outcome=outcome, kernel=str(props.get("kernel", kernel)),
            check=check, case=str(props.get("case", case)),
            comparisons=comparisons, duration_s=round(report.duration, 6),
            reason="" if outcome == "passed" else _first_line(report.longrepr))
        self.records.append(record)
        self._by_id[report.nodeid] = record


# ------------------------------------------------------------------------------ aggregation
@dataclass
class CheckRow:
    """One table row: a kernel's check over all its cases."""

    kernel: str
    check: str
    cases: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    worst_ratio: float | None = None  # max over comparisons of error / allowed (None: no comparison)
    worst_name: str = ""
    bounds: list[str] = field(default_factory=list)
    nan_map_equal: bool | None = None
    reasons: list[str] = field(default_factory=list)

    @property
    def result(self) -> str:
        if self.failed:
            return "FAIL"
        if self.passed == 0:
            return "skip"
        return "pass"


def _ratio(value: Any) -> float:
    if isinstance(value, str):  # JSON-safe spelling of inf / nan
        return math.inf
    return float(value)


def aggregate(records: Iterable[TestRecord]) -> list[CheckRow]:
    rows: dict[tuple[str, str], CheckRow] = {}
    for rec in records:
        row = rows.setdefault((rec.kernel, rec.check), CheckRow(rec.kernel, rec.check))
        row.cases += 1
        setattr(row, rec.outcome, getattr(row, rec.outcome) + 1)
        if rec.reason and rec.reason not in row.reasons:
            row.reasons.append(rec.reason)
        for comp in rec.comparisons:
            ratio = _ratio(comp.get("worst_ratio", 0.0))
            if row.worst_ratio is None or ratio > row.worst_ratio:
                row.worst_ratio, row.worst_name = ratio, str(comp.get("name", ""))
            if comp.get("tolerance") not in row.bounds:
                row.bounds.append(comp.get("tolerance"))
            equal = bool(comp.get("nan_map_equal", True))
            row.nan_map_equal = equal if row.nan_map_equal is None else (row.nan_map_equal and equal)
    return sorted(rows.values(), key=lambda r: (r.kernel == SUITE, r.kernel, r.check))


def _fmt_ratio(row: CheckRow) -> str:
    if row.worst_ratio is None:
        return "-"
    if math.isinf(row.worst_ratio):
        return "inf x bound"
    return f"{row.worst_ratio:.3g} x bound"


def format_table(rows: list[CheckRow], device: dict | None = None) -> str:
    """The text table printed by ``foxhunt conformance``."""
    header = ("kernel / check", "cases", "worst error vs bound", "NaN-map equal", "result")
    shown = [r for r in rows if r.result != "skip"]
    folded = [r for r in rows if r.result == "skip"]
    body = []
    for r in shown:
        nan = "-" if r.nan_map_equal is None else ("yes" if r.nan_map_equal else "NO")
        cases = f"{r.cases}" + (f" ({r.skipped} skipped)" if r.skipped and r.skipped != r.cases else "")
        body.append((f"{r.kernel} / {r.check}", cases, _fmt_ratio(r), nan, r.result))
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    if device is not None:
        out.append("")
        out.append(describe_device(device))
    failed = [r for r in rows if r.failed]
    if failed:
        out.append("")
        out.append("failures:")
        for r in failed:
            out += [f"  {r.kernel} / {r.check}: {reason}" for reason in r.reasons[:3]]
    if folded:
        by_reason: dict[str, list[CheckRow]] = defaultdict(list)
        for r in folded:
            by_reason[r.reasons[0] if r.reasons else "no reason given"].append(r)
        out.append("")
        for reason, group in sorted(by_reason.items()):
            checks = sorted({r.check for r in group})
            out.append(f"skipped: {sum(r.cases for r in group)} cases in {len(group)} rows "
                       f"({', '.join(checks)}): {reason}")
    return "\n".join(out)


# ------------------------------------------------------------------------------ device
def _nvrtc_version() -> str:
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        if int(err) != 0:
            return f"unknown (nvrtcVersion error {err})"
        return f"{major}.{minor}"
    except Exception as exc:  # noqa: BLE001 - report, never fail the run on it
        return f"unavailable ({type(exc).__name__}: {exc})"


def _driver_version_string() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown (nvidia-smi not found)"
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0]
    except Exception as exc:  # noqa: BLE001
        return f"unknown ({type(exc).__name__})"


def device_info() -> dict:
    """GPU name, compute capability, NVIDIA driver, CUDA (driver API and runtime) and NVRTC
    versions; ``"no GPU"`` and the reason where there is none. Never raises."""
    ok, reason = cuda_availability()
    info: dict[str, Any] = {"available": ok, "reason": reason, "gpu": "no GPU",
                            "compute_capability": None, "driver": None, "cuda_driver_api": None,
                            "cuda_runtime": None, "nvrtc": _nvrtc_version(),
                            "host": f"{platform.node()} ({platform.machine()})"}
    if not ok:
        return info
    try:
        from cuda.bindings import driver as drv

        def call(fn, *args):
            err, *values = fn(*args)
            if err != drv.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"{fn.__name__}: {err}")
            return values[0] if len(values) == 1 else values

        call(drv.cuInit, 0)
        dev = call(drv.cuDeviceGet, 0)
        info["gpu"] = call(drv.cuDeviceGetName, 256, dev).split(b"\0")[0].decode()
        attr = drv.CUdevice_attribute
        major = call(drv.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        minor = call(drv.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        info["compute_capability"] = f"{major}.{minor}"
        version = call(drv.cuDriverGetVersion)
        info["cuda_driver_api"] = f"{version // 1000}.{version % 1000 // 10}"
    except Exception as exc:  # noqa: BLE001
        info["gpu"] = f"unknown ({type(exc).__name__}: {exc})"
    try:
        from cuda.bindings import runtime as rt

        err, version = rt.cudaRuntimeGetVersion()
        info["cuda_runtime"] = (f"{version // 1000}.{version % 1000 // 10}" if int(err) == 0
                                else f"error {err}")
    except Exception as exc:  # noqa: BLE001
        info["cuda_runtime"] = f"unavailable ({type(exc).__name__})"
    info["driver"] = _driver_version_string()
    return info


def describe_device(info: dict) -> str:
    if not info.get("available"):
        return f"device: no GPU ({info.get('reason')}); NVRTC {info.get('nvrtc')}"
    return (f"device: {info['gpu']} (sm {info['compute_capability']}), driver {info['driver']}, "
            f"CUDA {info['cuda_driver_api']} (runtime {info['cuda_runtime']}), NVRTC {info['nvrtc']}")


# ------------------------------------------------------------------------------ JSON
def _version() -> str:
    try:
        return metadata.version("foxhunt")
    except metadata.PackageNotFoundError:
        return "not installed"


def build_report(records: list[TestRecord], *, mode: str, exit_code: int, device: dict,
                 kernels: Iterable[str], problems: Iterable[str] = ()) -> dict:
    """The JSON document: every kernel (with all its checks, even if all were skipped)."""
    rows = aggregate(records)
    per_kernel: dict[str, dict] = {name: {"result": "not run", "checks": {}} for name in kernels}
    for row in rows:
        entry = per_kernel.setdefault(row.kernel, {"result": "not run", "checks": {}})
        data = asdict(row)
        data["result"] = row.result
        if row.worst_ratio is not None and math.isinf(row.worst_ratio):
            data["worst_ratio"] = "inf"
        entry["checks"][row.check] = data
    for entry in per_kernel.values():
        results = [c["result"] for c in entry["checks"].values()]
        if results:
            entry["result"] = "FAIL" if "FAIL" in results else ("pass" if "pass" in results else "skip")
    counts = defaultdict(int)
    for rec in records:
        counts[rec.outcome] += 1
    return {
        "foxhunt": _version(), "mode": mode, "exit_code": int(exit_code), "device": device,
        "consistency_problems": list(problems),
        "summary": {k: counts[k] for k in ("passed", "failed", "skipped")},
        "kernels": per_kernel,
        "tests": [asdict(r) for r in records],
    }


def write_json(report: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")
    return path
