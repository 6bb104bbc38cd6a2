"""Gradient isolation with norm budgets (SPEC 4 step 5) and Mech 6's anchored safety clip.

::

    grad = clip(grad_c51, 0.70 mgn)                       # clip_grad_inplace     budget_pipeline
    grad += clipped(grad_cql, 0.15 mgn)                   # clipped_saxpy (isfinite-guarded)
    grad[0:trunk_end] += lambda_iqn * clipped(iqn, 0.10 mgn)   # IQN on        second_wave_budgets
    grad[0:value_end] += ens_weight * clipped(ens, 0.05 mgn)   # ensemble on

``iqn`` / ``ens`` are the sanitised trunk gradients of the IQN head and of the ensemble
diversity loss (their own scratch buffers, flat and layout-sized; only the trunk, resp. trunk
and value head, ranges are read). Each budget is ``fraction * max_grad_norm`` and the
fractions sum to 1, so with source weights <= 1 the finite part of the result has norm
``<= max_grad_norm`` (triangle inequality) and Adam's safety clip never fires from these
sources alone. A weight above 1 can exceed it: Mech 6's safety clip is the backstop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import DQNConfig
from .kernels import optim
from .layout import ParamLayout


@dataclass(frozen=True)
class BudgetNorms:
    """L2 norms of each source before and after its budget clip, and the squared norms the
    clips used (``optim.grad_norm_sq``), all float32."""

    c51_pre: np.float32
    c51_post: np.float32
    cql_pre: np.float32
    cql_post: np.float32
    c51_sq: np.float32
    cql_sq: np.float32


def budget_pipeline(config: DQNConfig, grad_c51: np.ndarray, grad_cql: np.ndarray
                    ) -> tuple[np.ndarray, BudgetNorms]:
    """The combined gradient and the per-source norms; inputs are not modified."""
    c51_sq = optim.grad_norm_sq(grad_c51)
    cql_sq = optim.grad_norm_sq(grad_cql)
    b_c51, b_cql = np.float32(config.budget("c51")), np.float32(config.budget("cql"))
    grad = optim.clip_grad_inplace(grad_c51, b_c51, c51_sq)
    grad = optim.clipped_saxpy(grad, grad_cql, np.float32(1), b_cql, cql_sq)
    n_c51, n_cql = optim.norm_from_sq(c51_sq), optim.norm_from_sq(cql_sq)
    norms = BudgetNorms(c51_pre=n_c51, c51_post=_post_clip_norm(n_c51, c51_sq, b_c51),
                        cql_pre=n_cql, cql_post=_post_clip_norm(n_cql, cql_sq, b_cql),
                        c51_sq=c51_sq, cql_sq=cql_sq)
    return grad, norms


def _post_clip_norm(norm: np.float32, norm_sq: np.float32, budget: np.float32) -> np.float32:
    """``norm * scale``; a component whose norm overflowed is discarded (scale 0): its post-clip
    norm is 0, not ``inf * 0`` (``kernels.step.step_scalars`` reports ``inf * 0 = NaN`` there,
    so the reference ``Trainer`` reports these two values from here)."""
    scale = optim.clip_scale(norm_sq, budget)
    return np.float32(0) if scale == 0 else np.float32(norm * scale)


@dataclass(frozen=True)
class SourceNorms:
    """The second-wave sources' norms before and after their budget clips (float32; all 0 for a
    source that is off). A post-clip norm is the clipped buffer's norm, before the source's
    weight multiplies it; an overflowed source is discarded (post-clip norm 0)."""

    iqn_pre: np.float32 = np.float32(0)
    iqn_post: np.float32 = np.float32(0)
    ens_pre: np.float32 = np.float32(0)
    ens_post: np.float32 = np.float32(0)


def second_wave_budgets(config: DQNConfig, layout: ParamLayout, grad: np.ndarray, *,
                        iqn_trunk: np.ndarray | None = None,
                        ens_trunk: np.ndarray | None = None) -> tuple[np.ndarray, SourceNorms]:
    """``budget_pipeline``'s output ``grad`` with the IQN and ensemble sources injected (module
    docstring): ``iqn_trunk`` over ``[0, trunk_end)`` with weight ``lambda_iqn`` and budget
    ``budgets[iqn] * mgn``, ``ens_trunk`` over ``[0, value_end)`` with ``ens_weight`` and
    ``budgets[ens] * mgn``; each norm is taken over its range, each SAXPY skips non-finite
    elements. A source is given iff its weight is > 0 (``ValueError`` otherwise: a missing
    source would be a silent no-op). ``grad`` is not modified; with neither source the result
    is ``grad`` itself."""
    norms: dict[str, np.float32] = {}
    out = grad
    for name, buf, weight, end in (("iqn", iqn_trunk, config.lambda_iqn, layout.trunk_end),
                                   ("ens", ens_trunk, config.ens_weight, layout.value_end)):
        if (buf is not None) != (weight > 0):
            field = "lambda_iqn" if name == "iqn" else "ens_weight"
            raise ValueError(f"second_wave_budgets: {name} trunk gradient "
                             f"{'given' if buf is not None else 'missing'} with {field}={weight!r}")
        if buf is None:
            continue
        layout.check_buffer(buf, f"{name}_trunk")
        sq = optim.grad_norm_sq(buf[:end])
        budget = np.float32(config.budget(name))
        if out is grad:
            out = grad.copy()
        out[:end] = optim.clipped_saxpy(out[:end], buf[:end], np.float32(weight), budget, sq)
        n = optim.norm_from_sq(sq)
        norms[f"{name}_pre"], norms[f"{name}_post"] = n, _post_clip_norm(n, sq, budget)
    return out, SourceNorms(**norms)
