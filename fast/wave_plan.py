"""The second-wave sources' records in the fast step's graphs (SPEC 4 second wave; issue 18).

``graph1_plan`` and ``graph2_plan`` call these where a source that is on joins the step; a
source whose weight is 0 adds no record, so the core step's plan is unchanged.

IQN (``lambda_iqn``), as ``reference.iqn_head.iqn_loss_and_grads`` and the reference
``Trainer`` compose it:

- ``iqn_chain`` (beside the forward passes and every other chain): per pass (online,
  target) the quantile fractions and cosine features (``iqn_tau_cos``, offset: the device
  step counter; key: the run's seed) and the head (``phi = relu(cos W_phi^T + b_phi)`` at
  once; ``e = h2 * phi`` once the pass's h2 is written, event ``h2_o`` / ``h2_t``; ``q = e
  W_iq^T + b_iq``), then, at the double-DQN actions (event ``gathered``), the quantile Huber
  loss at the
  double-DQN actions (into the readback's ``iqn_loss``), the head's backward into ``iqn_grad``
  with its own norm and clip at ``max_grad_norm``, and ``d h2`` through the guard, the copy into
  its trunk-gradient buffer (sentinel 35), the trunk backward into ``iqn_trunk_grad``, the
  output sanitisation into ``iqn_trunk_clean`` and its norm's partials;
- ``budget`` (the budget pipeline in one pass, the C51 clip and CQL SAXPY first):
  ``grad[0:trunk_end] += lambda_iqn * clipped(iqn_trunk_clean, 0.10 mgn)`` and the source's
  norms into the readback;
- ``optimizer`` (graph 2, beside the main Adam): the head's Adam over its range, its gradient
  already clipped (``grad_scale`` 1);
- ``producers`` (graph 2): the step counter advanced.

Auxiliary heads (``aux_chain``, beside the C51 chain; its trunk waits for them): ISV 117 from
the batch's returns, each head's forward, weighted loss gradient and backward into
``grad_c51`` (the C51 budget), their ``d h2`` added to the C51 trunk gradient (a guarded SAXPY,
``StepProgram.backward``). MSE warm-up (``mse_warmup`` in the C51 chain, after the projections
and the Mech 1 targets; ``mse_loss_blend`` after the loss scalars). Ensemble (``ens_chain``):
the frozen priors, the KL gradient on head 0's logits, the value head and guarded trunk
backward, the sanitisation; its injection follows IQN's in ``budget``.
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.records import Buf, Ops
from foxhunt.fast.step_layout import NORM_SEGMENT, READBACK_INDEX, blocks
from foxhunt.fast.step_program import StepProgram
from foxhunt.fast.wave_layout import injected_sources
from foxhunt.reference import isv as isv_mod
from foxhunt.reference import sentinels
from foxhunt.reference.kernels import rng

F32 = np.float32
#: The pass tags of the IQN head: online(s) and target(s2), with their parameter copy.
IQN_PASSES = (("o", 0, "h2o", "iqn_tau_online"), ("t", 1, "h2t", "iqn_tau_target"))


def _guard(prog: StepProgram, ops: Ops, x: Buf, out: Buf, n: int) -> None:
    """``out = clamp_finite(x, aux_guard_mult * max(ISV[H_S2_RMS_EMA], 1))`` (SPEC 6's input
    guard and output sanitisation around an auxiliary trunk backward)."""
    ops.kernel("clamp_finite", prog.kernels("safety").plan_clamp_finite(n), x=x, out=out, n=n,
               multiplier=F32(prog.config.aux_guard_mult),
               signal=Buf("isv", offset=isv_mod.H_S2_RMS_EMA_INDEX))


def _guard_mask(prog: StepProgram, ops: Ops, src: str, x: Buf) -> None:
    """An auxiliary trunk's (``src``: ``iqn``, ``ens``) guarded ``d h2`` (``_guard`` of ``x``
    into ``dh2g_<src>``), copied into its trunk-gradient buffer ``dh2_<src>`` with the masks
    ``dh2m_<src>`` (``h2_grad_sum_mask`` of the one part); or both in one launch of
    ``h2_guard_mask`` (``step_program.FUSE_GUARD_MASK``)."""
    from foxhunt.fast import step_program

    lay, step = prog.lay, prog.kernels("step")
    n2 = lay.B * lay.H2
    if step_program.FUSE_GUARD_MASK:
        ops.kernel("h2_guard_mask", step.plan_h2_guard_mask(n2), x=x, h2="h2o", h2_pre="h2preo",
                   dh2_out=f"dh2_{src}", out=f"dh2m_{src}", n=n2,
                   multiplier=F32(prog.config.aux_guard_mult),
                   signal=Buf("isv", offset=isv_mod.H_S2_RMS_EMA_INDEX))
        return
    _guard(prog, ops, x, Buf(f"dh2g_{src}"), n2)
    ops.kernel("h2_grad_sum_mask", step.plan_h2_grad_sum_mask(n2), parts=f"dh2g_{src}", n_parts=1,
               part_stride=n2, h2="h2o", h2_pre="h2preo", dh2_out=f"dh2_{src}",
               out=f"dh2m_{src}", n=n2)


def _norm_partial(prog: StepProgram, ops: Ops, x: str, n: int, partials: str) -> None:
    ops.kernel("grad_norm_partial", prog.kernels("optim").plan_grad_norm_partial(n, NORM_SEGMENT),
               x=x, n=n, block_size=NORM_SEGMENT, partials=partials)


# --------------------------------------------------------------------------------------------
# IQN
# --------------------------------------------------------------------------------------------


def iqn_features(prog: StepProgram, ops: Ops, tag: str, stream: str) -> None:
    """One pass's quantile fractions and cosine features (and their BF16 copy)."""
    lay, c = prog.lay, prog.config
    M, K = lay.iqn_rows, c.iqn_embed
    key_lo, key_hi = rng.split_u64("seed", prog.seed)
    ops.kernel("iqn_tau_cos", prog.kernels("iqn").plan_iqn_tau_cos(M, K), step="step_count",
               key_lo=key_lo, key_hi=key_hi, stream=rng.STREAMS[stream],
               tau=Buf("iqn_tau", tag), cosines=Buf("iqn_cos", tag), rows=M, n_cos=K)
    if lay.bf16:
        prog.to_bf16(ops, Buf("iqn_cos", tag), Buf("iqn_cos_bf16", tag), M * K)


def _iqn_head(prog: StepProgram, ops: Ops, tag: str, which: int, h2: str) -> None:
    """One pass's head: ``phi`` (it reads no activation), then, once the pass's h2 is written
    (event ``h2_<tag>``), ``e`` (and its BF16 copy) and the quantiles ``q``."""
    lay, c = prog.lay, prog.config
    M, K, H, A = lay.iqn_rows, c.iqn_embed, lay.H2, lay.A_total
    bf16 = lay.bf16
    cos = Buf("iqn_cos_bf16" if bf16 else "iqn_cos", tag)
    phi = Buf("iqn_phi", tag)
    prog.linear(ops, rows=M, n=H, k=K, x=cos, w=prog.weight("w_phi", which, bf16=bf16), c=phi,
                bias=prog.weight("b_phi", which, bf16=False), epilogue="relu_bias")
    ops.wait(f"h2_{tag}")
    e_bf16 = Buf("iqn_e_bf16", tag) if bf16 else None
    # The float32 e of the target pass has no reader in bf16 (its GEMM reads e_bf16; the weight
    # gradient reads the online pass's e): the kernel skips that store (null e).
    e = None if bf16 and tag == "t" else Buf("iqn_e", tag)
    ops.kernel("iqn_modulate", prog.kernels("iqn").plan_iqn_modulate(M, H), h2=h2, phi=phi,
               e=e, e_bf16=e_bf16, rows=M, hidden=H, n_quantiles=c.iqn_quantiles)
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
    for tag, which, h2, stream in IQN_PASSES:
        head = ops.branch()
        iqn_features(prog, head, tag, stream)
        _iqn_head(prog, head, tag, which, h2)
        heads.append(head)
    ops.parallel(*heads)
    ops.wait("gathered")
    ops.kernel("iqn_quantile_huber", iqn.plan_iqn_quantile_huber(nb * B, N, prog.arch),
               q=Buf("iqn_q", "o"),
               q_target=Buf("iqn_q", "t"), tau=Buf("iqn_tau", "o"), actions="batch.a",
               a_star="a_star", r="batch.r", done="batch.done", gamma="gamma", isw="batch.isw",
               isv="isv", q_abs_ref_index=isv_mod.Q_ABS_REF_INDEX,
               k1=F32(c.target_q_clip_mult), n_actions="n_actions", action_offset="action_offset",
               y="iqn_y", dq="iqn_dq", loss=Buf("readback", offset=READBACK_INDEX["iqn_loss"]),
               n_branches=nb, batch=B, n_quantiles=N, a_total=A, **lay.n_step_args())
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
    _guard_mask(prog, trunk, "iqn", Buf("iqn_d_h2"))
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
# Auxiliary heads
# --------------------------------------------------------------------------------------------


def aux_chain(prog: StepProgram) -> Ops:
    """The auxiliary heads (``reference.aux_heads.aux_loss_and_grads``), beside the C51 chain:
    with the next-bar head, first ISV 117 from this batch's returns (the value its loss reads);
    per head ``hidden = elu(h2 W1^T + b1)``, the output layer, the weighted loss's gradient (its
    loss into the readback), the backward into ``grad_c51`` at the head's tensors (the C51
    budget) and the head's weighted ``d h2``; with both heads their guarded sum (unless the C51
    trunk takes the heads' ``d h2`` in one launch: ``StepProgram.aux_trunk_fused``). Records
    ``aux_dh2`` once all of it is written (the C51 trunk waits for it)."""
    from foxhunt.fast.wave_layout import aux_heads
    from foxhunt.reference.kernels.aux import LABEL_SCALE_FLOOR

    lay, c = prog.lay, prog.config
    auxk, optim = prog.kernels("aux"), prog.kernels("optim")
    B, H, AXH = lay.B, lay.H2, c.aux_hidden
    g = "grad_c51"
    ops = prog.ops()
    if c.aux_next_bar_on:
        ops.kernel("isv_label_scale_update", auxk.plan_isv_label_scale_update(B), isv="isv",
                   slot=isv_mod.AUX_LABEL_SCALE_EMA_INDEX, next_ret="batch.next_ret", n=B,
                   sharpe=Buf("isv", offset=isv_mod.SHARPE_EMA_INDEX),
                   alpha_base=F32(isv_mod.ALPHA_BASE_DEFAULT),
                   sharpe_clamp=F32(isv_mod.SHARPE_CLAMP), sharpe_gain=F32(isv_mod.SHARPE_GAIN))
    ops.wait("h2_o")  # the heads read online(s)'s h2 only
    heads = []
    for key, n_out in aux_heads(c):
        head = ops.branch()
        hid, out, dout = Buf(f"aux_hid_{key}"), Buf(f"aux_out_{key}"), Buf(f"aux_dout_{key}")
        prog.linear(head, rows=B, n=AXH, k=H, x=Buf("h2o_bf16" if lay.bf16 else "h2o"),
                    w=prog.weight(f"w_{key}1", 0, bf16=lay.bf16), c=hid, bias=None, epilogue=None)
        head.kernel("add_bias_elu", auxk.plan_add_bias_elu(B, AXH), y=hid,
                    b=prog.weight(f"b_{key}1", 0, bf16=False), out=hid, rows=B, cols=AXH)
        hid_in = hid
        if lay.bf16:
            hid_in = Buf(f"aux_hid_bf16_{key}")
            prog.to_bf16(head, hid, hid_in, B * AXH)
        prog.linear(head, rows=B, n=n_out, k=AXH, x=hid_in,
                    w=prog.weight(f"w_{key}2", 0, bf16=lay.bf16), c=out,
                    bias=prog.weight(f"b_{key}2", 0, bf16=False), epilogue="bias")
        if key == "nb":
            head.kernel("aux_next_bar_loss_grad", auxk.plan_aux_next_bar_loss_grad(B), pred=out,
                        next_ret="batch.next_ret", isv="isv", d_pred=dout,
                        loss=Buf("readback", offset=READBACK_INDEX["aux_next_bar_loss"]), batch=B,
                        label_scale_index=isv_mod.AUX_LABEL_SCALE_EMA_INDEX,
                        scale_floor=F32(LABEL_SCALE_FLOOR), weight=F32(c.aux_next_bar_weight))
        else:
            head.kernel("aux_regime_loss_grad", auxk.plan_aux_regime_loss_grad(B), logits=out,
                        regime="batch.regime", d_logits=dout,
                        loss=Buf("readback", offset=READBACK_INDEX["aux_regime_loss"]), batch=B,
                        n_regimes=n_out, weight=F32(c.aux_regime_weight))
        # The backward to d h2 in line; each layer's weight gradient beside it.
        w2, rest = head.branch(), head.branch()
        prog.weight_grad(w2, dy=dout, x=hid, rows=B, n_out=n_out, n_in=AXH,
                         dw=prog.grad(g, f"w_{key}2"), db=prog.grad(g, f"b_{key}2"))
        dhid, dpre = Buf(f"aux_dhid_{key}"), Buf(f"aux_dpre_{key}")
        prog.input_grad(rest, dy=dout, w=prog.weight(f"w_{key}2", 0, bf16=False), dx=dhid, rows=B,
                        n_out=n_out, n_in=AXH)
        rest.kernel("elu_backward", auxk.plan_elu_backward(B * AXH), dy=dhid, h=hid, dx=dpre,
                    n=B * AXH)
        w1, dx = rest.branch(), rest.branch()
        prog.weight_grad(w1, dy=dpre, x=Buf("h2o"), rows=B, n_out=AXH, n_in=H,
                         dw=prog.grad(g, f"w_{key}1"), db=prog.grad(g, f"b_{key}1"))
        prog.input_grad(dx, dy=dpre, w=prog.weight(f"w_{key}1", 0, bf16=False),
                        dx=Buf(f"aux_d_h2_{key}"), rows=B, n_out=AXH, n_in=H)
        rest.parallel(w1, dx)
        head.parallel(w2, rest)
        heads.append(head)
    if len(heads) > 1:
        ops.parallel(*heads)
    if len(heads) > 1 and not prog.aux_trunk_fused:  # (fused: h2_grad_sum_aux_mask sums them)
        # The heads' guarded sum from 0 (aux_heads' saxpy(saxpy(0, nb, 1), rg, 1)): the first
        # head's finite values (clamp_finite with an infinite bound), then the second's SAXPY.
        n2 = B * H
        ops.kernel("clamp_finite", prog.kernels("safety").plan_clamp_finite(n2), x="aux_d_h2_nb",
                   out="aux_dh2", n=n2, multiplier=F32(np.inf), signal="one")
        ops.kernel("saxpy", optim.plan_saxpy(n2), y="aux_dh2", x="aux_d_h2_rg", n=n2, a=F32(1))
    elif len(heads) == 1:
        ops.extend(heads[0])
    ops.record("aux_dh2")
    return ops


def aux_dh2(config) -> Buf | None:
    """The auxiliary heads' weighted ``d h2`` the C51 trunk adds (None with both heads off): a
    single head's own (the guarded SAXPY skips its non-finite values as the sum would), or the
    two heads' guarded sum."""
    from foxhunt.fast.wave_layout import aux_heads

    heads = aux_heads(config)
    if not heads:
        return None
    return Buf("aux_dh2") if len(heads) > 1 else Buf(f"aux_d_h2_{heads[0][0]}")


# --------------------------------------------------------------------------------------------
# MSE warm-up
# --------------------------------------------------------------------------------------------


def mse_warmup(prog: StepProgram, ops: Ops) -> None:
    """The MSE warm-up's blend into the C51 logit gradients (in place; untouched once ``w``
    reaches 0), after every branch's projection and the Mech 1 targets; its loss and weight
    into the readback. The epoch is ISV ``EPOCH_IDX`` on the device."""
    lay, c = prog.lay, prog.config
    B, NA, nb = lay.B, lay.NA, lay.nb
    ops.kernel("mse_warmup", prog.kernels("warmup").plan_mse_warmup(B, lay.branches, NA),
               logp=Buf("logp", ("o", 0)), actions="batch.a", q_taken="q_taken",
               target_q="target_q", isw="batch.isw", z="z", dlogits="dlogits_c51", isv="isv",
               epoch_index=isv_mod.EPOCH_IDX_INDEX, warmup_epochs=c.c51_warmup_epochs,
               n_actions="n_actions", action_offset="action_offset",
               loss=Buf("readback", offset=READBACK_INDEX["mse_loss"]),
               weight=Buf("readback", offset=READBACK_INDEX["mse_weight"]), n_branches=nb,
               batch=B, block_rows=2 * B, num_atoms=NA)


def mse_loss_blend(prog: StepProgram, ops: Ops) -> None:
    """The reported C51 loss blended with the MSE loss (after ``loss_scalars`` wrote it)."""
    ops.kernel("mse_loss_blend", prog.kernels("wave").plan_single(), readback="readback",
               c51_index=READBACK_INDEX["c51_loss"], mse_loss_index=READBACK_INDEX["mse_loss"],
               mse_weight_index=READBACK_INDEX["mse_weight"])


# --------------------------------------------------------------------------------------------
# Ensemble diversity
# --------------------------------------------------------------------------------------------


def ens_chain(prog: StepProgram) -> Ops:
    """The ensemble diversity (``reference.aux_heads.ens_loss_and_grads``), beside the C51
    chain: the frozen prior heads on online(s)'s h2 (parallel), the KL gradient on head 0's
    logits (its loss into the readback), back through the value head into ``ens_trunk_grad``
    (``[trunk_end, value_end)``), its ``d h2`` through the guard, masks and trunk backward into
    the trunk range, then the sanitisation and its norm's partials."""
    from foxhunt.reference.kernels.ensemble import ENS_SOFTMAX_EPS

    lay, c = prog.lay, prog.config
    B, H, NA, VH = lay.B, lay.H2, lay.NA, c.value_h
    n_priors = c.ens_heads - 1
    ops = prog.ops()
    ops.wait("h2_o")  # the priors read online(s)'s h2 only
    priors = []
    for k in range(1, c.ens_heads):
        prior = ops.branch()
        hid = Buf("ens_hid", k)
        prog.linear(prior, rows=B, n=VH, k=H, x=Buf("h2o_bf16" if lay.bf16 else "h2o"),
                    w=prog.weight(f"w_e{k}1", 0, bf16=lay.bf16), c=hid,
                    bias=prog.weight(f"b_e{k}1", 0, bf16=False), epilogue="relu_bias")
        hid_in = hid
        if lay.bf16:
            hid_in = Buf("ens_hid_bf16", k)
            prog.to_bf16(prior, hid, hid_in, B * VH)
        prog.linear(prior, rows=B, n=NA, k=VH, x=hid_in,
                    w=prog.weight(f"w_e{k}2", 0, bf16=lay.bf16), c=Buf("ens_priors", k),
                    bias=prog.weight(f"b_e{k}2", 0, bf16=False), epilogue="bias")
        priors.append(prior)
    if len(priors) > 1:
        ops.parallel(*priors)
    else:
        ops.extend(priors[0])
    packed = lay.packed["ens_priors"]
    assert [packed.offsets[k] for k in range(1, c.ens_heads)] == \
        [(k - 1) * B * NA for k in range(1, c.ens_heads)], "the priors must be contiguous"
    ops.wait("fwd_o")  # head 0's logits and the value head's activations
    plan = prog.kernels("ensemble").plan_ens_kl_grad(B, NA, n_priors, prog.arch)
    ops.kernel("ens_kl_grad", plan, v="vo", priors="ens_priors", d_v="ens_d_v", kl="ens_kl",
               loss=Buf("readback", offset=READBACK_INDEX["ens_loss"]), batch=B, num_atoms=NA,
               n_priors=n_priors, eps=F32(ENS_SOFTMAX_EPS))
    g = "ens_trunk_grad"
    P = lambda name: prog.weight(name, 0, bf16=False)  # noqa: E731 - f32 master weights
    # W_v2's gradient before the value head's input gradient, the last reader of d v (slot
    # 31's planted-NaN test poisons d v after that GEMM); the chain is not the step's longest.
    prog.weight_grad(ops, dy=Buf("ens_d_v"), x=Buf("hido", "value"), rows=B, n_out=NA, n_in=VH,
                     dw=prog.grad(g, "w_v2"), db=prog.grad(g, "b_v2"))
    prog.input_grad(ops, dy=Buf("ens_d_v"), w=P("w_v2"), dx=Buf("ens_dhv"), rows=B, n_out=NA,
                    n_in=VH, relu=(Buf("hido", "value"), prog.grad(g, "b_v1"),
                                   Buf("ens_dpre")))
    value, trunk = ops.branch(), ops.branch()
    prog.weight_grad(value, dy=Buf("ens_dhv"), x=Buf("h2o"), rows=B, n_out=VH, n_in=H,
                     dw=prog.grad(g, "w_v1"))
    prog.input_grad(trunk, dy=Buf("ens_dhv"), w=P("w_v1"), dx=Buf("ens_d_h2"), rows=B, n_out=VH,
                    n_in=H)
    _guard_mask(prog, trunk, "ens", Buf("ens_d_h2"))
    prog.trunk_backward(trunk, dh2m=Buf("dh2m_ens"), grad=g, dh1=Buf("dh1_ens"),
                        scratch=Buf("dpre_ens"))
    ops.parallel(value, trunk)
    end = lay.param_layout.value_end
    _guard(prog, ops, Buf(g), Buf("ens_trunk_clean"), end)
    _norm_partial(prog, ops, "ens_trunk_clean", end, "partials_ens")
    return ops


# --------------------------------------------------------------------------------------------
# The budget pipeline's stages and graph 2's second-wave records
# --------------------------------------------------------------------------------------------

#: Each injected source's sanitised trunk gradient (its injection) and weight field.
_INJECT = {"iqn": ("iqn_trunk_clean", "lambda_iqn"), "ens": ("ens_trunk_clean", "ens_weight")}


def budget(prog: StepProgram, ops: Ops) -> None:
    """The budget pipeline with the injected sources that are on (IQN, the ensemble), in one
    launch of ``clip_saxpy_norm_partial_wave``: the C51 clip, the CQL clipped SAXPY, then
    ``grad[0:trunk_end] += lambda_iqn * clipped(iqn_trunk_clean, 0.10 mgn)`` and
    ``grad[0:value_end] += ens_weight * clipped(ens_trunk_clean, 0.05 mgn)``, each element's
    operations in that order (``budgets.budget_pipeline`` then ``second_wave_budgets``), writing
    ``grad``, the total norm's partials and every source's squared norm, with no re-read of the
    running gradient between the sources. Call it only with an injected source on (the core
    step launches ``clip_saxpy_norm_partial``); :func:`source_norms` reads what it writes."""
    lay, c = prog.lay, prog.config
    sources = injected_sources(c)
    assert sources, "budget: no injected source is on (the core step's pipeline is graph1's)"
    wave = prog.kernels("wave")
    ends = {"iqn": lay.param_layout.trunk_end, "ens": lay.param_layout.value_end}
    args = {}
    for src in ("iqn", "ens"):
        on = src in sources
        inject, weight = _INJECT[src]
        args.update({src: inject if on else None, f"{src}_n": ends[src] if on else 0,
                     f"{src}_a": F32(getattr(c, weight)) if on else F32(0),
                     f"{src}_max_norm": F32(c.budget(src)) if on else F32(0),
                     f"{src}_partials": f"partials_{src}" if on else None,
                     f"{src}_norm_sq_out": f"sq_{src}" if on else None})
    out, partials = "grad", "partials_total"  # what Adam, the total norm and sentinel 6 read
    ops.kernel("clip_saxpy_norm_partial_wave",
               wave.plan_clip_saxpy_norm_partial_wave(lay.NP, NORM_SEGMENT), base="grad_c51",
               inject="grad_cql", n=lay.NP, base_max_norm=F32(c.budget("c51")),
               base_partials="partials_c51", a=F32(1.0), inject_max_norm=F32(c.budget("cql")),
               inject_partials="partials_cql", count=lay.n_partials,
               final_threads=wave.final_threads_clip_saxpy_norm_partial_wave(lay.n_partials),
               block_size=NORM_SEGMENT, out=out, partials=partials, base_norm_sq_out="sq_c51",
               inject_norm_sq_out="sq_cql", **args)


def source_norms(prog: StepProgram) -> list[Ops]:
    """Each injected source's norms into the readback (``source_norm_scalars`` of the squared
    norm :func:`budget` wrote), one branch per source, to run beside ``step_scalars``; none in
    the core step."""
    c = prog.config
    wave = prog.kernels("wave")
    norms = []
    for src in injected_sources(c):
        norm = prog.ops()
        norm.kernel("source_norm_scalars", wave.plan_single(), norm_sq=f"sq_{src}",
                    readback="readback", budget=F32(c.budget(src)),
                    pre_index=READBACK_INDEX[f"{src}_norm_pre"],
                    post_index=READBACK_INDEX[f"{src}_norm_post"])
        norms.append(norm)
    return norms


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


__all__ = ["aux_chain", "aux_dh2", "budget", "ens_chain", "iqn_adam",
           "iqn_chain", "iqn_features", "mse_loss_blend", "mse_warmup", "optimizer", "producers",
           "source_norms"]
