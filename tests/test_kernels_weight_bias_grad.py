"""``gemm_tf32_bias_grad``: a layer's TF32 weight gradient ``dw = dy^T @ x`` and its bias gradient
``db = colsum(dy)`` in one launch (``cuda_src/dense.cu``), and the step's plan with it
(``step_program.FUSE_WEIGHT_BIAS_GRAD``, off by default).

On the CPU: the reference twin against an independent oracle (float64 products of the TF32-rounded
operands as torch computes them, float64 column sums; the NaN contract with hypothesis), its
one-line argument errors, the plan's shape, and the CPU executor's steps with the switch on bit for
bit those with it off (the twin composes ``gemm_tf32`` and ``bias_grad_reduce``, the launches it
replaces). On a GPU: the kernel bit for bit ``gemm_tf32`` then ``bias_grad_reduce`` on the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from cpu_step_runs import assert_runs_bitwise_equal, launch_count, step_run
from hypothesis import given, settings
from hypothesis import strategies as st

from foxhunt.fast import step_program
from foxhunt.fast.device import cuda_available
from foxhunt.fast.kernels import dense as fast_dense
from foxhunt.reference.config import DQNConfig, source_overrides
from foxhunt.reference.kernels import dense

F32 = np.float32


def _draw(rng, k: int, m: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    return (rng.standard_normal((k, m)).astype(F32),
            (rng.standard_normal((k, n)) / np.sqrt(k)).astype(F32))


@pytest.mark.parametrize("k, m, n", [(256, 51, 128), (256, 128, 256), (7, 3, 5), (1, 1, 1)])
def test_the_twin_is_the_tf32_product_and_the_column_sums(k, m, n):
    """Independent of the reference's ``gemm``: torch's float64 product of the TF32-rounded
    operands, float64 column sums; ``dw`` within float32 accumulation's error of it, ``db``
    within the reduction's."""
    import torch

    dy, x = _draw(np.random.default_rng(k + m + n), k, m, n)
    got = dense.gemm_tf32_bias_grad(dy, x)
    assert got.dw.shape == (m, n) and got.db.shape == (m,)
    assert got.dw.dtype == F32 and got.db.dtype == F32
    t = lambda a: torch.from_numpy(dense.tf32_round(a).astype(np.float64))  # noqa: E731
    want = (t(dy).T @ t(x)).numpy()
    scale = np.abs(dense.tf32_round(dy)).astype(np.float64).T @ np.abs(dense.tf32_round(x))
    assert np.all(np.abs(got.dw - want) <= 4 * k * np.finfo(F32).eps * scale + 1e-30)
    sums = torch.from_numpy(dy.astype(np.float64)).sum(0).numpy()
    assert np.all(np.abs(got.db - sums) <= 2 * k * np.finfo(F32).eps * np.abs(dy).sum(0))


_special = st.sampled_from([np.nan, np.inf, -np.inf])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), row=st.integers(0, 15), col=st.integers(0, 5),
       special=_special, where=st.sampled_from(["dy", "x"]))
def test_a_non_finite_value_reaches_its_row_or_column_only(seed, row, col, special, where):
    """``dy[i, j]`` non-finite: ``db[j]`` and ``dw[j, :]`` non-finite (``+/-Inf * x`` of either
    sign, or NaN), every other column of ``db`` and row of ``dw`` bit for bit the clean run's;
    ``x[i, l]``: ``dw[:, l]`` non-finite, ``db`` and the other columns of ``dw`` unchanged."""
    rng = np.random.default_rng(seed)
    dy, x = _draw(rng, 16, 6, 6)
    clean = dense.gemm_tf32_bias_grad(dy, x)
    (dy if where == "dy" else x)[row, col] = special
    got = dense.gemm_tf32_bias_grad(dy, x)
    bits = lambda a: a.view(np.uint32)  # noqa: E731
    if where == "dy":
        assert not np.isfinite(got.db[col]) and not np.isfinite(got.dw[col]).any()
        keep = np.arange(6) != col
        assert np.array_equal(bits(got.db[keep]), bits(clean.db[keep]))
        assert np.array_equal(bits(got.dw[keep]), bits(clean.dw[keep]))
    else:
        assert not np.isfinite(got.dw[:, col]).any()
        assert np.array_equal(bits(got.db), bits(clean.db))
        keep = np.arange(6) != col
        assert np.array_equal(bits(got.dw[:, keep]), bits(clean.dw[:, keep]))


def test_it_is_the_composition_of_the_two_kernels_it_replaces():
    dy, x = _draw(np.random.default_rng(3), 40, 9, 12)
    dy[5, 2] = np.nan
    got = dense.gemm_tf32_bias_grad(dy, x)
    assert got.dw.tobytes() == dense.gemm_tf32(dy, x, trans_a=True).tobytes()
    assert got.db.tobytes() == dense.bias_grad_reduce(dy).tobytes()


@pytest.mark.parametrize("bad, exc, message", [
    (lambda dy, x: (dy, x[:-1]), ValueError,
     r"^x: shape \(7, 5\) but dy is \[8, 3\]; expected \[K, N\] with K = 8 \(the rows of dy\)$"),
    (lambda dy, x: (dy.astype(np.float64), x), ValueError,
     r"^dy: dtype float64 is not allowed; expected float32$"),
    (lambda dy, x: (dy, x.astype(np.float16)), ValueError,
     r"^x: dtype float16 is not allowed; expected float32$"),
    (lambda dy, x: (dy[0], x), ValueError, r"^dy: "),
])
def test_bad_arguments_are_one_line_errors_naming_the_field(bad, exc, message):
    dy, x = _draw(np.random.default_rng(0), 8, 3, 5)
    with pytest.raises(exc, match=message) as info:
        dense.gemm_tf32_bias_grad(*bad(dy, x))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("m, n, k", [(51, 128, 256), (128, 256, 256), (256, 128, 256), (8, 128, 3)])
def test_the_plan_is_gemm_tf32s_with_room_for_the_bias_sums(m, n, k):
    grid, block, nbytes = fast_dense.plan_gemm_tf32_bias_grad(m, n, k)
    g_grid, g_block, g_bytes = fast_dense.plan_gemm_tf32(m, n, k, True)
    assert (grid, block) == (g_grid, g_block)
    width = block[0] // fast_dense.BIAS_GRAD_CHUNKS
    assert nbytes == max(g_bytes, 2 * fast_dense.BIAS_GRAD_CHUNKS * (width + 1) * 4)
    # the first column tile's blocks cover every column of dy (every bias) once
    tile_m = fast_dense.gemm_tf32_tile(m, n)[0]
    assert grid[1] * tile_m >= m > (grid[1] - 1) * tile_m


# ------------------------------------------------------------------------- the step's plan
def _config(precision: str, source: str, preset: str = "tiny"):
    return DQNConfig.preset(preset, precision=precision, **source_overrides(source))


def _graph1(config):
    from foxhunt.fast.cpu_executor import CpuTrainer

    trainer = CpuTrainer(config)
    try:
        return trainer._engine.plans["graph1"]
    finally:
        trainer.close()


@pytest.mark.parametrize("precision, source", [
    ("bf16", "core"), ("bf16", "all"), ("tf32", "core"), ("tf32", "all"), ("f32", "all")])
def test_the_switch_moves_each_bias_sum_into_its_weight_gradient(precision, source, monkeypatch):
    """With the switch on, every ``bias_grad_reduce`` the launch takes is gone, one launch per
    layer it fuses replaces a ``gemm_tf32``; f32's weight gradients are cuBLASLt's: no change."""
    config = _config(precision, source, "seed")
    off = _graph1(config)
    monkeypatch.setattr(step_program, "FUSE_WEIGHT_BIAS_GRAD", True)
    on = _graph1(config)
    fused = launch_count(on, "gemm_tf32_bias_grad")
    if precision == "f32":
        assert fused == 0 and len(on.nodes()) == len(off.nodes())
        return
    assert fused >= 8  # the heads' two layers in both passes, at least
    for kernel in ("bias_grad_reduce", "gemm_tf32"):
        assert launch_count(on, kernel) == launch_count(off, kernel) - fused
    assert len(on.nodes()) == len(off.nodes()) - fused


@pytest.mark.parametrize("precision, source, options", [
    ("bf16", "core", {}), ("bf16", "all", {}), ("tf32", "all", {}),
    ("bf16", "core", {"stacked_backward": True}), ("bf16", "core", {"fused_heads": True})],
    ids=["bf16-core", "bf16-all", "tf32-all", "bf16-stacked", "bf16-fused-heads"])
def test_on_the_cpu_executor_the_step_is_bitwise_the_two_launches(precision, source, options,
                                                                  monkeypatch):
    """The twin composes the launches it replaces, so the CPU executor's steps with the switch on
    and off end in the same bits (every state buffer, the step scalars, the TD errors and the
    greedy Q's); with the stacked backward (pairs: the unfused launches stay) too."""
    config = _config(precision, source)
    monkeypatch.setattr(step_program, "FUSE_WEIGHT_BIAS_GRAD", True)
    with_launch = step_run(config, options)
    monkeypatch.setattr(step_program, "FUSE_WEIGHT_BIAS_GRAD", False)
    assert_runs_bitwise_equal(config, step_run(config, options), with_launch)


def test_input_grad_without_a_bias_needs_a_weight_gradient_to_take_it():
    from foxhunt.fast.cpu_executor import CpuEngine
    from foxhunt.fast.records import Buf

    prog = CpuEngine(_config("bf16", "core")).program
    with pytest.raises(ValueError, match=r"^input_grad: relu=\(h, None, scratch\) needs then="):
        prog.input_grad(None, dy=Buf("a"), w=Buf("b"), dx=Buf("c"), rows=4, n_out=4, n_in=4,
                        relu=(Buf("h"), None, Buf("s")))


# --------------------------------------------------------------------------------- GPU
_GPU, _WHY = cuda_available()
gpu = pytest.mark.skipif(not _GPU, reason=f"no CUDA device/driver: {_WHY}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("k, m, n", [(256, 51, 128), (256, 128, 256), (256, 256, 128), (37, 19, 23)])
@pytest.mark.parametrize("poison", [False, True])
def test_the_kernel_is_the_two_gpu_launches_bit_for_bit(k, m, n, poison):
    """``dw`` bit for bit ``gemm_tf32``'s (the same tile code), ``db`` ``bias_grad_reduce``'s (the
    same chunks and order), every tile shape the plans pick; ``poison``: a NaN, an Inf and a huge
    term in three columns (the row-by-row re-sum)."""
    dy, x = _draw(np.random.default_rng(k * m + n), k, m, n)
    if poison:
        dy[3, 0], dy[k - 1, m // 2], dy[k // 2, m - 1] = np.nan, np.inf, F32(3e38)
    got = fast_dense.gemm_tf32_bias_grad(dy, x)
    nan_bits = lambda a: np.where(np.isnan(a), F32(np.nan), a).tobytes()  # noqa: E731
    assert nan_bits(got.dw) == nan_bits(fast_dense.gemm_tf32(dy, x, trans_a=True))
    assert nan_bits(got.db) == nan_bits(fast_dense.bias_grad_reduce(dy))
