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
