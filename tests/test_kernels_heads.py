"""The heads' fused forward (``heads_forward_bf16``): its reference twin against torch in float64,
the packed layout against the step's, the launch plan and its refusals, the conformance entry
on a legitimate variant and on a missed bias, and the step with ``fused_heads``: one launch a
training pass, the CPU executor's steps bit for bit as the nine nodes it replaces. GPU (skipped
without a device, with the reason): the kernel against the twin (seed, tiny, odd and one-head
shapes), the packed buffers it writes, NaN rows, determinism.

NVRTC compiles ``cuda_src/trunk.cu`` in ``tests/test_fast_build.py`` (every source file).
"""

from __future__ import annotations

import re
from importlib import resources

import numpy as np
import pytest
import torch

from foxhunt.conformance.registry import SPECS
from foxhunt.conformance.specs.trunk import heads_dims, heads_sample
from foxhunt.conformance.tolerance import compare, gamma
from foxhunt.fast.device import cuda_available
from foxhunt.fast.kernels import trunk as fast_trunk
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import dense
from foxhunt.reference.kernels.dense import bf16_to_f32, f32_to_bf16
from foxhunt.reference.kernels.trunk import (
    HEADS_FIELDS,
    HEADS_MAX,
    HeadsForward,
    heads_forward_bf16,
    heads_packed_offsets,
)
from cpu_step_runs import assert_steps_bitwise_equal, launch_count

F32, U16 = np.float32, np.uint16
SPEC = SPECS["heads_forward_bf16"]
_GPU, _WHY = cuda_available()
gpu = pytest.mark.skipif(not _GPU, reason=f"no CUDA device/driver: {_WHY}")
CASES = ("tiny", "seed", "odd", "extremal")


def _kwargs(case: str, seed: int = 0) -> dict:
    return heads_sample(np.random.default_rng(seed), *heads_dims(case))


def _failures(kwargs, actual: HeadsForward, expected: HeadsForward) -> list[str]:
    """The entry's comparison of every output (``expected`` plays the reference)."""
    got, want = SPEC.split_outputs(actual), SPEC.split_outputs(expected)
    inputs = SPEC.compare_inputs(kwargs, want)
    results = [compare(f"heads.{out}", got[out], want[out], SPEC.tolerance_of(out), inputs[out])
               for out in want]
    return [r.message for r in results if not r.passed]


# ------------------------------------------------------------------- the twin against torch
@pytest.mark.parametrize("case", ["tiny", "odd"])
def test_twin_is_the_heads_forward_in_float64_within_the_gemm_bound(case):
    kw = _kwargs(case)
    out = heads_forward_bf16(**kw)
    t = lambda a: torch.from_numpy(np.asarray(a, np.float64))  # noqa: E731
    h2, w1, w2 = (t(bf16_to_f32(kw[k])) for k in ("h2b", "w1", "w2"))
    b1, b2 = t(kw["b1"]), t(kw["b2"])
    hidden, outs = kw["hidden"].tolist(), kw["out"].tolist()
    pre1 = h2 @ w1.T + b1
    bound1 = (2 * gamma(h2.shape[1] + 1) * (h2.abs() @ w1.abs().T + b1.abs())).numpy()
    assert np.all(np.abs(out.hid - torch.relu(pre1).numpy()) <= bound1)
    assert np.array_equal(out.hid_bf16, f32_to_bf16(out.hid))
    hb = t(bf16_to_f32(out.hid_bf16))
    h0 = o0 = 0
    for width, o in zip(hidden, outs):
        a, w = hb[:, h0:h0 + width], w2[o0:o0 + o, :width]
        pre2 = (a @ w.T + b2[o0:o0 + o]).numpy()
        bound2 = (2 * gamma(width + 1) * (a.abs() @ w.abs().T + b2[o0:o0 + o].abs())).numpy()
        assert np.all(np.abs(out.out[:, o0:o0 + o] - pre2) <= bound2)
        h0, o0 = h0 + width, o0 + o


def test_twin_reads_no_w2_column_past_its_heads_hidden_width():
    kw = _kwargs("odd", seed=3)
    poisoned = kw["w2"].copy()
    o0 = 0
    for width, o in zip(kw["hidden"], kw["out"]):
        poisoned[o0:o0 + o, width:] = 0x7FC0  # NaN where the head has no hidden column
        o0 += o
    a, b = heads_forward_bf16(**kw), heads_forward_bf16(**{**kw, "w2": poisoned})
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b))


@pytest.mark.parametrize("preset", ["tiny", "seed"])
@pytest.mark.parametrize("rows_of", ["online", "target"])
def test_packed_offsets_are_the_step_layouts(preset, rows_of):
    """The kernel's packed layout (``heads_packed_offsets``, trunk.cu's ``heads_read_table``)
    is the step layout's ``hid`` / ``adv`` packing of both training passes."""
    from foxhunt.fast.step_layout import OPERAND_ALIGN, StepLayout

    lay = StepLayout(DQNConfig.preset(preset, precision="bf16"))
    tag, rows = ("o", 2 * lay.B) if rows_of == "online" else ("t", lay.B)
    hid_off, hid_total, adv_off, adv_total = heads_packed_offsets(
        lay.head_hidden, lay.head_out, rows, OPERAND_ALIGN)
    hid, adv = lay.packed[f"hid{tag}"], lay.packed[f"adv{tag}"]
    assert hid_off == tuple(hid.offsets[h.key] for h in lay.heads) and hid_total == hid.total
    assert adv_off[1:] == tuple(adv.offsets[d] for d in range(lay.nb))
    assert adv_total == adv.total


# ------------------------------------------------------------------------------ the plan
def test_plan_of_the_seed_shapes():
    rows, h2, hidden, out = heads_dims("seed")
    grid, block, nbytes = fast_trunk.plan_heads_forward_bf16(rows, h2, hidden, out, arch="sm_90")
    assert grid == (8, rows // 16) and block == (256,)
    # h2 tile 16 x 264, hid tile 16 x 520, W1 rows 64 x 264 (W2's 64 x 136 in their place); BF16.
    assert nbytes == 2 * (16 * 264 + 16 * 520 + 64 * 264)


def test_plan_constants_are_trunk_cu_s():
    source = (resources.files("foxhunt.cuda_src") / "trunk.cu").read_text()
    defined = dict(re.findall(r"^#define (HEADS_\w+) (\d+)$", source, re.M))
    assert int(defined["HEADS_WARPS"]) == fast_trunk.HEADS_WARPS
    assert int(defined["HEADS_MAX"]) == HEADS_MAX
    assert int(defined["HEADS_FIELDS"]) == HEADS_FIELDS


@pytest.mark.parametrize("args, match", [
    ((64, 40, (16,), (3,)), r"^H2=40: the fused heads kernel needs a positive multiple of 16$"),
    ((64, 32, (16, 24), (3, 3)), r"^hidden\[1\]=24: .*multiple of 16$"),
    ((64, 32, (16,) * (HEADS_MAX + 1), (3,) * (HEADS_MAX + 1)), r"needs 1 to 8 heads"),
    ((64, 32, (16, 16), (3, 0)), r"^out=\(3, 0\): every head needs at least one output$"),
    ((64, 32, (256, 272), (3, 3)), r"keeps at most 512 hidden and padded output columns on "
                                   r"sm_90 \(clusters of 8\); got 528 and 16$"),
    ((64, 32, (16,), (3,)), None),
])
def test_plan_refuses_shapes_the_kernel_cannot_run(args, match):
    if match is None:
        fast_trunk.plan_heads_forward_bf16(*args, arch="sm_90")
        return
    with pytest.raises(ValueError, match=match):
        fast_trunk.plan_heads_forward_bf16(*args, arch="sm_90")


@pytest.mark.parametrize("arch, fusable", [("sm_90", True), ("sm_80", False)])
def test_heads_fusable_needs_clusters(arch, fusable):
    _, h2, hidden, out = heads_dims("seed")
    assert fast_trunk.heads_fusable(h2, hidden, out, arch) == fusable
    assert not fast_trunk.heads_fusable(h2, (256, 272), (3, 3), arch)


def test_table_refuses_a_weight_offset_the_copies_cannot_read():
    with pytest.raises(ValueError, match=r"^head 1's w2 offset 36: .*multiple of 8 elements$"):
        fast_trunk.heads_table((16, 16), (3, 3), [(0, 8, 16, 24), (32, 40, 36, 48)])


# ------------------------------------------------------------------ the conformance entry
def test_entry_accepts_another_summation_order_and_catches_a_missed_bias():
    """A legitimate variant (layer 1 in float64 then rounded once, the heads' second layers
    likewise) passes; the same variant without layer 2's bias fails on ``out`` only."""
    kw = _kwargs("odd", seed=5)
    twin = heads_forward_bf16(**kw)
    h2, w1 = bf16_to_f32(kw["h2b"]).astype(np.float64), bf16_to_f32(kw["w1"]).astype(np.float64)
    hid = dense.add_bias_relu((h2 @ w1.T).astype(F32), kw["b1"])
    hid_bf16 = f32_to_bf16(hid)
    outs, nobias = [], []
    h0 = o0 = 0
    for width, o in zip(kw["hidden"], kw["out"]):
        a = bf16_to_f32(hid_bf16[:, h0:h0 + width]).astype(np.float64)
        prod = (a @ bf16_to_f32(kw["w2"][o0:o0 + o, :width]).astype(np.float64).T).astype(F32)
        outs.append(prod + kw["b2"][o0:o0 + o])
        nobias.append(prod)
        h0, o0 = h0 + width, o0 + o
    variant = HeadsForward(hid, hid_bf16, np.concatenate(outs, axis=1))
    assert not _failures(kw, variant, twin)
    missed = "\n".join(_failures(kw, variant._replace(out=np.concatenate(nobias, axis=1)), twin))
    assert "heads.out" in missed and "heads.hid" not in missed


# ------------------------------------------------------------------------ in the step plan
@pytest.mark.parametrize("fuse, fused, gemms_less", [(True, 2, 8), (False, 0, 0)])
def test_fused_heads_put_one_launch_in_each_training_pass(fuse, fused, gemms_less):
    """Graph 1 of the seed bf16 step on sm_90 (the CPU executor's plans): with ``fused_heads``
    the online and target passes each run ONE heads_forward_bf16 instead of their four
    first-layer GEMMs and ``heads_out_dueling_bf16`` (which replaced the second layers' four
    GEMMs, their f32_to_bf16 and the dueling log-softmax: ``tests/test_kernels_heads_out.py``)."""
    from foxhunt.fast.cpu_executor import CpuEngine
    from foxhunt.fast.records import Gemm

    config = DQNConfig.preset("seed", precision="bf16")
    counts = []
    for option in (False, fuse):
        graph1 = CpuEngine(config, fused_heads=option).plans["graph1"]
        counts.append((launch_count(graph1, "heads_forward_bf16"),
                       sum(1 for node in graph1.nodes() if isinstance(node, Gemm))))
    assert counts[1][0] == fused
    assert counts[0][1] - counts[1][1] == gemms_less


def test_fused_heads_refuse_what_the_kernel_cannot_run():
    from foxhunt.fast.cpu_executor import CpuTrainer

    with pytest.raises(ValueError, match=r"^fused_heads=True: .* got precision 'f32', sm_90, "
                                         r"H2=32, hidden \(16, 16, 16\), outputs \(11, 33, 22\)$"):
        CpuTrainer(DQNConfig.preset("tiny", precision="f32"), fused_heads=True)
    with pytest.raises(ValueError, match=r"^fused_heads=1: must be a bool$"):
        CpuTrainer(DQNConfig.preset("tiny", precision="bf16"), fused_heads=1)


@pytest.mark.parametrize("options", [dict(fused_heads=True),
                                     dict(fused_heads=True, fused_trunk=True)],
                         ids=["heads", "heads+trunk"])
def test_on_the_cpu_executor_the_fused_heads_step_bitwise_as_the_nodes(options):
    """The fused launch's twin is the composition of the nodes' reference functions, so the CPU
    executor's steps with and without it end in the same bits (every state buffer, the step
    scalars, the TD errors and the greedy Q's), the second-wave sources on."""
    config = DQNConfig.preset("tiny", precision="bf16", lambda_iqn=1.0,
                              aux_next_bar_weight=0.1, aux_regime_weight=0.1)
    assert_steps_bitwise_equal(config, options)


# --------------------------------------------------------------------------------- GPU
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_fused_kernel_conforms_to_the_twin(case):
    kw = _kwargs(case, seed=7)
    assert not _failures(kw, fast_trunk.heads_forward_bf16(**kw), heads_forward_bf16(**kw))


@gpu
@pytest.mark.gpu
def test_a_nan_h2_row_stays_in_its_row_and_the_kernel_is_deterministic():
    kw = _kwargs("seed", seed=9)
    h2b = kw["h2b"].copy()
    h2b[37, 5] = 0x7FC0  # a BF16 NaN
    first = fast_trunk.heads_forward_bf16(**{**kw, "h2b": h2b})
    second = fast_trunk.heads_forward_bf16(**{**kw, "h2b": h2b})
    assert all(a.tobytes() == b.tobytes() for a, b in zip(first, second))
    others = np.arange(h2b.shape[0]) != 37
    assert np.isfinite(first.hid[others]).all() and np.isfinite(first.out[others]).all()
    assert np.isnan(first.out[37]).all()
    clean = fast_trunk.heads_forward_bf16(**kw)
    assert first.out[others].tobytes() == clean.out[others].tobytes()

