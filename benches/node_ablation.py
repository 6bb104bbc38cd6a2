"""What each node of the fast step costs INSIDE its graph: the graph replayed without it.

    python benches/node_ablation.py [--preset seed] [--precision bf16] [--replays 100]
                                    [--top 30] [--members N] [SOURCE ...]

``critical_path.py --measure`` times every node alone (twenty copies in a row) and finds the
longest chain under those times, but a graph of a hundred and more nodes runs far slower than
that chain (issue 18: every source's graph 1 at 169 us against a 94 us chain): its branches
crowd each other, and a node's cost inside the graph is not its time alone. This measures
that cost directly. For each step variant (GPU), after two warm-up steps, graph 1 and graph 2
are captured again from their plans with one node left out (``without``: the records minus
that node; every fork, join and event kept, so the node's dependants wait on its own
dependencies instead) and replayed ``--replays`` times back to back between CUDA events;
``saved_us`` is the captured graph's replay time minus that. Groups are left out the same way:
every GEMM, every kernel launch, every node of one label (a kernel's name, a GEMM's shape). The values the shortened
graphs compute are wrong and not used: these are timings only (a kernel's time does not
depend on its data here; every node's arguments stay valid).

The base time is measured again before every tenth variant; the spread of those base times
is printed, and a ``saved_us`` inside it is noise. A removal can also make the graph SLOWER
(negative ``saved_us``: the block scheduler then serves the branches in another order; seen
on the H200 for the core step, by up to 3 us). ``--members N``: the step of a
``fast.Population`` of N members (issue 24).
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from critical_path import MEASURED_GRAPHS, node_kind, node_label, variant_main, warmed_trainer


def without(ops, drop: Callable[[object], bool]):
    """A copy of ``ops`` (an ``Ops``) whose kernel, GEMM and copy records for which ``drop``
    is true are left out; parallel sections, records and waits are kept as they are (a
    branch may become empty: its fork and join still bind)."""
    from foxhunt.fast.records import NODE_RECORDS, Parallel

    out = ops.branch()
    for it in ops.items:
        if isinstance(it, Parallel):
            out.items.append(Parallel(tuple(without(s, drop) for s in it.sides), without(it.main, drop)))
        elif not (isinstance(it, NODE_RECORDS) and drop(it)):
            out.items.append(it)
    return out


@dataclass(frozen=True)
class Ablation:
    """One graph's base replay times (``base_us``, measured along the way) and its replay time
    without each node (``single``) and without each group (``groups``)."""

    base_us: tuple[float, ...]
    single: tuple[tuple[str, float], ...]  # (node label, us without it), walk order
    groups: tuple[tuple[str, int, float], ...]  # (group, nodes in it, us without them)

    @property
    def base(self) -> float:
        return statistics.median(self.base_us)


def groups_of(nodes: Sequence) -> list[tuple[str, Callable[[object], bool], int]]:
    """``(name, drop, count)``: every GEMM, every kernel launch, and each kernel or GEMM shape
    launched more than once."""
    kinds = Counter(node_kind(n) for n in nodes)
    labels = Counter(node_label(n) for n in nodes)
    out = [(f"every {kind}", lambda n, k=kind: node_kind(n) == k, kinds[kind])
           for kind in ("gemm", "kernel")]
    out += [(f"every {label}", lambda n, lab=label: node_label(n) == lab, count)
            for label, count in sorted(labels.items()) if count > 1]
    return out


def ablate_step(config, *, replays: int = 100, seed: int = 0, members: int = 0) -> dict[str, Ablation]:
    """Graph 1 and graph 2 of the fast step for ``config``, ablated node by node and by group
    (module docstring)."""
    from foxhunt.fast.device import driver_event_time
    from foxhunt.fast.graphs import GraphCapture

    trainer = warmed_trainer(config, seed=seed, members=members)
    captured = {}
    try:
        engine = trainer.engine
        stream, lowering, pool = engine.stream, engine.lowering, engine.pool

        def time_without(ops, drop) -> float:
            capture = GraphCapture(stream)
            try:
                with capture:
                    lowering.enqueue(without(ops, drop), stream, pool)
                capture.replay()
                return driver_event_time(stream, capture.replay, replays) * 1e6
            finally:
                capture.close()

        out = {}
        for name in MEASURED_GRAPHS:
            captured[name] = engine.capture_plans([name])
            ops = engine.plans[name]
            nodes = ops.nodes()
            base: list[float] = []
            groups = groups_of(nodes)
            variants = [(node_label(n), lambda x, n=n: x is n) for n in nodes]
            variants += [(g, drop) for g, drop, _ in groups]
            times = []
            for k, (_, drop) in enumerate(variants):
                if k % 10 == 0:
                    base.append(driver_event_time(stream, captured[name].replay, replays) * 1e6)
                times.append(time_without(ops, drop))
            base.append(driver_event_time(stream, captured[name].replay, replays) * 1e6)
            single = tuple((label, t) for (label, _), t in zip(variants, times[:len(nodes)]))
            group_rows = tuple((g, count, t) for (g, _, count), t in zip(groups, times[len(nodes):]))
            out[name] = Ablation(tuple(base), single, group_rows)
        return out
    finally:
        for graph in captured.values():
            graph.close()
        trainer.close()


def format_ablation(source: str, graphs: dict[str, Ablation], *, top: int) -> str:
    lines = []
    for name, a in graphs.items():
        lo, hi = min(a.base_us), max(a.base_us)
        lines.append(f"{source} {name}: base {a.base:.1f} us (range {lo:.1f}-{hi:.1f} over "
                     f"{len(a.base_us)} measurements), {len(a.single)} nodes")
        lines.append(f"  the {top} nodes whose absence saves the most (saved_us, position, node)")
        ranked = sorted(range(len(a.single)), key=lambda i: a.single[i][1])[:top]
        for i in ranked:
            label, us = a.single[i]
            lines.append(f"    {a.base - us:7.2f}  #{i:<4d} {label}")
        lines.append("  groups left out (saved_us, nodes, group)")
        for g, count, us in sorted(a.groups, key=lambda r: r[2]):
            lines.append(f"    {a.base - us:7.2f}  {count:4d}  {g}")
    return "\n".join(lines)


def _options(parser) -> None:
    parser.add_argument("--replays", type=int, default=100, help="replays per timing")
    parser.add_argument("--top", type=int, default=30, help="nodes listed per graph")
    parser.add_argument("--members", type=int, default=0,
                        help="a fast.Population of this many members (0: one trainer)")


def main(argv: Sequence[str] | None = None) -> int:
    return variant_main(
        __doc__, "node_ablation", "all", _options,
        lambda config, args, source: format_ablation(
            source, ablate_step(config, replays=args.replays, members=args.members), top=args.top),
        argv)


if __name__ == "__main__":
    sys.exit(main())
