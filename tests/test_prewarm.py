"""fast.prewarm: the early device set-up never raises, leaves its answers for the trainer, and
the package module is built once per process."""

from __future__ import annotations

import logging

import pytest

from foxhunt.fast import _build, prewarm
from foxhunt.fast.device import cuda_available

_OK, _REASON = cuda_available()


def test_prewarm_drops_errors_the_trainer_will_raise(monkeypatch, caplog):
    import foxhunt.fast.device as device

    def broken(ordinal=0):
        raise device.CudaError("cuDevicePrimaryCtxRetain failed (planted)")

    monkeypatch.setattr(device, "cuda_available", lambda: (True, "planted"))
    monkeypatch.setattr(device, "Device", broken)
    with caplog.at_level(logging.DEBUG, logger="foxhunt"):
        prewarm.start().join(timeout=60)
    assert "prewarm stopped" in caplog.text and "planted" in caplog.text


def test_prewarm_without_a_device_does_nothing(monkeypatch):
    import foxhunt.fast.device as device

    monkeypatch.setattr(device, "cuda_available", lambda: (False, "no driver (planted)"))
    monkeypatch.setattr(device, "Device", lambda ordinal=0: pytest.fail("Device() was called"))
    prewarm.prewarm()


def test_package_module_builds_once_per_architecture(monkeypatch):
    built = []

    def fake_compile(arch):
        built.append(arch)
        return object()

    monkeypatch.setattr(_build, "compile_sources", fake_compile)
    monkeypatch.setattr(_build, "_PACKAGE_MODULES", {})
    first = _build.package_module("sm_90")
    assert _build.package_module(90) is first and _build.package_module("sm_80") is not first
    assert built == [90, 80]


@pytest.mark.gpu
@pytest.mark.skipif(not _OK, reason=f"no CUDA device/driver: {_REASON}")
def test_prewarm_leaves_the_module_and_the_handle_for_the_trainer():
    from foxhunt.fast import gemm
    from foxhunt.fast.device import Device

    prewarm.start().join(timeout=300)
    device = Device(0)
    assert 0 in gemm._HANDLES and gemm.cublaslt_handle(device) == gemm._HANDLES[0]
    module = _build.package_module(device.arch)
    assert module is _build._PACKAGE_MODULES[_build.normalize_arch(device.arch)]
