"""CUDA graphs by stream capture: capture once, instantiate, upload, replay every step.

    with GraphCapture(device.stream) as graph:
        kernel.launch(grid, block, ..., stream=device.stream)
        plan.run(a, b, c, stream=device.stream)
        with graph.branch() as side:          # a parallel branch (fork/join by events)
            other.launch(grid, block, ..., stream=side)
    graph.replay()                            # one cuGraphLaunch; no host round trip

Everything enqueued on the capture stream between enter and exit becomes a node (kernel
launches, cuBLASLt matmuls, async copies from pinned memory, memsets); nothing runs during
capture. Capture mode is thread-local: a call that is illegal during capture on this thread
(``cuMemAlloc``, a synchronous copy, a stream sync) fails instead of silently breaking the
graph, which is how "no allocation, no sync inside a step" is enforced. If the ``with`` body
raises, the capture is ended and discarded and the exception propagates; the stream is usable
again. Pointers and scalars are baked in at capture: replay reads the same buffers every time.

Host memory a graph copies to or from is baked in too, as a raw address: ``graph.hold(*arrays)``
makes the graph keep those (page-locked) arrays alive until ``close()``, and ``close()`` first
waits for the graph's last launch, so the DMA of a launch in flight never lands in host memory
that has been freed (and perhaps reused by the Python heap) in the meantime. To know when a
launch is done, ``replay`` records an event after it; a graph that records an event itself as
its last node (an external event record node, ``CU_EVENT_RECORD_EXTERNAL``, captured at the end
of its body) passes that event, ``graph.hold(*arrays, launch_event=event)``, and ``replay`` then
makes one driver call, the launch (the step's upload graphs: ``fast.gpu_engine``).
"""

from __future__ import annotations

import contextlib
from collections import Counter

from foxhunt.fast.device import (CudaError, Stream, _driver, _error_text, as_stream_handle, call,
                                 capture_begins, capture_ends)


def graph_nodes(graph) -> list:
    """The nodes of a ``CUgraph``."""
    drv = _driver()
    _, count = call(drv.cuGraphGetNodes, graph, 0)
    if not count:
        return []
    nodes, _ = call(drv.cuGraphGetNodes, graph, count)
    return list(nodes)


def count_nodes(graph) -> int:
    """Number of nodes in a ``CUgraph``."""
    return len(graph_nodes(graph))


def node_types(graph) -> Counter:
    """``Counter`` of node kinds (``"KERNEL"``, ``"MEMCPY"``, ``"MEMSET"``, ...) in a graph."""
    drv = _driver()
    kinds = Counter()
    for node in graph_nodes(graph):
        kind = call(drv.cuGraphNodeGetType, node)
        kinds[kind.name.removeprefix("CU_GRAPH_NODE_TYPE_")] += 1
    return kinds


def graph_edges(graph) -> list[tuple]:
    """The dependency edges ``(from, to)`` of a ``CUgraph``."""
    drv = _driver()
    out = call(drv.cuGraphGetEdges, graph, 0)
    count = out[-1]
    if not count:
        return []
    out = call(drv.cuGraphGetEdges, graph, count)
    return list(zip(out[0][:count], out[1][:count]))


def capture_frontier(handle) -> tuple:
    """The graph nodes that the next node captured on the capturing stream ``handle`` will
    depend on (``cuStreamGetCaptureInfo``'s dependency set)."""
    drv = _driver()
    info = call(drv.cuStreamGetCaptureInfo, handle)
    nodes = next(v for v in info if isinstance(v, (list, tuple)))
    return tuple(nodes[:info[-1]])


def set_capture_frontier(handle, nodes) -> None:
    """Make ``nodes`` (graph nodes of the capture) the whole dependency set of the capturing
    stream ``handle``: its next captured node depends on them and nothing else
    (``cuStreamUpdateCaptureDependencies`` with ``CU_STREAM_SET_CAPTURE_DEPENDENCIES``; plain
    edges)."""
    drv = _driver()
    nodes = list(nodes)
    if not nodes:
        raise ValueError("set_capture_frontier: no nodes (a captured node needs a dependency)")
    flag = drv.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES.value
    call(drv.cuStreamUpdateCaptureDependencies, handle, nodes, None, len(nodes), flag)


def priority_ranks(keys, edges, levels: int, groups=None) -> dict:
    """``{key: rank}`` for a DAG of nodes ``keys`` with dependency edges ``(from, to)``: rank 0
    (the highest priority) to ``levels - 1``, by the longest chain of nodes from the node to
    the graph's end (its ``bottom`` level, the node included) against the graph's depth D:
    ``rank = (D - bottom) * levels // D``, capped at ``levels - 1``. The nodes that start the
    longest chains get the highest priority; a node near the end of every chain the lowest
    (list scheduling's highest-level-first rule).

    ``groups`` (optional): collections of keys that partition ``keys``; each group is then
    ranked on its own, as a graph of its nodes and the edges between them (its own depth), so
    the parts of one graph get the ranks they would have as graphs of their own."""
    keys = list(keys)
    if groups is not None:
        groups = [list(g) for g in groups]
        grouped = [k for g in groups for k in g]
        if len(grouped) != len(set(grouped)) or set(grouped) != set(keys):
            raise ValueError(f"priority_ranks: groups must partition the {len(keys)} keys "
                             f"(got {len(grouped)} keys in {len(groups)} groups, "
                             f"{len(set(grouped))} distinct)")
        group_of = {k: i for i, g in enumerate(groups) for k in g}
        ranks: dict = {}
        for i, g in enumerate(groups):
            ranks.update(priority_ranks(g, [(a, b) for a, b in edges
                                            if group_of[a] == i and group_of[b] == i], levels))
        return ranks
    succ: dict = {k: [] for k in keys}
    indeg = dict.fromkeys(keys, 0)
    for a, b in edges:
        succ[a].append(b)
        indeg[b] += 1
    order, ready = [], [k for k in keys if indeg[k] == 0]
    while ready:
        k = ready.pop()
        order.append(k)
        for s in succ[k]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    if len(order) != len(keys):
        raise ValueError("priority_ranks: the graph has a cycle")
    bottom: dict = {}
    for k in reversed(order):
        bottom[k] = 1 + max((bottom[s] for s in succ[k]), default=0)
    depth = max(bottom.values(), default=1)
    return {k: min(levels - 1, (depth - bottom[k]) * levels // depth) for k in keys}


def set_node_priorities(graph, groups=None) -> int:
    """Give every kernel node of ``graph`` a launch priority (``CU_LAUNCH_ATTRIBUTE_PRIORITY``)
    from ``priority_ranks`` over the context's priority range (greatest = rank 0); the graph
    must then be instantiated with ``CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY``. Returns
    the number of kernel nodes set (cuBLASLt's kernels included). ``groups``: ``priority_ranks``'
    groups, as collections of ``int(node)`` that partition the graph's nodes.

    Why: a step graph's branches contend for the SMs, and the block scheduler otherwise serves
    ready kernels in no particular order, so a side branch can hold the SMs while the longest
    chain waits. Measured on the H200 (seed preset, bf16, issue 18, interleaved runs of the
    step bench): every second-wave source 216.3 / 214.7 us without priorities, 209.3 / 210.5
    us with them; the core step 136.8 / 135.6 against 134.1 / 133.9 us."""
    drv = _driver()
    least, greatest = call(drv.cuCtxGetStreamPriorityRange)
    nodes = graph_nodes(graph)
    ranks = priority_ranks([int(n) for n in nodes],
                           [(int(a), int(b)) for a, b in graph_edges(graph)], least - greatest + 1,
                           groups)
    kernel = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
    attr = drv.CUkernelNodeAttrID.CU_LAUNCH_ATTRIBUTE_PRIORITY
    count = 0
    for node in nodes:
        if call(drv.cuGraphNodeGetType, node) != kernel:
            continue
        value = drv.CUkernelNodeAttrValue()
        value.priority = greatest + ranks[int(node)]
        call(drv.cuGraphKernelNodeSetAttribute, node, attr, value)
        count += 1
    return count


class GraphCapture:
    """Context manager capturing the work enqueued on ``stream`` into a CUDA graph.

    After a clean exit: ``graph`` (``CUgraph``), ``exec`` (``CUgraphExec``, already uploaded),
    ``node_count``, ``node_types()``; ``replay(stream=None)`` launches it (on the capture
    stream by default). ``branch()`` forks a side stream off the capture stream and joins it
    back, making parallel graph branches; ``max_branches`` side streams are created up front.
    ``node_priority`` (default on): before instantiation every kernel node gets a launch
    priority by how long a chain of nodes still follows it (``set_node_priorities``), so the
    GPU serves the longest chains first when branches compete for the SMs;
    ``priority_group()`` inside the body ends a group of nodes ranked on its own.
    """

    def __init__(self, stream, *, max_branches: int = 4, node_priority: bool = True):
        drv = _driver()
        #: Kernel nodes get launch priorities by their graph level (``set_node_priorities``).
        self.node_priority = bool(node_priority)
        self.priority_nodes = 0
        #: ``priority_group()``'s groups of ``int(node)`` (the last one: the nodes after them).
        self.priority_groups: list[frozenset] = []
        self.stream = stream if isinstance(stream, Stream) else Stream(as_stream_handle(stream), owned=False)
        self.graph = None
        self.exec = None
        flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING.value
        self._side = [Stream(call(drv.cuStreamCreate, flags)) for _ in range(max_branches)]
        no_timing = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING.value
        self._events = [(call(drv.cuEventCreate, no_timing), call(drv.cuEventCreate, no_timing))
                        for _ in range(max_branches)]
        self._free = list(range(max_branches))
        self._capturing = False
        # Host buffers the graph's copies use (``hold``), and an event recorded after each
        # launch while there are any (by ``replay``, or by the graph's own last node: then
        # ``_records_itself``, and the caller owns the event): ``close`` waits for it before
        # letting them go.
        self._held: list = []
        self._launched = None
        self._records_itself = False
        self._launch_pending = False

    def __enter__(self) -> GraphCapture:
        if self.graph is not None:
            raise RuntimeError("this GraphCapture already holds a graph; make a new one")
        drv = _driver()
        call(drv.cuStreamBeginCapture, self.stream.handle,
             drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        self._capturing = True
        capture_begins()  # finalizers' frees wait for the capture's end (device.release)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        drv = _driver()
        self._capturing = False
        result = drv.cuStreamEndCapture(self.stream.handle)
        capture_ends()
        err, graph = result[0], result[1]
        if exc_type is not None:
            if err == drv.CUresult.CUDA_SUCCESS and graph is not None:
                drv.cuGraphDestroy(graph)
            return False  # propagate the body's exception
        if err != drv.CUresult.CUDA_SUCCESS:
            raise CudaError(f"cuStreamEndCapture failed with {_error_text(drv, err)} (an operation "
                            "illegal during capture, e.g. an allocation or a sync, was called)")
        self.graph = graph
        flags = 0
        if self.priority_groups:
            rest = frozenset(int(n) for n in graph_nodes(graph)).difference(*self.priority_groups)
            self.priority_groups.append(rest)
        if self.node_priority:
            self.priority_nodes = set_node_priorities(graph, self.priority_groups or None)
            flags = drv.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY.value
        self.exec = call(drv.cuGraphInstantiate, graph, flags)
        call(drv.cuGraphUpload, self.exec, self.stream.handle)
        return False

    @contextlib.contextmanager
    def branch(self):
        """Yield a side ``Stream`` that depends on everything enqueued on the capture stream
        so far; on exit the capture stream waits for it (fork/join). Works eagerly too."""
        if not self._free:
            raise RuntimeError(f"all {len(self._side)} branch streams are in use; raise max_branches")
        index = self._free.pop()
        side, (fork, join) = self._side[index], self._events[index]
        drv = _driver()
        try:
            call(drv.cuEventRecord, fork, self.stream.handle)
            call(drv.cuStreamWaitEvent, side.handle, fork, 0)
            yield side
            call(drv.cuEventRecord, join, side.handle)
            call(drv.cuStreamWaitEvent, self.stream.handle, join, 0)
        finally:
            self._free.append(index)

    def _graph_so_far(self, caller: str):
        """The ``CUgraph`` being captured (only inside the ``with`` body)."""
        if not self._capturing:
            raise RuntimeError(f"{caller}: only during the capture")
        drv = _driver()
        info = call(drv.cuStreamGetCaptureInfo, self.stream.handle)
        return next(v for v in info if isinstance(v, drv.CUgraph))

    def nodes_so_far(self) -> int:
        """Nodes captured so far (inside the ``with`` body: the graph being built)."""
        return count_nodes(self._graph_so_far("nodes_so_far"))

    def priority_group(self) -> None:
        """Inside the body: the nodes captured so far and in no earlier group form a group that
        ``set_node_priorities`` ranks on its own (``priority_ranks``' groups), as would a graph
        of its own; the nodes captured after the last call form the last group."""
        nodes = graph_nodes(self._graph_so_far("priority_group"))
        self.priority_groups.append(frozenset(int(n) for n in nodes).difference(*self.priority_groups))

    def hold(self, *objects, launch_event=None) -> None:
        """Keep ``objects`` (the host arrays the graph's copies read or write) alive until
        ``close()``, which waits for the last launch first. Not during a capture.

        ``launch_event``: an event the graph records itself, every launch, as its last node (an
        external event record node captured at the end of its body); ``replay`` then records
        none, and ``close`` waits on this one (the caller's: it destroys it, after ``close``).
        Given once, before any other ``hold``."""
        if self._capturing:
            raise RuntimeError("hold: call it after the capture (an event is created here)")
        if launch_event is not None:
            if self._launched is not None:
                raise RuntimeError("hold: launch_event must come with the first hold (this graph "
                                   "already has its launch event)")
            self._launched, self._records_itself = launch_event, True
        elif objects and self._launched is None:
            drv = _driver()
            self._launched = call(drv.cuEventCreate, drv.CUevent_flags.CU_EVENT_DISABLE_TIMING.value)
        self._held.extend(objects)

    def replay(self, stream=None) -> None:
        if self.exec is None:
            raise RuntimeError("nothing to replay: the capture has not completed")
        handle = self.stream.handle if stream is None else as_stream_handle(stream)
        call(_driver().cuGraphLaunch, self.exec, handle)
        if self._held:  # the launch that close() must see finished before the memory goes
            if not self._records_itself:
                call(_driver().cuEventRecord, self._launched, handle)
            self._launch_pending = True

    @property
    def node_count(self) -> int:
        if self.graph is None:
            raise RuntimeError("no graph: the capture has not completed")
        return count_nodes(self.graph)

    def node_types(self) -> Counter:
        if self.graph is None:
            raise RuntimeError("no graph: the capture has not completed")
        return node_types(self.graph)

    def close(self) -> None:
        """Destroy the graph, its executable, the branch streams and events; the host buffers
        it holds are let go only after its last launch has finished."""
        drv = _driver()
        if self._launched is not None:
            if self._launch_pending:
                from foxhunt.fast.device import SYNCS

                done = drv.cuEventQuery(self._launched)
                if (done[0] if isinstance(done, tuple) else done) != drv.CUresult.CUDA_SUCCESS:
                    SYNCS.note()
                    call(drv.cuEventSynchronize, self._launched)
                self._launch_pending = False
            if not self._records_itself:
                drv.cuEventDestroy(self._launched)
            self._launched = None
        self._held = []
        if self.exec is not None:
            drv.cuGraphExecDestroy(self.exec)
            self.exec = None
        if self.graph is not None:
            drv.cuGraphDestroy(self.graph)
            self.graph = None
        for side in self._side:
            side.close()
        for fork, join in self._events:
            drv.cuEventDestroy(fork)
            drv.cuEventDestroy(join)
        self._side, self._events, self._free = [], [], []


__all__ = ["GraphCapture", "count_nodes", "graph_edges", "graph_nodes", "node_types", "priority_ranks",
           "set_node_priorities"]
