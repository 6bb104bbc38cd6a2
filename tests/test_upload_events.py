"""The step's upload graphs record their staging slot's event themselves (``fast.gpu_engine``:
an external event record node ends each upload graph; ``Trainer.step`` makes four driver calls
where it made six). What the staging ring and the step stream rely on: the event counts as
recorded by the LAUNCH, so a host query or wait, and a stream wait, issued after the launch
wait for that launch's copy, not for an earlier record.

GPU only (skipped with the reason elsewhere). The upload stream is held shut by a
``cuStreamWaitValue32`` gate on a device word while the step is launched: the slot's event and
an event recorded after the step graph must then be pending; once a third stream opens the
gate, the step completes and the trainer ends in exactly the bits of a twin that stepped the
same batches through ``Trainer.step``. The staging ring allocated write-combined
(``gpu_engine.WRITE_COMBINED_STAGING``) steps to the same bits as the default one.
"""

from __future__ import annotations

import numpy as np
import pytest

from foxhunt.fast.device import cuda_available

_OK, _REASON = cuda_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=f"no CUDA device/driver: {_REASON}")]


def _query(drv, event):
    result = drv.cuEventQuery(event)
    return result[0] if isinstance(result, tuple) else result


def _assert_same_state(got_trainer, want_trainer) -> None:
    """The two trainers' states are bit for bit equal, entry by entry."""
    got, want = got_trainer.state_dict(), want_trainer.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert np.array_equal(np.asarray(got[key]), np.asarray(want[key])), key


def test_a_gated_upload_keeps_its_event_and_the_step_pending():
    from foxhunt.fast.device import _driver, call
    from foxhunt.fast.trainer import STAGING_RING, Trainer, write_batch
    from foxhunt.reference.batch import Batch
    from foxhunt.reference.config import CORE_STEP, DQNConfig

    drv = _driver()
    config = DQNConfig.preset("tiny", precision="f32", **CORE_STEP)
    rng = np.random.default_rng(5)
    batches = [Batch.random(config, rng) for _ in range(3)]
    gated, twin = Trainer(config, seed=2), Trainer(config, seed=2)
    try:
        for batch in batches[:2]:
            gated.step(batch)
            twin.step(batch)
        twin.step(batches[2])
        engine = gated.engine
        engine.synchronize()
        engine._upload_stream.synchronize()
        gate = engine.device.alloc(4)
        up = engine._upload_stream.handle
        call(drv.cuMemsetD32Async, gate.ptr, 0, 1, up)  # ordered before the gate on its stream
        opener = engine.device.new_stream()
        after = call(drv.cuEventCreate, 0)
        try:
            call(drv.cuStreamWaitValue32, up, gate.ptr, 1,
                 drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ.value)
            slot = gated.step_count % STAGING_RING
            write_batch(config, batches[2], engine.staging(slot))
            engine.launch(slot)
            call(drv.cuEventRecord, after, engine.stream.handle)
            not_ready = drv.CUresult.CUDA_ERROR_NOT_READY
            assert _query(drv, engine._uploaded[slot]) == not_ready
            assert _query(drv, after) == not_ready
            call(drv.cuStreamWriteValue32, opener.handle, gate.ptr, 1, 0)
            call(drv.cuEventSynchronize, after)
            assert _query(drv, engine._uploaded[slot]) == drv.CUresult.CUDA_SUCCESS
            gated.step_enqueued()
        finally:
            opener.synchronize()
            opener.close()
            drv.cuEventDestroy(after)
            gate.free()
        _assert_same_state(gated, twin)
    finally:
        gated.close()
        twin.close()


def test_a_write_combined_staging_ring_steps_to_the_same_bits(monkeypatch):
    """``gpu_engine.WRITE_COMBINED_STAGING`` on: the staging ring's blocks are write-combined
    (the read mirrors are not) and the trainer steps to exactly the bits of a twin built with the
    switch off."""
    from foxhunt.fast import gpu_engine
    from foxhunt.fast.device import pinned_block
    from foxhunt.fast.trainer import STAGING_RING, Trainer
    from foxhunt.reference.batch import Batch
    from foxhunt.reference.config import CORE_STEP, DQNConfig

    config = DQNConfig.preset("tiny", precision="bf16", **CORE_STEP)
    rng = np.random.default_rng(7)
    batches = [Batch.random(config, rng) for _ in range(2 * STAGING_RING + 1)]
    trainers = {}
    try:
        for combined in (True, False):
            monkeypatch.setattr(gpu_engine, "WRITE_COMBINED_STAGING", combined)
            trainers[combined] = Trainer(config, seed=3)
            engine = trainers[combined].engine
            staging = [pinned_block(b).write_combined for b in engine._staging]
            assert staging == [combined] * STAGING_RING
            assert not pinned_block(engine._readback_host).write_combined
            for batch in batches:
                trainers[combined].step(batch)
        _assert_same_state(trainers[True], trainers[False])
    finally:
        for trainer in trainers.values():
            trainer.close()


def _record_node_sources(engine) -> list:
    """The graph nodes the step graph's ``graph1_done`` record node depends on."""
    from foxhunt.fast.device import _driver, call
    from foxhunt.fast.graphs import graph_edges, graph_nodes

    drv = _driver()
    graph = engine._step_graph.graph
    record = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_EVENT_RECORD
    want = int(engine._graph1_done)
    nodes = [n for n in graph_nodes(graph) if call(drv.cuGraphNodeGetType, n) == record
             and int(call(drv.cuGraphEventRecordNodeGetEvent, n)) == want]
    assert len(nodes) == 1
    return [src for src, dst in graph_edges(graph) if int(dst) == int(nodes[0])]


@pytest.mark.parametrize("precision, source", [("bf16", "core"), ("f32", "all")])
def test_an_early_upload_release_steps_to_the_same_bits(monkeypatch, precision, source):
    """``step_program.EARLY_UPLOAD_RELEASE`` on (the default): the step graph records
    ``graph1_done`` after graph 1's last readers of the batch (``dataflow.release_points``: one
    kernel or GEMM node each), so the next upload may overwrite the batch while graph 1's tail
    still runs; a trainer stepping distinct batches back to back (no synchronisation between
    steps) ends in exactly the bits of a twin built with the switch off."""
    from foxhunt.fast import step_program
    from foxhunt.fast.dataflow import release_points
    from foxhunt.fast.device import _driver, call
    from foxhunt.fast.trainer import Trainer
    from foxhunt.reference.batch import Batch
    from foxhunt.reference.config import DQNConfig, source_overrides

    drv = _driver()
    config = DQNConfig.preset("seed", precision=precision, **source_overrides(source))
    rng = np.random.default_rng(11)
    batches = [Batch.random(config, rng) for _ in range(8)]
    trainers = {}
    try:
        for early in (True, False):
            monkeypatch.setattr(step_program, "EARLY_UPLOAD_RELEASE", early)
            trainers[early] = trainer = Trainer(config, seed=4)
            if early:
                plans = trainer.engine.plans
                points = release_points(plans["upload"][0], [plans["graph1"], plans["graph2"]])
                sources = _record_node_sources(trainer.engine)
                assert len(sources) == len(points) >= 2
                assert {call(drv.cuGraphNodeGetType, n) for n in sources} == {
                    drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL}
            for batch in batches:
                trainer.step(batch)
        _assert_same_state(trainers[True], trainers[False])
    finally:
        for trainer in trainers.values():
            trainer.close()
