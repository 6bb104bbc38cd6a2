"""The IQN head's loss and gradients for one batch (SPEC 4 second wave; issue 18 contract),
composed from the IQN kernels (``kernels.iqn``), the dense kernels and the GEMMs in the
trainer's precision mode, as ``network`` composes the core. A pure function: nothing is
clipped by a budget and nothing is updated (the budget pipeline and the IQN Adam are the
trainer's).

Per step, with ``h2`` of online(s) (after Mech 10's clamp) and the target pass's ``h2`` of s2
(``B`` samples, ``N = iqn_quantiles`` fractions each, ``M = B N`` rows ``m = b N + i``)::

    tau, cos   = iqn_tau_cos(step, seed, stream "iqn_tau_online")          [M], [M, n_cos]
    phi        = relu(cos W_phi^T + b_phi);  e = iqn_modulate(h2, phi)     [M, SH2]
    q          = e W_iq^T + b_iq                                           [M, A]
    q'         = the same with the target parameters on the target h2 and the stream
                 "iqn_tau_target"
    y, dq, L   = iqn_quantile_huber(q, q', tau, a, a*, r, done, gamma, isw, Mech 1 bound)
    dW_iq = dq^T e;  db_iq = colsum dq;  de = dq W_iq
    d_h2, d_phi_pre = iqn_modulate_backward(de, h2, phi)
    dW_phi = d_phi_pre^T cos;  db_phi = colsum d_phi_pre
    trunk: d_h2 -> guard clamp_finite(., aux_guard_mult * max(h2_rms, 1)) -> network.trunk_backward
           (Mech 10 clamp mask, h2 and h1 ReLU masks, W_s2, W_s1) -> trunk_grad -> the same
           clamp_finite (output sanitisation) -> trunk_grad_clean

GEMM precision (SPEC 9, ``backend.FORWARD_GEMM_MODE`` / ``BACKWARD_GEMM_MODE`` of ``mode``):
``bf16`` runs the forward GEMMs on BF16-rounded operands and the backward ones on TF32-rounded
ones, ``f32`` everything in f32; the bias add of ``q`` is a plain f32 add (a GEMM epilogue on the
fast path).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .backend import BACKWARD_GEMM_MODE, FORWARD_GEMM_MODE
from .batch import Batch
from .config import PRECISIONS, DQNConfig
from .kernels import dense, iqn, rng, safety
from .layout import ParamLayout
from .network import Activations, trunk_backward

F32 = np.float32


@dataclass
class IqnOut:
    """What ``iqn_loss_and_grads`` returns (shapes for ``B`` samples, ``N`` fractions, ``A``
    actions, ``D`` branches; flat buffers are layout-sized float32)."""

    #: The quantile Huber loss (float32; not yet weighted by ``lambda_iqn``).
    loss: np.float32
    #: Gradient of ``loss`` w.r.t. the IQN tensors, zero outside ``layout.iqn_range``.
    head_grad: np.ndarray
    #: ``d loss / d h2`` of the online pass ``[B, SH2]`` before the guard (sentinel 27).
    d_h2: np.ndarray
    #: ``d_h2`` after the input range guard: what enters the trunk-gradient buffer (slot 35).
    d_h2_guarded: np.ndarray
    #: ``d loss / d q`` ``[B N, A]`` (sentinel 28).
    d_quantiles: np.ndarray
    #: The trunk backward of ``d_h2_guarded``: non-zero on the trunk tensors only, before the
    #: output sanitisation (sentinel 26).
    trunk_grad: np.ndarray
    #: ``trunk_grad`` sanitised (``clamp_finite`` with the guard's bound): the budget's input.
    trunk_grad_clean: np.ndarray
    #: Online and target quantile fractions ``[B N]``.
    tau: np.ndarray
    tau_target: np.ndarray
    #: Online quantiles ``[B N, A]`` and the clipped quantile targets ``[D, B, N]``.
    q: np.ndarray
    y: np.ndarray


def _head_forward(layout: ParamLayout, params: np.ndarray, h2: np.ndarray, cosines: np.ndarray,
                  n_quantiles: int, mode: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(phi, e, q)`` of the head with ``params`` on ``h2`` and the features ``cosines``."""
    p = layout.views(params)
    phi = dense.add_bias_relu(dense.gemm(cosines, p["w_phi"], trans_b=True, mode=mode), p["b_phi"])
    e = iqn.iqn_modulate(h2, phi, n_quantiles).e
    q = (dense.gemm(e, p["w_iq"], trans_b=True, mode=mode) + p["b_iq"]).astype(F32)
    return phi, e, q


def _check(config: DQNConfig, layout: ParamLayout, online: Activations,
           target_next: Activations, a_star: np.ndarray, step, mode: str) -> int:
    """The argument checks; returns ``step`` as an int."""
    if layout.iqn_range is None:
        raise ValueError(f"lambda_iqn={config.lambda_iqn!r}: the IQN head is off (no IQN tensors "
                         "in the layout); iqn_loss_and_grads needs lambda_iqn > 0")
    if mode not in PRECISIONS:
        raise ValueError(f"mode={mode!r}: allowed values are {PRECISIONS}")
    shape = (config.batch_size, config.shared_h2)
    for name, act in (("online", online), ("target_next", target_next)):
        if act.h2.shape != shape:
            raise ValueError(f"{name}.h2: shape {act.h2.shape}; expected [B, SH2] = {shape}")
    want = (config.batch_size, config.n_branches)
    if not isinstance(a_star, np.ndarray) or a_star.shape != want or a_star.dtype.kind not in "iu":
        raise ValueError(f"a_star: expected an integer array of shape [B, n_branches] = {want}, "
                         f"got {getattr(a_star, 'dtype', type(a_star).__name__)} "
                         f"{getattr(a_star, 'shape', '')}")
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) \
            or not 0 <= step < 2**63:
        raise ValueError(f"step={step!r}: must be an integer in [0, 2**63) (the trainer's step "
                         "count before the step)")
    return int(step)


def iqn_loss_and_grads(config: DQNConfig, layout: ParamLayout, params: np.ndarray,
                       target_params: np.ndarray, online: Activations, target_next: Activations,
                       batch: Batch, a_star: np.ndarray, step: int, seed: int, q_abs_ref: float,
                       h2_rms: float, *, mode: str, gamma_ref: float | None = None) -> IqnOut:
    """The IQN head's loss and gradients (the module docstring's chain).

    ``online`` / ``target_next``: the forward passes of ``loss_and_grads`` (online(s) with
    ``params``, target(s2) with ``target_params``); ``a_star [B, n_branches]``: the C51
    double-DQN actions; ``step``: the trainer's step count before this step (the generator's
    offset; 0-based, never reset); ``seed``: the run's seed (the generator's key, in ``[0,
    2**64)``); ``q_abs_ref`` and ``h2_rms``: the ISV slots ``Q_ABS_REF`` (Mech 1 bound ``
    target_q_clip_mult * max(q_abs_ref, 1)``) and ``H_S2_RMS_EMA`` (the guard bound
    ``aux_guard_mult * max(h2_rms, 1)`` and the Mech 10 bound ``h2_clamp_mult * max(h2_rms,
    1)`` whose mask the trunk backward applies); ``mode``: the precision
    (``config.PRECISIONS``) whose GEMM modes the head and the trunk backward use;
    ``gamma_ref``: the reference gamma of ``batch.discount`` (n-step batches; not read when it
    is None).

    Raises ``ValueError`` (one line naming the argument) when the IQN head is off or an
    argument is malformed. NaN contract: the kernels' (``kernels.iqn``); the guard and the
    sanitisation make ``d_h2_guarded`` and ``trunk_grad_clean`` finite always.
    """
    step = _check(config, layout, online, target_next, a_star, step, mode)
    cfg = config if mode == config.precision else config.replace(precision=mode)
    fwd, bwd = FORWARD_GEMM_MODE[mode], BACKWARD_GEMM_MODE[mode]
    key_lo, key_hi = rng.split_u64("seed", seed)
    n, n_cos = config.iqn_quantiles, config.iqn_embed
    rows = config.batch_size * n
    offset = np.array([step], np.int64)

    online_tc = iqn.iqn_tau_cos(offset, key_lo, key_hi, rng.STREAMS["iqn_tau_online"], rows, n_cos)
    target_tc = iqn.iqn_tau_cos(offset, key_lo, key_hi, rng.STREAMS["iqn_tau_target"], rows, n_cos)
    phi, e, q = _head_forward(layout, params, online.h2, online_tc.cosines, n, fwd)
    q_target = _head_forward(layout, target_params, target_next.h2, target_tc.cosines, n, fwd)[2]

    loss = iqn.iqn_quantile_huber(
        q, q_target, online_tc.tau, np.ascontiguousarray(batch.a.T, np.int32),
        np.ascontiguousarray(a_star.T, np.int32), batch.r, batch.done,
        np.array(config.gammas, F32), batch.isw, np.array([q_abs_ref], F32), 0,
        F32(config.target_q_clip_mult), config.branches, n, batch.discount, gamma_ref)

    # Backward of the head (backward GEMM mode), into the IQN tensors of head_grad.
    p = layout.views(params)
    head_grad = layout.zeros()
    g = layout.views(head_grad)
    g["w_iq"][...] = dense.gemm(loss.dq, e, trans_a=True, mode=bwd)
    g["b_iq"][...] = dense.bias_grad_reduce(loss.dq)
    de = dense.gemm(loss.dq, p["w_iq"], mode=bwd)
    mod = iqn.iqn_modulate_backward(de, online.h2, phi, n)
    g["w_phi"][...] = dense.gemm(mod.d_phi_pre, online_tc.cosines, trans_a=True, mode=bwd)
    g["b_phi"][...] = dense.bias_grad_reduce(mod.d_phi_pre)

    # The trunk, inside the input range guard and the output sanitisation (SPEC 6).
    guard = safety.isv_bound(config.aux_guard_mult, h2_rms)
    d_h2_guarded = safety.clamp_finite(mod.d_h2, guard)
    trunk_grad = trunk_backward(cfg, layout, params, online, d_h2_guarded,
                                h2_bound=safety.isv_bound(config.h2_clamp_mult, h2_rms))
    return IqnOut(loss=loss.loss, head_grad=head_grad, d_h2=mod.d_h2, d_h2_guarded=d_h2_guarded,
                  d_quantiles=loss.dq, trunk_grad=trunk_grad,
                  trunk_grad_clean=safety.clamp_finite(trunk_grad, guard), tau=online_tc.tau,
                  tau_target=target_tc.tau, q=q, y=loss.y)


__all__ = ["IqnOut", "iqn_loss_and_grads"]
