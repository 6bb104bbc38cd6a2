"""Kernel conformance, parametrised over the registry: one test id per kernel x case.

CPU (always): the reference self-checks. On sample inputs of each shape case and on every
extremal case: the outputs have the declared names and dtypes, the inputs are not mutated,
the same inputs twice give bitwise-equal outputs, the kernel's output contract holds
(e.g. ``clamp_finite`` is finite, a guarded SAXPY keeps ``y`` where ``x`` is non-finite), and
finite sample inputs give finite outputs. Each error input raises its declared class.

GPU (skipped with ``"no CUDA device: <reason>"`` without one): the fast test entry against the
reference under each output's tolerance (random inputs per shape case, extremal inputs with
identical NaN maps and flags, hypothesis-drawn injections), both raising the same error class
on bad input, and the cuBLAS GEMM in each precision mode within the GEMM bound.
"""

from __future__ import annotations

import importlib
import inspect
import zlib
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foxhunt.conformance import registry
from foxhunt.conformance.registry import KernelSpec, case_dims
from foxhunt.conformance.strategies import inject, injections
from foxhunt.conformance.tolerance import Tolerance, compare, gemm_tolerance

SPECS = registry.SPECS

SAMPLE_CASES = [pytest.param(spec, case, id=f"{name}-{case}")
                for name, spec in SPECS.items() for case in spec.shape_cases]
EXTREMAL_CASES = [pytest.param(spec, label, id=f"{name}-{label}")
                  for name, spec in SPECS.items() for label in spec.extremal_labels()]
KERNEL_IDS = [pytest.param(spec, id=name) for name, spec in SPECS.items()]

#: Examples per kernel for the hypothesis injection tests (kept small: ~40 kernels).
INJECTION_EXAMPLES = 8

#: The fast GEMM test entry (numpy in/out, the signature of ``dense.gemm``).
GEMM_FAST_ENTRY = ("foxhunt.fast.gemm", "gemm")
GEMM_MODES = ("f32", "bf16", "tf32")
GEMM_SHAPES = {"tiny": (32, 16, 32), "seed": (256, 128, 256), "odd": (257, 259, 253)}


# ------------------------------------------------------------------------------ helpers
def _rng(*key: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32("/".join(key).encode()))


def _copy(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def _same_bits(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)):
        return isinstance(b, type(a)) and len(a) == len(b) and all(map(_same_bits, a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return type(a) is type(b) and (a == b or (a != a and b != b))


def _call(fn: Callable, kwargs: dict) -> Any:
    # Non-finite inputs make NumPy warn; the semantics are what the tests check.
    with np.errstate(all="ignore"):
        return fn(**_copy(kwargs))


def _run_reference(spec: KernelSpec, kwargs: dict) -> dict[str, np.ndarray]:
    """Run the reference twice; check no mutation, determinism and dtypes; return outputs."""
    pristine = _copy(kwargs)
    with np.errstate(all="ignore"):
        first = spec.split_outputs(spec.ref(**kwargs))
    mutated = [k for k in kwargs if not _same_bits(kwargs[k], pristine[k])]
    assert not mutated, f"{spec.name} mutated its input(s) {mutated}"
    second = spec.split_outputs(_call(spec.ref, pristine))
    assert first.keys() == second.keys()
    differ = [k for k in first if not _same_bits(first[k], second[k])]
    assert not differ, f"{spec.name} is not deterministic: output(s) {differ} differ bitwise"
    wrong = {k: str(v.dtype) for k, v in first.items() if v.dtype != spec.dtype_of(k)}
    assert not wrong, f"{spec.name}: output dtypes {wrong}, declared {dict(spec.entry.dtypes)}"
    return first


def _record_comparisons(record_property, results) -> None:
    for result in results:
        record_property("comparison", result.as_dict())


def _compare_outputs(spec: KernelSpec, actual: dict, expected: dict, kwargs: dict,
                     record_property, label: str) -> None:
    assert actual.keys() == expected.keys(), (
        f"{spec.name}: fast outputs {sorted(actual)} vs reference {sorted(expected)}")
    inputs = spec.compare_inputs(kwargs, expected)
    results = [compare(f"{spec.name}[{label}].{out}", actual[out], expected[out],
                       spec.tolerance_of(out), inputs[out]) for out in expected]
    _record_comparisons(record_property, results)
    failures = [r.message for r in results if not r.passed]
    assert not failures, "\n\n".join(failures)


def _fast_entry(spec: KernelSpec) -> Callable:
    if spec.fast is None:
        pytest.fail(f"{spec.name}: no fast test entry in foxhunt.fast.kernels.KERNELS")
    return spec.fast


def _tag(record_property, kernel: str, case: str) -> None:
    """Name the kernel and case in the report (the check is the test function)."""
    record_property("kernel", kernel)
    record_property("case", case)


def _f32_array_targets(spec: KernelSpec, kwargs: dict) -> list[tuple[str, int | None]]:
    """(argument, list index or None) of every float32 array the kernel may be poisoned in."""
    found = []
    for name in spec.entry.targets:
        value = kwargs[name]
        if isinstance(value, list):
            found += [(name, k) for k, v in enumerate(value)
                      if isinstance(v, np.ndarray) and v.dtype == np.float32 and v.size]
        elif isinstance(value, np.ndarray) and value.dtype == np.float32 and value.ndim and value.size:
            found.append((name, None))
    return found


def _draw_injected(spec: KernelSpec, data) -> tuple[dict, str]:
    seed = data.draw(st.integers(0, 2**16), label="seed")
    kwargs = spec.entry.sample(case_dims("extremal"), np.random.default_rng(seed))
    targets = _f32_array_targets(spec, kwargs)
    name, index = data.draw(st.sampled_from(targets), label="target")
    array = kwargs[name] if index is None else kwargs[name][index]
    drawn = data.draw(injections(array.size), label="injections")
    poisoned = inject(array, drawn)
    if index is None:
        kwargs[name] = poisoned
    else:
        kwargs[name] = [poisoned if k == index else v for k, v in enumerate(kwargs[name])]
    small = all(not np.isfinite(inj.value) or abs(inj.value) <= 1 for inj in drawn)
    return kwargs, f"{registry.OVERFLOW_FREE_INJECTION if small else 'injected'}:{name}"


INJECTABLE = [pytest.param(spec, id=name) for name, spec in SPECS.items()
              if _f32_array_targets(spec, spec.entry.sample(case_dims("extremal"), _rng(name)))]


# ------------------------------------------------------------------- CPU: reference self-checks
@pytest.mark.parametrize("spec, case", SAMPLE_CASES)
def test_reference_sample(spec: KernelSpec, case: str, record_property) -> None:
    _tag(record_property, spec.name, case)
    kwargs = spec.sample_inputs(case, _rng(spec.name, case))
    outputs = _run_reference(spec, kwargs)
    assert not spec.check_contract(kwargs, outputs, None)
    if spec.entry.finite_sample:
        nonfinite = [k for k, v in outputs.items() if v.dtype.kind == "f" and not np.all(np.isfinite(v))]
        assert not nonfinite, f"{spec.name}: finite inputs gave non-finite output(s) {nonfinite}"


@pytest.mark.parametrize("spec, label", EXTREMAL_CASES)
def test_reference_extremal(spec: KernelSpec, label: str, record_property) -> None:
    _tag(record_property, spec.name, label)
    kwargs = spec.extremal_case(label, _rng(spec.name, label))
    outputs = _run_reference(spec, kwargs)
    problems = spec.check_contract(kwargs, outputs, label)
    assert not problems, f"{spec.name} [{label}]: " + "; ".join(problems)


@pytest.mark.parametrize("spec", KERNEL_IDS)
def test_reference_errors(spec: KernelSpec, record_property) -> None:
    _tag(record_property, spec.name, "errors")
    cases = spec.error_inputs(_rng(spec.name, "errors"))
    assert cases, f"{spec.name}: the spec lists no error inputs"
    for kwargs, exc in cases:
        with pytest.raises(exc):
            _call(spec.ref, kwargs)


@pytest.mark.parametrize("spec", INJECTABLE)
@settings(max_examples=INJECTION_EXAMPLES)
@given(data=st.data())
def test_reference_injection(spec: KernelSpec, data) -> None:
    kwargs, label = _draw_injected(spec, data)
    outputs = _run_reference(spec, kwargs)
    problems = spec.check_contract(kwargs, outputs, label)
    assert not problems, f"{spec.name} [{label}]: " + "; ".join(problems)


# ------------------------------------------------------------------- GPU: fast vs reference
@pytest.mark.gpu
@pytest.mark.parametrize("spec, case", SAMPLE_CASES)
def test_fast_sample(spec: KernelSpec, case: str, cuda_device, record_property) -> None:
    _tag(record_property, spec.name, case)
    fast = _fast_entry(spec)
    kwargs = spec.sample_inputs(case, _rng(spec.name, case))
    expected = spec.split_outputs(_call(spec.ref, kwargs))
    actual = spec.split_outputs(_call(fast, kwargs))
    _compare_outputs(spec, actual, expected, kwargs, record_property, case)


@pytest.mark.gpu
@pytest.mark.parametrize("spec, label", EXTREMAL_CASES)
def test_fast_extremal(spec: KernelSpec, label: str, cuda_device, record_property) -> None:
    _tag(record_property, spec.name, label)
    fast = _fast_entry(spec)
    kwargs = spec.extremal_case(label, _rng(spec.name, label))
    expected = spec.split_outputs(_call(spec.ref, kwargs))
    actual = spec.split_outputs(_call(fast, kwargs))
    _compare_outputs(spec, actual, expected, kwargs, record_property, label)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", KERNEL_IDS)
def test_fast_errors(spec: KernelSpec, cuda_device, record_property) -> None:
    _tag(record_property, spec.name, "errors")
    fast = _fast_entry(spec)
    for kwargs, exc in spec.error_inputs(_rng(spec.name, "errors")):
        with pytest.raises(exc) as ref_error:
            _call(spec.ref, kwargs)
        with pytest.raises(Exception) as fast_error:
            _call(fast, kwargs)
        assert type(fast_error.value) is type(ref_error.value), (
            f"{spec.name}: reference raised {type(ref_error.value).__name__}, fast raised "
            f"{type(fast_error.value).__name__}: {fast_error.value}")


@pytest.mark.gpu
@pytest.mark.parametrize("spec", INJECTABLE)
@settings(max_examples=INJECTION_EXAMPLES,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # record_property only appends
@given(data=st.data())
def test_fast_injection(spec: KernelSpec, data, cuda_device, record_property) -> None:
    fast = _fast_entry(spec)
    kwargs, label = _draw_injected(spec, data)
    expected = spec.split_outputs(_call(spec.ref, kwargs))
    actual = spec.split_outputs(_call(fast, kwargs))
    _compare_outputs(spec, actual, expected, kwargs, record_property, label)


def _fast_gemm() -> Callable:
    module_name, attr = GEMM_FAST_ENTRY
    module = importlib.import_module(module_name)
    fast = getattr(module, attr, None)
    if fast is None:
        pytest.fail(f"no fast GEMM test entry {module_name}.{attr} (numpy in/out, dense.gemm's signature)")
    return fast


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GEMM_SHAPES))
@pytest.mark.parametrize("mode", GEMM_MODES)
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True)],
                         ids=["nn", "tn", "nt"])
def test_fast_gemm(mode: str, case: str, trans_a: bool, trans_b: bool, cuda_device,
                   record_property) -> None:
    from foxhunt.reference.kernels.dense import gemm, round_for

    _tag(record_property, "gemm", f"{case}-{'nt'[trans_a]}{'nt'[trans_b]}")
    fast = _fast_gemm()
    assert inspect.signature(fast) == inspect.signature(gemm), (
        f"fast GEMM signature {inspect.signature(fast)} != reference {inspect.signature(gemm)}")
    m, k, n = GEMM_SHAPES[case]
    rng = _rng("gemm", mode, case)
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    flags = {"trans_a": trans_a, "trans_b": trans_b, "mode": mode}
    expected = _call(gemm, {"a": a, "b": b, **flags})
    actual = _call(fast, {"a": a, "b": b, **flags})
    op_a = round_for(np.ascontiguousarray(a.T if trans_a else a), mode)
    op_b = round_for(np.ascontiguousarray(b.T if trans_b else b), mode)
    result = compare(f"gemm[{mode},{case}]", actual, expected, gemm_tolerance(mode),
                     {"a": op_a, "b": op_b})
    _record_comparisons(record_property, [result])
    assert result.passed, result.message


@pytest.mark.gpu
@pytest.mark.parametrize("case", registry.SHAPE_CASES)
def test_fast_batched_spectral_norm_equals_individual(case: str, cuda_device, record_property) -> None:
    """SPEC 8: the fast batched spectral norm is bitwise identical to the individual kernel."""
    if "batched_spectral_norm" not in SPECS or "spectral_norm" not in SPECS:
        pytest.fail("the spectral-norm kernels are missing from the registry")
    batched, single = SPECS["batched_spectral_norm"], SPECS["spectral_norm"]
    _tag(record_property, "batched_spectral_norm", case)
    kwargs = batched.sample_inputs(case, _rng("batched-vs-individual", case))
    together = batched.split_outputs(_call(_fast_entry(batched), kwargs))
    bitwise = Tolerance.exact(bitwise=True)
    results = []
    for k in range(len(kwargs["ws"])):
        one = single.split_outputs(_call(_fast_entry(single), {
            "w": kwargs["ws"][k], "u": kwargs["us"][k], "v": kwargs["vs"][k],
            "sigma_max": kwargs["sigma_max"]}))
        for name, plural in (("w", "ws"), ("u", "us"), ("v", "vs"), ("sigma", "sigmas")):
            results.append(compare(f"batched[{k}].{name}", together[f"{plural}[{k}]"], one[name], bitwise))
    _record_comparisons(record_property, results)
    failures = [r.message for r in results if not r.passed]
    assert not failures, "\n\n".join(failures)
