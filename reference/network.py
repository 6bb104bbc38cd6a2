"""The branching dueling C51 network, forward and backward, composed from the reference kernels.

Forward (SPEC 3), for states ``x [N, SD]`` and weights row-major ``[out, in]``::

    h1 = relu(x W_s1^T + b_s1);  h2 = relu(h1 W_s2^T + b_s2)   (then Mech 10 clamp_finite)
    hv = relu(h2 W_v1^T + b_v1); v = hv W_v2^T + b_v2
    ha_d = relu(h2 W_d1^T + b_d1); adv_d = ha_d W_d2^T + b_d2            [N, n_d, NA]
    logits_d = dueling_combine(v, adv_d); logp_d = log_softmax_atoms(logits_d)

GEMM precision (SPEC 9): ``f32`` runs every GEMM in f32, ``tf32`` every GEMM on TF32-rounded f32
inputs with f32 accumulation (``dense`` mode ``tf32``); ``bf16`` runs the forward GEMMs on
BF16-rounded inputs (the BF16 mirror of the weights and the BF16 copy of the activations) with
f32 accumulation, and the backward GEMMs on TF32-rounded f32 inputs. The bias adds of the layers
without ReLU (``v``, ``adv_d``) are GEMM epilogues in the fast path; here they are a plain f32 add.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .backend import BACKWARD_GEMM_MODE, FORWARD_GEMM_MODE
from .config import DQNConfig
from .kernels import dense, distributional, optim, safety
from .kernels import step as step_kernels
from .layout import ParamLayout, branch_name


@dataclass
class Activations:
    """Everything the backward pass needs from one forward pass."""

    x: np.ndarray
    h1: np.ndarray
    h2_pre_clamp: np.ndarray
    h2: np.ndarray
    hv: np.ndarray
    v: np.ndarray
    adv: list[np.ndarray] = field(default_factory=list)
    ha: list[np.ndarray] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    logp: list[np.ndarray] = field(default_factory=list)


def _rounded(x: np.ndarray, mode: str) -> np.ndarray:
    """The values a GEMM in ``mode`` multiplies (rounded once, reused by every GEMM of ``x``)."""
    return x if mode == "f32" else dense.round_for(x, mode)


def _linear(x_rounded: np.ndarray, w_rounded: np.ndarray, mode: str) -> np.ndarray:
    return dense.gemm(x_rounded, w_rounded, trans_b=True, mode=mode, rounded=True)


def forward_weights(config: DQNConfig, layout: ParamLayout, params: np.ndarray) -> dict:
    """The weight matrices of ``params`` as ``forward``'s GEMMs multiply them (rounded for the
    precision's forward GEMM mode), by tensor name."""
    mode = FORWARD_GEMM_MODE[config.precision]
    p = layout.views(params)
    return {t.name: _rounded(p[t.name], mode) for t in layout.weight_matrices}


def forward(config: DQNConfig, layout: ParamLayout, params: np.ndarray, x: np.ndarray,
            *, h2_bound: float | None = None, weights: dict | None = None) -> Activations:
    """One forward pass of the network with parameters ``params`` (flat f32) on ``x [N, SD]``.

    ``h2_bound`` is the Mech 10 bound (``h2_clamp_mult * max(ISV[H_S2_RMS_EMA], 1)``); ``None``
    skips the clamp (for debugging a pure forward). ``weights``: ``forward_weights(config,
    layout, params)`` when the caller keeps it for many passes on the same parameters.
    """
    mode = FORWARD_GEMM_MODE[config.precision]
    p = layout.views(params)
    w = forward_weights(config, layout, params) if weights is None else weights
    h1 = dense.add_bias_relu(_linear(_rounded(x, mode), w["w_s1"], mode), p["b_s1"])
    h2_pre = dense.add_bias_relu(_linear(_rounded(h1, mode), w["w_s2"], mode), p["b_s2"])
    h2 = h2_pre if h2_bound is None else safety.clamp_finite(h2_pre, np.float32(h2_bound))
    h2_r = _rounded(h2, mode)
    hv = dense.add_bias_relu(_linear(h2_r, w["w_v1"], mode), p["b_v1"])
    v = _linear(_rounded(hv, mode), w["w_v2"], mode) + p["b_v2"]
    act = Activations(x=x, h1=h1, h2_pre_clamp=h2_pre, h2=h2, hv=hv, v=v)
    n_rows = x.shape[0]
    for d, n in enumerate(config.branches):
        br = branch_name(d)
        ha = dense.add_bias_relu(_linear(h2_r, w[f"w_{br}1"], mode), p[f"b_{br}1"])
        adv = (_linear(_rounded(ha, mode), w[f"w_{br}2"], mode) + p[f"b_{br}2"]).reshape(
            n_rows, n, config.num_atoms)
        logits = distributional.dueling_combine(v, adv)
        act.ha.append(ha)
        act.adv.append(adv)
        act.logits.append(logits)
        act.logp.append(distributional.log_softmax_atoms(logits))
    return act


class _Backprop:
    """The dense-layer backward of one parameter buffer: weight and bias gradients written into
    ``grad``'s views, activations and weights rounded once per GEMM mode and reused."""

    def __init__(self, config: DQNConfig, layout: ParamLayout, params: np.ndarray, grad: np.ndarray):
        self.mode = BACKWARD_GEMM_MODE[config.precision]
        self.p = layout.views(params)
        self.g = layout.views(grad)
        self._rounded: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def rnd(self, x: np.ndarray) -> np.ndarray:
        key = id(x)  # the pair keeps x alive, so its id is not reused while cached
        if key not in self._rounded:
            self._rounded[key] = (x, _rounded(x, self.mode))
        return self._rounded[key][1]

    def dense(self, dy: np.ndarray, x_in: np.ndarray, w_name: str, b_name: str) -> np.ndarray:
        """``dW = dy^T x``, ``db = colsum dy`` into ``grad``; returns ``dx = dy W``."""
        dy_r = _rounded(dy, self.mode)
        self.g[w_name][...] = dense.gemm(dy_r, self.rnd(x_in), trans_a=True, mode=self.mode,
                                         rounded=True)
        self.g[b_name][...] = dense.bias_grad_reduce(dy)
        return dense.gemm(dy_r, self.rnd(self.p[w_name]), mode=self.mode, rounded=True)

    def trunk(self, dh2_masked: np.ndarray, act: Activations) -> None:
        """``W_s2``, ``b_s2`` then (through h1's ReLU) ``W_s1``, ``b_s1`` from the masked d h2."""
        dh1 = dense.relu_mask(self.dense(dh2_masked, act.h1, "w_s2", "b_s2"), act.h1)
        self.dense(dh1, act.x, "w_s1", "b_s1")


def _masked_trunk_grad(parts: np.ndarray, act: Activations, h2_bound: float | None):
    """``step.h2_grad_sum_mask`` of ``parts`` ``[K, N, SH2]``: ``(dh2 sum, masked)``. Without the
    clamp (``h2_bound`` None) only the ReLU applies: the kernel's "the clamp left it unchanged"
    test would also zero the gradient of a NaN h2, which relu_mask passes."""
    trunk = step_kernels.h2_grad_sum_mask(parts, act.h2, act.h2_pre_clamp)
    masked = trunk.out if h2_bound is not None else dense.relu_mask(trunk.dh2, act.h2_pre_clamp)
    return trunk.dh2, masked


def backward(config: DQNConfig, layout: ParamLayout, params: np.ndarray, act: Activations,
             dlogits: list[np.ndarray], *, h2_bound: float | None = None,
             trace: dict | None = None, aux_d_h2: np.ndarray | None = None) -> np.ndarray:
    """Gradient (flat f32, layout order, padding zero) of a loss whose gradient w.r.t. each
    branch's logits is ``dlogits[d] [N, n_d, NA]``.

    Chain: dueling backward (``dv`` summed over branches), head GEMMs with ReLU masks and bias
    reductions, ``dh2`` summed over every branch then the value head (the trunk-gradient
    buffer), then, if ``aux_d_h2`` ``[N, SH2]`` is given (the auxiliary heads' weighted d h2),
    ``dh2 = saxpy(dh2, aux_d_h2, 1)`` (isfinite-guarded: a non-finite element is skipped),
    then masked by the Mech 10 clamp (zero gradient where the clamp changed the value) and the
    trunk ReLU (``step.h2_grad_sum_mask``), then the trunk. Only the core tensors of the
    result are written.

    ``trace``, if given, receives the intermediate gradients the sentinels watch:
    ``d_value_logits`` (``dv``), ``d_adv_logits`` (every branch's ``dadv``, flattened),
    ``d_h2`` (after the heads, before the auxiliary SAXPY and the trunk) and, with
    ``aux_d_h2``, ``d_h2_post_aux`` (after the SAXPY).
    """
    grad = layout.zeros()
    bp = _Backprop(config, layout, params, grad)
    n_rows = act.x.shape[0]
    dv = np.zeros_like(act.v)
    dh2_parts = []  # each head's part of d h2: the branches in order, then the value head
    dadvs = []
    for d, n in enumerate(config.branches):
        br = branch_name(d)
        dv_d, dadv = distributional.dueling_combine_backward(dlogits[d])
        dv = dv + dv_d
        dadvs.append(dadv.ravel())
        dha = bp.dense(dadv.reshape(n_rows, n * config.num_atoms), act.ha[d], f"w_{br}2", f"b_{br}2")
        dha = dense.relu_mask(dha, act.ha[d])
        dh2_parts.append(bp.dense(dha, act.h2, f"w_{br}1", f"b_{br}1"))
    dhv = dense.relu_mask(bp.dense(dv, act.hv, "w_v2", "b_v2"), act.hv)
    dh2_parts.append(bp.dense(dhv, act.h2, "w_v1", "b_v1"))
    # The sum of the parts, then the backward through Mech 10's clamp (clamp_finite passes a
    # value through unchanged only where it was finite and in range) and the trunk ReLU.
    dh2, masked = _masked_trunk_grad(np.stack(dh2_parts), act, h2_bound)
    if trace is not None:
        trace.update(d_value_logits=dv, d_adv_logits=np.concatenate(dadvs), d_h2=dh2)
    if aux_d_h2 is not None:
        post_aux = optim.saxpy(dh2, aux_d_h2, np.float32(1))
        if trace is not None:
            trace["d_h2_post_aux"] = post_aux
        masked = _masked_trunk_grad(post_aux[None], act, h2_bound)[1]
    bp.trunk(masked, act)
    return grad


def trunk_backward(config: DQNConfig, layout: ParamLayout, params: np.ndarray, act: Activations,
                   dh2: np.ndarray, *, h2_bound: float | None) -> np.ndarray:
    """The trunk's gradient (flat f32, layout-sized; only ``w_s1 b_s1 w_s2 b_s2`` non-zero) of a
    loss whose gradient w.r.t. ``act.h2`` is ``dh2`` ``[N, SH2]``: the Mech 10 clamp mask and
    the ReLU mask of h2 (as in ``backward``), then ``W_s2``, h1's ReLU, ``W_s1``. The auxiliary
    sources' trunk backwards (IQN, ensemble) into their own scratch buffers use it."""
    grad = layout.zeros()
    _Backprop(config, layout, params, grad).trunk(_masked_trunk_grad(dh2[None], act, h2_bound)[1], act)
    return grad


def q_values(config: DQNConfig, act: Activations, z: np.ndarray) -> list[np.ndarray]:
    """Expected Q per branch, ``[N, n_d]`` each, on the support ``z``: ``[NA]`` shared by every
    branch, or ``[n_branches, NA]`` (branch d on ``z[d]``, ``DQNConfig.adaptive_atoms``)."""
    zs = [z] * len(act.logp) if z.ndim == 1 else list(z)
    return [distributional.expected_q(logp, zd) for logp, zd in zip(act.logp, zs)]
