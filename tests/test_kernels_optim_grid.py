"""Grid-independence of the segment kernels of ``cuda_src/optim.cu`` (``grad_norm_partial``,
``clip_saxpy_norm_partial``, ``clip_saxpy_norm_partial_wave``) and of ``saxpy``: their blocks
stride over the work, so a population may launch fewer blocks per member than the plan
(``fast/population_engine.py``'s ``GRID_SHARED_KERNELS``) and get the same bits.

CPU: the launch bound of the segment kernels matches the plans' block cap, and the plans. GPU:
every output of a launch with grid 1, 2, 3, ... equals the plan's launch bit for bit (odd block
sizes take the unaligned element paths; NaN/Inf planted; the wave kernel with a source shorter
than n and a source off)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

F32 = np.float32
OPTIM_CU = Path(__file__).resolve().parents[1] / "cuda_src" / "optim.cu"


def test_segment_kernels_launch_bound_is_the_plans_block_cap():
    from foxhunt.fast.kernels import optim as fast

    text = OPTIM_CU.read_text()
    bound = int(re.search(r"#define HB_PARTIAL_MAX_THREADS (\d+)", text).group(1))
    assert bound == fast.PARTIAL_MAX_THREADS
    for name in ("grad_norm_partial", "clip_saxpy_norm_partial", "clip_saxpy_norm_partial_wave"):
        head = re.search(r"__launch_bounds__\(([^)]*)\)\s*\n" + name + r"\(", text)
        assert head and head.group(1).startswith("HB_PARTIAL_MAX_THREADS"), name
    for n, block_size in ((0, 4096), (1, 3), (289_611, 4096), (10_000, 100_000)):
        grid, block, _ = fast.plan_grad_norm_partial(n, block_size)
        assert block <= fast.PARTIAL_MAX_THREADS and block % 32 == 0
        assert grid == max(1, -(-n // block_size))
        assert fast.plan_clip_saxpy_norm_partial(n, block_size) == (grid, block, 0)


@pytest.mark.parametrize("n", [0, 1, 5, 1024, 1025, 131_072, 10**7])
def test_plan_saxpy_one_thread_per_group(n):
    from foxhunt.fast.kernels import optim as fast

    grid, block, smem = fast.plan_saxpy(n)
    assert (block, smem) == (fast.ELEMENTWISE_THREADS, 0)
    assert 1 <= grid <= fast.ELEMENTWISE_MAX_BLOCKS
    assert grid == min(fast.ELEMENTWISE_MAX_BLOCKS, max(1, -(-n // (4 * block))))


# --- GPU -------------------------------------------------------------------------------------


def _gpu_or_skip():
    from foxhunt.fast.device import cuda_available

    ok, reason = cuda_available()
    if not ok:
        pytest.skip(f"no CUDA device/driver: {reason}")


def _data(rng, n: int, scale: float = 0.1) -> np.ndarray:
    x = (rng.standard_normal(n) * scale).astype(F32)
    if n:
        pos = rng.choice(n, size=min(n, 12), replace=False)
        x[pos] = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45, 3e19] * 2, F32)[:pos.size]
    return x


def _grids(plan_grid: int) -> list[int]:
    return sorted({g for g in (1, 2, 3, 5, 7, plan_grid - 1, plan_grid + 3) if g >= 1})


def _same(got, want) -> bool:
    return all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(got, want))


CASES = [(289_611, 4096, 4096), (257 * 259, 256, 256), (515, 7, 7), (1001, 3, 3),
         (1000, 6, 1), (4096 * 9, 4096, 4096), (0, 4096, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "block_size", "segment"), CASES)
def test_gpu_grad_norm_partial_any_grid(n, block_size, segment):
    _gpu_or_skip()
    from foxhunt.fast.kernels import optim as fast
    from foxhunt.fast.kernels._runtime import In, Out, call

    x = _data(np.random.default_rng(n), n)
    bs = min(block_size, max(n, 1))
    grid, block, smem = fast.plan_grad_norm_partial(n, bs)
    out = Out((-(-n // bs),), F32)
    want = call("grad_norm_partial", grid, block, In(x), n, bs, out, shared_mem=smem)
    assert _same(want, (fast.grad_norm_partial(x, block_size),))
    for g in _grids(grid):
        got = call("grad_norm_partial", g, block, In(x), n, bs, out, shared_mem=smem)
        assert _same(got, want), f"grid {g} of {grid}"


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "block_size", "segment"), CASES)
def test_gpu_clip_saxpy_norm_partial_any_grid(n, block_size, segment):
    _gpu_or_skip()
    from foxhunt.fast.kernels import optim as fast
    from foxhunt.fast.kernels._runtime import In, Out, call

    rng = np.random.default_rng(n + 1)
    base, inject = _data(rng, n), _data(rng, n, 0.3)
    base_parts = fast.grad_norm_partial(base, segment)
    inject_parts = fast.grad_norm_partial(inject, segment)
    count = base_parts.size
    # finite caps (the data's 3e19 entries overflow the squared norms to +Inf): the clip scales
    # are then 0 where a norm is +Inf and < 1 elsewhere
    base_max, inject_max = 0.7, 0.15
    bs = min(block_size, max(n, 1))
    grid, block, smem = fast.plan_clip_saxpy_norm_partial(n, bs)

    def launch(g):
        return call("clip_saxpy_norm_partial", g, block, In(base), In(inject), n, F32(base_max),
                    In(base_parts), F32(1.0), F32(inject_max), In(inject_parts), count,
                    fast.final_threads_clip_saxpy_norm_partial(count), bs, Out((n,), F32),
                    Out((-(-n // bs),), F32), Out((1,), F32), Out((1,), F32), shared_mem=smem)

    want = launch(grid)
    entry = fast.clip_saxpy_norm_partial(base, inject, base_max, base_parts, 1.0, inject_max,
                                         inject_parts, block_size)
    assert _same(want, (entry.out, entry.partials, [entry.base_norm_sq], [entry.inject_norm_sq]))
    for g in _grids(grid):
        assert _same(launch(g), want), f"grid {g} of {grid}"


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "block_size", "segment"), CASES)
@pytest.mark.parametrize("sources", ["both", "iqn", "none"])
def test_gpu_clip_saxpy_norm_partial_wave_any_grid(n, block_size, segment, sources):
    _gpu_or_skip()
    from foxhunt.fast.kernels import optim as fast
    from foxhunt.fast.kernels import wave as fast_wave
    from foxhunt.fast.kernels._runtime import In, Out, call

    rng = np.random.default_rng(n + 2)
    base, inject = _data(rng, n), _data(rng, n, 0.3)
    ends = {"iqn": (3 * n) // 5 + (n > 2), "ens": n - (n > 8) * 5}
    on = {"both": ("iqn", "ens"), "iqn": ("iqn",), "none": ()}[sources]
    src = {k: _data(rng, ends[k], 0.2) for k in on}
    parts = {k: fast.grad_norm_partial(v, segment) for k, v in src.items()}
    base_parts = fast.grad_norm_partial(base, segment)
    count = base_parts.size
    for k in on:  # every partial array has `count` entries (the step's layout)
        p = np.zeros(count, F32)
        p[:parts[k].size] = parts[k][:count]
        parts[k] = p
    inject_parts = fast.grad_norm_partial(inject, segment)
    bs = min(block_size, max(n, 1))
    grid, block, smem = fast_wave.plan_clip_saxpy_norm_partial_wave(n, bs)

    def source(k):
        if k not in on:
            return (0, 0, F32(0), F32(0), 0)
        norm = float(np.sqrt(fast.grad_norm_final(parts[k])))
        return (In(src[k]), src[k].size, F32(0.5), F32(0.6 * norm), In(parts[k]))

    def launch(g):
        outs = [Out((1,), F32) if k in on else 0 for k in ("iqn", "ens")]
        return call("clip_saxpy_norm_partial_wave", g, block, In(base), In(inject), n, F32(0.3),
                    In(base_parts), F32(1.0), F32(0.2), In(inject_parts), *source("iqn"),
                    *source("ens"), count,
                    fast_wave.final_threads_clip_saxpy_norm_partial_wave(count), bs,
                    Out((n,), F32), Out((-(-n // bs),), F32), Out((1,), F32), Out((1,), F32),
                    *outs, shared_mem=smem)

    want = launch(grid)
    for g in _grids(grid):
        assert _same(launch(g), want), f"grid {g} of {grid}"


@pytest.mark.gpu
@pytest.mark.parametrize("n", [0, 1, 3, 4, 7, 1029, 131_073, 289_611])
def test_gpu_saxpy_any_grid_equals_reference(n):
    _gpu_or_skip()
    from foxhunt.fast.kernels import optim as fast
    from foxhunt.fast.kernels._runtime import In, InOut, call
    from foxhunt.reference.kernels import optim as ref

    rng = np.random.default_rng(n + 3)
    y, x = _data(rng, n), _data(rng, n, 1e19)
    planned = fast.saxpy(y.copy(), x, 3.0)
    # the reference's values, NaN where it has NaN (a NaN y_i + finite gives the GPU's
    # canonical NaN, NumPy keeps the payload: SPEC 8 compares NaN positions)
    np.testing.assert_array_equal(planned, ref.saxpy(y.copy(), x, 3.0))
    grid, block, smem = fast.plan_saxpy(n)
    for g in _grids(grid):
        got = call("saxpy", g, block, InOut(y.copy()), In(x), n, F32(3.0), shared_mem=smem)
        assert _same(got, (planned,)), f"grid {g} of {grid}"
