"""One training step (SPEC 4): fast vs reference vs the PyTorch peers, one group per workload.

Groups (per step times; see ``benches/conftest.py`` for how asynchronous steps are timed):

- ``step-tiny-f32`` (CPU, runs in CI): the reference and PyTorch eager on the CPU;
- ``step-seed-f32``, ``step-seed-bf16``, ``step-seed-tf32`` (B=256, the production size): the
  reference on the CPU (bf16 = the bit-exact BF16 emulation; f32 and bf16 only), PyTorch eager on
  the CPU (f32), and on the GPU the fast trainer and the four PyTorch modes (eager, compile,
  graph, compile-graph; bf16 = autocast, tf32 = f32 with TF32 matmuls);
  ``step-seed-bf16`` also the fast trainer with its trunk forward fused (``fused_trunk=True``),
  its heads' forward fused (``fused_heads=True``) and both;
  both groups, and ``step-seed-{f32,bf16}-wave``, the fast trainer with its C51 and CQL backward
  stacked (``stacked_backward=True``).

Second wave (SPEC 4; issue 18), the ``seed`` step with its sources on (``WAVE_CASES``):

- ``step-seed-{f32,bf16}-wave``: every source on: IQN (1.0) and the auxiliary heads (0.1
  each) as SPEC 4's seed preset, the ensemble on (weight 1.0, the default K = ``ens_heads``),
  the MSE warm-up as the seed preset gives it (``c51_warmup_epochs``); the fast trainer and
  the four PyTorch modes on the GPU;
- ``step-seed-{f32,bf16}-wave-<source>``: each source alone (``iqn``, ``aux``, ``ens``, ``mse``:
  the warm-up over 4 epochs, at epoch 0, so the blend weight is 1), so a source's cost is its
  group's time minus the core group's; the fast trainer and the PyTorch ``eager`` and ``graph``
  modes (every mode with ``FOXHUNT_BENCH_FULL=1``: each compile mode compiles each case, about
  a minute apiece);
- ``step-tiny-f32-wave`` (CPU, runs in CI): the reference and PyTorch eager with every source
  on, at the tiny size.

A fast case whose source the fast trainer does not implement yet skips with its refusal.

Adaptive mechanisms (SPEC 7; issue 19), the core ``seed`` step with ISV producers and consumers
on (``ADAPTIVE_CASES``), fast trainer only (the PyTorch peers have none of them):

- ``step-seed-{f32,bf16}-adaptive``: every switch of ``isv_step.ADAPTIVE_SWITCHES`` and the
  adaptive atoms on;
- ``step-seed-{f32,bf16}-adaptive-<switch>``: each switch alone (``adaptive_atoms`` with
  ``q_stats``, its producer), so a mechanism's cost is its group's time minus the core group's;
- ``step-seed-{f32,bf16}-adaptive-wave``: every switch and every second-wave source of
  ``step-seed-*-wave`` on (the whole seeds' step), against that group.
"""

from __future__ import annotations

import pytest

from peers.torch_step import COMPILED_MODES, MODES
from peers.torch_wave import WAVE_SOURCES

from foxhunt.reference.config import ADAPTIVE_ON, ADAPTIVE_SWITCHES, PRECISIONS

#: Every second-wave source but the MSE warm-up, which stays as the seed preset gives it.
WAVE_ALL = {k: v for name, fields in WAVE_SOURCES.items() if name != "mse" for k, v in fields.items()}
#: Group suffix -> config overrides of the second-wave step cases.
WAVE_CASES = {"wave": WAVE_ALL, **{f"wave-{name}": fields for name, fields in WAVE_SOURCES.items()}}

#: Group suffix -> config overrides of the adaptive-mechanism cases (the adaptive atoms need
#: their producer, ``q_stats``).
ADAPTIVE_CASES = {"adaptive": ADAPTIVE_ON,
                  **{f"adaptive-{name}": {name: True} for name in ADAPTIVE_SWITCHES},
                  "adaptive-adaptive_atoms": {"q_stats": True, "adaptive_atoms": True},
                  "adaptive-wave": {**WAVE_ALL, **ADAPTIVE_ON}}

#: (preset, precision) of the reference step benchmarks: the tiny one is CI's quick check.
REFERENCE_CASES = (("tiny", "f32"), ("seed", "f32"), ("seed", "bf16"))


@pytest.mark.parametrize("preset,precision", REFERENCE_CASES)
def test_step_reference(benchmark, harness, preset, precision):
    config = harness.config(preset, precision)
    harness.steps(benchmark, harness.reference(config), group=f"step-{preset}-{precision}")


@pytest.mark.parametrize("preset", ("tiny", "seed"))
def test_step_torch_cpu(benchmark, harness, preset):
    """PyTorch eager on the CPU, the reference's natural peer (SPEC 11: 37 ms on 2 cores)."""
    config = harness.config(preset, "f32")
    harness.steps(benchmark, harness.peer(config, "eager", "cpu"), group=f"step-{preset}-f32")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_step_fast(benchmark, harness, fast_trainer_cls, precision):
    config = harness.config("seed", precision)
    harness.steps(benchmark, harness.fast(fast_trainer_cls, config), group=f"step-seed-{precision}")


@pytest.mark.gpu
def test_step_fast_fused_trunk(benchmark, harness, fast_trainer_cls):
    """The bf16 step with its trunk forward fused (``Trainer(..., fused_trunk=True)``), in
    group ``step-seed-bf16`` beside the default step."""
    config = harness.config("seed", "bf16")
    runner = harness.fast(fast_trainer_cls, config, "fast-fused-trunk", fused_trunk=True)
    harness.steps(benchmark, runner, group="step-seed-bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("fused", ("heads", "trunk-heads"))
def test_step_fast_fused_heads(benchmark, harness, fast_trainer_cls, fused):
    """The bf16 step with its heads' forward fused (``Trainer(..., fused_heads=True)``), alone
    and with the fused trunk, in group ``step-seed-bf16`` beside the default step."""
    config = harness.config("seed", "bf16")
    options = dict(fused_heads=True, fused_trunk=fused == "trunk-heads")
    runner = harness.fast(fast_trainer_cls, config, f"fast-fused-{fused}", **options)
    harness.steps(benchmark, runner, group="step-seed-bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ("core", "wave"))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_step_fast_stacked_backward(benchmark, harness, fast_trainer_cls, precision, case):
    """The step with its C51 and CQL backward stacked (``Trainer(..., stacked_backward=True)``),
    beside the default step of its group (the core step's, or every second-wave source's)."""
    fields = {} if case == "core" else WAVE_CASES[case]
    config = harness.config("seed", precision, **fields)
    runner = harness.fast(fast_trainer_cls, config, "fast-stacked-backward", stacked_backward=True)
    group = f"step-seed-{precision}" + ("" if case == "core" else f"-{case}")
    harness.steps(benchmark, runner, group=group)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_step_torch(benchmark, harness, torch_cuda, precision, mode):
    config = harness.config("seed", precision)
    harness.steps(benchmark, harness.peer(config, mode, "cuda"), group=f"step-seed-{precision}")


# ------------------------------------------------------------------------------ second wave
def test_wave_reference_tiny(benchmark, harness):
    config = harness.config("tiny", "f32", **WAVE_ALL)
    harness.steps(benchmark, harness.reference(config), group="step-tiny-f32-wave")


def test_wave_torch_cpu_tiny(benchmark, harness):
    config = harness.config("tiny", "f32", **WAVE_ALL)
    harness.steps(benchmark, harness.peer(config, "eager", "cpu"), group="step-tiny-f32-wave")


@pytest.mark.gpu
@pytest.mark.parametrize("case", WAVE_CASES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_wave_fast(benchmark, harness, fast_trainer_cls, precision, case):
    config = harness.config("seed", precision, **WAVE_CASES[case])
    try:
        runner = harness.fast(fast_trainer_cls, config)
    except ValueError as exc:
        if "does not implement" not in str(exc):
            raise
        pytest.skip(f"the fast trainer refuses this case: {exc}")
    harness.steps(benchmark, runner, group=f"step-seed-{precision}-{case}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", WAVE_CASES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_wave_torch(benchmark, harness, torch_cuda, precision, case, mode):
    if case != "wave" and mode in COMPILED_MODES and not harness.full:
        pytest.skip(f"compiles a one-source case (about a minute): {harness.full_reason}")
    config = harness.config("seed", precision, **WAVE_CASES[case])
    harness.steps(benchmark, harness.peer(config, mode, "cuda"), group=f"step-seed-{precision}-{case}")


# ------------------------------------------------------------------------------ adaptive
@pytest.mark.gpu
@pytest.mark.parametrize("case", ADAPTIVE_CASES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_adaptive_fast(benchmark, harness, fast_trainer_cls, precision, case):
    config = harness.config("seed", precision, **ADAPTIVE_CASES[case])
    harness.steps(benchmark, harness.fast(fast_trainer_cls, config),
                  group=f"step-seed-{precision}-{case}")
