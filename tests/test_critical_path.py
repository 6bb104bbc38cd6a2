"""benches/critical_path.py: the longest dependent chain of a plan, in nodes and estimated us.

A hand-made plan (records, a fork and join, an event) whose chains are counted by hand; the
step plans of the seed preset against networkx's longest path of the same dependency graph
(another method); the chain is a real path of the graph; the command line prints a row per
variant.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

from foxhunt.fast.dataflow import dependency_graph
from foxhunt.fast.records import Buf, Copy, Host, Launch, LaunchShape, Ops, Parallel, Record, Wait

_PATH = Path(__file__).resolve().parents[1] / "benches" / "critical_path.py"


def _module():
    spec = importlib.util.spec_from_file_location("critical_path", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("critical_path", mod)
    spec.loader.exec_module(mod)
    return mod


cp = _module()
SHAPE = LaunchShape((1, 1, 1), (32, 1, 1))


def _k(ops: Ops, name: str) -> None:
    ops.items.append(Launch(name, SHAPE, {}))


def _copy(ops: Ops) -> None:
    ops.items.append(Copy(Buf("x"), Host("h"), 4, "htod"))


def _hand_plan() -> Ops:
    """a; parallel(side1: b c record(e) d, side2: wait(e) f, main: copy g); h.

    Chains (kernel = K, copy = C us): a b c d h (5 kernels), a b c f h (5 kernels: f waits
    for c through the event), a g h (2 kernels and the copy)."""
    ops = Ops(None)
    _k(ops, "a")
    side1, side2, main = Ops(None), Ops(None), Ops(None)
    for name in "bc":
        _k(side1, name)
    side1.items.append(Record("e"))
    _k(side1, "d")
    side2.items.append(Wait("e"))
    _k(side2, "f")
    _copy(main)
    ops.items.append(Parallel((side1, side2), main))
    _k(ops, "h")
    return ops


def test_hand_plan_chain_in_nodes_and_us():
    path = cp.graph_path(_hand_plan())
    k = cp.LAUNCH_US + cp.RUN_US["kernel"]
    assert path.nodes == 7
    assert path.depth == 5
    assert path.est_us == pytest.approx(5 * k)
    labels = [cp.node_label(n) for n in path.chain.nodes]
    assert labels in (list("abcdh"), list("abcfh"))


def test_node_times_by_label_sum_in_plan_order():
    """--node: the nodes labelled LABEL across the graphs, in plan order, summed; a label no
    node has says so."""
    g1, g2 = Ops(None), Ops(None)
    for name in ("gemm_tf32", "a", "gemm_tf32"):
        _k(g1, name)
    _k(g2, "gemm_tf32")
    _copy(g2)
    graphs = {}
    for name, ops, us in (("graph1", g1, (1.25, 9.0, 2.5)), ("graph2", g2, (0.75, 3.0))):
        nodes = tuple(ops.items)
        graphs[name] = cp.MeasuredGraph(1.0, cp.graph_path(ops).chain, sum(us), nodes, us)
    step = cp.MeasuredStep(graphs, 1.0, 1.0)
    lines = cp.format_nodes(step, ["gemm_tf32", "copy htod", "gemm_f32"]).splitlines()
    assert lines == ["  nodes 'gemm_tf32': 3, 4.50 us in all: 1.25 2.50 0.75",
                     "  nodes 'copy htod': 1, 3.00 us in all: 3.00",
                     "  nodes 'gemm_f32': none in this step"]


def test_node_needs_measure(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cp.main(["--node", "gemm_tf32", "core"])
    assert exit_info.value.code == 2
    assert "--node 'gemm_tf32': node times need --measure" in capsys.readouterr().err


def test_a_heavy_copy_takes_the_chain():
    """With copies far dearer than kernels the three-node chain through the copy wins."""
    old = dict(cp.RUN_US)
    try:
        cp.RUN_US["copy"] = 100.0
        path = cp.graph_path(_hand_plan())
        assert [cp.node_label(n) for n in path.chain.nodes] == ["a", "copy htod", "h"]
        assert path.est_us == pytest.approx(3 * cp.LAUNCH_US + 2 * old["kernel"] + 100.0)
        assert path.depth == 5  # the node count of the longest chain does not change
    finally:
        cp.RUN_US.clear()
        cp.RUN_US.update(old)


def test_a_dependency_on_a_later_node_is_refused():
    with pytest.raises(ValueError, match="later node"):
        cp.longest_chain(["x", "y"], [frozenset({1}), frozenset()], lambda _: 1.0)


def _nx_longest(ops: Ops | list) -> float:
    nodes, deps = dependency_graph(ops if isinstance(ops, list) else [ops])
    g = nx.DiGraph()
    # Node weights as edge weights: a source s feeds every node, each edge into i weighs i's cost.
    g.add_node("s")
    for i, node in enumerate(nodes):
        g.add_edge("s", i, w=cp.node_cost(node))
        for d in deps[i]:
            g.add_edge(d, i, w=cp.node_cost(node))
    return nx.dag_longest_path_length(g, weight="w")


@pytest.mark.parametrize("source", ["core", "iqn", "all"])
def test_step_plan_paths_match_networkx(source):
    from foxhunt.fast.cpu_executor import CpuEngine

    plans = CpuEngine(cp.variant_config("seed", "bf16", source)).plans
    for ops in (plans["graph1"], plans["graph2"]):
        path = cp.graph_path(ops)
        assert path.est_us == pytest.approx(_nx_longest(ops))
        assert path.nodes == ops.node_count()
        # The chain is a path of the dependency graph and its weight is its nodes' costs.
        nodes, deps = dependency_graph([ops])
        idx = path.chain.indices
        assert all(a in deps[b] for a, b in zip(idx, idx[1:]))
        assert not deps[idx[0]]
        assert path.est_us == pytest.approx(sum(cp.node_cost(nodes[i]) for i in idx))
        assert 1 <= path.depth <= path.nodes


def test_command_line_prints_one_row_per_variant(capsys):
    assert cp.main(["core", "ens", "--preset", "tiny", "--precision", "f32"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    got = {r[0]: r for r in rows if r and r[0] in ("core", "ens")}
    assert set(got) == {"core", "ens"}
    assert int(got["ens"][1]) > int(got["core"][1])  # the ensemble adds nodes
    assert np.isfinite(float(got["core"][3]))


def test_fused_trunk_takes_three_nodes_off_each_pass(capsys):
    """``--fused-trunk``: the online and target passes each run one trunk_forward_bf16 for
    the GEMM, f32_to_bf16, GEMM, clamp_finite_isv nodes."""
    plain = cp.table("seed", "bf16", ["core"])[0]["paths"]["graph1"]
    fused = cp.table("seed", "bf16", ["core"], {"fused_trunk": True})[0]["paths"]["graph1"]
    assert plain.nodes - fused.nodes == 6
    assert plain.depth - fused.depth == 3
    assert cp.main(["core", "--fused-trunk"]) == 0
    with pytest.raises(SystemExit):
        cp.main(["core", "--fused-trunk", "--measure", "--members", "2"])
    with pytest.raises(SystemExit):
        cp.main(["core", "--fused-trunk", "--precision", "f32"])
    assert "--fused-trunk: the fused kernel is bf16 only" in capsys.readouterr().err


def test_fused_heads_run_two_nodes_for_five_in_each_pass(capsys):
    """``--fused-heads``: the online and target passes each run heads_forward_bf16 and
    dueling_log_softmax_q_branches for the four first-layer GEMMs and heads_out_dueling_bf16
    (the BF16 step's default end of a pass's heads); both are two nodes deep."""
    plain = cp.table("seed", "bf16", ["core"])[0]["paths"]["graph1"]
    fused = cp.table("seed", "bf16", ["core"], {"fused_heads": True})[0]["paths"]["graph1"]
    assert plain.nodes - fused.nodes == 2 * 3
    assert plain.depth == fused.depth
    assert cp.main(["core", "--fused-heads", "--fused-trunk"]) == 0
    with pytest.raises(SystemExit):
        cp.main(["core", "--fused-heads", "--measure", "--members", "2"])
    with pytest.raises(SystemExit):
        cp.main(["core", "--fused-heads", "--precision", "tf32"])
    assert "--fused-heads: the fused kernel is bf16 only" in capsys.readouterr().err


def test_stacked_backward_stacks_the_two_losses_gemms(capsys, monkeypatch):
    """``--stacked-backward``: the C51 and CQL backward passes' 2 x 19 GEMMs are 19 (per head 2
    input and 2 weight gradients, the trunk's 3), every per-loss kernel kept. Compared with the
    backward GEMMs all cuBLASLt's (``step_program.BACKWARD_GEMM_KERNELS`` off: the stacked pairs
    are batched cuBLASLt plans, which the backward GEMM kernels do not replace; nor the heads'
    ``d h2`` kernel, ``FUSE_HEADS_DH2``)."""
    import foxhunt.fast.step_program as step_program

    monkeypatch.setattr(step_program, "BACKWARD_GEMM_KERNELS", False)
    monkeypatch.setattr(step_program, "FUSE_HEADS_DH2", frozenset())
    plain = cp.table("seed", "bf16", ["core"])[0]["paths"]["graph1"]
    stacked = cp.table("seed", "bf16", ["core"], {"stacked_backward": True})[0]["paths"]["graph1"]
    assert plain.nodes - stacked.nodes == 4 * 4 + 3
    assert cp.main(["core", "--stacked-backward"]) == 0
    with pytest.raises(SystemExit):
        cp.main(["core", "--stacked-backward", "--measure", "--members", "2"])
    assert "--stacked-backward: a population keeps a backward pass per loss" in \
        capsys.readouterr().err


def test_command_line_refuses_an_unknown_source():
    with pytest.raises(SystemExit):
        cp.main(["nope"])


def test_collection_cycle_chain_matches_networkx_and_scans_in_many_blocks(capsys):
    """The collection cycle (issue 20) as one captured graph: its chain weight against
    networkx's longest path of the same dependency graph; the env step, the n-step window and
    the ring add are one node before the scan, whose tiles are one block each, and the scan's
    offsets, the draws, the weights and the gather one node after it; the one-block prefix_sum
    costs its tiles (1 + 3 + 2 * 7 us for 50,000 rows)."""
    import foxhunt.fast.records as records

    config = cp.variant_config("tiny", "f32", "core")
    graphs = list(cp.collect_plans(config, n_envs=4, capacity=3000).values())
    paths = cp.collect_paths(config, n_envs=4, capacity=3000)
    assert paths["cycle"].est_us == pytest.approx(_nx_longest(graphs))
    assert paths["cycle"].nodes == sum(paths[g].nodes for g in cp.COLLECT_GRAPHS)
    chain = [cp.node_label(n) for n in paths["cycle"].chain.nodes]
    at = chain.index("scan_tiles")
    assert chain[at - 1:at + 2] == ["collect_transition", "scan_tiles", "replay_batch"]
    for fused in ("env_act", "env_step", "nstep_window", "replay_add", "scan_offsets",
                  "replay_sample", "importance_weights", "replay_gather", "cycle_advance"):
        assert fused not in chain, fused
    scan = paths["cycle"].chain.nodes[at]
    assert scan.shape.grid[0] == 3  # ceil(3000 / 1024)
    assert paths["cycle"].est_us == pytest.approx(sum(paths[g].est_us for g in cp.COLLECT_GRAPHS))
    heavy = records.Launch("prefix_sum", SHAPE, {"n": 50_000})
    assert cp.node_cost(heavy) == pytest.approx(1.0 + 3.0 + 2.0 * 7)
    assert cp.main(["--collect", "--preset", "tiny", "--precision", "f32", "--n-envs", "4",
                    "--capacity", "3000"]) == 0
    rows = {r[0]: r for r in (line.split() for line in capsys.readouterr().out.splitlines()) if r}
    assert float(rows["cycle"][3]) == pytest.approx(paths["cycle"].est_us, abs=0.05)


def _gpu_reason() -> str | None:
    from foxhunt.fast.device import cuda_available

    ok, reason = cuda_available()
    return None if ok else reason


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=f"no CUDA device/driver: {_gpu_reason()}")
def test_measured_step_times_every_node_and_bounds_the_chain(capsys):
    """--measure on the GPU (tiny preset, every source on): a positive time per node of graph 1
    and graph 2, the measured chain is a path of the graph whose weight is the sum of its
    nodes' times and lies between the slowest node and the sum of all of them."""
    config = cp.variant_config("tiny", "f32", "all")
    step = cp.measure_step(config, repeats=3, replays=5)
    assert set(step.graphs) == set(cp.MEASURED_GRAPHS)
    assert step.pair_us > max(m.graph_us for m in step.graphs.values()) * 0.5
    assert step.merged_us > max(m.graph_us for m in step.graphs.values()) * 0.5
    for m in step.graphs.values():
        assert len(m.us) == len(m.nodes) > 0 and min(m.us) > 0 and m.graph_us > 0
        assert m.chain.weight == pytest.approx(sum(m.us[i] for i in m.chain.indices))
        assert max(m.us) <= m.chain.weight <= m.serial_us * (1 + 1e-9)
    assert cp.main(["--preset", "tiny", "--measure", "--repeats", "2", "--chain", "--node",
                    "step_scalars", "core"]) == 0
    out = capsys.readouterr().out
    assert "graph1" in out and "measured critical chain" in out and "back to back" in out
    assert "nodes 'step_scalars': 1, " in out
    assert "as one graph" in out


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=f"no CUDA device/driver: {_gpu_reason()}")
def test_graph_throughput_rows(capsys):
    """benches/graph_throughput.py: one row per (members, width), positive times, per-node time
    = graph time / nodes; a one-chain graph of 8 nodes takes longer than one node's launch."""
    spec = importlib.util.spec_from_file_location("graph_throughput", _PATH.parent / "graph_throughput.py")
    gt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gt)
    rows = gt.run(8, [1, 2], [1, 4], 4096)
    assert [(r["members"], r["width"]) for r in rows] == [(1, 1), (1, 2), (4, 1), (4, 2)]
    for r in rows:
        assert r["graph_us"] > 0 and r["us_per_node"] == pytest.approx(r["graph_us"] / 8)
    assert gt.main(["--nodes", "4", "--widths", "1,2", "--members", "1", "--elements", "1024"]) == 0
    assert "us_per_node" in capsys.readouterr().out
