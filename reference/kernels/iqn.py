"""Reference kernels of the IQN head (SPEC 4, second wave; issue 18 contract), twins of
``cuda_src/iqn.cu`` under the same names. The head's GEMMs and bias/ReLU epilogues are the dense
kernels' (``dense.gemm``, ``add_bias_relu``, ``bias_grad_reduce``); these four do the rest:

``iqn_tau_cos``            quantile fractions from the counter-based generator, cosine features
``iqn_modulate``           ``e = h2[m // N] * phi[m]`` (and its BF16 copy for the next GEMM)
``iqn_quantile_huber``     Mech 1-clipped quantile targets, quantile Huber loss, ``dq``
``iqn_modulate_backward``  ``d_h2`` (isfinite-guarded sum over quantiles) and ``d_phi_pre``

The head, for ``B`` samples, ``N`` quantile fractions each (``M = B N`` rows, row ``m = b N +
i``), ``K`` cosine features, trunk width ``H`` and ``A = sum(branches)`` actions::

    tau[m]    = uniform(seed, stream, step, m)                         [M]
    cos[m, k] = cos(pi k tau[m])                                       [M, K]
    phi       = relu(cos W_phi^T + b_phi)                              [M, H]
    e[m]      = h2[m // N] * phi[m]                                    [M, H]
    q         = e W_iq^T + b_iq                                        [M, A]   (branch d: columns
                                                                                 off_d .. off_d + n_d)

Every kernel is float32 in the CUDA kernel's order (``-fmad=false``: each product and sum
rounded on its own), except the cosine, which both compute in float64 and round once (below).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foxhunt.reference.kernels import dense, rng
from foxhunt.reference.kernels.argcheck import (
    check_f32_array,
    check_int,
    f32_scalar,
    ieee,
    require_array,
)
from foxhunt.reference.kernels.distributional import effective_gamma, validate_discount
from foxhunt.reference.kernels.fused import branch_offsets, require_branches
from foxhunt.reference.kernels.step import block_total

F32 = np.float32
I32 = np.int32
I64 = np.int64

#: Threads per block of ``iqn_quantile_huber`` (its loss total is ``step.block_total``'s tree
#: over that many threads, made by the cluster's block 0; ``IQN_LOSS_THREADS`` in ``iqn.cu``).
IQN_LOSS_THREADS = 256


def _require_rows(name: str, x: np.ndarray, rows: int, meaning: str) -> None:
    if x.shape[0] != rows:
        raise ValueError(f"{name}: shape {x.shape}; expected {rows} rows ({meaning})")


# --------------------------------------------------------------------------------------------
# Quantile fractions and cosine features
# --------------------------------------------------------------------------------------------


class TauCos(NamedTuple):
    """Outputs of ``iqn_tau_cos``: ``tau`` float32 [rows] and ``cosines`` float32 [rows, n_cos]."""

    tau: np.ndarray
    cosines: np.ndarray


def validate_iqn_tau_cos(step, key_lo, key_hi, stream, rows, n_cos) -> tuple[int, ...]:
    """The argument checks of ``iqn_tau_cos``; returns ``(offset, key_lo, key_hi, stream, rows,
    n_cos)`` with ``offset = step[0]``."""
    require_array("step", step, I64, ndim=1)
    if step.shape != (1,) or step[0] < 0:
        raise ValueError(f"step: {step!r}; expected int64 [1] holding the step count (>= 0), "
                         "the generator's offset")
    words = rng.validate_philox_uniform(0, key_lo, key_hi, stream, 0, 0)[1:4]
    rows = check_int("rows", rows, minimum=1, maximum=2**31 - 1)
    n_cos = check_int("n_cos", n_cos, minimum=1)
    if rows * n_cos >= 2**31:
        raise ValueError(f"rows * n_cos = {rows * n_cos}: must be below 2**31 (32-bit indices)")
    return (int(step[0]), *words, rows, n_cos)


def iqn_tau_cos(step: np.ndarray, key_lo: int, key_hi: int, stream: int, rows: int,
                n_cos: int) -> TauCos:
    """Quantile fractions and their cosine features:

    - ``tau[m] = rng.uniform(key, stream, step[0], m)`` (``key = key_hi << 32 | key_lo``: the
      run's seed; ``stream`` ``STREAMS["iqn_tau_online"]`` or ``["iqn_tau_target"]``; the offset
      is the trainer's step count before the step, read from device memory by the kernel);
    - ``cosines[m, k] = float32(cos(pi * (k * tau[m])))`` for ``k = 0 .. n_cos - 1``, the argument
      and the cosine in float64 (``k * tau`` is exact there, ``pi *`` one rounding), then one
      rounding to float32. CUDA's double ``cos`` and NumPy's differ by a few float64 ulp at most,
      so the float32 results agree except when the float64 value lies within those few ulp of a
      float32 rounding midpoint (about 1e-8 of values): at most 1 float32 ulp apart.

    Shapes: ``step`` int64 [1]; returns float32 ``tau [rows]`` in ``(0, 1)`` and ``cosines [rows,
    n_cos]`` in ``[-1, 1]``. NaN contract: none can arise (integer draws, bounded features).
    """
    offset, k_lo, k_hi, s, rows, n_cos = validate_iqn_tau_cos(step, key_lo, key_hi, stream, rows,
                                                              n_cos)
    tau = rng.uniform(k_hi << 32 | k_lo, s, offset, np.arange(rows, dtype=I64))
    k = np.arange(n_cos, dtype=np.float64)
    arg = np.pi * (k[np.newaxis, :] * tau.astype(np.float64)[:, np.newaxis])
    return TauCos(tau, np.cos(arg).astype(F32))


# --------------------------------------------------------------------------------------------
# Modulation h2 * phi and its backward
# --------------------------------------------------------------------------------------------


class Modulated(NamedTuple):
    """Outputs of ``iqn_modulate``: ``e`` float32 [B N, H] and its BF16 bits ``e_bf16`` (uint16,
    same shape; empty unless asked for: the kernel skips a null mirror pointer)."""

    e: np.ndarray
    e_bf16: np.ndarray


def validate_iqn_modulate(h2, phi, n_quantiles) -> int:
    """The argument checks of ``iqn_modulate``; returns ``n_quantiles``."""
    check_f32_array("h2", h2, ndim=2)
    check_f32_array("phi", phi, ndim=2)
    n = check_int("n_quantiles", n_quantiles, minimum=1)
    if phi.shape != (h2.shape[0] * n, h2.shape[1]):
        raise ValueError(f"phi: shape {phi.shape}; expected [B * n_quantiles, H] = "
                         f"{(h2.shape[0] * n, h2.shape[1])} (h2 is {h2.shape})")
    return n


@ieee
def iqn_modulate(h2: np.ndarray, phi: np.ndarray, n_quantiles: int,
                 with_bf16: bool = False) -> Modulated:
    """``e[b N + i, h] = h2[b, h] * phi[b N + i, h]`` (one float32 product) and, with
    ``with_bf16``, ``e_bf16 = f32_to_bf16(e)`` (the BF16 operand of the ``W_iq`` GEMM).

    Shapes: ``h2 [B, H]``, ``phi [B N, H]`` float32. NaN contract: IEEE (NaN propagates,
    ``0 * Inf`` is NaN); the mirror follows ``f32_to_bf16``.
    """
    n = validate_iqn_modulate(h2, phi, n_quantiles)
    e = (np.repeat(h2, n, axis=0) * phi).astype(F32)
    return Modulated(e, dense.f32_to_bf16(e) if with_bf16 else np.zeros(0, np.uint16))


class ModulateGrads(NamedTuple):
    """Outputs of ``iqn_modulate_backward``: ``d_h2`` float32 [B, H], ``d_phi_pre`` float32
    [B N, H]."""

    d_h2: np.ndarray
    d_phi_pre: np.ndarray


def validate_iqn_modulate_backward(de, h2, phi, n_quantiles) -> int:
    """The argument checks of ``iqn_modulate_backward``; returns ``n_quantiles``."""
    n = validate_iqn_modulate(h2, phi, n_quantiles)
    check_f32_array("de", de, ndim=2)
    if de.shape != phi.shape:
        raise ValueError(f"de: shape {de.shape}; expected phi's shape {phi.shape}")
    return n


@ieee
def iqn_modulate_backward(de: np.ndarray, h2: np.ndarray, phi: np.ndarray,
                          n_quantiles: int) -> ModulateGrads:
    """Backward of ``e = h2[m // N] * phi[m]`` and of ``phi = relu(phi_pre)``, from ``de``:

    - ``d_h2[b, h] = sum_i t_i`` over ``i = 0 .. N-1`` in order from ``+0.0``, each term
      ``t_i = de[b N + i, h] * phi[b N + i, h]`` added only if it is finite (the seeds' guard on
      the IQN trunk-gradient accumulation: a non-finite term is skipped, so ``d_h2`` is always
      finite unless finite terms overflow the sum);
    - ``d_phi_pre[m, h] = phi[m, h] <= 0 ? 0 : de[m, h] * h2[m // N, h]`` (the ReLU select of
      ``dense.relu_mask`` on the post-ReLU ``phi``: a NaN ``phi`` passes the product).

    Shapes: ``de``, ``phi`` [B N, H]; ``h2`` [B, H]; all float32. NaN contract: ``d_h2`` as
    above; ``d_phi_pre`` IEEE where ``phi > 0`` or NaN, ``+0.0`` where ``phi <= 0``.
    """
    n = validate_iqn_modulate_backward(de, h2, phi, n_quantiles)
    b, hidden = h2.shape
    terms = (de * phi).astype(F32).reshape(b, n, hidden)
    acc = np.zeros((b, hidden), F32)
    for i in range(n):
        t = terms[:, i]
        acc = np.where(np.isfinite(t), (acc + t).astype(F32), acc)
    passed = (de * np.repeat(h2, n, axis=0)).astype(F32)
    return ModulateGrads(acc, np.where(phi <= 0, F32(0), passed).astype(F32))


# --------------------------------------------------------------------------------------------
# Quantile Huber loss
# --------------------------------------------------------------------------------------------


class QuantileHuber(NamedTuple):
    """Outputs of ``iqn_quantile_huber``: ``y`` float32 [D, B, N] (clipped quantile targets),
    ``dq`` float32 [B N, A] (the loss gradient w.r.t. ``q``) and ``loss`` (float32 scalar)."""

    y: np.ndarray
    dq: np.ndarray
    loss: np.float32


def validate_iqn_quantile_huber(q, q_target, tau, actions, a_star, r, done, gamma, isw, isv,
                                q_abs_ref_index, k1, branches, n_quantiles, discount=None,
                                gamma_ref=None):
    """The argument checks of ``iqn_quantile_huber``; returns ``(branches, n_quantiles, batch,
    q_abs_ref_index, k1)``."""
    branches = require_branches(branches)
    n = check_int("n_quantiles", n_quantiles, minimum=1)
    require_array("r", r, F32, ndim=1)
    batch = r.shape[0]
    if batch < 1:
        raise ValueError("r: empty; expected [B] with B >= 1")
    a_total, nb = sum(branches), len(branches)
    for name, x in (("q", q), ("q_target", q_target)):
        require_array(name, x, F32, ndim=2)
        if x.shape != (batch * n, a_total):
            raise ValueError(f"{name}: shape {x.shape}; expected [B * n_quantiles, A_total] = "
                             f"{(batch * n, a_total)}")
    require_array("tau", tau, F32, ndim=1)
    _require_rows("tau", tau, batch * n, "B * n_quantiles")
    for name, x in (("done", done), ("isw", isw)):
        require_array(name, x, F32, ndim=1)
        _require_rows(name, x, batch, "B, as r")
    require_array("gamma", gamma, F32, ndim=1)
    _require_rows("gamma", gamma, nb, "one per branch")
    for name, x in (("actions", actions), ("a_star", a_star)):
        require_array(name, x, I32, ndim=2)
        if x.shape != (nb, batch):
            raise ValueError(f"{name}: shape {x.shape}; expected [D, B] = {(nb, batch)}")
        for d, count in enumerate(branches):
            if np.any((x[d] < 0) | (x[d] >= count)):
                raise ValueError(f"{name}: row {d} holds an action outside [0, {count})")
    check_f32_array("isv", isv, ndim=1)
    index = check_int("q_abs_ref_index", q_abs_ref_index, minimum=0, maximum=isv.shape[0] - 1)
    validate_discount(discount, gamma_ref, batch)
    return branches, n, batch, index, f32_scalar("k1", k1)


@ieee
def iqn_quantile_huber(q: np.ndarray, q_target: np.ndarray, tau: np.ndarray, actions: np.ndarray,
                       a_star: np.ndarray, r: np.ndarray, done: np.ndarray, gamma: np.ndarray,
                       isw: np.ndarray, isv: np.ndarray, q_abs_ref_index: int, k1,
                       branches, n_quantiles: int, discount: np.ndarray | None = None,
                       gamma_ref=None) -> QuantileHuber:
    """Quantile Huber loss (kappa = 1) of the online quantiles at the taken actions against the
    target quantiles at the double-DQN actions, per branch ``d`` (columns ``off_d + a``):

    - ``y[d, b, j] = clip(r[b] + (gamma[d] * (1 - done[b])) * q_target[b N + j, off_d +
      a_star[d, b]])``, the Mech 1 clip ``c > bd ? bd : (c < -bd ? -bd : c)`` with ``bd = k1 *
      fmaxf(isv[q_abs_ref_index], 1)`` (``safety.target_q_clip`` with the bound read from the
      ISV, as the scalar C51 target); for n-step transitions (``discount [B]``, ``gamma_ref`` in
      ``(0, 1)``; issue 22) ``gamma[d]`` is ``distributional.effective_gamma(gamma[d],
      discount[b], gamma_ref)`` (None: ``gamma[d]`` itself, bit for bit the 1-step loss);
    - ``u = y[d, b, j] - q[b N + i, off_d + actions[d, b]]``, ``w = |tau[b N + i] - (u < 0 ? 1 :
      0)|``, ``huber(u) = |u| <= 1 ? 0.5 * (u * u) : |u| - 0.5``, ``rho = w * huber(u)``;
    - ``scale = 1 / (B * D * N)`` (float32 division), ``c_b = isw[b] * scale``;
    - per ``(d, b)``: ``l = sum_i sum_j rho`` (one running sum, ``i`` outer, ``j`` inner, from 0)
      and, per ``i``, ``g_i = sum_j w * clip(u, -1, 1)`` (from 0, ``j`` in order; the clip
      written with comparisons); ``dq[b N + i, off_d + actions[d, b]] = -(c_b * g_i)``, every
      other element of ``dq`` is ``+0.0``;
    - ``loss = block_total(c_b * l)`` over the ``(d, b)`` terms in ``d``-major order
      (``step.block_total``: the kernel's one-block tree), i.e.
      ``loss = (1/D) sum_d sum_b isw_b / B * (1/N) sum_i sum_j rho``.

    ``dq`` is the exact gradient of ``loss`` w.r.t. ``q`` (the indicator is piecewise constant;
    ``d huber / du = clip(u, -1, 1)``).

    Shapes: ``q``, ``q_target`` [B N, A]; ``tau`` [B N] (the online fractions); ``actions``,
    ``a_star`` int32 [D, B]; ``r``, ``done``, ``isw`` [B]; ``gamma`` [D]; ``isv`` [L]; all
    float32 but the actions. NaN contract: IEEE, unguarded (sentinel 28 watches ``dq``): a NaN
    target or online quantile gives NaN ``y`` / ``u``, a NaN ``rho`` (the loss is NaN) and a NaN
    ``dq`` at that sample's taken column; ``+/-Inf`` targets are clipped to ``+/-bd``; the clips
    keep NaN. Only the taken / ``a_star`` columns of ``q`` / ``q_target`` are read. A NaN ISV
    value gives the bound ``k1``. With a discount, ``effective_gamma``'s contract (a NaN gamma or
    discount is floored; an infinite one reaches that sample's targets only).
    """
    branches, n, batch, index, k1 = validate_iqn_quantile_huber(
        q, q_target, tau, actions, a_star, r, done, gamma, isw, isv, q_abs_ref_index, k1,
        branches, n_quantiles, discount, gamma_ref)
    nb = len(branches)
    bound = F32(k1 * np.fmax(isv[index], F32(1)))  # the floor on the signal (SPEC 5)
    scale = F32(F32(1) / F32(batch * nb * n))
    coef = (isw * scale).astype(F32)
    rows = np.arange(batch)[:, np.newaxis]
    cols = np.arange(n)[np.newaxis, :]
    qo = q.reshape(batch, n, -1)
    qt = q_target.reshape(batch, n, -1)
    t = tau.reshape(batch, n)
    y = np.zeros((nb, batch, n), F32)
    dq = np.zeros(q.shape, F32)
    terms = np.zeros((nb, batch), F32)
    one, zero, half = F32(1), F32(0), F32(0.5)
    for d, off in enumerate(branch_offsets(branches)):
        sel = qt[rows, cols, (off + a_star[d])[:, np.newaxis]]                 # [B, N]
        g = effective_gamma(gamma[d], discount, gamma_ref)  # scalar (1-step) or [B]
        step_discount = (g * (one - done)).astype(F32)
        c = (r[:, np.newaxis] + step_discount[:, np.newaxis] * sel).astype(F32)
        y[d] = np.where(c > bound, bound, np.where(c < -bound, -bound, c))
        taken = qo[rows, cols, (off + actions[d])[:, np.newaxis]]              # [B, N]
        lsum = np.zeros(batch, F32)
        for i in range(n):
            g = np.zeros(batch, F32)
            for j in range(n):
                u = (y[d, :, j] - taken[:, i]).astype(F32)
                w = np.abs(t[:, i] - np.where(u < 0, one, zero)).astype(F32)
                au = np.abs(u)
                huber = np.where(au <= one, half * (u * u), au - half).astype(F32)
                lsum = (lsum + w * huber).astype(F32)
                clipped = np.where(u > one, one, np.where(u < -one, -one, u))
                g = (g + w * clipped).astype(F32)
            dq[np.arange(batch) * n + i, off + actions[d]] = -(coef * g).astype(F32)
        terms[d] = (coef * lsum).astype(F32)
    return QuantileHuber(y, dq, block_total(terms, IQN_LOSS_THREADS))


KERNELS = {
    "iqn_tau_cos": iqn_tau_cos,
    "iqn_modulate": iqn_modulate,
    "iqn_quantile_huber": iqn_quantile_huber,
    "iqn_modulate_backward": iqn_modulate_backward,
}

__all__ = [
    "IQN_LOSS_THREADS", "KERNELS", "ModulateGrads", "Modulated", "QuantileHuber", "TauCos",
    "iqn_modulate", "iqn_modulate_backward", "iqn_quantile_huber", "iqn_tau_cos",
    "validate_iqn_modulate", "validate_iqn_modulate_backward", "validate_iqn_quantile_huber",
    "validate_iqn_tau_cos",
]
