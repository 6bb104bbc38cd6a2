"""The registry: CUDA source parsing, the consistency check (on the real tree and on doctored
copies), the structure of every KernelSpec, and the comparison plumbing run reference vs
reference (so that every output's tolerance and bound inputs are exercised without a GPU)."""

from __future__ import annotations

import inspect
import json
import math
import shutil
import sys
import types
import zlib
from pathlib import Path

import numpy as np
import pytest

from foxhunt.conformance import registry
from foxhunt.fast.cuda_parse import CudaParseError, parse_cuda_dir, parse_kernels, split_params
from foxhunt.conformance.kernel_spec import Output, SpecEntry
from foxhunt.conformance.registry import (
    SPEC_TABLE,
    SPECS,
    build_specs,
    case_dims,
    check_consistency,
    cuda_availability,
    default_cuda_dir,
    load_fast_kernels,
)
from foxhunt.conformance.specs.inputs import f32
from foxhunt.conformance.tolerance import EXACT, REDUCTION, compare

REF = registry.REF_KERNELS
#: The reference kernels that are CUDA kernels (not the DIVERGENCES): a clean fake cuda_src.
CUDA_NAMES = sorted(set(REF) - set(registry.DIVERGENCES))
KERNEL_IDS = [pytest.param(spec, id=name) for name, spec in SPECS.items()]


def _rng(*key: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32("/".join(key).encode()))


# ------------------------------------------------------------------------------ CUDA parsing
PARSE_SOURCE = r'''
#include <cuda_bf16.h>
// extern "C" __global__ void commented_out(float* x) {}
/* extern "C" __global__ void block_commented(float* x) {} */
extern "C" __global__ void plain(const float* __restrict__ y, const float *b, float * out,
                                 int M, int N) { const char* s = "// not a comment"; }
extern "C" __global__ __launch_bounds__(256) void bounds_before(float* x, int n) {}
extern "C" __global__ void __launch_bounds__(MAX_THREADS(2), 4) bounds_after(float** ptrs,
        const int lens[], unsigned long long n) {}
__global__ void not_extern_c(float* x) {}
template <int B> __global__ void templated(float* x) {}
extern "C" {
__global__ void in_block(float x, float y) {}
__device__ float helper(float x) { return x; }
}
extern "C" __global__ void no_params(void) {}
extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(1024)
clustered(float* w, int rows) {}
'''


def test_parse_kernels_finds_exactly_the_extern_c_kernels() -> None:
    found = parse_kernels(PARSE_SOURCE, "t.cu")
    assert sorted(found) == ["bounds_after", "bounds_before", "clustered", "in_block", "no_params",
                             "plain"]
    assert found["clustered"].params == (("float*", "w"), ("int", "rows"))
    assert found["plain"].params == (("const float* __restrict__", "y"), ("const float*", "b"),
                                     ("float*", "out"), ("int", "M"), ("int", "N"))
    assert found["bounds_after"].params == (("float**", "ptrs"), ("const int*", "lens"),
                                            ("unsigned long long", "n"))
    assert found["bounds_before"].params == (("float*", "x"), ("int", "n"))
    assert found["no_params"].params == ()
    assert found["plain"].where == "t.cu:5"  # comments keep line numbers


def test_split_params_rejects_a_nameless_parameter() -> None:
    with pytest.raises(CudaParseError, match="float"):
        split_params("float")


def test_parse_rejects_a_kernel_defined_twice(tmp_path: Path) -> None:
    (tmp_path / "a.cu").write_text('extern "C" __global__ void k(float* x) {}\n')
    (tmp_path / "b.cu").write_text('extern "C" __global__ void k(float* y) {}\n')
    with pytest.raises(CudaParseError, match="'k' defined twice: a.cu:1 and b.cu:1"):
        parse_cuda_dir(tmp_path)


# ------------------------------------------------------------------------------ consistency
def test_consistency_on_the_real_tree() -> None:
    """Every launched kernel has its twins (the step's own kernels included, issue 17)."""
    assert registry.FAST_LOAD_PROBLEM is None, registry.FAST_LOAD_PROBLEM
    assert registry.consistency_problems() == []


def test_the_fast_package_names_the_kernels_it_launches() -> None:
    every = parse_cuda_dir(default_cuda_dir())
    launched = registry.kernels_named_by(registry.default_fast_dir(), every)
    assert {"relu_mask_bias_grad", "batched_spectral_norm", "nan_check_fused"} <= launched
    assert not launched & {"selftest_axpy", "selftest_bf16_round", "selftest_write_scalars"}
    assert {"step_bounds", "step_scalars", "merge_piece_flags"} <= launched  # the step's own


def _copy_cuda_src(tmp_path: Path) -> Path:
    target = tmp_path / "cuda_src"
    shutil.copytree(default_cuda_dir(), target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def test_fake_cuda_kernel_is_reported_missing_its_reference_twin(tmp_path: Path) -> None:
    cuda_dir = _copy_cuda_src(tmp_path)
    (cuda_dir / "fake.cu").write_text('extern "C" __global__ void fake_kernel(float* x) {}\n')
    problems = check_consistency(cuda_dir, REF, registry.FAST_KERNELS, SPECS)
    fake = [p for p in problems if "fake_kernel" in p]
    assert fake == [
        "CUDA kernel 'fake_kernel' (fake.cu:1) has no reference twin in "
        "foxhunt.reference.kernels.KERNELS",
        "CUDA kernel 'fake_kernel' (fake.cu:1) has no fast test entry in "
        "foxhunt.fast.kernels.KERNELS"]
    # ... and the unmodified copy is clean, so the fake kernel is what the check saw.
    (cuda_dir / "fake.cu").unlink()
    assert check_consistency(cuda_dir, REF, registry.FAST_KERNELS, SPECS) == []


def _write_kernels(cuda_dir: Path, names, file_name: str = "k.cu") -> None:
    cuda_dir.mkdir(exist_ok=True)
    (cuda_dir / file_name).write_text("".join(
        f'extern "C" __global__ void {n}(float* x, int n) {{}}\n' for n in names))


def test_reference_kernel_without_cuda_kernel_unless_divergence(tmp_path: Path) -> None:
    cuda_dir = tmp_path / "cuda_src"
    present = CUDA_NAMES[:-1]
    missing = CUDA_NAMES[-1]
    _write_kernels(cuda_dir, present)
    fast = dict(REF)
    gap = (f"reference kernel {missing!r} has no CUDA kernel in cuda_src/ "
           "(add it, or list it in DIVERGENCES with a reason)")
    assert check_consistency(cuda_dir, REF, fast, SPECS) == [gap]
    divergences = {**registry.DIVERGENCES, missing: "a host-side copy"}
    assert check_consistency(cuda_dir, REF, fast, SPECS, divergences) == []
    del fast[missing]
    assert check_consistency(cuda_dir, REF, fast, SPECS, registry.DIVERGENCES) == [
        gap, f"reference kernel {missing!r} has no fast test entry in foxhunt.fast.kernels.KERNELS"]


def test_stale_divergences_are_reported(tmp_path: Path) -> None:
    cuda_dir = tmp_path / "cuda_src"
    _write_kernels(cuda_dir, sorted(REF))
    name = sorted(REF)[0]
    problems = check_consistency(cuda_dir, REF, {}, SPECS, {name: "x", "no_such_kernel": "y"})
    assert any("stale" in p and repr(name) in p for p in problems)
    assert any("'no_such_kernel', which is not a reference kernel" in p for p in problems)


def test_infrastructure_sources_are_not_paired(tmp_path: Path) -> None:
    cuda_dir = tmp_path / "cuda_src"
    _write_kernels(cuda_dir, CUDA_NAMES)
    (cuda_dir / "_selftest.cu").write_text('extern "C" __global__ void selftest_axpy(float* y) {}\n')
    assert registry.infrastructure_sources(cuda_dir) == ("_selftest.cu",)
    assert "selftest_axpy" not in registry.cuda_kernels(cuda_dir)
    assert check_consistency(cuda_dir, REF, REF, SPECS) == []


def test_a_launched_kernel_of_an_infrastructure_source_needs_its_twins(tmp_path: Path) -> None:
    cuda_dir = tmp_path / "cuda_src"
    _write_kernels(cuda_dir, CUDA_NAMES)
    _write_kernels(cuda_dir, ["step_helper", "selftest_axpy"], "_glue.cu")
    assert set(registry.cuda_kernels(cuda_dir, launched={"step_helper"})) == set(CUDA_NAMES) | {
        "step_helper"}
    assert check_consistency(cuda_dir, REF, REF, SPECS, launched={"step_helper"}) == [
        "CUDA kernel 'step_helper' (_glue.cu:1) has no reference twin in "
        "foxhunt.reference.kernels.KERNELS",
        "CUDA kernel 'step_helper' (_glue.cu:1) has no fast test entry in "
        "foxhunt.fast.kernels.KERNELS"]


def test_kernels_named_by_reads_string_literals_only(tmp_path: Path) -> None:
    package = tmp_path / "fast"
    (package / "plan").mkdir(parents=True)
    (package / "plan" / "graph.py").write_text(
        '"""Launches k_doc."""\n'
        'ops.kernel("k_launched", grid=1)\n'
        '# ops.kernel("k_comment")\n'
        'note = "k_partial is mentioned"\n'
        'k_name_only = 1\n')
    names = {"k_launched", "k_doc", "k_comment", "k_partial", "k_name_only"}
    assert registry.kernels_named_by(package, names) == {"k_launched"}


def test_fast_names_and_signatures_must_match_the_reference() -> None:
    name = sorted(REF)[0]
    ref_fn = REF[name]

    def other_signature(*args, bogus=1):  # noqa: ARG001
        raise AssertionError("never called")

    fast = {n: REF[n] for n in REF}
    fast[name] = other_signature
    fast["only_fast"] = ref_fn
    del fast[sorted(REF)[1]]
    problems = check_consistency(None, REF, fast, SPECS)
    assert "fast kernel 'only_fast' has no reference twin" in problems
    mismatch = [p for p in problems if p.startswith(f"signature mismatch for {name!r}")]
    assert len(mismatch) == 1 and str(inspect.signature(ref_fn)) in mismatch[0]
    assert (f"reference kernel {sorted(REF)[1]!r} has no fast test entry in "
            "foxhunt.fast.kernels.KERNELS") in problems
    assert len(problems) == 3


def test_kernel_without_spec_is_reported() -> None:
    name = next(iter(REF))
    table = {k: v for k, v in SPEC_TABLE.items() if k != name}
    specs = build_specs(REF, REF, table)
    assert name not in specs and len(specs) == len(REF) - 1
    assert check_consistency(None, REF, REF, specs) == [
        f"reference kernel {name!r} has no conformance entry (add a SpecEntry to its area's "
        "ENTRIES in foxhunt.conformance.specs)"]


def test_an_entry_without_a_reference_kernel_raises() -> None:
    partial = {k: REF[k] for k in list(REF)[:3]}
    with pytest.raises(KeyError, match="name no reference kernel"):
        build_specs(partial, {}, SPEC_TABLE)
    assert check_consistency(None, partial, partial, {**{k: SPEC_TABLE[k] for k in partial},
                                                      "ghost": None}, {}) == [
        "conformance entry 'ghost' has no reference kernel"]


# ------------------------------------------------------------------------------ fast access
def test_cuda_availability_without_a_check_function(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "foxhunt.fast", types.ModuleType("foxhunt.fast"))
    ok, reason = cuda_availability()
    assert not ok and "AttributeError" in reason and "cuda_available" in reason


def test_cuda_availability_when_the_check_raises(monkeypatch) -> None:
    fake = types.ModuleType("foxhunt.fast")

    def broken():
        raise OSError("driver exploded")

    fake.cuda_available = broken
    monkeypatch.setitem(sys.modules, "foxhunt.fast", fake)
    ok, reason = cuda_availability()
    assert not ok and "OSError: driver exploded" in reason


def test_fast_kernels_module_without_kernels_gives_an_empty_mapping(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "foxhunt.fast.kernels", types.ModuleType("foxhunt.fast.kernels"))
    kernels, problem = load_fast_kernels()
    assert kernels == {} and problem.startswith("loading foxhunt.fast.kernels.KERNELS failed: "
                                                "AttributeError")


# ------------------------------------------------------------------------------ spec structure
def _entry(**changes):
    base = dict(name="k", outputs={"out": f32(EXACT)}, sample=lambda d, rng: {},
                targets=("x",), errors=lambda rng: [])
    return SpecEntry(**{**base, **changes})


@pytest.mark.parametrize("changes, match", [
    ({"name": "not a name"}, "SpecEntry.name"),
    ({"outputs": {}}, "outputs is empty"),
    ({"outputs": {"out": EXACT}}, r"outputs\['out'\] must be an Output"),
    ({"outputs": {"out": Output("float64", EXACT)}}, r"dtype 'float64' is not one of"),
    ({"outputs": {"out": f32(REDUCTION)}}, "scales .* must be given"),
    ({"targets": ["x"]}, "targets must be a tuple of argument names"),
    ({"cases": ("tiny", "huge")}, "cases"),
    ({"cases": ()}, "cases"),
], ids=["name", "no-outputs", "bare-tolerance", "dtype", "reduction-without-scales", "targets",
        "unknown-case", "no-cases"])
def test_spec_entry_rejects_a_bad_field(changes, match) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        _entry(**changes)


def test_spec_entry_is_built_by_keyword_only() -> None:
    entry = _entry()
    with pytest.raises(TypeError):
        SpecEntry("k", entry.outputs, entry.sample, entry.targets, entry.errors)  # noqa
    assert entry.scales is None and entry.contract is None  # unset is None, not a falsy stand-in
    assert dict(entry.tolerance) == {"out": EXACT} and dict(entry.dtypes) == {"out": "float32"}


def test_every_entry_sits_in_its_reference_kernels_area() -> None:
    import importlib

    from foxhunt.reference.kernels import AREAS

    for area in AREAS:
        module = importlib.import_module(f"foxhunt.conformance.specs.{area}")
        for entry in module.ENTRIES:
            assert REF[entry.name].__module__ == f"foxhunt.reference.kernels.{area}", entry.name


def test_every_reference_kernel_has_a_spec() -> None:
    assert set(SPECS) == set(REF)


@pytest.mark.parametrize("spec", KERNEL_IDS)
def test_spec_inputs_bind_to_the_reference_signature(spec) -> None:
    sig = inspect.signature(spec.ref)
    for case in spec.shape_cases:
        sig.bind(**spec.sample_inputs(case, _rng(spec.name, case)))
    labels = spec.extremal_labels()
    sample = spec.sample_inputs("tiny", _rng(spec.name, "tiny"))
    has_float = any(isinstance(v, np.ndarray) and v.dtype.kind == "f" for v in sample.values())
    assert labels or not has_float, f"{spec.name}: no extremal cases"  # (int-only kernels: none)
    for label in labels:
        sig.bind(**spec.extremal_case(label, _rng(spec.name, label)))
    errors = spec.error_inputs(_rng(spec.name))
    assert errors, f"{spec.name}: no error inputs"
    for kwargs, exc in errors:
        sig.bind(**kwargs)
        assert issubclass(exc, Exception)


def test_case_dims_cross_the_block_boundary() -> None:
    odd = case_dims("odd")
    assert (odd.batch, odd.hidden) == (257, 259) and odd.flat > 256
    assert case_dims("seed").flat == 289_611
    with pytest.raises(ValueError, match="shape case 'huge' is unknown"):
        case_dims("huge")


# ----------------------------------------------------- comparison plumbing, reference vs itself
def _outputs(spec, kwargs):
    with np.errstate(all="ignore"):
        return spec.split_outputs(spec.ref(**{k: (v.copy() if isinstance(v, np.ndarray) else v)
                                              for k, v in kwargs.items()}))


def _cases(spec):
    yield "tiny", spec.sample_inputs("tiny", _rng(spec.name, "tiny"))
    for label in spec.extremal_labels():
        yield label, spec.extremal_case(label, _rng(spec.name, label))


@pytest.mark.parametrize("spec", KERNEL_IDS)
def test_reference_conforms_to_itself(spec) -> None:
    """Every output has a usable tolerance and bound inputs; identical results pass."""
    for label, kwargs in _cases(spec):
        expected = _outputs(spec, kwargs)
        inputs = spec.compare_inputs(kwargs, expected)
        for out, value in expected.items():
            result = compare(f"{spec.name}[{label}].{out}", value.copy(), value, spec.tolerance_of(out),
                             inputs[out])
            assert result.passed, result.message
            # A GEMM output is judged against the float64 product: the reference's own roundings show.
            assert result.worst_ratio == 0.0 or spec.tolerance_of(out).kind == "gemm"


def _perturb(value: np.ndarray) -> np.ndarray | None:
    """``value`` with its largest finite element moved by 0.1% (an integer by 1)."""
    out = value.copy()
    if out.dtype.kind == "f":
        finite = np.where(np.isfinite(out), np.abs(out), -1)
        i = np.unravel_index(int(np.argmax(finite)), out.shape) if out.ndim else ()
        if finite[i] <= 0:
            return None
        out[i] = out[i] * out.dtype.type(1.001)
    else:
        out.reshape(-1)[0] += 1
    return out


@pytest.mark.parametrize("spec", KERNEL_IDS)
def test_a_wrong_result_fails_every_tolerance(spec) -> None:
    """Mutation check: a 0.1% error in the largest element of any output is caught."""
    kwargs = spec.sample_inputs("tiny", _rng(spec.name, "tiny"))
    expected = _outputs(spec, kwargs)
    inputs = spec.compare_inputs(kwargs, expected)
    checked = 0
    for out, value in expected.items():
        wrong = _perturb(value)
        if wrong is None:
            continue
        result = compare(f"{spec.name}.{out}", wrong, value, spec.tolerance_of(out), inputs[out])
        assert not result.passed, (
            f"{spec.name}.{out}: a 0.1% error passed {spec.tolerance_of(out).describe()}")
        assert result.mismatches >= 1
        checked += 1
    assert checked, f"{spec.name}: no output could be perturbed"


# ------------------------------------------------------------------------------ report and CLI
def _record(kernel, check, outcome, ratio=None, nan_equal=True, reason=""):
    from foxhunt.conformance.report import TestRecord

    comps = [] if ratio is None else [{"name": f"{kernel}.out", "worst_ratio": ratio,
                                       "tolerance": "<= 2 ULP", "nan_map_equal": nan_equal}]
    return TestRecord(f"t::{kernel}-{check}-{outcome}", outcome, kernel, check, "tiny", comps, reason)


def test_report_rows_and_json_list_every_kernel() -> None:
    from foxhunt.conformance.report import aggregate, build_report, format_table

    records = [
        _record("saxpy", "fast vs reference: samples", "passed", 0.25),
        _record("saxpy", "fast vs reference: samples", "passed", 0.5),
        _record("saxpy", "fast vs reference: extremal", "failed", "inf", nan_equal=False,
                reason="AssertionError: saxpy[nan:x].out: Tensor-likes are not close!"),
        _record("clamp_finite", "fast vs reference: samples", "skipped", reason="no CUDA device: none"),
    ]
    rows = {(r.kernel, r.check): r for r in aggregate(records)}
    samples = rows[("saxpy", "fast vs reference: samples")]
    assert (samples.cases, samples.passed, samples.worst_ratio, samples.result) == (2, 2, 0.5, "pass")
    extremal = rows[("saxpy", "fast vs reference: extremal")]
    assert extremal.result == "FAIL" and extremal.nan_map_equal is False and extremal.worst_ratio == math.inf
    assert rows[("clamp_finite", "fast vs reference: samples")].result == "skip"
    table = format_table(aggregate(records), {"available": False, "reason": "none", "nvrtc": "13.0"})
    assert "saxpy / fast vs reference: extremal" in table and "NO" in table and "inf x bound" in table
    assert "0.5 x bound" in table
    assert "skipped: 1 cases in 1 rows (fast vs reference: samples): no CUDA device: none" in table
    assert "device: no GPU (none); NVRTC 13.0" in table
    report = build_report(records, mode="quick", exit_code=1, device={"gpu": "no GPU"},
                          kernels=["saxpy", "clamp_finite", "relu_mask"], problems=["p"])
    assert report["kernels"]["saxpy"]["result"] == "FAIL"
    assert report["kernels"]["clamp_finite"]["result"] == "skip"
    assert report["kernels"]["relu_mask"] == {"result": "not run", "checks": {}}
    assert report["summary"] == {"passed": 2, "failed": 1, "skipped": 1}
    json.dumps(report)  # serialisable as written


def test_cli_arguments() -> None:
    import argparse

    from foxhunt.conformance.cli import register, run_conformance

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["conformance"])
    assert (args.mode, args.json) == ("full", None)
    args = parser.parse_args(["conformance", "--quick", "--json", "out.json"])
    assert (args.mode, args.json) == ("quick", "out.json")
    with pytest.raises(SystemExit):
        parser.parse_args(["conformance", "--quick", "--full"])
    with pytest.raises(ValueError, match="mode: 'medium' is not allowed"):
        run_conformance("medium")


def test_device_info_without_a_gpu_names_the_reason(monkeypatch) -> None:
    from foxhunt.conformance import report

    monkeypatch.setattr(report, "cuda_availability", lambda: (False, "no driver here"))
    info = report.device_info()
    assert info["gpu"] == "no GPU" and info["reason"] == "no driver here" and not info["available"]
    assert report.describe_device(info).startswith("device: no GPU (no driver here)")
