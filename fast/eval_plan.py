"""Evaluation plans as records: the ``q_values`` forward, and the greedy walk over a segment.

**The ``q_values`` forward** (``Trainer.q_values``; one graph per row count). ``eval_ops(prog,
evl)``: the states are copied in from host buffer ``x_host`` (pinned on the GPU) into ``x_e``,
the forward runs on the online params with the trainer's ISV (Mech 10 clamp), log-softmax and
expected Q into ``q_e`` (packed per branch), and ``q_e`` is copied out to host buffer
``q_host``: the whole evaluation is one captured graph. Its buffers are those of
``EvalLayout(layout, rows)`` (their own small arena); the side streams of its branches come
from the trainer's pool.

**The walk over a segment** (issue 20, SPEC 10: greedy evaluation on the device). The position
held at a bar depends on the previous action, so a segment is walked bar by bar; the walk stays
on the device and the host reads back once per segment. ``WalkLayout(layout, n_bars=,
n_features=, max_steps=)``: the walk's buffers (their own arena; the forward's activations are
an ``EvalLayout(layout, 1)``): the run's market tables (``walk_close`` ... as
``kernels.env.MarketTables``, uploaded once), the cost table, the baselines' fixed actions
(``walk_fixed``: one row per ``BASELINE_POLICIES`` entry), a zero ``eps`` and cycle counter
(greedy: no draw), one env's state, its state features ``walk_obs`` and the record rows
``walk_rec_*`` ``[max_steps, 1]``. The records, in order:

- ``begin_ops``: the segment's first bar (host buffer ``walk_start_host``) and its flat state's
  features (``walk_obs_host``, the reference ``env_observe`` of a flat state: no ``tanh`` of a
  non-zero value, so exact) copied in, ``env_reset`` at that bar;
- ``bar_ops(policy)``: ONE bar: for ``"greedy"`` the online forward on ``walk_obs`` (the
  trainer's live params and ISV) and ``env_act`` with eps 0 (argmax, lowest index on ties); a
  baseline reads its row of ``walk_fixed``; then ``env_step`` (one env, no auto-reset) writes
  the bar's reward (unscaled), position held and cost at row ``steps`` and the next state's
  features into ``walk_obs``. The host (``fast.evaluator``) captures ``K`` of these in one
  graph and launches it ``ceil(n / K)`` times;
- ``end_ops(n, bars_per_year, equity)``: ``eval_metrics`` of rows ``[0, n)`` (SPEC 10's
  metrics, reduced on the device in float64) copied out to ``walk_metrics_host``, and with
  ``equity`` the ``n`` per-bar rewards to ``walk_rewards_host``: the segment's one readback.

**The fused walk** (``fused_ops``, ``DeviceEvaluator(mode="fused")``): the first bar
(``walk_start_host``) and the step count (``walk_n_steps_host``) are copied in, with
``adaptive_atoms`` the live per-branch support built from the ISV of this moment into ``z_e``
(``support_plan.eval_support``: ``live_support_build``, as the chunk graphs' forward builds
it; the step's ``z_live`` is one step behind), then on sm_90
and newer (where ``kernels.walk.plan_walk`` picks the cluster kernel: the network fits a
cluster's shared memory) ``SPAN_PASSES`` launches of ``greedy_walk_spans`` on ``SPAN_CHUNKS``
thread-block clusters, then ``SPAN_ROUNDS`` launches of ``greedy_walk_round`` on
``SPAN_CHUNKS`` clusters with the spans' buffers as their base; elsewhere ONE launch of
``greedy_walk`` (one block). Both walk the greedy policy over the whole segment with records
bitwise the one-cluster ``greedy_walk_cluster``'s (``cuda_src/walk.cu``, twin
``reference.kernels.walk.greedy_walk``): while the policy holds its position the next states
need no network, so the span launches check the remaining steps in parallel, 16 clusters at
once, and commit up to the first trade; the rounds commit the last span launch's break and cut
what is left into 16 chunks walked in parallel, chunk 0 from that exact state and the others
from a flat guess, each later round rerunning a chunk from its predecessor's end until it
merges with its previous run (a policy that holds: nothing is left, the rounds are no-ops; one
that trades every few bars: two rounds converge; the later ones only compare keys). They read
the online copy of ``params2`` (and of ``mirror2`` in ``bf16``), ``isv`` (Mech 10's bound),
the support (``z`` with ``z_stride = 0``, or ``z_e`` with ``z_stride = NA``: branch d's row),
``n_actions`` and ``action_offset`` of the step layout and the walk's
``walk_param_offsets`` (the tensors' offsets, ``walk.walk_offsets``), keep the spans' base
states and breaks in ``walk_span_state`` / ``walk_span_brk`` and the rounds' keys in
``walk_round_trace`` / ``walk_round_ends``, and write rows ``[0, n)`` of ``walk_rec_*``;
``end_ops`` follows unchanged. The kernels build their own state rows: no ``walk_obs``, no
``env_reset``.

Why one bar graph serves every segment: ``env_step`` walks the whole table (``n_bars = T``), so
the records name no segment. A walk from ``start`` reads bars ``start .. start + n`` for its
``n = stop - start - 1`` recorded steps, exactly as the reference environment on
``bars[:stop]`` does (a step's reward needs bar ``t + 1 <= stop - 1``; ``done`` is never
used: no auto-reset). The bars a last partial chunk walks past the segment land in rows ``>=
n`` (never reduced, never read back) or past ``max_steps`` (not written); at the table's last
bar the env freezes (``kernels.env``: nothing trades, nothing is recorded).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.binder import Binder
from foxhunt.fast.kernels import walk as walk_fast
from foxhunt.fast.kernels.walk import WALK_KERNELS
from foxhunt.fast.records import F32, I32, I64, Buf, Host, Ops, Region
from foxhunt.fast.step_layout import BufferTable, EvalLayout, StepLayout
from foxhunt.fast.step_program import StepProgram
from foxhunt.fast.support_plan import eval_support
from foxhunt.reference.isv import H_S2_RMS_EMA_INDEX
from foxhunt.reference.kernels import env as env_kernels
from foxhunt.reference.kernels import walk as walk_kernels
from foxhunt.reference.kernels.rng import STREAMS
from foxhunt.reference.kernels.walk_rounds import greedy_walk_round
from foxhunt.reference.kernels.walk_spans import greedy_walk_spans_pass
from foxhunt.reference.loop import BASELINE_ACTIONS

#: Host buffers of the ``q_values`` graph.
X_HOST, Q_HOST = "x_host", "q_host"
#: Host buffers of the walk: the first bar and its state in, the metrics and rewards out.
START_HOST, OBS_HOST = "walk_start_host", "walk_obs_host"
#: Host buffer of the fused walk: its step count in.
N_STEPS_HOST = "walk_n_steps_host"
METRICS_HOST, REWARDS_HOST = "walk_metrics_host", "walk_rewards_host"
#: The walk's policies: the greedy one, then the baselines (rows of ``walk_fixed``, in order).
BASELINE_POLICIES = tuple(sorted(BASELINE_ACTIONS))
POLICIES = ("greedy", *BASELINE_POLICIES)
#: The walked env's state: ``(buffer, kernels.env.EnvState field, dtype)``.
WALK_STATE = (("walk_t", "t", I32), ("walk_steps", "steps", I32),
              ("walk_time", "time_in_position", I32), ("walk_position", "position", F32),
              ("walk_entry", "entry_price", F32))
#: The market tables (``kernels.env.MarketTables`` fields) and their buffers.
WALK_TABLES = tuple((f"walk_{name}", name) for name in env_kernels.MarketTables._fields)
#: The env kernels' stream-id parameters the walk passes (no draw is made: eps is 0 and there
#: is no auto-reset; the kernels take the ids all the same).
WALK_STREAMS = {"start_stream": STREAMS["episode_start"], "explore_stream": STREAMS["explore"],
                "action_stream": STREAMS["explore_action"]}
#: No Philox key: the walk draws nothing.
NO_KEY = {"key_lo": 0, "key_hi": 0}


def eval_host_specs(evl: EvalLayout) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The host buffers ``x_host`` (the states, ``[rows, SD]``) and ``q_host`` (the packed Q
    values, as ``q_e``): ``{name: (shape, dtype)}``."""
    return {X_HOST: ((evl.rows, evl.SD), np.dtype(F32)), Q_HOST: (evl.specs["q_e"][0], np.dtype(F32))}


def eval_host_nbytes(evl: EvalLayout) -> dict[str, int]:
    """Bytes of the host buffers of ``eval_host_specs``."""
    return {name: int(np.prod(shape)) * dtype.itemsize
            for name, (shape, dtype) in eval_host_specs(evl).items()}


def eval_ops(prog: StepProgram, evl: EvalLayout) -> Ops:
    ops = Ops(prog.eval_binder(evl, eval_host_nbytes(evl)))
    rows, lay = evl.rows, prog.lay
    ops.copy("x_e", Host(X_HOST), rows * lay.SD * 4, "htod")
    xb = None
    if lay.bf16:
        xb = Buf("xb_e")
        prog.to_bf16(ops, Buf("x_e"), xb, rows * lay.SD)
    prog.forward(ops, tag="e", rows=rows, which=0, x=Buf("x_e"), xb=xb,
                 logits=Buf("logits_e", 0), logp=Buf("logp_e", 0), q=Buf("q_e"))
    ops.copy(Host(Q_HOST), "q_e", eval_host_nbytes(evl)[Q_HOST], "dtoh")
    return ops


# --------------------------------------------------------------------------------------------
# The walk over a segment
# --------------------------------------------------------------------------------------------


class WalkLayout(BufferTable):
    """The walk's buffers (module docstring) for tables of ``n_bars`` bars and ``n_features``
    market features, recording at most ``max_steps`` steps."""

    def __init__(self, layout: StepLayout, *, n_bars: int, n_features: int, max_steps: int):
        super().__init__()
        self.step = layout
        self.n_bars, self.n_features, self.max_steps = int(n_bars), int(n_features), int(max_steps)
        T, SD, nb, R = self.n_bars, layout.SD, layout.nb, self.max_steps
        for buf, name in WALK_TABLES:
            shape = (T, self.n_features) if name == "features" else T
            self._add(buf, shape, I32 if name == "regime" else F32, "constant")
        self._add("walk_costs", len(env_kernels.COST_FIELDS), F32, "constant")
        self._add("walk_fixed", (len(BASELINE_POLICIES), nb), I32, "constant")
        self._add("walk_eps", 1, F32, "constant")
        self._add("walk_cycle", 1, I64, "constant")
        self._add("walk_start", 1, I32)
        self._add("walk_n_steps", 1, I32)
        self._add("walk_param_offsets", len(walk_kernels.walk_tensors(nb)), I32, "constant")
        for buf, _, dtype in WALK_STATE:
            self._add(buf, 1, dtype, "state")
        self._add("walk_obs", (1, SD), F32, "state")
        self._add("walk_actions", (1, nb), I32)
        for name in ("walk_r", "walk_done", "walk_next_ret"):
            self._add(name, 1, F32)
        self._add("walk_regime_out", 1, I32)
        for name in ("walk_rec_reward", "walk_rec_held", "walk_rec_cost"):
            self._add(name, (R, 1), F32, "state")
        self._add("walk_metrics", len(env_kernels.EVAL_FIELDS), F32)
        # greedy_walk_spans' base states and breaks, by launch parity
        self._add("walk_span_state", (2, 5), I32)
        self._add("walk_span_brk", (2, walk_fast.SPAN_CHUNKS, 5), I32)
        # greedy_walk_round's keys: per step, and each chunk's end by round parity
        self._add("walk_round_trace", (R, 3), I32)
        self._add("walk_round_ends", (2, walk_fast.SPAN_CHUNKS, 3), I32)
        clash = sorted(set(self.specs) & set(layout.specs))
        if clash:
            raise AssertionError(f"walk buffers {clash} shadow step buffers")

    def host_specs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """The host buffers: ``{name: (shape, dtype)}``."""
        return {START_HOST: ((1,), I32), N_STEPS_HOST: ((1,), I32),
                OBS_HOST: ((self.step.SD,), F32),
                METRICS_HOST: ((len(env_kernels.EVAL_FIELDS),), F32),
                REWARDS_HOST: ((self.max_steps,), F32)}

    def fixed_actions(self) -> np.ndarray:
        """``walk_fixed``: each baseline's actions (``loop.BASELINE_ACTIONS``, cut to the
        config's branches), one row per ``BASELINE_POLICIES`` entry."""
        nb = self.step.nb
        return np.array([BASELINE_ACTIONS[p][:nb] for p in BASELINE_POLICIES], I32)

    def constants(self) -> dict[str, np.ndarray]:
        """Host values of the walk's own constant tables the binder reads (extents):
        ``walk_param_offsets`` (online copy: offsets from the start of ``params2``)."""
        return {"walk_param_offsets": walk_kernels.walk_offsets(self.step.param_layout,
                                                                self.step.nb)}


def walk_binder(prog: StepProgram, wl: WalkLayout, evl: EvalLayout) -> Binder:
    """Names of the walk's, the forward's and the step's layouts, and the walk's host buffers."""
    def region(buf: Buf) -> Region:
        for table in (wl, evl):
            if buf.name in table:
                return table.region(buf)
        return prog.lay.region(buf)
    host = {name: int(np.prod(shape)) * np.dtype(dtype).itemsize
            for name, (shape, dtype) in wl.host_specs().items()}
    return Binder(region, constants={**prog.constants, **wl.constants()}, host_nbytes=host)


def walk_role(prog: StepProgram, wl: WalkLayout, evl: EvalLayout):
    """The roles ``check_dataflow`` sees for the walk's plans."""
    def role(name: str) -> str:
        for table in (wl, evl):
            if name in table:
                return table.role(name)
        return prog.lay.role(name)
    return role


def begin_ops(ops: Ops, prog: StepProgram, wl: WalkLayout) -> None:
    """The first bar and its state's features in from the host, ``env_reset`` there."""
    SD = prog.lay.SD
    ops.copy("walk_start", Host(START_HOST), 4, "htod")
    ops.copy("walk_obs", Host(OBS_HOST), SD * 4, "htod")
    ops.kernel("env_reset", prog.kernels("env").plan_env_reset(1), start="walk_start", n_envs=1,
               min_start=0, last_start=wl.n_bars - 2, **NO_KEY,
               start_stream=WALK_STREAMS["start_stream"], cycle="walk_cycle",
               **{field: buf for buf, field, _ in WALK_STATE})


def bar_ops(ops: Ops, prog: StepProgram, wl: WalkLayout, policy: str) -> None:
    """One bar of ``policy`` (``POLICIES``): the action, then ``env_step`` (module docstring)."""
    lay = prog.lay
    if policy == "greedy":
        xb = None
        if lay.bf16:
            xb = Buf("xb_e")
            prog.to_bf16(ops, Buf("walk_obs"), xb, lay.SD)
        prog.forward(ops, tag="e", rows=1, which=0, x=Buf("walk_obs"), xb=xb,
                     logits=Buf("logits_e", 0), logp=Buf("logp_e", 0), q=Buf("q_e"))
        ops.kernel("env_act", prog.kernels("env").plan_env_act(1, lay.nb), q="q_e",
                   n_actions="n_actions", action_offset="action_offset", n_branches=lay.nb,
                   n_envs=1, eps="walk_eps", **NO_KEY,
                   explore_stream=WALK_STREAMS["explore_stream"],
                   action_stream=WALK_STREAMS["action_stream"], cycle="walk_cycle",
                   actions="walk_actions")
        actions = Buf("walk_actions")
    elif policy in BASELINE_POLICIES:
        actions = Buf("walk_fixed", offset=BASELINE_POLICIES.index(policy) * lay.nb)
    else:
        raise ValueError(f"policy={policy!r}: allowed values are {', '.join(map(repr, POLICIES))}")
    tables = {name: buf for buf, name in WALK_TABLES}
    ops.kernel("env_step", prog.kernels("env").plan_env_step(1), close=tables["close"],
               high=tables["high"], low=tables["low"], features=tables["features"],
               n_features=wl.n_features, regime=tables["regime"],
               **{field: buf for buf, field, _ in WALK_STATE}, n_envs=1, actions=actions,
               n_branches=lay.nb, rec_reward="walk_rec_reward", rec_held="walk_rec_held",
               rec_cost="walk_rec_cost", record_len=wl.max_steps, costs="walk_costs",
               n_bars=wl.n_bars, min_start=0, last_start=wl.n_bars - 2, episode_len=0,
               auto_reset=0, reward_scale=np.float32(1.0), state_dim=lay.SD, **NO_KEY,
               start_stream=WALK_STREAMS["start_stream"], cycle="walk_cycle", r="walk_r",
               done="walk_done", s2=None, obs="walk_obs", next_ret="walk_next_ret",
               regime_out="walk_regime_out")


def fused_walk_kernel(prog: StepProgram) -> str:
    """The kernel ``fused_ops`` launches for ``prog`` (``walk.plan_walk``: ``greedy_walk_cluster``
    from sm_90 where the network fits a cluster's shared memory, else ``greedy_walk``)."""
    lay = prog.lay
    dims = walk_kernels.walk_dims(prog.config)
    return prog.kernels("walk").plan_walk(dims, lay.branches, lay.bf16, prog.arch)[0]


def fused_ops(ops: Ops, prog: StepProgram, wl: WalkLayout) -> None:
    """The fused walk (module docstring): the first bar and the step count in, the live support
    with ``adaptive_atoms`` (``eval_support``), then where
    ``plan_walk`` picks the cluster kernel ``SPAN_PASSES`` launches of ``greedy_walk_spans`` on
    ``SPAN_CHUNKS`` clusters and ``SPAN_ROUNDS`` launches of ``greedy_walk_round`` on their base
    (bitwise ``greedy_walk_cluster``'s records), else ONE ``greedy_walk``."""
    lay, c = prog.lay, prog.config
    tables = {name: buf for buf, name in WALK_TABLES}
    dims = walk_kernels.walk_dims(c)
    ops.copy("walk_start", Host(START_HOST), 4, "htod")
    ops.copy("walk_n_steps", Host(N_STEPS_HOST), 4, "htod")
    z, z_stride = eval_support(prog, ops)  # adaptive atoms: z_e from the ISV of this moment
    walk = prog.kernels("walk")
    kernel, plan = walk.plan_walk(dims, lay.branches, lay.bf16, prog.arch)
    args = dict(params="params2", params_bf16="mirror2" if lay.bf16 else None,
                param_offsets="walk_param_offsets", bf16=int(lay.bf16),
                **dict(zip(walk_kernels.DIMS, dims)), n_branches=lay.nb, n_actions="n_actions",
                action_offset="action_offset", z=z, z_stride=z_stride, isv="isv",
                isv_index=H_S2_RMS_EMA_INDEX,
                h2_clamp_mult=np.float32(c.h2_clamp_mult), close=tables["close"],
                high=tables["high"], low=tables["low"], features=tables["features"],
                n_features=wl.n_features, costs="walk_costs", n_bars=wl.n_bars,
                start="walk_start", n_steps="walk_n_steps")
    records = dict(rec_reward="walk_rec_reward", rec_held="walk_rec_held",
                   rec_cost="walk_rec_cost", rec_margin=None, record_len=wl.max_steps)
    if kernel != "greedy_walk_cluster":
        ops.kernel(kernel, plan, **args, **records)
        return
    span, _, rows = walk.plan_greedy_walk_spans(dims, lay.branches, lay.bf16, prog.arch,
                                                walk.SPAN_CHUNKS)
    for p in range(walk.SPAN_PASSES):  # (not the tail: the rounds walk what is left)
        ops.kernel("greedy_walk_spans", span, **args, n_chunks=walk.SPAN_CHUNKS,
                   n_passes=walk.SPAN_PASSES, pass_index=p, hold_rows=rows,
                   state="walk_span_state", brk="walk_span_brk", **records)
    chunks = walk.plan_greedy_walk_round(dims, lay.branches, lay.bf16, prog.arch,
                                         walk.SPAN_CHUNKS)
    for r in range(walk.SPAN_ROUNDS):
        ops.kernel("greedy_walk_round", chunks, **args, n_chunks=walk.SPAN_CHUNKS, round=r,
                   span_chunks=walk.SPAN_CHUNKS, span_passes=walk.SPAN_PASSES,
                   span_state="walk_span_state", span_brk="walk_span_brk",
                   trace="walk_round_trace", ends="walk_round_ends", **records)


def end_ops(ops: Ops, prog: StepProgram, wl: WalkLayout, *, n: int, bars_per_year: float,
            equity: bool) -> None:
    """``eval_metrics`` of the first ``n`` rows and the copies out (module docstring)."""
    ops.kernel("eval_metrics", prog.kernels("env").plan_eval_metrics(), rewards="walk_rec_reward",
               positions="walk_rec_held", costs="walk_rec_cost", n=n,
               bars_per_year=np.float64(bars_per_year), out="walk_metrics")
    ops.copy(Host(METRICS_HOST), "walk_metrics", len(env_kernels.EVAL_FIELDS) * 4, "dtoh")
    if equity:
        ops.copy(Host(REWARDS_HOST), "walk_rec_reward", n * 4, "dtoh")


# --------------------------------------------------------------------------------------------
# CPU twins of the launched kernels (foxhunt.fast.cpu_kernels)
# --------------------------------------------------------------------------------------------


def register_twins() -> None:
    """Add the twins of the walk's kernels to ``cpu_kernels.TWINS`` where they are missing:
    ``env_act`` and ``env_step`` come with the collection cycle's (``collect_plan``), and
    ``env_reset`` and ``eval_metrics`` are added here."""
    from foxhunt.fast.collect_plan import register_twins as register_cycle_twins
    from foxhunt.fast.cpu_kernels import TWINS, twin

    register_cycle_twins()
    if "env_reset" not in TWINS:
        state = {field: "n_envs" for _, field, _ in WALK_STATE}

        @twin("env_reset", nullable=("start",), start="n_envs", cycle=1, **state)
        def _env_reset(a):
            if a.start_stream != WALK_STREAMS["start_stream"]:
                raise ValueError(f"start_stream {a.start_stream}: the reference draws from "
                                 f"stream {WALK_STREAMS['start_stream']}")
            key = int(a.key_hi) << 32 | int(a.key_lo)
            return env_kernels.env_reset(a.start, a.n_envs, a.min_start, a.last_start, key,
                                         a.cycle)._asdict()

    if "greedy_walk" not in TWINS:
        for name in (*WALK_KERNELS, "greedy_walk_hold", "greedy_walk_spans", "greedy_walk_round"):
            _register_greedy_walk(twin, name)

    if "eval_metrics" not in TWINS:
        @twin("eval_metrics", rewards="n", positions="n", costs="n",
              out=len(env_kernels.EVAL_FIELDS))
        def _eval_metrics(a):
            return {"out": env_kernels.eval_metrics(a.rewards, a.positions, a.costs,
                                                    a.bars_per_year)}


def walk_tensor_sizes(dims, branches) -> tuple[int, ...]:
    """Elements of each ``walk.walk_tensors`` entry, in its order (walk.cu's shapes)."""
    sd, h1, h2, value_h, adv_h, na = (int(d) for d in dims)
    trunk = (h1 * sd, h1, h2 * h1, h2, value_h * h2, value_h, na * value_h, na)
    return trunk + tuple(size for n in branches
                         for size in (adv_h * h2, adv_h, int(n) * na * adv_h, int(n) * na))


def _register_greedy_walk(twin, name: str) -> None:
    """The twin of ``name``: ``greedy_walk``, ``greedy_walk_cluster`` or ``greedy_walk_hold`` (the
    same walk: ``reference.kernels.walk.greedy_walk`` on the launch's tables, writing rows
    ``[0, min(n_steps, record_len))`` of the records, the kernels' rule), one launch of
    ``greedy_walk_spans`` (``reference.kernels.walk_spans.greedy_walk_spans_pass`` on the launch's
    ``state``, ``brk`` and records) or one of ``greedy_walk_round``
    (``reference.kernels.walk_rounds.greedy_walk_round`` on its span base, ``trace``, ``ends``
    and records). In ``bf16`` the weights are the mirror's (as the kernel reads them), the biases
    the f32 params'."""
    from foxhunt.fast.cpu_kernels import branches
    from foxhunt.reference.isv import ISV_LEN
    from foxhunt.reference.kernels.dense import bf16_to_f32

    def dims(a):
        return tuple(getattr(a, name) for name in walk_kernels.DIMS)

    def spans(a):
        """``(tensor, offset, size)`` of each tensor the kernel reads."""
        brs = branches(a, a.n_branches)
        names = walk_kernels.walk_tensors(len(brs))
        offsets = a.table("param_offsets", len(names))
        return zip(names, (int(o) for o in offsets), walk_tensor_sizes(dims(a), brs))

    def param_extent(a):
        return max(offset + size for _, offset, size in spans(a))

    def walk_args(a) -> tuple:
        """The twin's arguments up to ``n_steps`` (greedy_walk's signature)."""
        params = a.params
        if a.bf16:
            mirror = a.params_bf16
            if mirror is None:
                raise ValueError(f"{name}: bf16 is 1 but params_bf16 is null")
            for tensor, offset, size in spans(a):
                if tensor.startswith("w_"):  # weights from the mirror, biases f32
                    params[offset:offset + size] = bf16_to_f32(mirror[offset:offset + size])
        return (params, a.param_offsets, dims(a), branches(a, a.n_branches), bool(a.bf16), a.z,
                a.z_stride, a.isv, a.isv_index, a.h2_clamp_mult, a.close, a.high, a.low,
                a.features, a.costs, int(a.start[0]), int(a.n_steps[0]))

    def support_extent(a):
        """``z``: one support ``[NA]`` (``z_stride`` 0) or a row per branch (any other stride:
        the reference's check names it)."""
        return a.num_atoms if a.z_stride == 0 else (a.n_branches, a.num_atoms)

    rec = {name: "record_len" for name in ("rec_reward", "rec_held", "rec_cost", "rec_margin")}
    extents = dict(params=param_extent, params_bf16=param_extent,
                   param_offsets=lambda a: len(walk_kernels.walk_tensors(a.n_branches)),
                   n_actions="n_branches", action_offset="n_branches", z=support_extent,
                   isv=ISV_LEN, close="n_bars", high="n_bars", low="n_bars",
                   features=("n_bars", "n_features"), costs=len(env_kernels.COST_FIELDS),
                   start=1, n_steps=1, **rec)

    def rows_in(a) -> tuple[int, list]:
        """``(n, the records' first n rows or None)`` of a per-launch twin (rows are steps;
        the evaluator's segments fit ``record_len``)."""
        n = int(a.n_steps[0])
        if n > a.record_len:
            raise ValueError(f"{name}: n_steps {n} > record_len {a.record_len}")
        return n, [getattr(a, f)[:n] if a.view(f) is not None else None for f in rec]

    def rows_out(a, n: int, done, out: dict) -> dict:
        """``out`` with the records' first ``n`` rows from ``done`` (the rest as they were)."""
        for f in rec:
            if a.view(f) is not None:
                out[f] = getattr(a, f)
                out[f][:n] = getattr(done, f)
        return out

    if name == "greedy_walk_spans":  # one launch: reference walk_spans.greedy_walk_spans_pass
        @twin(name, nullable=("params_bf16", "rec_margin"), state=(2, 5),
              brk=(2, "n_chunks", 5), **extents)
        def _greedy_walk_spans(a):
            n, recs = rows_in(a)
            done = greedy_walk_spans_pass(*walk_args(a), a.n_chunks, a.n_passes, a.pass_index,
                                          a.hold_rows, a.state, a.brk, *recs)
            return rows_out(a, n, done, {"state": done.state, "brk": done.brk})
        return

    if name == "greedy_walk_round":  # one round: reference walk_rounds.greedy_walk_round
        @twin(name, nullable=("params_bf16", "rec_margin", "span_state", "span_brk"),
              span_state=(2, 5), span_brk=(2, "span_chunks", 5), trace=("record_len", 3),
              ends=(2, "n_chunks", 3), **extents)
        def _greedy_walk_round(a):
            n, recs = rows_in(a)
            done = greedy_walk_round(*walk_args(a), a.n_chunks, a.round, a.span_chunks,
                                     a.span_passes, a.span_state, a.span_brk, a.trace[:n],
                                     a.ends, *recs)
            trace = a.trace
            trace[:n] = done.trace
            return rows_out(a, n, done, {"trace": trace, "ends": done.ends})
        return

    @twin(name, nullable=("params_bf16", "rec_margin"), **extents)
    def _greedy_walk(a):
        walked = walk_kernels.greedy_walk(*walk_args(a))
        rows = min(int(a.n_steps[0]), a.record_len)
        out = {}
        for field, values in zip(rec, (walked.rewards, walked.positions, walked.costs,
                                       walked.margins)):
            if a.view(field) is not None:
                out[field] = getattr(a, field)
                out[field][:rows] = values[:rows]
        return out


__all__ = ["BASELINE_POLICIES", "METRICS_HOST", "N_STEPS_HOST", "NO_KEY", "OBS_HOST", "POLICIES",
           "Q_HOST", "REWARDS_HOST", "START_HOST", "WALK_STATE", "WALK_STREAMS", "WALK_TABLES",
           "WalkLayout", "X_HOST", "begin_ops", "bar_ops", "end_ops", "eval_host_nbytes",
           "eval_host_specs", "eval_ops", "fused_ops", "register_twins", "walk_binder",
           "walk_role", "walk_tensor_sizes"]
