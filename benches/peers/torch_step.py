"""The foxhunt training step (SPEC 4) written idiomatically in PyTorch: the benchmarks' peer.

One ``TorchStep.step(batch)`` does what the reference ``Trainer.step`` does to the learning state:

1. three forward passes: online(s) with autograd, online(s2) and target(s2) without; double-DQN
   action choice ``a*_d = argmax_a Q_d(s2)`` (first index on ties, as ``torch.argmax``);
2. C51 loss with the dense triangular projection ``m_i = sum_j p'_j clip(1 - |Tz_j - z_i|/dz, 0, 1)``
   (no floor/ceil, no scatter) and CQL loss, each averaged over branches;
3. the second-wave sources that are on (``torch_wave``; issue 18 contract): the MSE warm-up
   blended into the C51 loss ``(1 - w) c51 + w mse``, ``w = max(0, 1 - epoch / W)``
   (``set_epoch``); the auxiliary heads' weighted losses added to it (so their gradients sit in
   the C51 budget); the IQN head (its quantile fractions from the reference's Philox generator,
   ``torch_philox.TauTable``); the ensemble diversity against frozen prior heads;
4. one backward pass (``torch.autograd.grad``) per source, so each has its own gradient: C51
   (+ aux) over the core and aux parameters, CQL over the core, IQN over the trunk and the IQN
   head, the ensemble over the trunk and value head;
5. budgets: ``grad = clipped(grad_c51, 0.70 mgn) + clipped(grad_cql, 0.15 mgn)``, then
   ``grad[trunk] += lambda_iqn * clipped(iqn_trunk, 0.10 mgn)`` and ``grad[trunk + value] +=
   ens_weight * clipped(ens, 0.05 mgn)``, with ``clipped(x, m) = x * (m/n if n > m else 1)``,
   ``n = ||x||_2`` over the source's parameters;
6. Adam (``torch.optim.AdamW``, decoupled weight decay as the reference; 0 by default) after the
   global safety clip ``clip_grad_norm_(params, mgn)`` over the core and aux parameters; the IQN
   head's own AdamW on its own gradient, clipped at ``mgn`` by its own norm (the ensemble
   priors are frozen: no optimiser);
7. spectral norm on every trained weight matrix (core, aux, IQN): one power iteration with
   persistent ``u``, ``v`` (``u = normalize(W v)``, ``v = normalize(W^T u)``, ``sigma = u . W v``),
   ``W *= sigma_max/sigma`` where ``sigma > sigma_max``;
8. Polyak target update ``target = lerp(target, online, tau)``; the ISV 117 label scale (the
   next-bar head's) is an EMA of the batches' return RMS kept on the device.

What it leaves out, on purpose: the safety mechanisms that are no-ops on finite, in-range data
(Mech 1 target-Q clip, also of the IQN and MSE targets; Mech 9 weight clamp; Mech 10 h2 clamp;
the per-element isfinite guards of the SAXPYs and Adam; the input guard and output sanitisation
around the IQN and ensemble trunk backwards), the sentinel checks, the ISV producers other than
the label scale (Q_ABS_REF and H_S2_RMS_EMA only move the bounds of those no-op clamps), the
BF16 weight mirrors and the deferred scalar readback. They cost the fast path work the peer
does not do, so the comparison favours the peer slightly.

Precision: ``config.precision == "f32"`` runs everything in float32 (PyTorch's default: no TF32);
``"tf32"`` the same with float32 matmuls on TF32 tensor cores
(``torch.backends.cuda.matmul.allow_tf32`` on for the peer's calls and restored after);
``"bf16"`` runs the network's forward passes (heads included) under
``torch.autocast(dtype=torch.bfloat16)`` (the Linear layers, hence their backward GEMMs, in
BF16); the dueling head, log-softmax, losses, projection and optimisers stay float32.

Execution modes (``MODES``):

- ``"eager"``: plain PyTorch; foreach kernels for the optimisers and the gradient lists.
- ``"compile"``: ``torch.compile`` (default mode) on the three regions around the autograd calls
  (forward + losses, with its AOT-compiled backward; budgets; clips + Adams + spectral norm +
  Polyak).
- ``"graph"``: the whole eager step (upload excluded) captured once in a ``torch.cuda.CUDAGraph``
  and replayed (Adam with ``capturable=True``); CUDA only.
- ``"compile-graph"``: the compiled regions captured the same way; CUDA only.

The IQN quantile fractions stay capturable: they are precomputed on the device for a block of
steps outside the step (``torch_philox.TauTable``, whose docstring says why that is fair) and
the step reads its row through a device-side counter. The MSE blend weight and the label scale
are device tensors too.

Batches arrive as host ``Batch`` objects (NumPy), as the fast trainer gets them: on CUDA each
step copies the batch into a pinned staging buffer (two, alternating, each guarded by an event)
and from there into static device tensors with ``non_blocking=True``. ``step`` never synchronises;
``synchronize()`` and ``read_scalars()`` do.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from foxhunt.reference.backend import check_epoch
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import BUDGET_SOURCES, DQNConfig
from foxhunt.reference.isv import AUX_LABEL_SCALE_EMA_INDEX, EPOCH_IDX_INDEX
from foxhunt.reference.kernels.distributional import DISCOUNT_FLOOR, GAMMA_FLOOR, support
from foxhunt.reference.kernels.rng import STREAMS
from foxhunt.reference.kernels.spectral import SPECTRAL_EPS, init_spectral_vectors
from foxhunt.reference.layout import FROZEN_GROUPS, ParamLayout, init_params
from foxhunt.reference.step import check_n_step

from .torch_net import DuelingC51Net, PeerNet, step_gemm_flops
from .torch_philox import TauTable
from .torch_runtime import (BATCH_FIELDS, BatchUpload, allow_many_compiled_instances,
                            batch_fields, count_graph_nodes)
from .torch_wave import (WaveConstants, aux_losses, ens_loss, iqn_loss, label_scale_rate,
                         label_scale_update, mse_loss, mse_weight)

MODES = ("eager", "compile", "graph", "compile-graph")
COMPILED_MODES = frozenset({"compile", "compile-graph"})
CAPTURED_MODES = frozenset({"graph", "compile-graph"})

#: Steps run on a side stream before a CUDA graph is captured (allocator pools, cuBLAS
#: workspaces, Adam state, Triton autotuning). They train on the first batch.
CAPTURE_WARMUP_STEPS = 3

#: Steps whose IQN quantile fractions one ``TauTable`` block holds, per device type (CPU: the
#: tests' few steps; CUDA: about 10 MB at the seed size, generated a few microseconds per step).
TAU_BLOCK_STEPS = {"cpu": 4, "cuda": 1024}

#: Scalars ``step`` returns (device tensors; ``read_scalars`` turns them into floats, 0 for a
#: second-wave source that is off, as the reference's ``StepScalars``).
SCALARS = ("loss", "c51_loss", "cql_loss", "c51_norm_pre", "cql_norm_pre", "grad_norm",
           "iqn_loss", "iqn_norm_pre", "ens_loss", "ens_norm_pre", "aux_next_bar_loss",
           "aux_regime_loss", "mse_loss", "mse_weight")


def _global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm over a list of tensors (what ``clip_grad_norm_`` computes)."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)))


def _budget_scale(norm: torch.Tensor, budget: float) -> torch.Tensor:
    """``budget / norm`` where ``norm > budget``, else 1 (no host sync)."""
    return torch.where(norm > budget, budget / norm, torch.ones_like(norm))


class TorchStep:
    """The training step in PyTorch (module docstring). Initial state identical to the reference
    ``Trainer(config, seed)``, or to a reference ``state_dict`` given as ``state``."""

    def __init__(self, config: DQNConfig, *, mode: str = "eager", device: str | torch.device | None = None,
                 seed: int = 0, state: dict[str, np.ndarray] | None = None, n_step: int = 1):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: allowed values are {MODES}")
        device = torch.device(device if device is not None else
                              ("cuda" if torch.cuda.is_available() else "cpu"))
        if mode in CAPTURED_MODES and device.type != "cuda":
            raise ValueError(f"mode={mode!r} captures a CUDA graph; device={device} is not a CUDA device")
        c = config
        self.config = config
        self.mode = mode
        self.device = device
        self.layout = ParamLayout(config)
        self.autocast = config.precision == "bf16"
        self.tf32 = config.precision == "tf32"
        self.gammas = config.gammas
        # n-step batches (issue 22): the targets use each sample's effective gamma.
        self.n_step_on = check_n_step(config, n_step)
        self.log_gamma_ref = float(np.log(np.float32(config.gammas[0])))
        lo, hi = np.float32(config.v_min), np.float32(config.v_max)
        self.v_min, self.v_max = float(lo), float(hi)
        self.dz = float((hi - lo) / np.float32(config.num_atoms - 1))  # float32, as the reference
        self.z = torch.from_numpy(support(config.v_min, config.v_max, config.num_atoms)).to(device)
        self.alpha = float(config.cql_alpha)
        self.sigma_max = float(config.sigma_max)
        self.sn_eps = float(SPECTRAL_EPS)
        self.budget = {src: float(config.budget(src)) for src in BUDGET_SOURCES}
        self.wave = WaveConstants(config, device)

        self.online = PeerNet(config).to(device)
        self.params = list(self.online.parameters())  # every layout tensor, in layout order
        shapes = [tuple(p.shape) for p in self.params]
        expected = [t.shape for t in self.layout.tensors]
        if shapes != expected:
            raise AssertionError(f"parameter order/shapes {shapes} differ from the layout's {expected}")
        # The parameter groups of the sources, layout order within each: the main Adam's (core
        # and aux heads), the IQN head's, the trunk and value head (the IQN and ensemble trunk
        # gradients), the trained weight matrices (spectral norm).
        pairs = list(zip(self.params, self.layout.tensors))
        self.core_params = [p for p, t in pairs if t.is_core]
        self.main_params = [p for p, t in pairs if t.group not in ("iqn", *FROZEN_GROUPS)]
        self.iqn_params = [p for p, t in pairs if t.group == "iqn"]
        self.trunk_params = [p for p, t in pairs if t.group == "trunk"]
        self.value_params = [p for p, t in pairs if t.group == "value"]
        self.weights = [p for p, t in pairs if t in self.layout.weight_matrices]
        self.target = copy.deepcopy(self.online).requires_grad_(False)
        self.target_params = list(self.target.parameters())
        self.sn_u: list[torch.Tensor] = []
        self.sn_v: list[torch.Tensor] = []
        for i, t in enumerate(self.layout.weight_matrices):
            u, v = init_spectral_vectors(t.shape, seed * 1000 + i)
            self.sn_u.append(torch.from_numpy(u).to(device))
            self.sn_v.append(torch.from_numpy(v).to(device))
        cuda = device.type == "cuda"
        self._foreach = cuda
        adam = dict(lr=c.lr, betas=(c.beta1, c.beta2), eps=c.adam_eps, weight_decay=c.weight_decay,
                    foreach=cuda, capturable=mode in CAPTURED_MODES)
        self.opt = torch.optim.AdamW(self.main_params, **adam)
        self.opt_iqn = torch.optim.AdamW(self.iqn_params, **adam) if c.iqn_on else None
        # Second-wave state on the device: the label scale (ISV 117), the MSE blend weight, the
        # IQN fractions' table and the step count that is the generator's offset.
        self.label_scale = torch.zeros(1, dtype=torch.float32, device=device)
        self.mse_w = torch.zeros(1, dtype=torch.float32, device=device)
        self.label_alpha = label_scale_rate(None)
        self.seed = int(seed)
        self.step_count = 0
        self._taus = (TauTable(self.seed, (STREAMS["iqn_tau_online"], STREAMS["iqn_tau_target"]),
                               c.batch_size * c.iqn_quantiles, TAU_BLOCK_STEPS[device.type], device)
                      if c.iqn_on else None)
        self.set_epoch(0)
        self.load_state(state if state is not None else self._initial_state(seed))

        self.uploader = BatchUpload(config, device, self.n_step_on)
        self.inputs = self.uploader.inputs

        if mode in COMPILED_MODES:
            allow_many_compiled_instances()
            # Static shapes: each instance's shapes never change; a new instance (another batch
            # size in the scaling benchmark) gets its own specialised graphs.
            self._loss_fn = torch.compile(self._losses, dynamic=False)
            self._budget_fn = torch.compile(self._budgets, dynamic=False)
            self._optim_fn = torch.compile(self._optimize, dynamic=False)
        else:
            self._loss_fn, self._budget_fn, self._optim_fn = self._losses, self._budgets, self._optimize
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_out: dict[str, torch.Tensor] | None = None
        #: Nodes of the captured CUDA graph (captured modes, once captured; None if unknown).
        self.graph_nodes: int | None = None

    # ------------------------------------------------------------------ state
    def _initial_state(self, seed: int) -> dict[str, np.ndarray]:
        params = init_params(self.layout, seed)
        return {"params": params, "target": params.copy()}

    def _views(self, flat: np.ndarray) -> list[torch.Tensor]:
        return [torch.from_numpy(np.ascontiguousarray(flat[t.offset:t.end]).reshape(t.shape))
                for t in self.layout.tensors]

    def _flat(self, tensors: Sequence[torch.Tensor], params: Sequence[torch.Tensor] | None = None
              ) -> np.ndarray:
        """A layout-sized flat buffer holding ``tensors``, one per parameter of ``params``
        (default: every parameter); zero elsewhere."""
        where = {id(p): t for p, t in zip(self.params, self.layout.tensors)}
        flat = self.layout.zeros()
        for p, x in zip(params if params is not None else self.params, tensors):
            t = where[id(p)]
            flat[t.offset:t.end] = x.detach().float().cpu().numpy().ravel()
        return flat

    @torch.no_grad()
    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Load the learning state from a reference-style ``state_dict`` (``params``, ``target``;
        optionally ``adam_m``, ``adam_v``, ``adam_t``, ``sn_u.<w>`` / ``sn_v.<w>``, and the
        second wave's ``step``, ``seed`` and ``isv``: its label scale, epoch and Sharpe)."""
        for p, x in zip(self.params, self._views(state["params"])):
            p.copy_(x)
        for p, x in zip(self.target_params, self._views(state["target"])):
            p.copy_(x)
        t = int(state["adam_t"][0]) if "adam_t" in state else 0
        if t > 0:
            m_views, v_views = self._views(state["adam_m"]), self._views(state["adam_v"])
            for opt in (self.opt, self.opt_iqn):
                if opt is None:
                    continue
                for p in opt.param_groups[0]["params"]:
                    k = next(i for i, q in enumerate(self.params) if q is p)
                    step = torch.tensor(float(t), dtype=torch.float32,
                                        device=self.device if opt.defaults["capturable"] else "cpu")
                    opt.state[p] = {"step": step, "exp_avg": m_views[k].to(self.device).clone(),
                                    "exp_avg_sq": v_views[k].to(self.device).clone()}
        for k, t_spec in enumerate(self.layout.weight_matrices):
            if f"sn_u.{t_spec.name}" in state:
                self.sn_u[k].copy_(torch.from_numpy(state[f"sn_u.{t_spec.name}"]))
                self.sn_v[k].copy_(torch.from_numpy(state[f"sn_v.{t_spec.name}"]))
        if "step" in state:
            self.step_count = int(state["step"][0])
        if "seed" in state and self._taus is not None:
            self.seed = int(state["seed"][0])
            self._taus.rekey(self.seed)
        if "isv" in state:
            isv = state["isv"]
            self.label_scale.fill_(float(isv[AUX_LABEL_SCALE_EMA_INDEX]))
            self.label_alpha = label_scale_rate(isv)
            self.set_epoch(int(isv[EPOCH_IDX_INDEX]))

    def set_epoch(self, epoch: int) -> None:
        """The epoch counter (ISV ``EPOCH_IDX``): sets the MSE warm-up's blend weight."""
        epoch = check_epoch(epoch)
        if self.config.mse_on:
            self.mse_w.fill_(mse_weight(self.config, epoch))

    def export_state(self) -> dict[str, np.ndarray]:
        """``params``, ``target``, ``adam_m``, ``adam_v`` (flat, layout order), ``sn_u.<w>``,
        ``sn_v.<w>`` and ``step``, with the reference ``state_dict``'s keys."""
        self.synchronize()
        opt_state = {**self.opt.state, **(self.opt_iqn.state if self.opt_iqn else {})}

        def moment(name: str) -> np.ndarray:
            return self._flat([opt_state.get(p, {}).get(name, torch.zeros_like(p))
                               for p in self.params])

        out = {"params": self._flat(self.params), "target": self._flat(self.target_params),
               "adam_m": moment("exp_avg"), "adam_v": moment("exp_avg_sq"),
               "step": np.array([self.step_count], np.int64)}
        for t, u, v in zip(self.layout.weight_matrices, self.sn_u, self.sn_v):
            out[f"sn_u.{t.name}"] = u.cpu().numpy().copy()
            out[f"sn_v.{t.name}"] = v.cpu().numpy().copy()
        return out

    # ------------------------------------------------------------------ the step's parts
    def _gamma_eff(self, gamma: float, discount: torch.Tensor | None):
        """Branch gamma of the targets: ``gamma`` (1-step), or per sample ``fmax(gamma, 1e-6) **
        (log(fmax(discount, 1e-9)) / log(gamma_ref))`` ``[B]`` (n-step; the reference's
        ``effective_gamma``, whose discount is also clamped to at most 1)."""
        if discount is None:
            return gamma
        floor = torch.tensor(float(DISCOUNT_FLOOR), dtype=discount.dtype, device=discount.device)
        n_eff = torch.log(torch.fmin(torch.fmax(discount, floor), torch.ones_like(floor))) \
            / self.log_gamma_ref
        return torch.pow(max(gamma, float(GAMMA_FLOOR)), n_eff)

    def _project(self, p_next: torch.Tensor, r: torch.Tensor, done: torch.Tensor,
                 gamma) -> torch.Tensor:
        """Dense triangular C51 projection ``[B, NA]`` (SPEC 4 step 2); ``gamma`` a float or the
        per-sample ``[B]`` effective gammas."""
        discount = gamma * (1.0 - done)
        tz = (r[:, None] + discount[:, None] * self.z).clamp(self.v_min, self.v_max)   # [B, j]
        weight = (1.0 - (tz[:, :, None] - self.z).abs() / self.dz).clamp(0.0, 1.0)     # [B, j, i]
        return torch.einsum("bj,bji->bi", p_next, weight)

    def _losses(self, x: dict[str, torch.Tensor], tau: torch.Tensor | None,
                label_scale: torch.Tensor, mse_w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every source's loss, ``td`` ``[B]``, ``a_star`` ``[B, n_branches]`` and the updated
        ``label_scale``. ``main`` is the C51 source's loss: the (blended) C51 loss plus the
        weighted auxiliary losses; ``c51`` the reported (blended) C51 loss."""
        c = self.config
        r, done, isw = x["r"], x["done"], x["isw"]
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            h2, v, logp = self.online.core(x["s"])
            with torch.no_grad():
                logp_next = self.online.core(x["s2"])[2]
                h2_target, _, logp_target = self.target.core(x["s2"])
        a = x["a"].long()
        nb = len(logp)
        c51 = cql = td = 0.0
        a_star, q_taken, target_q = [], [], []
        discount = x.get("discount")
        gamma_eff = [self._gamma_eff(g, discount) for g in self.gammas]
        for d, gamma in enumerate(gamma_eff):
            with torch.no_grad():
                q_next = (logp_next[d].exp() * self.z).sum(-1)                       # [B, n_d]
                best = q_next.argmax(dim=1)
                p_next = torch.take_along_dim(logp_target[d], best[:, None, None], dim=1).squeeze(1).exp()
                m = self._project(p_next, r, done, gamma)
                if c.mse_on:  # the scalar target E_{p'}[z] (Mech 1 clip: a no-op in range)
                    target_q.append(r + gamma * (1.0 - done) * (p_next * self.z).sum(-1))
            taken = a[:, d]
            logp_taken = torch.take_along_dim(logp[d], taken[:, None, None], dim=1).squeeze(1)
            ce = -(m * logp_taken).sum(-1)                                           # [B]
            c51 = c51 + (isw * ce).mean() / nb
            q = (logp[d].exp() * self.z).sum(-1)                                     # [B, n_d]
            q_taken.append(torch.take_along_dim(q, taken[:, None], dim=1).squeeze(1))
            cql = cql + self.alpha * (torch.logsumexp(q, dim=1) - q_taken[-1]).mean() / nb
            td = td + ce.detach() / nb
            a_star.append(best)
        a_star = torch.stack(a_star, dim=1)
        out = {"td": td, "a_star": a_star, "cql": cql, "label_scale": label_scale}
        if c.mse_on:
            out["mse"] = mse_loss(self.wave, torch.stack(q_taken, 1), torch.stack(target_q, 1), isw)
            c51 = (1.0 - mse_w[0]) * c51 + mse_w[0] * out["mse"]
        out["c51"] = out["main"] = c51
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            if c.aux_on:
                if c.aux_next_bar_on:
                    out["label_scale"] = label_scale_update(label_scale, x["next_ret"], self.label_alpha)
                regime = x["regime"].long() if c.aux_regime_on else None
                aux = aux_losses(self.wave, self.online.aux, h2, x.get("next_ret"), regime,
                                 out["label_scale"])
                for key, loss in aux.items():
                    out[key] = loss
                    out["main"] = out["main"] + self.wave.weights[key] * loss
            if c.iqn_on:
                q = self.online.iqn(h2, tau[0])
                with torch.no_grad():
                    q_target = self.target.iqn(h2_target, tau[1])
                gammas = None if discount is None else torch.stack(gamma_eff, dim=1)
                out["iqn"] = iqn_loss(self.wave, q, q_target, tau[0], a, a_star, r, done, isw,
                                      gammas)
            if c.ens_on:
                out["ens"] = ens_loss(self.online.ens, h2, v)
        return out

    def _budgets(self, g_main, g_cql, g_iqn, g_ens):
        """The four-way budget pipeline over the main parameters (module docstring, step 5);
        returns the combined gradients and each source's pre-clip norm."""
        c, n_core, n_trunk = self.config, len(self.core_params), len(self.trunk_params)
        norms = {"c51": _global_norm(g_main), "cql": _global_norm(g_cql)}
        grads = torch._foreach_mul(g_main, _budget_scale(norms["c51"], self.budget["c51"]))
        cql_scale = _budget_scale(norms["cql"], self.budget["cql"])
        torch._foreach_add_(grads[:n_core], torch._foreach_mul(g_cql, cql_scale))
        for name, g, weight in (("iqn", g_iqn, c.lambda_iqn), ("ens", g_ens, c.ens_weight)):
            if g is None:
                continue
            g = g[:n_trunk] if name == "iqn" else g  # IQN: its trunk part (the rest is its head's)
            norms[name] = _global_norm(g)
            scale = weight * _budget_scale(norms[name], self.budget[name])
            torch._foreach_add_(grads[:len(g)], torch._foreach_mul(g, scale))  # trunk (+ value)
        return grads, norms

    @torch.no_grad()
    def _spectral_norm(self) -> None:
        sigma_max = self.sigma_max
        for w, u, v in zip(self.weights, self.sn_u, self.sn_v):
            u_new = F.normalize(w @ v, dim=0, eps=self.sn_eps)
            v_new = F.normalize(w.t() @ u_new, dim=0, eps=self.sn_eps)
            sigma = torch.dot(u_new, w @ v_new)
            w.mul_(torch.where(sigma > sigma_max, sigma_max / sigma, torch.ones_like(sigma)))
            u.copy_(u_new)
            v.copy_(v_new)

    def _optimize(self) -> torch.Tensor:
        """Safety clip and Adam (main; the IQN head's own clip and Adam), spectral norm, Polyak;
        returns the norm entering the main Adam."""
        mgn = self.config.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(self.main_params, mgn, foreach=self._foreach)
        self.opt.step()
        if self.opt_iqn is not None:
            torch.nn.utils.clip_grad_norm_(self.iqn_params, mgn, foreach=self._foreach)
            self.opt_iqn.step()
        self._spectral_norm()
        with torch.no_grad():
            torch._foreach_lerp_(self.target_params, self.params, self.config.tau)
        return grad_norm

    def _source_grads(self, out: dict[str, torch.Tensor]) -> tuple:
        """One ``autograd.grad`` per source: ``(g_main, g_cql, g_iqn, g_ens)`` (None when off);
        ``g_iqn`` holds the trunk's then the IQN head's gradients."""
        jobs = [("main", self.main_params), ("cql", self.core_params)]
        if "iqn" in out:
            jobs.append(("iqn", self.trunk_params + self.iqn_params))
        if "ens" in out:
            jobs.append(("ens", self.trunk_params + self.value_params))
        grads = {name: torch.autograd.grad(out[name], params, retain_graph=i < len(jobs) - 1)
                 for i, (name, params) in enumerate(jobs)}
        return grads["main"], grads["cql"], grads.get("iqn"), grads.get("ens")

    def _run_losses(self) -> dict[str, torch.Tensor]:
        tau = self._taus.row() if self._taus is not None else None
        return self._loss_fn(self.inputs, tau, self.label_scale, self.mse_w)

    def _train_step(self) -> dict[str, torch.Tensor]:
        out = self._run_losses()
        g_main, g_cql, g_iqn, g_ens = self._source_grads(out)
        grads, norms = self._budget_fn(g_main, g_cql, g_iqn, g_ens)
        for p, g in zip(self.main_params, grads):
            p.grad = g
        if g_iqn is not None:
            for p, g in zip(self.iqn_params, g_iqn[len(self.trunk_params):]):
                p.grad = g
        grad_norm = self._optim_fn()
        if self.config.aux_next_bar_on:
            with torch.no_grad():
                self.label_scale.copy_(out["label_scale"])
        if self._taus is not None:
            self._taus.advance()
        c51, cql = out["c51"].detach(), out["cql"].detach()
        result = {"loss": c51 + cql, "c51_loss": c51, "cql_loss": cql, "c51_norm_pre": norms["c51"],
                  "cql_norm_pre": norms["cql"], "grad_norm": grad_norm, "td_errors": out["td"]}
        for key, name in (("iqn", "iqn_loss"), ("ens", "ens_loss"), ("nb", "aux_next_bar_loss"),
                          ("rg", "aux_regime_loss"), ("mse", "mse_loss")):
            if key in out:
                result[name] = out[key].detach()
        for key in ("iqn", "ens"):
            if key in norms:
                result[f"{key}_norm_pre"] = norms[key]
        if self.config.mse_on:
            result["mse_weight"] = self.mse_w[0]
        return result

    def _executed(self) -> None:
        """Bookkeeping before a step that will execute (not merely be captured): the fractions'
        block covers it; the host step count advances with the device counter."""
        if self._taus is not None:
            self._taus.ensure(self.step_count)
        self.step_count += 1

    # ------------------------------------------------------------------ capture
    def _capture(self) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(CAPTURE_WARMUP_STEPS):
                self._executed()
                self._train_step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        try:
            graph = torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:  # older PyTorch: no keep_graph, no node count
            graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._train_step()
        if hasattr(graph, "instantiate"):
            try:
                graph.instantiate()
            except RuntimeError:
                pass  # already instantiated (keep_graph=False)
        self.graph_nodes = count_graph_nodes(graph)
        self._graph, self._graph_out = graph, out

    # ------------------------------------------------------------------ public interface
    @contextlib.contextmanager
    def _matmul_precision(self):
        """PyTorch's float32 matmuls on TF32 tensor cores for a ``tf32`` peer, exact for the
        others (a process-wide flag: set for the call, restored after)."""
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before

    def step(self, batch: Batch) -> dict[str, torch.Tensor]:
        """One training step on ``batch``; returns device tensors (the ``SCALARS`` of the sources
        that are on, and ``td_errors``) without synchronising."""
        self.uploader.upload(batch)
        with self._matmul_precision():
            if self.mode in CAPTURED_MODES:
                if self._graph is None:
                    self._capture()
                self._executed()
                self._graph.replay()
                return self._graph_out
            self._executed()
            return self._train_step()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def read_scalars(self, out: dict[str, torch.Tensor]) -> dict[str, float]:
        """Wait for the step that produced ``out`` and read its scalars as floats (0 for a source
        that is off)."""
        self.synchronize()
        return {k: float(out[k]) if k in out else 0.0 for k in SCALARS}

    def loss_and_grads(self, batch: Batch) -> dict[str, np.ndarray]:
        """Losses and per-source gradients of ``batch`` at the current step count, without
        updating anything, like the reference ``loss_and_grads``: ``c51_loss`` (blended),
        ``cql_loss``, ``td_errors [B]``, ``a_star [B, n_branches]``, ``grad_c51`` (with the aux
        heads' parameter gradients), ``grad_cql``; with their sources on ``iqn_loss``,
        ``grad_iqn_head``, ``grad_iqn_trunk``, ``ens_loss``, ``grad_ens`` (trunk and value
        head), ``aux_next_bar_loss``, ``aux_regime_loss``, ``mse_loss``, ``mse_weight`` and
        ``label_scale``. Gradients are flat float32 in layout order."""
        self.uploader.upload(batch)
        if self._taus is not None:
            self._taus.ensure(self.step_count)
        with self._matmul_precision():
            out = self._run_losses()
            g_main, g_cql, g_iqn, g_ens = self._source_grads(out)
        res = {"c51_loss": np.float32(out["c51"].item()), "cql_loss": np.float32(out["cql"].item()),
               "td_errors": out["td"].cpu().numpy(), "a_star": out["a_star"].int().cpu().numpy(),
               "grad_c51": self._flat(g_main, self.main_params),
               "grad_cql": self._flat(g_cql, self.core_params),
               "label_scale": np.float32(out["label_scale"].item())}
        for key, name in (("iqn", "iqn_loss"), ("ens", "ens_loss"), ("nb", "aux_next_bar_loss"),
                          ("rg", "aux_regime_loss"), ("mse", "mse_loss")):
            if key in out:
                res[name] = np.float32(out[key].item())
        if g_iqn is not None:
            n = len(self.trunk_params)
            res["grad_iqn_trunk"] = self._flat(g_iqn[:n], self.trunk_params)
            res["grad_iqn_head"] = self._flat(g_iqn[n:], self.iqn_params)
        if g_ens is not None:
            res["grad_ens"] = self._flat(g_ens, self.trunk_params + self.value_params)
        if self.config.mse_on:
            res["mse_weight"] = np.float32(self.mse_w.item())
        return res


__all__ = ["BATCH_FIELDS", "CAPTURE_WARMUP_STEPS", "MODES", "SCALARS", "DuelingC51Net", "PeerNet",
           "TorchStep", "batch_fields", "step_gemm_flops"]
