"""Gradient isolation with norm budgets (SPEC 4 step 5) and Mech 6's anchored safety clip.

::

    grad = clip(grad_c51, 0.70 mgn)                       # clip_grad_inplace
    grad += clipped(grad_cql, 0.15 mgn)                   # clipped_saxpy (isfinite-guarded)
    (IQN 0.10 and ensemble 0.05 sources: not implemented yet; their budgets stay unused)

Each budget is ``fraction * max_grad_norm`` and the fractions sum to 1, so the finite part of
the result has norm ``<= max_grad_norm`` (triangle inequality) and Adam's safety clip never
fires when these are the only sources.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import DQNConfig
from .kernels import optim


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
