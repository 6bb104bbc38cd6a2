"""The foxhunt training step (SPEC 4) written idiomatically in PyTorch: the benchmarks' peer.

One ``TorchStep.step(batch)`` does what the reference ``Trainer.step`` does to the learning state:

1. three forward passes: online(s) with autograd, online(s2) and target(s2) without; double-DQN
   action choice ``a*_d = argmax_a Q_d(s2)`` (first index on ties, as ``torch.argmax``);
2. C51 loss with the dense triangular projection ``m_i = sum_j p'_j clip(1 - |Tz_j - z_i|/dz, 0, 1)``
   (no floor/ceil, no scatter) and CQL loss, each averaged over branches;
3. two backward passes (``torch.autograd.grad``), one per loss, so each source has its own
   gradient;
4. budgets: ``grad = clipped(grad_c51, 0.70 mgn) + clipped(grad_cql, 0.15 mgn)`` with
   ``clipped(x, m) = x * (m/n if n > m else 1)``, ``n = ||x||_2`` over all parameters;
5. Adam (``torch.optim.AdamW``, decoupled weight decay as the reference; 0 by default) after the
   global safety clip ``clip_grad_norm_(params, mgn)``;
6. spectral norm on every weight matrix: one power iteration with persistent ``u``, ``v``
   (``u = normalize(W v)``, ``v = normalize(W^T u)``, ``sigma = u . W v``), ``W *= sigma_max/sigma``
   where ``sigma > sigma_max``;
7. Polyak target update ``target = lerp(target, online, tau)``.

What it leaves out, on purpose: the safety mechanisms that are no-ops on finite, in-range data
(Mech 1 target-Q clip, Mech 9 weight clamp, Mech 10 h2 clamp, the per-element isfinite guards of
the SAXPYs and Adam), the sentinel checks, the ISV producers, the BF16 weight mirrors and the
deferred scalar readback. They cost the fast path work the peer does not do, so the comparison
favours the peer slightly. The IQN and ensemble sources are off in the reference too.

Precision: ``config.precision == "f32"`` runs everything in float32 (PyTorch's default: no TF32);
``"bf16"`` runs the network's forward passes under ``torch.autocast(dtype=torch.bfloat16)`` (the
Linear layers, hence their backward GEMMs, in BF16); the dueling head, log-softmax, losses,
projection and optimiser stay float32.

Execution modes (``MODES``):

- ``"eager"``: plain PyTorch; foreach kernels for the optimiser and the gradient lists.
- ``"compile"``: ``torch.compile`` (default mode) on the three regions around the autograd calls
  (forward + losses, with its AOT-compiled backward; budgets; clip + Adam + spectral norm + Polyak).
- ``"graph"``: the whole eager step (upload excluded) captured once in a ``torch.cuda.CUDAGraph``
  and replayed (Adam with ``capturable=True``); CUDA only.
- ``"compile-graph"``: the compiled regions captured the same way; CUDA only.

Batches arrive as host ``Batch`` objects (NumPy), as the fast trainer gets them: on CUDA each
step copies the batch into a pinned staging buffer (two, alternating, each guarded by an event)
and from there into static device tensors with ``non_blocking=True``. ``step`` never synchronises;
``synchronize()`` and ``read_scalars()`` do.
"""

from __future__ import annotations

import copy
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels.distributional import support
from foxhunt.reference.kernels.spectral import SPECTRAL_EPS, init_spectral_vectors
from foxhunt.reference.layout import ParamLayout, init_params

MODES = ("eager", "compile", "graph", "compile-graph")
COMPILED_MODES = frozenset({"compile", "compile-graph"})
CAPTURED_MODES = frozenset({"graph", "compile-graph"})

#: Steps run on a side stream before a CUDA graph is captured (allocator pools, cuBLAS
#: workspaces, Adam state, Triton autotuning). They train on the first batch.
CAPTURE_WARMUP_STEPS = 3

BATCH_FIELDS = ("s", "a", "r", "s2", "done", "isw")

#: Scalars ``step`` returns (device tensors; ``read_scalars`` turns them into floats).
SCALARS = ("loss", "c51_loss", "cql_loss", "c51_norm_pre", "cql_norm_pre", "grad_norm")


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

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Per branch, log-probabilities over the atoms, float32 ``[N, n_d, NA]``."""
        h2 = self.trunk(x)
        v = self.value(h2).float().unsqueeze(1)
        logp = []
        for head, n in zip(self.branches, self.branch_actions):
            adv = head(h2).float().unflatten(-1, (n, self.num_atoms))
            logits = v + (adv - adv.mean(dim=1, keepdim=True))
            logp.append(F.log_softmax(logits, dim=-1))
        return logp


def step_gemm_flops(config: DQNConfig) -> int:
    """GEMM floating-point operations of one step: three forward passes (online(s), online(s2),
    target(s2)) and two backward passes (C51, CQL: weight gradients of every layer and input
    gradients of every layer but the first). Spectral-norm matrix-vector products (about
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
    return 3 * forward + 2 * backward


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
                 seed: int = 0, state: dict[str, np.ndarray] | None = None):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: allowed values are {MODES}")
        device = torch.device(device if device is not None else
                              ("cuda" if torch.cuda.is_available() else "cpu"))
        if mode in CAPTURED_MODES and device.type != "cuda":
            raise ValueError(f"mode={mode!r} captures a CUDA graph; device={device} is not a CUDA device")
        self.config = config
        self.mode = mode
        self.device = device
        self.layout = ParamLayout(config)
        self.autocast = config.precision == "bf16"
        self.gammas = config.gammas
        lo, hi = np.float32(config.v_min), np.float32(config.v_max)
        self.v_min, self.v_max = float(lo), float(hi)
        self.dz = float((hi - lo) / np.float32(config.num_atoms - 1))  # float32, as the reference
        self.z = torch.from_numpy(support(config.v_min, config.v_max, config.num_atoms)).to(device)
        self.alpha = float(config.cql_alpha)
        self.sigma_max = float(config.sigma_max)
        self.sn_eps = float(SPECTRAL_EPS)
        self.budget_c51 = float(config.budget("c51"))
        self.budget_cql = float(config.budget("cql"))

        self.online = DuelingC51Net(config).to(device)
        self.params = list(self.online.parameters())
        shapes = [tuple(p.shape) for p in self.params]
        expected = [t.shape for t in self.layout.tensors]
        if shapes != expected:
            raise AssertionError(f"parameter order/shapes {shapes} differ from the layout's {expected}")
        self.weights = [p for p in self.params if p.ndim == 2]
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
        self.opt = torch.optim.AdamW(self.params, lr=config.lr, betas=(config.beta1, config.beta2),
                                     eps=config.adam_eps, weight_decay=config.weight_decay,
                                     foreach=cuda, capturable=mode in CAPTURED_MODES)
        self.load_state(state if state is not None else self._initial_state(seed))

        B, SD, nb = config.batch_size, config.state_dim, config.n_branches
        specs = {"s": ((B, SD), torch.float32), "a": ((B, nb), torch.int32),
                 "r": ((B,), torch.float32), "s2": ((B, SD), torch.float32),
                 "done": ((B,), torch.float32), "isw": ((B,), torch.float32)}
        self.inputs = {k: torch.zeros(shape, dtype=dt, device=device) for k, (shape, dt) in specs.items()}
        if cuda:
            self._staging = [{k: torch.empty(shape, dtype=dt, pin_memory=True)
                              for k, (shape, dt) in specs.items()} for _ in range(2)]
            self._staging_np = [{k: t.numpy() for k, t in slot.items()} for slot in self._staging]
            self._staged = [torch.cuda.Event(), torch.cuda.Event()]
            self._slot = 0

        if mode in COMPILED_MODES:
            _allow_many_instances()
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

    def _flat(self, tensors: Sequence[torch.Tensor]) -> np.ndarray:
        flat = self.layout.zeros()
        for t, x in zip(self.layout.tensors, tensors):
            flat[t.offset:t.end] = x.detach().float().cpu().numpy().ravel()
        return flat

    @torch.no_grad()
    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Load the learning state from a reference-style ``state_dict`` (``params``, ``target``;
        optionally ``adam_m``, ``adam_v``, ``adam_t`` and ``sn_u.<w>`` / ``sn_v.<w>``)."""
        for p, x in zip(self.params, self._views(state["params"])):
            p.copy_(x)
        for p, x in zip(self.target_params, self._views(state["target"])):
            p.copy_(x)
        t = int(state["adam_t"][0]) if "adam_t" in state else 0
        if t > 0:
            for p, m, v in zip(self.params, self._views(state["adam_m"]), self._views(state["adam_v"])):
                step = torch.tensor(float(t), dtype=torch.float32,
                                    device=self.device if self.opt.defaults["capturable"] else "cpu")
                self.opt.state[p] = {"step": step, "exp_avg": m.to(self.device).clone(),
                                     "exp_avg_sq": v.to(self.device).clone()}
        for k, t_spec in enumerate(self.layout.weight_matrices):
            if f"sn_u.{t_spec.name}" in state:
                self.sn_u[k].copy_(torch.from_numpy(state[f"sn_u.{t_spec.name}"]))
                self.sn_v[k].copy_(torch.from_numpy(state[f"sn_v.{t_spec.name}"]))

    def export_state(self) -> dict[str, np.ndarray]:
        """``params``, ``target``, ``adam_m``, ``adam_v`` (flat, layout order) and ``sn_u.<w>``,
        ``sn_v.<w>``, with the reference ``state_dict``'s keys."""
        self.synchronize()

        def moment(name: str) -> np.ndarray:
            return self._flat([self.opt.state.get(p, {}).get(name, torch.zeros_like(p))
                               for p in self.params])

        out = {"params": self._flat(self.params), "target": self._flat(self.target_params),
               "adam_m": moment("exp_avg"), "adam_v": moment("exp_avg_sq")}
        for t, u, v in zip(self.layout.weight_matrices, self.sn_u, self.sn_v):
            out[f"sn_u.{t.name}"] = u.cpu().numpy().copy()
            out[f"sn_v.{t.name}"] = v.cpu().numpy().copy()
        return out

    # ------------------------------------------------------------------ the step's parts
    def _project(self, p_next: torch.Tensor, r: torch.Tensor, done: torch.Tensor,
                 gamma: float) -> torch.Tensor:
        """Dense triangular C51 projection ``[B, NA]`` (SPEC 4 step 2)."""
        discount = gamma * (1.0 - done)
        tz = (r[:, None] + discount[:, None] * self.z).clamp(self.v_min, self.v_max)   # [B, j]
        weight = (1.0 - (tz[:, :, None] - self.z).abs() / self.dz).clamp(0.0, 1.0)     # [B, j, i]
        return torch.einsum("bj,bji->bi", p_next, weight)

    def _losses(self, s, a, r, s2, done, isw):
        """``(c51_loss, cql_loss, td_errors [B], a_star [B, n_branches])``."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logp = self.online(s)
            with torch.no_grad():
                logp_next = self.online(s2)
                logp_target = self.target(s2)
        a = a.long()
        nb = len(logp)
        c51 = cql = td = 0.0
        a_star = []
        for d, gamma in enumerate(self.gammas):
            with torch.no_grad():
                q_next = (logp_next[d].exp() * self.z).sum(-1)                       # [B, n_d]
                best = q_next.argmax(dim=1)
                p_next = torch.take_along_dim(logp_target[d], best[:, None, None], dim=1).squeeze(1).exp()
                m = self._project(p_next, r, done, gamma)
            taken = a[:, d]
            logp_taken = torch.take_along_dim(logp[d], taken[:, None, None], dim=1).squeeze(1)
            ce = -(m * logp_taken).sum(-1)                                           # [B]
            c51 = c51 + (isw * ce).mean() / nb
            q = (logp[d].exp() * self.z).sum(-1)                                     # [B, n_d]
            q_taken = torch.take_along_dim(q, taken[:, None], dim=1).squeeze(1)
            cql = cql + self.alpha * (torch.logsumexp(q, dim=1) - q_taken).mean() / nb
            td = td + ce.detach() / nb
            a_star.append(best)
        return c51, cql, td, torch.stack(a_star, dim=1)

    def _budgets(self, g_c51, g_cql):
        """``clipped(g_c51, 0.70 mgn) + clipped(g_cql, 0.15 mgn)`` and the two norms."""
        n_c51, n_cql = _global_norm(g_c51), _global_norm(g_cql)
        grads = torch._foreach_mul(g_c51, _budget_scale(n_c51, self.budget_c51))
        torch._foreach_add_(grads, torch._foreach_mul(g_cql, _budget_scale(n_cql, self.budget_cql)))
        return grads, n_c51, n_cql

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
        """Safety clip, Adam, spectral norm, Polyak; returns the norm entering Adam."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm,
                                                   foreach=self._foreach)
        self.opt.step()
        self._spectral_norm()
        with torch.no_grad():
            torch._foreach_lerp_(self.target_params, self.params, self.config.tau)
        return grad_norm

    def _train_step(self) -> dict[str, torch.Tensor]:
        x = self.inputs
        c51, cql, td, _ = self._loss_fn(x["s"], x["a"], x["r"], x["s2"], x["done"], x["isw"])
        g_c51 = torch.autograd.grad(c51, self.params, retain_graph=True)
        g_cql = torch.autograd.grad(cql, self.params)
        grads, n_c51, n_cql = self._budget_fn(g_c51, g_cql)
        for p, g in zip(self.params, grads):
            p.grad = g
        grad_norm = self._optim_fn()
        c51, cql = c51.detach(), cql.detach()
        return {"loss": c51 + cql, "c51_loss": c51, "cql_loss": cql, "c51_norm_pre": n_c51,
                "cql_norm_pre": n_cql, "grad_norm": grad_norm, "td_errors": td}

    # ------------------------------------------------------------------ upload and capture
    def _upload(self, batch: Batch) -> None:
        batch.validate(self.config)
        if self.device.type != "cuda":
            for k in BATCH_FIELDS:
                self.inputs[k].copy_(torch.from_numpy(getattr(batch, k)))
            return
        k_slot = self._slot
        self._slot = 1 - k_slot
        self._staged[k_slot].synchronize()  # the copy that last read this staging slot is done
        for k in BATCH_FIELDS:
            np.copyto(self._staging_np[k_slot][k], getattr(batch, k))
            self.inputs[k].copy_(self._staging[k_slot][k], non_blocking=True)
        self._staged[k_slot].record()

    def _capture(self) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(CAPTURE_WARMUP_STEPS):
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
        self.graph_nodes = _count_graph_nodes(graph)
        self._graph, self._graph_out = graph, out

    # ------------------------------------------------------------------ public interface
    def step(self, batch: Batch) -> dict[str, torch.Tensor]:
        """One training step on ``batch``; returns device tensors (``SCALARS`` and
        ``td_errors``) without synchronising."""
        self._upload(batch)
        if self.mode in CAPTURED_MODES:
            if self._graph is None:
                self._capture()
            self._graph.replay()
            return self._graph_out
        return self._train_step()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def read_scalars(self, out: dict[str, torch.Tensor]) -> dict[str, float]:
        """Wait for the step that produced ``out`` and read its scalars as floats."""
        self.synchronize()
        return {k: float(out[k]) for k in SCALARS}

    def loss_and_grads(self, batch: Batch) -> dict[str, np.ndarray]:
        """Losses and per-source gradients of ``batch`` without updating anything, like the
        reference ``loss_and_grads``: ``c51_loss``, ``cql_loss``, ``td_errors [B]``, ``a_star
        [B, n_branches]``, ``grad_c51``, ``grad_cql`` (flat float32, layout order)."""
        self._upload(batch)
        x = self.inputs
        c51, cql, td, a_star = self._loss_fn(x["s"], x["a"], x["r"], x["s2"], x["done"], x["isw"])
        g_c51 = torch.autograd.grad(c51, self.params, retain_graph=True)
        g_cql = torch.autograd.grad(cql, self.params)
        return {"c51_loss": np.float32(c51.item()), "cql_loss": np.float32(cql.item()),
                "td_errors": td.cpu().numpy(), "a_star": a_star.int().cpu().numpy(),
                "grad_c51": self._flat(g_c51), "grad_cql": self._flat(g_cql)}


#: Compiled instances per process the benchmarks may create (precisions x modes x scaling points).
MAX_COMPILED_INSTANCES = 64


def _allow_many_instances() -> None:
    """Dynamo caches compiled code per code object, guarded on ``self``'s identity: every
    ``TorchStep`` instance adds an entry. Past the recompile limit (default 8) it would silently
    run eager, so raise the limit."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # the newer name, then the older one
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name,
                    max(getattr(torch._dynamo.config, name), MAX_COMPILED_INSTANCES))


def _count_graph_nodes(graph) -> int | None:
    """Nodes of a captured ``torch.cuda.CUDAGraph`` (needs ``keep_graph=True`` and cuda-python);
    None when either is missing."""
    try:
        from cuda.bindings import driver

        from foxhunt.fast.graphs import count_nodes

        return count_nodes(driver.CUgraph(int(graph.raw_cuda_graph())))
    except Exception:  # noqa: BLE001 - a count is a nicety, never a failure
        return None


__all__ = ["BATCH_FIELDS", "CAPTURE_WARMUP_STEPS", "MODES", "SCALARS", "DuelingC51Net",
           "TorchStep", "step_gemm_flops"]
