"""`loss_and_grads`: the losses and per-component gradients of one batch (SPEC 4, steps 1-4).

A pure function: nothing is clipped, nothing is updated. It is what a user calls to debug a
gradient, and what `Trainer.step` builds the budget pipeline on.

1. Three forward passes: online(s), online(s2) (double-DQN choice ``a*_d = argmax_a Q_d(s2)``,
   lowest index on ties), target(s2).
2. C51 per branch: ``p'`` = target distribution at ``a*_d``; ``m = c51_project(p', r, done,
   gamma_d, discount, gamma_ref)`` (n-step batches, issue 22: ``batch.discount`` present, every
   target uses the per-sample ``effective_gamma(gamma_d, discount, gamma_ref)``); ``ce_b = -sum_j m_j logp_d[b, a_d, j]``; the loss is the mean over branches of
   ``sum_b isw_b ce_b / B``; ``td_errors[b]`` = mean over branches of ``ce_b``.
3. CQL per branch: ``alpha * mean_b [logsumexp_a Q_d(s,a) - Q_d(s,a_d)]``, averaged over branches.
4. Backward of each loss separately into its own flat gradient buffer (layout order).

Mech 1 (target-Q clip): the scalar target ``r + gamma_d (1-done) E_{p'}[z]`` (``gamma_d`` the
effective gamma for n-step batches; the MSE warm-up's target too) is formed once here,
clipped to ``target_q_clip_mult * max(ISV[Q_ABS_REF], 1)``, and reported (``target_q``); the C51
distributional target itself is bounded by the support clip inside ``c51_project``.
Mech 2 (atom growth bound): with ``adaptive_atoms`` off the support is fixed at ``[v_min,
v_max]`` and there is nothing to bound; with it on, branch d's support is the live support
``z[d]`` of ``kernels.live_support`` (built from the ISV at the start of the step, Mech 2's
consumer site), and every per-branch consumer reads it: the projection (targets clipped into
``[z[d, 0], z[d, -1]]``), the expected Q (``q_values``), the CQL gradient and the scalar
targets (``step_supports``).

The step kernels' reference twins (``kernels.step``) do the jobs they share with the fast step:
the double-DQN choice and gathers, the TD errors' branch mean (and, in ``network.backward``, the
trunk gradient's sum and masks).

Second wave (SPEC 4; issue 18 contract), each source only when its weight is > 0 (weight 0:
no call, and the result is bitwise the core's):

- MSE warm-up (``c51_warmup_epochs``): ``aux_heads.mse_blend`` blends the C51 logit gradient
  and the reported C51 loss with the expected-Q MSE by ``w = max(0, 1 - epoch / W)``,
  ``epoch = ISV[EPOCH_IDX]``, before the C51 backward.
- Auxiliary heads (``aux_next_bar_weight``, ``aux_regime_weight``): with the next-bar head,
  ISV 117 (the label scale) is first updated from the batch's ``next_ret``; then
  ``aux_heads.aux_loss_and_grads`` on online h2; their weighted d h2 enters the C51 backward's
  trunk-gradient buffer (guarded SAXPY) before the trunk, their parameter gradients enter
  ``grad_c51`` at their tensors (the C51 budget).
- IQN (``lambda_iqn``): ``iqn_head.iqn_loss_and_grads`` (own head gradient, own trunk scratch).
- Ensemble (``ens_weight``): ``aux_heads.ens_loss_and_grads`` (own trunk + value scratch).
"""

from __future__ import annotations

import numpy as np

from . import isv as isv_mod
from .aux_heads import aux_loss_and_grads, ens_loss_and_grads, mse_blend
from .batch import Batch
from .config import DQNConfig
from .iqn_head import iqn_loss_and_grads
from .kernels import aux as aux_kernels
from .kernels import distributional, live_support, safety, wave
from .kernels import step as step_kernels
from .layout import ParamLayout
from .network import Activations, backward, forward, q_values


def support(config: DQNConfig) -> np.ndarray:
    return distributional.support(config.v_min, config.v_max, config.num_atoms)


def step_supports(config: DQNConfig, isv: np.ndarray) -> live_support.LiveSupport:
    """Every branch's support for a step (or a Q read) starting from ``isv``: with
    ``adaptive_atoms`` the live support (``live_support.live_support_build``), else the fixed
    ``support(config)`` on every branch with bounds ``(v_min, v_max, dz)`` in float32 (the
    projection's arguments of the fixed support, bit for bit)."""
    nb, na = config.n_branches, config.num_atoms
    if config.adaptive_atoms:
        return live_support.live_support_build(np.asarray(isv, np.float32), nb, na,
                                               config.atom_growth_mult)
    lo, hi = np.float32(config.v_min), np.float32(config.v_max)
    bounds = np.tile(np.array([lo, hi, distributional.atom_spacing(lo, hi, na)], np.float32),
                     (nb, 1))
    return live_support.LiveSupport(z=np.tile(support(config), (nb, 1)), bounds=bounds)


def check_n_step(config: DQNConfig, n_step) -> bool:
    """A trainer's ``n_step`` (issue 22): an int >= 1 (the collection's upper bound is the loop
    settings'); with ``n_step > 1`` the configured gamma of branch 0 (``gamma_ref``, the base of
    the batches' discounts) must lie in ``(0, 1)``. Returns ``n_step > 1`` (the targets read
    ``batch.discount``); else one-line ``ValueError``."""
    if isinstance(n_step, bool) or not isinstance(n_step, (int, np.integer)) or n_step < 1:
        raise ValueError(f"n_step: {n_step!r}; allowed an int >= 1")
    if n_step > 1:
        n_step_gamma_ref(config, np.zeros(0, np.float32), None, n_step)
    return n_step > 1


def check_batch_kind(batch, n_step_on: bool) -> None:
    """A trainer built for n-step transitions (``n_step_on``) takes only batches with a
    ``discount``, a 1-step trainer only batches without: otherwise the discounts would be
    ignored, or missing. One-line ``ValueError``."""
    if (batch.discount is not None) != bool(n_step_on):
        raise ValueError(
            "batch.discount: missing; this trainer trains on n-step transitions (n_step > 1)"
            if n_step_on else "batch.discount: given, but this trainer was built with "
            "n_step=1 (1-step transitions: discount must be None)")


def n_step_gamma_ref(config: DQNConfig, discount: np.ndarray | None,
                     gamma_ref: float | None = None, n_step=None) -> np.float32 | None:
    """The reference gamma of an n-step batch's discounts, float32: ``gamma_ref`` (default
    ``config.gammas[0]``), which must lie in ``(0, 1)``; None for a 1-step batch (``discount``
    None: nothing reads it)."""
    if discount is None:
        return None
    value = config.gammas[0] if gamma_ref is None else gamma_ref
    if not 0 < np.float32(value) < 1:
        what = "n-step batches (a batch.discount)" if n_step is None else f"n_step={n_step!r}"
        raise ValueError(f"gamma: {value!r} (gamma_ref, the gamma of branch 0); {what} needs it "
                         "in (0, 1)")
    return np.float32(value)


def loss_and_grads(config: DQNConfig, params: np.ndarray, target_params: np.ndarray, batch: Batch,
                   *, q_abs_ref: float = 0.0, h2_bound: float | None = None,
                   layout: ParamLayout | None = None, isv: np.ndarray | None = None,
                   step: int = 0, seed: int = 0, gamma_ref: float | None = None) -> dict:
    """Losses and per-component gradients of ``batch`` (SPEC 4 steps 1-4). ``batch`` is validated
    first (``ValueError`` naming the field); ``Trainer.step`` relies on that single check.

    Second-wave inputs (read only by sources that are on): ``isv``, the ISV vector at the start
    of the step (``H_S2_RMS_EMA`` for the guards, ``AUX_LABEL_SCALE_EMA``, ``EPOCH_IDX``; default
    the config's cold start); ``step``, the trainer's step count before this step, and ``seed``,
    the run's seed (the IQN quantile fractions' generator offset and key).

    n-step batches (``batch.discount`` present; None is the 1-step step, bit for bit):
    ``gamma_ref`` is the configured gamma of branch 0 the discounts were formed with (default
    ``config.gammas[0]``; a trainer whose ``config`` carries the gamma schedule's live gammas
    passes the configured one), in ``(0, 1)`` (else ``ValueError``).

    Returns a dict with ``c51_loss`` and ``cql_loss`` (f32 scalars), ``td_errors`` ``[B]``,
    ``grad_c51`` and ``grad_cql`` (flat f32, layout order, padding zero), ``target_q``
    ``[B, n_branches]`` (Mech 1-clipped scalar targets), ``q_taken`` ``[B, n_branches]``,
    ``a_star`` ``[B, n_branches]``, ``q_s`` (online Q(s) per branch, ``[B, n_d]``), ``p_next``
    ``[n_branches, B, NA]`` (the target distributions at ``a*``), the activations of the three passes (``online``,
    ``online_next``, ``target_next``), ``support`` (``step_supports``: the step's per-branch
    support ``z [n_branches, NA]`` and bounds), per-branch ``logp``, ``m``, ``dlogits_c51``,
    ``dlogits_cql``, and each backward's intermediate gradients (``trace_c51``, ``trace_cql``:
    ``d_value_logits``, ``d_adv_logits``, ``d_h2``; ``trace_c51`` also ``d_h2_post_aux`` with
    the auxiliary heads on). Second wave: ``c51_loss`` is the blended loss and ``mse`` the
    ``MseOut`` while the warm-up runs (``mse`` None otherwise), ``aux`` (``AuxOut``), ``iqn``
    (``IqnOut``), ``ens`` (``EnsOut``): None for a source that is off; ``isv``, the ISV vector
    the sources read (with the next-bar head on, slot 117 updated from this batch's
    ``next_ret`` by ``isv_label_scale_update`` before the head reads it).
    """
    layout = layout or ParamLayout(config)
    batch.validate(config)
    B, nb = config.batch_size, config.n_branches
    if isv is None:
        isv = isv_mod.bus_for(config).to_array()
    supports = step_supports(config, isv)
    zs = supports.z  # [nb, NA]: branch d's support
    scale = np.float32(1.0 / (B * nb))
    alpha = np.float32(config.cql_alpha)
    q_bound_mult = np.float32(config.target_q_clip_mult)

    online: Activations = forward(config, layout, params, batch.s, h2_bound=h2_bound)
    online_next = forward(config, layout, params, batch.s2, h2_bound=h2_bound)
    target_next = forward(config, layout, target_params, batch.s2, h2_bound=h2_bound)

    # The double-DQN choice and its gathers for every branch at once (the step kernel's
    # branch-packed layout: branch d's block holds the rows of Q(s) then Q(s2), and the
    # target(s2) log-probabilities of its actions).
    q_s = q_values(config, online, zs)
    q_s2 = q_values(config, online_next, zs)
    q_online = np.concatenate([np.concatenate([q, q2]).ravel() for q, q2 in zip(q_s, q_s2)])
    logp_target = np.concatenate([lp.reshape(B * lp.shape[1], -1) for lp in target_next.logp])
    gather = step_kernels.double_dqn_gather_branches(
        logp_target, q_online, np.ascontiguousarray(batch.a.T), config.branches, B)

    out: dict = {"m": [], "dlogits_c51": [], "dlogits_cql": []}
    c51_total = np.float32(0)
    cql_total = np.float32(0)
    ce_parts = np.zeros((nb, B), np.float32)
    target_q = np.zeros((B, nb), np.float32)
    discount = batch.discount
    gamma_ref = n_step_gamma_ref(config, discount, gamma_ref)
    for d, gamma in enumerate(config.gammas):
        actions = batch.a[:, d]
        p_next = gather.p_next[d]
        z = zs[d]
        m = distributional.c51_project(p_next, batch.r, batch.done, np.float32(gamma), z,
                                       supports.bounds[d, 0], supports.bounds[d, 1],
                                       discount, gamma_ref)
        ce_parts[d], total = distributional.c51_loss(online.logp[d], actions, m, batch.isw, scale)
        dl_c51 = distributional.c51_grad(online.logp[d], actions, m, batch.isw, scale)
        dl_cql, terms = distributional.cql_logit_grad(online.logp[d], actions, z, alpha, scale)
        # Not step_kernels.loss_scalars: its means add in the kernel's block order, this one is
        # NumPy's pairwise mean (the bits differ).
        c51_total = np.float32(c51_total + total)
        cql_total = np.float32(cql_total + alpha * np.mean(terms, dtype=np.float32) / np.float32(nb))
        # Not step_kernels.scalar_target_q_branches: its expectation sums atom by atom, where
        # this one is NumPy's matmul (another f32 order; the bits differ).
        gamma_eff = distributional.effective_gamma(np.float32(gamma), discount, gamma_ref)
        scalar_target = (batch.r + gamma_eff * (np.float32(1) - batch.done)
                         * (p_next @ z).astype(np.float32)).astype(np.float32)
        target_q[:, d] = safety.target_q_clip(scalar_target, q_bound_mult, np.float32(q_abs_ref))
        out["m"].append(m)
        out["dlogits_c51"].append(dl_c51)
        out["dlogits_cql"].append(dl_cql)

    epoch = float(isv[isv_mod.EPOCH_IDX_INDEX])
    h2_rms = float(isv[isv_mod.H_S2_RMS_EMA_INDEX])
    out.update(mse=None, aux=None, iqn=None, ens=None)
    if config.mse_on:
        mse = mse_blend(config, online, batch, target_q, out["dlogits_c51"], epoch)
        if mse.w > 0:  # past the warm-up the C51 gradient and loss are untouched
            out["dlogits_c51"] = mse.dlogits
            c51_total = wave.mse_loss_blend(np.array([c51_total, mse.loss, mse.w], np.float32),
                                            0, 1, 2)[0]
        out["mse"] = mse
    aux_d_h2 = None
    if config.aux_next_bar_on:  # ISV 117, the label scale, from this batch before its use
        isv = aux_kernels.isv_label_scale_update(isv, batch.next_ret,
                                                 isv[isv_mod.SHARPE_EMA_INDEX],
                                                 isv_mod.ALPHA_BASE_DEFAULT)
    if config.aux_on:
        out["aux"] = aux_loss_and_grads(config, layout, params, online, batch, isv)
        aux_d_h2 = out["aux"].d_h2
    out["isv"] = isv

    trace_c51: dict = {}
    trace_cql: dict = {}
    grad_c51 = backward(config, layout, params, online, out["dlogits_c51"], h2_bound=h2_bound,
                        trace=trace_c51, aux_d_h2=aux_d_h2)
    if config.aux_on:  # the heads' own parameter gradients sit in the C51 budget
        aux_range = slice(layout.core_end, layout.main_adam_end)
        grad_c51[aux_range] = out["aux"].param_grad[aux_range]
    out.update(
        c51_loss=np.float32(c51_total),
        cql_loss=np.float32(cql_total),
        td_errors=step_kernels.branch_mean(ce_parts, nb),
        grad_c51=grad_c51,
        grad_cql=backward(config, layout, params, online, out["dlogits_cql"], h2_bound=h2_bound,
                          trace=trace_cql),
        trace_c51=trace_c51,
        trace_cql=trace_cql,
        target_q=target_q,
        q_taken=np.ascontiguousarray(gather.q_taken.T),
        q_s=q_s,
        p_next=gather.p_next,
        a_star=np.ascontiguousarray(gather.a_star.T),
        online=online,
        online_next=online_next,
        target_next=target_next,
        logp=online.logp,
        support=supports,
    )
    if config.iqn_on:
        out["iqn"] = iqn_loss_and_grads(config, layout, params, target_params, online, target_next,
                                        batch, out["a_star"], step, seed, q_abs_ref, h2_rms,
                                        mode=config.precision, gamma_ref=gamma_ref)
    if config.ens_on:
        out["ens"] = ens_loss_and_grads(config, layout, params, online, isv, mode=config.precision)
    return out
