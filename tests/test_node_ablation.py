"""benches/node_ablation.py on the CPU: the plans it replays without a node, its groups, and its
command line where there is no GPU (the timings themselves need one)."""

from __future__ import annotations

import pytest
from bench_modules import load_bench

from foxhunt.fast.dataflow import dependency_graph
from foxhunt.fast.records import Parallel

cp = load_bench("critical_path")
ab = load_bench("node_ablation")


@pytest.fixture(scope="module")
def graph1():
    from foxhunt.fast.cpu_executor import CpuEngine

    return CpuEngine(cp.variant_config("tiny", "f32", "all")).plans["graph1"]


def _parallels(ops) -> int:
    return sum(1 + sum(_parallels(b) for b in (*it.sides, it.main))
               for it in ops.items if isinstance(it, Parallel))


def test_leaving_one_node_out_keeps_every_other_node_and_every_fork(graph1):
    nodes = graph1.nodes()
    for k in (0, len(nodes) // 2, len(nodes) - 1):
        gone = nodes[k]
        kept = ab.without(graph1, lambda n, g=gone: n is g)
        assert [id(n) for n in kept.nodes()] == [id(n) for i, n in enumerate(nodes) if i != k]
        assert _parallels(kept) == _parallels(graph1)
        assert kept.branch_resources() == graph1.branch_resources()
        remaining, deps = dependency_graph([kept])  # still a DAG the capture can make
        assert len(remaining) == len(nodes) - 1 and all(d < i for i, ds in enumerate(deps) for d in ds)
    assert [id(n) for n in graph1.nodes()] == [id(n) for n in nodes]  # the plan itself untouched


def test_groups_cover_every_gemm_every_kernel_and_each_repeated_label(graph1):
    nodes = graph1.nodes()
    groups = {name: (drop, count) for name, drop, count in ab.groups_of(nodes)}
    kinds = [cp.node_kind(n) for n in nodes]
    assert groups["every gemm"][1] == kinds.count("gemm") > 0
    assert groups["every kernel"][1] == kinds.count("kernel") > 0
    labels = [cp.node_label(n) for n in nodes]
    repeated = {lab for lab in labels if labels.count(lab) > 1}
    assert {name for name in groups if name not in ("every gemm", "every kernel")} == \
        {f"every {lab}" for lab in repeated}
    for name, (drop, count) in groups.items():
        assert len(ab.without(graph1, drop).nodes()) == len(nodes) - count, name


def test_command_line_refuses_an_unknown_source_and_runs_only_on_a_gpu(capsys):
    with pytest.raises(SystemExit) as exc:
        ab.main(["bogus"])
    assert exc.value.code == 2 and "SOURCE 'bogus' is not one of" in capsys.readouterr().err
    from foxhunt.fast.device import cuda_available

    if cuda_available()[0]:
        pytest.skip("a GPU is present: the no-device message is for machines without one")
    assert ab.main(["core"]) == 2
    assert "node_ablation: no CUDA device" in capsys.readouterr().err
