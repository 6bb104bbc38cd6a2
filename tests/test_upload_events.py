"""The step's graphs wait for and record their events themselves (``fast.gpu_engine``: each
upload graph waits for ``graph1_done`` and records ``uploaded[slot]`` and ``batch_ready``, the
step graph waits for ``batch_ready`` and records ``graph1_done``; ``launch`` is two graph
launches). What the staging ring and the two streams rely on: a graph's wait and record nodes
act as a stream wait and a record issued at its LAUNCH, so a launch waits for the record of the
graph launched before it, and a host query or wait issued after a launch sees that launch's
record.

GPU only (skipped with the reason elsewhere). A stream is held shut by a ``cuStreamWaitValue32``
gate on a device word while steps are launched, and what must be pending is checked; once a
third stream opens the gate, the trainer ends in exactly the bits of a twin that stepped the
same batches through ``Trainer.step``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from foxhunt.fast.device import cuda_available

_OK, _REASON = cuda_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=f"no CUDA device/driver: {_REASON}")]


def _query(drv, event):
    result = drv.cuEventQuery(event)
    return result[0] if isinstance(result, tuple) else result


@contextlib.contextmanager
def gated(engine, stream):
    """Hold ``stream`` shut (work enqueued on it after this waits) until the yielded ``open()``
    is called; on exit the gate is open and every stream idle."""
    from foxhunt.fast.device import _driver, call

    drv = _driver()
    gate = engine.device.alloc(4)
    opener = engine.device.new_stream()
    call(drv.cuMemsetD32Async, gate.ptr, 0, 1, stream)  # ordered before the gate on its stream
    call(drv.cuStreamWaitValue32, stream, gate.ptr, 1,
         drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ.value)

    def open_gate():
        call(drv.cuStreamWriteValue32, opener.handle, gate.ptr, 1, 0)

    try:
        yield open_gate
    finally:
        open_gate()
        engine.device.synchronize()
        opener.close()
        gate.free()


def _twins(config, batches, warm):
    from foxhunt.fast.trainer import Trainer

    gated_trainer, twin = Trainer(config, seed=2), Trainer(config, seed=2)
    for batch in batches[:warm]:
        gated_trainer.step(batch)
    for batch in batches:
        twin.step(batch)
    gated_trainer.engine.device.synchronize()
    return gated_trainer, twin


def _assert_same_state(got, want):
    got, want = got.state_dict(), want.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert np.array_equal(np.asarray(got[key]), np.asarray(want[key])), key


def _enqueue(trainer, batch) -> int:
    """``Trainer.step``'s host side without its readback bookkeeping: the slot it launched."""
    from foxhunt.fast.trainer import STAGING_RING, write_batch

    slot = trainer.step_count % STAGING_RING
    write_batch(trainer.config, batch, trainer.engine.staging(slot))
    trainer.engine.launch(slot)
    return slot


@pytest.fixture
def config_batches():
    from foxhunt.reference.batch import Batch
    from foxhunt.reference.config import CORE_STEP, DQNConfig

    config = DQNConfig.preset("tiny", precision="f32", **CORE_STEP)
    rng = np.random.default_rng(5)
    return config, [Batch.random(config, rng) for _ in range(4)]


def test_a_gated_upload_keeps_its_events_and_the_step_pending(config_batches):
    """The upload stream shut: the step's upload cannot copy, so its slot's event, and the step
    graph (waiting for ``batch_ready``), stay pending."""
    from foxhunt.fast.device import _driver, call

    drv = _driver()
    config, batches = config_batches
    trainer, twin = _twins(config, batches[:3], warm=2)
    after = call(drv.cuEventCreate, 0)
    try:
        engine = trainer.engine
        with gated(engine, engine._upload_stream.handle) as open_gate:
            slot = _enqueue(trainer, batches[2])
            call(drv.cuEventRecord, after, engine.stream.handle)
            not_ready = drv.CUresult.CUDA_ERROR_NOT_READY
            assert _query(drv, engine._uploaded[slot]) == not_ready
            assert _query(drv, engine._batch_ready) == not_ready
            assert _query(drv, after) == not_ready
            open_gate()
            call(drv.cuEventSynchronize, after)
            assert _query(drv, engine._uploaded[slot]) == drv.CUresult.CUDA_SUCCESS
        trainer.step_enqueued()
        _assert_same_state(trainer, twin)
    finally:
        drv.cuEventDestroy(after)
        trainer.close()
        twin.close()


def test_a_held_step_holds_the_next_upload(config_batches):
    """The step stream shut: the first step's graph cannot run, so its ``graph1_done`` record
    is pending, and the next step's upload (waiting for it: the batch buffer is still to be
    read) stays pending although its own stream is free."""
    from foxhunt.fast.device import _driver, call

    drv = _driver()
    config, batches = config_batches
    trainer, twin = _twins(config, batches, warm=2)
    try:
        engine = trainer.engine
        with gated(engine, engine.stream.handle) as open_gate:
            _enqueue(trainer, batches[2])
            trainer.step_enqueued()
            slot = _enqueue(trainer, batches[3])
            trainer.step_enqueued()
            not_ready = drv.CUresult.CUDA_ERROR_NOT_READY
            assert _query(drv, engine._graph1_done) == not_ready
            assert _query(drv, engine._uploaded[slot]) == not_ready
            open_gate()
            call(drv.cuEventSynchronize, engine._uploaded[slot])
        _assert_same_state(trainer, twin)
    finally:
        trainer.close()
        twin.close()
