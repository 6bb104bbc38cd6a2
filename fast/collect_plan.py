"""The collection cycle as launch records (issue 20): acting, the environment step, the replay
ring and the batch gathered straight into the trainer's arena.

``CollectLayout(layout, n_envs=, capacity=, n_bars=, n_features=, n_step=1)``: the collector's
buffers (their own arena): the replay ring (``kernels.replay``'s ring, ``prefix``: the ring
scan's tiles, the sampled rows ``sample_idx``), the env walks (state, ``obs``: also the
forward's input, the step's per-env outputs), the n-step windows (``nstep_win_*``:
``kernels.replay.nstep_buffers``' ``win_*`` entries, role ``state``; the transitions they emit
go straight into the ring), the market tables of
the whole run (``mk_*``, role ``constant``, uploaded once), the ring scan's per-tile totals
``prefix_blocks``, the cycle counter ``cycle`` (int64)
and the exploration rate ``eps`` (float32, written by the host at epoch start). The greedy
forward on the ``n_envs`` states runs on an ``EvalLayout(layout, n_envs)`` (its own arena).

The records, in the order of ``reference.collector`` (the cycle's reference twin), with the
neighbouring kernels fused (``kernels.collect``: each fused kernel's twin is the composition of
the kernels it replaces, so the results are the unfused cycle's, bit for bit; the cycle is
launch/latency bound and each fusion takes a node off its chain):

- ``act_ops``: the online forward on ``obs`` in place (``q_e``, packed per branch);
- ``env_ops``: ``collect_transition`` = ``env_act`` (epsilon-greedy, Philox streams
  ``explore``/``explore_action``) + ``env_step`` with auto-reset (stream ``episode_start``) +
  ``nstep_window`` (issue 22; at ``n_step = 1`` it passes every step through) + ``replay_add``
  of the transitions it emitted + the post-reset states into ``obs``; one block;
- ``sample_ops``: ``scan_tiles`` (the priorities' per-tile scans, many blocks, bit-exact twin),
  then ``replay_batch`` = ``scan_offsets`` (applied where the search reads) + ``replay_sample``
  (stream ``replay_sample``) + ``importance_weights`` into ``batch.isw`` + ``replay_gather``
  into ``batch.x``, ``batch.a``, ``batch.r``, ``batch.done`` (and the label fields and
  ``batch.discount`` where the step layout has them): the step's graphs 1 and 2 then read the
  batch where they always do;
- ``priority_ops``: ``replay_update_priorities`` from the step's ``td``, advancing ``cycle``
  in the same launch (``cycle_advance`` fused);
- ``advance_ops``: ``cycle_advance`` (the warmup plan, which has no priority update).

``train_head_ops`` puts them together: a training cycle is the head (act, env, sample), the
trainer's graphs 1 and 2, and the priority update. The update is DEFERRED into the next cycle's
head, as a side branch beside the act forward: ``parallel(side: priority_ops, main: act_ops)
-> collect_transition -> scan_tiles -> replay_batch``. The order of the reference cycle is
kept: the update still runs before anything reads what it writes (``collect_transition``
reads ``cycle``, ``priority`` and ``max_priority``; ``scan_tiles`` the priorities) and after
what it reads (the previous step's ``td``, the previous batch's ``sample_idx``), and the act
forward neither reads nor writes any of these. The cycle is one CUDA graph of serial nodes,
latency bound: the update off the chain saves a node (3-4 us) per cycle (the 1.3x epoch
target). So ``td`` and ``sample_idx`` carry over from one cycle to the next: role ``state`` in
the cycle's plans (``CARRIED``, ``collect_role``): ``check_dataflow`` reads them as values
present before the graph, as it does the ring.

The binder (``collect_binder``) resolves names in the collector's, the evaluation's and the
step's layouts; the step's ``batch`` is writable here (role ``scratch``: ``check_dataflow``
then proves that the gather and the weights write every byte graph 1 reads).

``register_twins()`` adds the CPU twins (``foxhunt.fast.cpu_kernels``) of the kernels these
records launch, so the CPU executor runs the cycle with the reference kernels.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from foxhunt.fast.binder import Binder
from foxhunt.fast.records import F32, I32, I64, Buf, Ops, Region
from foxhunt.fast.step_layout import BufferTable, EvalLayout, StepLayout
from foxhunt.fast.step_program import StepProgram
from foxhunt.reference.kernels import collect as collect_kernels
from foxhunt.reference.kernels import env as env_kernels
from foxhunt.reference.kernels import replay as replay_kernels
from foxhunt.reference.kernels.rng import STREAMS, split_u64

#: The ring's stored fields: ``(buffer name, kernel field)``, in ``replay.RING_FIELDS`` order.
RING_BUFFERS = tuple((f"ring_{name}", name) for name, _, _ in replay_kernels.RING_FIELDS)
#: The env state's arrays: ``(buffer name, EnvState field, dtype)``.
ENV_BUFFERS = (("env_t", "t", I32), ("env_steps", "steps", I32),
               ("env_time", "time_in_position", I32), ("env_position", "position", F32),
               ("env_entry", "entry_price", F32))
#: The market tables (``kernels.env.MarketTables`` fields) and their buffers.
TABLE_BUFFERS = tuple((f"mk_{name}", name) for name in env_kernels.MarketTables._fields)
#: ``nstep_window``'s window and output parameters and their buffers (the layout holds the
#: windows only: ``collect_transition`` writes the emitted transitions into the ring).
NSTEP_BUFFERS = tuple((f"nstep_{name}", name) for name in replay_kernels.nstep_buffers(1, 1, 1, 1))
#: The env kernels' stream-id parameters and the ``rng.STREAMS`` entry each takes.
ENV_STREAMS = {"start_stream": STREAMS["episode_start"], "explore_stream": STREAMS["explore"],
               "action_stream": STREAMS["explore_action"]}


class CollectLayout(BufferTable):
    """The collector's buffers (module docstring)."""

    def __init__(self, layout: StepLayout, *, n_envs: int, capacity: int, n_bars: int,
                 n_features: int, n_step: int = 1):
        super().__init__()
        self.step = layout
        self.n_envs, self.capacity, self.n_step = int(n_envs), int(capacity), int(n_step)
        self.n_bars, self.n_features = int(n_bars), int(n_features)
        N, SD, nb, cap = self.n_envs, layout.SD, layout.nb, self.capacity
        rows = {"s": (cap, SD), "s2": (cap, SD), "a": (cap, nb)}
        for (buf, name), (_, dtype, _) in zip(RING_BUFFERS, replay_kernels.RING_FIELDS):
            self._add(buf, rows.get(name, cap), dtype, "state")
        self._add("priority", cap, F32, "state")
        self._add("ring_pos", 2, I32, "state")
        self._add("max_priority", 1, F32, "state")
        self._add("prefix", cap, F32)
        self._add("prefix_blocks", replay_kernels.scan_blocks(cap), F32)
        self._add("sample_idx", layout.B, I32, "state")  # read by the next cycle's update
        self._add("cycle", 1, I64, "state")
        self._add("eps", 1, F32, "state")
        for buf, name in TABLE_BUFFERS:
            shape = (self.n_bars, self.n_features) if name == "features" else self.n_bars
            self._add(buf, shape, I32 if name == "regime" else F32, "constant")
        self._add("env_costs", len(env_kernels.COST_FIELDS), F32, "constant")
        for buf, _, dtype in ENV_BUFFERS:
            self._add(buf, N, dtype, "state")
        self._add("obs", (N, SD), F32, "state")
        self._add("env_actions", (N, nb), I32)
        for name in ("env_r", "env_done", "env_next_ret"):
            self._add(name, N, F32)
        self._add("env_regime", N, I32)
        self._add("env_s2", (N, SD), F32)
        self._add("env_obs", (N, SD), F32)
        self._add("env_no_record", 0, F32)  # training walks record nothing (record_len 0)
        shapes = replay_kernels.nstep_buffers(N, self.n_step, SD, nb)
        for buf, name in NSTEP_BUFFERS:
            if name.startswith("win_"):  # collect_transition emits into the ring: no out_*
                dtype, shape = shapes[name]
                self._add(buf, shape, F32 if dtype == np.float32 else I32, "state")
        clash = sorted(set(self.specs) & set(layout.specs))
        if clash:
            raise AssertionError(f"collector buffers {clash} shadow step buffers")


#: Step buffers a training cycle leaves for the next one: the deferred priority update at the
#: next cycle's head reads the step's TD errors (role ``state`` in the cycle's plans, module
#: docstring; the collector's own ``sample_idx`` has that role in its layout).
CARRIED = ("td",)


def _cycle_role(name: str, role: str) -> str:
    """A step buffer's role in the cycle's plans: the step's ``batch`` is scratch (the gather
    writes it), the ``CARRIED`` buffers are state."""
    return "state" if name in CARRIED else "scratch" if role == "batch" else role


def collect_binder(prog: StepProgram, cl: CollectLayout, evl: EvalLayout) -> Binder:
    """Names of the collector's, the evaluation forward's and the step's layouts; the step's
    ``batch`` is a scratch buffer here (the gather writes it), ``CARRIED`` state."""
    def region(buf: Buf) -> Region:
        for table in (cl, evl):
            if buf.name in table:
                return table.region(buf)
        found = prog.lay.region(buf)
        return dataclasses.replace(found, role=_cycle_role(found.buffer, found.role))
    return Binder(region, constants=prog.constants)


def collect_role(prog: StepProgram, cl: CollectLayout, evl: EvalLayout):
    """The roles ``check_dataflow`` sees for a plan of the cycle (``_cycle_role``)."""
    def role(name: str) -> str:
        for table in (cl, evl):
            if name in table:
                return table.role(name)
        return _cycle_role(name, prog.lay.role(name))
    return role


def _key(seed: int) -> dict:
    key_lo, key_hi = split_u64("seed", seed)
    return {"key_lo": key_lo, "key_hi": key_hi}


def act_ops(ops: Ops, prog: StepProgram, cl: CollectLayout, evl: EvalLayout) -> None:
    """The greedy forward on ``obs`` (read in place: no copy into ``x_e``) into ``q_e``."""
    lay, N = prog.lay, cl.n_envs
    xb = None
    if lay.bf16:
        xb = Buf("xb_e")
        prog.to_bf16(ops, Buf("obs"), xb, N * lay.SD)
    prog.forward(ops, tag="e", rows=N, which=0, x=Buf("obs"), xb=xb,
                 logits=Buf("logits_e", 0), logp=Buf("logp_e", 0), q=Buf("q_e"))


def env_ops(ops: Ops, prog: StepProgram, cl: CollectLayout, walks, *, reward_scale: float,
            seed: int, gamma_ref: float, eps="eps") -> None:
    """``collect_transition``: ``env_act`` on ``q_e`` exploring with ``eps`` (the collector's
    ``eps``, or ``isv_plan.act_epsilon_buffer``: ISV 41), ``env_step`` (auto-reset),
    ``nstep_window``, ``replay_add`` of the transitions it emitted and the new states into
    ``obs``, in one launch (its twin the composition of those kernels).

    ``walks``: a ``reference.collector.Walks`` (the fold's bar range, start range, episode
    length; baked into the records: one plan per fold); ``gamma_ref``: the discounts' base
    (``reference.collector.nstep_gamma``)."""
    lay, N, SD = prog.lay, cl.n_envs, prog.lay.SD
    state = {field: buf for buf, field, _ in ENV_BUFFERS}
    tables = {name: buf for buf, name in TABLE_BUFFERS}
    windows = {name: buf for buf, name in NSTEP_BUFFERS if name.startswith("win_")}
    ops.kernel("collect_transition", prog.kernels("collect").plan_collect_transition(N, SD),
               q="q_e", n_actions="n_actions", action_offset="action_offset", n_branches=lay.nb,
               eps=eps, **_key(seed), **ENV_STREAMS, cycle="cycle", close=tables["close"],
               high=tables["high"], low=tables["low"], features=tables["features"],
               n_features=cl.n_features, regime=tables["regime"], costs="env_costs",
               n_bars=walks.n_bars, min_start=walks.min_start, last_start=walks.last_start,
               episode_len=walks.episode_len, reward_scale=np.float32(reward_scale),
               state_dim=SD, **state, n_envs=N, obs="obs", actions="env_actions", r="env_r",
               done="env_done", s2="env_s2", obs_next="env_obs", next_ret="env_next_ret",
               regime_out="env_regime", n_step=cl.n_step, gamma_ref=np.float32(gamma_ref),
               **windows, **{buf: buf for buf, _ in RING_BUFFERS}, priority="priority",
               ring_pos="ring_pos", max_priority="max_priority", capacity=cl.capacity)


def sample_ops(ops: Ops, prog: StepProgram, cl: CollectLayout, *, beta: float, seed: int) -> None:
    """The batch: prefix sums, the Philox-drawn rows, their weights and the gather."""
    lay, B, cap = prog.lay, prog.lay.B, cl.capacity
    replay = prog.kernels("replay")
    ops.kernel("scan_tiles", replay.plan_scan_tiles(cap), p="priority", s="prefix",
               block_sums="prefix_blocks", n=cap)
    labels = {name: f"batch.{name}" if f"batch.{name}" in lay else None
              for name in ("next_ret", "regime", "discount")}
    ops.kernel("replay_batch", prog.kernels("collect").plan_replay_batch(B, lay.SD, cap),
               s="prefix", block_sums="prefix_blocks", capacity=cap, ring_pos="ring_pos",
               **_key(seed), stream=STREAMS["replay_sample"], cycle="cycle", n=B, priority="priority",
               beta=np.float32(beta), state_dim=lay.SD, n_branches=lay.nb,
               **{buf: buf for buf, _ in RING_BUFFERS}, idx="sample_idx", w="batch.isw",
               x="batch.x", a="batch.a", r="batch.r", done="batch.done", **labels)


def priority_ops(ops: Ops, prog: StepProgram, cl: CollectLayout, *, alpha: float,
                 priority_eps: float) -> None:
    """The sampled rows' new priorities from the step's TD errors, and the cycle counter
    advanced by the same launch (``cycle_advance`` fused: the last reader of a cycle's counter
    is the cycle's ``replay_batch``)."""
    B = prog.lay.B
    ops.kernel("replay_update_priorities", prog.kernels("replay").plan_replay_update_priorities(B),
               td="td", idx="sample_idx", n=B, priority="priority", capacity=cl.capacity,
               max_priority="max_priority", alpha=np.float32(alpha), eps=np.float32(priority_eps),
               cycle="cycle")


def advance_ops(ops: Ops, prog: StepProgram) -> None:
    ops.kernel("cycle_advance", prog.kernels("replay").plan_cycle_advance(), cycle="cycle")


def train_head_ops(ops: Ops, prog: StepProgram, cl: CollectLayout, evl: EvalLayout, walks, *,
                   update: dict | None, beta: float, seed: int, **env) -> None:
    """A training cycle's head (module docstring): ``update`` is ``priority_ops``' keyword
    arguments (``alpha``, ``priority_eps``) for the previous cycle's deferred update, run as a
    side branch beside the act forward; ``None`` for a cycle with no update pending (the first
    after the warm-up or a flush). Then ``env_ops`` (``env``: its keyword arguments) and
    ``sample_ops``."""
    if update is None:
        act_ops(ops, prog, cl, evl)
    else:
        side, main = ops.branch(), ops.branch()
        priority_ops(side, prog, cl, **update)
        act_ops(main, prog, cl, evl)
        ops.parallel(side, main)
    env_ops(ops, prog, cl, walks, seed=seed, **env)
    sample_ops(ops, prog, cl, beta=beta, seed=seed)


# --------------------------------------------------------------------------------------------
# CPU twins of the launched kernels (foxhunt.fast.cpu_kernels)
# --------------------------------------------------------------------------------------------


def _seed(a) -> int:
    return int(a.key_hi) << 32 | int(a.key_lo)


def _stream(a, param: str, want: int) -> None:
    if getattr(a, param) != want:
        raise ValueError(f"{param} {getattr(a, param)}: the reference draws from stream {want}")


def register_twins() -> None:
    """Add the twins of the cycle's kernels to ``cpu_kernels.TWINS`` where they are missing
    (once per process; a twin registered elsewhere, e.g. by the evaluation plan, is kept)."""
    from foxhunt.fast.cpu_kernels import TWINS, branches
    from foxhunt.fast.cpu_kernels import twin as add_twin

    def twin(name: str, **extents):
        return (lambda run: run) if name in TWINS else add_twin(name, **extents)
    ring = {buf: ("capacity", "state_dim") if name in ("s", "s2") else
            ("capacity", "n_branches") if name == "a" else "capacity" for buf, name in RING_BUFFERS}

    @twin("scan_tiles", p="n", s="n", block_sums=lambda a: replay_kernels.scan_blocks(a.n))
    def _scan_tiles(a):
        return replay_kernels.scan_tiles(a.p)._asdict()

    @twin("scan_offsets", s="n", block_sums=lambda a: replay_kernels.scan_blocks(a.n))
    def _scan_offsets(a):
        return {"s": replay_kernels.scan_offsets(a.s, a.block_sums)}

    @twin("replay_sample", prefix="capacity", ring_pos=2, cycle=1, idx="n")
    def _replay_sample(a):
        _stream(a, "stream", STREAMS["replay_sample"])
        return {"idx": replay_kernels.replay_sample(a.prefix, a.ring_pos, _seed(a), a.cycle, a.n)}

    @twin("importance_weights", priorities="n_items", idx="n", w="n")
    def _importance_weights(a):
        return {"w": replay_kernels.importance_weights(a.priorities, a.idx, a.beta, a.n_items)}

    n = "n_given"

    @twin("replay_add", nullable=("n_valid",), s=(n, "state_dim"), a=(n, "n_branches"), r=n,
          s2=(n, "state_dim"), done=n, next_ret=n, regime=n, discount=n, n_valid=1, **ring,
          priority="capacity", ring_pos=2, max_priority=1)
    def _replay_add(a):
        out = replay_kernels.replay_add(a.s, a.a, a.r, a.s2, a.done, a.next_ret, a.regime,
                                        a.discount, *(getattr(a, buf) for buf, _ in RING_BUFFERS),
                                        a.priority, a.ring_pos, a.max_priority,
                                        a.view("n_valid"))
        return out._asdict()

    def nstep_extents(a) -> dict:
        shapes = replay_kernels.nstep_buffers(a.n_envs, a.n_step, a.state_dim, a.n_branches)
        return {name: shape for name, (_, shape) in shapes.items()}

    @twin("nstep_window", obs=("n_envs", "state_dim"), actions=("n_envs", "n_branches"),
          r="n_envs", done="n_envs", s2=("n_envs", "state_dim"), next_ret="n_envs",
          regime="n_envs", n_out=1,
          **{name: (lambda key: lambda a: nstep_extents(a)[key])(name)
             for _, name in NSTEP_BUFFERS})
    def _nstep_window(a):
        out = replay_kernels.nstep_window(
            a.obs, a.actions, a.r, a.done, a.s2, a.next_ret, a.regime,
            **{name: getattr(a, name) for _, name in NSTEP_BUFFERS}, n_step=a.n_step,
            gamma_ref=a.gamma_ref)
        return out._asdict()

    @twin("replay_gather", nullable=("next_ret", "regime", "discount"), idx="n", **ring,
          x=lambda a: (2 * a.n, a.state_dim), a=("n_branches", "n"), r="n", done="n",
          next_ret="n", regime="n", discount="n")
    def _replay_gather(a):
        g = replay_kernels.replay_gather(a.idx, *(getattr(a, buf) for buf, _ in RING_BUFFERS))
        out = {"x": g.x, "a": g.a, "r": g.r, "done": g.done}
        out.update({name: getattr(g, name) for name in ("next_ret", "regime", "discount")
                    if a.view(name) is not None})
        return out

    @twin("replay_update_priorities", nullable=("cycle",), td="n", idx="n", priority="capacity",
          max_priority=1, cycle=1)
    def _replay_update_priorities(a):
        out = replay_kernels.replay_update_priorities(a.td, a.idx, a.priority, a.max_priority,
                                                      a.alpha, a.eps)._asdict()
        if a.view("cycle") is not None:  # cycle_advance fused
            out["cycle"] = replay_kernels.cycle_advance(a.cycle)
        return out

    @twin("cycle_advance", cycle=1)
    def _cycle_advance(a):
        return {"cycle": replay_kernels.cycle_advance(a.cycle)}

    def nb_total(a):
        return a.n_envs * sum(branches(a, a.n_branches))

    @twin("env_act", q=nb_total, n_actions="n_branches", action_offset="n_branches", eps=1,
          cycle=1, actions=("n_envs", "n_branches"))
    def _env_act(a):
        for param in ("explore_stream", "action_stream"):
            _stream(a, param, ENV_STREAMS[param])
        return {"actions": env_kernels.env_act(a.q, branches(a, a.n_branches), a.eps[0], _seed(a),
                                               a.cycle)}

    state = {field: "n_envs" for _, field, _ in ENV_BUFFERS}
    record = ("record_len", "n_envs")
    tables = dict(close="n_bars", high="n_bars", low="n_bars", features=("n_bars", "n_features"),
                  regime="n_bars", costs=len(env_kernels.COST_FIELDS))
    per_env = ("n_envs", "state_dim")

    def window_extents(a) -> dict:
        shapes = replay_kernels.nstep_buffers(a.n_envs, a.n_step, a.state_dim, a.n_branches)
        return {name: shape for name, (_, shape) in shapes.items()}

    @twin("collect_transition", q=nb_total, n_actions="n_branches", action_offset="n_branches",
          eps=1, cycle=1, **tables, **state, obs=per_env, actions=("n_envs", "n_branches"),
          r="n_envs", done="n_envs", s2=per_env, obs_next=per_env, next_ret="n_envs",
          regime_out="n_envs", **ring, priority="capacity", ring_pos=2, max_priority=1,
          **{name: (lambda key: lambda a: window_extents(a)[key])(name)
             for _, name in NSTEP_BUFFERS if name.startswith("win_")})
    def _collect_transition(a):
        for param in ENV_STREAMS:
            _stream(a, param, ENV_STREAMS[param])
        out = collect_kernels.collect_transition(
            a.q, branches(a, a.n_branches), a.eps[0], _seed(a), a.cycle, a.close, a.high, a.low,
            a.features, a.regime, a.t, a.steps, a.time_in_position, a.position, a.entry_price,
            a.costs, a.n_bars, a.min_start, a.last_start, a.episode_len, a.reward_scale,
            a.state_dim, a.obs, a.win_s, a.win_a, a.win_r, a.win_next_ret, a.win_regime,
            a.win_len, a.n_step, a.gamma_ref, *(getattr(a, buf) for buf, _ in RING_BUFFERS),
            a.priority, a.ring_pos, a.max_priority)._asdict()
        out["obs_next"] = out["obs"]
        return out

    @twin("replay_batch", nullable=("next_ret", "regime", "discount"), s="capacity",
          block_sums=lambda a: replay_kernels.scan_blocks(a.capacity), ring_pos=2, cycle=1,
          priority="capacity", **ring, idx="n", w="n",
          x=lambda a: (2 * a.n, a.state_dim), a=("n_branches", "n"), r="n", done="n",
          next_ret="n", regime="n", discount="n")
    def _replay_batch(a):
        _stream(a, "stream", STREAMS["replay_sample"])
        out = collect_kernels.replay_batch(a.s, a.block_sums, a.ring_pos, _seed(a), a.cycle, a.n,
                                           a.priority, a.beta,
                                           *(getattr(a, buf) for buf, _ in RING_BUFFERS))._asdict()
        for name in ("next_ret", "regime", "discount"):
            if a.view(name) is None:
                del out[name]
        return out

    @twin("env_step", nullable=("s2",), close="n_bars", high="n_bars", low="n_bars",
          features=("n_bars", "n_features"), regime="n_bars", **state,
          actions=("n_envs", "n_branches"), rec_reward=record, rec_held=record, rec_cost=record,
          costs=len(env_kernels.COST_FIELDS), cycle=1, r="n_envs", done="n_envs",
          s2=("n_envs", "state_dim"), obs=("n_envs", "state_dim"), next_ret="n_envs",
          regime_out="n_envs")
    def _env_step(a):
        _stream(a, "start_stream", ENV_STREAMS["start_stream"])
        out = env_kernels.env_step(
            a.close, a.high, a.low, a.features, a.regime, a.t, a.steps, a.time_in_position,
            a.position, a.entry_price, a.actions, a.rec_reward, a.rec_held, a.rec_cost, a.costs,
            a.n_bars, a.min_start, a.last_start, a.episode_len, a.auto_reset, a.reward_scale,
            a.state_dim, _seed(a), a.cycle)._asdict()
        out["regime_out"] = out.pop("regime")
        if a.view("s2") is None:
            del out["s2"]
        return out


__all__ = ["CARRIED", "CollectLayout", "ENV_BUFFERS", "ENV_STREAMS", "NSTEP_BUFFERS",
           "RING_BUFFERS", "TABLE_BUFFERS", "act_ops", "advance_ops", "collect_binder",
           "collect_role", "env_ops", "priority_ops", "register_twins", "sample_ops",
           "train_head_ops"]
