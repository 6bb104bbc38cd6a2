"""Tests for foxhunt.reference.kernels.fused's c51_loss_branches (the per-branch c51_loss of
every action branch in one launch) and its CUDA kernel's build.

Oracles: the composition of per-branch ``c51_loss`` calls on the branch-packed layout, rebuilt
here from plain slicing (bitwise), and a float64 evaluation of the loss formula (values).
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foxhunt.reference.kernels import distributional as dist
from foxhunt.reference.kernels import fused

F32 = np.float32
SPECIALS = (np.nan, np.inf, -np.inf, -0.0)


def log_softmax(rng, shape) -> np.ndarray:
    x = rng.standard_normal(shape) * 2.0
    m = x.max(axis=-1, keepdims=True)
    return (x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))).astype(F32)


def make_case(branches, batch, atoms, rows=None, seed=0):
    """Branch-packed logp with ``rows`` samples per block (default 2B, the step's online pass),
    actions [D, B], targets m [D, B, NA] (rows sum to ~1), isw [B], scale 1 / (B * D)."""
    rng = np.random.default_rng(seed)
    rows = 2 * batch if rows is None else rows
    logp = log_softmax(rng, (rows * sum(branches), atoms))
    actions = np.stack([rng.integers(0, n, batch) for n in branches]).astype(np.int32)
    m = rng.dirichlet(np.full(atoms, 0.5), (len(branches), batch)).astype(F32)
    isw = rng.uniform(0.1, 1.0, batch).astype(F32)
    return logp, actions, m, isw, F32(1.0 / (batch * len(branches)))


def block(logp, branches, d, batch):
    """Branch d's first ``batch`` samples ``[B, n_d, NA]``, sliced by hand from the layout."""
    rows = logp.shape[0] // sum(branches)
    off = sum(branches[:d])
    return logp[rows * off:rows * (off + branches[d])].reshape(rows, branches[d], -1)[:batch].copy()


def composition(logp, actions, m, isw, scale, branches):
    """Per-branch c51_loss calls: ce [D, B], total [D]."""
    batch = actions.shape[1]
    out = [dist.c51_loss(block(logp, branches, d, batch), actions[d].copy(), m[d].copy(), isw,
                         scale) for d in range(len(branches))]
    return np.stack([r.ce for r in out]), np.array([r.total for r in out], dtype=F32)


def bits_equal(a, b) -> bool:
    """Bit for bit (NaN payloads aside: every NaN counts as equal; signs of zero must agree)."""
    a, b = np.asarray(a, F32), np.asarray(b, F32)
    if a.shape != b.shape:
        return False
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b))
                and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))


CASES = {
    "seed": ((3, 3, 2), 256, 51, None),
    "tiny": ((3, 2), 4, 11, None),
    "odd": ((3, 3, 2), 257, 51, None),
    "R=B": ((2, 1, 4), 5, 7, 5),
    "one-branch": ((1,), 9, 3, 12),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_c51_loss_branches_is_the_per_branch_composition(case):
    branches, batch, atoms, rows = CASES[case]
    args = make_case(branches, batch, atoms, rows)
    got = fused.c51_loss_branches(*args, branches)
    assert isinstance(got, fused.C51LossBranches)
    assert got.ce.dtype == F32 and got.total.dtype == F32
    assert got.ce.shape == (len(branches), batch) and got.total.shape == (len(branches),)
    ce, total = composition(*args, branches)
    assert bits_equal(got.ce, ce) and bits_equal(got.total, total)


@pytest.mark.parametrize("case", ["seed", "odd", "R=B"])
def test_c51_loss_branches_values_vs_float64_formula(case):
    branches, batch, atoms, rows = CASES[case]
    logp, actions, m, isw, scale = make_case(branches, batch, atoms, rows, seed=3)
    got = fused.c51_loss_branches(logp, actions, m, isw, scale, branches)
    for d, n in enumerate(branches):
        taken = block(logp, branches, d, batch).astype(np.float64)[np.arange(batch), actions[d]]
        ce64 = -(m[d].astype(np.float64) * taken).sum(axis=-1)
        total64 = float(scale) * float((isw.astype(np.float64) * ce64).sum())
        np.testing.assert_allclose(got.ce[d], ce64, rtol=1e-5, atol=1e-6 * atoms)
        np.testing.assert_allclose(got.total[d], total64, rtol=1e-5, atol=1e-7)
    # sanity: the branches' losses differ (each reads its own block, targets and actions)
    assert len(set(got.total.tolist())) == len(branches)


def test_c51_loss_branches_reads_only_the_first_b_samples_and_taken_rows():
    branches, batch, atoms = (3, 3, 2), 6, 5
    logp, actions, m, isw, scale = make_case(branches, batch, atoms)
    clean = fused.c51_loss_branches(logp, actions, m, isw, scale, branches)
    poisoned = logp.copy()
    rows = 2 * batch
    for d, (off, n) in enumerate(zip(fused.branch_offsets(branches), branches)):
        blk = poisoned[rows * off:rows * (off + n)].reshape(rows, n, atoms)
        blk[batch:] = np.nan  # samples past B
        for b in range(batch):
            for a in range(n):
                if a != actions[d, b]:
                    blk[b, a] = np.inf  # actions not taken
    got = fused.c51_loss_branches(poisoned, actions, m, isw, scale, branches)
    assert bits_equal(got.ce, clean.ce) and bits_equal(got.total, clean.total)
    assert np.all(np.isfinite(got.ce)) and np.all(np.isfinite(got.total))


@settings(max_examples=40)
@given(data=st.data(), branches=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       batch=st.integers(1, 6), atoms=st.integers(1, 6), extra=st.integers(0, 3))
def test_c51_loss_branches_specials_match_composition(data, branches, batch, atoms, extra):
    branches = tuple(branches)
    logp, actions, m, isw, scale = make_case(branches, batch, atoms, batch + extra,
                                             seed=data.draw(st.integers(0, 2**16)))
    for arr in (logp, m, isw):
        for _ in range(data.draw(st.integers(0, 3))):
            arr.flat[data.draw(st.integers(0, arr.size - 1))] = data.draw(st.sampled_from(SPECIALS))
    if data.draw(st.booleans()):
        scale = F32(data.draw(st.sampled_from(SPECIALS)))
    got = fused.c51_loss_branches(logp, actions, m, isw, scale, branches)
    ce, total = composition(logp, actions, m, isw, scale, branches)
    assert bits_equal(got.ce, ce) and bits_equal(got.total, total)
    # The contract, checked directly: ce[d, b] is NaN iff the float64 formula is NaN there, and
    # a NaN ce, isw or scale makes the branch total NaN.
    for d in range(len(branches)):
        taken = block(logp, branches, d, batch).astype(np.float64)[np.arange(batch), actions[d]]
        with np.errstate(all="ignore"):
            ce64 = -(m[d].astype(np.float64) * taken).sum(axis=-1)
        assert np.array_equal(np.isnan(got.ce[d]), np.isnan(ce64))
        if np.isnan(got.ce[d]).any() or np.isnan(isw).any() or np.isnan(scale):
            assert np.isnan(got.total[d])


def _bad(name, edit):
    return pytest.param(name, edit, id=name + ":" + edit.__name__)


def wrong_branches(k):
    k["branches"] = (3, 0)


def branches_not_matching_logp(k):
    k["branches"] = (3, 3, 3)


def logp_1d(k):
    k["logp"] = k["logp"].ravel()


def logp_f64(k):
    k["logp"] = k["logp"].astype(np.float64)


def actions_int64(k):
    k["actions"] = k["actions"].astype(np.int64)


def actions_too_many_rows(k):
    k["actions"] = np.concatenate([k["actions"], k["actions"][:1]])


def actions_more_than_r(k):
    k["actions"] = np.zeros((3, 2 * 4 + 1), np.int32)


def action_out_of_its_branch(k):
    k["actions"] = k["actions"].copy()
    k["actions"][2, 1] = 2  # branch 2 has n = 2 actions (valid in branches 0 and 1)


def action_negative(k):
    k["actions"] = k["actions"].copy()
    k["actions"][0, 0] = -1


def m_2d(k):
    k["m"] = k["m"][0]


def m_short_atoms(k):
    k["m"] = k["m"][:, :, :-1].copy()


def isw_short(k):
    k["isw"] = k["isw"][:-1]


def scale_array(k):
    k["scale"] = np.ones(2, F32)


@pytest.mark.parametrize("name,edit", [
    _bad("branches", wrong_branches), _bad("logp", branches_not_matching_logp),
    _bad("logp", logp_1d), _bad("logp", logp_f64), _bad("actions", actions_int64),
    _bad("actions", actions_too_many_rows), _bad("actions", actions_more_than_r),
    _bad("actions", action_out_of_its_branch), _bad("actions", action_negative),
    _bad("m", m_2d), _bad("m", m_short_atoms), _bad("isw", isw_short), _bad("scale", scale_array),
])
def test_c51_loss_branches_bad_input_names_the_argument(name, edit):
    branches = (3, 3, 2)
    logp, actions, m, isw, scale = make_case(branches, 4, 5)
    kwargs = dict(logp=logp, actions=actions, m=m, isw=isw, scale=scale, branches=branches)
    edit(kwargs)
    with pytest.raises(ValueError, match=rf"^{name}:"):
        fused.c51_loss_branches(**kwargs)


def test_c51_loss_branches_is_listed_and_fast_twin_matches_signature():
    import inspect

    from foxhunt.fast.kernels import distributional as fast_dist
    from foxhunt.fast.kernels import fused as fast_fused

    assert fused.KERNELS["c51_loss_branches"] is fused.c51_loss_branches
    assert (inspect.signature(fast_fused.c51_loss_branches)
            == inspect.signature(fused.c51_loss_branches))
    grid, threads, shared = fast_fused.plan_c51_loss_branches(256, (3, 3, 2), 51)
    assert grid == (1, 3, 1) and shared == 0
    assert threads == fast_dist.plan_c51_loss(256, 3, 51)[1]  # same reduction order per branch


# ---------------------------------------------------------------------------------------------
# The CUDA kernel compiles (NVRTC, no GPU needed) with its parameter list and c51_loss's body
# ---------------------------------------------------------------------------------------------


def _entry(ptx: str, name: str) -> str:
    start = ptx.index(f".entry {name}(")
    return ptx[start:ptx.index("\n}\n", start)]


def _float_ops(body: str) -> Counter:
    ops = (line.split()[0] for line in body.splitlines() if re.match(r"\s+[a-z]", line))
    return Counter(op for op in ops if ".f32" in op or op.startswith("shfl"))


def _compile_fused_ptx(arch: str, tmp_path):
    """fused.cu and distributional.cu (with the headers) compiled to PTX for ``arch`` by NVRTC;
    skips where cuda-bindings is missing."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (the test extra) is not installed")
    from foxhunt.fast._build import HEADER_SUFFIXES, compile_sources, source_files

    sources = source_files()
    headers = {n: b for n, b in sources.items() if n.endswith(HEADER_SUFFIXES)}
    return compile_sources(arch, "ptx", cache_root=tmp_path,
                           sources={"fused.cu": sources["fused.cu"],
                                    "distributional.cu": sources["distributional.cu"], **headers})


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_c51_loss_branches_compiles_with_c51_loss_body(arch, tmp_path):
    module = _compile_fused_ptx(arch, tmp_path)
    assert module.logs["fused.cu"] == ""
    assert module.kernels["c51_loss_branches"] == "fused.cu"
    # logp, actions, m, isw, scale, n_actions, action_offset, ce, total; batch, block_rows, NA
    assert tuple(p.ptx_type for p in module.params["c51_loss_branches"]) == ("u64",) * 9 + ("u32",) * 3
    assert "atom." not in module.ptx["fused.cu"]
    # The same float arithmetic and shuffles as c51_loss (one shared body, same rounding order).
    fused_ops = _float_ops(_entry(module.ptx["fused.cu"], "c51_loss_branches"))
    loss_ops = _float_ops(_entry(module.ptx["distributional.cu"], "c51_loss"))
    assert fused_ops == loss_ops and fused_ops["add.rn.f32"] > 0


# ---------------------------------------------------------------------------------------------
# dueling_log_softmax_q_branches: dueling_combine_branches then log_softmax_expected_q
# ---------------------------------------------------------------------------------------------


def make_dueling_case(branches, batch, atoms, seed=0):
    """``v [B, NA]``, branch-packed ``adv [B * A_total, NA]`` (logits of scale ~3), ``z``."""
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal((batch, atoms)) * 2.0).astype(F32)
    adv = (rng.standard_normal((batch * sum(branches), atoms)) * 2.0).astype(F32)
    z = np.linspace(-10.0, 10.0, atoms).astype(F32)
    return v, adv, z


def dueling_composition(v, adv, z, branches, with_q):
    """Per-branch dueling_combine on hand-sliced blocks, packed by hand, then log_softmax_atoms
    over every row and expected_q over every row (with_q) or none: logits, logp, q."""
    batch, atoms = v.shape
    logits = np.empty_like(adv)
    for d, n in enumerate(branches):
        lo = batch * sum(branches[:d])
        blk = adv[lo:lo + batch * n].reshape(batch, n, atoms).copy()
        logits[lo:lo + batch * n] = dist.dueling_combine(v, blk).reshape(batch * n, atoms)
    logp = dist.log_softmax_atoms(logits)
    rows = logits.shape[0] if with_q else 0
    q = dist.expected_q(logp[:rows].reshape(rows, 1, atoms).copy(), z).reshape(rows)
    return logits, logp, q


@pytest.mark.parametrize("with_q", [True, False], ids=["with_q", "no_q"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_dueling_log_softmax_q_branches_is_the_composition(case, with_q):
    branches, batch, atoms, _ = CASES[case]
    v, adv, z = make_dueling_case(branches, batch, atoms)
    got = fused.dueling_log_softmax_q_branches(v, adv, z, branches, with_q)
    assert isinstance(got, fused.DuelingLogSoftmaxQ)
    rows = batch * sum(branches)
    assert got.logits.shape == got.logp.shape == (rows, atoms)
    assert got.q.shape == ((rows,) if with_q else (0,))
    assert all(x.dtype == F32 for x in got)
    logits, logp, q = dueling_composition(v, adv, z, branches, with_q)
    assert bits_equal(got.logits, logits) and bits_equal(got.logp, logp) and bits_equal(got.q, q)
    # and it is literally the two fused reference kernels in a row
    lq = dist.log_softmax_expected_q(fused.dueling_combine_branches(v, adv, branches), z,
                                     rows if with_q else 0)
    assert bits_equal(got.logp, lq.logp) and bits_equal(got.q, lq.q)


@pytest.mark.parametrize("case", ["seed", "odd", "R=B"])
def test_dueling_log_softmax_q_branches_values_vs_float64_formula(case):
    branches, batch, atoms, _ = CASES[case]
    v, adv, z = make_dueling_case(branches, batch, atoms, seed=5)
    got = fused.dueling_log_softmax_q_branches(v, adv, z, branches, True)
    v64, z64 = v.astype(np.float64), z.astype(np.float64)
    for d, n in enumerate(branches):
        lo = batch * sum(branches[:d])
        a64 = adv[lo:lo + batch * n].astype(np.float64).reshape(batch, n, atoms)
        logits64 = v64[:, None, :] + a64 - a64.mean(axis=1, keepdims=True)
        m = logits64.max(axis=-1, keepdims=True)
        logp64 = logits64 - m - np.log(np.exp(logits64 - m).sum(axis=-1, keepdims=True))
        q64 = (np.exp(logp64) * z64).sum(axis=-1)
        sl = slice(lo, lo + batch * n)
        np.testing.assert_allclose(got.logits[sl], logits64.reshape(-1, atoms), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got.logp[sl], logp64.reshape(-1, atoms), rtol=1e-5, atol=2e-5)
        np.testing.assert_allclose(got.q[sl], q64.reshape(-1), rtol=1e-5, atol=1e-4)
    # rows are probability vectors and Q lies within the support
    np.testing.assert_allclose(np.exp(got.logp.astype(np.float64)).sum(axis=-1), 1.0, atol=1e-5)
    assert np.all(got.q >= z[0] - 1e-4) and np.all(got.q <= z[-1] + 1e-4)


@settings(max_examples=40)
@given(data=st.data(), branches=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       batch=st.integers(1, 5), atoms=st.integers(1, 6), with_q=st.booleans())
def test_dueling_log_softmax_q_branches_specials_match_composition(data, branches, batch, atoms,
                                                                     with_q):
    branches = tuple(branches)
    v, adv, z = make_dueling_case(branches, batch, atoms, seed=data.draw(st.integers(0, 2**16)))
    for arr in (v, adv, z):
        for _ in range(data.draw(st.integers(0, 3))):
            arr.flat[data.draw(st.integers(0, arr.size - 1))] = data.draw(st.sampled_from(SPECIALS))
    got = fused.dueling_log_softmax_q_branches(v, adv, z, branches, with_q)
    logits, logp, q = dueling_composition(v, adv, z, branches, with_q)
    assert bits_equal(got.logits, logits) and bits_equal(got.logp, logp) and bits_equal(got.q, q)
    # The contract, checked directly: a logp row is NaN iff its logits row holds NaN or +Inf or
    # is all -Inf (the float64 logits: v + (adv - mean), mean in float64), else finite where
    # the logit is; a NaN logp row or a NaN in z makes that row's q NaN.
    with np.errstate(all="ignore"):
        logits64 = np.empty(adv.shape)
        for d, n in enumerate(branches):
            lo = batch * sum(branches[:d])
            a64 = adv[lo:lo + batch * n].astype(np.float64).reshape(batch, n, atoms)
            mean = a64.sum(axis=1, keepdims=True) / n
            logits64[lo:lo + batch * n] = (v.astype(np.float64)[:, None, :]
                                           + (a64 - mean)).reshape(-1, atoms)
    nan_row = (np.isnan(logits64).any(axis=1) | np.isposinf(logits64).any(axis=1)
               | np.isneginf(logits64).all(axis=1))
    assert np.array_equal(np.isnan(got.logp).all(axis=1), nan_row)
    assert np.array_equal(np.isnan(got.logp).any(axis=1), nan_row)
    ok = ~nan_row
    assert np.array_equal(np.isneginf(got.logp[ok]), np.isneginf(logits64[ok]))
    if with_q:
        assert np.all(np.isnan(got.q[nan_row]))
        if np.isnan(z).any():
            assert np.all(np.isnan(got.q))


def v_1d(k):
    k["v"] = k["v"].ravel()


def v_f64(k):
    k["v"] = k["v"].astype(np.float64)


def adv_not_packed(k):
    k["adv"] = k["adv"][:-1]


def adv_atoms_differ(k):
    k["adv"] = k["adv"][:, :-1].copy()


def branches_not_matching_adv(k):
    k["branches"] = (3, 3, 3)


def z_short(k):
    k["z"] = k["z"][:-1]


def z_f64(k):
    k["z"] = k["z"].astype(np.float64)


def z_2d(k):
    k["z"] = k["z"][None, :]


def with_q_int(k):
    k["with_q"] = 1


def with_q_none(k):
    k["with_q"] = None


@pytest.mark.parametrize("name,edit", [
    _bad("v", v_1d), _bad("v", v_f64), _bad("adv", adv_not_packed),
    _bad("adv", adv_atoms_differ), _bad("adv", branches_not_matching_adv),
    _bad("branches", wrong_branches), _bad("z", z_short), _bad("z", z_f64), _bad("z", z_2d),
    _bad("with_q", with_q_int), _bad("with_q", with_q_none),
])
def test_dueling_log_softmax_q_branches_bad_input_names_the_argument(name, edit):
    branches = (3, 3, 2)
    v, adv, z = make_dueling_case(branches, 4, 5)
    kwargs = {"v": v, "adv": adv, "z": z, "branches": branches, "with_q": True}
    edit(kwargs)
    with pytest.raises(ValueError, match=rf"^{name}:"):
        fused.dueling_log_softmax_q_branches(**kwargs)


def test_dueling_log_softmax_q_branches_is_listed_and_plans_the_seed_passes():
    import inspect

    from foxhunt.fast.kernels import fused as fast_fused

    assert fused.KERNELS["dueling_log_softmax_q_branches"] is fused.dueling_log_softmax_q_branches
    assert (fast_fused.KERNELS["dueling_log_softmax_q_branches"]
            is fast_fused.dueling_log_softmax_q_branches)
    assert (inspect.signature(fast_fused.dueling_log_softmax_q_branches)
            == inspect.signature(fused.dueling_log_softmax_q_branches))
    plan = fast_fused.plan_dueling_log_softmax_q_branches
    # a warp per (sample, branch): the batch / 4 warps per block; per warp the cell means and a
    # group of 4 rows of NA floats
    assert plan(512, (3, 3, 2), 51) == ((128, 3, 1), 128, 4 * 5 * 51 * 4)  # online pass
    assert plan(256, (3, 3, 2), 51) == ((64, 3, 1), 128, 4 * 5 * 51 * 4)   # target pass
    assert plan(5, (1, 4), 7) == ((2, 2, 1), 128, 4 * 5 * 7 * 4)
    with pytest.raises(ValueError, match="^num_atoms:"):
        plan(4, (3,), 100_000)



def test_dueling_row_group_is_fused_cu_s():
    """The plan's shared memory holds fused.cu's row group: the two constants agree."""
    from importlib import resources

    from foxhunt.fast.kernels import fused as fast_fused

    text = (resources.files("foxhunt.cuda_src") / "fused.cu").read_text()
    assert fast_fused.DUELING_ROW_GROUP == int(
        re.search(r"constexpr int kDuelingRowGroup = (\d+);", text).group(1))


def test_dueling_warps_is_the_kernels_launch_bound():
    """The plan's warps per block are at most the kernel's __launch_bounds__ (kDuelingMaxWarps):
    a larger block would not launch."""
    from importlib import resources

    from foxhunt.fast.kernels import fused as fast_fused

    text = (resources.files("foxhunt.cuda_src") / "fused.cu").read_text()
    assert fast_fused.DUELING_WARPS == int(
        re.search(r"constexpr int kDuelingMaxWarps = (\d+);", text).group(1))
    assert "__launch_bounds__(kDuelingMaxWarps * kWarp" in text
    for batch, branches, atoms in ((512, (3, 3, 2), 51), (5, (1, 4), 7), (3, (2,), 2457)):
        _, threads, _ = fast_fused.plan_dueling_log_softmax_q_branches(batch, branches, atoms)
        assert threads <= 32 * fast_fused.DUELING_WARPS

@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_dueling_log_softmax_q_branches_compiles(arch, tmp_path):
    module = _compile_fused_ptx(arch, tmp_path)
    assert module.logs["fused.cu"] == "" and module.logs["distributional.cu"] == ""
    name = "dueling_log_softmax_q_branches"
    assert module.kernels[name] == "fused.cu"
    # v, adv, z, n_actions, action_offset, logits, logp, q; batch, num_atoms, with_q
    assert tuple(p.ptx_type for p in module.params[name]) == ("u64",) * 8 + ("u32",) * 3
    body = _entry(module.ptx["fused.cu"], name)
    assert "atom." not in body and "bar.sync" not in body  # no atomics, no block barrier
    assert "ld.shared.f32" in body and "st.shared.f32" in body  # the staged logits row
    ops = _float_ops(body)
    # dueling's mean (one IEEE division), log-softmax's and Q's warp butterflies, never fused
    assert ops["div.rn.f32"] > 0 and ops["shfl.sync.bfly.b32"] > 0 and ops["max.f32"] > 0
    # the log-softmax/Q row is log_softmax_expected_q's: same float operation kinds
    lsq = _float_ops(_entry(module.ptx["distributional.cu"], "log_softmax_expected_q"))
    assert set(lsq) <= set(ops)


# ---------------------------------------------------------------------------------------------
# dueling_combine_backward_sum_branches: the per-branch dueling backward, dv summed over branches
# ---------------------------------------------------------------------------------------------


def make_dlogits(branches, batch, atoms, seed=0) -> np.ndarray:
    """Branch-packed ``dlogits [B * A_total, NA]`` of scale ~1e-2 (the step's logit gradients)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch * sum(branches), atoms)) * 1e-2).astype(F32)


def backward_sum_composition(dlogits, branches):
    """network.backward's loop on hand-sliced blocks: ``dv = dv + dv_d`` from zeros (branch
    order) over per-branch ``dueling_combine_backward`` calls; dadv packed by hand."""
    batch, atoms = dlogits.shape[0] // sum(branches), dlogits.shape[1]
    dv = np.zeros((batch, atoms), F32)
    dadv = np.empty_like(dlogits)
    for d, n in enumerate(branches):
        lo = batch * sum(branches[:d])
        g = dist.dueling_combine_backward(dlogits[lo:lo + batch * n].reshape(batch, n, atoms).copy())
        dv = dv + g.dv
        dadv[lo:lo + batch * n] = g.dadv.reshape(batch * n, atoms)
    return dv, dadv


def unfused_glue(dlogits, branches):
    """What the step ran before: dueling_combine_backward_branches, then glue_branch_sum's
    ``((0 + parts[0] / 1) + parts[1] / 1) + ...`` on its dv parts."""
    g = fused.dueling_combine_backward_branches(dlogits, branches)
    acc = np.zeros(g.dv.shape[1:], F32)
    for part in g.dv:
        acc = (acc + part / F32(1.0)).astype(F32)
    return acc, g.dadv


BWD_CASES = {
    "seed": ((3, 3, 2), 256, 51),
    "tiny": ((3, 2), 4, 11),
    "odd": ((3, 3, 2), 257, 53),
    "mixed": ((2, 1, 4), 5, 7),
    "one-branch": ((1,), 9, 3),
}


@pytest.mark.parametrize("case", list(BWD_CASES), ids=list(BWD_CASES))
def test_dueling_combine_backward_sum_branches_is_the_composition(case):
    branches, batch, atoms = BWD_CASES[case]
    dlogits = make_dlogits(branches, batch, atoms)
    got = fused.dueling_combine_backward_sum_branches(dlogits, branches)
    assert isinstance(got, fused.DuelingGradsSum)
    assert got.dv.shape == (batch, atoms) and got.dadv.shape == dlogits.shape
    assert got.dv.dtype == F32 and got.dadv.dtype == F32
    dv, dadv = backward_sum_composition(dlogits, branches)
    assert bits_equal(got.dv, dv) and bits_equal(got.dadv, dadv)
    glue_dv, glue_dadv = unfused_glue(dlogits, branches)
    assert bits_equal(got.dv, glue_dv) and bits_equal(got.dadv, glue_dadv)


@pytest.mark.parametrize("case", ["tiny", "mixed", "one-branch"])
def test_dueling_combine_backward_sum_branches_vs_torch_autograd(case):
    torch = pytest.importorskip("torch")
    branches, batch, atoms = BWD_CASES[case]
    dlogits = make_dlogits(branches, batch, atoms, seed=3)
    rng = np.random.default_rng(4)
    v = torch.tensor(rng.standard_normal((batch, atoms)), dtype=torch.float64, requires_grad=True)
    advs, loss = [], 0.0
    for d, n in enumerate(branches):
        lo = batch * sum(branches[:d])
        adv = torch.tensor(rng.standard_normal((batch, n, atoms)), dtype=torch.float64,
                           requires_grad=True)
        logits = v[:, None, :] + (adv - adv.mean(dim=1, keepdim=True))
        dl = torch.tensor(dlogits[lo:lo + batch * n].astype(np.float64).reshape(batch, n, atoms))
        loss = loss + (logits * dl).sum()
        advs.append(adv)
    loss.backward()
    got = fused.dueling_combine_backward_sum_branches(dlogits, branches)
    np.testing.assert_allclose(got.dv, v.grad.numpy(), rtol=1e-5, atol=1e-8)
    dadv64 = np.concatenate([a.grad.numpy().reshape(-1, atoms) for a in advs])
    np.testing.assert_allclose(got.dadv, dadv64, rtol=1e-5, atol=1e-8)


def test_dueling_combine_backward_sum_branches_negative_zero_sums_to_positive_zero():
    # (+0 + -0) + -0 = +0: the sum starts from +0.0, as the reference step's zeros do.
    dlogits = np.full((2 * 5, 3), -0.0, F32)
    got = fused.dueling_combine_backward_sum_branches(dlogits, (2, 3))
    assert np.all(got.dv == 0) and not np.signbit(got.dv).any()
    assert np.signbit(fused.dueling_combine_backward_branches(dlogits, (2, 3)).dv).all()


@settings(max_examples=40)
@given(data=st.data(), branches=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       batch=st.integers(1, 5), atoms=st.integers(1, 6))
def test_dueling_combine_backward_sum_branches_specials_match_composition(data, branches, batch,
                                                                          atoms):
    branches = tuple(branches)
    dlogits = make_dlogits(branches, batch, atoms, seed=data.draw(st.integers(0, 2**16)))
    for _ in range(data.draw(st.integers(0, 4))):
        dlogits.flat[data.draw(st.integers(0, dlogits.size - 1))] = data.draw(
            st.sampled_from(SPECIALS))
    got = fused.dueling_combine_backward_sum_branches(dlogits, branches)
    dv, dadv = backward_sum_composition(dlogits, branches)
    assert bits_equal(got.dv, dv) and bits_equal(got.dadv, dadv)
    glue_dv, glue_dadv = unfused_glue(dlogits, branches)
    assert bits_equal(got.dv, glue_dv) and bits_equal(got.dadv, glue_dadv)
    # The contract, checked directly in float64: dv[b, j] is NaN iff the sum over every branch's
    # actions is NaN (a NaN entry, or opposite Infs anywhere in the cell), else that Inf or finite;
    # dadv_d[b, :, j] is all NaN where branch d's cell holds a NaN.
    with np.errstate(all="ignore"):
        dv64 = np.zeros((batch, atoms))
        for d, n in enumerate(branches):
            lo = batch * sum(branches[:d])
            blk = dlogits[lo:lo + batch * n].astype(np.float64).reshape(batch, n, atoms)
            dv64 = dv64 + blk.sum(axis=1)
            nan_cell = np.isnan(blk).any(axis=1)
            got_blk = got.dadv[lo:lo + batch * n].reshape(batch, n, atoms)
            assert np.all(np.isnan(got_blk).all(axis=1)[nan_cell])
    assert np.array_equal(np.isnan(got.dv), np.isnan(dv64))
    assert np.array_equal(np.isposinf(got.dv), np.isposinf(dv64))
    assert np.array_equal(np.isneginf(got.dv), np.isneginf(dv64))


def dlogits_not_packed(k):
    k["dlogits"] = k["dlogits"][:-1]


def dlogits_f64(k):
    k["dlogits"] = k["dlogits"].astype(np.float64)


def dlogits_1d(k):
    k["dlogits"] = k["dlogits"].ravel()


def dlogits_no_atoms(k):
    k["dlogits"] = np.zeros((k["dlogits"].shape[0], 0), F32)


def branches_empty(k):
    k["branches"] = ()


def branches_bool(k):
    k["branches"] = (True, 2)


@pytest.mark.parametrize("name,edit", [
    _bad("dlogits", dlogits_not_packed), _bad("dlogits", dlogits_f64), _bad("dlogits", dlogits_1d),
    _bad("dlogits", dlogits_no_atoms), _bad("branches", wrong_branches),
    _bad("branches", branches_empty), _bad("branches", branches_bool),
])
def test_dueling_combine_backward_sum_branches_bad_input_names_the_argument(name, edit):
    kwargs = {"dlogits": make_dlogits((3, 3, 2), 4, 5), "branches": (3, 3, 2)}
    edit(kwargs)
    with pytest.raises(ValueError, match=rf"^{name}:"):
        fused.dueling_combine_backward_sum_branches(**kwargs)


def test_dueling_combine_backward_sum_branches_is_listed_and_plans_the_seed():
    import inspect

    from foxhunt.fast.kernels import fused as fast_fused

    name = "dueling_combine_backward_sum_branches"
    assert fused.KERNELS[name] is fused.dueling_combine_backward_sum_branches
    assert fast_fused.KERNELS[name] is fast_fused.dueling_combine_backward_sum_branches
    assert (inspect.signature(fast_fused.dueling_combine_backward_sum_branches)
            == inspect.signature(fused.dueling_combine_backward_sum_branches))
    plan = fast_fused.plan_dueling_combine_backward_sum_branches
    # one thread per (b, j) cell over every branch: 256 * 51 cells in blocks of 128
    assert plan(256, (3, 3, 2), 51) == ((102, 1, 1), 128, 0)
    assert plan(1, (2,), 1) == ((1, 1, 1), 128, 0)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_dueling_combine_backward_sum_branches_compiles(arch, tmp_path):
    module = _compile_fused_ptx(arch, tmp_path)
    assert module.logs["fused.cu"] == "" and module.logs["distributional.cu"] == ""
    name = "dueling_combine_backward_sum_branches"
    assert module.kernels[name] == "fused.cu"
    # dlogits, n_actions, action_offset, dv, dadv; batch, num_atoms, n_branches
    assert tuple(p.ptx_type for p in module.params[name]) == ("u64",) * 5 + ("u32",) * 3
    body = _entry(module.ptx["fused.cu"], name)
    assert "atom." not in body and "bar.sync" not in body
    def arith(ptx_body):
        return {op for op in _float_ops(ptx_body) if op.split(".")[0] in
                ("add", "sub", "mul", "div", "fma", "max", "min", "neg", "abs")}

    ops = _float_ops(body)
    # the per-branch body's IEEE arithmetic (action sum, one division, subtraction), never fused
    per_branch = _entry(module.ptx["fused.cu"], "dueling_combine_backward_branches")
    assert arith(body) == arith(per_branch) == {"add.rn.f32", "div.rn.f32", "sub.rn.f32"}
    assert ops["div.rn.f32"] > 0 and ops["add.rn.f32"] > 0 and ops["sub.rn.f32"] > 0
