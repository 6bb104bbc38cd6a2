"""The fused trunk forward (``trunk_forward_bf16``): its reference twin against torch in float64,
the bitmask layout, the launch plan and its refusals, the comparison inputs its conformance
entry adds to the tolerance policy, and the entry's bounds on a legitimate variant (another
summation order, its own BF16 rounding of h1). GPU (skipped without a device, with the reason):
the kernel against the twin at the seed shapes and an odd legal shape, against the four-node
chain it replaces (cuBLASLt + the fast launchers), NaN rows, determinism, null bitmasks.

NVRTC compiles ``cuda_src/trunk.cu`` in ``tests/test_fast_build.py`` (every source file).
"""

from __future__ import annotations

import re
from importlib import resources

import numpy as np
import pytest
import torch

from foxhunt.conformance.registry import SPECS
from foxhunt.conformance.specs.trunk import trunk_sample
from foxhunt.conformance.tolerance import Tolerance, compare, gamma
from foxhunt.fast.device import cuda_available
from foxhunt.fast.kernels import trunk as fast_trunk
from foxhunt.reference.kernels.dense import bf16_to_f32, f32_to_bf16
from foxhunt.reference.kernels.trunk import (
    TrunkForward,
    aux_row_bytes,
    relu_aux_bits,
    trunk_forward_bf16,
)
from cpu_step_runs import assert_steps_bitwise_equal, launch_count

F32, U8, U16 = np.float32, np.uint8, np.uint16
SPEC = SPECS["trunk_forward_bf16"]
SEED_DIMS = ((256, 128, 256, 256), (512, 128, 256, 256))
ODD_DIMS = (257, 48, 80, 272)
#: Streamed on sm_90 (H1 = 528 needs 72 columns per cluster block; two passes), K chunks of 64
#: and 16; H2 = 48 leaves two cluster blocks without columns.
STREAMED_DIMS = (37, 32, 528, 48)
_GPU, _WHY = cuda_available()
gpu = pytest.mark.skipif(not _GPU, reason=f"no CUDA device/driver: {_WHY}")


def _kwargs(dims, seed=0, **kw):
    return trunk_sample(np.random.default_rng(seed), *dims, **kw)


def _conformance_failures(kwargs, actual: TrunkForward, expected: TrunkForward) -> list[str]:
    """The entry's comparison of every output (``expected`` plays the reference)."""
    got, want = SPEC.split_outputs(actual), SPEC.split_outputs(expected)
    inputs = SPEC.compare_inputs(kwargs, want)
    results = [compare(f"trunk.{out}", got[out], want[out], SPEC.tolerance_of(out), inputs[out])
               for out in want]
    return [r.message for r in results if not r.passed]


# ------------------------------------------------------------------- the twin against torch
@pytest.mark.parametrize("dims", [(64, 16, 32, 32), ODD_DIMS], ids=["tiny", "odd"])
def test_twin_is_the_trunk_forward_in_float64_within_the_gemm_bound(dims):
    kw = _kwargs(dims)
    out = trunk_forward_bf16(**kw)
    t = lambda a: torch.from_numpy(np.asarray(a, np.float64))  # noqa: E731
    x, w1, w2 = (t(bf16_to_f32(kw[k])) for k in ("xb", "w1", "w2"))
    b1, b2 = t(kw["b1"]), t(kw["b2"])

    def check(pre, absolute, k, h, aux):
        bound = (2 * gamma(k + 1) * absolute).numpy()
        want = torch.relu(pre).numpy()
        assert np.all(np.abs(h - want) <= bound)
        decided = np.abs(pre.numpy()) > bound
        assert decided.mean() > 0.99
        bits = np.unpackbits(aux, axis=1, bitorder="little")[:, :h.shape[1]].astype(bool)
        assert np.array_equal(bits[decided], (pre.numpy() > 0)[decided])
        return bound

    pre1 = x @ w1.T + b1
    check(pre1, x.abs() @ w1.abs().T + b1.abs(), dims[1], out.h1, out.aux1)
    assert np.array_equal(out.h1_bf16, f32_to_bf16(out.h1))
    h1b = t(bf16_to_f32(out.h1_bf16))
    pre2 = h1b @ w2.T + b2
    bound2 = check(pre2, h1b.abs() @ w2.abs().T + b2.abs(), dims[2], out.h2pre, out.aux2)
    cap = float(kw["mult"]) * max(float(kw["isv"][kw["index"]]), 1.0)
    want_h2 = torch.clamp(torch.relu(pre2), max=cap).numpy()
    assert np.all(np.abs(out.h2 - want_h2) <= bound2)
    assert (want_h2 == cap).any() and (want_h2 < cap).any(), "the sample exercises the clamp"
    assert np.array_equal(out.h2_bf16, f32_to_bf16(out.h2))


def test_relu_aux_bits_pack_little_endian_rows_padded_to_16_bytes():
    h = np.zeros((2, 20), F32)
    h[0, [0, 3, 9]] = 1.0
    h[1, 19] = np.nan
    h[1, 18] = -0.0
    bits = relu_aux_bits(h)
    assert bits.shape == (2, 16) and bits.dtype == U8
    assert bits[0, :3].tolist() == [0b1001, 0b10, 0]
    assert bits[1, :3].tolist() == [0, 0, 0b1000]
    assert not bits[:, 3:].any()


@pytest.mark.parametrize("cols", [16, 32, 80, 128, 136, 256, 272])
def test_aux_row_bytes_is_the_gemm_plans_bitmask_row(cols):
    from foxhunt.fast.gemm import GemmSpec

    spec = GemmSpec(7, cols, 16, trans_b=True, precision="bf16", epilogue="relu_aux_bias")
    assert aux_row_bytes(cols) == spec.aux_ld // 8 == spec.aux_nbytes // 7


def test_without_aux_the_twin_returns_empty_masks_and_the_same_values():
    kw = _kwargs((5, 16, 32, 16))
    with_aux = trunk_forward_bf16(**kw)
    without = trunk_forward_bf16(**{**kw, "with_aux": False})
    assert without.aux1.shape == without.aux2.shape == (0,)
    for name in ("h1", "h1_bf16", "h2pre", "h2", "h2_bf16"):
        assert getattr(without, name).tobytes() == getattr(with_aux, name).tobytes()


# ----------------------------------------------------------------------------- the plan
def _cu_define(name: str) -> int:
    text = (resources.files("foxhunt.cuda_src") / "trunk.cu").read_text()
    return int(re.search(rf"#define {name} (\d+)", text).group(1))


def test_plan_constants_are_trunk_cu_s():
    assert fast_trunk.TRUNK_ROWS_PER_BLOCK == 16 * _cu_define("TRUNK_MT")
    assert fast_trunk.TRUNK_K_CHUNK == _cu_define("TRUNK_KC")
    assert fast_trunk.TRUNK_STAGES == _cu_define("TRUNK_STAGES")
    assert fast_trunk.TRUNK_PAD == _cu_define("TRUNK_PAD")
    warps = _cu_define("TRUNK_WARPS")
    assert fast_trunk.TRUNK_THREADS == 32 * warps
    assert fast_trunk.TRUNK_COLS_PER_PASS == warps * 8 * _cu_define("TRUNK_NT")


def test_plan_of_the_seed_shapes():
    # A cluster of 8 blocks (sm_90) per 16 rows, 32 columns of each layer per block (resident);
    # shared: xb tile 16 x 136, h1 tile 16 x 264, W1 slice 32 x 136, W2 slice 32 x 264 (bf16).
    smem = 2 * (16 * 136 + 16 * 264 + 32 * 136 + 32 * 264)
    assert fast_trunk.plan_trunk_forward_bf16(256, 128, 256, 256) == ((8, 16), (128,), smem)
    assert fast_trunk.plan_trunk_forward_bf16(512, 128, 256, 256) == ((8, 32), (128,), smem)
    assert fast_trunk.plan_trunk_forward_bf16(257, 48, 80, 272)[0] == (8, 17)
    # Before sm_90 there are no clusters: one block per 16 rows computes every column, its W
    # streamed in 3 chunks of 64 rows x 64 (+ 8) k.
    assert fast_trunk.plan_trunk_forward_bf16(512, 128, 256, 256, arch=80) == (
        (1, 32), (128,), 2 * (16 * 136 + 16 * 264 + 3 * 64 * 72))
    # The odd shape's H2 = 272 needs 40 columns per cluster block: resident; the streamed test
    # shape's H1 = 528 needs 72.
    assert fast_trunk.trunk_resident(80, 272, 8)
    assert not fast_trunk.trunk_resident(STREAMED_DIMS[2], STREAMED_DIMS[3], 8)


@pytest.mark.parametrize("dims, match", [
    ((256, 100, 256, 256), r"^SD=100: .* multiple of 16$"),
    ((256, 128, 0, 256), r"^H1=0: .* multiple of 16$"),
    ((256, 128, 256, 24), r"^H2=24: .* multiple of 16$"),
    ((0, 128, 256, 256), r"^rows=0: must be an integer >= 1$"),
    ((256, 128.0, 256, 256), r"^SD=128.0: "),
])
def test_plan_refuses_shapes_the_kernel_cannot_run(dims, match):
    with pytest.raises(ValueError, match=match):
        fast_trunk.plan_trunk_forward_bf16(*dims)


def test_plan_refuses_more_shared_memory_than_the_architecture_has():
    fast_trunk.plan_trunk_forward_bf16(256, 2048, 2048, 2048, arch=90)
    with pytest.raises(ValueError, match=r"^SD \+ H1=4096: .* sm_89 allows 101376$"):
        fast_trunk.plan_trunk_forward_bf16(256, 2048, 2048, 2048, arch=89)


def test_twin_refuses_widths_that_are_not_multiples_of_16():
    kw = _kwargs((5, 16, 32, 16))
    bad = {**kw, "w2": kw["w2"][:8].copy(), "b2": kw["b2"][:8].copy()}
    with pytest.raises(ValueError, match=r"^H2=8: "):
        trunk_forward_bf16(**bad)


# ---------------------------------------------------------- the comparison inputs it adds
def test_gemm_clip_compares_with_the_clipped_product():
    a = np.array([[1.0, 2.0], [-3.0, 1.0]])
    b = np.eye(2)
    tol = Tolerance.gemm("f32")
    relu = np.array([[1.0, 2.0], [0.0, 1.0]], F32)
    assert compare("c", relu, relu, tol, {"a": a, "b": b, "clip": (0.0, np.inf)}).passed
    assert not compare("c", relu, relu, tol, {"a": a, "b": b}).passed
    capped = np.minimum(relu, F32(1.5))
    assert compare("c", capped, capped, tol, {"a": a, "b": b, "clip": (0.0, 1.5)}).passed


def test_gemm_a_slack_widens_the_bound_by_slack_times_abs_b():
    a, b = np.array([[1.0, 1.0]]), np.array([[2.0], [-4.0]])
    tol = Tolerance.gemm("f32")
    moved = np.array([[-2.0 + 0.5 * 4]], F32)  # the fast path's a[0, 1] was 0.5 lower
    assert not compare("c", moved, moved, tol, {"a": a, "b": b}).passed
    assert compare("c", moved, moved, tol, {"a": a, "b": b, "a_slack": [[0.0, 0.26]]}).passed
    assert not compare("c", moved, moved, tol, {"a": a, "b": b, "a_slack": [[0.24, 0.0]]}).passed


def test_exact_free_bits_ignore_only_those_bits():
    want = np.array([0b1010, 0xFF], U8)
    got = np.array([0b1000, 0xFF], U8)
    assert not compare("m", got, want, Tolerance.exact()).passed
    assert compare("m", got, want, Tolerance.exact(), {"free_bits": np.array([0b10, 0], U8)}).passed
    assert not compare("m", got, want, Tolerance.exact(), {"free_bits": np.array([0b1, 0], U8)}).passed


# ------------------------------------------------ the entry's bounds on a legitimate variant
def _reversed_sum(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``a @ w.T`` in float32 with k from last to first (exact products of BF16 values)."""
    acc = np.zeros((a.shape[0], w.shape[0]), F32)
    for k in reversed(range(a.shape[1])):
        acc = (acc + np.outer(a[:, k], w[:, k]).astype(F32)).astype(F32)
    return acc


def _variant(kw, *, round_h1: bool = True, bias2: bool = True) -> TrunkForward:
    """The four nodes with another summation order (each layer's own BF16 rounding of h1)."""
    from foxhunt.reference.kernels.step import clamp_finite_isv

    def layer(a, w, b):
        pre = (_reversed_sum(a, bf16_to_f32(w)) + b).astype(F32)
        h = np.where(pre <= 0, F32(0), pre).astype(F32)
        return h, relu_aux_bits(h)

    h1, aux1 = layer(bf16_to_f32(kw["xb"]), kw["w1"], kw["b1"])
    h1b = f32_to_bf16(h1)
    h2pre, aux2 = layer(bf16_to_f32(h1b) if round_h1 else h1, kw["w2"],
                        kw["b2"] if bias2 else np.zeros_like(kw["b2"]))
    h2, h2b = clamp_finite_isv(h2pre, kw["isv"], kw["index"], kw["mult"], with_bf16=True)
    return TrunkForward(h1, aux1, h1b, h2pre, aux2, h2, h2b)


@pytest.mark.parametrize("dims, seed", [(SEED_DIMS[1], 6), (ODD_DIMS, 4)], ids=["seed", "odd"])
def test_entry_accepts_another_summation_order_with_its_own_bf16_h1(dims, seed):
    """Samples where the variant rounds some h1 to the neighbouring BF16 value (the odd one fails
    without ``a_slack``: a flipped operand moves h2pre elements past layer 2's own bound). The
    twin's h1 is a BLAS float32 product whose summation order depends on the CPU's kernel, so
    the first of ``seed``, ``seed + 1``, ... whose sample shows a flip on this machine is used."""
    for s in range(seed, seed + 40):
        kw = _kwargs(dims, seed=s)
        variant, twin = _variant(kw), trunk_forward_bf16(**kw)
        if (variant.h1_bf16 != twin.h1_bf16).any():
            break
    else:
        pytest.fail(f"no sample of seeds {seed}..{seed + 39} exercises a BF16 flip of h1")
    assert not _conformance_failures(kw, variant, twin)


def test_entry_catches_a_missed_rounding_or_bias_of_layer_2():
    kw = _kwargs((64, 16, 32, 32), seed=4)
    expected = trunk_forward_bf16(**kw)
    unrounded = "\n".join(_conformance_failures(kw, _variant(kw, round_h1=False), expected))
    assert "trunk.h2pre" in unrounded and "trunk.h1:" not in unrounded
    unbiased = "\n".join(_conformance_failures(kw, _variant(kw, bias2=False), expected))
    assert "trunk.h2pre" in unbiased and "trunk.aux2" in unbiased


# --------------------------------------------------------------------------------- GPU
def _fast(kw) -> TrunkForward:
    return fast_trunk.trunk_forward_bf16(**kw)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dims", SEED_DIMS + (ODD_DIMS, (5, 16, 32, 16), STREAMED_DIMS),
                         ids=["seed256", "seed512", "odd", "extremal", "streamed"])
def test_fused_kernel_conforms_to_the_twin(dims):
    kw = _kwargs(dims, seed=7)
    assert not _conformance_failures(kw, _fast(kw), trunk_forward_bf16(**kw))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dims", SEED_DIMS, ids=["seed256", "seed512"])
def test_fused_kernel_conforms_to_the_four_node_chain(dims):
    """The chain it replaces, run on the GPU: cuBLASLt RELU_AUX_BIAS GEMMs, the fast
    f32_to_bf16 and clamp_finite_isv launchers. Both paths conform to the twin, and the fused
    kernel to the chain (playing the reference): bitmask bytes in cuBLASLt's layout included."""
    from foxhunt.fast.arena import Arena
    from foxhunt.fast.gemm import GemmPlan
    from foxhunt.fast.kernels import dense as fast_dense
    from foxhunt.fast.kernels import step as fast_step
    from foxhunt.fast.kernels._runtime import runtime

    kw = _kwargs(dims, seed=11)
    rows, sd, h1, h2 = dims
    dev = runtime().device
    plans = [GemmPlan(dev, rows, n, k, trans_b=True, precision="bf16", epilogue="relu_aux_bias")
             for n, k in ((h1, sd), (h2, h1))]
    arena = Arena.from_specs(dev, {
        "xb": ((rows, sd), U16), "w1": ((h1, sd), U16), "b1": ((h1,), F32),
        "h1": ((rows, h1), F32), "aux1": ((plans[0].spec.aux_nbytes,), U8),
        "h1b": ((rows, h1), U16), "w2": ((h2, h1), U16), "b2": ((h2,), F32),
        "h2pre": ((rows, h2), F32), "aux2": ((plans[1].spec.aux_nbytes,), U8)})
    try:
        for name in ("xb", "w1", "b1", "w2", "b2"):
            arena.upload(name, kw[name])
        p = arena.ptr
        plans[0].run(p("xb"), p("w1"), p("h1"), bias_ptr=p("b1"), aux_ptr=p("aux1"), stream=dev.stream)
        dev.stream.synchronize()
        h1_out = arena.download("h1")
        h1b = fast_dense.f32_to_bf16(h1_out)
        arena.upload("h1b", h1b)
        plans[1].run(p("h1b"), p("w2"), p("h2pre"), bias_ptr=p("b2"), aux_ptr=p("aux2"),
                     stream=dev.stream)
        dev.stream.synchronize()
        h2pre = arena.download("h2pre")
        aux1 = arena.download("aux1").reshape(rows, -1)
        aux2 = arena.download("aux2").reshape(rows, -1)
    finally:
        arena.close()
        for plan in plans:
            plan.close()
    h2_out, h2b = fast_step.clamp_finite_isv(h2pre, kw["isv"], kw["index"], kw["mult"], with_bf16=True)
    chain = TrunkForward(h1_out, aux1, h1b, h2pre, aux2, h2_out, h2b)
    assert not _conformance_failures(kw, chain, trunk_forward_bf16(**kw))
    assert not _conformance_failures(kw, _fast(kw), chain)


@gpu
@pytest.mark.gpu
def test_a_nan_state_stays_in_its_row_and_other_rows_keep_their_bits():
    kw = _kwargs(ODD_DIMS, seed=13)
    clean = _fast(kw)
    poisoned = dict(kw, xb=kw["xb"].copy())
    poisoned["xb"][100, 5] = f32_to_bf16(np.array([np.nan], F32))[0]
    out = _fast(poisoned)
    rows = np.arange(ODD_DIMS[0]) != 100
    for name in ("h1", "h2pre"):
        assert np.isnan(getattr(out, name)[100]).all()
    assert (out.h2[100] == 0).all() and not np.signbit(out.h2[100]).any()
    assert np.unpackbits(out.aux1[100], bitorder="little")[:ODD_DIMS[2]].all()
    for name in TrunkForward._fields:
        assert getattr(out, name)[rows].tobytes() == getattr(clean, name)[rows].tobytes(), name


@gpu
@pytest.mark.gpu
def test_fused_kernel_is_deterministic_and_null_bitmasks_change_nothing_else():
    kw = _kwargs(SEED_DIMS[1], seed=17)
    first, second = _fast(kw), _fast(kw)
    without = _fast({**kw, "with_aux": False})
    assert without.aux1.shape == without.aux2.shape == (0,)
    for name in TrunkForward._fields:
        assert getattr(first, name).tobytes() == getattr(second, name).tobytes(), name
        if name not in ("aux1", "aux2"):
            assert getattr(without, name).tobytes() == getattr(first, name).tobytes(), name


# ------------------------------------------------------------------------- in the step plan
@pytest.mark.parametrize("fuse, fused, clamps", [(True, 2, 0), (False, 0, 2)])
def test_fused_trunk_puts_one_launch_in_each_training_pass(fuse, fused, clamps):
    """Graph 1 of the seed bf16 step on sm_90 (the CPU executor's plans): with ``fused_trunk``
    the online and target passes each run ONE trunk_forward_bf16 instead of GEMM, f32_to_bf16,
    GEMM, clamp_finite_isv; the evaluation forwards keep the four nodes."""
    from foxhunt.fast.cpu_executor import CpuEngine
    from foxhunt.reference.config import DQNConfig

    engine = CpuEngine(DQNConfig.preset("seed", precision="bf16"), fused_trunk=fuse)
    graph1 = engine.plans["graph1"]
    assert launch_count(graph1, "trunk_forward_bf16") == fused
    assert launch_count(graph1, "clamp_finite_isv") == clamps


def test_fused_trunk_refuses_what_the_kernel_cannot_run():
    from foxhunt.fast.cpu_executor import CpuTrainer
    from foxhunt.reference.config import DQNConfig

    with pytest.raises(ValueError, match=r"^fused_trunk=True: .* got precision 'f32', sm_90, "
                                         r"SD=16, H1=32, H2=32$"):
        CpuTrainer(DQNConfig.preset("tiny", precision="f32"), fused_trunk=True)
    with pytest.raises(ValueError, match=r"^fused_trunk=1: must be a bool$"):
        CpuTrainer(DQNConfig.preset("tiny", precision="bf16"), fused_trunk=1)


def test_on_the_cpu_executor_the_fused_trunk_steps_bitwise_as_the_four_nodes():
    """The fused launch's twin is the composition of the four nodes' reference functions, so the
    CPU executor's steps with and without it end in the same bits (every state buffer, the
    step scalars, the TD errors and the greedy Q's)."""
    from foxhunt.reference.config import DQNConfig

    assert_steps_bitwise_equal(DQNConfig.preset("tiny", precision="bf16"), dict(fused_trunk=True))


@pytest.mark.parametrize("arch, widths, fusable", [
    ("sm_90", (128, 256, 256), True), ("sm_80", (128, 256, 256), False),
    ("sm_90", (128, 512, 512), True), ("sm_90", (128, 1024, 256), False),
    ("sm_90", (120, 256, 256), False)])
def test_trunk_fusable_needs_clusters_and_resident_slices(arch, widths, fusable):
    assert fast_trunk.trunk_fusable(*widths, arch) == fusable
