"""The second-wave sources' records in the fast step's graphs (SPEC 4 second wave; issue 18).

``graph1_plan`` and ``graph2_plan`` call these where a source that is on joins the step; a
source whose weight is 0 adds no record, so the core step's plan is unchanged.

IQN (``lambda_iqn``), as ``reference.iqn_head.iqn_loss_and_grads`` and the reference
``Trainer`` compose it:

- ``iqn_features`` (beside the forward passes): the online and target quantile fractions and
  cosine features (``iqn_tau_cos``, offset: the device step counter; key: the run's seed);
- ``iqn_chain`` (beside the C51 and CQL chains): each pass's head (``phi = relu(cos W_phi^T +
  b_phi)``, ``e = h2 * phi``, ``q = e W_iq^T + b_iq``), the quantile Huber loss at the
  double-DQN actions (into the readback's ``iqn_loss``), the head's backward into ``iqn_grad``
  with its own norm and clip at ``max_grad_norm``, and ``d h2`` through the guard, the copy into
  its trunk-gradient buffer (sentinel 35), the trunk backward into ``iqn_trunk_grad``, the
  output sanitisation into ``iqn_trunk_clean`` and its norm's partials;
- ``budget_stages`` (after the C51 + CQL stage): ``grad[0:trunk_end] += lambda_iqn *
  clipped(iqn_trunk_clean, 0.10 mgn)`` and the source's norms into the readback;
- ``optimizer`` (graph 2, beside the main Adam): the head's Adam over its range, its gradient
  already clipped (``grad_scale`` 1);
- ``producers`` (graph 2): the step counter advanced.
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.records import Buf, Ops
from foxhunt.fast.step_layout import NORM_SEGMENT, READBACK_INDEX, blocks
from foxhunt.fast.step_program import StepProgram
from foxhunt.fast.wave_layout import injected_sources, stage_names
from foxhunt.reference import isv as isv_mod
from foxhunt.reference import sentinels
from foxhunt.reference.kernels import rng

F32 = np.float32
#: A budget stage re-reads the budgeted gradient with this clip bound: never reached
#: (``wave_layout.MAX_STAGED_GRAD_NORM``).
NO_CLIP = F32(np.finfo(np.float32).max)
#: The pass tags of the IQN head: online(s) and target(s2), with their parameter copy.
IQN_PASSES = (("o", 0, "h2o", "iqn_tau_online"), ("t", 1, "h2t", "iqn_tau_target"))


def _guard(prog: StepProgram, ops: Ops, x: Buf, out: Buf, n: int) -> None:
    """``out = clamp_finite(x, aux_guard_mult * max(ISV[H_S2_RMS_EMA], 1))`` (SPEC 6's input
    guard and output sanitisation around an auxiliary trunk backward)."""
    ops.kernel("clamp_finite", prog.kernels("safety").plan_clamp_finite(n), x=x, out=out, n=n,
               multiplier=F32(prog.config.aux_guard_mult),
               signal=Buf("isv", offset=isv_mod.H_S2_RMS_EMA_INDEX))


def _norm_partial(prog: StepProgram, ops: Ops, x: str, n: int, partials: str) -> None:
    ops.kernel("grad_norm_partial", prog.kernels("optim").plan_grad_norm_partial(n, NORM_SEGMENT),
               x=x, n=n, block_size=NORM_SEGMENT, partials=partials)


# --------------------------------------------------------------------------------------------
# IQN
# --------------------------------------------------------------------------------------------


def iqn_features(prog: StepProgram) -> Ops:
    """The online and target quantile fractions and cosine features (and their BF16 copies)."""
    lay, c = prog.lay, prog.config
    ops = prog.ops()
    M, K = lay.iqn_rows, c.iqn_embed
    key_lo, key_hi = rng.split_u64("seed", prog.seed)
    for tag, _, _, stream in IQN_PASSES:
        ops.kernel("iqn_tau_cos", prog.kernels("iqn").plan_iqn_tau_cos(M, K), step="step_count",
                   key_lo=key_lo, key_hi=key_hi, stream=rng.STREAMS[stream],
                   tau=Buf("iqn_tau", tag), cosines=Buf("iqn_cos", tag), rows=M, n_cos=K)
        if lay.bf16:
            prog.to_bf16(ops, Buf("iqn_cos", tag), Buf("iqn_cos_bf16", tag), M * K)
    return ops


def _iqn_head(prog: StepProgram, ops: Ops, tag: str, which: int, h2: str) -> None:
    """One pass's head: ``phi``, ``e`` (and its BF16 copy) and the quantiles ``q``."""
    lay, c = prog.lay, prog.config
    M, K, H, A = lay.iqn_rows, c.iqn_embed, lay.H2, lay.A_total
    bf16 = lay.bf16
    cos = Buf("iqn_cos_bf16" if bf16 else "iqn_cos", tag)
    phi = Buf("iqn_phi", tag)
    prog.linear(ops, rows=M, n=H, k=K, x=cos, w=prog.weight("w_phi", which, bf16=bf16), c=phi,
                bias=prog.weight("b_phi", which, bf16=False), epilogue="relu_bias")
    e_bf16 = Buf("iqn_e_bf16", tag) if bf16 else None
    ops.kernel("iqn_modulate", prog.kernels("iqn").plan_iqn_modulate(M, H), h2=h2, phi=phi,
               e=Buf("iqn_e", tag), e_bf16=e_bf16, rows=M, hidden=H, n_quantiles=c.iqn_quantiles)
    prog.linear(ops, rows=M, n=A, k=H, x=e_bf16 if bf16 else Buf("iqn_e", tag),
                w=prog.weight("w_iq", which, bf16=bf16), c=Buf("iqn_q", tag),
                bias=prog.weight("b_iq", which, bf16=False), epilogue="bias")


def iqn_chain(prog: StepProgram) -> Ops:
    """The IQN head's forward, loss and backward, its trunk backward and its budget's input
    (module docstring); waits for the double-DQN actions (event ``gathered``)."""
    lay, c = prog.lay, prog.config
    opt, safety, iqn, step = (prog.kernels(a) for a in ("optim", "safety", "iqn", "step"))
    B, H, nb = lay.B, lay.H2, lay.nb
    N, K, A, M = c.iqn_quantiles, c.iqn_embed, lay.A_total, lay.iqn_rows
    ops = prog.ops()
    heads = []
    for tag, which, h2, _ in IQN_PASSES:
        head = ops.branch()
        _iqn_head(prog, head, tag, which, h2)
        heads.append(head)
    ops.parallel(*heads)
    ops.wait("gathered")
    ops.kernel("iqn_quantile_huber", iqn.plan_iqn_quantile_huber(), q=Buf("iqn_q", "o"),
               q_target=Buf("iqn_q", "t"), tau=Buf("iqn_tau", "o"), actions="batch.a",
               a_star="a_star", r="batch.r", done="batch.done", gamma="gamma", isw="batch.isw",
               isv="isv", q_abs_ref_index=isv_mod.Q_ABS_REF_INDEX,
               k1=F32(c.target_q_clip_mult), n_actions="n_actions", action_offset="action_offset",
               y="iqn_y", dq="iqn_dq", loss=Buf("readback", offset=READBACK_INDEX["iqn_loss"]),
               n_branches=nb, batch=B, n_quantiles=N, a_total=A)
    # The head's backward: W_iq (with b_iq) beside de -> d h2 and d phi_pre.
    g = "iqn_grad"
    w_iq, rest = ops.branch(), ops.branch()
    prog.weight_grad(w_iq, dy=Buf("iqn_dq"), x=Buf("iqn_e", "o"), rows=M, n_out=A, n_in=H,
                     dw=prog.grad(g, "w_iq"), db=prog.grad(g, "b_iq"))
    prog.input_grad(rest, dy=Buf("iqn_dq"), w=prog.weight("w_iq", 0, bf16=False),
                    dx=Buf("iqn_de"), rows=M, n_out=A, n_in=H)
    rest.kernel("iqn_modulate_backward", iqn.plan_iqn_modulate_backward(B, H), de="iqn_de",
                h2="h2o", phi=Buf("iqn_phi", "o"), d_h2="iqn_d_h2", d_phi_pre="iqn_d_phi_pre",
                batch=B, hidden=H, n_quantiles=N)
    ops.parallel(w_iq, rest)
    # Then W_phi (with b_phi) and the head's own norm and clip at max_grad_norm, beside the
    # trunk: guard, copy into the trunk-gradient buffer, masks, trunk GEMMs, sanitisation.
    head, trunk = ops.branch(), ops.branch()
    prog.weight_grad(head, dy=Buf("iqn_d_phi_pre"), x=Buf("iqn_cos", "o"), rows=M, n_out=H,
                     n_in=K, dw=prog.grad(g, "w_phi"), db=prog.grad(g, "b_phi"))
    size = lay.specs[g][0][0]
    count = blocks(size, NORM_SEGMENT)
    _norm_partial(prog, head, g, size, "partials_iqn_head")
    head.kernel("grad_norm_final", opt.plan_grad_norm_final(count), partials="partials_iqn_head",
                count=count, out="sq_iqn_head")
    head.kernel("clip_grad_inplace", opt.plan_clip_grad_inplace(size), x=g, n=size,
                max_norm=F32(c.max_grad_norm), norm_sq="sq_iqn_head")
    n2 = B * H
    _guard(prog, trunk, Buf("iqn_d_h2"), Buf("dh2g_iqn"), n2)
    trunk.kernel("h2_grad_sum_mask", step.plan_h2_grad_sum_mask(n2), parts="dh2g_iqn", n_parts=1,
                 part_stride=n2, h2="h2o", h2_pre="h2preo", dh2_out="dh2_iqn", out="dh2m_iqn",
                 n=n2)
    check = trunk.branch()  # slot 35: the trunk-gradient buffer after the IQN d h2 copy
    check.kernel("nan_check", safety.plan_nan_check(n2), x="dh2_iqn", n=n2,
                 flag=Buf("flags", offset=sentinels.index("d_h2_post_iqn")))
    prog.trunk_backward(trunk, dh2m=Buf("dh2m_iqn"), grad="iqn_trunk_grad", dh1=Buf("dh1_iqn"),
                        scratch=Buf("dpre_iqn"), beside=(check,))
    end = lay.param_layout.trunk_end
    _guard(prog, trunk, Buf("iqn_trunk_grad"), Buf("iqn_trunk_clean"), end)
    _norm_partial(prog, trunk, "iqn_trunk_clean", end, "partials_iqn")
    ops.parallel(head, trunk)
    return ops


def iqn_adam(prog: StepProgram) -> Ops:
    """The IQN head's Adam over its range: the core's hyperparameters, Mech 9 clamp and
    ``adam_t``; its gradient clipped at ``max_grad_norm`` in graph 1 (``grad_scale`` 1)."""
    lay, c = prog.lay, prog.config
    lo, hi = lay.param_layout.iqn_range
    ops = prog.ops()
    ops.kernel("adam_update", prog.kernels("optim").plan_adam_update(hi - lo),
               param=Buf("params2", offset=lo), grad="iqn_grad", m=Buf("adam_m", offset=lo),
               v=Buf("adam_v", offset=lo), n=hi - lo, step="adam_t", lr=F32(c.lr),
               beta1=F32(c.beta1), beta2=F32(c.beta2), eps=F32(c.adam_eps),
               weight_decay=F32(c.weight_decay), grad_scale="one", weight_clamp="weight_clamp")
    return ops


# --------------------------------------------------------------------------------------------
# The budget pipeline's stages and graph 2's second-wave records
# --------------------------------------------------------------------------------------------

#: Each injected source's sanitised trunk gradient (the stage's ``inject``) and weight field.
_INJECT = {"iqn": ("iqn_trunk_clean", "lambda_iqn"), "ens": ("ens_trunk_clean", "ens_weight")}


def budget_stages(prog: StepProgram, ops: Ops) -> None:
    """After the C51 + CQL stage (which wrote ``stage_names()[0]``), one
    ``clip_saxpy_norm_partial`` per injected source: ``out = base + weight * clipped(source,
    budget)`` over the whole layout (the source is zero past its range, so this is the
    reference's SAXPY over the range), with the base read unclipped (bound ``NO_CLIP``) and the
    new buffer's norm partials; then the source's norms into the readback."""
    lay, c = prog.lay, prog.config
    opt, wave = prog.kernels("optim"), prog.kernels("wave")
    NP = lay.NP
    names = stage_names(c)
    for k, src in enumerate(injected_sources(c)):
        (base, base_partials), (out, partials) = names[k], names[k + 1]
        inject, weight = _INJECT[src]
        budget = F32(c.budget(src))
        ops.kernel("clip_saxpy_norm_partial", opt.plan_clip_saxpy_norm_partial(NP, NORM_SEGMENT),
                   base=base, inject=inject, n=NP, base_max_norm=NO_CLIP,
                   base_partials=base_partials, a=F32(getattr(c, weight)),
                   inject_max_norm=budget, inject_partials=f"partials_{src}",
                   count=lay.n_partials,
                   final_threads=opt.final_threads_clip_saxpy_norm_partial(lay.n_partials),
                   block_size=NORM_SEGMENT, out=out, partials=partials,
                   base_norm_sq_out=f"sq_base_{src}", inject_norm_sq_out=f"sq_{src}")
        ops.kernel("source_norm_scalars", wave.plan_single(), norm_sq=f"sq_{src}",
                   readback="readback", budget=budget,
                   pre_index=READBACK_INDEX[f"{src}_norm_pre"],
                   post_index=READBACK_INDEX[f"{src}_norm_post"])


def optimizer(prog: StepProgram, main_adam: Ops) -> Ops:
    """``main_adam`` with the second-wave optimisers beside it (the IQN head's Adam)."""
    if not prog.config.iqn_on:
        return main_adam
    ops = prog.ops()
    ops.parallel(iqn_adam(prog), main_adam)
    return ops


def producers(prog: StepProgram, ops: Ops) -> None:
    """Graph 2's second-wave state updates: the step counter (after graph 1's readers)."""
    if prog.config.iqn_on:
        ops.kernel("step_count_advance", prog.kernels("wave").plan_single(),
                   step_count="step_count")


__all__ = ["NO_CLIP", "budget_stages", "iqn_adam", "iqn_chain", "iqn_features", "optimizer",
           "producers"]
