"""The dependency graph of a plan and its data-flow check (both executors share them).

``dependency_graph(graphs)``: the records of the graphs, in walk order, and each one's direct
dependencies, exactly as stream capture makes the edges of a CUDA graph (the CPU executor runs
this graph; the GPU engine's capture builds the same). ``check_dataflow(graphs, role, preset)``:
every scratch region a record reads was written by a record it depends on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from foxhunt.fast.records import Ops, Parallel, PlanError, Record, Wait


def dependency_graph(graphs: list[Ops]) -> tuple[list, list[frozenset]]:
    """The nodes (kernel, GEMM and copy records) of ``graphs`` run one after the other, and
    each node's direct dependencies (indices), exactly as stream capture makes them: a node
    depends on its stream's frontier; ``parallel`` forks every side from the current frontier
    and joins all of them afterwards; ``wait`` adds the frontier ``record`` saw. Every node of
    a graph depends on every node of the graphs before it. An event recorded twice, or waited
    on before it is recorded, raises ``PlanError``."""
    nodes: list = []
    deps: list[frozenset] = []

    def walk(ops: Ops, frontier: frozenset, events: dict) -> frozenset:
        for it in ops.items:
            if isinstance(it, Parallel):
                ends = [walk(side, frontier, events) for side in it.sides]
                frontier = frontier.union(walk(it.main, frontier, events), *ends)
            elif isinstance(it, Record):
                if it.event in events:
                    raise PlanError(f"event {it.event!r} recorded twice")
                events[it.event] = frontier
            elif isinstance(it, Wait):
                if it.event not in events:
                    raise PlanError(f"wait on event {it.event!r} before it is recorded")
                frontier = frontier | events[it.event]
            else:
                nodes.append(it)
                deps.append(frontier)
                frontier = frozenset({len(nodes) - 1})
        return frontier

    before: frozenset = frozenset()
    for ops in graphs:
        first = len(nodes)
        walk(ops, before, {})
        before = before | frozenset(range(first, len(nodes)))
    return nodes, deps


def _covered(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether the union of ``spans`` covers ``[start, end)``."""
    reach = start
    for lo, hi in sorted(spans):
        if lo > reach:
            break
        reach = max(reach, hi)
        if reach >= end:
            return True
    return reach >= end


def check_dataflow(graphs: list[Ops], role: Callable[[str], str],
                   preset: Mapping[str, list[tuple[int, int]]] = MappingProxyType({})) -> None:
    """Every scratch region a record of ``graphs`` (run in order) reads was written by a record
    it depends on (``dependency_graph``). State, batch and constant buffers hold values before
    the step, and so do the ``preset`` byte ranges ``{buffer: [(start, end), ...]}`` of scratch
    buffers (bytes no record writes, zero since the arena was made). Raises ``PlanError``
    naming the record that reads what none of its dependencies wrote: an input bound to the
    wrong buffer, or a missing dependency between parallel branches."""
    nodes, deps = dependency_graph(graphs)
    ancestors = _ancestors(deps)
    writes: dict[str, list[tuple[int, int, int]]] = {}
    for i, node in enumerate(nodes):
        anc = ancestors[i]
        for acc in node.accesses:
            if acc.write or acc.nbytes == 0 or role(acc.buffer) != "scratch":
                continue
            spans = [(lo, hi) for j, lo, hi in writes.get(acc.buffer, ()) if anc >> j & 1]
            spans += preset.get(acc.buffer, [])
            if not _covered(spans, acc.start, acc.start + acc.nbytes):
                raise PlanError(f"{acc.what} reads bytes [{acc.start}, {acc.start + acc.nbytes}) "
                                f"of {acc.buffer!r}, which no record it depends on writes ({node})")
        for acc in node.accesses:
            if acc.write and acc.nbytes:
                writes.setdefault(acc.buffer, []).append((i, acc.start, acc.start + acc.nbytes))


def _ancestors(deps: list[frozenset]) -> list[int]:
    """Each node's ancestors (every node it depends on, directly or not) as a bit set."""
    out: list[int] = []
    for direct in deps:
        anc = 0
        for d in direct:
            anc |= out[d] | (1 << d)
        out.append(anc)
    return out


def _overlaps(acc, spans: list[tuple[str, int, int]]) -> bool:
    return any(acc.buffer == name and acc.start < hi and lo < acc.start + acc.nbytes
               for name, lo, hi in spans)


def release_points(writer: Ops, graphs: list[Ops]) -> list[int] | None:
    """Where ``graphs`` (run in order, as one captured graph) are done with what ``writer``
    overwrites: the indices (``dependency_graph(graphs[:1])``'s walk order) of the nodes of
    ``graphs[0]`` that read or write a byte ``writer`` writes, less those another such node
    depends on. Once those nodes are done, no node of the graphs touches those bytes again, so
    the next ``writer`` may run (the step's upload: ``gpu_engine``'s ``graph1_done``, recorded
    after these nodes instead of after graph 1). ``None`` where a later graph touches them (the
    point is then the end of ``graphs[0]``); ``[]`` where no node does."""
    spans = [(acc.buffer, acc.start, acc.start + acc.nbytes)
             for node in writer.nodes() for acc in node.accesses if acc.write and acc.nbytes]
    if any(_overlaps(acc, spans) for ops in graphs[1:] for node in ops.nodes()
           for acc in node.accesses if acc.nbytes):
        return None
    nodes, deps = dependency_graph(graphs[:1])
    users = [i for i, node in enumerate(nodes)
             if any(acc.nbytes and _overlaps(acc, spans) for acc in node.accesses)]
    ancestors = _ancestors(deps)
    covered = 0
    for i in users:
        covered |= ancestors[i]
    return [i for i in users if not covered >> i & 1]


__all__ = ["check_dataflow", "dependency_graph", "release_points"]
