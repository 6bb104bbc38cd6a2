"""Reference kernels of the second-wave step plumbing (``cuda_src/wave.cu``): the values the
fast step's graphs keep on the device between the second-wave sources' kernels, which the
reference ``Trainer`` computes on the host between its calls (SPEC 4 second wave; issue 18).

``step_count_advance``   the trainer's step counter + 1 (the IQN quantile fractions' offset)
``source_norm_scalars``  a budget source's norm before and after its clip, into the readback
``mse_loss_blend``       the reported C51 loss blended with the MSE warm-up loss

Each is the plain-NumPy twin of the CUDA kernel of the same name, in the kernel's float32
order (``-fmad=false``: every product and sum rounded on its own).
"""

from __future__ import annotations

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


KERNELS = {
    "step_count_advance": step_count_advance,
    "source_norm_scalars": source_norm_scalars,
    "mse_loss_blend": mse_loss_blend,
}

__all__ = [
    "KERNELS", "mse_loss_blend", "source_norm_scalars", "step_count_advance",
    "validate_mse_loss_blend", "validate_source_norm_scalars", "validate_step_count_advance",
]
