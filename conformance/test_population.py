"""Population conformance (SPEC 12, issue 24): one step of ``foxhunt.fast.Population`` from a
shared state against each member's single reference ``Trainer``, under the step-conformance
bounds (``step_compare``), and the isolation of a member's non-finite values.

The population has ``len(MEMBERS)`` members of the case's config: member 0 as the case, the
others with per-member scalars (``MEMBERS``: lr, tau, cql_alpha; with the IQN head on, each its
own seed, so its own quantile key). Every member starts from the shared state (its own seed in
it where the IQN head reads it) and steps on the case's conditioned batch; the reference for
member m is ``reference.Trainer`` of member m's config from that state. Each member's outcome
(state after the step, ``step()`` and ``end_epoch()`` scalars, TD errors, greedy Q of the
batch) must pass every bound a single fast trainer's must.

Isolation: a NaN planted in member 1's batch (``nan_s``, ``nan_r``) or parameters
(``nan_param``) must give member 1 the reference's outcome for that injection (flags included)
and leave members 0 and 2 bitwise as they are after the same population step without it.

Backends: ``gpu`` (``Population``: the member build, batched GEMMs, one graph; skipped with
the ``cuda_device`` fixture's reason without a device) and ``cpu`` (``CpuPopulation``, the same
records on the CPU executor; run in CI on the tiny preset).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from foxhunt.conformance.step_compare import StepOutcome, compare_step, copy_batch, run_step
from foxhunt.conformance.step_harness import (
    CASE_SEED,
    PRECISIONS,
    PRESETS,
    assert_all,
    injected,
    record_results,
    reference_from,
    shared_case,
)

#: Per-member overrides, as factors of the case config's value (member 0 is the case itself).
MEMBERS = ({}, {"lr": 0.5, "cql_alpha": 2.0}, {"tau": 2.0})
#: Step variants of the population cases (``step_harness.SOURCES``).
POP_SOURCES = ("core", "all")
#: Non-finite injections into member 1 (``step_harness.injected`` kinds).
POP_INJECTIONS = ("nan_s", "nan_r", "nan_param")
BACKENDS = ("cpu", "gpu")


def _backend(name: str, request):
    if name == "gpu":
        request.getfixturevalue("cuda_device")  # skips with its reason without a device
        from foxhunt.fast.population import Population

        return Population
    from foxhunt.fast.population import CpuPopulation

    return CpuPopulation


def member_setup(case) -> tuple[list[dict], list[int], list]:
    """The members' overrides, seeds and configs for ``case``."""
    overrides = [{name: factor * getattr(case.config, name) for name, factor in m.items()}
                 for m in MEMBERS]
    seeds = [CASE_SEED + (m if case.config.iqn_on else 0) for m in range(len(MEMBERS))]
    return overrides, seeds, [case.config.replace(**o) for o in overrides]


def member_state(state: dict, seed: int) -> dict:
    """``state`` for a member of seed ``seed`` (its IQN key, where the state carries one)."""
    state = {k: np.array(v, copy=True) for k, v in state.items()}
    if "seed" in state:
        state["seed"] = np.array([seed], np.int64)
    return state


def population_outcomes(pop, batches) -> list[StepOutcome]:
    """Each member's ``StepOutcome`` of one population step (``step_compare.run_step``'s reads,
    per member)."""
    with np.errstate(all="ignore"):
        scalars = pop.step([copy_batch(b) for b in batches])
        tds = [np.array(pop.member(m).last_td_errors(), copy=True) for m in range(len(pop))]
        ends = pop.end_epoch()
        qs = [[np.array(x, copy=True) for x in pop.member(m).q_values(b.s.copy())]
              for m, b in enumerate(batches)]
    return [StepOutcome({k: np.array(v, copy=True) for k, v in pop.state_dict(m).items()},
                        scalars[m], ends[m], tds[m], qs[m]) for m in range(len(pop))]


def run_population(cls, case, states, batches) -> list[StepOutcome]:
    overrides, seeds, _ = member_setup(case)
    pop = cls(case.config, seeds, overrides)
    try:
        for m, state in enumerate(states):
            pop.load_member_state(m, state)
        return population_outcomes(pop, batches)
    finally:
        pop.close()


def _cases(backend: str):
    presets = PRESETS if backend == "gpu" else ("tiny",)
    return [pytest.param(backend, p, q, s, id=f"{backend}-{p}-{q}-{s}")
            for p in presets for q in PRECISIONS for s in POP_SOURCES]


CASES = [c for b in BACKENDS for c in _cases(b)]


@pytest.mark.parametrize("backend, case, precision, source", CASES)
def test_population_step_is_each_members_step(backend, case, precision, source, request,
                                              record_property) -> None:
    cls = _backend(backend, request)
    shared = shared_case(case, precision, "warm", source)
    _, seeds, configs = member_setup(shared)
    states = [member_state(shared.state, s) for s in seeds]
    outcomes = run_population(cls, shared, states, [shared.batch] * len(MEMBERS))
    results = []
    for m, (config, state, fast) in enumerate(zip(configs, states, outcomes)):
        ref = run_step(reference_from(config, state), shared.batch)
        results += [dataclasses.replace(r, name=f"member {m}: {r.name}")
                    for r in compare_step(config, state, ref, fast)]
    record_results(record_property, f"population-{backend}-{case}-{precision}-{source}", results)
    assert_all(results)


INJECTION_CASES = [pytest.param(b, p, q, k, id=f"{b}-{p}-{q}-{k}")
                   for b in BACKENDS for p in (PRESETS if b == "gpu" else ("tiny",))
                   for q in PRECISIONS for k in POP_INJECTIONS]


@pytest.mark.parametrize("backend, case, precision, kind", INJECTION_CASES)
def test_non_finite_member_flags_only_itself(backend, case, precision, kind, request,
                                             record_property) -> None:
    cls = _backend(backend, request)
    shared = shared_case(case, precision, "warm", "all")
    _, seeds, configs = member_setup(shared)
    clean_states = [member_state(shared.state, s) for s in seeds]
    clean = run_population(cls, shared, clean_states, [shared.batch] * len(MEMBERS))
    bad_state, bad_batch = injected(shared, kind)
    states = list(clean_states)
    states[1] = member_state(bad_state, seeds[1])
    batches = [shared.batch, bad_batch, shared.batch]
    got = run_population(cls, shared, states, batches)
    ref = run_step(reference_from(configs[1], states[1]), bad_batch)
    results = compare_step(configs[1], states[1], ref, got[1])
    record_results(record_property, f"population-{backend}-{case}-{precision}-{kind}", results)
    assert_all(results)
    assert got[1].state["flags"].any(), "the injected member raised no flag"
    for m in (0, 2):
        for key, value in clean[m].state.items():
            assert np.array_equal(got[m].state[key].view(np.uint8),
                                  value.view(np.uint8)), f"member {m}: {key} changed"
        assert not got[m].state["flags"].any(), f"member {m} flagged: {got[m].state['flags']}"
        for field in ("loss", "grad_norm"):
            a, b = getattr(got[m].end, field), getattr(clean[m].end, field)
            assert np.float32(a).tobytes() == np.float32(b).tobytes(), (m, field)
