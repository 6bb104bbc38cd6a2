"""Shared pytest configuration: the hypothesis profiles (``ci`` derandomised, ``dev`` random),
defined once in ``foxhunt.conformance.strategies``; the ``lt`` fixture (cuBLASLt's bindings, or
a skip with the reason) of the GPU GEMM tests."""

import pytest

from foxhunt.conformance.strategies import load_hypothesis_profile

load_hypothesis_profile()


@pytest.fixture(scope="module")
def lt():
    """``nvmath.bindings.cublasLt`` as ``foxhunt.fast.gemm`` loads it; skips with the reason
    where it cannot be loaded."""
    from foxhunt.fast.gemm import CublasUnavailableError, _cublaslt

    try:
        return _cublaslt()
    except CublasUnavailableError as exc:
        pytest.skip(str(exc))
