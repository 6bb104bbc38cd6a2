"""The second-wave gradient sources of SPEC 4 (issue 18 contract) written idiomatically in PyTorch,
for the peer ``torch_step.TorchStep``: the modules (parameters in the layout's order) and the
loss functions, whose gradients autograd takes.

- IQN head (``IqnHead``, ``iqn_loss``): ``cos[m, k] = cos(pi k tau[m])`` (float64, rounded to
  float32 once, as the reference), ``phi = relu(Linear(cos))``, ``e = h2[m // N] * phi``,
  ``q = Linear(e)`` ``[B N, A]``; the quantile Huber loss (kappa = 1) of the online quantiles at
  the taken actions against ``y = r + gamma_d (1 - done) q'`` of the target head (target
  parameters, target ``h2`` of s2, its own fractions) at the double-DQN actions:
  ``loss = sum_{d,b,i,j} isw_b |tau_bi - 1{u < 0}| huber(u) / (B D N)``,
  ``u = y[b, j, d] - q[b N + i, off_d + a_d]``.
- Auxiliary heads (``AuxHeads``, ``aux_losses``): ``hidden = elu(Linear(h2))``; next-bar
  regression ``mean over finite labels of (pred - next_ret / max(scale, 1e-6))^2`` with the ISV
  117 label scale (``label_scale_update``); regime cross-entropy.
- Ensemble diversity (``EnsemblePriors``, ``ens_loss``): frozen randomized prior heads
  ``v_k = Linear(relu(Linear(h2)))`` on a detached ``h2`` (the reference sends no gradient
  through them); ``loss = -(1/(B (K-1))) sum_b sum_k KL(softmax(v_k) || softmax(v))``.
- MSE warm-up (``mse_loss``): ``(1/nb) sum_d sum_b isw_b 0.5 (E_d[b] - y_d[b])^2 / B`` with the
  online expected Q of the taken action and the scalar target ``r + gamma (1 - done) E_{p'}[z]``.

Left out, as in the core peer (no-ops on finite, in-range data): the Mech 1 clip of the IQN
and MSE targets, the input range guard and output sanitisation around the IQN and ensemble
trunk backwards, the isfinite guard of the IQN ``d h2`` sum and the aux ``d h2`` SAXPY.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from foxhunt.reference.config import SECOND_WAVE_SOURCES, DQNConfig
from foxhunt.reference.isv import SHARPE_EMA_INDEX, adaptive_ema_rate
from foxhunt.reference.kernels.aux import LABEL_SCALE_FLOOR
from foxhunt.reference.kernels.fused import branch_offsets
from foxhunt.reference.kernels.warmup import warmup_weight

#: Each second-wave source alone, as the config fields that turn it on (``config``'s single
#: definition). The tests and the step benchmarks use these, alone and together.
WAVE_SOURCES = SECOND_WAVE_SOURCES

#: The auxiliary heads in layout order: (key, config weight field).
AUX_KEYS = (("nb", "aux_next_bar_weight"), ("rg", "aux_regime_weight"))


class AuxHeads(nn.Module):
    """The auxiliary heads that are on, each ``Linear(SH2, AXH) -> ELU -> Linear(AXH, out)``
    (``w_nb1, b_nb1, w_nb2, b_nb2`` then ``w_rg1 ...``: the layout's order)."""

    def __init__(self, config: DQNConfig):
        super().__init__()
        c = config
        self.heads = nn.ModuleDict()
        for key, weight in AUX_KEYS:
            if getattr(c, weight) > 0:
                out = 1 if key == "nb" else c.n_regimes
                self.heads[key] = nn.Sequential(nn.Linear(c.shared_h2, c.aux_hidden), nn.ELU(),
                                                nn.Linear(c.aux_hidden, out))


class IqnHead(nn.Module):
    """``phi = relu(Linear(n_cos, SH2)(cos))``, ``q = Linear(SH2, A)(h2 repeated N times * phi)``
    (``w_phi, b_phi, w_iq, b_iq``)."""

    def __init__(self, config: DQNConfig):
        super().__init__()
        c = config
        self.n_quantiles = c.iqn_quantiles
        self.phi = nn.Linear(c.iqn_embed, c.shared_h2)
        self.out = nn.Linear(c.shared_h2, sum(c.branches))
        self.register_buffer("k", torch.arange(c.iqn_embed, dtype=torch.float64), persistent=False)

    def cosines(self, tau: torch.Tensor) -> torch.Tensor:
        """``cos(pi * (k * tau))`` ``[M, n_cos]``, in float64 then rounded (the reference's)."""
        return torch.cos(math.pi * (tau.double()[:, None] * self.k)).float()

    def forward(self, h2: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        """Quantiles ``[B N, A]`` (float32) of the fractions ``tau [B N]`` on ``h2 [B, SH2]``."""
        phi = F.relu(self.phi(self.cosines(tau)))
        e = h2.repeat_interleave(self.n_quantiles, dim=0) * phi
        return self.out(e).float()


class EnsemblePriors(nn.Module):
    """The ``K - 1`` frozen prior heads ``Linear(SH2, VH) -> ReLU -> Linear(VH, NA)``
    (``w_e{k}1, b_e{k}1, w_e{k}2, b_e{k}2``); ``requires_grad`` off: never trained."""

    def __init__(self, config: DQNConfig):
        super().__init__()
        c = config
        self.heads = nn.ModuleList(
            nn.Sequential(nn.Linear(c.shared_h2, c.value_h), nn.ReLU(),
                          nn.Linear(c.value_h, c.num_atoms))
            for _ in range(1, c.ens_heads))
        self.requires_grad_(False)


class WaveConstants:
    """What the losses need from the config, as plain Python numbers and small tensors."""

    def __init__(self, config: DQNConfig, device: torch.device):
        c = config
        self.batch, self.n_branches, self.n_quantiles = c.batch_size, c.n_branches, c.iqn_quantiles
        self.offsets = torch.tensor(branch_offsets(c.branches), dtype=torch.int64, device=device)
        self.gammas = torch.tensor(c.gammas, dtype=torch.float32, device=device)
        self.weights = {key: float(getattr(c, weight)) for key, weight in AUX_KEYS}
        self.label_floor = float(LABEL_SCALE_FLOOR)


def iqn_loss(k: WaveConstants, q: torch.Tensor, q_target: torch.Tensor, tau: torch.Tensor,
             a: torch.Tensor, a_star: torch.Tensor, r: torch.Tensor, done: torch.Tensor,
             isw: torch.Tensor, gammas: torch.Tensor | None = None) -> torch.Tensor:
    """The quantile Huber loss (module docstring). ``q``, ``q_target`` ``[B N, A]`` (``q_target``
    without gradient), ``tau [B N]`` the online fractions, ``a``, ``a_star`` int64
    ``[B, D]``; ``gammas`` the per-sample effective gammas ``[B, D]`` of n-step batches (None:
    the branches' gammas)."""
    B, N, D = k.batch, k.n_quantiles, k.n_branches
    taken = q.view(B, N, -1).gather(2, (k.offsets + a)[:, None, :].expand(B, N, D))      # [B, i, D]
    best = q_target.view(B, N, -1).gather(2, (k.offsets + a_star)[:, None, :].expand(B, N, D))
    g = k.gammas if gammas is None else gammas[:, None, :]
    y = r[:, None, None] + g * (1.0 - done)[:, None, None] * best                       # [B, j, D]
    u = y[:, None, :, :] - taken[:, :, None, :]                                         # [B, i, j, D]
    weight = (tau.view(B, N, 1, 1) - (u.detach() < 0).float()).abs()
    rho = weight * F.huber_loss(u, torch.zeros_like(u), reduction="none", delta=1.0)
    return (isw[:, None, None, None] * rho).sum() / (B * D * N)


def label_scale_update(scale: torch.Tensor, next_ret: torch.Tensor, alpha: float) -> torch.Tensor:
    """ISV 117 (``kernels.aux.isv_label_scale_update``): the RMS of the finite ``next_ret``;
    replaces a slot that is not > 0, else ``(1 - alpha) old + alpha rms``; no finite return keeps
    the slot. ``scale`` ``[1]`` float32."""
    finite = torch.isfinite(next_ret)
    count = finite.sum()
    rms = (torch.where(finite, next_ret, 0.0).square().sum() / count.clamp_min(1)).sqrt()
    new = torch.where(scale > 0, (1.0 - alpha) * scale + alpha * rms, rms)
    return torch.where(count > 0, new, scale)


def label_scale_rate(isv) -> float:
    """The label scale's EMA rate (SPEC 7) from the Sharpe slot of an ISV vector (None: the cold
    start, a NaN Sharpe: ``alpha_base``)."""
    return float(adaptive_ema_rate(float("nan") if isv is None else float(isv[SHARPE_EMA_INDEX])))


def aux_losses(k: WaveConstants, heads: AuxHeads, h2: torch.Tensor, next_ret: torch.Tensor,
               regime: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"nb": L_nb, "rg": L_rg}`` of the heads that are on (unweighted, float32). ``scale``: the
    label scale already updated from this batch."""
    out = {}
    if "nb" in heads.heads:
        pred = heads.heads["nb"](h2).float().squeeze(-1)
        label = next_ret / scale.clamp_min(k.label_floor)
        valid = torch.isfinite(label)
        diff = pred - torch.where(valid, label, 0.0)  # a masked label must not poison the gradient
        out["nb"] = torch.where(valid, diff.square(), 0.0).sum() / valid.sum().clamp_min(1)
    if "rg" in heads.heads:
        out["rg"] = F.cross_entropy(heads.heads["rg"](h2).float(), regime)
    return out


def ens_loss(priors: EnsemblePriors, h2: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``-(1/(B (K-1))) sum_b sum_k KL(softmax(v_k) || softmax(v))``; ``v [B, NA]`` the value
    stream's logits (float32), the priors on ``h2`` without gradient."""
    logp0 = F.log_softmax(v, dim=-1)
    with torch.no_grad():
        logpk = torch.stack([F.log_softmax(head(h2).float(), dim=-1) for head in priors.heads])
    kl = F.kl_div(logp0.expand_as(logpk), logpk, reduction="none", log_target=True).sum()
    return -kl / (v.shape[0] * len(priors.heads))


def mse_loss(k: WaveConstants, q_taken: torch.Tensor, target_q: torch.Tensor,
             isw: torch.Tensor) -> torch.Tensor:
    """``sum_{b,d} isw_b 0.5 (q_taken - target_q)^2 / (B nb)``; ``[B, nb]`` each, ``target_q``
    without gradient."""
    return (isw[:, None] * 0.5 * (q_taken - target_q).square()).sum() / (k.batch * k.n_branches)


def mse_weight(config: DQNConfig, epoch: float) -> float:
    """The warm-up blend weight ``max(0, 1 - epoch / W)`` (float32, the reference's rounding)."""
    return float(warmup_weight(epoch, config.c51_warmup_epochs))


def wave_gemm_flops(config: DQNConfig) -> int:
    """GEMM floating-point operations the second-wave sources that are on add to a step
    (``torch_step.step_gemm_flops`` adds them):

    - auxiliary heads: a forward on online(s) (2 layers) and, in the C51 backward, the weight
      gradients of both layers and the input gradients of both (``d hidden``, ``d h2``);
    - IQN: the head's forward twice (online, target: ``cos -> phi`` and ``e -> q`` on ``B N``
      rows), its backward (both weight gradients, the input gradient of ``e -> q``) and a trunk
      backward (``W_s2``, ``W_s1`` weight gradients and ``d h1``);
    - ensemble: the ``K - 1`` priors' forward (2 layers each) and a backward through the value
      head (weight and input gradients of both layers) and the trunk (as IQN's).

    The MSE warm-up adds no GEMM."""
    c = config
    B = c.batch_size
    trunk = 2 * B * (c.shared_h1 * c.shared_h2 * 2 + c.state_dim * c.shared_h1)
    total = 0
    for key, weight in AUX_KEYS:
        if getattr(c, weight) > 0:
            out = 1 if key == "nb" else c.n_regimes
            macs = c.shared_h2 * c.aux_hidden + c.aux_hidden * out
            total += 2 * B * macs * 3
    if c.iqn_on:
        M, A = B * c.iqn_quantiles, sum(c.branches)
        phi, out = c.iqn_embed * c.shared_h2, c.shared_h2 * A
        total += 2 * (2 * M * (phi + out)) + 2 * M * (phi + 2 * out) + trunk
    if c.ens_on:
        value = c.shared_h2 * c.value_h + c.value_h * c.num_atoms
        total += 2 * B * value * (c.ens_heads - 1) + 2 * B * value * 2 + trunk
    return total


__all__ = ["AUX_KEYS", "WAVE_SOURCES", "AuxHeads", "EnsemblePriors", "IqnHead", "WaveConstants",
           "aux_losses", "ens_loss", "iqn_loss", "label_scale_rate", "label_scale_update", "mse_loss",
           "mse_weight", "wave_gemm_flops"]
