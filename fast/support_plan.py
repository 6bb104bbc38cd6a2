"""``DQNConfig.adaptive_atoms`` in the fast step, as records: the live per-branch support
(``foxhunt.reference.kernels.live_support``) built on the device from the ISV, and the records
of its consumers. With the switch off nothing here adds a buffer or a record, so the plans
are record for record today's.

- Buffers (``add_support_buffers``): ``z_live [nb, NA]`` and ``z_bounds [nb, 3]`` (branch d's
  atoms and ``(v_min_d, v_max_d, dz_d)``), ``support_members [nb]`` (constant: the seed member
  of each branch's ISV slots).
- Graph 1, first, beside the other consumers (``live_support``): ``live_support_build`` from
  the ISV of the step's start (slots 23-30, ``Q_ABS_REF``), so every consumer of the step reads
  the same support, bound by pointer (no host value):
  - the online pass's expected Q: ``dueling_log_softmax_q_branches`` with ``with_q = 0`` and one
    ``expected_q`` per branch on ``z_live[d]`` (``forward_q``);
  - the projection: ``c51_project_grad_live`` (``z_live[d]``, ``z_bounds[d]``);
  - the scalar targets (Mech 1's input): ``scalar_target_q_branches`` once per branch on
    ``z_live[d]`` (``scalar_targets``);
  - the CQL gradient: ``cql_logit_grad`` once per branch on ``z_live[d]`` (``cql_grads``);
  - graph 2's ``isv_signal_build`` reads ``z_live`` (``signal_support``) and sentinel 47
    (``atom_span_max``) checks it (``foxhunt.fast.sentinel_plan``).
- The value stream is shared by the branches: atom j of the value logits is atom j of every
  branch's combined logits, read on that branch's own support (module docstring of
  ``live_support``).

Cost with the switch on: one launch for the support, and per branch one expected-Q, one scalar
target and one CQL launch instead of one branch-packed launch each (``3 nb - 2`` more
launches in graph 1).

The greedy forward (tag ``e``: the ``q_values`` graph, the collectors' act, the graph-mode
walk) and the fused walk (``cuda_src/walk.cu``, ``eval_support``) build their own ``z_e`` from
the ISV of their start, as the reference's ``q_values`` does: ``z_live`` is the support of the
step's START, one step behind the ISV the step leaves.
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.records import Buf, Ops
from foxhunt.reference import isv as reg
from foxhunt.reference.kernels.live_support import branch_members

F32, I32 = np.float32, np.int32
#: The live support's buffers (``add_support_buffers``).
Z_LIVE, Z_BOUNDS, MEMBERS = "z_live", "z_bounds", "support_members"
#: The greedy forward's own live support (``add_eval_support_buffers``).
EVAL_SUPPORT = ("z_e", "z_e_bounds")


def add_support_buffers(lay) -> None:
    """The live support's buffers (none with ``adaptive_atoms`` off)."""
    if lay.config.adaptive_atoms:
        lay._add(Z_LIVE, (lay.nb, lay.NA), F32)
        lay._add(Z_BOUNDS, (lay.nb, 3), F32)
        lay._add(MEMBERS, lay.nb, I32, "constant")


def support_constants(lay) -> dict[str, np.ndarray]:
    """Host values of the constant buffers of ``add_support_buffers``."""
    if not lay.config.adaptive_atoms:
        return {}
    return {MEMBERS: np.array(branch_members(lay.nb), I32)}


def add_eval_support_buffers(evl, config) -> None:
    """The greedy forward's own live support (``EvalLayout``, tag ``e``): ``z_e`` and
    ``z_e_bounds``, built from the ISV at the forward's start (none with the switch off)."""
    if config.adaptive_atoms:
        nb = len(evl.branches)
        evl._add(EVAL_SUPPORT[0], (nb, evl.NA), F32)
        evl._add(EVAL_SUPPORT[1], (nb, 3), F32)


def _build(prog, ops: Ops, z: str, bounds: str) -> None:
    c, lay = prog.config, prog.lay
    ops.kernel("live_support_build",
               prog.kernels("live_support").plan_live_support_build(lay.nb, lay.NA), isv="isv",
               members=MEMBERS, z=z, bounds=bounds, n_branches=lay.nb,
               num_atoms=lay.NA, q_abs_ref_slot=reg.Q_ABS_REF_INDEX,
               centre_base=reg.V_CENTER_INDICES[0], half_base=reg.V_HALF_INDICES[0],
               atom_growth_mult=F32(c.atom_growth_mult))


def live_support(prog, ops: Ops) -> None:
    """Graph 1's ``live_support_build`` (before the fork, with the other consumers)."""
    if prog.config.adaptive_atoms:
        _build(prog, ops, Z_LIVE, Z_BOUNDS)


def live_q(config, q) -> bool:
    """Whether a pass's expected Q is computed per branch on the live support."""
    return config.adaptive_atoms and q is not None


def forward_q(prog, ops: Ops, *, tag: str, rows: int, logp: Buf, q: Buf) -> None:
    """The expected Q of a pass (after ``dueling_log_softmax_q_branches`` with ``with_q = 0``)
    on the live support: per branch d, ``expected_q`` over its ``rows * n_d`` rows of ``logp``
    (packed key ``(tag, d)`` in the step, ``d`` in the greedy forward) into ``q``'s block d.
    The step's passes read ``z_live`` (built at the step's start); the greedy forward (tag
    ``e``: ``q_values``, the collectors' act, the graph-mode walk) first builds its own
    ``z_e`` from the ISV of its start, as the reference's ``q_values`` does."""
    lay = prog.lay
    z = eval_support(prog, ops)[0] if tag == "e" else Z_LIVE
    dist = prog.kernels("distributional")
    for d, n in enumerate(lay.branches):
        key = (logp.key[0], d) if isinstance(logp.key, tuple) else d
        ops.kernel("expected_q", dist.plan_expected_q(rows, n, lay.NA),
                   logp=Buf(logp.name, key), z=Buf(z, offset=d * lay.NA),
                   q=Buf(q.name, d), rows=rows * n, num_atoms=lay.NA)


def eval_support(prog, ops: Ops) -> tuple[str, int]:
    """The support a greedy read of Q takes (tag ``e``; the fused walk's ``z``, ``z_stride``):
    with the switch on ``live_support_build`` into ``z_e`` / ``z_e_bounds`` from the ISV of this
    moment (the trainer's current one: ``z_live`` is the last step's start's), then ``("z_e",
    NA)``, branch d's support at ``z_e + d NA``; off, the fixed support ``("z", 0)``, shared by
    every branch, and no record."""
    if not prog.config.adaptive_atoms:
        return "z", 0
    _build(prog, ops, *EVAL_SUPPORT)
    return EVAL_SUPPORT[0], prog.lay.NA


def projection(d: int, num_atoms: int) -> dict:
    """``c51_project_grad_live``'s support arguments of branch d."""
    return {"z": Buf(Z_LIVE, offset=d * num_atoms), "bounds": Buf(Z_BOUNDS, offset=3 * d)}


def scalar_targets(prog, ops: Ops) -> None:
    """``scalar_target_q_branches`` once per branch on its live support (the same per-(d, b)
    formula as the branch-packed launch)."""
    lay = prog.lay
    B, NA = lay.B, lay.NA
    step = prog.kernels("step")
    for d in range(lay.nb):
        ops.kernel("scalar_target_q_branches", step.plan_scalar_target_q_branches(1, B),
                   p_next=Buf("p_next", offset=d * B * NA), z=Buf(Z_LIVE, offset=d * NA),
                   r="batch.r", done="batch.done", gamma=Buf("gamma", offset=d),
                   target_q=Buf("target_q", offset=d * B), n_branches=1, batch=B,
                   num_atoms=NA, **lay.n_step_args())


def cql_grads(prog, ops: Ops, alpha) -> None:
    """``cql_logit_grad`` once per branch on its live support: the first B samples of the
    online block (as ``cql_logit_grad_branches`` reads them), its actions, its rows of
    ``dlogits_cql`` and ``terms``."""
    lay = prog.lay
    B, NA = lay.B, lay.NA
    dist = prog.kernels("distributional")
    for d, n in enumerate(lay.branches):
        ops.kernel("cql_logit_grad", dist.plan_cql_logit_grad(B, n, NA),
                   logp=Buf("logp", ("o", d)), actions=Buf("batch.a", offset=d * B),
                   z=Buf(Z_LIVE, offset=d * NA), alpha=alpha, scale="scale",
                   dlogits=Buf("dlogits_cql", d), terms=Buf("terms", offset=d * B), batch=B,
                   num_actions=n, num_atoms=NA)


def signal_support(config) -> str:
    """The support ``isv_signal_build`` reads: ``z_live`` with the switch on."""
    return Z_LIVE if config.adaptive_atoms else "z_branches"


def span_buffer(lay) -> tuple[str, int]:
    """Sentinel 47's buffer and length: the live support, or the fixed ``z``."""
    return (Z_LIVE, lay.nb * lay.NA) if lay.config.adaptive_atoms else ("z", lay.NA)


__all__ = ["MEMBERS", "Z_BOUNDS", "Z_LIVE", "add_support_buffers", "cql_grads", "eval_support",
           "forward_q", "live_q", "live_support", "projection", "scalar_targets",
           "signal_support", "span_buffer", "support_constants"]
