"""``c51_gather_project_dueling_branches``: the C51 chain's front (double-DQN gathers, every
branch's projection with its gradient, the C51 dueling backward) in one launch.

Its reference twin is the composition of the three reference kernels; the CUDA kernel's outputs
are compared with it in conformance (``conformance/specs/step.py``). Here: where the step plans
it, that a step with it ends in the same bits as a step with the three launches (the CPU
executor; and the GPU, where there is one), and the twin's argument checks and NaN contract.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foxhunt.fast import graph1_plan
from foxhunt.fast.kernels.step import (
    MAX_BLOCK_THREADS,
    gather_project_dueling_fits,
    plan_c51_gather_project_dueling_branches,
)
from foxhunt.fast.records import Launch
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig, source_overrides
from foxhunt.reference.kernels import distributional as dist
from foxhunt.reference.kernels import fused
from foxhunt.reference.kernels import step as rstep

F32, I32 = np.float32, np.int32
FRONT = "c51_gather_project_dueling_branches"


def _count(ops, kernel: str) -> int:
    return sum(1 for node in ops.nodes() if isinstance(node, Launch) and node.kernel == kernel)


def _both_ways(monkeypatch, make, run) -> list:
    """``run(trainer)`` for a trainer ``make()`` builds with the front in its plan, then for one
    built with the three kernels (``graph1_plan.gather_project_dueling`` patched off)."""
    out = []
    for front in (True, False):
        with monkeypatch.context() as patch:
            if not front:
                patch.setattr(graph1_plan, "gather_project_dueling", lambda c: False)
            trainer = make()
            try:
                assert _count(trainer.engine.plans["graph1"], FRONT) == int(front)
                out.append(run(trainer))
            finally:
                getattr(trainer, "close", lambda: None)()
    return out


def _differ(state0: dict, state1: dict) -> list[str]:
    """The state entries whose bytes differ (and any entry only one side has)."""
    keys = state0.keys() | state1.keys()
    return sorted(k for k in keys if k not in state0 or k not in state1
                  or np.asarray(state0[k]).tobytes() != np.asarray(state1[k]).tobytes())


# ------------------------------------------------------------------------------ in the plan
@pytest.mark.parametrize("overrides, front", [
    (source_overrides("core"), True), (source_overrides("iqn"), True),
    (source_overrides("all"), False), (source_overrides("mse"), False),
    ({**source_overrides("core"), "adaptive_atoms": True, "q_stats": True}, False)])
def test_graph1_runs_the_front_in_one_launch_unless_the_warmup_or_a_live_support_needs_three(
        overrides, front):
    """Seed bf16 step (the CPU executor's plans): with the front, no gather or per-branch
    projection is launched and only the CQL pass keeps a dueling backward; with the MSE warm-up
    (it blends the logit gradients first) or a live support the three kernels run."""
    from foxhunt.fast.cpu_executor import CpuEngine

    config = DQNConfig.preset("seed", precision="bf16", **overrides)
    graph1 = CpuEngine(config).plans["graph1"]
    assert _count(graph1, FRONT) == int(front)
    assert _count(graph1, "double_dqn_gather_branches") == int(not front)
    projections = _count(graph1, "c51_project_grad") + _count(graph1, "c51_project_grad_live")
    assert projections == (0 if front else config.n_branches)
    assert _count(graph1, "dueling_combine_backward_sum_branches") == (1 if front else 2)


@pytest.mark.parametrize("precision, source", [("f32", "core"), ("bf16", "core"),
                                               ("bf16", "iqn")])
def test_on_the_cpu_executor_the_front_steps_bitwise_as_its_three_kernels(
        monkeypatch, precision, source):
    """The twin is the composition of the three kernels' reference functions, so the CPU
    executor's steps with and without the front end in the same bits (every state buffer, the
    step scalars, the TD errors)."""
    from foxhunt.fast.cpu_executor import CpuTrainer

    config = DQNConfig.preset("tiny", precision=precision, **source_overrides(source))
    batches = [Batch.random(config, np.random.default_rng(s)) for s in range(3)]

    def run(trainer):
        scalars = [trainer.step(b) for b in batches]
        return trainer.state_dict(), scalars, np.array(trainer.last_td_errors())

    (state0, scalars0, td0), (state1, scalars1, td1) = _both_ways(
        monkeypatch, lambda: CpuTrainer(config, seed=5), run)
    assert not _differ(state0, state1)
    assert scalars0 == scalars1 and td0.tobytes() == td1.tobytes()


def _gpu_reason() -> str | None:
    from foxhunt.fast.device import cuda_available

    ok, reason = cuda_available()
    return None if ok else reason


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=f"no CUDA device/driver: {_gpu_reason()}")
@pytest.mark.parametrize("precision, source", [("f32", "core"), ("bf16", "core"),
                                               ("bf16", "iqn")])
def test_on_the_gpu_the_front_steps_bitwise_as_its_three_kernels(monkeypatch, precision, source):
    """The CUDA front runs each output element with the expression of the kernel it comes
    from, so the GPU steps with and without it end in the same bits (seed preset, 3 steps; a
    NaN injected into one batch's rewards in the last step)."""
    from foxhunt.fast.trainer import Trainer

    config = DQNConfig.preset("seed", precision=precision, **source_overrides(source))
    batches = [Batch.random(config, np.random.default_rng(s)) for s in range(3)]
    batches[2].r[3] = np.nan

    def run(trainer):
        for b in batches:
            trainer.step(b)
        return trainer.state_dict()

    assert not _differ(*_both_ways(monkeypatch, lambda: Trainer(config, seed=5), run))


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=f"no CUDA device/driver: {_gpu_reason()}")
@pytest.mark.parametrize("atoms", [11, 51, 300])  # one tile; one tile of 64; several tiles
def test_on_the_gpu_the_front_gives_the_bits_of_its_three_kernels(atoms):
    """The CUDA front against the CUDA gather, per-branch projection and dueling sum run one
    after the other on the same inputs, NaN and Inf among them: every output bitwise equal (NA =
    300 takes the several-tiles path)."""
    from foxhunt.fast.kernels import fused as ffused
    from foxhunt.fast.kernels import step as fstep
    from foxhunt.fast.kernels.distributional import c51_project_grad

    kw = _inputs(np.random.default_rng(atoms), batch=9, atoms=atoms)
    kw["r"][1], kw["r"][2], kw["logp_target"][5, 3], kw["q_online"][20] = np.nan, np.inf, np.nan, np.nan
    kw["logp"][4, 0] = np.nan
    got = fstep.c51_gather_project_dueling_branches(**kw)
    g = fstep.double_dqn_gather_branches(kw["logp_target"], kw["q_online"], kw["actions"],
                                         kw["branches"], kw["batch"])
    m, blocks = [], []
    for d, logp_d in enumerate(fused.split_branches(kw["logp"], kw["branches"])):
        pg = c51_project_grad(g.p_next[d], kw["r"], kw["done"], kw["gamma"][d], kw["z"], -10.0,
                              10.0, np.ascontiguousarray(logp_d[:kw["batch"]]), kw["actions"][d],
                              kw["isw"], kw["scale"])
        m.append(pg.m)
        blocks.append(pg.dlogits.reshape(-1, atoms))
    dlogits = np.concatenate(blocks)
    duel = ffused.dueling_combine_backward_sum_branches(dlogits, kw["branches"])
    want = rstep.C51GatherProjectDueling(g.a_star, g.p_next, g.q_taken, np.stack(m), dlogits,
                                         duel.dv, duel.dadv)
    assert np.isnan(got.m).any() and np.isnan(got.dv).any()
    for name in want._fields:
        assert getattr(got, name).tobytes() == getattr(want, name).tobytes(), name


# ------------------------------------------------------------------------------ the plan
def test_the_plan_puts_every_branch_of_a_sample_in_one_block():
    grid, block, shared = plan_c51_gather_project_dueling_branches(3, 256, 51)
    assert grid == (256, 1, 1) and block == (64, 3, 1) and shared == 3 * 64 * 3 * 4
    assert gather_project_dueling_fits(4, 256)  # 4 * 256 threads
    assert not gather_project_dueling_fits(5, 256)
    with pytest.raises(ValueError, match=rf"^branches: 5 branches of 256 atoms need 1280 threads "
                                         rf"per block of {FRONT}; at most {MAX_BLOCK_THREADS}$"):
        plan_c51_gather_project_dueling_branches(5, 8, 256)


# ------------------------------------------------------------------------------ the twin
def _inputs(rng, branches=(3, 3, 2), batch=6, atoms=11):
    a_total = sum(branches)

    def log_softmax(shape):
        x = rng.standard_normal(shape) * 2
        x = x - x.max(axis=-1, keepdims=True)
        return (x - np.log(np.exp(x).sum(axis=-1, keepdims=True))).astype(F32)

    return dict(logp_target=log_softmax((batch * a_total, atoms)),
                q_online=rng.standard_normal(2 * batch * a_total).astype(F32),
                actions=np.stack([rng.integers(0, n, batch) for n in branches]).astype(I32),
                logp=log_softmax((2 * batch * a_total, atoms)),
                r=(rng.standard_normal(batch) * 3).astype(F32),
                done=(rng.random(batch) < 0.3).astype(F32),
                gamma=rng.uniform(0.9, 0.999, len(branches)).astype(F32),
                z=dist.support(-10.0, 10.0, atoms), v_min=-10.0, v_max=10.0,
                isw=rng.uniform(0.1, 1.0, batch).astype(F32), scale=F32(1 / 12),
                branches=branches, batch=batch)


def test_the_twin_gives_each_part_what_its_own_kernel_gives():
    """Against the three kernels run by hand on the same inputs (and the gradient rows of the
    actions not taken +0.0, the dueling sums of the taken rows)."""
    kw = _inputs(np.random.default_rng(3))
    got = rstep.c51_gather_project_dueling_branches(**kw)
    g = rstep.double_dqn_gather_branches(kw["logp_target"], kw["q_online"], kw["actions"],
                                         kw["branches"], kw["batch"])
    for name in ("a_star", "p_next", "q_taken"):
        assert getattr(got, name).tobytes() == getattr(g, name).tobytes(), name
    blocks = fused.split_branches(kw["logp"], kw["branches"])
    for d, n in enumerate(kw["branches"]):
        pg = dist.c51_project_grad(g.p_next[d], kw["r"], kw["done"], kw["gamma"][d], kw["z"],
                                   -10.0, 10.0, np.ascontiguousarray(blocks[d][:kw["batch"]]),
                                   kw["actions"][d], kw["isw"], kw["scale"])
        assert got.m[d].tobytes() == pg.m.tobytes()
        mine = fused.split_branches(got.dlogits, kw["branches"])[d]
        assert mine.tobytes() == pg.dlogits.tobytes()
        rows = np.arange(kw["batch"])
        others = np.ones((kw["batch"], n), bool)
        others[rows, kw["actions"][d]] = False
        assert np.all(mine[others] == 0)
    duel = fused.dueling_combine_backward_sum_branches(got.dlogits, kw["branches"])
    assert got.dv.tobytes() == duel.dv.tobytes() and got.dadv.tobytes() == duel.dadv.tobytes()


@pytest.mark.parametrize("change, match", [
    (lambda k: k.update(gamma=k["gamma"][:2]), r"^gamma: shape \(2,\); expected \[D\] = \[3\]$"),
    (lambda k: k.update(logp=k["logp"][:48]), r"^logp: shape \(48, 11\); expected \[q_rows \* "
                                              r"A_total, NA\] = \[96, 11\]"),
    (lambda k: k.update(isw=k["isw"][:5]), r"^isw: "),
    (lambda k: k.update(v_min=20.0), r"v_min"),
    (lambda k: k.update(actions=np.full_like(k["actions"], 3)), r"^actions: row 0 holds an action outside \[0, 3\)$"),
])
def test_the_twin_names_the_bad_argument(change, match):
    kw = _inputs(np.random.default_rng(4))
    change(kw)
    with pytest.raises(ValueError, match=match):
        rstep.c51_gather_project_dueling_branches(**kw)


@settings(max_examples=40, deadline=None)
@given(sample=st.integers(0, 5), value=st.sampled_from([np.nan, np.inf, -np.inf]),
       seed=st.integers(0, 2**16))
def test_a_special_reward_reaches_only_its_sample(sample, value, seed):
    """A NaN reward makes sample b's projection NaN in every branch, hence its taken gradient
    rows, every action's ``dadv`` and its ``dv``; an infinite one is clipped into the support
    (a finite sample). Every other sample is finite."""
    kw = _inputs(np.random.default_rng(seed))
    kw["r"][sample] = value
    got = rstep.c51_gather_project_dueling_branches(**kw)
    others = np.arange(kw["batch"]) != sample
    nan = np.isnan(value)
    assert np.isnan(got.m[:, sample]).all() == nan and np.isfinite(got.m[:, others]).all()
    assert np.isnan(got.dv[sample]).all() == nan and np.isfinite(got.dv[others]).all()
    for d, block in enumerate(fused.split_branches(got.dadv, kw["branches"])):
        assert np.isnan(block[sample]).all() == nan and np.isfinite(block[others]).all()
    assert np.isfinite(got.p_next).all() and np.isfinite(got.q_taken).all()
    if not nan:
        assert np.isfinite(got.m).all()
