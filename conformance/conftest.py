"""pytest configuration of the conformance suite.

- hypothesis profiles ``ci`` (derandomised, no deadline; loaded unless ``HYPOTHESIS_PROFILE``
  names another) and ``dev`` (random, more examples), as in ``tests/conftest.py``;
- the ``gpu`` / ``slow`` markers (also when the suite runs from an installed wheel, where
  ``pyproject.toml`` is not seen);
- ``--conformance-mode quick|full``: ``quick`` deselects the ``seed``-size shape cases;
- the ``cuda_device`` fixture: skips a GPU test with ``"no CUDA device: <reason>"``, the reason
  coming from ``foxhunt.fast.cuda_available()``.
"""

from __future__ import annotations


import pytest
from foxhunt.conformance.registry import cuda_availability
from foxhunt.conformance.strategies import load_hypothesis_profile

load_hypothesis_profile()

MODES = ("quick", "full")
#: Shape cases left out by ``--conformance-mode quick``.
QUICK_SKIPS = ("seed",)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--conformance-mode", choices=MODES, default="full",
                     help="quick: leave out the seed-size shape cases; full (default): everything")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped with a reason otherwise)")
    config.addinivalue_line("markers", "slow: long-running (long-run parity, full epochs)")


def conformance_mode(config: pytest.Config) -> str:
    return config.getoption("--conformance-mode", default="full")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if conformance_mode(config) != "quick":
        return
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        (drop if params.get("case") in QUICK_SKIPS else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def cuda_device() -> str:
    """The fast path's description of the CUDA device; skips the test when there is none."""
    ok, reason = cuda_availability()
    if not ok:
        pytest.skip(f"no CUDA device: {reason}")
    return reason
