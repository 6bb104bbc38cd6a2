"""How fast the GPU runs a CUDA graph of many small kernels: the step's limit when its longest
chain is not (issue 18's and 26's question), and the head-room a population has (issue 24).

    python benches/graph_throughput.py [--nodes 96] [--widths 1,4,16] [--members 1,16,64]
                                       [--elements 65536]

``critical_path.py --measure`` found the whole-wave step's graph 1 (177 nodes) taking about twice
its longest measured chain, and the core step's (99 nodes) 1.6 times. This bench times graphs
built of one kernel only, ``f32_to_bf16`` over ``--elements`` floats (about the size of one of
the step's activations: 256 rows x 256 units), arranged as ``width`` independent chains of
``nodes / width`` launches each (forked from the capture stream and joined back: the shape of
the step's parallel branches), with ``members`` copies of every launch's blocks along
``gridDim.z`` (the kernel ignores ``blockIdx.z``, so each copy redoes the same work: the work a
population of that many members would add to every launch). Per case: the graph's replay time
between CUDA events (``graph_us``), per node (``us_per_node``), and the time of the same graph
with ONE chain (``width`` 1) of the same nodes for reference.

Reading it: if ``us_per_node`` stays near one value as ``width`` grows, the GPU's front end
(about one node per that many microseconds) bounds a wide graph, not its longest chain; if it
also stays as ``members`` grows, a population's extra work rides for free on the same launches.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be a positive int")
    return values


def graph_case(dev, kernel, x_ptr: int, out_ptr: int, *, nodes: int, width: int, members: int,
               elements: int, replays: int = 50) -> float:
    """Microseconds per replay of a graph of ``nodes`` launches of ``kernel`` (``f32_to_bf16``
    over ``elements``) in ``width`` parallel chains, each launch ``members`` deep in z."""
    from foxhunt.fast.device import driver_event_time
    from foxhunt.fast.graphs import GraphCapture
    from foxhunt.fast.kernels._runtime import FLAT_THREADS, blocks

    grid = (blocks(elements, FLAT_THREADS), 1, members)
    packed = kernel.pack(x_ptr, out_ptr, elements)
    per_chain = [nodes // width + (1 if c < nodes % width else 0) for c in range(width)]
    capture = GraphCapture(dev.stream, max_branches=width)
    try:
        with capture:
            with contextlib.ExitStack() as stack:
                sides = [stack.enter_context(capture.branch()) for _ in range(width)]
                for side, count in zip(sides, per_chain):
                    for _ in range(count):
                        kernel.launch(grid, FLAT_THREADS, packed, stream=side)
        capture.replay()
        return driver_event_time(dev.stream, capture.replay, replays) * 1e6
    finally:
        capture.close()


def run(nodes: int, widths: Sequence[int], members: Sequence[int], elements: int) -> list[dict]:
    """One row per ``(width, members)``: ``graph_us`` and ``us_per_node``."""
    from foxhunt.fast._build import package_module
    from foxhunt.fast.device import Device

    dev = Device(0)
    module = dev.load_module(package_module(dev.arch))
    kernel = module.kernel("f32_to_bf16")
    x, out = dev.alloc(4 * elements), dev.alloc(2 * elements)
    try:
        dev.copy_to_device(x.ptr, __import__("numpy").ones(elements, "float32"))
        rows = []
        for z in members:
            for w in widths:
                us = graph_case(dev, kernel, x.ptr, out.ptr, nodes=nodes, width=w, members=z,
                                elements=elements)
                rows.append({"width": w, "members": z, "graph_us": us, "us_per_node": us / nodes})
        return rows
    finally:
        dev.synchronize()
        x.free()
        out.free()
        module.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=96, help="launches per graph")
    parser.add_argument("--widths", type=_ints, default=[1, 4, 16], help="parallel chains")
    parser.add_argument("--members", type=_ints, default=[1, 16, 64], help="gridDim.z copies")
    parser.add_argument("--elements", type=int, default=65536, help="floats per launch")
    args = parser.parse_args(argv)
    if args.nodes < max(args.widths):
        parser.error(f"--nodes {args.nodes}: at least the largest width ({max(args.widths)})")
    rows = run(args.nodes, args.widths, args.members, args.elements)
    print(f"graph of {args.nodes} f32_to_bf16 launches over {args.elements} floats each")
    print(f"{'members':>8} {'width':>6} {'graph_us':>9} {'us_per_node':>12}")
    for r in rows:
        print(f"{r['members']:>8d} {r['width']:>6d} {r['graph_us']:>9.1f} {r['us_per_node']:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
