"""The CPU executor's steps of a config with and without a plan option, compared bit for bit
(the fused kernels' tests: a fused launch's twin composes the reference functions of the nodes
it replaces, so the steps must end in the same bits)."""

from __future__ import annotations

import numpy as np


def step_run(config, options: dict, *, steps: int = 3, seed: int = 4) -> tuple:
    """``steps`` CPU-executor steps of ``config`` with ``options``: ``(state, scalars, TD errors,
    greedy Q's of the first batch)``."""
    from foxhunt.fast.cpu_executor import CpuTrainer
    from foxhunt.reference.batch import Batch

    batches = [Batch.random(config, np.random.default_rng(s)) for s in range(steps)]
    trainer = CpuTrainer(config, seed=seed, **options)
    scalars = [trainer.step(b) for b in batches]
    return (trainer.state_dict(), scalars, np.array(trainer.last_td_errors()),
            [np.array(q) for q in trainer.q_values(batches[0].s)])


def assert_runs_bitwise_equal(config, run0: tuple, run1: tuple, *, seed: int = 4) -> None:
    """Two ``step_run`` results end in the same bits: every state buffer, the step scalars, the
    TD errors and the greedy Q's; and they did train (the parameters moved)."""
    from foxhunt.fast.cpu_executor import CpuTrainer

    (state0, scalars0, td0, q0), (state1, scalars1, td1, q1) = run0, run1
    assert state0.keys() == state1.keys()
    differ = [k for k in state0 if np.asarray(state0[k]).tobytes() != np.asarray(state1[k]).tobytes()]
    assert not differ
    assert scalars0 == scalars1 and td0.tobytes() == td1.tobytes()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(q0, q1))
    assert np.abs(state0["params"] - CpuTrainer(config, seed=seed).state_dict()["params"]).max() > 0


def assert_steps_bitwise_equal(config, options: dict, *, steps: int = 3, seed: int = 4) -> None:
    """``steps`` CPU-executor steps of ``config`` without and with ``options`` end in the same
    bits (``assert_runs_bitwise_equal``)."""
    assert_runs_bitwise_equal(config, step_run(config, {}, steps=steps, seed=seed),
                              step_run(config, options, steps=steps, seed=seed), seed=seed)


def launch_count(ops, kernel: str) -> int:
    """Launch records of ``kernel`` in a plan's ``ops``."""
    from foxhunt.fast.records import Launch

    return sum(1 for node in ops.nodes() if isinstance(node, Launch) and node.kernel == kernel)
