"""The optimiser graph alone (issue 7's figure): grad norm, clip, Adam with Mech 9, batched
spectral norm over the 10 ``seed`` matrices, BF16 mirror, Polyak + target mirror, ISV producers
and the fused sentinel check — the fast trainer's graph 2 (the second part of its step graph),
captured and replayed on its own (GPU only)."""

from __future__ import annotations

import numpy as np
import pytest

from foxhunt.reference.batch import Batch

REPLAYS = 200


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "f32"])
def test_optimizer_graph_replay(benchmark, harness, fast_trainer_cls, precision):
    config = harness.config("seed", precision)
    trainer = fast_trainer_cls(config)
    graph = None
    try:
        rng = np.random.default_rng(0)
        for _ in range(3):
            trainer.step(Batch.random(config, rng))
        trainer.end_epoch()
        graph = trainer._engine.capture_plans(["graph2"])  # the optimiser part (SPEC 9: graph 2)
        stream = trainer.stream

        def replays():
            for _ in range(REPLAYS):
                graph.replay()
            stream.synchronize()

        benchmark.group = f"optimizer-graph-seed-{precision}"
        gpu_s = np.median([harness.driver_event_time(stream, graph.replay, REPLAYS) for _ in range(5)])
        benchmark.extra_info.update(impl="fast", precision=precision, device="gpu",
                                    batch=config.batch_size, nodes=graph.node_count,
                                    gpu_us=gpu_s * 1e6, per="graph replay")
        benchmark.pedantic(replays, rounds=5, iterations=1, warmup_rounds=1)
        print(f"OPTIMIZER GRAPH seed {precision}: {gpu_s * 1e6:.1f} us per replay (CUDA events, "
              f"median of 5 x {REPLAYS}), {graph.node_count} nodes")
    finally:
        if graph is not None:
            graph.close()
        trainer.close()
