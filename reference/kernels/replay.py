"""Prioritised-replay kernels (SPEC 10: proportional sampling by prefix sums and binary search,
importance weights; Schaul et al. 2016).

Priorities are data: the kernels define what happens for zero, NaN or Inf priorities and for
out-of-range uniforms instead of raising; only shapes, dtypes, configuration scalars and indices
that would read outside the buffer raise ``ValueError``.
"""

from __future__ import annotations

import numpy as np

from foxhunt.reference.kernels.argcheck import (
    check_array,
    check_f32_array,
    check_f32_scalar,
    check_int,
)


# ---------------------------------------------------------------------------------------------
# Validation shared with the fast test entries (foxhunt.fast.kernels.replay)
# ---------------------------------------------------------------------------------------------


def validate_sample_proportional(prefix, u) -> int:
    """The argument checks of ``sample_proportional``; returns the item count N."""
    check_f32_array("prefix", prefix, ndim=1)
    check_f32_array("u", u, ndim=1)
    n_items = prefix.shape[0]
    if n_items == 0:
        raise ValueError("prefix: shape (0,) is empty; need at least one item to sample")
    return n_items


def validate_importance_weights(priorities, idx, beta, n_valid) -> tuple[np.float32, int]:
    """The argument checks of ``importance_weights``; returns ``(beta, n_valid)`` as float32 and
    int."""
    check_f32_array("priorities", priorities, ndim=1)
    check_array("idx", idx, np.int32, ndim=1)
    capacity = priorities.shape[0]
    if capacity == 0:
        raise ValueError("priorities: shape (0,) is empty; need at least one item")
    n = check_int("n_valid", n_valid, minimum=1, maximum=capacity)
    beta32 = check_f32_scalar("beta", beta, lo=0.0, hi=1.0)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError(f"idx: values in [{idx.min()}, {idx.max()}] not allowed; every index "
                         f"must lie in [0, n_valid={n})")
    return beta32, n


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


def prefix_sum(p: np.ndarray) -> np.ndarray:
    """Inclusive prefix sums ``s_i = p_0 + ... + p_i`` in float32.

    Accumulation order: sequential, left to right, one float32 rounding per addition
    (``s_i = fl(s_{i-1} + p_i)``). The fast scan associates differently; for non-negative
    priorities both are within ``gamma_i * s_i`` (``gamma_i = i u / (1 - i u)``, ``u = 2^-24``)
    of the exact prefix sum.

    Shapes: ``p`` float32[N] (N >= 0). Returns float32[N].
    NaN contract: plain sums; a NaN (or +Inf) priority makes every later prefix NaN (or +Inf).
    """
    check_f32_array("p", p, ndim=1)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.cumsum(p, dtype=np.float32)


def sample_proportional(prefix: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Proportional sampling: index ``i`` with probability ``p_i / total``.

    ``target = u_k * total`` (float32, ``total = prefix[N-1]``); the sample is the first ``i``
    with ``prefix[i] > target``, found by the binary search::

        lo, hi = 0, N - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if prefix[mid] > target: hi = mid
            else:                     lo = mid + 1

    which returns ``N - 1`` when no prefix exceeds the target (the clamp to ``N - 1``).

    Shapes: ``prefix`` float32[N], N >= 1 (from ``prefix_sum``); ``u`` float32[n] uniforms in
    [0, 1). Returns int32[n].

    Contract: an item with zero priority is never sampled while ``total > 0`` (its prefix equals
    the previous one, so an earlier index already exceeds the target; for ``i = 0``,
    ``prefix[0] = 0 > target`` is false). ``u < 1`` gives ``target < total`` in float32, so the
    clamp never fires for valid uniforms. Degenerate inputs, defined rather than raised:
    ``total = 0``, a NaN target (NaN ``u`` or NaN total) or ``u >= 1`` give ``N - 1`` (every
    comparison with NaN is false); ``u < 0`` gives the first index whose prefix exceeds the
    negative target (0 for non-negative priorities).
    """
    n_items = validate_sample_proportional(prefix, u)
    with np.errstate(over="ignore", invalid="ignore"):
        target = u * prefix[-1]
    lo = np.zeros(u.shape, dtype=np.int64)
    hi = np.full(u.shape, n_items - 1, dtype=np.int64)
    active = lo < hi
    while np.any(active):
        mid = (lo + hi) // 2
        with np.errstate(invalid="ignore"):
            right_of_target = prefix[mid] > target
        hi = np.where(active & right_of_target, mid, hi)
        lo = np.where(active & ~right_of_target, mid + 1, lo)
        active = lo < hi
    return lo.astype(np.int32)


def importance_weights(priorities: np.ndarray, idx: np.ndarray, beta: float,
                       n_valid: int) -> np.ndarray:
    """PER importance weights ``w_k = (N P(i_k))^-beta / max_j (N P(i_j))^-beta``.

    ``P(i) = p_i / total``, ``N = n_valid``. Normalisation choice: by the maximum over the
    *sampled batch* (not over the whole buffer, which would need a second reduction over all
    N priorities each step), so the largest weight of every batch is exactly 1 and all weights
    lie in (0, 1] (for positive priorities). Since ``x^-beta`` decreases, the batch maximum is at
    the smallest sampled priority, and ``N`` and ``total`` cancel exactly::

        w_k = (p_min / p_{i_k}) ^ beta,   p_min = fminf-reduce_k p_{i_k}

    which is what the kernel computes in float32 (one division, one ``powf`` per sample): no
    dependency on the total, and no overflow of ``(N P)^-beta`` for tiny probabilities.

    Shapes: ``priorities`` float32[capacity]; ``idx`` int32[n] with ``0 <= idx < n_valid``
    (raise otherwise: the kernel would read outside the valid items); ``beta`` in [0, 1];
    ``n_valid`` an int in [1, capacity]. Returns float32[n].

    NaN contract: ``beta = 0`` gives exactly 1 everywhere (``powf(x, 0) = 1``). ``p_min`` is an
    ``fminf`` reduction, so a NaN priority only affects its own weight (NaN). A sampled zero
    priority (only when the whole buffer has total 0) gives ``0/0 = NaN`` for itself and weight
    0 for the others, as the unsimplified formula does (Inf / Inf and x / Inf).
    """
    beta32, _ = validate_importance_weights(priorities, idx, beta, n_valid)
    p = priorities[idx]
    if p.size == 0:
        return np.zeros(0, dtype=np.float32)
    p_min = np.fmin.reduce(p)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return np.power(p_min / p, beta32).astype(np.float32, copy=False)


KERNELS = {
    "prefix_sum": prefix_sum,
    "sample_proportional": sample_proportional,
    "importance_weights": importance_weights,
}

__all__ = [
    "KERNELS", "importance_weights", "prefix_sum", "sample_proportional",
    "validate_importance_weights", "validate_sample_proportional",
]
