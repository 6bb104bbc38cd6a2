"""The fused evaluation walk's twin (reference/kernels/walk.py), its launch plans (the one-block
and the cluster kernel, and which one a device's architecture gets), NVRTC builds of walk.cu
and its conformance samples, on the CPU; on a GPU, the cluster kernel against the one-block
kernel, bit for bit. The support: one for every branch (``z_stride = 0``) or one per branch
(``z_stride = NA``: the live per-branch support of ``adaptive_atoms``)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from foxhunt.conformance.kernel_spec import case_dims
from foxhunt.conformance.specs.walk import ENTRIES, branch_supports
from foxhunt.fast.device import cuda_available
from foxhunt.fast.kernels import walk as fast_walk
from foxhunt.fast.kernels.walk import plan_greedy_walk, walk_shared_floats
from foxhunt.reference import network
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.env import ExecutionCosts
from foxhunt.reference.kernels import walk
from foxhunt.reference.kernels.env import MarketTables
from foxhunt.reference.kernels.env_walk import greedy_walk as kernels_walk
from foxhunt.reference.layout import ParamLayout

F32 = np.float32
SPEC = {e.name: e for e in ENTRIES}["greedy_walk"]


def _sample(case="tiny", seed=0, **changes):
    kwargs = SPEC.sample(case_dims(case), np.random.default_rng(seed))
    kwargs.update(changes)
    return kwargs


def test_dot_lanes_sums_each_lane_in_order_then_the_halving_tree():
    # lane 0 holds 1 (k=0) and 1 (k=32), lane 16 holds 2^24: lanes first gives 2 + 2^24
    # exactly; the sum in k order would lose both ones (2^24 + 1 rounds to 2^24).
    w = np.zeros((1, 64), F32)
    w[0, 0] = w[0, 32] = 1.0
    w[0, 16] = 2.0**24
    assert walk.dot_lanes(np.ones(64, F32), w)[0] == F32(2.0**24 + 2)
    rng = np.random.default_rng(1)
    x, m = rng.integers(-8, 8, 37).astype(F32), rng.integers(-8, 8, (5, 37)).astype(F32)
    np.testing.assert_array_equal(walk.dot_lanes(x, m), (m.astype(np.float64) @ x).astype(F32))


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_forward_row_is_the_network_forward(precision):
    c = DQNConfig.preset("tiny", precision=precision)
    lay = ParamLayout(c)
    rng = np.random.default_rng(2)
    p = (rng.standard_normal(lay.num_elements) * 0.3).astype(F32)
    x = rng.standard_normal((1, c.state_dim)).astype(F32)
    z = np.linspace(c.v_min, c.v_max, c.num_atoms, dtype=F32)
    bound = F32(2.5)
    ref = network.q_values(c, network.forward(c, lay, p, x, h2_bound=bound), z)
    qs = walk.forward_row(p, walk.walk_offsets(lay, c.n_branches), walk.walk_dims(c), c.branches,
                          precision == "bf16", z, bound, x[0])
    for q, r in zip(qs, ref):
        assert q.shape == r.shape
        np.testing.assert_allclose(q, r, rtol=0, atol=walk.q_error_bound(z, precision == "bf16"))


def _hand_margins(qs: list[np.ndarray]) -> np.float32:
    """min over the branches of (best - second best), written out (no NaN in these rows)."""
    return np.float32(min(np.diff(np.sort(q.reshape(-1)))[-1] for q in qs))


@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("per_branch", [False, True], ids=["one-support", "per-branch"])
def test_the_walk_is_the_kernels_greedy_walk_up_to_the_first_near_tie(per_branch, precision):
    """The twin against the bar-by-bar composition of the reference functions: the network's
    forward (``network.forward``), the expected Q of branch d on its support (``network.q_values``
    with ``z [NA]`` or ``z [n_branches, NA]``: row d), the greedy action and the env
    (``env_walk.greedy_walk``); the margins (best minus second best, the minimum over the
    branches) from those Q values."""
    c = DQNConfig.preset("tiny", precision=precision)
    bf16 = precision == "bf16"
    k = _sample(bf16=bf16)
    if per_branch:  # distinct rows: a branch read on another's row picks other actions
        k.update(z=branch_supports(c), z_stride=c.num_atoms)
    lay = ParamLayout(c)
    bound = np.float32(k["h2_clamp_mult"] * max(k["isv"][k["isv_index"]], 1.0))
    margins = []

    def q_values(obs):
        act = network.forward(c, lay, k["params"], obs, h2_bound=bound)
        qs = network.q_values(c, act, k["z"])
        margins.append(_hand_margins(qs))
        return qs

    T = k["close"].shape[0]
    tables = MarketTables(k["close"], k["high"], k["low"], k["features"], np.zeros(T, np.int32))
    ref = kernels_walk(q_values, tables, ExecutionCosts(), c.branches, c.state_dim, k["start"],
                       k["start"] + k["n_steps"] + 1)
    got = walk.greedy_walk(**k)
    tie = walk.first_near_tie(got.margins, k["z"], bf16)
    assert tie > k["n_steps"] // 2  # the sample decides most bars
    for a, b in zip(got[:3], ref):
        np.testing.assert_array_equal(a[:tie], b[:tie])
    # both paths' Q agree within the bound (two Q values per margin)
    bound_q = 2 * walk.q_error_bound(k["z"], bf16)
    np.testing.assert_allclose(got.margins[:tie + 1], np.array(margins, F32)[:tie + 1], rtol=0,
                               atol=bound_q)


def test_a_support_per_branch_changes_the_walk_against_either_shared_row():
    """Not vacuous: the per-branch sample's records differ from the walk on branch 0's row and
    on branch 1's row shared by both branches (actions, or at least margins)."""
    k = _sample("odd")
    assert k["z_stride"] == k["dims"][5] and k["z"].shape == (2, k["dims"][5])
    got = walk.greedy_walk(**k)
    for row in k["z"]:
        shared = walk.greedy_walk(**{**k, "z": row.copy(), "z_stride": 0})
        assert got.margins.tobytes() != shared.margins.tobytes()
    shared = walk.greedy_walk(**{**k, "z": k["z"][1].copy(), "z_stride": 0})
    assert got.positions.tobytes() != shared.positions.tobytes()


@pytest.mark.parametrize("case", ["tiny", "seed"])
def test_stride_0_is_one_row_per_branch_repeated_bit_for_bit(case):
    """``z [NA]`` with ``z_stride = 0`` reads what ``z [n_branches, NA]`` of that row repeated
    reads with ``z_stride = NA``: the same records and margins, bit for bit."""
    k = _sample(case)
    nb, na = len(k["branches"]), k["dims"][5]
    one = walk.greedy_walk(**k)
    rows = walk.greedy_walk(**{**k, "z": np.tile(k["z"], (nb, 1)), "z_stride": na})
    for a, b in zip(one, rows):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("changes, message", [
    (dict(z_stride=1), "z_stride=1: allowed 0 (one support z [num_atoms] for every branch) or "
                       "num_atoms=11"),
    (dict(z_stride=True), "z_stride=True: allowed 0"),
    (dict(z_stride=11.0), "z_stride=11.0: allowed 0"),
    (dict(z_stride=11), "z: shape (11,); need [2, 11] with z_stride=11"),
    (dict(z=np.zeros((2, 11), F32)), "z: shape (2, 11); need [11] with z_stride=0"),
    (dict(z=np.zeros((3, 11), F32), z_stride=11), "z: shape (3, 11); need [2, 11]"),
    (dict(z=np.zeros((2, 11)), z_stride=11), "z: dtype float64 is not allowed"),
])
def test_support_errors_are_one_line_naming_the_argument(changes, message):
    k = _sample()
    assert (len(k["branches"]), k["dims"][5]) == (2, 11)
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        walk.greedy_walk(**{**k, **changes})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("case", ["tiny", "seed"])
def test_samples_are_decided_by_clear_margins(case):
    k = _sample(case)
    rec = walk.greedy_walk(**k)
    assert walk.first_near_tie(rec.margins, k["z"], k["bf16"]) > k["n_steps"] // 2
    if case == "tiny":  # the walk trades (the seed sample holds one position: margins only)
        assert np.unique(rec.positions).size >= 2


def test_a_non_finite_feature_zeroes_h2_so_the_rest_of_its_row_does_not_matter():
    k = _sample()
    a, b = k["features"].copy(), k["features"].copy()
    bar = k["start"] + 5
    a[bar, 0] = np.nan
    b[bar] = np.random.default_rng(9).standard_normal(b.shape[1])
    b[bar, 1] = np.inf
    ra, rb = walk.greedy_walk(**{**k, "features": a}), walk.greedy_walk(**{**k, "features": b})
    for x, y in zip(ra, rb):
        np.testing.assert_array_equal(x, y)
    assert np.isfinite(ra.rewards).all()


def test_errors_name_the_argument():
    k = _sample()
    with pytest.raises(ValueError, match="n_steps"):
        walk.greedy_walk(**{**k, "n_steps": k["close"].shape[0]})
    with pytest.raises(ValueError, match="param_offsets"):
        walk.greedy_walk(**{**k, "param_offsets": k["param_offsets"][:-1]})


def test_plan_is_one_block_with_the_shared_layout_counted_by_hand():
    c = DQNConfig.preset("seed")
    dims = walk.walk_dims(c)
    # x 128 + h1 256 + h2 256 + hidden 128 + 3 * 128 + outputs 51 * (1 + 8) + q 8 + 2 * 32 * 51
    assert walk_shared_floats(dims, c.branches) == 4883
    assert plan_greedy_walk(dims, c.branches) == ((1,), (1024,), 4 * 4883)
    with pytest.raises(ValueError, match="shared memory"):
        plan_greedy_walk((128, 4096, 4096, 128, 128, 51), c.branches)


# ------------------------------------------------------------------ the cluster kernel's plan

SEED = DQNConfig.preset("seed")
SEED_DIMS = walk.walk_dims(SEED)


def test_cluster_plan_counts_the_seed_network_s_slices_by_hand():
    # Per block of 8, rows ceil(n / 8): s1 256 -> 32 rows of 128, s2 256 -> 32 rows of 256,
    # hidden 128 + 3 * 128 = 512 -> 64 rows of 256, outputs 51 * (1 + 8) = 459 -> 58 rows of
    # 128 (value and advantage rows alike): biases 32 + 32 + 64 + 58 = 186, weights
    # 32 * 128 + 32 * 256 + 64 * 256 + 58 * 128 = 36096 elements.
    assert fast_walk.cluster_slices(SEED_DIMS, SEED.branches, 8) == (186, 36096)
    # Activations as the one-block kernel's (32 warps each): 4883 floats.
    floats = 4 * (4883 + 186)
    assert fast_walk.cluster_shared_bytes(SEED_DIMS, SEED.branches, True, 8) == floats + 2 * 36096
    assert fast_walk.cluster_shared_bytes(SEED_DIMS, SEED.branches, False, 8) == floats + 4 * 36096
    for bf16, nbytes in ((True, 92468), (False, 164660)):
        assert fast_walk.plan_walk(SEED_DIMS, SEED.branches, bf16, "sm_90") == (
            "greedy_walk_cluster", ((8,), (1024,), nbytes))


@pytest.mark.parametrize("preset", ["tiny", "seed"])
def test_one_block_s_slices_hold_every_weight_and_bias_once(preset):
    """With C = 1 the slices are the network's weight and bias tensors (ParamLayout's sizes)."""
    c = DQNConfig.preset(preset)
    lay = ParamLayout(c)
    names = walk.walk_tensors(c.n_branches)
    size = {name: int(np.prod(lay[name].shape)) for name in names}
    want = (sum(v for k, v in size.items() if k.startswith("b_")),
            sum(v for k, v in size.items() if k.startswith("w_")))
    assert fast_walk.cluster_slices(walk.walk_dims(c), c.branches, 1) == want


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 459, 512])
def test_owned_rows_split_the_layer_in_rank_order(rows):
    covered = []
    for rank in range(8):
        r0, r1 = fast_walk.owned_rows(rows, rank, 8)
        assert r1 - r0 <= -(-rows // 8)
        covered.extend(range(r0, r1))
    assert covered == list(range(rows))


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", (8, 9), "sm_89"])
def test_before_sm90_the_plan_is_the_one_block_kernel(arch):
    assert fast_walk.plan_walk(SEED_DIMS, SEED.branches, True, arch) == (
        "greedy_walk", plan_greedy_walk(SEED_DIMS, SEED.branches))


@pytest.mark.parametrize("arch", ["sm_90", (9, 0), "sm_100"])
def test_from_sm90_the_plan_is_the_cluster_kernel(arch):
    kernel, (grid, block, _) = fast_walk.plan_walk(SEED_DIMS, SEED.branches, False, arch)
    assert (kernel, grid, block) == ("greedy_walk_cluster", (8,), (1024,))


def test_a_network_too_large_for_the_cluster_falls_back_to_the_one_block_kernel():
    # s2 of 1024 x 1024 f32 weights: 512 KiB per block of 8, past sm_90's 227 KiB; the one-block
    # kernel reads the weights from global memory and needs only its activations.
    dims = (128, 1024, 1024, 128, 128, 51)
    with pytest.raises(ValueError, match="greedy_walk_cluster needs .* sm_90 allows at most"):
        fast_walk.plan_greedy_walk_cluster(dims, SEED.branches, False, "sm_90")
    assert fast_walk.plan_walk(dims, SEED.branches, False, "sm_90") == (
        "greedy_walk", plan_greedy_walk(dims, SEED.branches))
    with pytest.raises(ValueError, match="greedy_walk needs"):  # fits neither
        fast_walk.plan_walk((128, 8192, 8192, 128, 128, 51), SEED.branches, False, "sm_90")


# ------------------------------------------------------------------------- NVRTC builds


def _walk_sources() -> dict[str, bytes]:
    """walk.cu and the headers beside it: a build of walk.cu alone (with options of its own)."""
    from foxhunt.fast._build import HEADER_SUFFIXES, source_files

    return {n: b for n, b in source_files().items() if n == "walk.cu" or n.endswith(HEADER_SUFFIXES)}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_walk_cu_compiles_with_the_cluster_the_plan_launches(arch, package_build):
    """PTX of walk.cu in the session's package build (NVRTC needs no GPU): its kernels, the
    same parameters, and the cluster kernel's compiled-in cluster (``.reqnctapercluster``) is
    the plan's grid."""
    import re

    module = package_build(arch)
    assert {k for k, unit in module.kernels.items() if unit == "walk.cu"} == {
        "greedy_walk", "greedy_walk_cluster", "greedy_walk_round", "greedy_walk_hold",
        "greedy_walk_spans"}
    assert module.params["greedy_walk"] == module.params["greedy_walk_cluster"]
    ptx_round = module.ptx["walk.cu"][module.ptx["walk.cu"].index(".entry greedy_walk_round("):]
    assert re.search(r"\.reqnctapercluster (\d+), 1, 1", ptx_round[:ptx_round.index("{")]) \
        or arch != "sm_90"
    ptx = module.ptx["walk.cu"]
    head = ptx[ptx.index(".entry greedy_walk_cluster("):]
    found = re.search(r"\.reqnctapercluster (\d+), 1, 1", head[:head.index("{")])
    compiled = int(found.group(1)) if found else 1
    assert compiled == fast_walk.cluster_size(arch) == (8 if arch == "sm_90" else 1)
    if arch == "sm_90":
        assert fast_walk.plan_greedy_walk_cluster(SEED_DIMS, SEED.branches, True, arch)[0] == (
            compiled,)


def test_walk_kernels_do_not_spill_on_sm90(tmp_path):
    """The one-bar walks are latency-bound: they may not spill registers to local memory (ptxas
    chose 32 registers and spilled before ``__launch_bounds__(1024, 1)``)."""
    import re

    from foxhunt.fast._build import compile_sources

    module = compile_sources("sm_90", "cubin", cache_root=tmp_path, sources=_walk_sources(),
                             extra_options=("--ptxas-options=-v",))
    log = module.logs["walk.cu"]
    spills = dict(re.findall(r"Function properties for (\w+)\n.*?(\d+) bytes spill stores", log))
    assert {k: spills[k] for k in ("greedy_walk", "greedy_walk_cluster", "greedy_walk_round")} \
        == {"greedy_walk": "0", "greedy_walk_cluster": "0", "greedy_walk_round": "0"}
    # The hold and span kernels run many rows a pass (throughput, not one bar's latency): the
    # H200's NVRTC 13.0 spills 4 bytes of greedy_walk_hold (this machine's: none); a few bytes
    # are allowed, not more.
    assert set(spills) == {"greedy_walk", "greedy_walk_cluster", "greedy_walk_round",
                           "greedy_walk_hold", "greedy_walk_spans"}
    assert max(int(spills[k]) for k in ("greedy_walk_hold", "greedy_walk_spans")) <= 16


def test_the_phase_profile_is_compiled_only_on_request(tmp_path, package_build):
    """benches/walk_profile.py's build (-DWALK_PROFILE) declares the ``walk_profile`` global
    that the bench reads back; the normal build (the session's package build) has no trace of
    it (the kernels it launches are unchanged by the profile). One architecture (sm_90): the
    switch is a preprocessor branch, the same for every target, and each build of walk.cu
    costs CI about 6 s."""
    arch = "sm_90"
    from foxhunt.fast._build import compile_sources

    normal = package_build(arch)
    profiled = compile_sources(arch, "ptx", cache_root=tmp_path, sources=_walk_sources(),
                               extra_options=("-DWALK_PROFILE",))
    assert "walk_profile" not in normal.ptx["walk.cu"]
    assert "clock64" not in normal.ptx["walk.cu"] and "%clock64" not in normal.ptx["walk.cu"]
    assert ".global .align 8 .b8 walk_profile[256]" in profiled.ptx["walk.cu"]
    assert "%clock64" in profiled.ptx["walk.cu"]
    assert profiled.params == {k: p for k, p in normal.params.items()
                               if normal.kernels[k] == "walk.cu"}


# ------------------------------------------------------------- on a GPU: cluster == one block

_GPU, _WHY = cuda_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU, reason=f"no CUDA device/driver: {_WHY}")
@pytest.mark.parametrize("poison", [False, True])
@pytest.mark.parametrize("precision", ["bf16", "f32"])
@pytest.mark.parametrize("case", ["tiny", "seed", "odd"])
def test_gpu_cluster_walk_is_the_one_block_walk_bit_for_bit(case, precision, poison):
    """walk.cu's claim: the same rows by other warps and blocks, the same bits (records and
    margins), NaN/Inf features included; ``odd``: a support per branch (``z_stride = NA``).
    Runs where the device's plan fits the network."""
    from foxhunt.fast.kernels._runtime import runtime

    k = _sample(case, seed=11, bf16=precision == "bf16")
    if poison:
        features = k["features"].copy()
        bars = k["start"] + np.array([0, 4, 9])
        features[bars[0], 0] = np.nan
        features[bars[1], 1] = np.inf
        features[bars[2]] = -3e38
        k["features"] = features
    arch = runtime().device.arch
    try:
        fast_walk.plan_greedy_walk_cluster(k["dims"], k["branches"], k["bf16"], arch)
    except ValueError as exc:
        pytest.skip(f"{arch}: the cluster kernel does not fit this network ({exc})")
    one = fast_walk.greedy_walk(**k)
    cluster = fast_walk.greedy_walk_cluster(**k)
    for name, a, b in zip(walk.WalkRecord._fields, cluster, one):
        assert a.tobytes() == b.tobytes(), f"{name} differs"
    tie = walk.first_near_tie(one.margins, k["z"], k["bf16"])
    assert tie > k["n_steps"] // 2  # and the walk is the twin's up to its first near tie
    ref = walk.greedy_walk(**k)
    for a, b in zip(one[:3], ref[:3]):
        np.testing.assert_array_equal(a[:tie], b[:tie])
