"""The peer's networks: the branching dueling C51 network of SPEC 3 with the second-wave heads
that are on (``torch_wave``), parameters in the layout's order, and the step's GEMM FLOP count."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from foxhunt.reference.config import DQNConfig

from .torch_wave import AuxHeads, EnsemblePriors, IqnHead, wave_gemm_flops


class DuelingC51Net(nn.Module):
    """The branching dueling C51 network of SPEC 3 (parameters in the layout's GOFF order)."""

    def __init__(self, config: DQNConfig):
        super().__init__()
        c = config
        self.num_atoms = c.num_atoms
        self.branch_actions = tuple(c.branches)
        self.trunk = nn.Sequential(nn.Linear(c.state_dim, c.shared_h1), nn.ReLU(),
                                   nn.Linear(c.shared_h1, c.shared_h2), nn.ReLU())
        self.value = nn.Sequential(nn.Linear(c.shared_h2, c.value_h), nn.ReLU(),
                                   nn.Linear(c.value_h, c.num_atoms))
        self.branches = nn.ModuleList(
            nn.Sequential(nn.Linear(c.shared_h2, c.adv_h), nn.ReLU(),
                          nn.Linear(c.adv_h, n * c.num_atoms))
            for n in c.branches)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """``(h2, v, logp)``: the trunk's output ``[N, SH2]``, the value stream's logits ``[N, NA]``
        (float32) and, per branch, log-probabilities over the atoms, float32 ``[N, n_d, NA]``."""
        h2 = self.trunk(x)
        v = self.value(h2).float()
        logp = []
        for head, n in zip(self.branches, self.branch_actions):
            adv = head(h2).float().unflatten(-1, (n, self.num_atoms))
            logits = v.unsqueeze(1) + (adv - adv.mean(dim=1, keepdim=True))
            logp.append(F.log_softmax(logits, dim=-1))
        return h2, v, logp


class PeerNet(nn.Module):
    """The core network and the second-wave heads that are on; ``parameters()`` yields them in
    the layout's order (core, aux, IQN, ensemble priors)."""

    def __init__(self, config: DQNConfig):
        super().__init__()
        self.core = DuelingC51Net(config)
        self.aux = AuxHeads(config) if config.aux_on else None
        self.iqn = IqnHead(config) if config.iqn_on else None
        self.ens = EnsemblePriors(config) if config.ens_on else None


def step_gemm_flops(config: DQNConfig) -> int:
    """GEMM floating-point operations of one step: three forward passes (online(s), online(s2),
    target(s2)) and two backward passes (C51, CQL: weight gradients of every layer and input
    gradients of every layer but the first), plus the second-wave sources that are on
    (``torch_wave.wave_gemm_flops``). Spectral-norm matrix-vector products (about
    ``4 * params``) and the elementwise work are not counted."""
    c = config
    layers = [(c.state_dim, c.shared_h1), (c.shared_h1, c.shared_h2), (c.shared_h2, c.value_h),
              (c.value_h, c.num_atoms)]
    for n in c.branches:
        layers += [(c.shared_h2, c.adv_h), (c.adv_h, n * c.num_atoms)]
    macs = sum(i * o for i, o in layers)
    first = layers[0][0] * layers[0][1]
    forward = 2 * c.batch_size * macs
    backward = 2 * c.batch_size * macs + 2 * c.batch_size * (macs - first)
    return 3 * forward + 2 * backward + wave_gemm_flops(config)


__all__ = ["DuelingC51Net", "PeerNet", "step_gemm_flops"]
