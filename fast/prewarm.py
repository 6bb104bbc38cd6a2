"""``start()``: what the first fast trainer of a process waits for, begun early on a thread.

Measured on the H200 (``foxhunt train --backend fast`` with the defaults, session 11): of the
trainer's construction (0.88 s) the driver's initialisation took about 0.12 s, the device's
primary context 0.1-0.2 s, the cuBLASLt handle 0.07 s, reading the kernel cache 0.19 s and the
kernels' parameter table 0.03-0.08 s. None of it depends on the run's data or settings, so
``foxhunt train`` starts it on a daemon thread before it builds its data: what of it does not
hold Python's GIL (time inside the driver and cuBLASLt) overlaps that work. (Not measured
apart: with the stored cuBLASLt answers, ``fast.gemm_algos``, the defaults' run went from
2.79 s to 2.46 s on the H200.) The trainer then finds each one done: ``Device`` retains the primary context
this thread retained (and keeps), ``gemm.cublaslt_handle``, ``_build.package_module`` and
``cuda_parse.package_kernels`` keep their answers per process (a trainer that asks while this
thread still builds the module waits for it instead of building it again).

Every step is one the trainer repeats; an error here is logged at debug level and dropped (the
trainer meets it again and raises it with its own message), so prewarming changes when the work
happens, never what a run does.
"""

from __future__ import annotations

import logging
import threading

LOG = logging.getLogger("foxhunt")

_KEPT: list = []  # the thread's Device: its primary-context retain lasts the process


def prewarm(ordinal: int = 0) -> None:
    """Initialise the driver, retain device ``ordinal``'s primary context, create its cuBLASLt
    handle, load the compiled module and the kernels' parameter table (see the module
    docstring); never raises."""
    try:
        from foxhunt.fast.device import Device, cuda_available

        if not cuda_available()[0]:
            return
        device = Device(ordinal)
        _KEPT.append(device)
        from foxhunt.fast._build import package_module
        from foxhunt.fast.cuda_parse import package_kernels
        from foxhunt.fast.gemm import cublaslt_handle

        cublaslt_handle(device)
        package_module(device.arch)
        package_kernels()
    except Exception as exc:  # noqa: BLE001 - the trainer repeats each step and raises
        LOG.debug("prewarm stopped: %r", exc)


def start(ordinal: int = 0) -> threading.Thread:
    """``prewarm(ordinal)`` on a new daemon thread (started; returned for tests to join)."""
    thread = threading.Thread(target=prewarm, args=(ordinal,), name="foxhunt-prewarm",
                              daemon=True)
    thread.start()
    return thread


__all__ = ["prewarm", "start"]
