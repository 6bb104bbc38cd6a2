"""The population's reference twin (issue 24): each member is bitwise its own single trainer.

Expectations come from single reference trainers built independently
(``config.replace(**overrides[i])``, ``seed=seeds[i]``), never from the population itself.
"""

import dataclasses

import numpy as np
import pytest

from foxhunt.reference import sentinels
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig, source_overrides
from foxhunt.reference.layout import ParamLayout
from foxhunt.reference.population import MEMBER_FIELDS, Population
from foxhunt.reference.trainer import Trainer

SEEDS = [5, 3, 3]

#: Per-member overrides for each base variant; the second-wave weights keep their on/off.
CASES = {
    "core": (source_overrides("core"),
             [{}, {"lr": 3e-4, "gamma": 0.95, "tau": 0.01},
              {"cql_alpha": 0.5, "gamma": (0.9, 0.8)}]),
    "iqn+aux": ({**source_overrides("iqn"), "aux_next_bar_weight": 0.1, "aux_regime_weight": 0.1},
                [{"lambda_iqn": 0.5}, {"aux_next_bar_weight": 0.3, "lr": 2e-4},
                 {"aux_regime_weight": 0.05, "tau": 0.02}]),
}


def base(case: str) -> DQNConfig:
    return DQNConfig.preset("tiny", readback_interval=1, **CASES[case][0])


def singles(config: DQNConfig, overrides) -> list[Trainer]:
    return [Trainer(config.replace(**o), seed=s) for s, o in zip(SEEDS, overrides)]


def batches(config: DQNConfig, seed: int) -> list[Batch]:
    rng = np.random.default_rng(seed)
    return [Batch.random(config, rng) for _ in SEEDS]


def assert_state_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), f"state[{k!r}] differs"


@pytest.mark.parametrize("case", sorted(CASES))
def test_population_step_is_each_members_single_step_bitwise(case):
    config, overrides = base(case), CASES[case][1]
    pop, ones = Population(config, seeds=SEEDS, overrides=overrides), singles(config, overrides)
    assert len(pop) == 3
    for i, t in enumerate(ones):
        assert_state_equal(pop.state_dict(i), t.state_dict())
    # The members really differ: seeds 5 and 3, and 3 again with other hyper-parameters.
    assert not np.array_equal(pop.state_dict(0)["params"], pop.state_dict(1)["params"])
    for k in range(3):
        bs = batches(config, k)
        got = pop.step(bs)
        want = [t.step(b) for t, b in zip(ones, bs)]
        assert got == want and all(s.fresh for s in got)
        for i, t in enumerate(ones):
            assert_state_equal(pop.state_dict(i), t.state_dict())
    # Same seed, other scalars (member 2 vs member 1): the step took them.
    assert not np.array_equal(pop.state_dict(1)["params"], pop.state_dict(2)["params"])
    pop.fold_boundary()
    for t in ones:
        t.fold_boundary()
    for i, t in enumerate(ones):
        assert_state_equal(pop.state_dict(i), t.state_dict())
        assert not pop.member(i).flags.any()


def test_nan_in_one_members_batch_flags_only_that_member():
    config, overrides = base("core"), CASES["core"][1]
    pop, ones = Population(config, seeds=SEEDS, overrides=overrides), singles(config, overrides)
    bs = batches(config, 0)
    s = bs[1].s.copy()
    s[4, 2] = np.nan
    bs[1] = Batch(s=s, a=bs[1].a, r=bs[1].r, s2=bs[1].s2, done=bs[1].done, isw=bs[1].isw)
    got = pop.step(bs)
    for i in (0, 2):
        ones[i].step(bs[i])
        assert_state_equal(pop.state_dict(i), ones[i].state_dict())
        assert not pop.member(i).flags.any() and not any(got[i].flags)
    # A NaN state reaches the states sentinel (SPEC 6, Mech 5) of member 1 only.
    assert "states" in sentinels.flagged_names(pop.member(1).flags)
    assert "states" in sentinels.flagged_names(np.array(got[1].flags, np.int32))


@pytest.mark.parametrize("over, words", [
    ({"batch_size": 64}, ["member 1", "batch_size=64", "lr"]),
    ({"state_dim": 8}, ["member 1", "state_dim=8"]),
    ({"shared_h1": 64}, ["member 1", "shared_h1=64"]),
    ({"num_atoms": 21}, ["member 1", "num_atoms=21"]),
    ({"branches": (3, 3)}, ["member 1", "branches=(3, 3)"]),
    ({"precision": "f32"}, ["member 1", "precision='f32'"]),
    ({"bogus": 1}, ["member 1", "bogus=1"]),
    ({"lambda_iqn": 1.0}, ["member 1", "lambda_iqn=1.0", "on", "of 0"]),
    ({"lr": -1.0}, ["member 1", "lr=-1.0", "> 0"]),
])
def test_override_errors_name_member_field_value_and_allowed(over, words):
    with pytest.raises(ValueError) as err:
        Population(base("core"), seeds=[0, 1], overrides=[{}, over])
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_switching_a_source_off_is_refused():
    with pytest.raises(ValueError, match=r"member 0: aux_regime_weight=0 turns its source off"):
        Population(base("iqn+aux"), seeds=[0], overrides=[{"aux_regime_weight": 0}])


@pytest.mark.parametrize("seeds, overrides, match", [
    ([], None, r"seeds=\[\]: a population needs at least one member"),
    ([0, 1], [{}], r"overrides: 1 given for 2 seeds"),
    ([0], [{}, {}], r"overrides: 2 given for 1 seeds"),
    ([0, -1], None, r"member 1: seed=-1"),
    ([0, 1.5], None, r"member 1: seed=1.5"),
])
def test_population_shape_errors(seeds, overrides, match):
    with pytest.raises(ValueError, match=match):
        Population(base("core"), seeds=seeds, overrides=overrides)


def test_step_wrong_count_or_bad_batch_changes_no_member():
    config = base("core")
    pop = Population(config, seeds=SEEDS)
    before = [pop.state_dict(i) for i in range(3)]
    bs = batches(config, 0)
    with pytest.raises(ValueError, match=r"batches: 2 given; allowed: one per member \(3\)"):
        pop.step(bs[:2])
    bad = Batch(s=bs[2].s, a=bs[2].a, r=bs[2].r, s2=bs[2].s2, done=bs[2].done,
                isw=np.zeros_like(bs[2].isw))
    with pytest.raises(ValueError, match=r"^member 2: .*isw"):
        pop.step([bs[0], bs[1], bad])
    for i in range(3):
        assert_state_equal(pop.state_dict(i), before[i])
    with pytest.raises(ValueError, match=r"member=3: allowed members are 0 \.\. 2"):
        pop.member(3)


def test_member_fields_keep_the_architecture():
    config = base("iqn+aux")
    values = {"lr": 5e-4, "gamma": 0.9, "cql_alpha": 2.0, "tau": 0.1, "lambda_iqn": 0.25,
              "ens_weight": 0.0, "aux_next_bar_weight": 0.5, "aux_regime_weight": 0.5}
    assert set(values) == set(MEMBER_FIELDS)
    for name, value in values.items():
        other = config.replace(**{name: value})
        assert getattr(other, name) != getattr(config, name) or name == "ens_weight"
        assert ParamLayout(other).canonical() == ParamLayout(config).canonical(), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_member_checkpoint_loads_into_a_single_trainer(case, tmp_path):
    config, overrides = base(case), CASES[case][1]
    pop = Population(config, seeds=SEEDS, overrides=overrides)
    pop.step(batches(config, 0))
    path = tmp_path / "member1.safetensors"
    pop.member(1).save(path)
    single = Trainer.load(path)
    assert single.config == config.replace(**overrides[1])
    nxt = batches(config, 1)
    got = pop.step(nxt)[1]
    assert single.step(nxt[1]) == got
    assert_state_equal(single.state_dict(), pop.state_dict(1))
    # And a member's state loads into another member (same architecture, other scalars).
    pop.load_member_state(0, pop.state_dict(2))
    assert_state_equal(pop.state_dict(0), pop.state_dict(2))


def test_epoch_calls_reach_every_member_as_on_singles():
    """``set_epoch`` and ``end_epoch`` on the population are each member's, in order: the same
    scalars and states as the singles given the same calls (readback every 2 steps, so the
    epoch end's scalars are not all the last readback's)."""
    config = base("core").replace(readback_interval=2)
    overrides = CASES["core"][1]
    pop, ones = Population(config, seeds=SEEDS, overrides=overrides), singles(config, overrides)
    for epoch in (0, 1):
        pop.set_epoch(epoch)
        for t in ones:
            t.set_epoch(epoch)
        for k in range(3):
            bs = batches(config, 10 * epoch + k)
            pop.step(bs)
            for t, b in zip(ones, bs):
                t.step(b)
        got, want = pop.end_epoch(), [t.end_epoch() for t in ones]
        assert [dataclasses.astuple(g) for g in got] == [dataclasses.astuple(w) for w in want]
        for i, t in enumerate(ones):
            assert_state_equal(pop.state_dict(i), t.state_dict())
