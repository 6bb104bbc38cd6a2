"""Graph 1 of the fast step taken apart: replayed with classes of its nodes made trivial.

    python benches/graph_anatomy.py [--preset seed] [--precision bf16] [--replays 100]
                                    [SOURCE ...]

``critical_path.py --measure`` finds graph 1 replaying 25 us (the core step) to 60 us (every
second-wave source) above its measured critical chain, and ``node_ablation.py`` what one node
costs in place. This asks which nodes make up that difference. For each step variant (GPU),
after two warm-up steps, graph 1 is captured again from its plan with every node of a class
SWAPPED for one trivial launch (``saxpy`` of 32 floats with ``a = 0``, from ``q_taken`` into the
scratch buffer ``td``: one block, about 1 us inside a chain), every fork, join and event kept,
and replayed ``--replays`` times between CUDA events (the best of 5):

- ``real``: nothing swapped (the captured graph 1);
- ``skeleton``: every node swapped: the graph's structure alone;
- ``chain``: the nodes of the measured critical chain real, every other node swapped;
- ``off-chain``: the reverse;
- ``gemms`` / ``kernels``: every GEMM (every other kernel launch) real, the rest swapped;
- ``chain+gemms`` / ``chain+kernels``: the chain and every GEMM (every kernel) real;
- ``chain+kernels+<role>``: the chain, every kernel and the GEMMs of one role (``gemm_role``:
  the forward passes' layers, the input gradients, the weight gradients) real.

So ``chain`` minus the measured chain is what the structure adds to the chain, ``real`` minus
``chain+kernels`` what the GEMMs beside the chain add, and ``chain+kernels+<role>`` minus
``chain+kernels`` what those of one role add. The values the swapped graphs
compute are wrong and not used: these are timings only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from critical_path import measure_step, variant_main, warmed_trainer

def gemm_role(node) -> str:
    """A GEMM record's role: ``"forward"`` (a layer of a forward pass: ``x @ W^T``),
    ``"weight"`` (a weight gradient: ``dy^T @ x``) or ``"input"`` (an input gradient:
    ``dy @ W``)."""
    spec = node.spec
    return "weight" if spec.trans_a else "forward" if spec.trans_b else "input"


#: Per variant: is a node SWAPPED for the trivial launch? ``(node, on_chain, is_gemm)``.
VARIANTS: dict[str, Callable[[object, bool, bool], bool]] = {
    "real": lambda node, chain, gemm: False,
    "skeleton": lambda node, chain, gemm: True,
    "chain": lambda node, chain, gemm: not chain,
    "off-chain": lambda node, chain, gemm: chain,
    "gemms": lambda node, chain, gemm: not gemm,
    "kernels": lambda node, chain, gemm: gemm,
    "chain+gemms": lambda node, chain, gemm: not chain and not gemm,
    "chain+kernels": lambda node, chain, gemm: not chain and gemm,
    # the chain, every kernel and one role of the GEMMs beside the chain real
    **{f"chain+kernels+{role}": (lambda node, chain, gemm, role=role:
                                 not chain and gemm and gemm_role(node) != role)
       for role in ("forward", "input", "weight")},
}
#: Elements the trivial launch adds (``saxpy``: one block).
TRIVIAL_N = 32


def trivial_launch(binder):
    """The trivial node: ``td[:TRIVIAL_N] += 0 * q_taken[:TRIVIAL_N]`` (``saxpy``, one block)."""
    import numpy as np

    from foxhunt.fast.kernels.optim import plan_saxpy
    from foxhunt.fast.records import Buf

    return binder.launch("saxpy", plan_saxpy(TRIVIAL_N),
                         {"y": Buf("td"), "x": Buf("q_taken"), "n": TRIVIAL_N, "a": np.float32(0)})


def swapped(ops, swap: Callable[[object], bool]):
    """A copy of ``ops`` whose kernel, GEMM and copy records for which ``swap`` is true are each
    replaced by ``trivial_launch``; parallel sections, records and waits kept as they are."""
    from foxhunt.fast.records import NODE_RECORDS, Parallel

    out = ops.branch()
    for it in ops.items:
        if isinstance(it, Parallel):
            out.items.append(Parallel(tuple(swapped(s, swap) for s in it.sides),
                                      swapped(it.main, swap)))
        elif isinstance(it, NODE_RECORDS) and swap(it):
            out.items.append(trivial_launch(ops.binder))
        else:
            out.items.append(it)
    return out


def variant_ops(ops, chain_indices: Sequence[int]) -> dict[str, object]:
    """``{variant: ops}`` for graph 1's ``ops`` whose measured critical chain is the nodes
    ``chain_indices`` of ``dependency_graph([ops])``."""
    from foxhunt.fast.dataflow import dependency_graph
    from foxhunt.fast.records import Gemm

    nodes, _ = dependency_graph([ops])
    on_chain = {id(nodes[i]) for i in chain_indices}
    return {name: swapped(ops, lambda n, pick=pick: pick(n, id(n) in on_chain, isinstance(n, Gemm)))
            for name, pick in VARIANTS.items()}


@dataclass(frozen=True)
class Anatomy:
    """Graph 1's replay time (``graph_us``) and measured chain (``chain_us``, ``depth`` nodes)
    from ``critical_path.measure_step``, and each variant's replay time."""

    graph_us: float
    chain_us: float
    depth: int
    nodes: int
    variants: dict


def anatomy(config, *, replays: int = 100, seed: int = 0) -> Anatomy:
    """Graph 1 of the fast step for ``config`` taken apart (module docstring; GPU)."""
    from foxhunt.fast.dataflow import dependency_graph
    from foxhunt.fast.device import driver_event_time
    from foxhunt.fast.graphs import GraphCapture

    measured = measure_step(config, repeats=10, seed=seed).graphs["graph1"]
    trainer = warmed_trainer(config, seed=seed)
    try:
        engine = trainer.engine
        stream, lowering, pool = engine.stream, engine.lowering, engine.pool
        ops = engine.plans["graph1"]
        times = {}
        for name, variant in variant_ops(ops, measured.chain.indices).items():
            capture = GraphCapture(stream)
            try:
                with capture:
                    lowering.enqueue(variant, stream, pool)
                capture.replay()
                times[name] = min(driver_event_time(stream, capture.replay, replays)
                                  for _ in range(5)) * 1e6
            finally:
                capture.close()
        count = len(dependency_graph([ops])[0])
        return Anatomy(measured.graph_us, measured.chain.weight, measured.chain.depth, count, times)
    finally:
        trainer.close()


def format_anatomy(source: str, a: Anatomy) -> str:
    lines = [f"{source}: graph 1 {a.graph_us:.1f} us, {a.nodes} nodes; measured chain "
             f"{a.chain_us:.1f} us over {a.depth} nodes", "  variant         replay (us)"]
    lines += [f"  {name:14s} {us:9.1f}" for name, us in a.variants.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return variant_main(
        __doc__, "graph_anatomy", "core",
        lambda parser: parser.add_argument("--replays", type=int, default=100,
                                           help="replays per timing"),
        lambda config, args, source: format_anatomy(source, anatomy(config, replays=args.replays)),
        argv)


if __name__ == "__main__":
    sys.exit(main())
