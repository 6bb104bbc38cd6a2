"""The backward's GEMMs with their optional ReLU mask, ``gemm_tf32`` (TF32) and ``gemm_f32`` (its
exact-f32 twin): the reference twins against torch in float64 (the product) and torch's ReLU
backward (the mask), their argument checks, the launch plan and the shapes the step gives them, the
constants the plan shares with ``cuda_src/dense.cu``, the conformance entries on a small error and
on a masked element, and the step: each backward GEMM of the seed step that fits one launch, a ReLU
layer's input gradient with its mask (no ``relu_mask`` node), the CPU executor's steps bit for bit
as the cuBLASLt GEMMs' and masks'. GPU (skipped without a device, with the reason): the kernels
against their twins on every shape, a NaN row and determinism.

NVRTC compiles ``cuda_src/dense.cu`` in ``tests/test_fast_build.py`` (every source file).
"""

from __future__ import annotations

import re
from importlib import resources

import numpy as np
import pytest
import torch

import foxhunt.fast.step_program as step_program
from foxhunt.conformance.registry import SPECS
from foxhunt.conformance.tolerance import compare, gamma
from foxhunt.fast.device import cuda_available
from foxhunt.fast.kernels import dense as fast_dense
from foxhunt.fast.records import Gemm
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels.dense import gemm_f32, gemm_tf32, tf32_round
from cpu_step_runs import assert_runs_bitwise_equal, launch_count, step_run

F32 = np.float32
#: kernel -> (reference twin, the operands' rounding, fast entry)
KERNELS = {"gemm_tf32": (gemm_tf32, tf32_round, fast_dense.gemm_tf32),
           "gemm_f32": (gemm_f32, lambda x: x, fast_dense.gemm_f32)}
_GPU, _WHY = cuda_available()
gpu = pytest.mark.skipif(not _GPU, reason=f"no CUDA device/driver: {_WHY}")
#: (m, n, k, trans_a, masked): the seed chain's shapes and odd tails past every tile edge.
SHAPES = [(256, 128, 153, False, True), (256, 256, 256, False, False), (256, 128, 256, True, False),
          (37, 20, 13, False, True), (5, 7, 259, True, True), (17, 33, 1, False, False),
          (256, 256, 200, True, True), (70, 90, 24, False, True)]


def _operands(m, n, k, trans_a, masked, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(F32)
    b = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(F32)
    h = None
    if masked:
        h = np.where(rng.random((m, n)) < 0.4, F32(0), rng.uniform(-1, 2, (m, n))).astype(F32)
        h[0, :3] = (np.nan, -0.0, np.inf)
    return a, b, h


# ------------------------------------------------------------------- the twin against torch
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("m, n, k, trans_a, masked", SHAPES)
def test_twin_is_the_product_then_torchs_relu_backward(kernel, m, n, k, trans_a, masked):
    twin, rounding, _ = KERNELS[kernel]
    a, b, h = _operands(m, n, k, trans_a, masked)
    got = twin(a, b, h, trans_a=trans_a)
    t = lambda x: torch.from_numpy(np.asarray(x, np.float64))  # noqa: E731
    op_a = t(rounding(np.ascontiguousarray(a.T if trans_a else a)))
    tb = t(rounding(b))
    product = op_a @ tb
    bound = (2 * gamma(k) * (op_a.abs() @ tb.abs())).numpy()
    plain = twin(a, b, trans_a=trans_a)
    assert np.all(np.abs(plain - product.numpy()) <= bound)
    if h is None:
        assert got.tobytes() == plain.tobytes()
        return
    # torch's ReLU backward (threshold_backward: h <= 0 gives 0, a NaN h passes the gradient)
    want = torch.ops.aten.threshold_backward(torch.from_numpy(plain), torch.from_numpy(h), 0.0)
    assert got.tobytes() == want.numpy().tobytes()
    assert got[0, 1] == 0 and np.signbit(got[0, 1]) == np.False_  # h = -0.0: +0
    assert got[0, 0] == plain[0, 0]  # h = NaN passes


def test_tf32_twin_rounds_its_operands_ties_away_from_zero_and_f32_does_not_round():
    """1 + 2^-11 is a TF32 tie: rounded up to 1 + 2^-10 (cvt.rna), so the product is that."""
    a = np.array([[1 + 2.0 ** -11]], F32)
    assert gemm_tf32(a, np.ones((1, 1), F32))[0, 0] == F32(1 + 2.0 ** -10)
    assert gemm_f32(a, np.ones((1, 1), F32))[0, 0] == a[0, 0]


@pytest.mark.parametrize("edit, exc, match", [
    (dict(b=np.zeros((4, 3), F32)), ValueError,
     r"^b: shape \(4, 3\) but op\(a\) is \[2, 5\]; expected \[K, N\] with K = 5$"),
    (dict(h=np.zeros((2, 4), F32)), ValueError,
     r"^h: shape \(2, 4\) is not allowed; expected \[M, N\], op\(a\) @ b's shape = \(2, 3\)$"),
    (dict(trans_a=1), TypeError, r"^trans_a: expected a bool, got int$"),
    (dict(a=np.zeros(5, F32)), ValueError, r"^a: "),
    (dict(h=np.zeros((2, 3), np.float64)), (ValueError, TypeError), r"^h: "),
])
@pytest.mark.parametrize("kernel", KERNELS)
def test_bad_arguments_raise_one_line_naming_the_field(kernel, edit, exc, match):
    kw = dict(a=np.zeros((2, 5), F32), b=np.zeros((5, 3), F32), h=None, trans_a=False)
    kw.update(edit)
    with pytest.raises(exc, match=match):
        KERNELS[kernel][0](kw["a"], kw["b"], kw["h"], trans_a=kw["trans_a"])


# ------------------------------------------------------------------------------ the plan
def _cu_define(name: str) -> int:
    text = (resources.files("foxhunt.cuda_src") / "tf32_mma.cuh").read_text()
    return int(re.search(rf"^#define {name} (\d+)$", text, re.M).group(1))


def test_plan_constants_are_the_sources():
    assert fast_dense.GEMM_TF32_WARPS == _cu_define("GEMM_TF32_WARPS")
    assert fast_dense.GEMM_TF32_ROWS == _cu_define("GEMM_TF32_ROWS")
    text = (resources.files("foxhunt.cuda_src") / "dense.cu").read_text()
    for tile_m, tile_n in fast_dense.GEMM_TF32_TILES:
        for kernel in KERNELS:
            assert f"{kernel}_tile<{tile_m // 16}, {tile_n}>" in text
    assert fast_dense.plan_gemm_f32 is fast_dense.plan_gemm_tf32


@pytest.mark.parametrize("m, n, k, trans_a, tile", [
    (256, 128, 153, False, (32, 32)), (256, 256, 256, False, (32, 32)),
    (256, 128, 256, True, (32, 32)), (102, 128, 256, True, (16, 32)),
    (51, 128, 256, True, (16, 16)), (37, 20, 13, False, (16, 16))])
def test_plan_tiles_and_shared_memory(m, n, k, trans_a, tile):
    grid, block, nbytes = fast_dense.plan_gemm_tf32(m, n, k, trans_a)
    assert fast_dense.gemm_tf32_tile(m, n) == tile
    tile_m, tile_n = tile
    assert grid == (-(-n // tile_n), -(-m // tile_m)) and block == (256,)
    # 8 warps, each ceil(ceil(k / 8) / 8) steps of 8 of k: b [kw, tile_n + 8] and a [tile_m,
    # kw + 4] ([kw, tile_m + 8] transposed) floats, then 8 partial tiles of tile_m x tile_n.
    kw = 8 * -(-(-(-k // 8)) // 8)
    a_floats = kw * (tile_m + 8) if trans_a else tile_m * (kw + 4)
    assert nbytes == 4 * 8 * (kw * (tile_n + 8) + a_floats + tile_m * tile_n)


def test_the_step_runs_the_narrow_gemms_and_leaves_wide_or_long_ones_to_cublaslt():
    """At most 32 blocks (GEMM_TF32_MAX_BLOCKS) and k <= 256: the seed heads' and first layer's
    gradients fit (32 x 32 tiles), the 256 x 256 products and the IQN head's long weight gradients
    do not."""
    assert fast_dense.GEMM_TF32_MAX_BLOCKS == 32
    for m, n, k in ((256, 128, 153), (256, 128, 256), (153, 128, 256), (128, 256, 256),
                    (256, 128, 51)):
        assert fast_dense.gemm_tf32_fits(m, n, k)
    assert not fast_dense.gemm_tf32_fits(256, 128, 257)  # k past GEMM_TF32_MAX_K
    assert not fast_dense.gemm_tf32_fits(256, 256, 256)  # 8 x 8 blocks of 32 x 32
    assert not fast_dense.gemm_tf32_fits(256, 512, 512)  # the width-512 trunk's input gradient


def test_plan_refusals_name_the_field_and_the_limit():
    with pytest.raises(ValueError, match=r"^k=0: gemm_tf32 needs positive sizes$"):
        fast_dense.plan_gemm_tf32(4, 4, 0, False)
    with pytest.raises(ValueError, match=r"^k=100000: gemm_tf32 needs \d+ bytes of shared memory "
                                         r"per block; sm_90 allows \d+$"):
        fast_dense.plan_gemm_tf32(16, 16, 100_000, False)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_entry_catches_a_small_error_and_a_missed_mask(kernel):
    """The GEMM policy on the values both paths multiply: a 1e-4 relative error fails (the TF32
    input slack, 2^-10, would have let it pass), and so does a masked element left set."""
    spec = SPECS[kernel]
    kw = spec.sample_inputs("tiny", np.random.default_rng(3))
    want = KERNELS[kernel][0](**kw)
    inputs = spec.compare_inputs(kw, {"out": want})["out"]
    assert compare(kernel, want.copy(), want, spec.tolerance_of("out"), inputs).passed
    off = want.copy()
    i = np.unravel_index(np.argmax(np.abs(want)), want.shape)
    off[i] *= F32(1 + 1e-4)
    assert not compare(kernel, off, want, spec.tolerance_of("out"), inputs).passed
    masked = np.argwhere(kw["h"] <= 0)[0]
    leak = want.copy()
    leak[tuple(masked)] = F32(1e-30)
    result = compare(kernel, leak, want, spec.tolerance_of("out"), inputs)
    assert not result.passed and "bit for bit" in result.message


def test_a_smaller_launch_never_lowers_the_kernels_shared_memory_allowance(monkeypatch):
    """gemm_tf32's launches in one plan ask for different shared memory (tile width, k, trans_a):
    the function attribute only ever grows, so a launch planned with more keeps its allowance
    when a smaller one is packed after it (else a later capture fails, CUDA_ERROR_INVALID_VALUE)."""
    import types

    import foxhunt.fast.kernel_launch as kl

    attr = types.SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES="max_dyn")
    monkeypatch.setattr(kl, "_driver", lambda: types.SimpleNamespace(
        cuFuncSetAttribute="set", CUfunction_attribute=attr))
    calls = []
    monkeypatch.setattr(kl, "call", lambda fn, *args: calls.append((fn, *args)))
    kernel = kl.Kernel("gemm_tf32", function="f", params=())
    for nbytes in (75_776, 57_344, 75_776, 80_000):
        kernel.set_max_dynamic_shared(nbytes)
    assert calls == [("set", "f", "max_dyn", 75_776), ("set", "f", "max_dyn", 80_000)]


def test_a_test_entry_launch_opts_in_to_its_shared_memory_past_48_kib(monkeypatch):
    """``_runtime.call`` (every test entry's launch) opts a kernel in to a launch's dynamic shared
    memory above ``SHARED_LIMIT``, as the graph lowering does for a launch record."""
    import types

    from foxhunt.fast.kernels import _runtime

    asked = []

    class Kernel:
        def set_max_dynamic_shared(self, nbytes):
            asked.append(nbytes)

        def launch(self, grid, block, *args, stream=None, shared_mem=0):
            asked.append(("launch", shared_mem))

    rt = types.SimpleNamespace(module=types.SimpleNamespace(kernel=lambda name: Kernel()),
                               device=None, stream=None)
    monkeypatch.setattr(_runtime, "runtime", lambda: rt)
    for nbytes in (_runtime.SHARED_LIMIT, _runtime.SHARED_LIMIT + 4):
        _runtime.call("gemm_tf32", (1,), (256,), 3, shared_mem=nbytes)
    assert asked == [("launch", _runtime.SHARED_LIMIT), _runtime.SHARED_LIMIT + 4,
                     ("launch", _runtime.SHARED_LIMIT + 4)]


# ------------------------------------------------------------------------ in the step plan
def _backward_gemms(ops) -> list:
    """The cuBLASLt GEMMs of the backward passes (the forward's are ``x @ W^T``:
    ``StepProgram.linear``'s ``trans_b``)."""
    return [n for n in ops.nodes() if isinstance(n, Gemm) and not n.spec.trans_b]


@pytest.mark.parametrize("precision, source, kernel", [
    ("bf16", "core", "gemm_tf32"), ("tf32", "core", "gemm_tf32"), ("bf16", "all", "gemm_tf32"),
    ("f32", "core", "gemm_f32"), ("f32", "all", "gemm_f32")])
def test_the_backward_gemms_that_fit_are_one_launch_each(precision, source, kernel, monkeypatch):
    """Graph 1 of the seed step: each backward GEMM that ``gemm_tf32_fits`` is one launch of its
    precision's kernel (those that do not stay cuBLASLt's), a masked one in place of its relu_mask
    too; in f32 (``MASKED_ONLY``) only the masked ones."""
    from foxhunt.fast.cpu_executor import CpuEngine
    from foxhunt.reference.config import source_overrides

    config = DQNConfig.preset("seed", precision=precision, **source_overrides(source))
    graph1 = CpuEngine(config).plans["graph1"]
    monkeypatch.setattr(step_program, "BACKWARD_GEMM_KERNELS", False)
    before = CpuEngine(config).plans["graph1"]
    shapes = lambda ops: [(g.spec.m, g.spec.n, g.spec.k) for g in _backward_gemms(ops)]  # noqa: E731
    fit = [s for s in shapes(before) if fast_dense.gemm_tf32_fits(*s)]
    assert launch_count(graph1, ({"gemm_tf32", "gemm_f32"} - {kernel}).pop()) == 0
    masks = launch_count(before, "relu_mask") - launch_count(graph1, "relu_mask")
    assert masks > 0
    if precision in step_program.MASKED_ONLY:  # only the masked GEMMs: one per relu_mask gone
        assert launch_count(graph1, kernel) == masks
        assert len(shapes(graph1)) == len(shapes(before)) - masks
        return
    assert fit and launch_count(graph1, kernel) == len(fit)
    assert sorted(shapes(graph1)) == sorted(s for s in shapes(before) if s not in fit)


@pytest.mark.parametrize("precision, options", [
    ("bf16", {}), ("bf16", dict(stacked_backward=True)), ("bf16", dict(fused_trunk=True)),
    ("tf32", {}), ("f32", {})], ids=["bf16", "bf16-stacked", "bf16-fused-trunk", "tf32", "f32"])
def test_on_the_cpu_executor_the_step_is_bitwise_the_cublaslt_gemms(precision, options,
                                                                    monkeypatch):
    """The launch's twin is gemm(mode=...) then relu_mask, so the CPU executor's steps with
    and without it end in the same bits (every state buffer, the step scalars, the TD errors and
    the greedy Q's), the second-wave sources on."""
    config = DQNConfig.preset("tiny", precision=precision, lambda_iqn=1.0,
                              aux_next_bar_weight=0.1, aux_regime_weight=0.1)
    with_launch = step_run(config, options)
    monkeypatch.setattr(step_program, "BACKWARD_GEMM_KERNELS", False)
    assert_runs_bitwise_equal(config, step_run(config, options), with_launch)


# --------------------------------------------------------------------------------- GPU
def _failures(kernel, kw, actual) -> list[str]:
    spec = SPECS[kernel]
    want = KERNELS[kernel][0](**kw)
    inputs = spec.compare_inputs(kw, {"out": want})["out"]
    result = compare(kernel, actual, want, spec.tolerance_of("out"), inputs)
    return [] if result.passed else [result.message]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("m, n, k, trans_a, masked", SHAPES)
def test_kernel_conforms_to_the_twin(kernel, m, n, k, trans_a, masked):
    a, b, h = _operands(m, n, k, trans_a, masked, seed=5)
    kw = dict(a=a, b=b, h=h, trans_a=trans_a)
    assert not _failures(kernel, kw, KERNELS[kernel][2](**kw))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_nan_row_stays_in_its_row_and_the_kernel_is_deterministic(kernel):
    fast = KERNELS[kernel][2]
    a, b, h = _operands(256, 128, 153, False, True, seed=9)
    a[37, 5] = np.nan
    first = fast(a, b, h)
    second = fast(a, b, h)
    assert first.tobytes() == second.tobytes()
    live = ~(h[37] <= 0)
    assert np.isnan(first[37, live]).all() and (first[37, ~live] == 0).all()
    others = np.arange(256) != 37
    assert np.isfinite(first[others]).all()
