"""Graph 1 of the fast step, as records: forward passes, losses, backward passes, budgets.

Runs after the upload graph (``graph2_plan.upload_ops``). Branch structure:

- the step prologue (the step's ISV-driven bounds), then the fused check of the sentinel slots
  of the batch (checked here, not in graph 2, because the next step's upload overwrites the
  batch once this graph is done), alongside everything up to the budget launch;
- the target pass alongside the online pass over ``[s; s2]`` (one stacked pass; the heads in
  parallel inside each), and beside both every later chain, each waiting on the events of the
  passes it reads (``h2_o`` / ``h2_t`` once a pass's h2 is written, ``fwd_o`` / ``fwd_t`` at
  its end), so no chain waits for a pass it does not read:
- after log-softmax and expected Q, in parallel: the CQL chain (every branch's CQL logit
  gradient in one launch, then the heads' backward, value head, trunk, norm), the C51 chain
  (every branch's double-DQN choice and gathers in one launch, per branch the projection with
  the C51 gradient, then the backward and norm) and the C51 bookkeeping (scalar targets with
  Mech 1; the C51 losses and TD errors; the loss scalars of the readback);
- then the budget pipeline in one launch (both per-loss norms from their partials, ``grad =
  clip(grad_c51, 0.70 mgn) + clipped(grad_cql, 0.15 mgn)``, the total norm's partials). The
  step scalars (the total norm's phase 2, Mech 6's clip factor, the readback, the slow EMA) are
  graph 2's first side branch, beside Adam, which sums the partials itself, with the injected
  second-wave sources' norms (``graph2_plan.scalars_beside_adam``: at graph 1's end instead
  where ``step_program.WAVE_SCALARS_BESIDE_ADAM`` is off).

The second-wave sources that are on (``wave_plan``) join it: the auxiliary heads', IQN and
ensemble chains start at online (target) h2, beside the passes' heads (the IQN fractions and
``phi`` at once: they read no activation); the C51 trunk adds the auxiliary heads' ``d h2``,
the MSE warm-up runs inside the C51 chain (with the targets moved there); the injected sources
join the budget launch (``clip_saxpy_norm_partial_wave``), each source's norms into the
readback beside the step scalars. ``benches/critical_path.py`` prints the longest chain of each variant.
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast import isv_plan, support_plan, wave_plan
from foxhunt.fast.graph2_plan import scalars_beside_adam, step_scalars_ops
from foxhunt.fast.records import Buf, Ops
from foxhunt.fast.step_layout import LOSSES, NORM_SEGMENT
from foxhunt.fast.step_program import StepProgram
from foxhunt.fast.wave_layout import injected_sources
from foxhunt.reference import isv as isv_mod
from foxhunt.reference import sentinels
from foxhunt.reference.kernels.distributional import atom_spacing


def gather_project_dueling(config) -> bool:
    """Whether graph 1 runs the C51 chain's front as ONE launch,
    ``c51_gather_project_dueling_branches`` (gathers, every branch's projection and gradient,
    the C51 dueling backward): not with the MSE warm-up (it blends the logit gradients before
    the dueling backward) or a live support (``c51_project_grad_live`` per branch), and only
    where one block holds every branch's projection (``gather_project_dueling_fits``)."""
    from foxhunt.fast.kernels.step import gather_project_dueling_fits

    return (not config.mse_on and not config.adaptive_atoms
            and gather_project_dueling_fits(len(config.branches), config.num_atoms))


def graph1_ops(prog: StepProgram) -> Ops:
    lay, c = prog.lay, prog.config
    B, NA, nb, NP = lay.B, lay.NA, lay.nb, lay.NP
    dist, safety, opt, fused, step = (prog.kernels(a) for a in
                                      ("distributional", "safety", "optim", "fused", "step"))
    sp = lay.sentinel
    prologue = prog.ops()
    prologue.kernel("step_bounds", step.plan_step_bounds(), isv="isv", adam_t="adam_t",
                    weight_clamp="weight_clamp", clip_bound="clip_bound", thr_mult="thr_mult",
                    thr_isv_index="thr_isv_index", thr_power="thr_power", thresholds="thresholds",
                    n_thresholds=sp.n_desc, q_abs_ref_index=isv_mod.Q_ABS_REF_INDEX,
                    slow_ema_index=isv_mod.GRAD_NORM_SLOW_EMA_INDEX,
                    weight_clamp_mult=np.float32(c.weight_clamp_mult),
                    max_grad_norm=np.float32(c.max_grad_norm),
                    anchor_mult=np.float32(c.grad_clip_anchor_mult))
    prog.fused_check(prologue, "desc_lens_batch")

    ops = prog.ops()
    x, x2 = Buf("batch.x"), Buf("batch.x", offset=B * lay.SD)
    xb = xb2 = None
    if lay.bf16:
        xb, xb2 = Buf("xb"), Buf("xb", offset=B * lay.SD)
        prog.to_bf16(ops, x, xb, 2 * B * lay.SD)
    online, target = prog.ops(), prog.ops()
    # Slot 12: online(s)'s h2 before the Mech 10 clamp (the clamp writes another buffer).
    check_h2 = prog.ops()
    check_h2.kernel("nan_check", safety.plan_nan_check(B * lay.H2), x="h2preo", n=B * lay.H2,
                    flag=Buf("flags", offset=sentinels.index("h2")))
    prog.forward(online, tag="o", rows=2 * B, which=0, x=x, xb=xb,
                 logits=Buf("logits", ("o", 0)), logp=Buf("logp", ("o", 0)), q=Buf("q_o"),
                 extra=check_h2, h2_event="h2_o", fuse_trunk=True, fuse_heads=True,
                 fuse_outputs=True)
    online.record("fwd_o")
    prog.forward(target, tag="t", rows=B, which=1, x=x2, xb=xb2,
                 logits=Buf("logits", ("t", 0)), logp=Buf("logp", ("t", 0)), h2_event="h2_t",
                 fuse_trunk=True, fuse_heads=True, fuse_outputs=True)
    target.record("fwd_t")
    lo, hi = np.float32(c.v_min), np.float32(c.v_max)

    # The scalar targets and Mech 1 (they need the gathered p_next only).
    targets = prog.ops()
    if not c.mse_on:  # else they run in the C51 chain, after the gathers
        targets.wait("gathered")
    if c.adaptive_atoms:  # per branch on its live support
        support_plan.scalar_targets(prog, targets)
    else:
        targets.kernel("scalar_target_q_branches", step.plan_scalar_target_q_branches(nb, B),
                       p_next="p_next", z="z", r="batch.r", done="batch.done", gamma="gamma",
                       target_q="target_q", n_branches=nb, batch=B, num_atoms=NA,
                       **lay.n_step_args())
    targets.kernel("target_q_clip", safety.plan_target_q_clip(nb * B), q="target_q",
                   out="target_q", n=nb * B, k1=np.float32(c.target_q_clip_mult),
                   q_abs_ref=Buf("isv", offset=isv_mod.Q_ABS_REF_INDEX))
    if c.mse_on:
        targets.record("targets")

    # C51 logit gradients: one launch for every branch's double-DQN choice and gathers, then
    # per branch (parallel) the projection with the C51 gradient; with the MSE warm-up on, the
    # targets beside the projections, then the blend (wave_plan.mse_warmup). Without the warm-up
    # or a live support, and where a block holds every branch's projection, ONE launch does the
    # gathers, every branch's projection and the C51 dueling backward
    # (c51_gather_project_dueling_branches; the backward then skips that dueling backward).
    c51_pre = prog.ops()
    c51_pre.wait("fwd_o")
    c51_pre.wait("fwd_t")
    gather = dict(logp_target=Buf("logp", ("t", 0)), q_online="q_o", actions="batch.a",
                  n_actions="n_actions", action_offset="action_offset", a_star="a_star",
                  p_next="p_next", q_taken="q_taken", n_branches=nb, batch=B, num_atoms=NA,
                  q_rows=2 * B)
    front_done = gather_project_dueling(c)
    if front_done:
        c51_pre.kernel("c51_gather_project_dueling_branches",
                       step.plan_c51_gather_project_dueling_branches(nb, B, NA), **gather,
                       logp=Buf("logp", ("o", 0)), r="batch.r", done="batch.done", gamma="gamma",
                       z="z", isw="batch.isw", scale="scale", m="m", dlogits="dlogits_c51",
                       dv="dv_c51", dadv="dadv_c51", v_min=lo, v_max=hi,
                       dz=atom_spacing(lo, hi, NA), **lay.n_step_args())
        c51_pre.record("gathered")
        c51_pre.record("m")
    else:
        c51_pre.kernel("double_dqn_gather_branches",
                       step.plan_double_dqn_gather_branches(nb, B, NA), **gather)
        c51_pre.record("gathered")
    projections = []
    for d, n in enumerate(lay.branches if not front_done else ()):
        proj = prog.ops()
        # adaptive_atoms: branch d's live support and bounds by pointer (support_plan).
        name, support = (("c51_project_grad_live", support_plan.projection(d, NA))
                         if c.adaptive_atoms else
                         ("c51_project_grad", dict(z="z", v_min=lo, v_max=hi,
                                                   dz=atom_spacing(lo, hi, NA))))
        proj.kernel(name, dist.plan_c51_project_grad(B, n, NA),
                    p_next=Buf("p_next", offset=d * B * NA), r="batch.r", done="batch.done",
                    gamma=Buf("gamma", offset=d), logp=Buf("logp", ("o", d)),
                    actions=Buf("batch.a", offset=d * B), isw="batch.isw", scale="scale",
                    m=Buf("m", offset=d * B * NA), dlogits=Buf("dlogits_c51", d), batch=B,
                    num_actions=n, num_atoms=NA, **support, **lay.n_step_args())
        proj.record(f"m{d}")
        projections.append(proj)
    if c.mse_on:
        c51_pre.parallel(*projections, targets)
        wave_plan.mse_warmup(prog, c51_pre)
        c51_pre.record("mse")
    elif projections:
        c51_pre.parallel(*projections)
    # CQL logit gradients of every branch in one launch (first B samples of each block).
    cql_pre = prog.ops()
    cql_pre.wait("fwd_o")
    if c.adaptive_atoms:  # per branch on its live support
        support_plan.cql_grads(prog, cql_pre, isv_plan.alpha_buffer(c))
    else:
        cql_pre.kernel("cql_logit_grad_branches",
                       fused.plan_cql_logit_grad_branches(B, lay.branches, NA),
                       logp=Buf("logp", ("o", 0)), actions="batch.a", z="z",
                       alpha=isv_plan.alpha_buffer(c), scale="scale", n_actions="n_actions",
                       action_offset="action_offset", dlogits="dlogits_cql", terms="terms",
                       batch=B, block_rows=2 * B, num_atoms=NA)
    cql_pre.record("cql_terms")
    # The auxiliary heads (walked before the C51 chain, whose trunk waits for their d h2).
    aux_side = [wave_plan.aux_chain(prog)] if c.aux_on else []
    # The backward passes: stacked (each GEMM one launch for both losses), then the two norms
    # side by side; or (a population's members) a chain per loss.
    pres = {"c51": c51_pre, "cql": cql_pre}
    if prog.stacked_backward:
        back = prog.ops()
        prog.backward(back, pres, aux_dh2=wave_plan.aux_dh2(c),
                      dueling_done=("c51",) if front_done else ())
        norms = [back.branch() for _ in LOSSES]
        for loss, norm in zip(LOSSES, norms):
            prog.norm(norm, f"grad_{loss}", loss)
        back.parallel(*norms)
        loss_sides = [back]
    else:
        loss_sides = []
        for loss in ("cql", "c51"):
            side = prog.ops()
            prog.backward(side, {loss: pres[loss]},
                          aux_dh2=wave_plan.aux_dh2(c) if loss == "c51" else None,
                          dueling_done=("c51",) if front_done and loss == "c51" else ())
            prog.norm(side, f"grad_{loss}", loss)
            loss_sides.append(side)
    # C51 bookkeeping, beside the backward passes, in two parallel chains: the scalar targets
    # (in the C51 chain with the MSE warm-up on) and the C51 losses and TD errors (after every
    # branch's projection).
    losses = prog.ops()
    for event in ["m"] if front_done else [f"m{d}" for d in range(nb)]:
        losses.wait(event)
    losses.kernel("c51_loss_branches", fused.plan_c51_loss_branches(B, lay.branches, NA),
                  logp=Buf("logp", ("o", 0)), actions="batch.a", m="m", isw="batch.isw",
                  scale="scale", n_actions="n_actions", action_offset="action_offset", ce="ce",
                  total="c51_total", batch=B, block_rows=2 * B, num_atoms=NA)
    losses.kernel("branch_mean", step.plan_branch_mean(B), parts="ce", out="td", n=B, n_branches=nb,
                  part_stride=B, divisor=np.float32(nb))
    books = prog.ops()
    if c.mse_on:
        books.extend(losses)
        books.wait("targets")
    else:
        books.parallel(targets, losses)
    # The loss scalars and means of the readback (block reductions), beside the backward
    # passes: they need the C51 totals, the Q's and the CQL terms.
    books.wait("cql_terms")
    name, alpha = isv_plan.loss_scalars_alpha(c)  # the CQL-alpha ramp's slot, or cql_alpha
    books.kernel(name, step.plan_loss_scalars(), c51_total="c51_total", terms="terms",
                 q_taken="q_taken", target_q="target_q", readback="readback", n_branches=nb,
                 batch=B, **alpha)
    if c.mse_on:  # the reported C51 loss blended with the MSE warm-up's
        books.wait("mse")
        wave_plan.mse_loss_blend(prog, books)
    # Every chain forks here, beside both forward passes, and waits on the events of what it
    # reads: the C51 and CQL chains the passes' ends, the second-wave chains online (target)
    # h2 first (their heads need only the trunk) and the IQN chain the double-DQN actions
    # (walked after the C51 chain, which records them).
    wave = ([wave_plan.iqn_chain(prog)] if c.iqn_on else []) + \
        ([wave_plan.ens_chain(prog)] if c.ens_on else [])
    ops.parallel(target, online, *aux_side, *loss_sides, *wave, books)
    # Budget pipeline, one launch: the per-loss norms from their partials, the clips, the SAXPY
    # and the total norm's phase-1 partials (phase 2 is in the step scalars); with an injected
    # second-wave source on, the same launch injects them (``wave_plan.budget``).
    if injected_sources(c):
        wave_plan.budget(prog, ops)
    else:
        out, partials = "grad", "partials_total"
        ops.kernel("clip_saxpy_norm_partial", opt.plan_clip_saxpy_norm_partial(NP, NORM_SEGMENT),
                   base="grad_c51", inject="grad_cql", n=NP,
                   base_max_norm=np.float32(c.budget("c51")), base_partials="partials_c51",
                   a=np.float32(1.0), inject_max_norm=np.float32(c.budget("cql")),
                   inject_partials="partials_cql", count=lay.n_partials,
                   final_threads=opt.final_threads_clip_saxpy_norm_partial(lay.n_partials),
                   block_size=NORM_SEGMENT, out=out, partials=partials,
                   base_norm_sq_out="sq_c51", inject_norm_sq_out="sq_cql")
    body = prog.ops()
    isv_plan.consumers(prog, body)  # before the fork: the targets read gamma, CQL alpha_step
    support_plan.live_support(prog, body)  # adaptive_atoms: every consumer reads z_live
    body.parallel(prologue, ops)
    # The total norm's phase 2 and the step's scalars (step_scalars), with the injected sources'
    # norms: beside graph 2's Adam, which then sums the partials itself, or at graph 1's end
    # (graph2_plan.scalars_beside_adam).
    if not scalars_beside_adam(c):
        body.parallel(*wave_plan.source_norms(prog), step_scalars_ops(prog))
    return body


__all__ = ["graph1_ops"]
