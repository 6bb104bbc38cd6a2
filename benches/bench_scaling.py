"""Scaling: step time vs batch size and vs trunk width, for fast and the best PyTorch peer (GPU).

Where the step time stops being flat as the work grows is where the step stops being
launch-bound (SPEC 11: the ``seed`` step's GEMMs are under 1 GFLOP, about 1 us at the GPU's BF16
rate, so at B=256 it is all launch and latency). Points (``seed`` preset otherwise, bf16):

- batch size ``B`` in ``BATCH_SIZES`` (group ``scaling-batch-<B>``);
- trunk width ``SH1 = SH2`` in ``WIDTHS`` (group ``scaling-width-<W>``).

``extra_info`` carries ``scaling_axis``, ``scaling_value`` and the achieved GEMM TFLOP/s;
``benches/report.py`` turns them into the scaling table. The peer's mode is
``FOXHUNT_BENCH_SCALING_PEER`` (default ``compile-graph``, SPEC 11's best PyTorch mode: the
compiled step captured in one CUDA graph; each new shape compiles again, about a minute each, so
``graph`` is the quicker choice).
"""

from __future__ import annotations

import os

import pytest

BATCH_SIZES = (64, 256, 1024, 4096)
WIDTHS = (256, 512, 1024, 2048)
PRECISION = "bf16"
PEER_MODE = os.environ.get("FOXHUNT_BENCH_SCALING_PEER", "compile-graph")
#: Measured seconds per point and implementation (14 points).
BUDGET_S = 1.0

POINTS = [("batch", b) for b in BATCH_SIZES] + [("width", w) for w in WIDTHS]
IDS = [f"{axis}-{value}" for axis, value in POINTS]


def scaled_config(harness, axis: str, value: int):
    if axis == "batch":
        return harness.config("seed", PRECISION, batch_size=value)
    return harness.config("seed", PRECISION, shared_h1=value, shared_h2=value)


def _run(benchmark, harness, runner, axis: str, value: int) -> None:
    harness.steps(benchmark, runner, group=f"scaling-{axis}-{value}", budget_s=BUDGET_S,
                  scaling_axis=axis, scaling_value=value)


@pytest.mark.gpu
@pytest.mark.parametrize("axis,value", POINTS, ids=IDS)
def test_scaling_fast(benchmark, harness, fast_trainer_cls, axis, value):
    config = scaled_config(harness, axis, value)
    _run(benchmark, harness, harness.fast(fast_trainer_cls, config), axis, value)


@pytest.mark.gpu
@pytest.mark.parametrize("axis,value", POINTS, ids=IDS)
def test_scaling_torch(benchmark, harness, torch_cuda, axis, value):
    from peers.torch_step import MODES

    if PEER_MODE not in MODES:
        raise ValueError(f"FOXHUNT_BENCH_SCALING_PEER={PEER_MODE!r}: allowed values are {MODES}")
    config = scaled_config(harness, axis, value)
    _run(benchmark, harness, harness.peer(config, PEER_MODE, "cuda"), axis, value)
