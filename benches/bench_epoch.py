"""One epoch (300 steps, SPEC 10, then the epoch-end readback): fast vs reference vs PyTorch.

Groups (per epoch times): ``epoch-tiny-f32`` (CPU: the reference and PyTorch eager; runs in CI,
one round) and ``epoch-seed-f32`` / ``epoch-seed-bf16`` (B=256): the fast trainer and the four
PyTorch modes on the GPU; the reference and PyTorch eager on the CPU only with
``FOXHUNT_BENCH_FULL=1`` (about 10 s per epoch each).
"""

from __future__ import annotations

import pytest

from peers.torch_step import MODES

PRECISIONS = ("f32", "bf16")


def test_epoch_reference_tiny(benchmark, harness):
    config = harness.config("tiny", "f32")
    harness.epoch(benchmark, harness.reference(config), group="epoch-tiny-f32")


def test_epoch_torch_cpu_tiny(benchmark, harness):
    config = harness.config("tiny", "f32")
    harness.epoch(benchmark, harness.peer(config, "eager", "cpu"), group="epoch-tiny-f32")


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_epoch_reference(benchmark, harness, precision):
    if not harness.full:
        pytest.skip(f"reference seed epoch (300 steps on the CPU): {harness.full_reason}")
    config = harness.config("seed", precision)
    harness.epoch(benchmark, harness.reference(config), group=f"epoch-seed-{precision}")


@pytest.mark.slow
def test_epoch_torch_cpu(benchmark, harness):
    if not harness.full:
        pytest.skip(f"PyTorch CPU seed epoch (300 steps on the CPU): {harness.full_reason}")
    config = harness.config("seed", "f32")
    harness.epoch(benchmark, harness.peer(config, "eager", "cpu"), group="epoch-seed-f32")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_epoch_fast(benchmark, harness, fast_trainer_cls, precision):
    config = harness.config("seed", precision)
    harness.epoch(benchmark, harness.fast(fast_trainer_cls, config), group=f"epoch-seed-{precision}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_epoch_torch(benchmark, harness, torch_cuda, precision, mode):
    config = harness.config("seed", precision)
    harness.epoch(benchmark, harness.peer(config, mode, "cuda"), group=f"epoch-seed-{precision}")
