"""Reference kernels of the second-wave step plumbing (``cuda_src/wave.cu``): the values the
fast step's graphs keep on the device between the second-wave sources' kernels, which the
reference ``Trainer`` computes on the host between its calls (SPEC 4 second wave; issue 18).

``step_count_advance``   the trainer's step counter + 1 (the IQN quantile fractions' offset)
``source_norm_scalars``  a budget source's norm before and after its clip, into the readback
``mse_loss_blend``       the reported C51 loss blended with the MSE warm-up loss
``clip_saxpy_norm_partial_wave``  the budget pipeline with the IQN and ensemble injections in
                         one pass (its CUDA kernel lives in ``optim.cu``, beside the core's
                         ``clip_saxpy_norm_partial`` whose element loop it shares)

Each is the plain-NumPy twin of the CUDA kernel of the same name, in the kernel's float32
order (``-fmad=false``: every product and sum rounded on its own).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foxhunt.reference.kernels import optim
from foxhunt.reference.kernels.argcheck import (
    check_f32_array,
    check_f32_scalar,
    check_int,
    require_array,
)

F32 = np.float32
I64 = np.int64


# --------------------------------------------------------------------------------------------
# The step counter
# --------------------------------------------------------------------------------------------


def validate_step_count_advance(step_count) -> int:
    """The argument checks of ``step_count_advance``; returns the count."""
    require_array("step_count", step_count, I64, ndim=1)
    if step_count.shape != (1,) or not 0 <= step_count[0] < np.iinfo(I64).max:
        raise ValueError(f"step_count: {step_count!r}; expected int64 [1] holding a count in "
                         f"[0, 2**63 - 1)")
    return int(step_count[0])


def step_count_advance(step_count: np.ndarray) -> np.ndarray:
    """``step_count + 1`` (int64 [1]): the trainer's total step count (0-based before a step,
    never reset; ``state_dict["step"]``), advanced once per step after the IQN head's
    ``iqn_tau_cos`` launches read it as their generator offset. Exact."""
    return np.array([validate_step_count_advance(step_count) + 1], I64)


# --------------------------------------------------------------------------------------------
# Norms and losses of the readback block
# --------------------------------------------------------------------------------------------


def _check_readback(readback, **indices) -> tuple[int, ...]:
    check_f32_array("readback", readback, ndim=1)
    return tuple(check_int(name, value, minimum=0, maximum=readback.shape[0] - 1)
                 for name, value in indices.items())


def validate_source_norm_scalars(norm_sq, readback, budget, pre_index, post_index):
    """The argument checks of ``source_norm_scalars``; returns ``(budget, pre_index,
    post_index)``."""
    check_f32_array("norm_sq", norm_sq, ndim=1)
    if norm_sq.shape != (1,):
        raise ValueError(f"norm_sq: shape {norm_sq.shape}; expected [1]")
    pre, post = _check_readback(readback, pre_index=pre_index, post_index=post_index)
    if pre == post:
        raise ValueError(f"pre_index={pre_index!r} and post_index={post_index!r}: must differ")
    return check_f32_scalar("budget", budget, lo=0.0), pre, post


def source_norm_scalars(norm_sq: np.ndarray, readback: np.ndarray, budget, pre_index: int,
                        post_index: int) -> np.ndarray:
    """A budget source's norms into the readback block (``budgets.second_wave_budgets``' norms):
    ``n = sqrtf(fmaxf(norm_sq[0], 0))`` (``optim.norm_from_sq``), ``s = clip_scale(norm_sq[0],
    budget)`` (``optim.clip_scale``), then ``readback[pre_index] = n`` and
    ``readback[post_index] = s == 0 ? 0 : n * s`` (a discarded, overflowed source reads 0, not
    ``Inf * 0``).

    Shapes: ``norm_sq`` float32 [1] (the source's squared norm over its range); ``readback``
    float32 [L]; ``budget`` finite >= 0. Returns the new readback block (float32 [L]); the other
    entries are copied. NaN contract: ``clip_scale``'s (a NaN ``norm_sq`` gives ``n = 0``,
    ``s = 1``; +Inf gives ``n = +Inf``, ``s = 0``).
    """
    budget, pre, post = validate_source_norm_scalars(norm_sq, readback, budget, pre_index,
                                                     post_index)
    n = optim.norm_from_sq(norm_sq[0])
    s = optim.clip_scale(norm_sq[0], budget)
    out = readback.copy()
    out[pre] = n
    out[post] = F32(0) if s == F32(0) else F32(n * s)
    return out


def validate_mse_loss_blend(readback, c51_index, mse_loss_index, mse_weight_index):
    """The argument checks of ``mse_loss_blend``; returns the three indices."""
    indices = _check_readback(readback, c51_index=c51_index, mse_loss_index=mse_loss_index,
                              mse_weight_index=mse_weight_index)
    if len(set(indices)) != 3:
        raise ValueError(f"c51_index, mse_loss_index, mse_weight_index = {indices}: must differ")
    return indices


def mse_loss_blend(readback: np.ndarray, c51_index: int, mse_loss_index: int,
                   mse_weight_index: int) -> np.ndarray:
    """The reported C51 loss during the MSE warm-up: with ``w = readback[mse_weight_index]``,
    ``c = readback[c51_index]``, ``e = readback[mse_loss_index]``,
    ``readback[c51_index] = w > 0 ? (1 - w) * c + w * e : c`` (``step.loss_and_grads``' blend,
    each product and the sum rounded to float32; ``w == 0`` leaves the C51 loss untouched, bit
    for bit).

    Shapes: ``readback`` float32 [L]. Returns the new readback block (float32 [L]). NaN
    contract: IEEE (a NaN loss gives NaN; a NaN ``w`` is not ``> 0``: untouched).
    """
    c51, mse, weight = validate_mse_loss_blend(readback, c51_index, mse_loss_index,
                                               mse_weight_index)
    out = readback.copy()
    w = readback[weight]
    if w > F32(0):
        with np.errstate(all="ignore"):
            out[c51] = F32(F32(F32(1) - w) * readback[c51] + F32(w * readback[mse]))
    return out


# --------------------------------------------------------------------------------------------
# The budget pipeline in one pass
# --------------------------------------------------------------------------------------------


class WaveBudget(NamedTuple):
    """``clip_saxpy_norm_partial_wave`` outputs: the budgeted gradient, its norm partials and
    each source's squared norm (float32; 0 for a source that is off)."""

    out: np.ndarray
    partials: np.ndarray
    base_norm_sq: np.float32
    inject_norm_sq: np.float32
    iqn_norm_sq: np.float32
    ens_norm_sq: np.float32


def _check_source(name: str, x, partials, a, max_norm, n: int, count: int):
    """A second-wave source's checks; returns ``(a, max_norm)`` in float32 (0, 0 when off)."""
    if x is None or partials is None:
        if x is not None or partials is not None:
            raise ValueError(f"{name}, {name}_partials: give both (source on) or neither (off)")
        return F32(0), F32(0)
    check_f32_array(name, x, ndim=1)
    if x.shape[0] > n:
        raise ValueError(f"{name}: length {x.shape[0]}; expected at most len(base) = {n}")
    check_f32_array(f"{name}_partials", partials, ndim=1)
    if partials.shape[0] != count:
        raise ValueError(f"{name}_partials: length {partials.shape[0]}; expected "
                         f"len(base_partials) = {count}")
    return (check_f32_scalar(f"{name}_a", a),
            check_f32_scalar(f"{name}_max_norm", max_norm, lo=0.0))


def validate_clip_saxpy_norm_partial_wave(base, inject, base_max_norm, base_partials, a,
                                          inject_max_norm, inject_partials, iqn, iqn_a,
                                          iqn_max_norm, iqn_partials, ens, ens_a, ens_max_norm,
                                          ens_partials, block_size):
    """The argument checks of ``clip_saxpy_norm_partial_wave`` (``clip_saxpy_norm_partial``'s,
    then each source's); returns ``(ClipSaxpyArgs, (iqn_a, iqn_max_norm), (ens_a,
    ens_max_norm))`` in float32."""
    core = optim.validate_clip_saxpy_norm_partial(base, inject, base_max_norm, base_partials, a,
                                                  inject_max_norm, inject_partials, block_size)
    n, count = base.shape[0], base_partials.shape[0]
    return (core, _check_source("iqn", iqn, iqn_partials, iqn_a, iqn_max_norm, n, count),
            _check_source("ens", ens, ens_partials, ens_a, ens_max_norm, n, count))


def clip_saxpy_norm_partial_wave(base: np.ndarray, inject: np.ndarray, base_max_norm,
                                 base_partials: np.ndarray, a, inject_max_norm,
                                 inject_partials: np.ndarray, iqn: np.ndarray | None, iqn_a,
                                 iqn_max_norm, iqn_partials: np.ndarray | None,
                                 ens: np.ndarray | None, ens_a, ens_max_norm,
                                 ens_partials: np.ndarray | None, block_size: int) -> WaveBudget:
    """The budget pipeline of SPEC 4 step 5 with the second-wave sources, in one pass (graph 1's
    last budget launch with IQN or the ensemble on). The composition, in this order::

        core     = optim.clip_saxpy_norm_partial(base, inject, base_max_norm, base_partials, a,
                                                 inject_max_norm, inject_partials, block_size)
        out      = core.out
        out[:len(iqn)] = clipped_saxpy(out[:len(iqn)], iqn, iqn_a, iqn_max_norm,
                                       grad_norm_final(iqn_partials))          # IQN on
        out[:len(ens)] = clipped_saxpy(out[:len(ens)], ens, ens_a, ens_max_norm,
                                       grad_norm_final(ens_partials))          # ensemble on
        partials = grad_norm_partial(out, block_size)

    In the step: ``base``/``inject`` the C51 and CQL gradients (``budgets.budget_pipeline``),
    ``iqn`` the sanitised IQN trunk gradient over ``[0, trunk_end)`` (``a = lambda_iqn``,
    budget ``0.10 mgn``), ``ens`` the ensemble's over ``[0, value_end)`` (``a = ens_weight``,
    budget ``0.05 mgn``): ``budgets.second_wave_budgets``' SAXPYs, each norm the
    ``grad_norm_final`` of its phase-1 partials (the fast step's ``grad_norm_partial`` over the
    source's range, zero-padded to ``count``).

    Per element: ``clip_saxpy_norm_partial``'s ``out_i``, then ``out_i + iqn_a * (iqn_i *
    s_iqn)`` for ``i < len(iqn)`` where ``iqn_i`` is finite, then the same with ``ens``
    (``s_src = clip_scale(src_norm_sq, src_max_norm)``; every product and sum rounded to
    float32 in that order). Elements past a source's range are not touched by it.

    Shapes: ``base``, ``inject`` float32[N]; ``base_partials``, ``inject_partials`` float32[P];
    a source that is on: its vector float32[N_src] (``N_src <= N``) and its partials
    float32[P]; a source that is off: both ``None`` (its ``a`` and ``max_norm`` ignored; norm 0).
    ``a``'s finite, ``max_norm``'s finite >= 0, ``block_size >= 1``. Returns ``WaveBudget(out
    float32[N], partials float32[ceil(N / block_size)], base_norm_sq, inject_norm_sq,
    iqn_norm_sq, ens_norm_sq)``; the inputs are not modified.

    NaN contract: ``clip_saxpy_norm_partial``'s, and for each source ``clipped_saxpy``'s: a
    non-finite source element is skipped; a NaN norm gives scale 1, a +Inf norm scale 0 (the
    source discarded); ``partials`` skip the non-finite ``out_i``.
    """
    _, (iqn_a, iqn_max), (ens_a, ens_max) = validate_clip_saxpy_norm_partial_wave(
        base, inject, base_max_norm, base_partials, a, inject_max_norm, inject_partials, iqn,
        iqn_a, iqn_max_norm, iqn_partials, ens, ens_a, ens_max_norm, ens_partials, block_size)
    core = optim.clip_saxpy_norm_partial(base, inject, base_max_norm, base_partials, a,
                                         inject_max_norm, inject_partials, block_size)
    out = core.out
    sq = {}
    for name, x, parts, w, mx in (("iqn", iqn, iqn_partials, iqn_a, iqn_max),
                                  ("ens", ens, ens_partials, ens_a, ens_max)):
        if x is None:
            sq[name] = F32(0)
            continue
        sq[name] = optim.grad_norm_final(parts)
        end = x.shape[0]
        out[:end] = optim.clipped_saxpy(out[:end], x, w, mx, sq[name])
    return WaveBudget(out=out, partials=optim.grad_norm_partial(out, block_size),
                      base_norm_sq=core.base_norm_sq, inject_norm_sq=core.inject_norm_sq,
                      iqn_norm_sq=sq["iqn"], ens_norm_sq=sq["ens"])


KERNELS = {
    "step_count_advance": step_count_advance,
    "source_norm_scalars": source_norm_scalars,
    "mse_loss_blend": mse_loss_blend,
    "clip_saxpy_norm_partial_wave": clip_saxpy_norm_partial_wave,
}

__all__ = [
    "KERNELS", "WaveBudget", "clip_saxpy_norm_partial_wave", "mse_loss_blend",
    "source_norm_scalars", "step_count_advance", "validate_clip_saxpy_norm_partial_wave",
    "validate_mse_loss_blend", "validate_source_norm_scalars", "validate_step_count_advance",
]
