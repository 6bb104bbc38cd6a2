"""benches/graph_anatomy.py on the CPU: the plans it replays with classes of nodes swapped for a
trivial launch, and its command line where there is no GPU (the timings need one)."""

from __future__ import annotations

import pytest
from bench_modules import load_bench

from foxhunt.fast.dataflow import dependency_graph
from foxhunt.fast.records import Gemm, Launch, Parallel, Record, Wait

cp = load_bench("critical_path")
ga = load_bench("graph_anatomy")


@pytest.fixture(scope="module")
def graph1():
    """Graph 1 of the tiny core bf16 step with every backward GEMM cuBLASLt's (the anatomy's GEMM
    roles; ``step_program.BACKWARD_GEMM_KERNELS`` off)."""
    import foxhunt.fast.step_program as step_program
    from foxhunt.fast.cpu_executor import CpuEngine

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(step_program, "BACKWARD_GEMM_KERNELS", False)
        return CpuEngine(cp.variant_config("tiny", "bf16", "core")).plans["graph1"]


def _shape(ops) -> list:
    """The plan's structure: parallel sections, records and waits, and a mark per node."""
    out = []
    for it in ops.items:
        if isinstance(it, Parallel):
            out.append(("parallel", [_shape(b) for b in (*it.sides, it.main)]))
        elif isinstance(it, (Record, Wait)):
            out.append(it)
        else:
            out.append("node")
    return out


def _is_trivial(node) -> bool:
    return isinstance(node, Launch) and node.kernel == "saxpy" and node.args["n"] == ga.TRIVIAL_N \
        and node.args["x"].name == "q_taken"


def test_each_variant_swaps_exactly_its_class_and_keeps_the_structure(graph1):
    nodes, _ = dependency_graph([graph1])
    chain = [0, 3, len(nodes) - 1]  # any set of node indices stands for the chain here
    variants = ga.variant_ops(graph1, chain)
    assert set(variants) == set(ga.VARIANTS)
    for name, ops in variants.items():
        assert _shape(ops) == _shape(graph1), name
        kept = ops.nodes()
        assert len(kept) == len(nodes), name
        for i, (old, new) in enumerate(zip(graph1.nodes(), kept)):
            on_chain, gemm = i in chain, isinstance(old, Gemm)
            want_swapped = ga.VARIANTS[name](old, on_chain, gemm)
            assert (new is not old) == want_swapped and (_is_trivial(new) == want_swapped
                                                         or _is_trivial(old)), (name, i)
    real, skeleton = variants["real"].nodes(), variants["skeleton"].nodes()
    assert all(a is b for a, b in zip(real, graph1.nodes()))
    assert all(_is_trivial(n) for n in skeleton)
    gemms = [i for i, n in enumerate(graph1.nodes()) if isinstance(n, Gemm)]
    assert gemms and all(isinstance(variants["gemms"].nodes()[i], Gemm) for i in gemms)
    assert not any(isinstance(n, Gemm) for n in variants["kernels"].nodes())
    assert [i for i, n in enumerate(variants["chain"].nodes()) if not _is_trivial(n)] == \
        [i for i in chain if not _is_trivial(graph1.nodes()[i])]
    roles = {ga.gemm_role(graph1.nodes()[i]) for i in gemms}
    assert roles == {"forward", "input", "weight"}
    for role in roles:
        kept = [i for i, n in enumerate(variants[f"chain+kernels+{role}"].nodes())
                if isinstance(n, Gemm)]
        assert kept == [i for i in gemms if i in chain or ga.gemm_role(graph1.nodes()[i]) == role]


def test_gemm_roles_follow_the_transposes():
    from foxhunt.fast.gemm import GemmSpec

    class Node:
        def __init__(self, **kw):
            self.spec = GemmSpec(8, 8, 8, **kw)

    assert ga.gemm_role(Node(trans_b=True, epilogue="relu_aux_bias")) == "forward"
    assert ga.gemm_role(Node(trans_a=True)) == "weight"
    assert ga.gemm_role(Node(epilogue="drelu_bgrad")) == "input"


def test_the_trivial_launch_is_one_block():
    from foxhunt.fast.kernels.optim import plan_saxpy

    grid, block, _ = plan_saxpy(ga.TRIVIAL_N)
    assert grid == 1 and block >= ga.TRIVIAL_N // 4


def test_without_a_gpu_the_command_line_says_so(capsys):
    from foxhunt.fast.device import cuda_available

    if cuda_available()[0]:
        pytest.skip("a CUDA device is present (the command would run)")
    assert ga.main(["core"]) == 2
    assert "graph_anatomy: no CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ga.main(["nope"])
