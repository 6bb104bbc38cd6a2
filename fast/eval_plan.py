"""The greedy forward of ``Trainer.q_values`` as records: one graph per row count.

``eval_ops(prog, evl)``: the states are copied in from host buffer ``x_host`` (pinned on the
GPU) into ``x_e``, the forward runs on the online params with the trainer's ISV (Mech 10
clamp), log-softmax and expected Q into ``q_e`` (packed per branch), and ``q_e`` is copied out
to host buffer ``q_host``: the whole evaluation is one captured graph. Its buffers are those of
``EvalLayout(layout, rows)`` (their own small arena); the side streams of its branches come
from the trainer's pool.
"""

from __future__ import annotations

from foxhunt.fast.records import Buf, Host, Ops
from foxhunt.fast.step_layout import EvalLayout
from foxhunt.fast.step_program import StepProgram

#: Host buffers of the evaluation graph.
X_HOST, Q_HOST = "x_host", "q_host"


def eval_host_nbytes(evl: EvalLayout) -> dict[str, int]:
    """Bytes of the host buffers ``x_host`` (the states) and ``q_host`` (the Q values)."""
    return {X_HOST: evl.rows * evl.SD * 4, Q_HOST: evl.specs["q_e"][0][0] * 4}


def eval_ops(prog: StepProgram, evl: EvalLayout) -> Ops:
    ops = Ops(prog.eval_binder(evl, eval_host_nbytes(evl)))
    rows, lay = evl.rows, prog.lay
    ops.copy("x_e", Host(X_HOST), rows * lay.SD * 4, "htod")
    xb = None
    if lay.bf16:
        xb = Buf("xb_e")
        prog.to_bf16(ops, Buf("x_e"), xb, rows * lay.SD)
    prog.forward(ops, tag="e", rows=rows, which=0, x=Buf("x_e"), xb=xb, aux=False,
                 logits=Buf("logits_e", 0), logp=Buf("logp_e", 0), q=Buf("q_e"))
    ops.copy(Host(Q_HOST), "q_e", eval_host_nbytes(evl)[Q_HOST], "dtoh")
    return ops


__all__ = ["Q_HOST", "X_HOST", "eval_host_nbytes", "eval_ops"]
