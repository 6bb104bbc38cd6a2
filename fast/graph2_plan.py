"""Graph 2 of the fast step (the optimiser tail) and the upload graph, as records.

Graph 2: on the step stream the optimiser chain (Adam with Mech 6's clip factor, which each of
its blocks computes from the total norm's partials, and Mech 9's clamp: ``adam_update_norm``;
then, in parallel, the check of the Adam moments and the chain batched spectral norm, Polyak
with the BF16 mirrors of params and target and the check of params and target, one launch with
the constant tau: ``post_check_in_polyak``); beside the whole
chain, forked at the graph's start, the step scalars (the total norm's phase 2, the readback,
``safety_scale``, Mech 6's slow EMA), then in parallel the ISV producers (they read graph 1's
``q_taken`` and ``h2`` and write their own ISV slots, which nothing in graph 2 reads: this
step's bounds were formed in graph 1; the adaptive signals read the readback) and the fused
check of the slots whose buffers graph 2 does not write (the readback among them); the
sentinel pieces' flags are merged once every piece is checked.

The upload graph, once per pinned staging buffer: the batch copy from that buffer into the
arena's ``batch``. The trainer replays it on its upload stream, after the previous step's
graph 1 (the last reader of ``batch``) and before this step's graph 1, so the copy overlaps the
previous step's graph 2 instead of heading this step's critical path. (The bf16 states' BF16
copy stays graph 1's first node: measured on the H200, seed preset, 154.5 us per step with it
there against 162.0 us with it in the upload graph.)
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast import isv_plan, step_program, wave_plan
from foxhunt.fast.records import Buf, Host, Ops
from foxhunt.fast.sentinel_plan import GRAPH2_WRITTEN, desc_entries, desc_lengths_split
from foxhunt.fast.step_program import StepProgram
from foxhunt.fast.wave_layout import injected_sources
from foxhunt.reference import isv as isv_mod
from foxhunt.reference.kernels.optim import POLYAK_CHECK_MAX
from foxhunt.reference.kernels.spectral import SPECTRAL_EPS
from foxhunt.reference.layout import ALIGN_ELEMS
from foxhunt.reference.trainer import ISV_PRODUCER_ALPHA

#: Host buffer names of the pinned staging ring (``staging_name(slot)``).
STAGING_PREFIX = "staging"


def staging_name(slot: int) -> str:
    return f"{STAGING_PREFIX}{slot}"


def upload_ops(prog: StepProgram, slots: int) -> list[Ops]:
    """The upload graph of each staging slot: ``batch`` from host buffer ``staging<slot>``."""
    out = []
    for slot in range(slots):
        ops = prog.ops()
        ops.copy("batch", Host(staging_name(slot)), prog.lay.batch_nbytes, "htod")
        out.append(ops)
    return out


def graph2_ops(prog: StepProgram) -> Ops:
    lay, c = prog.lay, prog.config
    NP = lay.NP
    opt, spec, isvk = prog.kernels("optim"), prog.kernels("spectral"), prog.kernels("isv")
    body, main = prog.ops(), prog.ops()
    target = Buf("params2", offset=NP)
    # The main Adam covers the core and the auxiliary heads (layout.main_adam_end, rounded up
    # to the tensor alignment: padding only; NP when no IQN or ensemble tensor follows).
    n_main = min(NP, -(-lay.param_layout.main_adam_end // ALIGN_ELEMS) * ALIGN_ELEMS)
    adam = dict(param="params2", grad="grad", m="adam_m", v="adam_v", n=n_main, step="adam_t",
                lr=np.float32(c.lr), beta1=np.float32(c.beta1), beta2=np.float32(c.beta2),
                eps=np.float32(c.adam_eps), weight_decay=np.float32(c.weight_decay),
                weight_clamp="weight_clamp")
    beside = scalars_beside_adam(c)
    if beside:  # Mech 6's clip factor from the partials in every block: step_scalars' bits
        main.kernel("adam_update_norm", opt.plan_adam_update_norm(n_main),
                    total_partials="partials_total", n_partials=lay.n_partials,
                    final_threads=opt.final_threads_adam_update_norm(lay.n_partials),
                    clip_bound="clip_bound", **adam)
    else:  # step_scalars ended graph 1
        main.kernel("adam_update", opt.plan_adam_update(n_main), grad_scale="safety_scale",
                    **adam)
    ops = wave_plan.optimizer(prog, main)
    # After Adam, in parallel: the check of the Adam moments (final once Adam is done), and the
    # chain spectral norm, Polyak with the BF16 mirrors of params and target ([params; target]
    # in mirror2, one launch), the check of params and target.
    moments, chain = prog.ops(), prog.ops()
    prog.fused_check(moments, "desc_lens_moments")
    n_w = len(lay.weights)
    fit = c.precision in step_program.SPECTRAL_FIT_CLUSTERS
    chain.kernel("batched_spectral_norm",
                 spec.plan_step_spectral_norm(n_w, prog.arch, fit_clusters=fit),
                 mats="spectral_desc", count=n_w, sigma_max=np.float32(c.sigma_max),
                 eps=SPECTRAL_EPS, sigmas="sigmas")
    polyak, tau = isv_plan.polyak_tau(c)  # the adaptive tau's slot (graph 1 copied it), or tau
    polyak_args = dict(target=target, online="params2", n=NP, **tau, online_bf16="mirror2",
                       target_bf16=Buf("mirror2", offset=NP))
    if post_check_in_polyak(lay, polyak):  # the check of params and target in Polyak's pass
        chain.kernel("polyak_update_mirror_check", opt.plan_polyak_update_mirror(NP), **polyak_args,
                     buffers="desc_ptrs", lengths="desc_lens_post", thresholds="thresholds",
                     flags="flags", n_entries=lay.sentinel.n_desc)
    else:
        chain.kernel(polyak, opt.plan_polyak_update_mirror(NP), **polyak_args)
        prog.fused_check(chain, "desc_lens_post")
    if moments.items:
        ops.parallel(moments, chain)
    else:
        ops.extend(chain)
    sp = lay.sentinel
    producers, first, rest = prog.ops(), prog.ops(), prog.ops()
    nq = lay.nb * lay.B
    first.kernel("isv_q_abs_ref_update", isvk.plan_isv_q_abs_ref_update(nq), isv="isv",
                 slot=isv_mod.Q_ABS_REF_INDEX, q="q_taken", n=nq,
                 alpha=np.float32(ISV_PRODUCER_ALPHA))
    nh = lay.B * lay.H2
    rest.kernel("isv_h2_rms_update", isvk.plan_isv_h2_rms_update(nh), isv="isv",
                slot=isv_mod.H_S2_RMS_EMA_INDEX, h2="h2o", n=nh,
                alpha=np.float32(ISV_PRODUCER_ALPHA))
    wave_plan.producers(prog, rest)
    # With issue 19's switches on, its producers and these run in parallel branches.
    isv_plan.producers(prog, producers, first, rest, after_scalars=beside)
    checks_pre = prog.ops()
    if beside:
        checks_pre.wait(isv_plan.STEP_SCALARS_DONE)  # it checks the readback (step_scalars)
    prog.fused_check(checks_pre, "desc_lens_pre")
    # The extra pieces' flags are ORed into their slots' flags once every piece has been
    # checked: right after the "pre" check when all pieces are there (the seed preset's are:
    # packed per-branch buffers that graph 2 does not write), else after the join.
    merge = prog.ops()
    if sp.n_pieces:
        merge.kernel("merge_piece_flags", prog.kernels("step").plan_merge_piece_flags(),
                     flags="flags", piece_slot="piece_slot", n_slots=sp.n_slots,
                     n_pieces=sp.n_pieces)
    branches = [producers, checks_pre, ops]
    if beside:
        # The step's scalars (the total norm's phase 2, the readback, safety_scale, Mech 6's
        # slow EMA) on a branch of their own, walked first; their readers wait for its event:
        # the "pre" check (it checks the readback) and the adaptive signals (isv_plan).
        norms = wave_plan.source_norms(prog)
        if norms:  # the injected sources' norms into the readback, beside step_scalars
            scalars = prog.ops()
            scalars.parallel(*norms, step_scalars_ops(prog))
        else:
            scalars = step_scalars_ops(prog)
        scalars.record(isv_plan.STEP_SCALARS_DONE)
        branches.insert(0, scalars)
    merge_in_checks = all(piece.buffer not in GRAPH2_WRITTEN for piece in sp.extras)
    if merge_in_checks:
        checks_pre.extend(merge)
    body.parallel(*branches)
    if not merge_in_checks:
        body.extend(merge)
    return body


def scalars_beside_adam(config) -> bool:
    """Where ``step_scalars`` runs, with the injected second-wave sources' norm launches
    (``wave_plan.source_norms``): beside graph 2's Adam (``adam_update_norm``, which sums the
    total norm's partials itself), or at graph 1's end, after the budget launch, with Adam
    reading ``safety_scale`` (``adam_update``). Beside Adam in the core step; with an injected
    source (IQN, the ensemble) only where ``step_program.WAVE_SCALARS_BESIDE_ADAM``. Measured on
    the H200 (session 28, the sources' norms then at graph 1's end either way), the core bf16
    step 114.7 -> 112.0 us with ``step_scalars`` beside Adam, the step with every second-wave
    source 162.7 -> 166.7 us."""
    return not injected_sources(config) or step_program.WAVE_SCALARS_BESIDE_ADAM


def post_check_in_polyak(lay, polyak: str) -> bool:
    """Whether graph 2 checks params and target after Polyak (the entries of
    ``desc_lens_post``) inside the Polyak launch, ``polyak_update_mirror_check``, instead of a
    ``nan_check_fused`` node after it: with the constant tau (``polyak`` is
    ``polyak_update_mirror``; the adaptive tau's ``polyak_update_mirror_ptr`` keeps the node) and
    1 to ``POLYAK_CHECK_MAX`` entries, each in ``params2`` (the online and target rows the
    kernel passes over). Those entries are the slots on params and target
    (``sentinel_plan.desc_lengths_split``)."""
    if polyak != "polyak_update_mirror":
        return False
    lengths = desc_lengths_split(lay.sentinel)["desc_lens_post"]
    post = [piece for k, piece in desc_entries(lay.sentinel) if lengths[k]]
    if any(piece.buffer != "params2" for piece in post):
        raise AssertionError(f"a post-Polyak sentinel entry outside params2: {post}")
    return 0 < len(post) <= POLYAK_CHECK_MAX


def step_scalars_ops(prog: StepProgram) -> Ops:
    """``step_scalars``: the total norm's phase 2 (``grad_norm_final``'s block, so its tree and
    bits), ``safety_scale``, the readback's norms and flags and Mech 6's slow EMA."""
    lay, c = prog.lay, prog.config
    ops = prog.ops()
    ops.kernel("step_scalars", prog.kernels("step").plan_step_scalars(lay.n_partials),
               total_partials="partials_total", n_partials=lay.n_partials, total_sq="sq_total",
               c51_sq="sq_c51", cql_sq="sq_cql", clip_bound="clip_bound", isv="isv",
               safety_scale="safety_scale", readback="readback",
               budget_c51=np.float32(c.budget("c51")), budget_cql=np.float32(c.budget("cql")),
               slow_ema_index=isv_mod.GRAD_NORM_SLOW_EMA_INDEX,
               slow_alpha=np.float32(c.grad_slow_ema_alpha))
    return ops


__all__ = ["STAGING_PREFIX", "graph2_ops", "post_check_in_polyak", "scalars_beside_adam",
           "staging_name", "step_scalars_ops", "upload_ops"]
