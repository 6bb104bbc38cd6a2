"""The spectral-norm launch plans' dynamic shared memory (fast.kernels.spectral): its size per
architecture, the seed preset's matrices cached on sm_90, the layout's constants shared with
cuda_src/spectral.cu; and on a GPU, the same bits whether a block's rows of W are cached in
shared memory or read from global memory (the paths of spectral.cu's header)."""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import numpy as np
import pytest

from foxhunt.fast.device import cuda_available
from foxhunt.fast.kernels import spectral as fast_spectral
from foxhunt.reference.kernels import spectral as ref_spectral

CU = Path(__file__).resolve().parents[1] / "cuda_src" / "spectral.cu"


def test_plans_dynamic_shared_memory_per_architecture():
    for arch, cluster in (("sm_80", 1), ("sm_90", 8)):
        smem = fast_spectral.spectral_shared_bytes(arch)
        assert fast_spectral.plan_spectral_norm(arch) == (cluster, fast_spectral.SPECTRAL_THREADS, smem)
        assert fast_spectral.plan_batched_spectral_norm(16, arch) == (
            16 * cluster, fast_spectral.SPECTRAL_THREADS, smem)
        assert smem % 16 == 0 and smem <= fast_spectral.SPECTRAL_SHARED_LIMIT
        # At least the static arrays the kernel had before: the partials of a full tile and u
        # of 512 rows (the same occupancy where nothing more is planned).
        assert smem >= 4 * (fast_spectral.SPECTRAL_COL_TILE + fast_spectral.SPECTRAL_U_MIN)
    # sm_90: the seed preset's largest matrix (256 x 256: 32 rows x 256 per block) cached.
    assert fast_spectral.spectral_shared_bytes("sm_90") == 4 * 8740
    # sm_80: one block holds the whole matrix (256 KiB): only the minimum.
    assert fast_spectral.spectral_shared_bytes("sm_80") == 4 * (4096 + 512)


def test_layout():
    # 256 x 256 on 8 blocks: recv 8 x 32, u 32 rows, v 256, W 32 x 256 (+3 floats of slack).
    assert fast_spectral.spectral_shared_floats(256, 256, 8) == (256, 288, 544 + 3 + 8192)
    # Multi-tile: recv holds a full tile's partials whatever the width.
    assert fast_spectral.spectral_shared_floats(12, 9000, 8)[:2] == (4096, 4098)
    assert fast_spectral.spectral_shared_floats(1, 1, 8) == (8, 9, 16 + 3 + 1)
    assert fast_spectral.spectral_shared_floats(7, 5, 1) == (5, 15, 24 + 3 + 35)


def test_every_seed_matrix_is_cached_on_sm90():
    from foxhunt.fast.step_layout import StepLayout
    from foxhunt.reference.config import DQNConfig

    floats = fast_spectral.spectral_shared_bytes("sm_90") // 4
    shapes = [t.shape for t in StepLayout(DQNConfig.preset("seed")).weights]
    assert max(r * c for r, c in shapes) == np.prod(fast_spectral.SPECTRAL_CACHE_SHAPE)
    for rows, cols in shapes:
        assert fast_spectral.spectral_shared_floats(rows, cols, 8)[2] <= floats, (rows, cols)


def test_layout_constants_match_the_kernel():
    text = CU.read_text()
    tile = re.search(r"#define SPECTRAL_COL_TILE (\d+)", text)
    assert tile and int(tile.group(1)) == fast_spectral.SPECTRAL_COL_TILE
    cluster = re.search(r"#define SPECTRAL_CLUSTER (\d+)", text)
    assert cluster and int(cluster.group(1)) == fast_spectral.SPECTRAL_CLUSTER_SM90


# ---------------------------------------------------------------------------------- GPU
_OK, _REASON = cuda_available()
needs_gpu = pytest.mark.skipif(not _OK, reason=f"no CUDA device/driver: {_REASON}")

#: Shapes crossing the kernel's paths on sm_90 with the plan's shared memory: W cached with
#: aligned rows (256 x 256, 128 x 262), cached with rows that start off a 16-byte boundary
#: (odd widths: the copy's and the rescale's scalar heads and tails), blocks without rows
#: (7 x 5, 3 x 1), uncached W with cached u (257 x 259), one multi-tile matrix (12 x 9000).
GPU_SHAPES = [(256, 256), (128, 262), (33, 259), (7, 5), (5, 7), (3, 1), (1, 1), (257, 259),
              (12, 9000)]


def _case(shape, seed: int, scale: float):
    rng = np.random.default_rng(zlib.crc32(f"spectral-plan-{shape}-{seed}".encode()))
    w = (rng.standard_normal(shape) * scale / np.sqrt(shape[1])).astype(np.float32)
    u, v = ref_spectral.init_spectral_vectors(shape, seed)
    return w, u, v


def _launch(w, u, v, sigma_max, threads: int, smem: int):
    from foxhunt.fast.kernels._runtime import InOut, Out, call

    rows, cols = w.shape
    grid = fast_spectral.plan_spectral_norm()[0]
    w2, u2, v2, sigma = call("spectral_norm", grid, threads, InOut(w), InOut(u), InOut(v), rows,
                             cols, np.float32(sigma_max), ref_spectral.SPECTRAL_EPS,
                             Out((1,), np.float32), shared_mem=smem)
    return [a.view(np.uint32).copy() for a in (w2, u2, v2, sigma)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("sigma_max", [0.25, 1e3])  # rescaled / not
@pytest.mark.parametrize("nonfinite", [False, True])
def test_cached_and_global_paths_give_the_same_bits(shape, sigma_max, nonfinite):
    w, u, v = _case(shape, 7, 2.0)
    if nonfinite:  # sigma NaN (W unchanged) or Inf (scale 0) where the NaN is not met
        w.flat[(w.size * 2) // 3] = np.inf
        if w.size > 3:
            w.flat[w.size // 3] = np.nan
    cluster = fast_spectral.plan_spectral_norm()[0]
    recv, with_u, with_w = fast_spectral.spectral_shared_floats(*shape, cluster)
    planned = fast_spectral.plan_spectral_norm()[2]
    want = _launch(w, u, v, sigma_max, fast_spectral.SPECTRAL_THREADS, planned)
    single = fast_spectral.spectral_norm(w, u, v, sigma_max)
    assert all(np.array_equal(a, b.view(np.uint32)) for a, b in
               zip(want, (single.w, single.u, single.v, np.atleast_1d(single.sigma))))
    # Every smaller layout (nothing cached; u only; everything where it fits) and block size.
    sizes = {4 * recv, 4 * with_u, 4 * with_w, planned}
    for smem in sorted(s for s in sizes if s <= fast_spectral.SPECTRAL_SHARED_LIMIT):
        for threads in (512, 256, 32):
            got = _launch(w, u, v, sigma_max, threads, smem)
            for name, a, b in zip(("w", "u", "v", "sigma"), got, want):
                assert np.array_equal(a, b), f"{name}: smem {smem}, {threads} threads"


@pytest.mark.gpu
@needs_gpu
def test_batched_mixes_cached_and_global_matrices_bitwise():
    cases = [_case(s, k, [0.5, 6.0][k % 2]) for k, s in enumerate(GPU_SHAPES)]
    ws, us, vs = (list(c) for c in zip(*cases))
    batched = fast_spectral.batched_spectral_norm(ws, us, vs, 3.0)
    ref = ref_spectral.batched_spectral_norm(ws, us, vs, 3.0)
    rescaled = 0
    for k, (w, u, v) in enumerate(cases):
        single = fast_spectral.spectral_norm(w, u, v, 3.0)
        for a, b in ((batched.ws[k], single.w), (batched.us[k], single.u), (batched.vs[k], single.v)):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), GPU_SHAPES[k]
        assert batched.sigmas[k].view(np.uint32) == single.sigma.view(np.uint32)
        np.testing.assert_allclose(batched.sigmas[k], ref.sigmas[k], rtol=1e-5)
        rescaled += not np.array_equal(single.w, w)
    assert 0 < rescaled < len(cases)


def test_the_step_plan_spreads_a_cluster_one_block_an_sm_on_sm90():
    """The training step's launch takes more than half of an SM's 228 KiB of shared memory on
    sm_90 (one block an SM; the kernel's bits do not depend on it), the plain plan before
    sm_90; a population of more than one member launches it with the plain plan's memory."""
    from foxhunt.fast.population_engine import population_shared

    plain = fast_spectral.plan_batched_spectral_norm(10, "sm_90")
    step = fast_spectral.plan_step_spectral_norm(10, "sm_90")
    assert step[:2] == plain[:2] and step[2] == fast_spectral.SPECTRAL_SPREAD_SHARED
    assert 2 * (step[2] + 1024) > 228 * 1024 and step[2] <= 227 * 1024
    assert fast_spectral.plan_step_spectral_norm(10, "sm_80") == (
        fast_spectral.plan_batched_spectral_norm(10, "sm_80"))
    assert population_shared("batched_spectral_norm", step[2], 1, "sm_90") == step[2]
    assert population_shared("batched_spectral_norm", step[2], 16, "sm_90") == plain[2]
    assert population_shared("adam_update", 0, 16, "sm_90") == 0


def _every_source_three_steps(precision: str) -> tuple[set, int, dict]:
    """The seed preset's step with every second-wave source in ``precision``, on a ``Trainer``
    built now (call it inside the arm's patches): the dynamic shared memory of graph 2's
    spectral-norm launches, the number of weight matrices and the state after three steps (the
    same batches and seed for every arm)."""
    from foxhunt.fast.records import Launch
    from foxhunt.fast.trainer import Trainer
    from foxhunt.reference.batch import Batch
    from foxhunt.reference.config import DQNConfig, source_overrides

    config = DQNConfig.preset("seed", precision=precision, **source_overrides("all"))
    trainer = Trainer(config, seed=5)
    try:
        smem = {n.shape.shared_mem for n in trainer.engine.plans["graph2"].nodes()
                if isinstance(n, Launch) and n.kernel == "batched_spectral_norm"}
        for s in range(3):
            trainer.step(Batch.random(config, np.random.default_rng(s)))
        return smem, len(trainer.engine.layout.weights), trainer.state_dict()
    finally:
        trainer.close()


def _differing_keys(a: dict, b: dict) -> list[str]:
    return [k for k in a if np.asarray(a[k]).tobytes() != np.asarray(b[k]).tobytes()]


@pytest.mark.gpu
@needs_gpu
def test_the_step_with_the_spread_plan_steps_bitwise_as_with_the_plain_one(monkeypatch):
    """Seed preset (bf16, every second-wave source), 3 steps on the GPU: graph 2's spectral norm
    launched with ``SPECTRAL_SPREAD_SHARED`` and with the plain plan's shared memory ends in
    the same bits (the larger memory changes which matrices are cached, never a sum)."""
    from foxhunt.fast import step_program

    if fast_spectral.spectral_cluster() == 1:
        pytest.skip("before sm_90 the step's plan is the plain plan: nothing to compare")
    spread_smem, n_w, spread = _every_source_three_steps("bf16")
    with monkeypatch.context() as patch:
        patch.setattr(fast_spectral, "plan_step_spectral_norm",
                      lambda count, arch=None, **_: (
                          fast_spectral.plan_batched_spectral_norm(count, arch)))
        plain_smem, _, plain = _every_source_three_steps("bf16")
    assert spread_smem == {fast_spectral.plan_step_spectral_norm(
        n_w, fit_clusters="bf16" in step_program.SPECTRAL_FIT_CLUSTERS)[2]}
    assert plain_smem == {fast_spectral.plan_batched_spectral_norm(n_w)[2]}
    assert not _differing_keys(spread, plain)


# ------------------------------------------------------------ every matrix's cluster at once
def test_the_step_plan_fits_more_clusters_than_one_block_an_sm_holds_where_asked():
    """``fit_clusters``: one block an SM up to ``SPECTRAL_SPREAD_CLUSTERS`` matrices, two beyond
    (the memory of two blocks fits an SM's 228 KiB); the plain plan before sm_90."""
    cap = fast_spectral.SPECTRAL_SPREAD_CLUSTERS
    pair = fast_spectral.SPECTRAL_PAIR_SHARED
    assert 2 * (pair + 1024) <= 228 * 1024 < 2 * (fast_spectral.SPECTRAL_SPREAD_SHARED + 1024)
    for count in (1, 10, cap, cap + 1, 16, 40):
        spread = fast_spectral.plan_step_spectral_norm(count, "sm_90")
        fit = fast_spectral.plan_step_spectral_norm(count, "sm_90", fit_clusters=True)
        assert spread[2] == fast_spectral.SPECTRAL_SPREAD_SHARED
        assert fit[:2] == spread[:2] == (8 * count, fast_spectral.SPECTRAL_THREADS)
        assert fit[2] == (pair if count > cap else spread[2])
        assert fast_spectral.plan_step_spectral_norm(count, "sm_80", fit_clusters=True) == (
            fast_spectral.plan_batched_spectral_norm(count, "sm_80"))


def _max_active_clusters(count: int, smem: int) -> int:
    """The driver's answer for ``count`` clusters of batched_spectral_norm with ``smem``."""
    from cuda.bindings import driver as drv

    from foxhunt.fast.device import call as cu
    from foxhunt.fast.kernels._runtime import runtime

    kernel = runtime().module.kernel("batched_spectral_norm")
    kernel.set_max_dynamic_shared(smem)
    grid, block, _ = fast_spectral.plan_batched_spectral_norm(count)
    config = drv.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
    config.sharedMemBytes = smem
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x = fast_spectral.spectral_cluster()
    attr.value.clusterDim.y = attr.value.clusterDim.z = 1
    config.attrs, config.numAttrs = [attr], 1
    return int(cu(drv.cuOccupancyMaxActiveClusters, kernel.function, config))


@pytest.mark.gpu
@needs_gpu
def test_the_step_plans_run_the_seed_matrices_clusters_at_once():
    """On this GPU the step's plan with ``fit_clusters`` runs the seed step's 10 (core) and 16
    (every second-wave source) clusters at once; on a 132-SM part one block an SM holds exactly
    ``SPECTRAL_SPREAD_CLUSTERS`` of them (the constant is that answer)."""
    from cuda.bindings import driver as drv

    from foxhunt.fast.device import call as cu

    if fast_spectral.spectral_cluster() == 1:
        pytest.skip("before sm_90 a matrix is one block: no clusters to fit")
    for count in (10, 16):
        smem = fast_spectral.plan_step_spectral_norm(count, fit_clusters=True)[2]
        assert _max_active_clusters(count, smem) >= count, (count, smem)
    sms = cu(drv.cuDeviceGetAttribute,
             drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0)
    if sms == 132:
        assert _max_active_clusters(16, fast_spectral.SPECTRAL_SPREAD_SHARED) == (
            fast_spectral.SPECTRAL_SPREAD_CLUSTERS)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["bf16", "f32"])
def test_the_step_with_fitted_clusters_steps_bitwise_as_without(precision, monkeypatch):
    """Seed preset, every second-wave source (16 matrices), 3 steps on the GPU: graph 2's
    spectral norm with two blocks an SM (``SPECTRAL_FIT_CLUSTERS``) and with one end in the
    same bits."""
    from foxhunt.fast import step_program

    if fast_spectral.spectral_cluster() == 1:
        pytest.skip("before sm_90 the step's plan is the plain plan: nothing to compare")
    arms = []
    for fit in (True, False):
        monkeypatch.setattr(step_program, "SPECTRAL_FIT_CLUSTERS",
                            frozenset({precision} if fit else ()))
        arms.append(_every_source_three_steps(precision))
    assert [smem for smem, _, _ in arms] == [{fast_spectral.SPECTRAL_PAIR_SHARED},
                                             {fast_spectral.SPECTRAL_SPREAD_SHARED}]
    assert not _differing_keys(arms[0][2], arms[1][2])
