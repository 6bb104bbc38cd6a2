"""Step conformance of the fast step's own plan on the CPU (SPEC 9, "The plan is data"): the
fast Trainer's records run by ``foxhunt.fast.cpu_executor.CpuTrainer`` (the same-name
reference twins, a reference GEMM per GEMM record) against the reference ``Trainer``, under
the step-conformance bounds and harnesses of the GPU tests (``step_harness``, ``step_compare``).

What this checks without a GPU: the plan's buffers, argument bindings, GEMM shapes, epilogues
and kernel launches, launch order and branch dependencies (branches run "latest ready
record first": an edge missing between parallel branches changes the result; and in capture
order), readback, state exchange and checkpoints. What it cannot check is the CUDA code of the
kernels and cuBLASLt (the kernel conformance tests and ``test_step``'s GPU cases do).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from foxhunt.conformance.step_compare import compare_step, run_step
from foxhunt.conformance.step_conditioning import condition_batch
from foxhunt.conformance.step_harness import (
    CPU_SEQUENCE_INTERVAL,
    INJECTIONS,
    PRECISIONS,
    PRESETS,
    STARTS,
    SOURCES,
    assert_all,
    case_of,
    fast_sources,
    check_checkpoint_interchange,
    check_injection,
    check_readback_sequence,
    one_step,
    set_trunk_grads,
    shared_case,
)
from foxhunt.fast.cpu_executor import BRANCH_ORDERS, CpuTrainer
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.trainer import Trainer

CASES = [pytest.param(p, q, s, id=f"{p}-{q}-{s}") for p in PRESETS for q in PRECISIONS for s in STARTS]


@pytest.mark.parametrize("case, precision, start", CASES)
def test_cpu_executor_step_matches_reference(case, precision, start) -> None:
    assert_all(one_step(CpuTrainer, shared_case(case, precision, start))[0])


def _wave_cases() -> list:
    """Each second-wave source the fast step implements, alone, at the tiny preset; every
    source at once (``all``, once it is implemented) at both presets."""
    sources = fast_sources()
    return [pytest.param(p, q, src, id=f"{p}-{q}-{src}") for src in sources for q in PRECISIONS
            for p in PRESETS if p == "tiny" or src == "all"]


@pytest.mark.parametrize("case, precision, source", _wave_cases())
def test_cpu_executor_second_wave_step_matches_reference(case, precision, source) -> None:
    assert_all(one_step(CpuTrainer, shared_case(case, precision, "warm", source))[0])


@pytest.mark.parametrize("source", fast_sources())
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", INJECTIONS)
def test_cpu_executor_second_wave_step_with_injected_non_finite_values(kind, precision,
                                                                       source) -> None:
    assert_all(check_injection(CpuTrainer, shared_case("tiny", precision, "warm", source), kind))


@pytest.mark.parametrize("source", fast_sources())
@pytest.mark.parametrize("precision", PRECISIONS)
def test_cpu_executor_second_wave_checkpoint_interchange(precision, source, tmp_path) -> None:
    case = shared_case("tiny", precision, "warm", source)
    assert_all(check_checkpoint_interchange(CpuTrainer, case, tmp_path))


@pytest.mark.parametrize("source", fast_sources())
@pytest.mark.parametrize("order", BRANCH_ORDERS)
def test_cpu_executor_second_wave_step_in_either_branch_order(order, source) -> None:
    factory = functools.partial(CpuTrainer, branch_order=order)
    assert_all(one_step(factory, shared_case("tiny", "bf16", "warm", source))[0])


@pytest.mark.parametrize("order", BRANCH_ORDERS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_cpu_executor_step_in_either_branch_order(precision, order) -> None:
    """Parallel branches run latest-ready-first or in capture order: the same step (a missing
    dependency between branches would make one order read stale data)."""
    factory = functools.partial(CpuTrainer, branch_order=order)
    assert_all(one_step(factory, shared_case("tiny", precision, "warm"))[0])


@pytest.mark.parametrize("source", ["core", "all"])
@pytest.mark.parametrize("case", PRESETS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_cpu_executor_stacked_backward_step_matches_reference(case, precision, source) -> None:
    """``stacked_backward=True``: each GEMM of the C51 and CQL backward one record of two batches
    (the per-loss kernels side by side), the same step."""
    factory = functools.partial(CpuTrainer, stacked_backward=True)
    assert_all(one_step(factory, shared_case(case, precision, "warm", source))[0])


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", INJECTIONS)
def test_cpu_executor_stacked_backward_step_with_injected_non_finite_values(kind, precision) -> None:
    factory = functools.partial(CpuTrainer, stacked_backward=True)
    assert_all(check_injection(factory, shared_case("tiny", precision, "warm", "all"), kind))


def _one_head_case(head: str):
    """``shared_case("tiny", "bf16", "warm", "aux")`` with one auxiliary head on (``nb``: next
    bar, ``rg``: regime): the fused launch's null second head."""
    off = {"nb": "aux_regime_weight", "rg": "aux_next_bar_weight"}[head]
    config = DQNConfig.preset("tiny", precision="bf16", **{**SOURCES["aux"], off: 0.0})
    return case_of("tiny", config, "warm")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("case, precision, source", [
    *(pytest.param("tiny", q, "all", id=f"tiny-{q}-all") for q in PRECISIONS),
    pytest.param("seed", "bf16", "all", id="seed-bf16-all"),
    pytest.param("tiny", "bf16", "nb", id="tiny-bf16-next-bar-head"),
    pytest.param("tiny", "bf16", "rg", id="tiny-bf16-regime-head")])
def test_cpu_executor_fused_trunk_grads_step_matches_reference(case, precision, source, fused,
                                                               monkeypatch) -> None:
    """Both switches on (the default): ``h2_grad_sum_aux_mask`` in place of the C51 trunk's six
    launches (no SAXPY left) and ``h2_guard_mask`` in place of each auxiliary trunk's guard and
    masks, the same step; and both off (the launches they fuse), the same step: every source in
    each precision (the launches read and write f32 buffers in every precision, so the seed
    preset in bf16 only), and each auxiliary head alone (the kernel's null second head)."""
    set_trunk_grads(monkeypatch, fused)
    case = _one_head_case(source) if source in ("nb", "rg") else shared_case(
        case, precision, "warm", source)
    trainer = CpuTrainer(case.config)
    try:
        kernels = [getattr(n, "kernel", None) for n in trainer._engine.plans["graph1"].nodes()]
    finally:
        trainer.close()
    c = case.config
    if fused:
        assert kernels.count("h2_grad_sum_aux_mask") == 1 and "saxpy" not in kernels
        assert kernels.count("h2_guard_mask") == int(c.iqn_on) + int(c.ens_on)
    else:
        assert "h2_grad_sum_aux_mask" not in kernels and "h2_guard_mask" not in kernels
        assert "saxpy" in kernels
    assert_all(one_step(CpuTrainer, case)[0])


@pytest.mark.parametrize("order", BRANCH_ORDERS)
@pytest.mark.parametrize("kind", INJECTIONS)
def test_cpu_executor_unfused_trunk_grads_step_with_injected_non_finite_values(
        kind, order, monkeypatch) -> None:
    """The launches the default fuses (both switches off), injected: the default's injections
    run in every other test of the step."""
    set_trunk_grads(monkeypatch, False)
    factory = functools.partial(CpuTrainer, branch_order=order)
    assert_all(check_injection(factory, shared_case("tiny", "bf16", "warm", "all"), kind))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_cpu_executor_three_steps_resynchronised_each_step(precision) -> None:
    """Three consecutive steps, both trainers loading the reference's state before each: every
    step within the bounds (the executor keeps no hidden state between steps)."""
    config = DQNConfig.preset("tiny", precision=precision)
    case = shared_case("tiny", precision, "warm")
    ref = Trainer(config)
    ref.load_state_dict(case.fresh_state())
    fast = CpuTrainer(config)
    rng = np.random.default_rng(3)
    for _ in range(3):
        before = ref.state_dict()
        for trainer in (ref, fast):  # both start the step with the same readback bookkeeping
            trainer.load_state_dict({k: v.copy() for k, v in before.items()})
        batch = condition_batch(config, before, Batch.random(config, rng), rng)
        assert_all(compare_step(config, before, run_step(ref, batch), run_step(fast, batch)))


@pytest.mark.parametrize("case", PRESETS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", INJECTIONS)
def test_cpu_executor_step_with_injected_non_finite_values(kind, precision, case) -> None:
    assert_all(check_injection(CpuTrainer, shared_case(case, precision, "warm"), kind))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("resync", [True, False], ids=["resync", "free"])
def test_cpu_executor_readback_sequence_matches_reference(resync, precision) -> None:
    check_readback_sequence(CpuTrainer, DQNConfig.preset("tiny", precision=precision,
                                                         readback_interval=CPU_SEQUENCE_INTERVAL),
                            resync)


@pytest.mark.parametrize("case", PRESETS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_cpu_executor_checkpoint_interchange(precision, case, tmp_path) -> None:
    assert_all(check_checkpoint_interchange(CpuTrainer, shared_case(case, precision, "warm"), tmp_path))
