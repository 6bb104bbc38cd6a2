"""Conditioning the compared batch away from discontinuities.

A ReLU mask or a double-DQN argmax sitting within rounding distance of its switching point
legitimately flips one sample's whole contribution, and no tight bound survives that. The batch
is therefore *conditioned* (:func:`condition_batch`): a forward pass that carries the size of
the legitimate difference between two correct implementations (:func:`deviation_forward`:
independent accumulation roundings ``2 u sqrt(K) |w x|_2`` added in quadrature through the
layers, and in ``bf16`` and ``tf32`` a whole ulp of the format wherever an activation sits near
a rounding midpoint) finds the rows of ``s`` whose ReLU pre-activations, and the rows of ``s2``
whose top-two expected Q values, lie within ``MARGIN_SAFETY`` such deviations of their
switching point, and those rows are redrawn. What remains is continuous in the rounding noise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from foxhunt.conformance.step_bounds import F32, F64, U
from foxhunt.reference import isv as isv_mod
from foxhunt.reference.backend import FORWARD_GEMM_MODE
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import dense, safety
from foxhunt.reference.layout import ParamLayout, branch_name
from foxhunt.reference.network import forward
from foxhunt.reference.step import support

#: A row is redrawn when a discontinuity lies within this many deviations of it (a Gaussian
#: rounding difference exceeds 8 sigma with probability ~1e-15).
MARGIN_SAFETY = 8.0
MAX_CONDITION_ROUNDS = 200


#: A BF16 rounding flip less likely than this (Gaussian tail bound) is not provided for.
FLIP_PROBABILITY_FLOOR = 1e-9


#: Low float32 mantissa bits a forward GEMM mode's operand rounding drops (round to nearest).
DROPPED_BITS = {"bf16": 16, "tf32": 13}


def rounding_flips(x: np.ndarray, sigma: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """``(probability, jump)`` of ``x``'s rounding to ``mode`` (``DROPPED_BITS``) differing when
    the other implementation holds ``x + N(0, sigma)``: ``exp(-d^2 / 2 sigma^2)`` (a bound on the
    Gaussian tail beyond the distance ``d`` to the nearest rounding midpoint) and one ulp of
    ``mode``."""
    dropped = DROPPED_BITS[mode]
    bits = np.ascontiguousarray(x, F32).view(np.uint32)
    low = (bits & np.uint32((1 << dropped) - 1)).astype(np.int64)
    f32_ulp = np.spacing(np.abs(x).astype(F32)).astype(F64)
    dist = np.abs(low - (1 << (dropped - 1))) * f32_ulp
    with np.errstate(divide="ignore", invalid="ignore"):
        prob = np.where(sigma > 0, np.exp(-0.5 * (dist / sigma) ** 2), (dist == 0).astype(F64))
    return prob, float(1 << dropped) * f32_ulp


@dataclass
class Deviations:
    """Reference values and how far a correct implementation may be from them: per ReLU
    pre-activation and per expected Q, the ``reach`` within which a switch counts as near."""

    pre_activations: list[tuple[str, np.ndarray, np.ndarray]]  # (name, t [N, H], reach [N, H])
    q: list[tuple[np.ndarray, np.ndarray]]                     # per branch (q, reach) [N, n_d]


def _max_single_flip(jump: np.ndarray, w_abs: np.ndarray, chunk: int = 32) -> np.ndarray:
    """``max_k |w[n, k]| jump[b, k]`` per (b, n): the largest effect of one flipped input
    (``jump`` is sparse: only the rows and columns holding a flip are visited)."""
    out = np.zeros((jump.shape[0], w_abs.shape[0]), np.float32)
    rows = np.flatnonzero(jump.any(axis=1))
    for start in range(0, len(rows), chunk):
        rs = rows[start:start + chunk]
        ks = np.flatnonzero(jump[rs].any(axis=0))
        j = jump[np.ix_(rs, ks)].astype(np.float32)
        out[rs] = np.max(j[:, None, :] * w_abs[None, :, ks].astype(np.float32), axis=2)
    return out.astype(F64)


def deviation_forward(config: DQNConfig, params: np.ndarray, x: np.ndarray,
                      h2_bound: F32) -> Deviations:
    """The forward pass with, for every ReLU pre-activation and expected Q, how far it may
    legitimately differ between two correct implementations (float64).

    Error model: the two implementations' accumulation errors are independent roundings, so a
    K-term dot product differs by a standard deviation of about ``2 u sqrt(K) |w x|_2``, and
    input deviations add in quadrature (a worst-case interval grows ~10x per layer and flags
    every row). In ``bf16`` an activation's BF16 rounding may flip (probability ``pi`` from its
    distance to the rounding midpoint): flips add ``pi J^2 w^2`` to the variance, and the
    largest single likely flip (``pi > FLIP_PROBABILITY_FLOOR``) is added to the reach in full.
    ``tf32`` is modelled as ``bf16`` with TF32's ulp: its GEMMs round both operands, the weights
    too, to nearest (cuBLASLt's TF32 plans ties to even, ``tests/test_fast_gpu.py``; the
    reference's ``tf32_round`` ties away: they differ on exact ties alone), where a truncating
    tensor core would move every product.
    ``reach = MARGIN_SAFETY sigma + largest flip``. ReLU and the Mech 10 clamp are 1-Lipschitz;
    ``dQ = sum_j p_j (z_j - Q) dlogit_j``.
    """
    layout = ParamLayout(config)
    mode = FORWARD_GEMM_MODE[config.precision]
    rounded = mode in DROPPED_BITS
    p = layout.views(params)
    with np.errstate(all="ignore"):
        act = forward(config, layout, params, x, h2_bound=h2_bound)

    def layer(inp, sigma_in, w_name, b_name):
        w, b = p[w_name], p[b_name].astype(F64)
        flip_var = np.zeros(inp.shape, F64)
        flip_max = 0.0
        if rounded:
            prob, jump = rounding_flips(inp, sigma_in, mode)
            flip_var = prob * jump * jump
            inp, w = dense.round_for(inp, mode), dense.round_for(w, mode)
        x64, w64 = inp.astype(F64), w.astype(F64)
        if rounded:
            flip_max = _max_single_flip(np.where(prob > FLIP_PROBABILITY_FLOOR, jump, 0.0), np.abs(w64))
        t = x64 @ w64.T + b
        # Variances only set the size of a margin: float32 is plenty for them.
        w_sq = (w64 * w64).astype(np.float32)
        k = inp.shape[1] + 1
        var = ((sigma_in * sigma_in + flip_var).astype(np.float32) @ w_sq.T).astype(F64) \
            + (2 * U) ** 2 * k * (((x64 * x64).astype(np.float32) @ w_sq.T).astype(F64) + b * b)
        sigma = np.sqrt(var)
        return t, sigma, MARGIN_SAFETY * sigma + flip_max

    zero = np.zeros(x.shape, F64)
    t1, s1, r1 = layer(act.x, zero, "w_s1", "b_s1")
    t2, s2, r2 = layer(act.h1, s1, "w_s2", "b_s2")
    tv, sv, rv = layer(act.h2, s2, "w_v1", "b_v1")
    v, _, reach_v = layer(act.hv, sv, "w_v2", "b_v2")
    pre = [("h1", t1, r1), ("h2", t2, r2), ("hv", tv, rv)]
    z = support(config).astype(F64)
    qs = []
    n_rows = x.shape[0]
    for d, n in enumerate(config.branches):
        br = branch_name(d)
        ta, sa, ra = layer(act.h2, s2, f"w_{br}1", f"b_{br}1")
        pre.append((f"ha_{br}", ta, ra))
        adv, _, reach_adv = layer(act.ha[d], sa, f"w_{br}2", f"b_{br}2")
        adv, reach_adv = (a.reshape(n_rows, n, config.num_atoms) for a in (adv, reach_adv))
        reach_logit = reach_v[:, None, :] + reach_adv + reach_adv.mean(axis=1, keepdims=True) \
            + 4 * U * (np.abs(v)[:, None, :] + np.abs(adv) + np.abs(adv).mean(axis=1, keepdims=True))
        prob = np.exp(act.logp[d].astype(F64))
        q = (prob * z).sum(axis=2)
        reach_q = reach_logit.max(axis=2) * (prob * np.abs(z - q[:, :, None])).sum(axis=2) \
            + MARGIN_SAFETY * 4 * U * config.num_atoms * (prob * np.abs(z)).sum(axis=2)
        qs.append((q, reach_q))
    return Deviations(pre, qs)


def h2_clamp_bound(config: DQNConfig, isv: np.ndarray) -> F32:
    return F32(safety.isv_bound(F32(config.h2_clamp_mult), isv[isv_mod.H_S2_RMS_EMA_INDEX]))


def near_relu_switch(config: DQNConfig, params: np.ndarray, s: np.ndarray, h2_bound: F32) -> np.ndarray:
    """Rows of ``s`` with a ReLU pre-activation within its reach of 0."""
    bad = np.zeros(s.shape[0], bool)
    for _, t, reach in deviation_forward(config, params, s, h2_bound).pre_activations:
        bad |= np.any(~(np.abs(t) > reach), axis=1)
    return bad


def near_argmax_tie(config: DQNConfig, params: np.ndarray, s2: np.ndarray, h2_bound: F32) -> np.ndarray:
    """Rows of ``s2`` whose best and second-best expected Q (any branch) are within the sum of
    their reaches."""
    bad = np.zeros(s2.shape[0], bool)
    for q, reach in deviation_forward(config, params, s2, h2_bound).q:
        order = np.argsort(-q, axis=1, kind="stable")
        rows = np.arange(q.shape[0])
        best, second = order[:, 0], order[:, 1]
        gap = q[rows, best] - q[rows, second]
        bad |= ~(gap > reach[rows, best] + reach[rows, second])
    return bad


def condition_batch(config: DQNConfig, state: Mapping[str, np.ndarray], batch: Batch,
                    rng: np.random.Generator) -> Batch:
    """Redraw the rows of ``s`` near a ReLU switch and of ``s2`` near a double-DQN tie (module
    docstring) until none is left; the redrawn rows are re-examined alone, then the whole batch
    once more, as its users examine it: :func:`deviation_forward`'s float32 products round with
    the row count's blocking, so a row at a margin's edge can pass alone and fail in the batch
    (seed preset, ``tf32``, numpy 2.4.6: one row of ``s``)."""
    params, h2_bound = state["params"], h2_clamp_bound(config, state["isv"])
    s, s2 = batch.s.copy(), batch.s2.copy()
    todo_s, todo_s2 = np.arange(len(s)), np.arange(len(s2))
    for _ in range(MAX_CONDITION_ROUNDS):
        if len(todo_s):
            todo_s = todo_s[near_relu_switch(config, params, s[todo_s], h2_bound)]
        if len(todo_s2):
            todo_s2 = todo_s2[near_argmax_tie(config, params, s2[todo_s2], h2_bound)]
        if not len(todo_s) and not len(todo_s2):
            todo_s = np.flatnonzero(near_relu_switch(config, params, s, h2_bound))
            todo_s2 = np.flatnonzero(near_argmax_tie(config, params, s2, h2_bound))
            if not len(todo_s) and not len(todo_s2):
                return dataclasses.replace(batch, s=s, s2=s2).validate(config)
        s[todo_s] = rng.standard_normal((len(todo_s), s.shape[1])).astype(F32)
        s2[todo_s2] = rng.standard_normal((len(todo_s2), s2.shape[1])).astype(F32)
    raise AssertionError(f"condition_batch: {len(todo_s)} rows of s and {len(todo_s2)} of s2 still "
                         f"near a discontinuity after {MAX_CONDITION_ROUNDS} rounds")
