"""The harnesses of step conformance: the shared cases (:func:`shared_case`: a ``fresh`` or
``warm`` reference state and a conditioned batch per preset x precision), one step of the
reference and a second trainer from it (:func:`one_step`), NaN/Inf injection, the deferred
readback sequence (SPEC 9) and checkpoint interchange. The second trainer is any class with the
backend interface: ``foxhunt.fast.Trainer`` on a GPU, a reference variant on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import pytest

from foxhunt.conformance.step_compare import (
    StepOutcome,
    bits,
    close,
    compare_step,
    copy_batch,
    failures,
    run_step,
)
from foxhunt.conformance.step_conditioning import condition_batch
from foxhunt.conformance.tolerance import Comparison
from foxhunt.reference.backend import StepScalars, TrainerBackend, get_backend
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import PRECISIONS, SECOND_WAVE_SOURCES, DQNConfig, source_overrides
from foxhunt.reference.layout import ParamLayout
from foxhunt.reference.trainer import Trainer

PRESETS = ("tiny", "seed")
STARTS = ("fresh", "warm")

#: Seed of the shared state and batches; reference steps taken before a ``warm`` state.
CASE_SEED = 11
WARMUP_STEPS = 3

#: The readback interval of the CPU's readback-sequence tests (the reference's, the CPU
#: executor's): SPEC 9's rule is the same at every interval, and 25 steps of the tiny preset
#: cost CI a tenth of the GPU's 250 (its preset's interval, 100).
CPU_SEQUENCE_INTERVAL = 10


def sequence_plan(config: DQNConfig) -> tuple[int, tuple[int, int]]:
    """The readback-sequence tests' steps (two and a half readback intervals) and the steps
    whose batch carries a NaN reward: the first read's (a fresh non-finite read, so the next
    step reads too) and half an interval later (seen at the next read): 250 and (100, 150)
    at the preset's interval of 100."""
    n = config.readback_interval
    return 5 * n // 2, (n, 3 * n // 2)


# ------------------------------------------------------------------------------ shared cases
@dataclass(frozen=True)
class Case:
    config: DQNConfig
    state: Mapping[str, np.ndarray]
    batch: Batch

    def fresh_state(self) -> dict[str, np.ndarray]:
        return {k: np.array(v, copy=True) for k, v in self.state.items()}


#: The step variants (SPEC 4; issue 18): ``core`` (every second-wave source off), each source
#: alone, ``all`` of them; the config overrides of each (``config.source_overrides``).
SOURCES: Mapping[str, Mapping[str, object]] = {
    name: source_overrides(name) for name in ("core", *SECOND_WAVE_SOURCES, "all")}
#: The epoch the ``mse`` cases' states are at (blend weight 1 - 1/4: both terms count).
MSE_EPOCH = 1


def fast_sources() -> tuple[str, ...]:
    """The second-wave source cases (every one: the fast step implements them all)."""
    return tuple(name for name in SOURCES if name != "core")


#: The plan switches of the second-wave trunk gradients in fewer launches (``fast.step_program``;
#: on by default since session 42): the tests of the launches they fuse turn both off.
TRUNK_GRAD_SWITCHES = ("FUSE_AUX_TRUNK_GRAD", "FUSE_GUARD_MASK")


def set_trunk_grads(monkeypatch, fused: bool) -> None:
    """Both :data:`TRUNK_GRAD_SWITCHES` set to ``fused`` for the trainers a test then builds."""
    from foxhunt.fast import step_program

    for switch in TRUNK_GRAD_SWITCHES:
        monkeypatch.setattr(step_program, switch, fused)


@functools.lru_cache(maxsize=None)
def shared_case(preset: str, precision: str, start: str, source: str = "core") -> Case:
    """The shared state (``fresh`` or ``warm``) and a conditioned batch for one comparison, with
    the second-wave ``source`` (``SOURCES``) on."""
    if source not in SOURCES:
        raise ValueError(f"source={source!r}: allowed values are {tuple(SOURCES)}")
    return case_of(preset, DQNConfig.preset(preset, precision=precision, **SOURCES[source]), start)


def case_of(preset: str, config: DQNConfig, start: str) -> Case:
    """``shared_case``'s state and batch for ``config``, preset ``preset``'s with any overrides
    (not cached): the reference trainer from ``CASE_SEED``, ``WARMUP_STEPS`` steps for
    ``warm``, a conditioned batch."""
    rng = np.random.default_rng([CASE_SEED, PRESETS.index(preset),
                                 PRECISIONS.index(config.precision)])
    trainer = Trainer(config, seed=CASE_SEED)
    if config.mse_on:
        trainer.set_epoch(MSE_EPOCH)
    if start == "warm":
        for _ in range(WARMUP_STEPS):
            trainer.step(Batch.random(config, rng))
    elif start != "fresh":
        raise ValueError(f"start={start!r}: allowed values are {STARTS}")
    state = trainer.state_dict()
    batch = condition_batch(config, state, Batch.random(config, rng), rng)
    return Case(config, state, batch)


def reference_from(case_config: DQNConfig, state: Mapping[str, np.ndarray]) -> Trainer:
    trainer = Trainer(case_config)
    trainer.load_state_dict({k: np.array(v, copy=True) for k, v in state.items()})
    return trainer


# ------------------------------------------------------------------------------ the fast trainer
def fast_trainer_class() -> type[TrainerBackend]:
    """``foxhunt.fast.Trainer`` through the backend registry (as ``loop.run`` finds it); a
    clear failure while it does not exist yet."""
    try:
        cls = get_backend("fast")
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"the fast trainer is not available: get_backend('fast') raised "
                    f"{type(exc).__name__}: {exc} (foxhunt.fast.Trainer in fast/trainer.py, "
                    "exported from foxhunt.fast, is what step conformance tests)")
    missing = [m for m in ("step", "end_epoch", "state_dict", "load_state_dict", "last_td_errors",
                           "fold_boundary", "save", "load") if not callable(getattr(cls, m, None))]
    if missing:
        pytest.fail(f"foxhunt.fast.Trainer lacks {missing} of the backend interface")
    return cls


#: A trainer class with the backend interface (``cls(config)``, ``cls.load(path)``).
Factory = type[TrainerBackend]


def fast_factory() -> Factory:
    return fast_trainer_class()


def _loaded(factory: Factory, config: DQNConfig, state: Mapping[str, np.ndarray]) -> TrainerBackend:
    trainer = factory(config)
    trainer.load_state_dict({k: np.array(v, copy=True) for k, v in state.items()})
    return trainer


def record_results(record_property, case: str, results: list[Comparison]) -> None:
    record_property("kernel", "trainer.step")
    record_property("case", case)
    for r in results:
        record_property("comparison", r.as_dict())


def assert_all(results: list[Comparison]) -> None:
    bad = failures(results)
    assert not bad, f"{len(bad)} of {len(results)} step comparisons failed:\n\n" + "\n\n".join(bad)


def state_round_trip_problems(trainer: TrainerBackend, state: Mapping[str, np.ndarray]) -> list[str]:
    """``load_state_dict(state)`` then ``state_dict()`` must give ``state`` back bit for bit."""
    got = trainer.state_dict()
    problems = []
    if set(got) != set(state):
        problems.append(f"keys differ: missing {sorted(set(state) - set(got))}, "
                        f"extra {sorted(set(got) - set(state))}")
    for k in sorted(set(got) & set(state)):
        a, b = np.asarray(got[k]), np.asarray(state[k])
        if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(bits(a), bits(b)):
            problems.append(f"{k}: not bit-identical after load_state_dict (dtype {a.dtype} vs "
                            f"{b.dtype}, shape {a.shape} vs {b.shape})")
    return problems


# ------------------------------------------------------------------------------ the checks
def one_step(factory: Factory, case: Case) -> tuple[list[Comparison], StepOutcome, StepOutcome]:
    """Both trainers from the shared state, one step: (comparisons, reference, other)."""
    ref = reference_from(case.config, case.state)
    other = _loaded(factory, case.config, case.state)
    try:
        problems = state_round_trip_problems(other, case.state)
        assert not problems, "state_dict round trip: " + "; ".join(problems)
        ref_out, other_out = run_step(ref, case.batch), run_step(other, case.batch)
    finally:
        close(other)
    return compare_step(case.config, case.state, ref_out, other_out), ref_out, other_out


INJECTIONS = ("nan_s", "nan_r", "inf_r", "nan_param")


def injected(case: Case, kind: str) -> tuple[dict[str, np.ndarray], Batch]:
    """The shared state and batch with one non-finite value planted (``INJECTIONS``)."""
    state, batch = case.fresh_state(), copy_batch(case.batch)
    row = batch.s.shape[0] // 3
    if kind == "nan_s":
        batch.s[row, batch.s.shape[1] // 2] = np.nan
    elif kind == "nan_r":
        batch.r[row] = np.nan
    elif kind == "inf_r":
        batch.r[row] = np.inf
    elif kind == "nan_param":
        w = ParamLayout(case.config)["w_s1"]
        state["params"][w.offset + w.size // 2 + 1] = np.nan
    else:
        raise ValueError(f"kind={kind!r}: allowed values are {INJECTIONS}")
    return state, batch


def check_injection(factory: Factory, case: Case, kind: str) -> list[Comparison]:
    state, batch = injected(case, kind)
    ref = reference_from(case.config, state)
    other = _loaded(factory, case.config, state)
    try:
        ref_out, other_out = run_step(ref, batch), run_step(other, batch)
    finally:
        close(other)
    return compare_step(case.config, state, ref_out, other_out)


def _poisoned(batch: Batch) -> Batch:
    r = batch.r.copy()
    r[1] = np.nan
    return dataclasses.replace(batch, r=r)


def _sequence_batches(config: DQNConfig) -> list[Batch]:
    steps, poisoned = sequence_plan(config)
    rng = np.random.default_rng([CASE_SEED, 250])
    batches = [Batch.random(config, rng) for _ in range(steps)]
    return [_poisoned(b) if k + 1 in poisoned else b for k, b in enumerate(batches)]


def _bookkeeping(s: StepScalars) -> tuple:
    finite = tuple(bool(np.isfinite(getattr(s, f))) for f in StepScalars.FINITE_FIELDS)
    return s.step, s.fresh, s.read_at, finite


def readback_sequences(factory: Factory, config: DQNConfig, resync: bool) -> tuple[list, list]:
    """The ``(step, fresh, read_at, finiteness)`` sequences of the reference and ``factory``'s
    trainer over ``sequence_plan(config)``'s steps (then ``end_epoch``) from the same initial
    state.

    ``resync``: before every step both trainers load the reference trainer's current state
    (``load_state_dict`` also resets the readback bookkeeping, identically in both by the
    backend contract); otherwise both run free on the same batches."""
    ref = Trainer(config, seed=CASE_SEED)
    other = _loaded(factory, config, ref.state_dict())
    seq_ref, seq_other = [], []
    try:
        with np.errstate(all="ignore"):
            for batch in _sequence_batches(config):
                if resync:
                    state = ref.state_dict()
                    ref.load_state_dict({k: np.array(v, copy=True) for k, v in state.items()})
                    other.load_state_dict({k: np.array(v, copy=True) for k, v in state.items()})
                seq_ref.append(_bookkeeping(ref.step(copy_batch(batch))))
                seq_other.append(_bookkeeping(other.step(copy_batch(batch))))
            seq_ref.append(_bookkeeping(ref.end_epoch()))
            seq_other.append(_bookkeeping(other.end_epoch()))
    finally:
        close(other)
    return seq_ref, seq_other


def expected_sequence(config: DQNConfig, resync: bool) -> list[tuple[int, bool, int]]:
    """SPEC 9's rule, independently: fresh at multiples of ``readback_interval`` and on the step
    after a fresh non-finite read (``resync`` resets that carry, and ``read_at`` to 0)."""
    out, last_read, force = [], 0, False
    interval = config.readback_interval
    steps, poisoned = sequence_plan(config)
    for k in range(1, steps + 1):
        if resync:
            last_read, force = 0, False
        fresh = k % interval == 0 or force
        if fresh:
            last_read = k
            force = k in poisoned
        out.append((k, fresh, last_read))
    out.append((steps, True, steps))
    return out


def check_readback_sequence(factory: Factory, config: DQNConfig, resync: bool) -> None:
    seq_ref, seq_other = readback_sequences(factory, config, resync)
    want = expected_sequence(config, resync)
    got_ref = [s[:3] for s in seq_ref]
    assert got_ref == want, ("reference readback sequence deviates from SPEC 9 at step "
                             f"{next(i + 1 for i, (a, b) in enumerate(zip(got_ref, want)) if a != b)}")
    diff = [i for i, (a, b) in enumerate(zip(seq_ref, seq_other)) if a != b]
    assert not diff and len(seq_ref) == len(seq_other), (
        f"readback sequences differ at {len(diff)} step(s); first at index {diff[0] if diff else '-'}: "
        f"reference {seq_ref[diff[0]] if diff else '-'} vs other {seq_other[diff[0]] if diff else '-'} "
        "(step, fresh, read_at, finiteness of the loss/norm fields)")


def check_checkpoint_interchange(factory: Factory, case: Case, tmp_path) -> list[Comparison]:
    """Reference checkpoint -> the other trainer (and back): bit-exact state after loading, and
    the next step matches under STEP_BOUNDS in both directions."""
    path = tmp_path / "reference.safetensors"
    reference_from(case.config, case.state).save(path)
    other = factory.load(path)
    try:
        return _interchange(factory, other, case, path, tmp_path)
    finally:
        close(other)


def _interchange(other_cls: Factory, other: TrainerBackend, case: Case, path, tmp_path) -> list[Comparison]:
    from foxhunt.reference.checkpoint import read_metadata

    problems = state_round_trip_problems(other, case.state)
    assert not problems, "reference checkpoint -> other trainer: " + "; ".join(problems)
    ref_loaded = Trainer.load(path)
    results = compare_step(case.config, case.state, run_step(ref_loaded, case.batch),
                           run_step(other, case.batch))

    back = tmp_path / "other.safetensors"
    other.save(back)
    assert read_metadata(back).get("backend") == other_cls.backend_name
    after = other.state_dict()
    ref_back = Trainer.load(back)
    problems = state_round_trip_problems(ref_back, after)
    assert not problems, "other trainer's checkpoint -> reference: " + "; ".join(problems)
    other_back = other_cls.load(back)  # its readback bookkeeping starts afresh, like ref_back's
    try:
        problems = state_round_trip_problems(other_back, after)
        assert not problems, "other trainer's checkpoint -> other trainer: " + "; ".join(problems)
        rng = np.random.default_rng([CASE_SEED, 7])
        batch = condition_batch(case.config, after, Batch.random(case.config, rng), rng)
        results += compare_step(case.config, after, run_step(ref_back, batch),
                                run_step(other_back, batch))
    finally:
        close(other_back)
    return results
