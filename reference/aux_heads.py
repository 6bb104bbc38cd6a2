"""The auxiliary heads', the ensemble diversity's and the MSE warm-up's losses and gradients for
one batch (SPEC 4 second wave; issue 18 contract), composed from their kernels
(``kernels.aux``, ``kernels.ensemble``, ``kernels.warmup``), the dense kernels and the GEMMs in
the trainer's precision mode, as ``network`` composes the core. Pure functions: nothing is
clipped by a budget and nothing is updated (the budget pipeline is the trainer's).

Auxiliary heads, on ``h2`` of online(s) (after Mech 10's clamp), ``key`` = ``nb`` / ``rg``::

    hidden = add_bias_elu(h2 W_key1^T, b_key1)                         [B, AXH]
    pred   = hidden w_nb2^T + b_nb2          [B]   logits_r = hidden W_rg2^T + b_rg2   [B, R]
    d_pred, L_nb = aux_next_bar_loss_grad(pred, next_ret, ISV[117] ...)    (weighted gradient)
    d_logits, L_rg = aux_regime_loss_grad(logits_r, regime)                (weighted gradient)
    dW_key2 = d_out^T hidden;  db_key2 = colsum d_out;  d_hidden = d_out W_key2
    d_pre = elu_backward(d_hidden, hidden);  dW_key1 = d_pre^T h2;  db_key1 = colsum d_pre
    d_h2_key = d_pre W_key1

Ensemble diversity, with ``v`` the value stream's logits of online(s) (head 0)::

    v_k = W_e{k}2 relu(W_e{k}1 h2 + b_e{k}1) + b_e{k}2        k = 1..K-1 (frozen prior heads)
    d_v, kl, L_ens = ens_kl_grad(v, [v_1 .. v_{K-1}])
    value head: dW_v2 = d_v^T hv; db_v2; dhv = relu_mask(d_v W_v2, hv); dW_v1 = dhv^T h2; db_v1
    d_h2 = dhv W_v1 -> guard clamp_finite(., aux_guard_mult * max(ISV[H_S2_RMS_EMA], 1))
         -> network.trunk_backward (Mech 10 clamp mask, h2 and h1 ReLU masks, W_s2, W_s1)
    trunk_grad = value head + trunk gradients ([0, value_end)) -> the same clamp_finite

MSE warm-up: ``mse_warmup`` on the online log-probabilities, the taken-action expected Q and
the Mech 1 clipped scalar targets, blended into the C51 logit gradients.

GEMM precision (SPEC 9, ``backend.FORWARD_GEMM_MODE`` / ``BACKWARD_GEMM_MODE``): ``bf16`` runs
the forward GEMMs on BF16-rounded operands and the backward ones on TF32-rounded ones, ``f32``
everything in f32; the output layers' bias adds are plain f32 adds (GEMM epilogues on the fast
path).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import isv as isv_mod
from .backend import BACKWARD_GEMM_MODE, FORWARD_GEMM_MODE
from .batch import Batch
from .config import PRECISIONS, DQNConfig
from .kernels import aux, dense, distributional, ensemble, optim, safety, warmup
from .kernels import step as step_kernels
from .kernels.fused import split_branches
from .layout import ParamLayout
from .network import Activations, trunk_backward

F32 = np.float32

#: The auxiliary heads: (layout key, config switch, weight field).
AUX_HEADS = (("nb", "aux_next_bar_on", "aux_next_bar_weight"),
             ("rg", "aux_regime_on", "aux_regime_weight"))


def _check_mode(mode: str) -> None:
    if mode not in PRECISIONS:
        raise ValueError(f"mode={mode!r}: allowed values are {PRECISIONS}")


def _linear(x: np.ndarray, w: np.ndarray, b: np.ndarray, mode: str) -> np.ndarray:
    """``x W^T + b`` (the GEMM in ``mode``, then a plain f32 bias add)."""
    return (dense.gemm(x, w, trans_b=True, mode=mode) + b).astype(F32)


def _dense_backward(g: dict, p: dict, dy: np.ndarray, x_in: np.ndarray, w_name: str,
                    b_name: str, mode: str) -> np.ndarray:
    """``dW = dy^T x_in`` and ``db = colsum dy`` into the gradient views ``g``; returns
    ``dx = dy W`` (backward GEMM ``mode``)."""
    g[w_name][...] = dense.gemm(dy, x_in, trans_a=True, mode=mode)
    g[b_name][...] = dense.bias_grad_reduce(dy)
    return dense.gemm(dy, p[w_name], mode=mode)


# --------------------------------------------------------------------------------------------
# Auxiliary heads
# --------------------------------------------------------------------------------------------


@dataclass
class AuxOut:
    """What ``aux_loss_and_grads`` returns (``B`` samples; flat buffers layout-sized float32)."""

    #: The next-bar regression's and the regime classification's losses (float32, unweighted;
    #: 0 for a head that is off).
    loss_nb: np.float32
    loss_rg: np.float32
    #: The weighted losses' gradient w.r.t. the aux tensors (zero outside them): the C51
    #: budget's share of the heads.
    param_grad: np.ndarray
    #: The heads' weighted ``d h2`` summed ``[B, SH2]``: ``saxpy(saxpy(0, d_h2_nb, 1), d_h2_rg,
    #: 1)`` over the heads that are on (isfinite-guarded, so always finite); what enters the
    #: main trunk-gradient buffer.
    d_h2: np.ndarray
    #: Each head's weighted ``d h2`` ``[B, SH2]`` before the guarded sum (sentinels 30, 52);
    #: None for a head that is off.
    d_h2_nb: np.ndarray | None
    d_h2_rg: np.ndarray | None


def _check_aux(config: DQNConfig, layout: ParamLayout, online: Activations, batch: Batch,
               isv: np.ndarray) -> None:
    if not config.aux_on:
        raise ValueError("aux_next_bar_weight=0.0, aux_regime_weight=0.0: the auxiliary heads "
                         "are off; aux_loss_and_grads needs a head weight > 0")
    for key, on, weight in AUX_HEADS:
        if getattr(config, on) and f"w_{key}1" not in layout.by_name:
            raise ValueError(f"{weight}={getattr(config, weight)!r}: the layout has no {key} "
                             "head tensors (build the layout from the same config)")
    shape = (config.batch_size, config.shared_h2)
    if online.h2.shape != shape:
        raise ValueError(f"online.h2: shape {online.h2.shape}; expected [B, SH2] = {shape}")
    for name in ("next_ret", "regime"):
        if getattr(batch, name, None) is None:
            raise ValueError(f"batch.{name}: missing; the auxiliary heads need the batch's labels")
    if not isinstance(isv, np.ndarray) or isv.shape != (isv_mod.ISV_LEN,):
        raise ValueError(f"isv: expected the ISV vector, shape ({isv_mod.ISV_LEN},), got "
                         f"{getattr(isv, 'shape', type(isv).__name__)}")


def aux_loss_and_grads(config: DQNConfig, layout: ParamLayout, params: np.ndarray,
                       online: Activations, batch: Batch, isv: np.ndarray) -> AuxOut:
    """The auxiliary heads' losses and gradients (the module docstring's chain), for the heads
    whose weight is > 0.

    ``online``: the forward pass of online(s) (its clamped ``h2``); ``batch``: its ``next_ret``
    and ``regime`` labels; ``isv``: the ISV vector whose slot 117 (the label scale, already
    updated by ``isv_label_scale_update`` for this batch) the next-bar loss reads. The GEMMs run
    in ``config.precision``'s modes.

    Raises ``ValueError`` (one line naming the field) when both heads are off, the layout lacks
    an active head's tensors or an input has the wrong shape. NaN contract: the kernels'
    (``kernels.aux``); ``d_h2`` is finite (guarded sum), ``d_h2_nb``/``d_h2_rg`` and
    ``param_grad`` carry whatever NaN the heads produce (the sentinels see it).
    """
    _check_aux(config, layout, online, batch, isv)
    fwd, bwd = FORWARD_GEMM_MODE[config.precision], BACKWARD_GEMM_MODE[config.precision]
    p = layout.views(params)
    param_grad = layout.zeros()
    g = layout.views(param_grad)
    h2 = online.h2
    d_h2 = np.zeros(h2.shape, F32)
    losses = {"nb": F32(0), "rg": F32(0)}
    parts: dict[str, np.ndarray | None] = {"nb": None, "rg": None}
    for key, on, weight in AUX_HEADS:
        if not getattr(config, on):
            continue
        hidden = aux.add_bias_elu(dense.gemm(h2, p[f"w_{key}1"], trans_b=True, mode=fwd),
                                  p[f"b_{key}1"])
        out = _linear(hidden, p[f"w_{key}2"], p[f"b_{key}2"], fwd)
        if key == "nb":
            res = aux.aux_next_bar_loss_grad(np.ascontiguousarray(out[:, 0]), batch.next_ret, isv,
                                             isv_mod.AUX_LABEL_SCALE_EMA_INDEX,
                                             aux.LABEL_SCALE_FLOOR, getattr(config, weight))
            d_out = res.d_pred[:, np.newaxis]
        else:
            res = aux.aux_regime_loss_grad(out, batch.regime, getattr(config, weight))
            d_out = res.d_logits
        losses[key] = res.loss
        d_hidden = _dense_backward(g, p, d_out, hidden, f"w_{key}2", f"b_{key}2", bwd)
        d_pre = aux.elu_backward(d_hidden, hidden)
        parts[key] = _dense_backward(g, p, d_pre, h2, f"w_{key}1", f"b_{key}1", bwd)
        d_h2 = optim.saxpy(d_h2, parts[key], F32(1))
    return AuxOut(loss_nb=losses["nb"], loss_rg=losses["rg"], param_grad=param_grad, d_h2=d_h2,
                  d_h2_nb=parts["nb"], d_h2_rg=parts["rg"])


# --------------------------------------------------------------------------------------------
# Ensemble diversity
# --------------------------------------------------------------------------------------------


@dataclass
class EnsOut:
    """What ``ens_loss_and_grads`` returns (flat buffers layout-sized float32)."""

    #: The diversity loss ``-(1/(B (K-1))) sum_b sum_k KL(p_k || p_0)`` (float32, not weighted by
    #: ``ens_weight``).
    loss: np.float32
    #: Its gradient w.r.t. head 0's logits (the value stream ``v``) ``[B, NA]`` (sentinel 31).
    d_logits: np.ndarray
    #: The value head's and the trunk's gradient (non-zero in ``[0, value_end)`` only), the
    #: trunk part from the guarded ``d h2``, before the output sanitisation (sentinel 51).
    trunk_grad: np.ndarray
    #: ``trunk_grad`` sanitised (``clamp_finite`` with the guard's bound): the budget's input.
    trunk_grad_clean: np.ndarray
    #: ``d loss / d h2`` through the value head ``[B, SH2]``, and after the input range guard.
    d_h2: np.ndarray
    d_h2_guarded: np.ndarray
    #: The prior heads' logits ``[K - 1, B, NA]`` and each sample's KL summed over them ``[B]``.
    priors: np.ndarray
    kl: np.ndarray


def _check_ens(config: DQNConfig, layout: ParamLayout, online: Activations, isv: np.ndarray,
               mode: str) -> None:
    if layout.ens_range is None:
        raise ValueError(f"ens_weight={config.ens_weight!r}: the ensemble is off (no prior heads "
                         "in the layout); ens_loss_and_grads needs ens_weight > 0")
    _check_mode(mode)
    for name, x, shape in (("online.h2", online.h2, (config.batch_size, config.shared_h2)),
                           ("online.v", online.v, (config.batch_size, config.num_atoms))):
        if x.shape != shape:
            raise ValueError(f"{name}: shape {x.shape}; expected {shape}")
    if not isinstance(isv, np.ndarray) or isv.shape != (isv_mod.ISV_LEN,):
        raise ValueError(f"isv: expected the ISV vector, shape ({isv_mod.ISV_LEN},), got "
                         f"{getattr(isv, 'shape', type(isv).__name__)}")


def ens_loss_and_grads(config: DQNConfig, layout: ParamLayout, params: np.ndarray,
                       online: Activations, isv: np.ndarray, *, mode: str) -> EnsOut:
    """The ensemble diversity's loss and gradients (the module docstring's chain).

    ``online``: the forward pass of online(s) (``h2``, ``hv``, ``v``); ``isv``: the ISV vector
    (``H_S2_RMS_EMA`` sets the guard ``aux_guard_mult * max(., 1)`` and the Mech 10 bound whose
    mask the trunk backward applies); ``mode``: the precision (``config.PRECISIONS``) whose
    GEMM modes the prior heads and the backward use. The priors are frozen: no gradient reaches
    them.

    Raises ``ValueError`` (one line naming the argument) when the ensemble is off or an input is
    malformed. NaN contract: ``ens_kl_grad``'s; ``d_h2_guarded`` and ``trunk_grad_clean`` are
    finite always (the guard and the sanitisation).
    """
    _check_ens(config, layout, online, isv, mode)
    cfg = config if mode == config.precision else config.replace(precision=mode)
    fwd, bwd = FORWARD_GEMM_MODE[mode], BACKWARD_GEMM_MODE[mode]
    p = layout.views(params)
    h2 = online.h2
    priors = np.stack([
        _linear(dense.add_bias_relu(dense.gemm(h2, p[f"w_e{k}1"], trans_b=True, mode=fwd),
                                    p[f"b_e{k}1"]), p[f"w_e{k}2"], p[f"b_e{k}2"], fwd)
        for k in range(1, config.ens_heads)])
    kl = ensemble.ens_kl_grad(online.v, priors, ensemble.ENS_SOFTMAX_EPS)

    # Back through the value head (its gradients go into the scratch's value range).
    value_grad = layout.zeros()
    g = layout.views(value_grad)
    dhv = dense.relu_mask(_dense_backward(g, p, kl.d_v, online.hv, "w_v2", "b_v2", bwd), online.hv)
    d_h2 = _dense_backward(g, p, dhv, h2, "w_v1", "b_v1", bwd)

    # The trunk, inside the input range guard and the output sanitisation (SPEC 6).
    guard = step_kernels.clamp_finite_isv(d_h2, isv, isv_mod.H_S2_RMS_EMA_INDEX,
                                          config.aux_guard_mult).out
    h2_bound = safety.isv_bound(config.h2_clamp_mult, isv[isv_mod.H_S2_RMS_EMA_INDEX])
    trunk_grad = trunk_backward(cfg, layout, params, online, guard, h2_bound=h2_bound)
    value = slice(layout.trunk_end, layout.value_end)
    trunk_grad[value] = value_grad[value]
    clean = step_kernels.clamp_finite_isv(trunk_grad, isv, isv_mod.H_S2_RMS_EMA_INDEX,
                                          config.aux_guard_mult).out
    return EnsOut(loss=kl.loss, d_logits=kl.d_v, trunk_grad=trunk_grad, trunk_grad_clean=clean,
                  d_h2=d_h2, d_h2_guarded=guard, priors=priors, kl=kl.kl)


# --------------------------------------------------------------------------------------------
# MSE warm-up
# --------------------------------------------------------------------------------------------


@dataclass
class MseOut:
    """What ``mse_blend`` returns."""

    #: The expected-Q MSE ``(1/nb) sum_d sum_b isw_b 0.5 td^2 / B`` (float32; computed whatever
    #: ``w``). The reported C51 loss is ``(1 - w) * c51 + w * loss`` while ``w > 0``.
    loss: np.float32
    #: The blend weight ``max(0, 1 - epoch / c51_warmup_epochs)`` (float32).
    w: np.float32
    #: Per branch ``[B, n_d, NA]``: ``(1 - w) dl_c51 + w dl_mse`` for ``w > 0``, else copies of
    #: the C51 logit gradients, bit for bit.
    dlogits: list[np.ndarray]


def mse_blend(config: DQNConfig, online: Activations, batch: Batch, target_q: np.ndarray,
              dlogits_c51: list[np.ndarray], epoch) -> MseOut:
    """The MSE warm-up's loss and its blend into the C51 logit gradients (``mse_warmup``).

    ``online``: the forward pass of online(s) (its per-branch log-probabilities; ``E`` is the
    expected Q of the taken action, ``distributional.expected_q``); ``target_q [B, n_branches]``:
    the Mech 1 clipped scalar targets; ``dlogits_c51``: the per-branch C51 logit gradients
    ``[B, n_d, NA]``; ``epoch``: the epoch counter (ISV ``EPOCH_IDX``, which the kernel reads
    from the bus: here a bus holding it). Raises ``ValueError`` when the warm-up is off
    (``c51_warmup_epochs == 0``) or an input is malformed (the kernel's checks).
    """
    if not config.mse_on:
        raise ValueError("c51_warmup_epochs=0: the MSE warm-up is off; mse_blend needs "
                         "c51_warmup_epochs > 0")
    if isinstance(epoch, (bool, np.bool_)) or not isinstance(epoch, (int, float, np.integer,
                                                                       np.floating)):
        raise ValueError(f"epoch={epoch!r}: expected a real scalar (the epoch counter)")
    z = distributional.support(config.v_min, config.v_max, config.num_atoms)
    rows = np.arange(config.batch_size)
    actions = np.ascontiguousarray(batch.a.T, np.int32)
    q_taken = np.stack([distributional.expected_q(lp, z)[rows, actions[d]]
                        for d, lp in enumerate(online.logp)]).astype(F32)
    bus = np.zeros(isv_mod.ISV_LEN, F32)
    bus[isv_mod.EPOCH_IDX_INDEX] = F32(epoch)
    packed = lambda blocks: np.concatenate(  # noqa: E731
        [b.reshape(-1, config.num_atoms) for b in blocks]).astype(F32)
    res = warmup.mse_warmup(packed(online.logp), actions, q_taken,
                            np.ascontiguousarray(target_q.T, F32), batch.isw, z,
                            packed(dlogits_c51), bus, isv_mod.EPOCH_IDX_INDEX,
                            config.c51_warmup_epochs, config.branches)
    dlogits = [x.copy() for x in split_branches(res.dlogits, config.branches)]
    return MseOut(loss=res.loss, w=res.w, dlogits=dlogits)


__all__ = ["AuxOut", "EnsOut", "MseOut", "aux_loss_and_grads", "ens_loss_and_grads", "mse_blend"]
