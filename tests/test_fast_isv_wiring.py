"""Issue 19, part two, in the fast step's own plan on the CPU executor: each switch's producers
and the gamma schedule's consumer against the reference step within the step bounds
(``conformance.step_compare``; SPEC 8's one-step-at-a-time trajectory from the shared state)."""

import numpy as np
import pytest

from foxhunt.conformance.step_compare import compare_step, run_step
from foxhunt.fast.cpu_executor import CpuTrainer
from foxhunt.fast.graph2_plan import graph2_ops
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.isv_step import ADAPTIVE_SWITCHES
from foxhunt.reference.trainer import Trainer

#: SPEC 8's trajectory: 300 steps, compared one step at a time from the shared state.
TRAJECTORY_STEPS = 300
PRODUCER_KERNELS = {"isv_signal_build", "isv_signal_update", "q_stats_update",
                    "q_quantile_update", "adaptive_support_update", "per_branch_gamma_update"}


def _compare(config, state, batch):
    ref = Trainer(config)
    ref.load_state_dict({k: v.copy() for k, v in state.items()})
    fast = CpuTrainer(config)
    fast.load_state_dict({k: v.copy() for k, v in state.items()})
    try:
        ro, fo = run_step(ref, batch), run_step(fast, batch)
    finally:
        fast.close()
    bad = [r.message for r in compare_step(config, state, ro, fo) if not r.passed]
    assert not bad, "\n".join(bad)
    return ro


def _start(config, steps, seed=0):
    rng = np.random.default_rng(seed)
    t = Trainer(config, seed=1)
    t.set_loop_signals(total_epochs=10, sharpe_ema=0.7)
    t.set_epoch(3)
    for _ in range(steps):
        t.step(Batch.random(config, rng))
    return t, rng


@pytest.mark.parametrize("switch", [*ADAPTIVE_SWITCHES, "all"])
@pytest.mark.parametrize("steps", [0, 2], ids=["fresh", "warm"])
def test_one_step_with_a_switch_on_matches_the_reference(switch, steps):
    on = ADAPTIVE_SWITCHES if switch == "all" else (switch,)
    config = DQNConfig.preset("tiny", precision="f32", readback_interval=1,
                              **{name: True for name in on})
    t, rng = _start(config, steps)
    _compare(config, t.state_dict(), Batch.random(config, rng))


def test_a_trajectory_one_step_at_a_time_stays_within_the_bounds():
    """SPEC 8: the reference walks; at every step the fast step from the reference's state is
    compared with the reference's (every switch on, the ISV's producer slots bounded)."""
    config = DQNConfig.preset("tiny", precision="f32", readback_interval=1,
                              **{name: True for name in ADAPTIVE_SWITCHES})
    t, rng = _start(config, 0, seed=4)
    for _ in range(TRAJECTORY_STEPS):
        state, batch = t.state_dict(), Batch.random(config, rng)
        _compare(config, state, batch)
        t.step(batch)


def test_switches_off_launch_no_issue19_producer():
    plain = CpuTrainer(DQNConfig.preset("tiny", precision="f32"))
    try:
        names = {item.kernel for item in _launches(plain)}
    finally:
        plain.close()
    assert not names & PRODUCER_KERNELS and "isv_q_abs_ref_update" in names


def _launches(trainer):
    from foxhunt.fast.records import Launch, Parallel

    def walk(ops):
        for item in ops.items:
            if isinstance(item, Parallel):
                for side in (*item.sides, item.main):
                    yield from walk(side)
            elif isinstance(item, Launch):
                yield item
    return list(walk(graph2_ops(trainer._engine.program)))
