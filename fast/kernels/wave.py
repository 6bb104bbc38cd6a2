"""Fast launchers of the second-wave step plumbing (``cuda_src/wave.cu``), twins of
``foxhunt.reference.kernels.wave`` under the same names and signatures.

Each public function is a numpy-in/numpy-out test entry (conformance and debugging): it
validates with the reference's ``validate_<name>`` (same ``ValueError``), launches the CUDA
kernel once through ``_runtime.launch`` and returns what the reference returns. The step plan
launches the same kernels on arena pointers with ``plan_single`` (one thread: a handful of
scalars). Exact: each kernel rounds where its reference does.

``clip_saxpy_norm_partial_wave`` (its CUDA kernel in ``optim.cu``) launches as
``clip_saxpy_norm_partial`` does (``plan_clip_saxpy_norm_partial_wave``: one block per segment;
the blocks stride over the segments, so any smaller grid gives the same outputs).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, InOut, Out, call, launch
from foxhunt.fast.kernels.optim import (
    final_threads_clip_saxpy_norm_partial,
    plan_clip_saxpy_norm_partial,
)
from foxhunt.reference.kernels.wave import (
    WaveBudget,
    validate_clip_saxpy_norm_partial_wave,
    validate_mse_loss_blend,
    validate_source_norm_scalars,
    validate_step_count_advance,
)

Plan = tuple[int, int, int]
F32 = np.float32


def plan_single() -> Plan:
    """One block of one thread."""
    return 1, 1, 0


def step_count_advance(step_count) -> np.ndarray:
    """Test entry of the CUDA ``step_count_advance`` (contract as the reference twin)."""
    validate_step_count_advance(step_count)
    (out,) = launch("step_count_advance", plan_single(), InOut(step_count))
    return out


def source_norm_scalars(norm_sq, readback, budget, pre_index, post_index) -> np.ndarray:
    """Test entry of the CUDA ``source_norm_scalars`` (contract as the reference twin)."""
    budget, pre, post = validate_source_norm_scalars(norm_sq, readback, budget, pre_index,
                                                     post_index)
    (out,) = launch("source_norm_scalars", plan_single(), In(norm_sq), InOut(readback), budget,
                    pre, post)
    return out


def mse_loss_blend(readback, c51_index, mse_loss_index, mse_weight_index) -> np.ndarray:
    """Test entry of the CUDA ``mse_loss_blend`` (contract as the reference twin)."""
    c51, mse, weight = validate_mse_loss_blend(readback, c51_index, mse_loss_index,
                                               mse_weight_index)
    (out,) = launch("mse_loss_blend", plan_single(), InOut(readback), c51, mse, weight)
    return out


#: ``clip_saxpy_norm_partial``'s launch and ``final_threads``: the same segments and trees, so
#: the same bits for the elements and norms the two kernels share.
plan_clip_saxpy_norm_partial_wave = plan_clip_saxpy_norm_partial
final_threads_clip_saxpy_norm_partial_wave = final_threads_clip_saxpy_norm_partial


def clip_saxpy_norm_partial_wave(base, inject, base_max_norm, base_partials, a, inject_max_norm,
                                 inject_partials, iqn, iqn_a, iqn_max_norm, iqn_partials, ens,
                                 ens_a, ens_max_norm, ens_partials, block_size) -> WaveBudget:
    """Test entry of the CUDA ``clip_saxpy_norm_partial_wave`` (contract as the reference twin;
    a source that is off goes as null pointers with ``n = 0``)."""
    core, (iqn_a, iqn_max), (ens_a, ens_max) = validate_clip_saxpy_norm_partial_wave(
        base, inject, base_max_norm, base_partials, a, inject_max_norm, inject_partials, iqn,
        iqn_a, iqn_max_norm, iqn_partials, ens, ens_a, ens_max_norm, ens_partials, block_size)
    n, count = base.shape[0], base_partials.shape[0]
    bs = min(core.block_size, max(n, 1))  # as clip_saxpy_norm_partial's entry: same segments
    grid, block, smem = plan_clip_saxpy_norm_partial_wave(n, bs)

    def source(x, parts):
        return (0, 0, 0, 0) if x is None else (In(x), x.shape[0], In(parts), Out((1,), F32))

    iqn_x, iqn_n, iqn_p, iqn_sq = source(iqn, iqn_partials)
    ens_x, ens_n, ens_p, ens_sq = source(ens, ens_partials)
    outs = call("clip_saxpy_norm_partial_wave", grid, block, In(base), In(inject), n,
                core.base_max_norm, In(base_partials), core.a, core.inject_max_norm,
                In(inject_partials), iqn_x, iqn_n, iqn_a, iqn_max, iqn_p, ens_x, ens_n, ens_a,
                ens_max, ens_p, count, final_threads_clip_saxpy_norm_partial_wave(count), bs,
                Out((n,), F32), Out((-(-n // bs),), F32), Out((1,), F32), Out((1,), F32), iqn_sq,
                ens_sq, shared_mem=smem)
    out, partials, base_sq, inject_sq = outs[:4]
    rest = iter(outs[4:])
    iqn_norm = F32(0) if iqn is None else F32(next(rest)[0])
    ens_norm = F32(0) if ens is None else F32(next(rest)[0])
    return WaveBudget(out=out, partials=partials, base_norm_sq=F32(base_sq[0]),
                      inject_norm_sq=F32(inject_sq[0]), iqn_norm_sq=iqn_norm,
                      ens_norm_sq=ens_norm)


KERNELS = {
    "step_count_advance": step_count_advance,
    "source_norm_scalars": source_norm_scalars,
    "mse_loss_blend": mse_loss_blend,
    "clip_saxpy_norm_partial_wave": clip_saxpy_norm_partial_wave,
}
