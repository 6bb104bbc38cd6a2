"""The benchmark session's ordering (benches/conftest.py, Isolation): every PyTorch CUDA case is
timed after all other cases, since a CUDA peer slows every later CUDA launch in the process."""

from __future__ import annotations

import pytest


def test_pytorch_cuda_cases_come_after_every_other_case(request):
    items = request.session.items
    uses_torch_cuda = ["torch_cuda" in getattr(item, "fixturenames", ()) for item in items]
    names = [item.nodeid for item in items]
    if True not in uses_torch_cuda:
        pytest.skip("no PyTorch CUDA case was collected in this session (run benches/ whole)")
    first = uses_torch_cuda.index(True)
    late = [n for n, torch_cuda in zip(names[first:], uses_torch_cuda[first:]) if not torch_cuda]
    assert late == [], f"cases after the first PyTorch CUDA case ({names[first]}): {late[:5]}"
    # ... and the fast path's cases are among the earlier ones
    fast = [i for i, n in enumerate(names) if "_fast[" in n or n.endswith("_fast")]
    assert fast and max(fast) < first


def test_fast_trainer_exposes_its_step_stream():
    """The GPU event time (``gpu_us``) is measured on ``trainer.stream`` (``conftest._fast_stream``):
    after the plan-as-data split the fast Trainer had no such attribute and the benches
    silently reported none."""
    from foxhunt.fast.cpu_executor import CpuTrainer
    from foxhunt.fast.trainer import Trainer
    from foxhunt.reference.config import DQNConfig

    assert isinstance(Trainer.__dict__.get("stream"), property)
    assert CpuTrainer(DQNConfig.preset("tiny")).stream is None  # no device stream on the CPU
