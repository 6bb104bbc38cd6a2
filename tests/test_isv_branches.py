"""Graph 2's ISV producers run in parallel branches (``isv_plan.producers``): no two launches
that no dependency orders share an ISV slot that either writes (``isv_plan.isv_races``, from
each kernel's declared slots ``isv_plan.ISV_ACCESS``), for every switch alone and all together,
with the second-wave sources of the ``seed`` preset on; the checker itself finds a race."""

import numpy as np
import pytest

from foxhunt.fast import isv_plan
from foxhunt.fast.cpu_executor import CpuTrainer
from foxhunt.fast.graph2_plan import graph2_ops
from foxhunt.fast.records import Launch
from foxhunt.reference import isv as reg
from foxhunt.reference.config import ADAPTIVE_ON, DQNConfig, SEED_SECOND_WAVE
from foxhunt.reference.isv_step import ADAPTIVE_SWITCHES

EVERY = ADAPTIVE_ON


def _graph2(**fields):
    config = DQNConfig.preset("tiny", precision="f32", **fields)
    trainer = CpuTrainer(config)
    try:
        return graph2_ops(trainer._engine.program)
    finally:
        trainer.close()


@pytest.mark.parametrize("switches", [*({n: True} for n in ADAPTIVE_SWITCHES), EVERY],
                         ids=[*ADAPTIVE_SWITCHES, "every"])
@pytest.mark.parametrize("wave", [False, True], ids=["core", "second-wave"])
def test_no_two_unordered_producers_share_a_written_slot(switches, wave):
    g2 = _graph2(**switches, **(SEED_SECOND_WAVE if wave else {}))
    assert isv_plan.isv_races(g2) == []
    kernels = [n.kernel for n in g2.nodes() if isinstance(n, Launch)]
    assert kernels.count("isv_q_abs_ref_update") == 1 and kernels.count("isv_h2_rms_update") == 1


def test_every_producer_runs_beside_the_others_with_every_switch_on():
    """The longest producer chain is short: the quantiles, the gamma schedule and the signal
    chain are parallel branches, not one sequence (the point of the branches)."""
    from foxhunt.fast.dataflow import dependency_graph

    g2 = _graph2(**EVERY)
    nodes, deps = dependency_graph([g2])
    index = {n.kernel: i for i, n in enumerate(nodes) if isinstance(n, Launch)}
    quantiles = [i for i, n in enumerate(nodes) if getattr(n, "kernel", "") == "q_quantile_update"]
    assert len(quantiles) == DQNConfig.preset("tiny").n_branches
    depth = []
    for i in range(len(nodes)):
        depth.append(1 + max((depth[d] for d in deps[i]), default=0))
    for q in quantiles:  # straight after the fork: nothing of graph 2 before them
        assert deps[q] == frozenset()
    assert deps[index["per_branch_gamma_update"]] == frozenset()
    # the signal build reads the readback's grad_norm and loss: after step_scalars only
    assert deps[index["isv_signal_build"]] == frozenset({index["step_scalars"]})
    assert deps[index["step_scalars"]] == frozenset()
    # support after the quantiles and Q_ABS_REF, q_stats after the build read the Q-mean EMAs
    support = index["adaptive_support_update"]
    assert all(depth[support] > depth[q] for q in quantiles)
    assert depth[index["q_stats_update"]] > depth[index["isv_signal_build"]]
    assert depth[index["cql_alpha_ramp"]] > depth[index["epsilon_tau_update"]] \
        > depth[index["isv_signal_update"]]


def test_switches_off_keep_the_producers_one_sequence():
    g2 = _graph2()
    from foxhunt.fast.dataflow import dependency_graph

    nodes, deps = dependency_graph([g2])
    index = {n.kernel: i for i, n in enumerate(nodes) if isinstance(n, Launch)}
    assert deps[index["isv_h2_rms_update"]] == frozenset({index["isv_q_abs_ref_update"]})


def test_the_checker_finds_an_unordered_pair_that_shares_a_slot():
    """Two branches that both blend the Q_ABS_REF slot, and a reader of slot 41 beside its
    writer: both reported; the same launches one after the other: none."""
    g2 = _graph2(**EVERY)
    prog_ops = g2.branch()
    launches = {n.kernel: n for n in g2.nodes() if isinstance(n, Launch)}

    def again(ops, kernel):
        n = launches[kernel]
        ops.kernel(n.kernel, (n.shape.grid, n.shape.block, n.shape.shared_mem), **n.args)

    a, b = prog_ops.branch(), prog_ops.branch()
    again(a, "isv_q_abs_ref_update")
    again(b, "adaptive_support_update")  # reads Q_ABS_REF
    c, d = prog_ops.branch(), prog_ops.branch()
    again(c, "epsilon_tau_update")
    again(d, "cql_alpha_ramp")  # reads EPSILON_EFF
    prog_ops.parallel(a, b)
    prog_ops.parallel(c, d)
    races = isv_plan.isv_races(prog_ops)
    assert len(races) == 2
    assert f"[{reg.Q_ABS_REF_INDEX}]" in races[0] and f"[{reg.EPSILON_EFF_INDEX}]" in races[1]
    serial = g2.branch()
    for k in ("isv_q_abs_ref_update", "adaptive_support_update", "epsilon_tau_update",
              "cql_alpha_ramp"):
        again(serial, k)
    assert isv_plan.isv_races(serial) == []


def test_a_launch_binding_isv_without_a_declared_access_is_refused():
    g2 = _graph2(**EVERY)
    ops = g2.branch()
    ops.kernel("clamp_finite_isv", (1, 32, 0), x="h2preo", out="h2o", out_bf16=None, n=4,
               isv="isv", index=reg.H_S2_RMS_EMA_INDEX, mult=np.float32(1.0))
    with pytest.raises(KeyError, match="clamp_finite_isv: binds isv but has no ISV_ACCESS"):
        isv_plan.isv_races(ops)


def test_either_branch_order_gives_the_same_isv_bits():
    """The CPU executor runs graph 2's branches latest-first or in capture order: with every
    switch on, two warm steps give the same ISV bits either way."""
    from foxhunt.reference.batch import Batch

    config = DQNConfig.preset("tiny", precision="f32", readback_interval=1, **EVERY)
    out = []
    for order in ("latest_first", "capture_order"):
        rng = np.random.default_rng(3)
        t = CpuTrainer(config, seed=1, branch_order=order)
        try:
            t.set_loop_signals(total_epochs=10, sharpe_ema=0.7, epsilon=(0.4, 1.0))
            t.set_epoch(3)
            for _ in range(3):
                t.step(Batch.random(config, rng))
            out.append(np.asarray(t.state_dict()["isv"], np.float32).copy())
        finally:
            t.close()
    assert out[0].view(np.uint32).tolist() == out[1].view(np.uint32).tolist()
    produced = [reg.Q_P05_INDICES[0], reg.V_CENTER_INDICES[0], reg.CQL_ALPHA_INDEX,
                reg.EPSILON_EFF_INDEX, reg.GAMMA_INDICES[0], 0]
    assert all(out[0][s] != reg.ISVBus().to_array()[s] for s in produced)
