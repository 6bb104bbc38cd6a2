"""``foxhunt.fast.population`` on the CPU executor (``CpuPopulation``): each member is bitwise the
single fast trainer of its config and seed (``CpuTrainer``, an independent run of the same
records one member at a time), including per-member scalars (lr, tau, gamma, cql_alpha, the
IQN key of its seed); its errors; its members' state exchange and checkpoints. The GPU
population is checked against the reference by ``conformance/test_population.py``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from foxhunt.fast.cpu_executor import CpuTrainer
from foxhunt.fast.population import CpuPopulation
from foxhunt.fast.population_plan import PopulationPlan, _record_plan, align_members
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig, source_overrides
from foxhunt.reference.trainer import Trainer

SEEDS = [3, 5, 8]


def overrides_for(config: DQNConfig) -> list[dict]:
    return [{}, {"lr": 2 * config.lr, "gamma": 0.9}, {"tau": 0.5 * config.tau, "cql_alpha": 0.25}]


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_same_state(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    bad = [k for k in want if not same_bits(got[k], want[k])]
    assert not bad, f"{what}: {bad} differ"


def assert_same_scalars(got, want, what: str) -> None:
    for field in ("step", "fresh", "read_at", *type(want).FINITE_FIELDS):
        assert same_bits(np.float64(getattr(got, field)), np.float64(getattr(want, field))), (what, field)
    assert same_bits(got.flags, want.flags), what


@pytest.mark.parametrize("source", ["core", "all"])
def test_each_member_is_its_single_trainer_bit_for_bit(source):
    config = DQNConfig.preset("tiny", **source_overrides(source))
    overrides = overrides_for(config)
    pop = CpuPopulation(config, SEEDS, overrides)
    singles = [CpuTrainer(config.replace(**o), seed=s) for s, o in zip(SEEDS, overrides)]
    rng = np.random.default_rng(0)
    for step in range(3):
        batches = [Batch.random(config, rng) for _ in SEEDS]
        got = pop.step(batches)
        for m, (single, batch) in enumerate(zip(singles, batches)):
            assert_same_scalars(got[m], single.step(batch), f"step {step} member {m}")
    for m, single in enumerate(singles):
        assert_same_state(pop.state_dict(m), single.state_dict(), f"member {m}")
        assert same_bits(pop.member(m).last_td_errors(), single.last_td_errors())
        states = batches[m].s[:5]
        for a, b in zip(pop.member(m).q_values(states), single.q_values(states)):
            assert same_bits(a, b)
    for m, (got, single) in enumerate(zip(pop.end_epoch(), singles)):
        assert_same_scalars(got, single.end_epoch(), f"end_epoch member {m}")
    # The members really differ (each its own lr/tau/gamma/alpha, seed and batches).
    assert not same_bits(pop.state_dict(0)["params"], pop.state_dict(1)["params"])
    pop.set_epoch(2)
    pop.fold_boundary()
    for m, single in enumerate(singles):
        single.set_epoch(2)
        single.fold_boundary()
        assert_same_state(pop.state_dict(m), single.state_dict(), f"after the fold, member {m}")


def test_only_the_iqn_key_reads_the_seed():
    """``PopulationPlan`` plans one member per config where the IQN head is off (it assumes no
    launch argument but the IQN key depends on the seed): two seeds' plans are one plan."""
    config = DQNConfig.preset("tiny", **{**source_overrides("all"), "lambda_iqn": 0.0})
    assert not config.iqn_on and config.aux_regime_on
    assert align_members([_record_plan(config, 1, False), _record_plan(config, 2, False)]) == []
    with_iqn = DQNConfig.preset("tiny", **source_overrides("iqn"))
    found = align_members([_record_plan(with_iqn, 1, False), _record_plan(with_iqn, 2, False)])
    assert found and {f.kernel for f in found} == {"iqn_tau_cos"}


def test_scalar_blocks_cover_exactly_the_differing_launches():
    config = DQNConfig.preset("tiny")
    plan = PopulationPlan(config, [0, 1], [{}, {"lr": 2 * config.lr}])
    assert {b.kernel for b in plan.blocks} == {"adam_update_norm"}  # graph 2's main Adam
    same = PopulationPlan(config, [0, 1])
    assert same.blocks == () and same.stride % 256 == 0


def test_a_bad_batch_changes_no_member():
    config = DQNConfig.preset("tiny")
    pop = CpuPopulation(config, [0, 1, 2])
    before = [pop.state_dict(m) for m in range(3)]
    rng = np.random.default_rng(1)
    batches = [Batch.random(config, rng) for _ in range(3)]
    batches[2].isw[0] = -1.0
    with pytest.raises(ValueError, match=r"^member 2: .*isw"):
        pop.step(batches)
    with pytest.raises(ValueError, match=r"batches: 2 given; allowed: one per member \(3\)"):
        pop.step(batches[:2])
    for m in range(3):
        assert_same_state(pop.state_dict(m), before[m], f"member {m}")
    assert pop.steps == 0


def test_member_errors_are_one_line_and_name_the_member():
    config = DQNConfig.preset("tiny", **source_overrides("iqn"))
    pop = CpuPopulation(config, [0, 1])
    rng = np.random.default_rng(2)
    with pytest.raises(RuntimeError, match="member 1 of a population steps with the others"):
        pop.member(1).step(Batch.random(config, rng))
    for bad in (2, -1, True, "0"):
        with pytest.raises(ValueError, match=r"allowed members are 0 \.\. 1"):
            pop.member(bad)
    other_seed = Trainer(config, seed=7).state_dict()
    with pytest.raises(ValueError, match="seed 7 is not member 0's seed 0"):
        pop.load_member_state(0, other_seed)
    with pytest.raises(ValueError, match="member 1: batch_size"):
        CpuPopulation(config, [0, 1], [{}, {"batch_size": 64}])


def test_member_checkpoint_loads_into_single_trainers_of_both_backends(tmp_path):
    config = DQNConfig.preset("tiny")
    pop = CpuPopulation(config, [4, 9], [{}, {"lr": 3 * config.lr}])
    rng = np.random.default_rng(3)
    pop.step([Batch.random(config, rng) for _ in range(2)])
    path = tmp_path / "member1.npz"
    pop.member(1).save(path)
    want = pop.state_dict(1)
    for cls in (Trainer, CpuTrainer):
        loaded = cls.load(path)
        assert loaded.config.lr == 3 * config.lr
        assert_same_state(loaded.state_dict(), want, cls.__name__)
    # ... and a single trainer's state loads into a member.
    single = Trainer(config.replace(lr=3 * config.lr), seed=9)
    single.step(Batch.random(config, rng))
    pop.load_member_state(1, single.state_dict())
    assert_same_state(pop.state_dict(1), single.state_dict(), "loaded member")


def test_n_step_members_are_their_n_step_single_trainers():
    config = DQNConfig.preset("tiny")
    pop = CpuPopulation(config, [1, 2], n_step=3)
    singles = [CpuTrainer(config, seed=s, n_step=3) for s in (1, 2)]
    rng = np.random.default_rng(4)
    batches = []
    for _ in range(2):
        discount = rng.uniform(0.5, 0.99, config.batch_size).astype(np.float32)
        batches.append(dataclasses.replace(Batch.random(config, rng), discount=discount))
    one_step = Batch.random(config, rng)
    with pytest.raises(ValueError, match="^member 0: "):
        pop.step([one_step, batches[1]])  # a 1-step batch: no discount
    got = pop.step(batches)
    for m, single in enumerate(singles):
        assert_same_scalars(got[m], single.step(batches[m]), f"member {m}")
        assert_same_state(pop.state_dict(m), single.state_dict(), f"member {m}")
    assert pop.member(0).n_step_on


def test_a_population_that_fails_to_load_its_members_releases_its_engine(monkeypatch):
    from foxhunt.fast import population as population_mod
    from foxhunt.fast.population_engine import CpuPopulationEngine

    closed = []
    monkeypatch.setattr(CpuPopulationEngine, "close", lambda self: closed.append(self))

    def broken(config, seed=0):
        raise MemoryError("injected: no memory for the initial state")
    monkeypatch.setattr(population_mod, "ReferenceTrainer", broken)
    with pytest.raises(MemoryError, match="injected"):
        CpuPopulation(DQNConfig.preset("tiny"), [0, 1])
    assert len(closed) == 1
