"""The heads' input gradients into the trunk in one launch (``heads_dh2_tf32``: every head's
``dhid_h @ W1_h`` in TF32, the parts summed in the reference's order and the trunk's masks): the
reference twin against torch autograd in float64, its sum order, the launch plan and its
refusals, the constants the plan shares with ``cuda_src``, the conformance entry on another
summation order and on a missed mask, and the step: one launch a TF32 loss pass in place of the
heads' part GEMMs and ``h2_grad_sum_mask``, the CPU executor's steps bit for bit as those
nodes'. GPU (skipped without a device, with the reason): the kernel against the twin, a row's bits
independent of the other rows and the grid, a NaN row, determinism.

NVRTC compiles ``cuda_src/trunk.cu`` in ``tests/test_fast_build.py`` (every source file).
"""

from __future__ import annotations

import re
from importlib import resources

import numpy as np
import pytest
import torch

import foxhunt.fast.step_program as step_program
from foxhunt.conformance.registry import SPECS
from foxhunt.conformance.specs.trunk import dh2_sample, dh2_dims
from foxhunt.conformance.kernel_spec import case_dims
from foxhunt.conformance.tolerance import compare, gamma
from foxhunt.fast.device import cuda_available
from foxhunt.fast.kernels import trunk as fast_trunk
from foxhunt.reference.config import DQNConfig, source_overrides
from foxhunt.reference.kernels import dense, step
from foxhunt.reference.kernels import trunk as ref_trunk
from cpu_step_runs import assert_runs_bitwise_equal, launch_count, step_run

F32 = np.float32
_GPU, _WHY = cuda_available()
gpu = pytest.mark.skipif(not _GPU, reason=f"no CUDA device/driver: {_WHY}")
CASES = ("tiny", "seed", "odd", "extremal")
KERNEL = "heads_dh2_tf32"


def _kwargs(case: str, seed: int = 0) -> dict:
    return dh2_sample(case_dims(case), np.random.default_rng(seed))


def _failures(kwargs, actual, expected) -> list[str]:
    """The entry's comparison of both outputs (``expected`` plays the reference)."""
    spec = SPECS[KERNEL]
    got, want = spec.split_outputs(actual), spec.split_outputs(expected)
    inputs = spec.compare_inputs(kwargs, want)
    results = [compare(f"heads_dh2.{out}", got[out], want[out], spec.tolerance_of(out), inputs[out])
               for out in want]
    return [r.message for r in results if not r.passed]


# ------------------------------------------------------------------- the twin against torch
@pytest.mark.parametrize("case", CASES)
def test_twin_is_the_gradient_of_the_heads_first_layers_through_the_masks(case):
    """torch autograd (float64, on the TF32-rounded operands): ``dh2`` is the gradient of
    ``sum_h <dhid_h, h2 @ W1_h^T>`` in ``h2``, within the GEMM bound of k = sum(hidden); ``out``
    is it where the clamp passed the value and the ReLU was open, +0 elsewhere."""
    kw = _kwargs(case)
    r = ref_trunk.heads_dh2_tf32(**kw)
    a, b = (torch.from_numpy(dense.tf32_round(kw[n]).astype(np.float64)) for n in ("dhid", "w1"))
    h2 = torch.zeros(kw["h2"].shape, dtype=torch.float64, requires_grad=True)
    starts = np.cumsum([0] + kw["hidden"].tolist())
    loss = sum((a[:, s:e] * (h2 @ b[s:e].T)).sum() for s, e in zip(starts[:-1], starts[1:]))
    loss.backward()
    want = h2.grad.numpy()
    bound = 2 * gamma(int(starts[-1]) + len(starts)) * (np.abs(a.numpy()) @ np.abs(b.numpy()))
    assert np.all(np.abs(r.dh2 - want) <= bound)
    pre, clamped = kw["h2_pre"], kw["h2"]
    open_ = (pre > 0) & (clamped == pre)
    assert open_.any() and (~open_).any() and (clamped != pre).any()
    assert np.array_equal(r.out, np.where(open_, r.dh2, F32(0)))
    assert not np.signbit(r.out[~open_]).any()


def test_twin_sums_the_parts_branch_heads_first_then_the_value_head():
    """Bit for bit ``((0 + part_1) + part_2 + ...) + part_0`` (``heads_dh2_order``), the order of
    the step's packed ``dh2p`` (the reference network's); another order differs somewhere."""
    kw = _kwargs("seed", seed=3)
    assert ref_trunk.heads_dh2_order(4) == (1, 2, 3, 0)
    starts = np.cumsum([0] + kw["hidden"].tolist())
    parts = [dense.gemm(np.ascontiguousarray(kw["dhid"][:, s:e]),
                        np.ascontiguousarray(kw["w1"][s:e]), mode="tf32")
             for s, e in zip(starts[:-1], starts[1:])]
    total = np.zeros_like(parts[0])
    for h in (1, 2, 3, 0):
        total = (total + parts[h]).astype(F32)
    r = ref_trunk.heads_dh2_tf32(**kw)
    assert r.dh2.tobytes() == total.tobytes()
    other = np.zeros_like(parts[0])
    for h in (0, 1, 2, 3):
        other = (other + parts[h]).astype(F32)
    assert other.tobytes() != total.tobytes()


def test_twin_keeps_a_non_finite_hidden_gradient_in_its_row():
    kw = _kwargs("odd", seed=5)
    dhid = kw["dhid"].copy()
    dhid[17, 30] = np.inf
    r = ref_trunk.heads_dh2_tf32(**{**kw, "dhid": dhid})
    others = np.arange(dhid.shape[0]) != 17
    assert not np.isfinite(r.dh2[17]).all() and np.isfinite(r.dh2[others]).all()
    assert np.array_equal(r.out[others], ref_trunk.heads_dh2_tf32(**kw).out[others])


@pytest.mark.parametrize("edit, match", [
    (dict(hidden=np.array([], np.int32)), r"^hidden=\(\): heads_dh2_tf32 needs 1 to 8 heads$"),
    (dict(hidden=np.array([16, 0], np.int32)),
     r"^hidden\[1\]=0: heads_dh2_tf32 needs a width >= 1$"),
    (dict(w1=np.zeros((23, 16), F32)), r"^w1: .*\[sum\(hidden\), H2\]"),
    (dict(h2_pre=np.zeros((5, 15), F32)), r"^h2_pre: .*\[rows, H2\]"),
])
def test_bad_arguments_raise_one_line_naming_the_field(edit, match):
    kw = _kwargs("extremal")
    for entry in (ref_trunk.heads_dh2_tf32, fast_trunk.heads_dh2_tf32):
        with pytest.raises(ValueError, match=match):
            entry(**{**kw, **edit})


# ------------------------------------------------------------------------------ the plan
def test_plan_of_the_seed_shapes():
    """A cluster of 8 blocks (sm_90) a 64 x 64 tile of the 256 x 256 outputs; one block a tile
    before sm_90. Shared memory: a chunk of 64 k of the tile's dhid rows (rows of 64 + 4 floats)
    and W1 columns (64 + 8), which the partial tile (64 x 64 floats) reuses."""
    rows, hidden, h2 = dh2_dims("seed")
    assert fast_trunk.plan_heads_dh2_tf32(rows, h2, hidden) == ((4 * 8, 4), (256,), 35840)
    assert fast_trunk.plan_heads_dh2_tf32(rows, h2, hidden, arch=80) == ((4, 4), (256,), 35840)
    assert fast_trunk.heads_dh2_shared_bytes() == 4 * (64 * 68 + 64 * 72)
    assert fast_trunk.plan_heads_dh2_tf32(257, 40, (21, 300, 12)) == ((8, 5), (256,), 35840)


def _cu_define(text: str, name: str) -> int:
    return int(re.search(rf"^#define {name} (\d+)$", text, re.M).group(1))


def test_plan_constants_are_the_sources():
    text = (resources.files("foxhunt.cuda_src") / "trunk.cu").read_text()
    assert fast_trunk.HEADS_DH2_TILE == (_cu_define(text, "HDH_BM"), _cu_define(text, "HDH_BN"))
    assert fast_trunk.HEADS_DH2_KC == _cu_define(text, "HDH_KC")
    assert fast_trunk.HEADS_DH2_THREADS == 32 * _cu_define(text, "HDH_WARPS")
    # A head a cluster block at least (HEADS_MAX heads on sm_90's 8-block clusters).
    from foxhunt.fast.kernels._runtime import CLUSTER_SM90
    assert ref_trunk.HEADS_MAX <= CLUSTER_SM90


@pytest.mark.parametrize("args, match", [
    ((0, 16, (16,)), r"^rows=0"),
    ((4, 0, (16,)), r"^H2=0"),
    ((4, 16, (16,) * 9), r"^hidden=\(16(, 16){8}\): heads_dh2_tf32 needs 1 to 8 heads$"),
    ((4, 16, (16, 0)), r"^hidden\[1\]=0: heads_dh2_tf32 needs a width >= 1$"),
])
def test_plan_refuses_shapes_the_kernel_cannot_run(args, match):
    with pytest.raises(ValueError, match=match):
        fast_trunk.plan_heads_dh2_tf32(*args)


def test_heads_it_runs():
    """Any 1 to 8 heads of any widths (long k: chunks of 64), on an architecture with clusters."""
    assert fast_trunk.heads_dh2_fits((128,) * 4) and fast_trunk.heads_dh2_fits((1,) * 8)
    assert fast_trunk.heads_dh2_fits((4096, 3))
    assert not fast_trunk.heads_dh2_fits((16,) * 9) and not fast_trunk.heads_dh2_fits(())
    assert not fast_trunk.heads_dh2_fits((128,) * 4, arch=80)


def test_the_test_entries_packing_is_the_steps_layout():
    """``pack_hidden`` (both heads' test entries) puts head h's block at the step's packed offset
    (``heads_packed_offsets``, the step's ``OPERAND_ALIGN``), zeros between; ``unpack_hidden``
    inverts it."""
    from foxhunt.fast.step_layout import OPERAND_ALIGN

    rows, hidden = 5, (21, 300, 12)
    x = np.arange(rows * sum(hidden), dtype=F32).reshape(rows, sum(hidden)) + 1
    hid_off, total, _, _ = ref_trunk.heads_packed_offsets(hidden, [0, 0, 0], rows, OPERAND_ALIGN)
    packed = fast_trunk.pack_hidden(hidden, x, hid_off)
    assert packed.shape == (total,) and hid_off[1] % OPERAND_ALIGN == 0 and hid_off[1] > rows * 21
    assert np.count_nonzero(packed) == x.size
    assert np.array_equal(packed[hid_off[1]:hid_off[1] + 3], x[0, 21:24])
    assert np.array_equal(fast_trunk.unpack_hidden(hidden, rows, hid_off, packed), x)


def test_entry_accepts_another_summation_order_and_catches_a_missed_mask():
    kw = _kwargs("seed", seed=2)
    r = ref_trunk.heads_dh2_tf32(**kw)
    # The concatenated product in one float32 GEMM (k = 512 in BLAS's order): within the bound.
    whole = dense.gemm(kw["dhid"], kw["w1"], mode="tf32")
    reordered = step.h2_grad_sum_mask(whole[None], kw["h2"], kw["h2_pre"])
    assert whole.tobytes() != r.dh2.tobytes()
    assert not _failures(kw, reordered, r)
    # The clamp's mask left out: caught (the clamped elements must be +0 bit for bit).
    unclamped = np.where(kw["h2_pre"] <= 0, F32(0), r.dh2).astype(F32)
    assert _failures(kw, step.TrunkGrad(r.dh2, unclamped), r)


# ------------------------------------------------------------------------ in the step plan
@pytest.mark.parametrize("precision, source, options, launches", [
    ("bf16", "core", {}, 2), ("tf32", "core", {}, 2), ("f32", "core", {}, 0),
    ("bf16", "core", dict(stacked_backward=True), 0), ("bf16", "aux", {}, 1),
    ("bf16", "all", {}, 1),
], ids=["bf16", "tf32", "f32", "stacked", "aux", "every-source"])
def test_a_tf32_loss_pass_takes_its_heads_dh2_in_one_launch(precision, source, options,
                                                            launches, monkeypatch):
    """Graph 1 of the seed step (the CPU executor's plans) with ``FUSE_HEADS_DH2`` on: each
    unstacked TF32 loss pass (C51 and CQL) runs ONE heads_dh2_tf32 in place of four part GEMMs and
    h2_grad_sum_mask; f32 and the stacked backward keep the nodes; with an auxiliary head the C51
    pass keeps them (its sum takes the auxiliary heads' d h2: h2_grad_sum_aux_mask) and the CQL
    pass fuses. Off (the default) every pass keeps the nodes."""
    from foxhunt.fast.cpu_executor import CpuEngine

    config = DQNConfig.preset("seed", precision=precision, **source_overrides(source))
    assert step_program.FUSE_HEADS_DH2 == frozenset()
    base = CpuEngine(config, **options).plans["graph1"]
    monkeypatch.setattr(step_program, "FUSE_HEADS_DH2", frozenset({"tf32"}))
    graph1 = CpuEngine(config, **options).plans["graph1"]
    assert launch_count(graph1, KERNEL) == launches
    assert launch_count(base, KERNEL) == 0
    assert (launch_count(base, "h2_grad_sum_mask") - launch_count(graph1, "h2_grad_sum_mask")
            == launches)
    assert len(list(base.nodes())) - len(list(graph1.nodes())) == 4 * launches


def test_a_population_keeps_the_batched_part_gemms():
    """A member's plan (``population_plan.MEMBER_PROGRAM_OPTIONS``) keeps the part GEMMs, which
    the population batches over its members."""
    from foxhunt.fast.population_plan import _record_plan

    plans = _record_plan(DQNConfig.preset("tiny"), 1, False)
    assert launch_count(plans["graph1"], KERNEL) == 0
    assert launch_count(plans["graph1"], "h2_grad_sum_mask") == 2


@pytest.mark.parametrize("precision, config_kw", [
    ("bf16", {}), ("tf32", {}),
    ("bf16", dict(lambda_iqn=1.0, aux_next_bar_weight=0.1, aux_regime_weight=0.1))],
    ids=["bf16", "tf32", "bf16-second-wave"])
def test_on_the_cpu_executor_the_step_is_bitwise_the_nodes(precision, config_kw, monkeypatch):
    """The launch's twin is the composition of the nodes' reference functions, so the CPU
    executor's steps with and without it end in the same bits (every state buffer, the step
    scalars, the TD errors and the greedy Q's)."""
    config = DQNConfig.preset("tiny", precision=precision, **config_kw)
    monkeypatch.setattr(step_program, "FUSE_HEADS_DH2", frozenset({"tf32"}))
    with_launch = step_run(config, {})
    monkeypatch.setattr(step_program, "FUSE_HEADS_DH2", frozenset())
    assert_runs_bitwise_equal(config, step_run(config, {}), with_launch)


# --------------------------------------------------------------------------------- GPU
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_fused_kernel_conforms_to_the_twin(case):
    kw = _kwargs(case, seed=7)
    assert not _failures(kw, fast_trunk.heads_dh2_tf32(**kw), ref_trunk.heads_dh2_tf32(**kw))


@gpu
@pytest.mark.gpu
def test_a_rows_bits_do_not_depend_on_the_other_rows_or_the_grid():
    """The first 70 rows alone (a grid of 2 row tiles, the second partial) give the bits of
    those rows of the whole 257 (5 row tiles)."""
    kw = _kwargs("odd", seed=13)
    whole = fast_trunk.heads_dh2_tf32(**kw)
    part = fast_trunk.heads_dh2_tf32(**{**kw, "dhid": kw["dhid"][:70].copy(),
                                        "h2": kw["h2"][:70].copy(),
                                        "h2_pre": kw["h2_pre"][:70].copy()})
    assert all(a[:70].tobytes() == b.tobytes() for a, b in zip(whole, part))


@gpu
@pytest.mark.gpu
def test_a_nan_hidden_gradient_stays_in_its_row_and_the_kernel_is_deterministic():
    kw = _kwargs("seed", seed=9)
    dhid = kw["dhid"].copy()
    dhid[37, 200] = np.nan  # a branch head's hidden gradient of sample 37
    first = fast_trunk.heads_dh2_tf32(**{**kw, "dhid": dhid})
    second = fast_trunk.heads_dh2_tf32(**{**kw, "dhid": dhid})
    assert all(a.tobytes() == b.tobytes() for a, b in zip(first, second))
    others = np.arange(dhid.shape[0]) != 37
    assert np.isnan(first.dh2[37]).all() and np.isfinite(first.dh2[others]).all()
    clean = fast_trunk.heads_dh2_tf32(**kw)
    assert first.dh2[others].tobytes() == clean.dh2[others].tobytes()
    assert first.out[others].tobytes() == clean.out[others].tobytes()
