"""The fast step's critical path, read statically from its plan (issue 18's performance work;
issue 26 item 3 in its static form).

    python benches/critical_path.py [--preset seed] [--precision bf16] [--chain] [SOURCE ...]
    python benches/critical_path.py --collect [--n-envs 16] [--capacity 50000] [--chain]
    python benches/critical_path.py --measure [--repeats 20] [--top 12] [--chain] [SOURCE ...]

The step is launch/latency bound: every node of a CUDA graph costs a launch and a short run,
and the step takes about as long as its longest chain of dependent nodes, not its node count.
For each step variant (``core``, each second-wave source alone, ``all``: the config overrides
of ``reference.config.source_overrides``) this builds the plan the GPU captures (the upload
graph of staging slot 0, graph 1, graph 2; on the CPU executor's engine, so no GPU is needed),
takes each graph's dependency graph exactly as stream capture makes it
(``fast.dataflow.dependency_graph``: records, branch forks and joins, record/wait events) and
prints, per graph and for the step (the graphs run one after the other):

- ``nodes``: the graph's node count;
- ``depth``: the longest chain of dependent nodes, counted in nodes;
- ``est_us``: the longest chain weighted by the cost model below (``node_cost``), in
  estimated microseconds; with ``--chain``, the records of that chain.

``--collect`` (issue 20): the collection cycle's plan instead (``fast.collector``: the head
graph ``collect`` = the previous cycle's priority update beside the act forward, env step, ring
add and the batch; the trainer's ``graph1`` and ``graph2``), each graph alone and the whole
``cycle`` as captured (one CUDA graph: the three in order); ``--chain`` prints the cycle's
critical chain.

``--measure`` (GPU; issue 26 item 3): the same step variants on the fast trainer, with each
node's MEASURED time in place of the cost model: after two warm-up steps, every node of graph 1
and graph 2 is captured ``--repeats`` times in a row into a CUDA graph of its own and replayed
between CUDA events (``node_us``: the node's time inside a chain of graph nodes, launch gap
included; the least of ``NODE_TIMINGS`` timings of three replays each, so that a host stall
between two replays does not count: one such timing read 58.9 us for a 5.9 us GEMM at N = 16,
session 18). It prints the time of graph 1 and graph 2 replayed back to back, and per graph the replay time of the whole graph (``graph_us``), the longest
chain weighted by the node times (``chain_us``, the time the graph would take if only its
dependencies limited it) and the sum of the node times (``serial_us``, the time with no overlap
at all); ``graph_us`` near ``chain_us`` is a latency-bound graph, near ``serial_us`` one whose
branches do not overlap. Then the ``--top`` slowest nodes and, with ``--chain``, graph 1's
measured critical chain. Repeating a node repeats its writes (an Adam update applied twenty
times): the times are of the kernels, the values they leave are not used. ``--members N``
measures the step of a ``fast.Population`` of N members instead (issue 24: every node runs for
all N members). ``--fused-trunk`` / ``--fused-heads`` / ``--stacked-backward`` (either mode):
the step of ``Trainer(..., fused_trunk=True)`` / ``fused_heads=True`` / ``stacked_backward=True``.
``--node LABEL`` (repeatable, with ``--measure``): the measured nodes of graph 1 and graph 2
labelled LABEL (``node_label``: a kernel's name, ``gemm MxNxK [epilogue]``, ``copy KIND``),
their count, the sum of their times and each time in plan order. Node times repeat to
0.01-0.02 us from one process to the next where a step's time varies by 1-4 us from one trainer
instance to the next (README, session 35), so a kernel's change is compared by its nodes, in
processes run alternately (``PYTHONPATH`` to the base's installed tree for the base).

Cost model (``LAUNCH_US``, ``RUN_US``, ``KERNEL_RUN_US``): ESTIMATES read off the H200 runs of the seed step
(about 1 us to launch a node and 3-6 us to run one), not measurements of these nodes; replace
them with per-node GPU times once the lead has them (``nsys`` / the benches' event times). The
estimate is a chain length, not a step time: it ignores the host enqueue, the GPU's limits on
concurrent kernels and streams, and contention between parallel branches.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from foxhunt.reference.config import PRECISIONS

#: Estimated cost of launching any graph node, microseconds (an estimate: module docstring).
LAUNCH_US = 1.0
#: Estimated run time of a node by kind, microseconds (estimates: module docstring). ``gemm``:
#: a cuBLASLt GEMM of the seed sizes; ``kernel``: one of our kernels (elementwise, a small
#: reduction, a two-phase norm over the parameters); ``copy``: an async memory copy.
RUN_US = {"gemm": 5.0, "kernel": 3.0, "copy": 2.0}
#: Kernels whose run time grows with their size, microseconds from the launch record's
#: arguments (estimates): ``prefix_sum``, ONE block walking ``ceil(n / 8192)`` tiles in turn
#: (each about 2 us: a load, four barriers, a store), on top of the plain kernel's time.
KERNEL_RUN_US = {"prefix_sum": lambda args: RUN_US["kernel"] + 2.0 * -(-int(args["n"]) // 8192)}
#: ``--measure``: timings of a node's graph (three replays each) whose least is its time.
NODE_TIMINGS = 3
#: The graphs of one step, in the order they run.
GRAPHS = ("upload", "graph1", "graph2")


def node_kind(node) -> str:
    """``gemm``, ``kernel`` or ``copy`` (a key of ``RUN_US``)."""
    from foxhunt.fast.records import Copy, Gemm, Launch

    for cls, kind in ((Gemm, "gemm"), (Launch, "kernel"), (Copy, "copy")):
        if isinstance(node, cls):
            return kind
    raise TypeError(f"node {node!r} is not a kernel, GEMM or copy record")


def node_cost(node) -> float:
    """Estimated microseconds of one node: ``LAUNCH_US + RUN_US[node_kind(node)]``, or the
    kernel's ``KERNEL_RUN_US`` entry of its arguments in place of ``RUN_US``."""
    kind = node_kind(node)
    if kind == "kernel" and node.kernel in KERNEL_RUN_US:
        return LAUNCH_US + KERNEL_RUN_US[node.kernel](node.args)
    return LAUNCH_US + RUN_US[kind]


def node_label(node) -> str:
    """A short name of a node: the kernel's name, ``gemm MxNxK epilogue``, ``copy kind``."""
    kind = node_kind(node)
    if kind == "kernel":
        return node.kernel
    if kind == "gemm":
        s = node.spec
        return f"gemm {s.m}x{s.n}x{s.k}" + (f" {s.epilogue}" if s.epilogue else "")
    return f"copy {node.kind}"


@dataclass(frozen=True)
class Chain:
    """The longest weighted chain of a dependency graph: its node indices (first to last), the
    records, and its weight (the sum of the nodes' weights)."""

    indices: tuple[int, ...]
    nodes: tuple
    weight: float

    @property
    def depth(self) -> int:
        return len(self.indices)


def longest_chain(nodes: Sequence, deps: Sequence[frozenset],
                  weight: Callable[[object], float]) -> Chain:
    """The heaviest chain of the DAG whose node ``i`` depends directly on ``deps[i]`` (indices
    below ``i``, as ``dependency_graph`` makes them): ``best[i] = weight(i) + max(best[d] for d
    in deps[i])``, ties broken towards the lower index. An empty graph has an empty chain."""
    best: list[float] = []
    prev: list[int | None] = []
    for i, node in enumerate(nodes):
        if any(d >= i for d in deps[i]):
            raise ValueError(f"node {i} depends on a later node: {sorted(deps[i])}")
        p = max(sorted(deps[i]), key=lambda d: best[d], default=None)
        best.append(weight(node) + (best[p] if p is not None else 0.0))
        prev.append(p)
    if not nodes:
        return Chain((), (), 0.0)
    end = max(range(len(nodes)), key=lambda i: best[i])
    path = []
    while end is not None:
        path.append(end)
        end = prev[end]
    path.reverse()
    return Chain(tuple(path), tuple(nodes[i] for i in path), best[path[-1]])


@dataclass(frozen=True)
class GraphPath:
    """One graph's node count, longest chain in nodes (``depth``) and in estimated
    microseconds (``est_us``, with that chain's records in ``chain``)."""

    nodes: int
    depth: int
    est_us: float
    chain: Chain


def graph_path(ops) -> GraphPath:
    """``GraphPath`` of one graph's records (an ``Ops``), or of a list of them run in order as
    one captured graph."""
    from foxhunt.fast.dataflow import dependency_graph

    nodes, deps = dependency_graph(list(ops) if isinstance(ops, (list, tuple)) else [ops])
    by_count = longest_chain(nodes, deps, lambda _: 1.0)
    by_cost = longest_chain(nodes, deps, node_cost)
    return GraphPath(len(nodes), by_count.depth, by_cost.weight, by_cost)


def step_paths(config, options: Mapping = MappingProxyType({})) -> dict[str, GraphPath]:
    """``{graph: GraphPath}`` of the step plan of ``config`` (``GRAPHS``; the upload graph of
    staging slot 0), built as the CPU executor builds it (``options``: the trainer's
    ``fused_trunk`` / ``fused_heads`` / ``stacked_backward``)."""
    from foxhunt.fast.cpu_executor import CpuEngine

    plans = CpuEngine(config, **options).plans
    graphs = {"upload": plans["upload"][0], "graph1": plans["graph1"], "graph2": plans["graph2"]}
    return {name: graph_path(graphs[name]) for name in GRAPHS}


#: The collection cycle's graphs, in the order they run (``FastCollector.plans["train"]``).
COLLECT_GRAPHS = ("collect", "graph1", "graph2")


def collect_plans(config, *, n_envs: int, capacity: int, seed: int = 0) -> dict:
    """``{graph: Ops}`` of the collection cycle of ``config`` (``COLLECT_GRAPHS``), built as the
    CPU executor builds it (``FastCollector`` on a ``CpuTrainer``) on a synthetic market."""
    from foxhunt.fast.collector import FastCollector
    from foxhunt.fast.cpu_executor import CpuTrainer
    from foxhunt.reference import loop
    from foxhunt.reference.collector import Walks
    from foxhunt.reference.kernels import env as env_kernels
    from foxhunt.reference.market import SyntheticMarket, feature_warmup, market_features

    bars = SyntheticMarket.preset("default", seed=seed, n_bars=1200).generate()
    windows = loop.choose_windows(config.state_dim)
    seg = loop.fold_segments(len(bars), feature_warmup(windows), 1, 0.125, 0.125)[0]
    t0, t_val = seg.train
    tables = env_kernels.market_tables(bars, market_features(bars, windows))
    col = FastCollector(CpuTrainer(config, seed=seed), config, tables,
                        Walks(t_val, t0, t_val - 51, 50), n_envs=n_envs, capacity=capacity,
                        reward_scale=1.0, seed=seed, cycle=0)
    try:
        return dict(zip(COLLECT_GRAPHS, col.plans["train"], strict=True))
    finally:
        col.close()


def collect_paths(config, *, n_envs: int, capacity: int, seed: int = 0) -> dict[str, GraphPath]:
    """``{graph: GraphPath}`` of ``collect_plans`` and ``cycle``: the graphs as the one
    CUDA graph the GPU captures (every node of a graph after every node of the one before)."""
    graphs = collect_plans(config, n_envs=n_envs, capacity=capacity, seed=seed)
    paths = {name: graph_path(ops) for name, ops in graphs.items()}
    paths["cycle"] = graph_path(list(graphs.values()))
    return paths


def format_collect(paths: dict[str, GraphPath]) -> str:
    lines = [f"{'graph':10} {'nodes':>6} {'depth':>6} {'est_us':>8}"]
    for name in (*COLLECT_GRAPHS, "cycle"):
        p = paths[name]
        lines.append(f"{name:10} {p.nodes:>6d} {p.depth:>6d} {p.est_us:>8.1f}")
    return "\n".join(lines)


def variant_config(preset: str, precision: str, source: str):
    from foxhunt.reference.config import DQNConfig, source_overrides

    return DQNConfig.preset(preset, precision=precision, **source_overrides(source))


def table(preset: str, precision: str, sources: Sequence[str],
          options: Mapping = MappingProxyType({})) -> list[dict]:
    """One row per source: per graph ``nodes``, ``depth``, ``est_us``, and the step's sums (the
    graphs run one after the other)."""
    rows = []
    for source in sources:
        paths = step_paths(variant_config(preset, precision, source), options)
        row = {"source": source, "paths": paths}
        for key in ("nodes", "depth", "est_us"):
            row[key] = sum(getattr(p, key) for p in paths.values())
        rows.append(row)
    return rows


#: The graphs ``--measure`` times node by node (the upload graph is one copy).
MEASURED_GRAPHS = ("graph1", "graph2")


@dataclass(frozen=True)
class MeasuredGraph:
    """One graph's replay time, its critical chain under the measured node times, the sum of
    those times, and each node's time (``us[i]`` for node ``i`` of ``dependency_graph``)."""

    graph_us: float
    chain: Chain
    serial_us: float
    nodes: tuple
    us: tuple[float, ...]


@dataclass(frozen=True)
class MeasuredStep:
    """``graphs``: ``{graph: MeasuredGraph}`` (``MEASURED_GRAPHS``); ``pair_us``: graph 1 then
    graph 2 replayed back to back, per pair (the step without its upload and host side);
    ``merged_us``: graph 1's and graph 2's records captured into ONE graph, per replay (what
    the step would take with no graph boundary between them)."""

    graphs: dict
    pair_us: float
    merged_us: float


def warmed_trainer(config, *, seed: int = 0, members: int = 0, gemm_workspace: str = "none",
                   options: Mapping = MappingProxyType({})):
    """A fast ``Trainer`` for ``config`` (``members`` > 0: a ``fast.Population`` of that many
    members, seeds ``seed`` ..; ``options``: the trainer's, one trainer only) after
    two steps on random batches, its GPU idle: its graphs are captured and warm. The caller
    closes it."""
    import numpy as np

    from foxhunt.fast.trainer import Trainer
    from foxhunt.reference.batch import Batch

    rng = np.random.default_rng(seed)
    if members:
        from foxhunt.fast.population import Population

        trainer = Population(config, range(seed, seed + members), gemm_workspace=gemm_workspace)
        step = lambda: trainer.step([Batch.random(config, rng) for _ in range(members)])  # noqa: E731
    else:
        trainer = Trainer(config, seed=seed, gemm_workspace=gemm_workspace, **options)
        step = lambda: trainer.step(Batch.random(config, rng))  # noqa: E731
    try:
        for _ in range(2):
            step()
        trainer.engine.synchronize()
    except BaseException:
        trainer.close()
        raise
    return trainer


def measure_step(config, *, repeats: int = 20, replays: int = 50, seed: int = 0,
                 gemm_workspace: str = "none", members: int = 0,
                 options: Mapping = MappingProxyType({})) -> MeasuredStep:
    """The fast trainer's step for ``config`` measured on the GPU (module docstring,
    ``--measure``); ``gemm_workspace`` is the trainer's; ``members`` > 0: the step of a
    ``fast.Population`` of that many members (seeds ``seed`` ..) instead."""
    from foxhunt.fast.dataflow import dependency_graph
    from foxhunt.fast.device import driver_event_time
    from foxhunt.fast.graphs import GraphCapture

    trainer = warmed_trainer(config, seed=seed, members=members, gemm_workspace=gemm_workspace,
                             options=options)
    captured = {}
    try:
        engine = trainer.engine
        stream, lowering = engine.stream, engine.lowering
        for name in MEASURED_GRAPHS:
            captured[name] = engine.capture_plans([name])
        out = {}
        for name in MEASURED_GRAPHS:
            graph_us = driver_event_time(stream, captured[name].replay, replays) * 1e6
            nodes, deps = dependency_graph([engine.plans[name]])
            us = []
            for node in nodes:
                single = _OneNode(node)
                capture = GraphCapture(stream, max_branches=0)
                try:
                    with capture:
                        for _ in range(repeats):
                            lowering.enqueue(single, stream)
                    capture.replay()
                    us.append(min(driver_event_time(stream, capture.replay, 3)
                                  for _ in range(NODE_TIMINGS)) * 1e6 / repeats)
                finally:
                    capture.close()
            chain = longest_chain(nodes, deps, lambda n, t=dict(zip(map(id, nodes), us)): t[id(n)])
            out[name] = MeasuredGraph(graph_us, chain, sum(us), tuple(nodes), tuple(us))

        def pair() -> None:
            captured["graph1"].replay()
            captured["graph2"].replay()

        merged = engine.capture_plans(MEASURED_GRAPHS)
        try:
            merged.replay()
            merged_us = driver_event_time(stream, merged.replay, replays) * 1e6
        finally:
            merged.close()
        return MeasuredStep(out, driver_event_time(stream, pair, replays) * 1e6, merged_us)
    finally:
        for graph in captured.values():
            graph.close()
        trainer.close()


class _OneNode:
    """The ``Ops`` face ``Lowering.enqueue`` reads (``items``) of one record."""

    def __init__(self, node):
        self.items = (node,)


def format_measured(source: str, step: MeasuredStep, *, top: int, chain: bool) -> str:
    graphs = step.graphs
    lines = [f"{source}: {'graph':7} {'nodes':>6} {'graph_us':>9} {'chain_us':>9} {'depth':>6} "
             f"{'serial_us':>10}"]
    for name, m in graphs.items():
        lines.append(f"{'':{len(source) + 1}} {name:7} {len(m.nodes):>6d} {m.graph_us:>9.1f} "
                     f"{m.chain.weight:>9.1f} {m.chain.depth:>6d} {m.serial_us:>10.1f}")
    lines.append(f"{'':{len(source) + 1}} graph 1 then graph 2, back to back: {step.pair_us:.1f} us; "
                 f"as one graph: {step.merged_us:.1f} us")
    for name, g in graphs.items():
        on_chain = set(g.chain.indices)
        lines.append(f"  {name}'s {top} slowest nodes (us; * = on the measured critical chain)")
        for i in sorted(range(len(g.nodes)), key=lambda i: -g.us[i])[:top]:
            lines.append(f"    {g.us[i]:7.2f} {'*' if i in on_chain else ' '} {node_label(g.nodes[i])}")
    for name, g in graphs.items():
        kinds: dict[str, float] = {}
        for node, us in zip(g.nodes, g.us):
            kind = node_kind(node)
            kinds[kind] = kinds.get(kind, 0.0) + us
        lines.append(f"  {name}'s node times by kind (us): " + ", ".join(
            f"{kind} {total:.1f}" for kind, total in sorted(kinds.items())))
    g1 = graphs["graph1"]
    if chain:
        lines.append("  graph 1's measured critical chain (node us, cumulative us)")
        total = 0.0
        for i in g1.chain.indices:
            total += g1.us[i]
            lines.append(f"    {g1.us[i]:7.2f} {total:8.1f}  {node_label(g1.nodes[i])}")
    return "\n".join(lines)


def format_nodes(step: MeasuredStep, labels: Sequence[str]) -> str:
    """``--node``: per label, the measured nodes of every graph of ``step`` whose ``node_label``
    is that label, in plan order: their count, the sum of their times and each time."""
    lines = []
    for label in labels:
        us = [t for g in step.graphs.values() for node, t in zip(g.nodes, g.us)
              if node_label(node) == label]
        if us:
            lines.append(f"  nodes {label!r}: {len(us)}, {sum(us):.2f} us in all: "
                         + " ".join(f"{t:.2f}" for t in us))
        else:
            lines.append(f"  nodes {label!r}: none in this step")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    head = f"{'source':8} {'step nodes':>10} {'depth':>6} {'est_us':>7}   " + "   ".join(
        f"{g + ' nodes/depth/us':>24}" for g in GRAPHS)
    lines = [head]
    for row in rows:
        per = "   ".join(f"{p.nodes:>10d} {p.depth:>4d} {p.est_us:>8.1f}"
                         for p in (row["paths"][g] for g in GRAPHS))
        lines.append(f"{row['source']:8} {row['nodes']:>10d} {row['depth']:>6d} "
                     f"{row['est_us']:>7.1f}   {per}")
    return "\n".join(lines)


def format_chain(path: GraphPath) -> str:
    out, total = [], 0.0
    for node in path.chain.nodes:
        total += node_cost(node)
        out.append(f"    {total:7.1f}  {node_label(node)}")
    return "\n".join(out)


def variant_parser(description: str, default: str) -> tuple[argparse.ArgumentParser, tuple]:
    """The command line the step-variant benches share (SOURCE ..., --preset, --precision) and
    the variants' names; ``default`` says what no SOURCE means."""
    from foxhunt.reference.config import SECOND_WAVE_SOURCES

    choices = ("core", *SECOND_WAVE_SOURCES, "all")
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("sources", nargs="*", metavar="SOURCE",
                        help=f"step variants of {choices} (default: {default})")
    parser.add_argument("--preset", default="seed")
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS)
    return parser, choices


def parse_gpu_variants(parser: argparse.ArgumentParser, choices: Sequence[str],
                       argv: Sequence[str] | None, tool: str):
    """``parser``'s arguments for a GPU bench of step variants: an unknown SOURCE is a usage
    error; None where there is no CUDA device (``tool`` says why on stderr)."""
    args = parser.parse_args(argv)
    bad = [s for s in args.sources if s not in choices]
    if bad:
        parser.error(f"SOURCE {bad[0]!r} is not one of {tuple(choices)}")
    from foxhunt.fast.device import cuda_available

    ok, reason = cuda_available()
    if not ok:
        print(f"{tool}: no CUDA device ({reason})", file=sys.stderr)
        return None
    return args


def variant_main(doc: str, tool: str, default: str, add_options: Callable, report: Callable,
                 argv: Sequence[str] | None = None) -> int:
    """The ``main`` of a GPU bench over step variants (``graph_anatomy``, ``node_ablation``,
    ``step_host``): ``variant_parser``'s command line (``doc``'s first line as its description,
    ``default`` the variant no SOURCE means) with ``add_options(parser)``'s options, then for
    each SOURCE ``report(config, args, source)``'s text printed. 2 where there is no CUDA device
    (``tool`` says why on stderr)."""
    parser, choices = variant_parser(doc.splitlines()[0], default)
    add_options(parser)
    args = parse_gpu_variants(parser, choices, argv, tool)
    if args is None:
        return 2
    for source in args.sources or (default,):
        print(report(variant_config(args.preset, args.precision, source), args, source),
              flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser, choices = variant_parser(__doc__.splitlines()[0], "all of them")
    parser.add_argument("--chain", action="store_true",
                        help="print graph 1's critical chain of each variant (with --collect: "
                             "the cycle's)")
    parser.add_argument("--collect", action="store_true",
                        help="the collection cycle's plan (issue 20) instead of the step variants")
    parser.add_argument("--measure", action="store_true",
                        help="GPU: each node's measured time in place of the cost model")
    parser.add_argument("--repeats", type=int, default=20, help="--measure: node repeats per graph")
    parser.add_argument("--gemm-workspace", default="none", choices=("none", "default"),
                        help="--measure: the trainer's cuBLASLt workspace policy")
    parser.add_argument("--top", type=int, default=12, help="--measure: slowest nodes listed")
    parser.add_argument("--node", action="append", default=[], metavar="LABEL",
                        help="--measure: the times of the nodes labelled LABEL (a kernel's name, "
                             "'gemm MxNxK ...'; repeatable)")
    parser.add_argument("--members", type=int, default=0,
                        help="--measure: a fast.Population of this many members (0: one trainer)")
    parser.add_argument("--fused-trunk", action="store_true",
                        help="the step with Trainer(..., fused_trunk=True): bf16, one trainer")
    parser.add_argument("--fused-heads", action="store_true",
                        help="the step with Trainer(..., fused_heads=True): bf16, one trainer")
    parser.add_argument("--stacked-backward", action="store_true",
                        help="the step with Trainer(..., stacked_backward=True): one trainer")
    parser.add_argument("--n-envs", type=int, default=16, help="--collect: environments")
    parser.add_argument("--capacity", type=int, default=50_000, help="--collect: ring rows")
    args = parser.parse_args(argv)
    if args.collect:
        if args.sources:
            parser.error("--collect takes no SOURCE (it builds the core step's cycle)")
        paths = collect_paths(variant_config(args.preset, args.precision, "core"),
                              n_envs=args.n_envs, capacity=args.capacity)
        print(f"collection cycle, preset {args.preset}, {args.precision}, {args.n_envs} envs, "
              f"ring of {args.capacity} (est_us: LAUNCH_US={LAUNCH_US} + RUN_US={RUN_US} per "
              f"node, KERNEL_RUN_US for {sorted(KERNEL_RUN_US)}; estimates)")
        print(format_collect(paths))
        if args.chain:
            print("\nthe cycle's critical chain (cumulative est. us)")
            print(format_chain(paths["cycle"]))
        return 0
    bad = [s for s in args.sources if s not in choices]
    if bad:
        parser.error(f"SOURCE {bad[0]!r} is not one of {choices}")
    for flag, on in (("--fused-trunk", args.fused_trunk), ("--fused-heads", args.fused_heads)):
        if on and args.members:
            parser.error(f"{flag}: a population keeps its forward nodes (--members 0)")
        if on and args.precision != "bf16":
            parser.error(f"{flag}: the fused kernel is bf16 only (--precision {args.precision})")
    if args.node and not args.measure:
        parser.error(f"--node {args.node[0]!r}: node times need --measure (a GPU)")
    if args.stacked_backward and args.members:
        parser.error("--stacked-backward: a population keeps a backward pass per loss (--members 0)")
    options = {"fused_trunk": args.fused_trunk, "fused_heads": args.fused_heads,
               "stacked_backward": args.stacked_backward}
    if args.measure:
        for source in args.sources or choices:
            step = measure_step(variant_config(args.preset, args.precision, source),
                                repeats=args.repeats, gemm_workspace=args.gemm_workspace,
                                members=args.members, options=options)
            print(format_measured(source, step, top=args.top, chain=args.chain), flush=True)
            if args.node:
                print(format_nodes(step, args.node), flush=True)
        return 0
    rows = table(args.preset, args.precision, args.sources or choices, options)
    print(f"critical path, preset {args.preset}, {args.precision} (est_us: LAUNCH_US={LAUNCH_US} "
          f"+ RUN_US={RUN_US} per node, estimates)")
    print(format_table(rows))
    if args.chain:
        for row in rows:
            print(f"\n{row['source']}: graph 1's critical chain (cumulative est. us)")
            print(format_chain(row["paths"]["graph1"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
