"""GPU tests of the fast path's plumbing: device arena round trips, pinned readback, NVRTC
kernel launches, cuBLASLt GEMMs in every precision and epilogue against a float64 NumPy
reference on exactly representable inputs, and CUDA-graph replay == eager, bitwise.

Every test skips (with the reason) where no CUDA driver/device is usable; GEMM tests also
skip where nvmath-python is missing. ``python tests/test_fast_gpu.py`` prints a short report
(error-bound ratios, epilogue NaN behaviour, graph timings) for the record.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from foxhunt.fast.device import cuda_available

_OK, _REASON = cuda_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=f"no CUDA device/driver: {_REASON}")]

U = np.float64(2.0**-24)  # unit roundoff of float32 (round to nearest)
# Per-element GEMM bound safety factor: tensor-core adders may truncate (error up to 2u per
# add instead of u), and the accumulation order is unknown; 4 leaves a further 2x margin.
GEMM_SAFETY = 4.0
SHAPES = [(256, 256, 256), (257, 259, 131)]  # (m, n, k): regular and odd tails
BLOCK = 256


@pytest.fixture(scope="module")
def device():
    from foxhunt.fast.device import Device

    return Device()


@pytest.fixture(scope="module")
def kernels(device, tmp_path_factory):
    from foxhunt.fast._build import HEADER_SUFFIXES, compile_sources, source_files

    # Only the self-test file (plus headers): these tests must not depend on other kernels.
    files = source_files()
    sources = {n: b for n, b in files.items() if n == "_selftest.cu" or n.endswith(HEADER_SUFFIXES)}
    module = compile_sources(device.arch, "cubin", cache_root=tmp_path_factory.mktemp("nvrtc"),
                             sources=sources)
    return device.load_module(module)


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32) if x.dtype == np.float32 else x


# --------------------------------------------------------------------------------------------
# Device, arena, pinned memory
# --------------------------------------------------------------------------------------------


def test_device_describes_itself(device):
    major, minor = device.compute_capability
    assert major >= 8 and device.arch == f"sm_{major}{minor}"
    assert device.multiprocessor_count > 0 and device.name


def _specials_f32(n: int, rng) -> np.ndarray:
    x = rng.standard_normal(n).astype(np.float32)
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45, -1e-40, 3.4e38], dtype=np.float32)
    x[: min(n, len(specials))] = specials[:n]
    if n > len(specials):
        x.view(np.uint32)[len(specials)] = 0x7FC0_1234  # a NaN with a payload survives the copy
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint16, np.uint8, np.float64])
def test_arena_round_trip_is_bitwise(device, dtype):
    from foxhunt.fast.device import ALIGNMENT, Arena

    rng = np.random.default_rng(3)
    shapes = {"a": (257, 3), "b": (1,), "c": (1000,)}
    arena = Arena.from_specs(device, {name: (shape, dtype) for name, shape in shapes.items()})
    try:
        hosts = {}
        for name, shape in shapes.items():
            assert arena.ptr(name) % ALIGNMENT == 0
            if dtype == np.float32:
                host = _specials_f32(int(np.prod(shape)), rng).reshape(shape)
            else:
                host = rng.integers(0, 200, size=shape).astype(dtype)
            hosts[name] = host
        assert np.all(arena.download("b") == 0), "a new arena must be zero-filled"
        for name, host in hosts.items():
            arena.upload(name, host)
        for name, host in hosts.items():
            out = arena.download(name)
            assert out.dtype == host.dtype and out.shape == host.shape
            assert np.array_equal(_bits(out), _bits(host))
        arena.zero("a")
        assert np.all(arena.download("a") == 0)
        assert np.array_equal(_bits(arena.download("c")), _bits(hosts["c"])), "zero() spilled over"
    finally:
        arena.close()


def test_raw_pointer_copies_are_stream_ordered(device, kernels):
    from foxhunt.fast.device import grid_for

    n = 3001
    x = np.arange(n, dtype=np.float32)
    buf = device.alloc(2 * n * 4)
    try:
        device.memset(buf.ptr, 0xFF, 2 * n * 4)  # NaN bytes, then overwritten in stream order
        device.copy_to_device(buf.ptr, x, wait=False)
        device.memset(buf.ptr + n * 4, 0, n * 4)
        kernels.kernel("selftest_axpy").launch(grid_for(n, BLOCK), BLOCK, buf.ptr + n * 4, buf.ptr,
                                               np.float32(3.0), n, stream=device.stream)
        out = device.copy_to_host(np.empty(2 * n, np.float32), buf.ptr)
        assert np.array_equal(out[:n], x) and np.array_equal(out[n:], 3 * x)
    finally:
        buf.free()


def test_arena_async_copies_through_pinned_memory(device):
    from foxhunt.fast.device import Arena

    arena = Arena(device, 1 << 20)
    try:
        arena.add("x", (4099,), np.float32)
        staged = device.pinned_empty((4099,), np.float32)
        staged[...] = np.arange(4099, dtype=np.float32) * np.float32(0.5)
        back = device.pinned_empty((4099,), np.float32)
        back[...] = -1
        arena.upload_async("x", staged, device.stream)
        arena.download_async("x", back, device.stream)
        device.stream.synchronize()
        assert np.array_equal(back, staged)
    finally:
        arena.close()


def test_arena_rejects_mismatched_host_arrays(device):
    from foxhunt.fast.device import Arena

    arena = Arena(device, 4096)
    try:
        arena.add("x", (8,), np.float32)
        with pytest.raises(ValueError, match="holds"):
            arena.upload("x", np.zeros(8, np.float64))
        with pytest.raises(ValueError, match="holds"):
            arena.upload("x", np.zeros(9, np.float32))
        with pytest.raises(KeyError, match="no buffer"):
            arena.ptr("y")
        with pytest.raises(ValueError, match="does not fit"):
            arena.add("big", (4096,), np.float32)
    finally:
        arena.close()


def test_pinned_scalars_are_written_by_a_kernel_and_read_without_a_copy(device, kernels):
    from foxhunt.fast.device import PinnedScalars

    slots = PinnedScalars(device, {"loss": np.float32, "count": np.int64, "flags": (np.int32, 64)})
    assert slots.device_ptr("count") % 8 == 0
    kernels.kernel("selftest_write_scalars").launch(
        1, 32, slots.device_ptr("loss"), slots.device_ptr("count"), np.float32(-2.75), (1 << 40) + 3,
        stream=device.stream)
    device.stream.synchronize()
    assert slots.read("loss")[0] == np.float32(-2.75)
    assert slots.read("count")[0] == (1 << 40) + 3
    assert np.all(slots.read("flags") == 0)
    slots.clear()
    assert slots.read("loss")[0] == 0


# --------------------------------------------------------------------------------------------
# Kernel launches
# --------------------------------------------------------------------------------------------


def test_axpy_kernel_rounds_product_and_sum_separately(device, kernels):
    from foxhunt.fast.device import Arena, grid_for

    rng = np.random.default_rng(7)
    n = 100_003
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    a = np.float32(1.0 / 3.0)
    expected = (a * x + y).astype(np.float32)  # NumPy float32: two roundings
    fused = (np.float64(a) * x.astype(np.float64) + y).astype(np.float32)  # ~ one rounding (FMA)
    assert np.any(fused != expected), "test data cannot tell FMA from mul+add"
    arena = Arena.from_specs(device, {"x": ((n,), np.float32), "y": ((n,), np.float32)})
    try:
        arena.upload("x", x)
        arena.upload("y", y)
        kernels.kernel("selftest_axpy").launch(grid_for(n, BLOCK), BLOCK, arena.ptr("y"),
                                               arena.ptr("x"), a, n, stream=device.stream)
        assert np.array_equal(_bits(arena.download("y")), _bits(expected))
    finally:
        arena.close()


def test_bf16_kernel_matches_reference_rounding(device, kernels):
    from foxhunt.fast.device import Arena, grid_for
    from foxhunt.reference.kernels.dense import f32_to_bf16

    rng = np.random.default_rng(11)
    x = (rng.standard_normal(5000) * 1e3).astype(np.float32)
    ties = np.array([0x3F80_8000, 0x3F81_8000, 0x0000_8000, 0x7F7F_FFFF, 0x0001_0000],
                    dtype=np.uint32).view(np.float32)  # ties to even both ways, subnormal, overflow
    x[: len(ties)] = ties
    x[len(ties): len(ties) + 3] = [np.inf, -np.inf, -0.0]
    arena = Arena.from_specs(device, {"x": (x.shape, np.float32), "o": (x.shape, np.uint16)})
    try:
        arena.upload("x", x)
        kernels.kernel("selftest_bf16_round").launch(grid_for(x.size, BLOCK), BLOCK, arena.ptr("o"),
                                                     arena.ptr("x"), x.size, stream=device.stream)
        assert np.array_equal(arena.download("o"), f32_to_bf16(x))
    finally:
        arena.close()


def test_kernel_lookup_and_launch_errors(device, kernels):
    with pytest.raises(KeyError, match="no kernel 'nope'"):
        kernels.kernel("nope")
    axpy = kernels.kernel("selftest_axpy")
    with pytest.raises(TypeError, match="takes 4 arguments"):
        axpy.launch(1, 32, 0, 0, np.float32(1), stream=device.stream)
    with pytest.raises(TypeError, match="expected an int"):
        axpy.launch(1, 32, 0, 0, np.float32(1), 2.0, stream=device.stream)
    with pytest.raises(ValueError, match="stream"):
        axpy.launch(1, 32, 0, 0, np.float32(1), 0)
    with pytest.raises(ValueError, match="block"):
        axpy.launch(1, 0, 0, 0, np.float32(1), 0, stream=device.stream)


# --------------------------------------------------------------------------------------------
# GEMMs
# --------------------------------------------------------------------------------------------


def _representable(rng, shape, precision) -> np.ndarray:
    """float32 values that the precision's inputs hold exactly (so input rounding is moot)."""
    x = rng.standard_normal(shape).astype(np.float32)
    drop = {"f32": 0, "tf32": 13, "bf16": 16}[precision]
    x.view(np.uint32)[...] &= np.uint32((0xFFFF_FFFF >> drop) << drop)
    return x


def _to_device_layout(x: np.ndarray, precision: str) -> np.ndarray:
    return (x.view(np.uint32) >> 16).astype(np.uint16) if precision == "bf16" else x


def _gemm_bound(a_op, b_op, k, extra=0.0):
    """Per-element bound: safety * gamma_K * (|A| @ |B|) + 2u * |extra terms|, float64."""
    gamma = k * U / (1 - k * U)
    return GEMM_SAFETY * gamma * (np.abs(a_op) @ np.abs(b_op)) + 2 * U * np.abs(extra)


class _Gemm:
    """Allocate operands for a plan, run it, return C (and bias/aux) as NumPy."""

    def __init__(self, device, plan):
        from foxhunt.fast.device import Arena

        s = plan.spec
        specs = {"a": (s.a_shape, s.input_dtype), "b": (s.b_shape, s.input_dtype),
                 "c": (s.c_shape, np.float32)}
        if s.bias_len is not None:
            specs["bias"] = ((s.bias_len,), np.float32)
        if s.aux_nbytes is not None:
            specs["aux"] = ((s.aux_nbytes,), np.uint8)
        self.device, self.plan, self.arena = device, plan, Arena.from_specs(device, specs)

    def run(self, a, b, *, bias=None, aux=None, c=None):
        s, arena = self.plan.spec, self.arena
        arena.upload("a", _to_device_layout(a, s.precision))
        arena.upload("b", _to_device_layout(b, s.precision))
        if c is not None:
            arena.upload("c", c)
        if bias is not None:
            arena.upload("bias", bias)
        if aux is not None:
            arena.upload("aux", aux)
        self.plan.run(arena.ptr("a"), arena.ptr("b"), arena.ptr("c"),
                      bias_ptr=arena.ptr("bias") if "bias" in arena else None,
                      aux_ptr=arena.ptr("aux") if "aux" in arena else None,
                      stream=self.device.stream)
        self.device.stream.synchronize()
        out = {"c": arena.download("c")}
        for name in ("bias", "aux"):
            if name in arena:
                out[name] = arena.download(name)
        return out

    def close(self):
        self.arena.close()
        self.plan.close()


def _plan(device, *args, **kwargs):
    from foxhunt.fast.gemm import GemmPlan

    return GemmPlan(device, *args, **kwargs)


def _operands(rng, m, n, k, trans_a, trans_b, precision):
    a = _representable(rng, (k, m) if trans_a else (m, k), precision)
    b = _representable(rng, (n, k) if trans_b else (k, n), precision)
    a_op = (a.T if trans_a else a).astype(np.float64)
    b_op = (b.T if trans_b else b).astype(np.float64)
    return a, b, a_op, b_op


def _assert_within(got, want, bound, what):
    err = np.abs(got.astype(np.float64) - want)
    bad = ~(err <= bound)
    if bad.any():
        idx = np.unravel_index(np.argmax(np.where(bad, err / np.maximum(bound, 1e-300), 0)), err.shape)
        raise AssertionError(
            f"{what}: {bad.sum()} of {bad.size} elements ({100 * bad.mean():.3f}%) exceed the bound; "
            f"worst at {idx}: got {got[idx]!r}, want {want[idx]!r}, |err| {err[idx]:.3e}, "
            f"bound {bound[idx]:.3e}")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("precision", ["f32", "tf32", "bf16"])
def test_gemm_matches_float64_on_representable_inputs(device, lt, precision, trans_a, trans_b, shape):
    m, n, k = shape
    rng = np.random.default_rng(zlib.crc32(repr((precision, trans_a, trans_b, shape)).encode()))
    a, b, a_op, b_op = _operands(rng, m, n, k, trans_a, trans_b, precision)
    gemm = _Gemm(device, _plan(device, m, n, k, trans_a=trans_a, trans_b=trans_b, precision=precision))
    try:
        out = gemm.run(a, b)["c"]
    finally:
        gemm.close()
    want = a_op @ b_op
    assert out.dtype == np.float32 and out.shape == (m, n)
    _assert_within(out, want, _gemm_bound(a_op, b_op, k, want), f"{precision} GEMM")


def test_f32_gemm_does_not_use_tf32(device, lt):
    """An f32 GEMM on inputs with low mantissa bits must beat TF32's input rounding by far."""
    m, n, k = 256, 256, 16  # short sums: TF32's input rounding cannot average out
    rng = np.random.default_rng(5)
    a = (1 + rng.random((m, k))).astype(np.float32)  # [1, 2): every mantissa bit in play
    b = (1 + rng.random((k, n))).astype(np.float32)
    gemm = _Gemm(device, _plan(device, m, n, k, precision="f32"))
    try:
        out = gemm.run(a, b)["c"]
    finally:
        gemm.close()
    want = a.astype(np.float64) @ b.astype(np.float64)
    rel = np.max(np.abs(out - want) / want)
    assert rel < 2.0**-14, f"relative error {rel:.2e} looks like TF32 (2^-11 per input)"


#: (m, n, k) of the step's forward GEMMs (trunk, head first and output layers) and a small one.
TF32_ROUNDING_SHAPES = [(256, 256, 128), (512, 128, 256), (256, 153, 128), (64, 64, 64)]


@pytest.mark.parametrize("shape", TF32_ROUNDING_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("operand", ["a", "b"])
@pytest.mark.parametrize("trans_a, trans_b, epilogue",
                         [(False, True, None), (False, True, "relu_bias"), (True, False, None)],
                         ids=["forward", "forward-relu", "weight-grad"])
def test_tf32_plans_round_operands_to_nearest_even(device, lt, shape, operand, trans_a, trans_b,
                                                   epilogue):
    """cuBLASLt's TF32 plans round each f32 operand to nearest, ties to even (not truncated, as
    a tensor core fed raw f32 bits would): what ``precision="tf32"``'s step conformance relies on
    (``step_variants.legitimate_variant``, ``step_conditioning``). ``C[i, i] = A[i, 0] B[0, i]``
    with one factor 1 and the other a value off the TF32 grid (above, on and below a midpoint)."""
    from foxhunt.conformance.step_variants import tf32_nearest_even

    m, n, k = shape
    vals = np.array([1 + 3 * 2.0**-12, 1 + 2.0**-11, 1 + 2.0**-12, -(1 + 3 * 2.0**-12),
                     1 + 2.0**-11 + 2.0**-20, 1.5 + 2.0**-11], np.float32)
    a = np.zeros((k, m) if trans_a else (m, k), np.float32)
    b = np.zeros((n, k) if trans_b else (k, n), np.float32)
    idx = np.arange(len(vals))
    a_vals, b_vals = (vals, 1) if operand == "a" else (1, vals)
    a[(0, idx) if trans_a else (idx, 0)] = a_vals
    b[(idx, 0) if trans_b else (0, idx)] = b_vals
    gemm = _Gemm(device, _plan(device, m, n, k, trans_a=trans_a, trans_b=trans_b,
                               precision="tf32", epilogue=epilogue))
    try:
        out = gemm.run(a, b, **({"bias": np.zeros(n, np.float32)} if epilogue else {}))["c"]
    finally:
        gemm.close()
    want = tf32_nearest_even(vals)
    if epilogue == "relu_bias":
        want = np.maximum(want, np.float32(0))
    assert out[idx, idx].tolist() == want.tolist()


def test_stored_algorithms_are_checked_and_give_the_same_bits(device, lt, tmp_path):
    """gemm_algos: a second plan cache reading the first one's store asks cuBLASLt nothing,
    takes the same algorithm (checked) and computes the same bits; an algorithm stored under a
    GEMM it does not fit is rejected by the check, forgotten and asked again."""
    import functools

    from foxhunt.fast.gemm import GemmPlan, PlanCache, cublaslt_version
    from foxhunt.fast.gemm_algos import AlgoStore

    make = functools.partial(GemmPlan, device)
    store = lambda: AlgoStore.for_device(device, cublaslt_version(), root=tmp_path)  # noqa: E731
    m, n, k = SHAPES[1]
    rng = np.random.default_rng(7)
    a, b, _, _ = _operands(rng, m, n, k, False, True, "bf16")
    first = PlanCache(make, store=store())
    second = None
    try:
        plans = [first(m, n, k, trans_b=True, precision="bf16")]
        second = PlanCache(make, store=store())  # a new process: reads what first wrote
        plans.append(second(m, n, k, trans_b=True, precision="bf16"))
        assert (first.queries, first.loaded, second.queries, second.loaded) == (1, 0, 0, 1)
        assert plans[0].heuristic.tobytes() == plans[1].heuristic.tobytes()
        outs = []
        for plan in plans:
            gemm = _Gemm(device, plan)
            try:
                outs.append(gemm.run(a, b)["c"])
            finally:
                gemm.arena.close()  # (the plan is the cache's to close)
        assert np.array_equal(_bits(outs[0]), _bits(outs[1]))
        # Plant a garbage algorithm (every byte of its algo field 0xFF) under an f32 GEMM's
        # key: the check must refuse it.
        dtype = plans[0].heuristic.dtype
        offset, size = dtype.fields["algo"][1], dtype.fields["algo"][0].itemsize
        garbage = bytearray(plans[0].heuristic.tobytes())
        garbage[offset:offset + size] = b"\xff" * size
        wrong = PlanCache.key(m, n, k, trans_b=True, precision="f32")
        planted = store()
        planted.put(wrong, bytes(garbage))
        third = PlanCache(make, store=planted)
        try:
            third(m, n, k, trans_b=True, precision="f32")
            assert (third.queries, third.loaded) == (1, 0)
            assert store().get(wrong) != bytes(garbage)
        finally:
            third.close()
    finally:
        first.close()
        if second is not None:
            second.close()


def test_gemm_accumulates_into_c_with_beta(device, lt):
    m, n, k = 64, 96, 32
    rng = np.random.default_rng(9)
    a, b, a_op, b_op = _operands(rng, m, n, k, False, False, "f32")
    c0 = _representable(rng, (m, n), "f32")
    gemm = _Gemm(device, _plan(device, m, n, k, alpha=0.5, beta=-2.0))
    try:
        out = gemm.run(a, b, c=c0)["c"]
    finally:
        gemm.close()
    want = 0.5 * (a_op @ b_op) - 2.0 * c0
    _assert_within(out, want, _gemm_bound(a_op, b_op, k, np.abs(want) + 2 * np.abs(c0)), "beta GEMM")


def _aux_bits(aux: np.ndarray, m: int, n: int) -> np.ndarray:
    """ReLU bitmask -> bool [m, n]: one padded bit-row per row of C, least significant bit first."""
    rows = aux.reshape(m, -1)
    return np.unpackbits(rows, axis=1, bitorder="little")[:, :n].astype(bool)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("epilogue", ["bias", "relu_bias", "relu_aux_bias"])
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_forward_epilogues(device, lt, precision, epilogue, shape):
    m, n, k = shape
    rng = np.random.default_rng(17)
    a, b, a_op, b_op = _operands(rng, m, n, k, False, True, precision)
    bias = rng.standard_normal(n).astype(np.float32)
    gemm = _Gemm(device, _plan(device, m, n, k, trans_b=True, precision=precision, epilogue=epilogue))
    try:
        out = gemm.run(a, b, bias=bias)
    finally:
        gemm.close()
    pre = a_op @ b_op + bias.astype(np.float64)[None, :]
    bound = _gemm_bound(a_op, b_op, k, np.abs(pre) + np.abs(bias)[None, :])
    want = pre if epilogue == "bias" else np.maximum(pre, 0)
    _assert_within(out["c"], want, bound, f"{precision} {epilogue}")
    assert np.array_equal(out["bias"], bias), "the bias input must not be modified"
    if epilogue == "relu_aux_bias":
        mask = _aux_bits(out["aux"], m, n)
        clear = np.abs(pre) > bound  # away from 0, the sign of the pre-activation is certain
        assert np.array_equal(mask[clear], (pre > 0)[clear])
        assert np.array_equal(mask, out["c"] > 0), "aux bit set exactly where the output is > 0"


@pytest.mark.parametrize("preset", ["tiny", "seed"])
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_relu_aux_bits_of_a_nan_output_depend_on_the_plans_precision(device, lt, preset, precision):
    """The ``gemm`` module's NaN contract of RELU_AUX_BIAS, for the shapes of the step's forward
    ReLU GEMMs planned as the step plans them (alignment, SM target, no workspace), with a NaN and
    +-Inf in the input rows and a NaN bias: NaN rows and the NaN column stay NaN in C; every
    non-NaN output's bit is ``not C <= 0``; a NaN output's bit is set by the f32 plans and left
    clear by the bf16 ones (measured on the H200, cuBLAS 13.0, session 21). The clear bit is why
    the step masks its ReLU gradients by the output (``relu_mask_bias_grad``), not by
    DRELU_BGRAD: with it a NaN row's gradient became 0 where the reference's is NaN."""
    from foxhunt.fast.records import Gemm
    from foxhunt.fast.trainer import Trainer
    from foxhunt.reference.config import DQNConfig

    trainer = Trainer(DQNConfig.preset(preset, precision=precision), device=device)
    try:
        plans = {(n.plan.spec.m, n.plan.spec.n, n.plan.spec.k): n.plan
                 for n in trainer.engine.plans["graph1"].nodes()
                 if isinstance(n, Gemm) and n.spec.epilogue == "relu_bias"}
        sm_count_target = trainer.engine.program.sm_count_targets["forward"]
    finally:
        trainer.close()
    assert plans
    rng = np.random.default_rng(31)
    for (m, n, k), step_plan in plans.items():
        s = step_plan.spec
        plan = _plan(device, m, n, k, trans_b=s.trans_b, precision=s.precision,
                     epilogue="relu_aux_bias", min_alignment=step_plan.min_alignment,
                     workspace_limit=0, sm_count_target=sm_count_target)
        x = _representable(rng, (m, k), precision)
        x[1, 0], x[3, 0], x[4, 0] = np.nan, np.inf, -np.inf
        w = _representable(rng, (n, k), precision)
        bias = _representable(rng, (n,), "bf16")
        bias[min(5, n - 1)] = np.nan
        gemm = _Gemm(device, plan)
        try:
            out = gemm.run(x, w, bias=bias)
        finally:
            gemm.close()
        c, bits = out["c"], _aux_bits(out["aux"], m, n)
        where = f"{preset} {precision} GEMM {m}x{n}x{k}"
        nan = np.isnan(c)
        assert nan[1].all() and nan[:, min(5, n - 1)].all(), where
        with np.errstate(invalid="ignore"):
            assert np.array_equal(bits[~nan], c[~nan] > 0), f"{where}: bits of non-NaN outputs"
        assert (bits[nan] if precision == "f32" else ~bits[nan]).all(), f"{where}: NaN bits"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_drelu_bgrad_masks_with_the_forward_aux_and_sums_rows(device, lt, precision, shape):
    m, n, k = shape
    rng = np.random.default_rng(23)
    # Forward: H = relu(X W.T + b) with the aux bitmask.
    x, w, _, _ = _operands(rng, m, n, k, False, True, precision)
    forward = _Gemm(device, _plan(device, m, n, k, trans_b=True, precision=precision,
                                  epilogue="relu_aux_bias"))
    backward = _Gemm(device, _plan(device, m, n, k, precision=precision, epilogue="drelu_bgrad"))
    try:
        fwd = forward.run(x, w, bias=rng.standard_normal(n).astype(np.float32))
        dy, v, dy_op, v_op = _operands(rng, m, n, k, False, False, precision)
        bwd = backward.run(dy, v, aux=fwd["aux"])
    finally:
        forward.close()
        backward.close()
    mask = _aux_bits(fwd["aux"], m, n)
    assert np.array_equal(mask, fwd["c"] > 0)
    want = np.where(mask, dy_op @ v_op, 0.0)
    _assert_within(bwd["c"], want, np.where(mask, _gemm_bound(dy_op, v_op, k, want), 0.0),
                   f"{precision} drelu_bgrad")
    column_sums = bwd["c"].astype(np.float64).sum(axis=0)
    bound = 2 * m * U * np.abs(bwd["c"]).astype(np.float64).sum(axis=0) + 1e-30
    _assert_within(bwd["bias"], column_sums, bound, "drelu_bgrad bias gradient")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("precision", ["f32", "tf32", "bf16"])
@pytest.mark.parametrize("epilogue, trans_a, trans_b", [
    ("bgrada", True, False),    # dW[in, out] = X.T @ dZ, db = column sums of dZ
    ("bgradb", True, False),    # dW[out, in] = dZ.T @ X, db = column sums of dZ
    ("bgrada", False, False),
    ("bgradb", True, True),
])
def test_bias_gradient_epilogues(device, lt, epilogue, trans_a, trans_b, precision, shape):
    m, n, k = shape
    rng = np.random.default_rng(29)
    a, b, a_op, b_op = _operands(rng, m, n, k, trans_a, trans_b, precision)
    plan = _plan(device, m, n, k, trans_a=trans_a, trans_b=trans_b, precision=precision,
                 epilogue=epilogue)
    gemm = _Gemm(device, plan)
    try:
        out = gemm.run(a, b)
    finally:
        gemm.close()
    want = a_op @ b_op
    _assert_within(out["c"], want, _gemm_bound(a_op, b_op, k, want), f"{precision} {epilogue} product")
    reduced = b_op if epilogue == "bgrada" else a_op.T  # sum over k of op(B) or of op(A)
    sums = reduced.sum(axis=0)
    bound = 2 * k * U * np.abs(reduced).sum(axis=0) + 1e-30
    _assert_within(out["bias"], sums, bound, f"{precision} {epilogue} bias gradient")


def _relu_epilogue_keeps_nan() -> list[str]:
    from foxhunt.fast.gemm import RELU_EPILOGUE_KEEPS_NAN

    return [p for p, keeps in RELU_EPILOGUE_KEEPS_NAN.items() if keeps]


@pytest.mark.parametrize("precision", _relu_epilogue_keeps_nan())
def test_relu_bias_epilogue_keeps_nan(device, lt, precision):
    """``gemm.RELU_EPILOGUE_KEEPS_NAN``'s precisions whose RELU_BIAS epilogue the step uses: in a
    trunk-shaped plan a NaN pre-activation (a NaN input, a NaN bias) stays NaN in C and every
    other element is the reference's ``add_bias_relu``. (tf32 is not claimed: its step runs
    ``add_bias_relu`` itself; the table's comment says why.)"""
    from foxhunt.reference.kernels.dense import add_bias_relu

    m, n, k = 256, 128, 256  # a trunk layer of the seed step
    x = np.ones((m, k), np.float32)
    x[1, 0] = np.nan
    x[2, :] = -1.0
    w = np.ones((n, k), np.float32)
    bias = np.zeros(n, np.float32)
    bias[5] = np.nan
    gemm = _Gemm(device, _plan(device, m, n, k, trans_b=True, precision=precision,
                               epilogue="relu_bias"))
    try:
        c = gemm.run(x, w, bias=bias)["c"]  # 1, -1 and NaN: exact in every precision
    finally:
        gemm.close()
    with np.errstate(invalid="ignore"):
        want = add_bias_relu((x @ w.T).astype(np.float32), bias)
    assert np.array_equal(c, want, equal_nan=True)


def test_relu_epilogues_follow_the_reference_nan_contract(device, lt):
    """NaN and Inf through RELU_AUX_BIAS and DRELU_BGRAD as the reference kernels define them:
    ``add_bias_relu`` (NaN stays NaN, -Inf -> 0), ``relu_mask`` (``h <= 0 ? 0 : dy``)."""
    from foxhunt.reference.kernels.dense import add_bias_relu, relu_mask

    m, n, k = 8, 16, 8
    x = np.ones((m, k), np.float32)
    x[1, 0] = np.nan
    x[2, :] = -1.0
    x[3, 0] = np.inf
    x[4, 0] = -np.inf
    w = np.ones((n, k), np.float32)
    bias = np.zeros(n, np.float32)
    bias[5] = np.nan
    forward = _Gemm(device, _plan(device, m, n, k, trans_b=True, epilogue="relu_aux_bias"))
    backward = _Gemm(device, _plan(device, m, n, k, epilogue="drelu_bgrad"))
    try:
        fwd = forward.run(x, w, bias=bias)
        with np.errstate(invalid="ignore"):
            h_ref = add_bias_relu((x @ w.T).astype(np.float32), bias)
        assert np.array_equal(fwd["c"], h_ref, equal_nan=True)
        assert np.array_equal(_aux_bits(fwd["aux"], m, n), ~(h_ref <= 0))
        dy = np.ones((m, k), np.float32)
        dy[2, 0] = np.nan  # row 2: masked off (NaN must vanish) except column 5, where h is NaN
        v = np.ones((k, n), np.float32)
        bwd = backward.run(dy, v, aux=fwd["aux"])
        with np.errstate(invalid="ignore"):
            dx_ref = relu_mask((dy @ v).astype(np.float32), h_ref)
        assert np.array_equal(bwd["c"], dx_ref, equal_nan=True)
        assert np.isnan(dx_ref[2, 5]) and np.sum(np.isnan(dx_ref)) == 1
        db_nan = np.isnan(bwd["bias"])
        assert db_nan[5] and not db_nan[np.arange(n) != 5].any()
    finally:
        forward.close()
        backward.close()


def test_prepacked_arguments_launch_like_plain_ones(device, kernels):
    from foxhunt.fast.device import Arena

    arena = Arena.from_specs(device, {"x": ((64,), np.float32), "y": ((64,), np.float32)})
    try:
        arena.upload("x", np.arange(64, dtype=np.float32))
        axpy = kernels.kernel("selftest_axpy")
        packed = axpy.pack(arena.ptr("y"), arena.ptr("x"), np.float32(2.0), 64)
        for _ in range(3):
            axpy.launch(1, 64, packed, stream=device.stream)
        assert np.array_equal(arena.download("y"), 6 * np.arange(64, dtype=np.float32))
    finally:
        arena.close()


def test_plan_checks_pointers(device, lt):
    plan = _plan(device, 16, 16, 16, epilogue="bias")
    try:
        with pytest.raises(ValueError, match="bias_ptr"):
            plan.run(256, 512, 768, stream=device.stream)
        with pytest.raises(ValueError, match="aligned"):
            plan.run(256 + 4, 512, 768, bias_ptr=1024, stream=device.stream)
        with pytest.raises(ValueError, match="aux_ptr"):
            plan.run(256, 512, 768, bias_ptr=1024, aux_ptr=2048, stream=device.stream)
        with pytest.raises(ValueError, match="stream"):
            plan.run(256, 512, 768, bias_ptr=1024)
    finally:
        plan.close()


# --------------------------------------------------------------------------------------------
# Graphs
# --------------------------------------------------------------------------------------------


class _Pipeline:
    """A small step: a relu_bias GEMM (bf16), a kernel rounding its output to BF16, a second
    GEMM (tf32) on the first's output, and an independent GEMM on a parallel branch."""

    m = n = k = 192

    def __init__(self, device, kernels):
        from foxhunt.fast.device import Arena

        m, n, k = self.m, self.n, self.k
        rng = np.random.default_rng(31)
        self.device = device
        self.arena = Arena.from_specs(device, {
            "x": ((m, k), np.uint16), "w": ((n, k), np.uint16), "b": ((n,), np.float32),
            "h": ((m, n), np.float32), "h16": ((m, n), np.uint16), "v": ((n, n), np.float32),
            "out": ((m, n), np.float32), "side_in": ((m, k), np.float32), "side_out": ((m, m), np.float32),
        })
        self.arena.upload("x", _to_device_layout(_representable(rng, (m, k), "bf16"), "bf16"))
        self.arena.upload("w", _to_device_layout(_representable(rng, (n, k), "bf16"), "bf16"))
        self.arena.upload("b", rng.standard_normal(n).astype(np.float32))
        self.arena.upload("v", rng.standard_normal((n, n)).astype(np.float32))
        self.arena.upload("side_in", rng.standard_normal((m, k)).astype(np.float32))
        self.first = _plan(device, m, n, k, trans_b=True, precision="bf16", epilogue="relu_bias")
        self.second = _plan(device, m, n, n, precision="tf32")
        self.side = _plan(device, m, m, k, trans_b=True, precision="f32")
        self.round = kernels.kernel("selftest_bf16_round")

    def enqueue(self, stream, branch=None):
        p = self.arena.ptr
        self.first.run(p("x"), p("w"), p("h"), bias_ptr=p("b"), stream=stream)
        self.round.launch(grid_for_all(self.m * self.n), BLOCK, p("h16"), p("h"), self.m * self.n,
                          stream=stream)
        self.second.run(p("h"), p("v"), p("out"), stream=stream)
        if branch is None:
            self.side.run(p("side_in"), p("side_in"), p("side_out"), stream=stream)
        else:
            with branch() as side:
                self.side.run(p("side_in"), p("side_in"), p("side_out"), stream=side)

    def outputs(self):
        return {name: self.arena.download(name) for name in ("h", "h16", "out", "side_out")}

    def clear_outputs(self):
        for name in ("h", "h16", "out", "side_out"):
            self.arena.zero(name)
        self.device.stream.synchronize()

    def close(self):
        for plan in (self.first, self.second, self.side):
            plan.close()
        self.arena.close()


def grid_for_all(n):
    from foxhunt.fast.device import grid_for

    return grid_for(n, BLOCK)


def test_graph_replay_equals_eager_bitwise(device, kernels, lt):
    from foxhunt.fast.graphs import GraphCapture

    pipe = _Pipeline(device, kernels)
    try:
        pipe.enqueue(device.stream)
        device.stream.synchronize()
        eager = pipe.outputs()
        assert np.any(eager["out"] != 0) and np.any(eager["side_out"] != 0)
        pipe.clear_outputs()

        graph = GraphCapture(device.stream)
        with graph:
            pipe.enqueue(device.stream, branch=graph.branch)
        assert np.all(pipe.outputs()["out"] == 0), "capture must not execute the work"
        assert graph.node_count >= 4 and graph.node_types()["KERNEL"] >= 4
        for _ in range(2):
            graph.replay()
            device.stream.synchronize()
            replayed = pipe.outputs()
            for name, value in eager.items():
                assert np.array_equal(_bits(replayed[name]), _bits(value)), name
            pipe.clear_outputs()
        graph.close()
    finally:
        pipe.close()


def test_captured_kernel_nodes_carry_priorities_by_level(device, kernels, lt):
    """GraphCapture's node priorities: every kernel node gets the priority that
    ``priority_ranks`` gives it over the context's range (read back from the graph), and the
    graph, instantiated to use them, still replays the eager results bit for bit (above)."""
    from foxhunt.fast.device import _driver, call
    from foxhunt.fast.graphs import GraphCapture, graph_edges, graph_nodes, priority_ranks

    drv = _driver()
    pipe = _Pipeline(device, kernels)
    try:
        graph = GraphCapture(device.stream)
        with graph:
            pipe.enqueue(device.stream, branch=graph.branch)
        least, greatest = call(drv.cuCtxGetStreamPriorityRange)
        nodes = graph_nodes(graph.graph)
        ranks = priority_ranks([int(n) for n in nodes],
                               [(int(a), int(b)) for a, b in graph_edges(graph.graph)],
                               least - greatest + 1)
        kernel = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
        attr = drv.CUkernelNodeAttrID.CU_LAUNCH_ATTRIBUTE_PRIORITY
        seen = {int(n): call(drv.cuGraphKernelNodeGetAttribute, n, attr).priority
                for n in nodes if call(drv.cuGraphNodeGetType, n) == kernel}
        assert graph.priority_nodes == len(seen) >= 4
        assert seen == {k: greatest + ranks[k] for k in seen}
        assert len(set(seen.values())) > 1, "a graph with a chain and a branch has several levels"
        # priority_group(): the pipeline twice in one graph, each part ranked on its own, so
        # each gets the priorities the pipeline's graph alone has (not those of one graph twice
        # as deep).
        grouped = GraphCapture(device.stream)
        with grouped:
            pipe.enqueue(device.stream, branch=grouped.branch)
            grouped.priority_group()
            pipe.enqueue(device.stream, branch=grouped.branch)
        first, second = grouped.priority_groups
        both = graph_nodes(grouped.graph)
        assert first.isdisjoint(second) and first | second == {int(n) for n in both}
        assert len(first) == len(second) == len(nodes)
        ranks = priority_ranks([int(n) for n in both],
                               [(int(a), int(b)) for a, b in graph_edges(grouped.graph)],
                               least - greatest + 1, groups=[first, second])
        seen2 = {int(n): call(drv.cuGraphKernelNodeGetAttribute, n, attr).priority
                 for n in both if call(drv.cuGraphNodeGetType, n) == kernel}
        assert seen2 == {k: greatest + ranks[k] for k in seen2}
        for part in (first, second):
            assert sorted(v for k, v in seen2.items() if k in part) == sorted(seen.values())
        grouped.close()
        plain = GraphCapture(device.stream, node_priority=False)
        with plain:
            pipe.enqueue(device.stream, branch=plain.branch)
        assert plain.priority_nodes == 0
        graph.close()
        plain.close()
    finally:
        pipe.close()


def test_capture_failure_is_discarded_and_the_stream_stays_usable(device, kernels, lt):
    from foxhunt.fast.device import Arena, CudaError
    from foxhunt.fast.graphs import GraphCapture

    arena = Arena.from_specs(device, {"x": ((4,), np.float32)})
    try:
        with pytest.raises(RuntimeError, match="boom"), GraphCapture(device.stream):
            raise RuntimeError("boom")
        assert not device.stream.is_capturing()
        # A synchronous upload syncs the stream: illegal during capture, so it must fail loudly.
        graph = GraphCapture(device.stream)
        with pytest.raises(CudaError), graph:
            arena.upload("x", np.ones(4, np.float32))
        assert graph.graph is None and not device.stream.is_capturing()
        arena.upload("x", np.full(4, 2, np.float32))
        assert np.all(arena.download("x") == 2)
    finally:
        arena.close()


# --------------------------------------------------------------------------------------------
# Report (python tests/test_fast_gpu.py): numbers for the record, not assertions
# --------------------------------------------------------------------------------------------


def _report() -> None:  # pragma: no cover - run by hand on a GPU machine
    import time

    from foxhunt.fast._build import compile_sources, source_files
    from foxhunt.fast.device import Arena, Device
    from foxhunt.fast.graphs import GraphCapture

    device = Device()
    print(f"device: {device}, {_REASON}")
    t0 = time.perf_counter()
    try:
        module = compile_sources(device.arch, cache=False)
        print(f"nvrtc {module.nvrtc_version}: compiled {len(module.images)} file(s) in "
              f"{time.perf_counter() - t0:.3f} s; {len(module.kernels)} kernels")
        loaded = device.load_module(module)
        print(f"loaded all into the context: {len(loaded.names)} kernels")
    except Exception as exc:  # noqa: BLE001 - report and go on
        print(f"compiling all of cuda_src failed: {type(exc).__name__}: {exc}")

    rng = np.random.default_rng(0)
    for precision in ("f32", "tf32", "bf16"):
        for m, n, k in SHAPES:
            a, b, a_op, b_op = _operands(rng, m, n, k, True, False, precision)
            plan = _plan(device, m, n, k, trans_a=True, precision=precision)
            gemm = _Gemm(device, plan)
            out = gemm.run(a, b)["c"]
            want = a_op @ b_op
            err = np.abs(out - want)
            ratio = np.max(err / (_gemm_bound(a_op, b_op, k, want) / GEMM_SAFETY))
            print(f"{precision} {m}x{n}x{k}: max |err| / (gamma_K |A||B| + 2u|C|) = {ratio:.3f}; "
                  f"rms err / rms C = {np.sqrt(np.mean(err**2) / np.mean(want**2)):.2e}; "
                  f"workspace {plan.workspace_nbytes} B")
            gemm.close()

    # NaN behaviour of the fused ReLU epilogues (the reference keeps NaN through ReLU).
    m, n, k = 8, 16, 8
    a = np.ones((m, k), np.float32)
    a[1, 0] = np.nan
    a[2, :] = -1.0
    w = np.ones((n, k), np.float32)
    fwd = _Gemm(device, _plan(device, m, n, k, trans_b=True, epilogue="relu_aux_bias"))
    out = fwd.run(a, w, bias=np.zeros(n, np.float32))
    mask = _aux_bits(out["aux"], m, n)
    print(f"relu_aux_bias: NaN pre-activation -> out {out['c'][1, 0]!r}, aux bit {mask[1, 0]}; "
          f"negative -> out {out['c'][2, 0]!r}, aux bit {mask[2, 0]}")
    relu = _Gemm(device, _plan(device, m, n, k, trans_b=True, epilogue="relu_bias"))
    print(f"relu_bias: NaN pre-activation -> out {relu.run(a, w, bias=np.zeros(n, np.float32))['c'][1, 0]!r}")
    dy = np.ones((m, k), np.float32)
    dy[2, 0] = np.nan  # row 2 is masked off by the forward
    bwd = _Gemm(device, _plan(device, m, n, k, precision="f32", epilogue="drelu_bgrad"))
    res = bwd.run(dy, np.ones((k, n), np.float32), aux=out["aux"])
    print(f"drelu_bgrad: NaN gradient where the mask is 0 -> {res['c'][2, 0]!r}; where the forward "
          f"was NaN (mask {mask[1, 0]}) -> {res['c'][1, 0]!r}; bias grad[0] {res['bias'][0]!r}")
    for g in (fwd, relu, bwd):
        g.close()

    # Host cost of one eager launch / GEMM call from Python.
    arena = Arena.from_specs(device, {"x": ((256, 256), np.float32), "y": ((256, 256), np.float32)})
    selftest = {"_selftest.cu": source_files()["_selftest.cu"]}
    axpy = device.load_module(compile_sources(device.arch, sources=selftest)).kernel("selftest_axpy")
    plan = _plan(device, 256, 256, 256)
    packed = axpy.pack(arena.ptr("y"), arena.ptr("x"), np.float32(0.0), 1)
    for label, fn in (
        ("kernel.launch (packing args)", lambda: axpy.launch(1, 32, arena.ptr("y"), arena.ptr("x"),
                                                             np.float32(0.0), 1, stream=device.stream)),
        ("kernel.launch (pre-packed)", lambda: axpy.launch(1, 32, packed, stream=device.stream)),
        ("plan.run 256^3 f32", lambda: plan.run(arena.ptr("x"), arena.ptr("x"), arena.ptr("y"),
                                                stream=device.stream)),
    ):
        fn()
        device.stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            fn()
        host_us = (time.perf_counter() - t0) / 500 * 1e6
        device.stream.synchronize()
        print(f"{label}: {host_us:.1f} us host time per call")
    plan.close()
    arena.close()

    # Graph of 27 GEMMs (256^3 bf16 relu_bias) vs the same enqueued eagerly.
    size, count, reps = 256, 27, 200
    arena = Arena.from_specs(device, {"x": ((size, size), np.uint16), "w": ((size, size), np.uint16),
                                      "b": ((size,), np.float32), "y": ((count, size, size), np.float32)})
    plan = _plan(device, size, size, size, trans_b=True, precision="bf16", epilogue="relu_bias")
    ys = [arena.ptr("y") + i * size * size * 4 for i in range(count)]

    def enqueue():
        for y in ys:
            plan.run(arena.ptr("x"), arena.ptr("w"), y, bias_ptr=arena.ptr("b"), stream=device.stream)

    enqueue()
    device.stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        enqueue()
    device.stream.synchronize()
    eager_us = (time.perf_counter() - t0) / 20 * 1e6
    graph = GraphCapture(device.stream)
    with graph:
        enqueue()
    graph.replay()
    device.stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    device.stream.synchronize()
    graph_us = (time.perf_counter() - t0) / reps * 1e6
    print(f"{count} GEMMs {size}^3 bf16 relu_bias: eager {eager_us:.1f} us/step (host-bound), "
          f"graph {graph_us:.1f} us/replay, {graph.node_count} nodes {dict(graph.node_types())}")
    graph.close()
    plan.close()
    arena.close()


if __name__ == "__main__":  # pragma: no cover
    if not _OK:
        raise SystemExit(f"no CUDA device/driver: {_REASON}")
    _report()


# ---------------------------------------------------------------------- spectral norm tiles
def test_spectral_norm_wide_matrix_crosses_column_tiles():
    """9000 columns: more than two of spectral.cu's SPECTRAL_COL_TILE (4096) tiles of W^T u
    partials, and 12 rows over a cluster of 8 blocks (two blocks without rows). Fast vs the
    reference within the SPEC's rtol 1e-5 (with the reduction's absolute floor), the bound
    applied (sigma above sigma_max), and batched == individual bitwise."""
    from foxhunt.fast.kernels import spectral as fast_spectral
    from foxhunt.reference.kernels import spectral as ref_spectral

    rng = np.random.default_rng(zlib.crc32(b"spectral-tiles"))
    rows, cols = 12, 9000
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    u, v = ref_spectral.init_spectral_vectors((rows, cols), seed=3)
    sigma_max = np.float32(0.5)
    want = ref_spectral.spectral_norm(w, u, v, sigma_max)
    got = fast_spectral.spectral_norm(w, u, v, sigma_max)
    assert want.sigma > sigma_max  # the rescale runs
    np.testing.assert_allclose(got.sigma, want.sigma, rtol=1e-5)
    for name in ("w", "u", "v"):
        a, b = getattr(got, name), getattr(want, name)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()), err_msg=name)
    small = [np.ascontiguousarray(a) for a in (w[:5, :300], u[:5], v[:300])]
    batched = fast_spectral.batched_spectral_norm([w, small[0]], [u, small[1]], [v, small[2]],
                                                  sigma_max)
    assert np.array_equal(batched.ws[0], got.w) and np.array_equal(batched.us[0], got.u)
    assert np.array_equal(batched.vs[0], got.v) and batched.sigmas[0] == got.sigma


@pytest.mark.parametrize("rows, cols", [(256, 256), (256, 128), (257, 259), (5, 3)])
def test_relu_mask_then_bias_grad_reduce_gives_relu_mask_bias_grads_bits(rows, cols):
    """The step's loss backward masks its ReLU gradients with ``relu_mask`` and sums the bias
    gradient with ``bias_grad_reduce`` beside the next GEMM (``StepProgram.input_grad``'s
    ``then``); elsewhere ``relu_mask_bias_grad`` does both. On the GPU the two give the same
    bits (``cuda_src/dense.cu``, the fused kernel's comment), NaN, Inf and huge terms included
    (a column holding one is re-summed row by row by both)."""
    from foxhunt.fast.kernels import dense as fdense

    rng = np.random.default_rng(rows * 1000 + cols)
    dy = rng.standard_normal((rows, cols)).astype(np.float32)
    h = rng.standard_normal((rows, cols)).astype(np.float32)
    h[0, 0], dy[1, 1], h[1, 1] = np.nan, np.nan, 1.0
    dy[-1, -1], h[-1, -1] = np.inf, 2.0
    dy[rows // 2, 0], h[rows // 2, 0] = np.float32(2.0**100), 1.0
    fused = fdense.relu_mask_bias_grad(dy, h)
    dx = fdense.relu_mask(dy, h)
    assert dx.tobytes() == fused.dx.tobytes()
    assert fdense.bias_grad_reduce(dx).tobytes() == fused.db.tobytes()
