"""The heads' outputs with the dueling log-softmax in one launch (``heads_out_dueling_bf16`` and
its f32 twin ``heads_out_dueling_f32``, each test for both where it applies): the reference twin
against torch in float64, the launch plan and its refusals, the constants the plan shares with
``cuda_src``, the conformance entry on another summation order and on a missed bias, and the
step: one launch a BF16 / f32 training pass in place of (``f32_to_bf16``,) the heads'
second-layer GEMMs and ``dueling_log_softmax_q_branches``, the CPU executor's steps bit for bit
as those nodes'. GPU (skipped without a device, with the reason): the kernel against the twin,
its dueling outputs bit for bit those of the fast ``dueling_log_softmax_q_branches`` on its own
``v`` / ``adv``, a NaN row, determinism.

NVRTC compiles ``cuda_src/trunk.cu`` in ``tests/test_fast_build.py`` (every source file).
"""

from __future__ import annotations

import re
from importlib import resources

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import foxhunt.fast.step_program as step_program
from foxhunt.conformance.registry import SPECS
from foxhunt.conformance.specs.trunk import hod_dims, hod_sample
from foxhunt.conformance.tolerance import compare, gamma
from foxhunt.fast.device import cuda_available
from foxhunt.fast.kernels import trunk as fast_trunk
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import fused
from foxhunt.reference.kernels.dense import bf16_to_f32, f32_to_bf16
from foxhunt.reference.kernels import trunk as ref_trunk
from foxhunt.reference.kernels.trunk import HeadsOutDueling, HeadsOutDuelingF32
from cpu_step_runs import assert_runs_bitwise_equal, launch_count, step_run

F32 = np.float32
_GPU, _WHY = cuda_available()
gpu = pytest.mark.skipif(not _GPU, reason=f"no CUDA device/driver: {_WHY}")
CASES = ("tiny", "seed", "odd", "extremal")
PRECISIONS = tuple(fast_trunk.HOD_KERNELS)


def _name(precision: str) -> str:
    return fast_trunk.HOD_KERNELS[precision]


def _twin(precision: str):
    return getattr(ref_trunk, _name(precision))


def _fast(precision: str):
    return getattr(fast_trunk, _name(precision))


def _kwargs(case: str, seed: int = 0, precision: str = "bf16") -> dict:
    return hod_sample(np.random.default_rng(seed), *hod_dims(case), with_q=case != "odd",
                      precision=precision)


def _w2_f32(kw) -> np.ndarray:
    """W2's values as float32 (the BF16 kernel's are bits)."""
    return bf16_to_f32(kw["w2"]) if kw["w2"].dtype == np.uint16 else kw["w2"]


def _failures(kwargs, actual, expected, precision: str = "bf16") -> list[str]:
    """The entry's comparison of every output (``expected`` plays the reference)."""
    spec = SPECS[_name(precision)]
    got, want = spec.split_outputs(actual), spec.split_outputs(expected)
    inputs = spec.compare_inputs(kwargs, want)
    results = [compare(f"heads_out.{out}", got[out], want[out], spec.tolerance_of(out), inputs[out])
               for out in want]
    return [r.message for r in results if not r.passed]


def _pack(out: np.ndarray, na: int, branches) -> tuple[np.ndarray, np.ndarray]:
    """``(v, adv)`` of side-by-side head outputs (adv branch-packed)."""
    adv, o0 = [], na
    for n in branches:
        adv.append(out[:, o0:o0 + n * na].reshape(-1, na))
        o0 += n * na
    return np.ascontiguousarray(out[:, :na]), np.concatenate(adv).astype(F32)


# ------------------------------------------------------------------- the twin against torch
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", ["tiny", "odd", "extremal"])
def test_twin_is_the_heads_outputs_and_dueling_log_softmax_in_float64(case, precision):
    kw = _kwargs(case, precision=precision)
    r = _twin(precision)(**kw)
    if precision == "bf16":
        assert np.array_equal(r.hid_bf16, f32_to_bf16(kw["hid"]))
        multiplied = bf16_to_f32(r.hid_bf16)
    else:
        multiplied = kw["hid"]
    t = lambda a: torch.from_numpy(np.asarray(a, np.float64))  # noqa: E731
    hb, w2, b2 = t(multiplied), t(_w2_f32(kw)), t(kw["b2"])
    hidden, outs = kw["hidden"].tolist(), kw["out"].tolist()
    cols = []
    h0 = o0 = 0
    for width, o in zip(hidden, outs):
        a, w = hb[:, h0:h0 + width], w2[o0:o0 + o, :width]
        pre = a @ w.T + b2[o0:o0 + o]
        bound = (2 * gamma(width + 1) * (a.abs() @ w.abs().T + b2[o0:o0 + o].abs())).numpy()
        assert np.all(np.abs(r.out[:, o0:o0 + o] - pre.numpy()) <= bound)
        cols.append(pre)
        h0, o0 = h0 + width, o0 + o
    # The dueling log-softmax of the twin's own outputs, in float64 with torch.
    na, branches = outs[0], kw["n_actions"].tolist()
    v = t(r.out[:, :na])
    logits, o0 = [], na
    for n in branches:
        adv = t(r.out[:, o0:o0 + n * na]).reshape(-1, n, na)
        x = (v[:, None, :] + (adv - adv.mean(dim=1, keepdim=True))).reshape(-1, na)
        logits.append(x)
        o0 += n * na
    x = torch.cat(logits)
    logp = torch.log_softmax(x, dim=1)
    assert np.allclose(r.logits, x.numpy(), rtol=1e-5, atol=1e-5)
    assert np.allclose(r.logp, logp.numpy(), rtol=1e-5, atol=1e-5)
    if kw["with_q"]:
        assert np.allclose(r.q, (logp.exp() @ t(kw["z"])).numpy(), rtol=1e-4, atol=1e-4)
    else:
        assert r.q.shape == (0,)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_twin_reads_no_w2_column_past_its_heads_hidden_width(precision):
    kw = _kwargs("odd", precision=precision)
    w2 = kw["w2"].copy()
    nan = np.uint16(0x7FC0) if precision == "bf16" else F32(np.nan)  # a BF16 / f32 NaN
    o0 = 0
    for width, o in zip(kw["hidden"].tolist(), kw["out"].tolist()):
        w2[o0:o0 + o, width:] = nan
        o0 += o
    poked, base = _twin(precision)(**dict(kw, w2=w2)), _twin(precision)(**kw)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(poked, base))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_twin_is_the_composition_of_the_nodes(precision):
    """(hid_bf16 the f32_to_bf16 of hid;) logits / logp / q exactly dueling_log_softmax_q_branches
    of the twin's own head outputs."""
    kw = _kwargs("seed", precision=precision)
    r = _twin(precision)(**kw)
    v, adv = _pack(r.out, int(kw["out"][0]), kw["n_actions"].tolist())
    d = fused.dueling_log_softmax_q_branches(v, adv, kw["z"], tuple(kw["n_actions"].tolist()), True)
    assert all(a.tobytes() == b.tobytes() for a, b in zip((r.logits, r.logp, r.q), d))


@settings(max_examples=30, deadline=None)
@given(data=st.data(), precision=st.sampled_from(PRECISIONS),
       value=st.sampled_from([np.nan, np.inf, -np.inf]))
def test_twin_keeps_a_non_finite_hidden_value_in_its_row_and_head(data, precision, value):
    """NaN contract: a NaN or Inf at ``hid[i, k]`` makes row i's outputs of k's head non-finite
    (every W2 entry is non-zero) and leaves every other row's outputs and every other sample's
    logits / logp / q bit for bit those of the clean input."""
    kw = _kwargs("tiny", seed=data.draw(st.integers(0, 3)), precision=precision)
    rows, width = kw["hid"].shape
    i, k = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, width - 1))
    hid = kw["hid"].copy()
    hid[i, k] = value
    clean, poked = _twin(precision)(**kw), _twin(precision)(**dict(kw, hid=hid))
    hidden, outs = kw["hidden"].tolist(), kw["out"].tolist()
    head = int(np.searchsorted(np.cumsum(hidden), k, side="right"))
    o0 = sum(outs[:head])
    assert not np.isfinite(poked.out[i, o0:o0 + outs[head]]).any()
    others = np.arange(rows) != i
    assert poked.out[others].tobytes() == clean.out[others].tobytes()
    sample = np.concatenate([np.repeat(~others, n) for n in kw["n_actions"].tolist()])
    for name in ("logits", "logp", "q"):
        a, b = getattr(poked, name), getattr(clean, name)
        assert a[~sample].tobytes() == b[~sample].tobytes(), name


# ------------------------------------------------------------------------------ the plan
def test_plan_of_the_seed_shapes():
    rows, hidden, branches, na = hod_dims("seed")
    out = (na,) + tuple(n * na for n in branches)
    grid, block, nbytes = fast_trunk.plan_heads_out_dueling_bf16(rows, hidden, out, branches, na)
    assert grid == (rows // 16, len(branches)) and block == (512,)
    # Two BF16 hidden tiles 16 x 136, then the value head's and a branch's f32 outputs (16 x 51
    # and 16 x 153, the widest branch).
    assert nbytes == 2 * 16 * (136 + 136) + 4 * 16 * (51 + 153)
    # The f32 kernel: two f32 hidden tiles 16 x 132, the two heads' W2 tiles 51 x 132 and 153 x
    # 132, the same output tiles (137,664 bytes: opted in on sm_90, too much for sm_89).
    f32_bytes = 4 * 16 * (132 + 132) + 4 * (51 + 153) * 132 + 4 * 16 * (51 + 153)
    assert f32_bytes == 137664
    assert fast_trunk.plan_heads_out_dueling_f32(rows, hidden, out, branches, na,
                                                 arch="sm_90") == (grid, (1024,), f32_bytes)
    with pytest.raises(ValueError, match=r"needs 137664 bytes of shared memory per block; it runs "
                                         r"with at most 101376$"):
        fast_trunk.plan_heads_out_dueling_f32(rows, hidden, out, branches, na, arch="sm_89")


def _cu_define(name: str) -> int:
    text = (resources.files("foxhunt.cuda_src") / "trunk.cu").read_text()
    return int(re.search(rf"^#define {name} (\d+)$", text, re.M).group(1))


def _cuh_constexpr(name: str) -> int:
    text = (resources.files("foxhunt.cuda_src") / "dueling.cuh").read_text()
    return int(re.search(rf"constexpr int {name} = (\d+);", text).group(1))


def test_plan_constants_are_the_sources():
    assert fast_trunk.HOD_WARPS == _cu_define("HOD_WARPS")
    assert fast_trunk.HOD_TILES == _cu_define("HOD_TILES")
    assert fast_trunk.HODF_PAD == _cu_define("HODF_PAD")
    assert fast_trunk.HODF_WARPS == _cu_define("HODF_WARPS")
    assert fast_trunk.HODF_TILES == _cu_define("HODF_TILES")
    assert fast_trunk.HODF_THREADS == 32 * fast_trunk.HODF_WARPS
    assert fast_trunk.HOD_THREADS == 32 * fast_trunk.HOD_WARPS
    assert fast_trunk.HOD_MAX_ACTIONS == _cuh_constexpr("kDuelingRegRows")
    assert fast_trunk.HOD_MAX_ATOMS == 32 * _cuh_constexpr("kDuelingRegChunks")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("args, match", [
    (((16, 24), (3, 6), (2,), 3), r"^hidden\[1\]=24: .*multiple of 16$"),
    (((16,), (3,), (), 3), r"^n_actions=\(\): {kernel} needs at least one branch$"),
    (((16, 16, 16), (3, 6, 6), (2,), 3), r"^hidden=\(16, 16, 16\): {kernel} needs "
                                         r"the value head and one head a branch: 2 heads for "
                                         r"n_actions=\(2,\)$"),
    (((16, 16), (3, 15), (5,), 3), r"^n_actions\[0\]=5: {kernel} .*\(1 to 4 actions\)$"),
    (((16, 16), (65, 130), (2,), 65), r"^num_atoms=65: {kernel} .*\(1 to 64 atoms\)$"),
    (((16, 16), (3, 7), (2,), 3), r"^out=\(3, 7\): {kernel} needs \(NA, n_0 NA, "
                                  r"\.\.\.\) = \(3, 6\)$"),
    (((16, 16), (64, 256), (4,), 64), r"^out=.*: {kernel} computes at most 32 n8 tiles a block; "
                                      r"the value head and a branch need 40$"),
    (((1024, 1024), (51, 153), (3,), 51), r"^hidden=\(1024, 1024\): {kernel} needs "
                                        r"\d+ bytes of shared memory per block; it runs with at "
                                        r"most {limit}$"),
])
def test_plan_refuses_shapes_the_kernel_cannot_run(args, match, precision):
    """Every refusal on sm_90 (the f32 kernel opts in to 227 KiB there; BF16 stays within 48)."""
    hidden, out, branches, na = args
    limit = {"bf16": 49152, "f32": 232448}[precision]
    with pytest.raises(ValueError, match=match.format(kernel=_name(precision), limit=limit)):
        getattr(fast_trunk, f"plan_{_name(precision)}")(64, hidden, out, branches, na,
                                                       arch="sm_90")
    assert not fast_trunk.hod_fusable(hidden, out, branches, na, precision, "sm_90")


def test_the_f32_kernel_is_fusable_where_its_architecture_opts_in_to_enough_shared_memory():
    """The f32 kernel keeps both heads' W2 in shared memory: the seed shapes need 137,664 bytes,
    which sm_80 (163 KiB) and sm_90 (227 KiB) give and sm_86 / sm_89 (99 KiB) do not, nor "any
    architecture" (``arch=None``, the smallest); the BF16 kernel needs 34,048 bytes everywhere.
    Hidden widths (320, 320) need 318,912 f32 bytes: no architecture."""
    seed = ((128, 128, 128, 128), (51, 153, 153, 102), (3, 3, 2), 51)
    assert fast_trunk.hod_shared_bytes(*seed[:2], "f32") == 137664
    assert fast_trunk.hod_shared_bytes(*seed[:2], "bf16") == 2 * 16 * 272 + 4 * 16 * 204
    fusable = {arch: fast_trunk.hod_fusable(*seed, "f32", arch)
               for arch in ("sm_80", "sm_86", "sm_89", "sm_90", None)}
    assert fusable == {"sm_80": True, "sm_86": False, "sm_89": False, "sm_90": True, None: False}
    assert all(fast_trunk.hod_fusable(*seed, "bf16", arch) for arch in fusable)
    wide = ((320, 320), (51, 153), (3,), 51)
    assert fast_trunk.hod_shared_bytes(*wide[:2], "bf16") == 34048
    assert fast_trunk.hod_shared_bytes(*wide[:2], "f32") == 318912
    assert fast_trunk.hod_fusable(*wide, "bf16") and not fast_trunk.hod_fusable(*wide, "f32",
                                                                              "sm_90")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_entry_accepts_another_summation_order_and_catches_a_missed_bias(precision):
    """The conformance entry against the twin: float64 GEMMs rounded once (another legitimate
    order) and the dueling log-softmax of those pass; dropping one output column's bias fails
    (``out``, and the logits carried through it)."""
    kw = _kwargs("seed", seed=3, precision=precision)
    ref = _twin(precision)(**kw)
    hidden, outs = kw["hidden"].tolist(), kw["out"].tolist()
    hb = (bf16_to_f32(ref.hid_bf16) if precision == "bf16" else kw["hid"]).astype(np.float64)
    w2 = _w2_f32(kw)
    cols, h0, o0 = [], 0, 0
    for width, o in zip(hidden, outs):
        w = w2[o0:o0 + o, :width].astype(np.float64)
        cols.append((hb[:, h0:h0 + width] @ w.T + kw["b2"][o0:o0 + o]).astype(F32))
        h0, o0 = h0 + width, o0 + o
    out = np.concatenate(cols, axis=1)

    def result(out):
        v, adv = _pack(out, outs[0], kw["n_actions"].tolist())
        d = fused.dueling_log_softmax_q_branches(v, adv, kw["z"], tuple(kw["n_actions"].tolist()),
                                                 True)
        return (HeadsOutDueling(ref.hid_bf16, out, *d) if precision == "bf16"
                else HeadsOutDuelingF32(out, *d))

    assert not _failures(kw, result(out), ref, precision)
    missed = out.copy()
    missed[:, 60] -= kw["b2"][60]
    failed = _failures(kw, result(missed), ref, precision)
    assert any("heads_out.out" in m for m in failed) and any("heads_out.logits" in m for m in failed)


# ------------------------------------------------------------------------ in the step plan
@pytest.mark.parametrize("precision, kernel, enabled", [
    ("bf16", "heads_out_dueling_bf16", step_program.FUSE_HEAD_OUTPUTS), ("f32", None, None),
    ("f32", "heads_out_dueling_f32", frozenset({"bf16", "f32"})),
    ("tf32", None, frozenset({"bf16", "f32", "tf32"}))], ids=["bf16", "f32", "f32-on", "tf32"])
def test_a_training_pass_ends_its_heads_in_one_launch(precision, kernel, enabled, monkeypatch):
    """Graph 1 of the seed step (the CPU executor's plans): in BF16 the online and target passes
    each run ONE heads_out_dueling_bf16 in place of f32_to_bf16, four second-layer GEMMs and
    dueling_log_softmax_q_branches; f32 keeps the nodes by default and runs ONE
    heads_out_dueling_f32 in their place where ``FUSE_HEAD_OUTPUTS`` names it; tf32 keeps the
    nodes even then (no kernel of its own)."""
    from foxhunt.fast.cpu_executor import CpuEngine

    if enabled is not None:
        monkeypatch.setattr(step_program, "FUSE_HEAD_OUTPUTS", enabled)
    graph1 = CpuEngine(DQNConfig.preset("seed", precision=precision)).plans["graph1"]
    fused_launches = 0 if kernel is None else 2
    for name in fast_trunk.HOD_KERNELS.values():
        assert launch_count(graph1, name) == (fused_launches if name == kernel else 0)
    assert launch_count(graph1, "dueling_log_softmax_q_branches") == 2 - fused_launches


@pytest.mark.parametrize("precision, options", [
    ("bf16", {}), ("bf16", dict(fused_trunk=True)), ("bf16", dict(fused_heads=True)), ("f32", {})],
    ids=["plain", "fused-trunk", "fused-heads", "f32"])
def test_on_the_cpu_executor_the_step_is_bitwise_the_nodes(precision, options, monkeypatch):
    """The launch's twin is the composition of the nodes' reference functions, so the CPU
    executor's steps with and without it end in the same bits (every state buffer, the step
    scalars, the TD errors and the greedy Q's), the second-wave sources on. With
    ``fused_heads`` the heads' fused forward runs instead (the launch is not used). f32: the
    launch switched on (``FUSE_HEAD_OUTPUTS``; off by default)."""
    config = DQNConfig.preset("tiny", precision=precision, lambda_iqn=1.0,
                              aux_next_bar_weight=0.1, aux_regime_weight=0.1)
    monkeypatch.setattr(step_program, "FUSE_HEAD_OUTPUTS", frozenset({precision}))
    with_launch = step_run(config, options)
    monkeypatch.setattr(step_program, "FUSE_HEAD_OUTPUTS", frozenset())
    assert_runs_bitwise_equal(config, step_run(config, options), with_launch)


# --------------------------------------------------------------------------------- GPU
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", CASES)
def test_fused_kernel_conforms_to_the_twin(case, precision):
    kw = _kwargs(case, seed=7, precision=precision)
    assert not _failures(kw, _fast(precision)(**kw), _twin(precision)(**kw), precision)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", ["seed", "odd"])
def test_its_dueling_outputs_are_the_fast_dueling_kernels_on_its_own_outputs(case, precision):
    """Bit for bit (NaN payloads aside): the kernel runs dueling_log_softmax_q_branches' register
    path on the v / adv it computed."""
    from foxhunt.fast.kernels import fused as fast_fused

    kw = _kwargs(case, seed=11, precision=precision)
    got = _fast(precision)(**kw)
    v, adv = _pack(got.out, int(kw["out"][0]), kw["n_actions"].tolist())
    d = fast_fused.dueling_log_softmax_q_branches(v, adv, kw["z"], tuple(kw["n_actions"].tolist()),
                                                  bool(kw["with_q"]))
    bits = lambda x: np.where(np.isnan(x), np.float32(np.nan), x).view(np.uint32)  # noqa: E731
    for mine, theirs in zip((got.logits, got.logp, got.q), d):
        assert bits(mine).tobytes() == bits(theirs).tobytes()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_nan_hidden_row_stays_in_its_sample_and_the_kernel_is_deterministic(precision):
    kw = _kwargs("seed", seed=9, precision=precision)
    hid = kw["hid"].copy()
    hid[37, 5] = np.nan  # the value head's hidden values of sample 37
    first = _fast(precision)(**{**kw, "hid": hid})
    second = _fast(precision)(**{**kw, "hid": hid})
    assert all(a.tobytes() == b.tobytes() for a, b in zip(first, second))
    rows = hid.shape[0]
    others = np.arange(rows) != 37
    assert np.isnan(first.out[37, :int(kw["out"][0])]).all()
    assert np.isfinite(first.out[others]).all()
    sample = np.concatenate([np.repeat(np.arange(rows) == 37, n) for n in kw["n_actions"]])
    assert np.isnan(first.logp[sample]).all() and np.isfinite(first.logp[~sample]).all()
    clean = _fast(precision)(**kw)
    assert first.logp[~sample].tobytes() == clean.logp[~sample].tobytes()
