"""Step conformance (SPEC 8; issue 6 part 5): one ``step()`` of ``foxhunt.fast.Trainer`` against
the reference ``Trainer`` from one shared state, in each precision mode, presets ``tiny`` and
``seed``.

The bounds and their reasons are :mod:`foxhunt.conformance.step_bounds` (applied by
:mod:`.step_compare`); the batch is conditioned away from discontinuities by
:mod:`.step_conditioning`; the shared cases and the injection, readback and checkpoint
harnesses are :mod:`.step_harness`; the CPU stand-ins for a second implementation are
:mod:`.step_variants`.

CPU self-checks (run everywhere): the reference steps bitwise-identically from one
``state_dict`` (the precondition of the comparison); ``state_dict`` and checkpoints round-trip
bit for bit; the bounds accept a legitimate re-implementation (every GEMM, bias-gradient, norm
and spectral mat-vec accumulated in float64, TF32 operands truncated as tensor cores may) and
reject deliberately wrong steps (a dropped CQL gradient, a sign error, TF32 in ``f32`` mode,
wrong lr or tau, a skipped spectral norm or ISV producer, a tail bug); the GPU tests' harnesses
(NaN injection, readback sequence, checkpoint interchange) run with a reference stand-in for
the fast trainer.

GPU (skipped with the ``cuda_device`` fixture's reason without one; a missing fast trainer is
a failure naming what is missing): one step per preset x precision x start; NaN/Inf injection
(NaN in ``s``, NaN / +Inf in ``r``, a NaN parameter: identical flags and NaN maps); the
``(step, fresh, read_at)`` readback sequence over 250 steps, re-synchronised from the reference
state every step, and free-running with non-finite readbacks; checkpoint interchange both ways;
each second-wave source the fast step implements, alone and all at once (``step_harness.
SOURCES``), one step and the injections per preset x precision from the warm state; the bf16
step with the fused trunk and / or heads forward (``fused_trunk=True``, ``fused_heads=True``),
one step per preset x start and the injections on the seed preset; the step with the C51 and CQL backward stacked
(``stacked_backward=True``), one step per preset x precision with the core and with every
second-wave source, and the injections per precision on the seed preset with every source; the
step with the sources' trunk gradients in the launches the default fuses into
``h2_grad_sum_aux_mask`` and ``h2_guard_mask`` (``step_program.FUSE_AUX_TRUNK_GRAD``,
``FUSE_GUARD_MASK`` off), one step per preset x precision with the auxiliary heads and with
every source, and the injections on the seed preset with every source.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from foxhunt.conformance.step_bounds import F32, STEP_BOUNDS, bound_row
from foxhunt.conformance.step_compare import bits, compare_step, failures, run_step
from foxhunt.conformance.step_conditioning import (
    deviation_forward,
    h2_clamp_bound,
    near_argmax_tie,
    near_relu_switch,
    rounding_flips,
)
from foxhunt.conformance.step_harness import (
    CPU_SEQUENCE_INTERVAL,
    INJECTIONS,
    PRECISIONS,
    PRESETS,
    SOURCES,
    STARTS,
    assert_all,
    check_checkpoint_interchange,
    check_injection,
    check_readback_sequence,
    fast_factory,
    fast_sources,
    injected,
    one_step,
    record_results,
    reference_from,
    set_trunk_grads,
    shared_case,
    state_round_trip_problems,
)
from foxhunt.conformance.step_variants import BUGS, bug_variant, legitimate_variant, variant_factory
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.layout import ParamLayout
from foxhunt.reference.trainer import Trainer


# ------------------------------------------------------------------------------ CPU self-checks
# The preset is the parameter ``case`` so that ``--conformance-mode quick`` leaves out "seed".
CASES = [pytest.param(p, q, s, id=f"{p}-{q}-{s}") for p in PRESETS for q in PRECISIONS for s in STARTS]


def test_every_state_buffer_has_a_bound() -> None:
    keys = Trainer(DQNConfig.preset("tiny", **SOURCES["all"])).state_dict()
    missing = []
    for key in keys:
        try:
            bound_row(key)
        except KeyError as exc:
            missing.append(str(exc))
    assert not missing, "\n".join(missing)
    assert all(row.criterion and row.reason for row in STEP_BOUNDS.values())
    with pytest.raises(KeyError, match="no row in STEP_BOUNDS"):
        bound_row("new_buffer")


@pytest.mark.parametrize("case, precision, start", CASES)
def test_reference_steps_bitwise_identically_from_a_state_dict(case, precision, start) -> None:
    shared = shared_case(case, precision, start)
    one = run_step(reference_from(shared.config, shared.state), shared.batch)
    two = run_step(reference_from(shared.config, shared.state), shared.batch)
    assert one.state.keys() == two.state.keys()
    differ = [k for k in one.state if not np.array_equal(bits(one.state[k]), bits(two.state[k]))]
    assert not differ, f"the reference is not deterministic from one state_dict: {differ}"
    assert np.array_equal(bits(one.td), bits(two.td))
    assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(one.q, two.q))
    assert dataclasses.astuple(one.end) == dataclasses.astuple(two.end)
    assert not failures(compare_step(shared.config, shared.state, one, two))


@pytest.mark.parametrize("case, precision, start", CASES)
def test_state_dict_round_trips_bit_for_bit(case, precision, start) -> None:
    shared = shared_case(case, precision, start)
    assert not state_round_trip_problems(reference_from(shared.config, shared.state), shared.state)


@pytest.mark.parametrize("case, precision, start", CASES)
def test_conditioned_batch_keeps_every_discontinuity_at_a_distance(case, precision, start) -> None:
    shared = shared_case(case, precision, start)
    config, params = shared.config, shared.state["params"]
    h2_bound = h2_clamp_bound(config, shared.state["isv"])
    assert not near_relu_switch(config, params, shared.batch.s, h2_bound).any()
    assert not near_argmax_tie(config, params, shared.batch.s2, h2_bound).any()
    # The margins are not vacuous: a bias that puts unit 0 of layer 1 on its switch is caught.
    probe = shared.batch.s[:1]
    t1 = deviation_forward(config, params, probe, h2_bound).pre_activations[0][1]
    moved = params.copy()
    bias = ParamLayout(config).view(moved, "b_s1")
    bias[0] = F32(bias[0] - t1[0, 0])
    assert near_relu_switch(config, moved, probe, h2_bound)[0]
    assert not near_relu_switch(config, params, probe, h2_bound)[0]


@pytest.mark.parametrize("mode, ulp", [("bf16", 2.0**-7), ("tf32", 2.0**-10)])
def test_flip_probability_grows_near_a_rounding_midpoint(mode, ulp) -> None:
    x = np.array([1.0 + ulp / 2, 1.0, 1.0 + ulp / 2 + 2.0**-20], F32)  # midpoint, grid, near
    prob, jump = rounding_flips(x, np.full(3, 2.0**-20), mode)
    assert prob[0] == 1.0 and prob[1] < 1e-300 and 0.5 < prob[2] < 0.7
    assert np.all(jump == ulp)  # one ulp of the format at 1.0
    assert rounding_flips(x[:1], np.zeros(1), mode)[0][0] == 1.0  # on a midpoint: always at risk


@pytest.mark.parametrize("case, precision, start", CASES)
def test_bounds_accept_a_legitimate_reimplementation(case, precision, start, record_property) -> None:
    results, ref, other = one_step(variant_factory(legitimate_variant),
                                   shared_case(case, precision, start))
    record_results(record_property, f"{case}-{precision}-{start} (float64/TF32 variant)", results)
    assert_all(results)
    # The variant must really differ from the reference, or this test proves nothing.
    assert not np.array_equal(ref.state["adam_m"], other.state["adam_m"]), \
        "the legitimate variant no longer changes the step (reference internals renamed?)"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("source", [s for s in SOURCES if s != "core"])
def test_bounds_accept_a_legitimate_reimplementation_of_the_second_wave(source, precision,
                                                                      record_property) -> None:
    """The float64 / TF32 variant (``legitimate_variant``) with each second-wave source on (the
    sources' GEMMs, bias gradients and norms re-rounded too) stays within the bounds."""
    results, ref, other = one_step(variant_factory(legitimate_variant),
                                   shared_case("tiny", precision, "warm", source))
    record_results(record_property, f"tiny-{precision}-{source} (variant)", results)
    assert_all(results)
    assert not np.array_equal(ref.state["adam_m"], other.state["adam_m"])


@pytest.mark.parametrize(("bug", "precision"),
                         [(bug, p) for bug, modes in BUGS.items() for p in modes])
def test_bounds_reject_a_wrong_step(bug, precision) -> None:
    """Each deliberate bug is rejected in every precision mode BUGS lists for it (a bug that is
    within a mode's bounds by design, e.g. BF16 gradient storage in bf16 mode, is not listed)."""
    results, _, _ = one_step(variant_factory(lambda c: bug_variant(bug, c)), shared_case("tiny", precision, "warm"))
    assert failures(results), f"{bug}: every comparison passed; the bounds cannot see this bug"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", INJECTIONS)
def test_injection_harness_on_the_reference(kind, precision) -> None:
    shared = shared_case("tiny", precision, "warm")
    assert_all(check_injection(variant_factory(legitimate_variant), shared, kind))
    state, batch = injected(shared, kind)
    out = run_step(reference_from(shared.config, state), batch)
    if kind != "inf_r":  # +Inf rewards are clipped onto the support: no flag needs to fire
        assert out.state["flags"].any(), f"{kind}: the reference raised no sentinel flag"


@pytest.mark.parametrize("resync", [True, False], ids=["resync", "free"])
def test_readback_sequence_harness_on_the_reference(resync) -> None:
    check_readback_sequence(Trainer, DQNConfig.preset("tiny", readback_interval=CPU_SEQUENCE_INTERVAL),
                            resync)


def test_checkpoint_interchange_harness_on_the_reference(tmp_path) -> None:
    assert_all(check_checkpoint_interchange(Trainer, shared_case("tiny", "bf16", "warm"), tmp_path))


# ------------------------------------------------------------------------------ GPU: fast vs reference
@pytest.mark.gpu
@pytest.mark.parametrize("case, precision, start", CASES)
def test_fast_step_matches_reference(case, precision, start, cuda_device, record_property) -> None:
    results, _, _ = one_step(fast_factory(), shared_case(case, precision, start))
    record_results(record_property, f"{case}-{precision}-{start}", results)
    assert_all(results)


#: Each second-wave source alone and all at once (``SOURCES``; those the fast step implements),
#: per preset x precision, from the warm state.
WAVE_CASES = [pytest.param(p, q, src, id=f"{p}-{q}-{src}")
              for src in fast_sources() for p in PRESETS for q in PRECISIONS]


@pytest.mark.gpu
@pytest.mark.parametrize("case, precision, source", WAVE_CASES)
def test_fast_second_wave_step_matches_reference(case, precision, source, cuda_device,
                                                 record_property) -> None:
    results, _, _ = one_step(fast_factory(), shared_case(case, precision, "warm", source))
    record_results(record_property, f"{case}-{precision}-{source}", results)
    assert_all(results)


@pytest.mark.gpu
@pytest.mark.parametrize("case, precision, source", WAVE_CASES)
@pytest.mark.parametrize("kind", INJECTIONS)
def test_fast_second_wave_step_with_injected_non_finite_values(kind, case, precision, source,
                                                               cuda_device,
                                                               record_property) -> None:
    results = check_injection(fast_factory(), shared_case(case, precision, "warm", source), kind)
    record_results(record_property, f"{case}-{precision}-{source}-{kind}", results)
    assert_all(results)


@pytest.mark.gpu
@pytest.mark.parametrize("case, precision, source", WAVE_CASES)
def test_fast_second_wave_checkpoint_interchange(case, precision, source, cuda_device, tmp_path,
                                                 record_property) -> None:
    results = check_checkpoint_interchange(fast_factory(), shared_case(case, precision, "warm", source),
                                           tmp_path)
    record_results(record_property, f"{case}-{precision}-{source}-checkpoint", results)
    assert_all(results)


@pytest.mark.gpu
@pytest.mark.parametrize("case", PRESETS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", INJECTIONS)
def test_fast_step_with_injected_non_finite_values(kind, precision, case, cuda_device,
                                                   record_property) -> None:
    results = check_injection(fast_factory(), shared_case(case, precision, "warm"), kind)
    record_results(record_property, f"{case}-{precision}-{kind}", results)
    assert_all(results)


#: The fast trainer with parts of its forward fused (bf16 only): the trunk
#: (``Trainer(..., fused_trunk=True)``), the heads (``fused_heads=True``), both.
FUSED_OPTIONS = {"fused-trunk": dict(fused_trunk=True), "fused-heads": dict(fused_heads=True),
                 "fused-trunk-heads": dict(fused_trunk=True, fused_heads=True)}
FUSED_CASES = [pytest.param(p, s, f, id=f"{p}-bf16-{s}-{f}") for p in PRESETS for s in STARTS
               for f in FUSED_OPTIONS]


def _fused_factory(fused: str):
    import functools

    return functools.partial(fast_factory(), **FUSED_OPTIONS[fused])


@pytest.mark.gpu
@pytest.mark.parametrize("case, start, fused", FUSED_CASES)
def test_fast_step_with_a_fused_forward_matches_reference(case, start, fused, cuda_device,
                                                          record_property) -> None:
    results, _, _ = one_step(_fused_factory(fused), shared_case(case, "bf16", start))
    record_results(record_property, f"{case}-bf16-{start}-{fused}", results)
    assert_all(results)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", FUSED_OPTIONS)
@pytest.mark.parametrize("kind", INJECTIONS)
def test_fast_step_with_a_fused_forward_and_injected_non_finite_values(kind, fused, cuda_device,
                                                                       record_property) -> None:
    results = check_injection(_fused_factory(fused), shared_case("seed", "bf16", "warm"), kind)
    record_results(record_property, f"seed-bf16-{kind}-{fused}", results)
    assert_all(results)


@pytest.mark.gpu
@pytest.mark.parametrize("case, precision, source", [
    pytest.param(p, q, s, id=f"{p}-{q}-{s}") for p in PRESETS for q in PRECISIONS
    for s in ("aux", "all")])
def test_fast_step_with_the_trunk_grads_unfused_matches_reference(
        case, precision, source, cuda_device, record_property, monkeypatch) -> None:
    """The launches ``h2_grad_sum_aux_mask`` and ``h2_guard_mask`` fuse (``FUSE_AUX_TRUNK_GRAD``,
    ``FUSE_GUARD_MASK`` off; on by default, which every other step test runs), the same step; and
    with every source, the injections."""
    set_trunk_grads(monkeypatch, False)
    results, _, _ = one_step(fast_factory(), shared_case(case, precision, "warm", source))
    if case == "seed" and source == "all":
        for kind in INJECTIONS:
            results += check_injection(fast_factory(), shared_case(case, precision, "warm", source),
                                       kind)
    record_results(record_property, f"{case}-{precision}-{source}-trunk-grads-unfused", results)
    assert_all(results)


#: The fast trainer with its C51 and CQL backward stacked (``Trainer(..., stacked_backward=True)``).
STACKED_CASES = [pytest.param(p, q, src, id=f"{p}-{q}-{src}") for p in PRESETS for q in PRECISIONS
                 for src in ("core", "all")]


def _stacked_factory():
    import functools

    return functools.partial(fast_factory(), stacked_backward=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case, precision, source", STACKED_CASES)
def test_fast_step_with_the_stacked_backward_matches_reference(case, precision, source, cuda_device,
                                                               record_property) -> None:
    results, _, _ = one_step(_stacked_factory(), shared_case(case, precision, "warm", source))
    record_results(record_property, f"{case}-{precision}-{source}-stacked", results)
    assert_all(results)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", INJECTIONS)
def test_fast_step_with_the_stacked_backward_and_injected_non_finite_values(
        kind, precision, cuda_device, record_property) -> None:
    results = check_injection(_stacked_factory(), shared_case("seed", precision, "warm", "all"),
                              kind)
    record_results(record_property, f"seed-{precision}-all-{kind}-stacked", results)
    assert_all(results)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("resync", [True, False], ids=["resync", "free"])
def test_fast_readback_sequence_matches_reference(resync, precision, cuda_device, record_property) -> None:
    record_property("kernel", "trainer.step")
    record_property("case", f"tiny-{precision}-{'resync' if resync else 'free'}")
    check_readback_sequence(fast_factory(), DQNConfig.preset("tiny", precision=precision), resync)


@pytest.mark.gpu
@pytest.mark.parametrize("case", PRESETS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_fast_checkpoint_interchange(precision, case, cuda_device, tmp_path, record_property) -> None:
    results = check_checkpoint_interchange(fast_factory(), shared_case(case, precision, "warm"), tmp_path)
    record_results(record_property, f"{case}-{precision}-checkpoint", results)
    assert_all(results)
