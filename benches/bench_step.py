"""One training step (SPEC 4): fast vs reference vs the PyTorch peers, one group per workload.

Groups (per step times; see ``benches/conftest.py`` for how asynchronous steps are timed):

- ``step-tiny-f32`` (CPU, runs in CI): the reference and PyTorch eager on the CPU;
- ``step-seed-f32``, ``step-seed-bf16`` (B=256, the production size): the reference on the CPU
  (bf16 = the bit-exact BF16 emulation), PyTorch eager on the CPU (f32), and on the GPU the fast
  trainer and the four PyTorch modes (eager, compile, graph, compile-graph; bf16 = autocast).
"""

from __future__ import annotations

import pytest

from peers.torch_step import MODES

PRECISIONS = ("f32", "bf16")

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
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_step_torch(benchmark, harness, torch_cuda, precision, mode):
    config = harness.config("seed", precision)
    harness.steps(benchmark, harness.peer(config, mode, "cuda"), group=f"step-seed-{precision}")
