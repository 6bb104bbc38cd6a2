"""Tests of the n-step transitions (issue 22, collection side): ``nstep_window`` against
transitions written out by hand, the host collector at an episode boundary (against its own
1-step transitions), ``n_step = 1`` bit for bit today's collection, the device collector's plan
on the CPU executor bit for bit the host collector's, and resume of the windows."""

from __future__ import annotations

import numpy as np
import pytest

from foxhunt.fast.collector import FastCollector
from foxhunt.fast.cpu_executor import CpuTrainer
from foxhunt.reference import loop
from foxhunt.reference.collector import Collector, Walks, nstep_state
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import env as env_kernels
from foxhunt.reference.kernels import replay
from foxhunt.reference.market import SyntheticMarket, feature_warmup, market_features
from foxhunt.reference.replay import ReplayBuffer

F32, I32, I64 = np.float32, np.int32, np.int64
CFG = DQNConfig.preset("tiny")
KW = dict(n_envs=3, capacity=256, reward_scale=1000.0, seed=11, cycle=2)


# ------------------------------------------------------------------ nstep_window by hand


def _window_step(state, step, n_step, gamma):
    """One ``nstep_window`` call on the windows ``state`` (updated in place); the emitted rows."""
    out = replay.nstep_window(**step, **state, n_step=n_step, gamma_ref=gamma)._asdict()
    m = int(out.pop("n_out")[0])
    state.update(out)
    return {k[4:]: v[:m] for k, v in out.items() if k.startswith("out_")}


def _step(n_envs, t, r, done):
    """Env step ``t`` of ``n_envs`` envs (state dim 2, one branch) whose fields encode ``t``:
    state ``[t, e]``, s2 ``[t + 1, e]``, action ``t % 3``, next_ret ``t / 100``, regime
    ``t % 2``; rewards ``r`` and ``done`` per env."""
    e = np.arange(n_envs, dtype=F32)
    return {"obs": np.stack([np.full(n_envs, t, F32), e], 1),
            "actions": np.full((n_envs, 1), t % 3, I32), "r": np.asarray(r, F32),
            "done": np.asarray(done, F32), "s2": np.stack([np.full(n_envs, t + 1, F32), e], 1),
            "next_ret": np.full(n_envs, t / 100, F32), "regime": np.full(n_envs, t % 2, I32)}


def test_nstep_window_at_an_episode_boundary_by_hand():
    """n = 3, gamma = 0.5 (its powers exact). Env 0: an episode of 4 steps with rewards 1, 2, 4,
    8 (ends at step 3), then 16 of the next one. Env 1: rewards 3, 5, 7, 9, 11 (no end)."""
    g, n = 0.5, 3
    state = nstep_state(2, n, DQNConfig.preset("tiny", state_dim=2, branches=(3,)))
    rewards = [(1, 3), (2, 5), (4, 7), (8, 9), (16, 11)]
    dones = [(0, 0), (0, 0), (0, 0), (1, 0), (0, 0)]
    emitted = [_window_step(state, _step(2, t, rewards[t], dones[t]), n, g) for t in range(5)]
    assert [len(e["r"]) for e in emitted] == [0, 0, 2, 4, 1]
    # step 2: each env's oldest entry (step 0) with k = 3, env by env
    e2 = emitted[2]
    assert e2["r"].tolist() == [1 + 0.5 * 2 + 0.25 * 4, 3 + 0.5 * 5 + 0.25 * 7]
    assert e2["discount"].tolist() == [0.125, 0.125]
    assert e2["s"].tolist() == [[0, 0], [0, 1]] and e2["s2"].tolist() == [[3, 0], [3, 1]]
    assert e2["done"].tolist() == [0, 0] and e2["a"].tolist() == [[0], [0]]
    assert e2["next_ret"].tolist() == [F32(0.0)] * 2 and e2["regime"].tolist() == [0, 0]
    # step 3: env 0's episode ends: its entries of steps 1, 2, 3 with k = 3, 2, 1, every s2 the
    # terminal state and done = 1; then env 1's step-1 entry (k = 3)
    e3 = emitted[3]
    assert e3["r"].tolist() == [2 + 0.5 * 4 + 0.25 * 8, 4 + 0.5 * 8, 8, 5 + 0.5 * 7 + 0.25 * 9]
    assert e3["discount"].tolist() == [0.125, 0.25, 0.5, 0.125]
    assert e3["done"].tolist() == [1, 1, 1, 0]
    assert e3["s"][:, 0].tolist() == [1, 2, 3, 1] and e3["s"][:, 1].tolist() == [0, 0, 0, 1]
    assert e3["s2"].tolist() == [[4, 0], [4, 0], [4, 0], [4, 1]]
    assert e3["a"][:, 0].tolist() == [1, 2, 0, 1] and e3["regime"].tolist() == [1, 0, 1, 1]
    assert e3["next_ret"].tolist() == [F32(0.01), F32(0.02), F32(0.03), F32(0.01)]
    # step 4: env 0's new episode has one step (nothing out); env 1's step-2 entry
    assert emitted[4]["r"].tolist() == [7 + 0.5 * 9 + 0.25 * 11]
    assert state["win_len"].tolist() == [1, 2]
    assert state["win_r"][0, 0] == 16 and state["win_r"][1, :2].tolist() == [9, 11]


def test_nstep_window_sums_in_order_in_float32():
    """gamma = 0.9: the sum r_0 + g r_1 + g^2 r_2 with each product and sum rounded in float32
    (g^2 = fl(g * g)), and discount = fl(fl(g * g) * g)."""
    g = F32(0.9)
    state = nstep_state(1, 3, DQNConfig.preset("tiny", state_dim=2, branches=(3,)))
    rs = [F32(0.3), F32(-1.7), F32(2.9)]
    out = [_window_step(state, _step(1, t, [rs[t]], [0]), 3, 0.9) for t in range(3)][-1]
    g2 = F32(g * g)
    want = F32(F32(rs[0] + F32(g * rs[1])) + F32(g2 * rs[2]))
    assert out["r"].view(I32).tolist() == [np.array(want, F32).view(I32)]
    assert out["discount"].view(I32).tolist() == [np.array(F32(g2 * g), F32).view(I32)]
    assert abs(float(out["r"][0]) - (0.3 - 0.9 * 1.7 + 0.81 * 2.9)) < 1e-6


def test_nstep_window_of_one_step_passes_each_step_through():
    state = nstep_state(2, 1, DQNConfig.preset("tiny", state_dim=2, branches=(3,)))
    step = _step(2, 5, [-0.0, 2.5], [1, 0])
    out = _window_step(state, step, 1, 0.97)
    for name in ("r", "done", "s2", "next_ret", "regime"):
        assert np.array_equal(out[name].view(np.uint8), np.asarray(step[name]).view(np.uint8)), name
    assert np.array_equal(out["s"], step["obs"]) and np.array_equal(out["a"], step["actions"])
    assert out["discount"].tolist() == [F32(0.97)] * 2 and state["win_len"].tolist() == [0, 0]


def test_nstep_window_rejects_a_full_window_and_a_bad_n_step():
    state = nstep_state(1, 3, DQNConfig.preset("tiny", state_dim=2, branches=(3,)))
    state["win_len"][0] = 3
    with pytest.raises(ValueError, match=r"win_len\[0\]=3"):
        _window_step(state, _step(1, 0, [1], [0]), 3, 0.9)
    with pytest.raises(ValueError, match="n_step"):
        _window_step(nstep_state(1, 3, CFG), _step(1, 0, [1], [0]), 17, 0.9)


# -------------------------------------------------------------- the host collector


@pytest.fixture(scope="module")
def market():
    """The run's tables and walks of 5-step episodes (several end within a test)."""
    bars = SyntheticMarket.preset("default", seed=3, n_bars=600).generate()
    feats = market_features(bars, loop.choose_windows(CFG.state_dim))
    seg = loop.fold_segments(len(bars), feature_warmup(loop.choose_windows(CFG.state_dim)), 1,
                             0.125, 0.125)[0]
    t0, t_val = seg.train
    return env_kernels.market_tables(bars, feats), Walks(t_val, t0, t_val - 1 - 5, 5)


def _explore(col, cycles):
    """``cycles`` collection cycles with eps = 1 (the actions depend on the cycle only)."""
    col.begin_epoch(1.0)
    for _ in range(cycles):
        col.collect(None)
        col.cycle += 1


def _rows(col):
    r = col.ring
    return {k: getattr(r, k)[:r.size].copy() for k in ReplayBuffer.STATE_ARRAYS if k != "priority"}


def test_host_collector_n_step_transitions_from_its_one_step_transitions(market):
    """Twelve cycles of 3 envs with 5-step episodes: the n = 3 ring holds, env by env and
    oldest first, the transitions formed by hand from the n = 1 ring of the same walks."""
    tables, walks = market
    one, three = (Collector(CFG, tables, walks, **KW, n_step=n) for n in (1, 3))
    _explore(one, 12)
    _explore(three, 12)
    steps, got = _rows(one), _rows(three)
    g = F32(CFG.gammas[0])
    N = KW["n_envs"]
    # per cycle c the 1-step ring holds env e's step at row c * N + e
    want, pending = {k: [] for k in got}, [[] for _ in range(N)]
    for c in range(12):
        emitted = []
        for e in range(N):
            pending[e].append(c * N + e)
            rows = pending[e]
            done = steps["done"][rows[-1]] == 1
            out = rows if done else rows[:1] if len(rows) == 3 else []
            for j, first in enumerate(out):
                span = rows[j:]
                acc, gk = steps["r"][span[0]], g
                for row in span[1:]:
                    acc, gk = F32(acc + F32(gk * steps["r"][row])), F32(gk * g)
                emitted.append(dict(s=steps["s"][first], a=steps["a"][first], r=acc,
                                    s2=steps["s2"][rows[-1]], done=steps["done"][rows[-1]],
                                    next_ret=steps["next_ret"][first],
                                    regime=steps["regime"][first], discount=gk))
            pending[e] = [] if done else rows[1:] if len(rows) == 3 else rows
        for tr in emitted:
            for k in want:
                want[k].append(tr[k])
    assert len(want["r"]) == three.size > 0
    assert steps["done"].sum() >= 3  # several episodes ended inside the window of cycles
    for k in got:
        assert np.array_equal(got[k], np.array(want[k], got[k].dtype)), k
    # the 5-step episodes: per env 12 steps = 2 whole episodes (5 each: 3 + 2 at the end) and
    # 2 steps pending (no transition is cut by the collection's end)
    assert three.size == N * (12 - 2) and three.window["win_len"].tolist() == [2] * N


def test_host_collector_at_an_episode_boundary_written_out(market):
    """Env 0's first episode (5 steps, rewards r0..r4 from the 1-step ring): the n = 3
    transitions of steps 2, 3, 4, emitted when it ends, with k = 3, 2, 1."""
    tables, walks = market
    one, three = (Collector(CFG, tables, walks, **KW, n_step=n) for n in (1, 3))
    _explore(one, 5)
    _explore(three, 5)
    N, g = KW["n_envs"], F32(CFG.gammas[0])
    r = one.ring.r[0:5 * N:N]  # env 0's rewards r0 .. r4
    assert one.ring.done[0:5 * N:N].tolist() == [0, 0, 0, 0, 1]
    terminal = one.ring.s2[4 * N]
    # cycle 2 emits steps 0 of every env, cycle 3 steps 1, cycle 4: env 0's steps 2, 3, 4 first
    rows = slice(2 * N, 2 * N + 3)
    assert three.ring.r[rows].tolist() == [F32(F32(r[2] + F32(g * r[3])) + F32(F32(g * g) * r[4])),
                                           F32(r[3] + F32(g * r[4])), r[4]]
    assert three.ring.discount[rows].tolist() == [F32(F32(g * g) * g), F32(g * g), g]
    assert three.ring.done[rows].tolist() == [1, 1, 1]
    assert all(np.array_equal(s2, terminal) for s2 in three.ring.s2[rows])
    assert np.array_equal(three.ring.s[rows], one.ring.s[[2 * N, 3 * N, 4 * N]])
    # env 0's step 0 (k = 3, not done): emitted at cycle 2 with s2 the state after step 2
    assert three.ring.r[0] == F32(F32(r[0] + F32(g * r[1])) + F32(F32(g * g) * r[2]))
    assert three.ring.done[0] == 0 and np.array_equal(three.ring.s2[0], one.ring.s2[2 * N])


def test_one_step_collection_is_todays_bit_for_bit(market):
    """n_step = 1: the ring, the walks and the sampled batch equal those of today's cycle
    (env_act, env_step, then every env's step added as it is), the discount column gamma."""
    tables, walks = market
    col = Collector(CFG, tables, walks, **KW)
    old, c = ReplayBuffer(CFG, KW["capacity"]), CFG
    env = env_kernels.env_reset(None, 3, walks.min_start, walks.last_start, KW["seed"],
                                np.array([KW["cycle"]], I64))
    obs = env_kernels.env_observe(tables.features, tables.close, env.t, env.position,
                                  env.entry_price, env.time_in_position, c.state_dim)
    _explore(col, 12)
    for cycle in range(KW["cycle"], KW["cycle"] + 12):
        cyc = np.array([cycle], I64)
        actions = env_kernels.env_act(np.zeros(3 * sum(c.branches), F32), c.branches, F32(1),
                                      KW["seed"], cyc)
        no = np.zeros((0, 3), F32)
        out = env_kernels.env_step(tables.close, tables.high, tables.low, tables.features,
                                   tables.regime, *env, actions, no, no, no,
                                   env_kernels.cost_table(col_costs()), walks.n_bars,
                                   walks.min_start, walks.last_start, walks.episode_len, 1,
                                   F32(1000.0), c.state_dim, KW["seed"], cyc)
        old.add(obs, actions, out.r, out.s2, out.done, next_ret=out.next_ret, regime=out.regime)
        env, obs = env_kernels.EnvState(*out[:5]), out.obs
    a, b = col.ring.state(), old.state()
    for k in ReplayBuffer.STATE_ARRAYS:
        if k != "priority":  # the ring's new rows take the running maximum, the old buffer's too
            assert np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), k
    assert np.all(a["discount"] == F32(CFG.gammas[0]))
    batch, _ = col.ring.sample(KW["seed"], 40)
    assert batch.discount is None  # 1-step batches: today's targets


def col_costs():
    from foxhunt.reference.env import ExecutionCosts

    return ExecutionCosts()


def test_n_step_batches_carry_the_discount(market):
    tables, walks = market
    col = Collector(CFG, tables, walks, **{**KW, "n_envs": 8}, n_step=3)
    _explore(col, 30)
    batch, idx = col.ring.sample(KW["seed"], 99)
    assert np.array_equal(batch.discount, col.ring.discount[idx])
    g = F32(CFG.gammas[0])
    assert set(batch.discount.tolist()) <= {g, F32(g * g), F32(F32(g * g) * g)}
    batch.validate(CFG)


def test_collector_rejects_n_step_with_gamma_one(market):
    tables, walks = market
    with pytest.raises(ValueError, match=r"gamma: 1\.0 .*n_step=3"):
        Collector(CFG.replace(gamma=1.0), tables, walks, **KW, n_step=3)


def test_loop_settings_n_step_range():
    assert loop.LoopSettings().n_step == 1
    for bad in (0, 17, 2.0, True):
        with pytest.raises(ValueError, match=r"n_step=.*\[1, 16\]"):
            loop.LoopSettings(n_step=bad)


# ------------------------------------------------- the device plan on the CPU executor


def test_fast_n_step_cycle_on_the_cpu_executor_equals_the_reference(market):
    """n = 3: warm-up and training cycles of the fast plan (records run by the twins) against
    the host collector: the ring (discount included), the windows, the walks and the trainers
    agree bit for bit; then a resume of the device state continues exactly."""
    tables, walks = market
    kw = {**KW, "n_step": 3}
    t_ref, t_fast = CpuTrainer(CFG, seed=1, n_step=3), CpuTrainer(CFG, seed=1, n_step=3)
    ref, fast = Collector(CFG, tables, walks, **kw), FastCollector(t_fast, CFG, tables, walks, **kw)
    for eps in (1.0, 0.3):
        ref.warmup(t_ref, 40)
        fast.warmup(t_fast, 40)
        ref.begin_epoch(eps)
        fast.begin_epoch(eps)
        for _ in range(4):
            assert ref.cycle_step(t_ref) == fast.cycle_step(t_fast)
    assert fast.size == ref.size
    arrays_ref, meta_ref = ref.state()
    arrays_fast, meta_fast = fast.state()
    assert meta_ref == meta_fast and arrays_ref.keys() == arrays_fast.keys()
    for k in arrays_ref:
        assert np.array_equal(arrays_ref[k], arrays_fast[k], equal_nan=True), k
    a, b = t_ref.state_dict(), t_fast.state_dict()
    assert all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)
    # resume: a new fast collector from the saved state continues as the uninterrupted one
    saved = t_fast.state_dict()
    ref.cycle_step(t_ref)
    t_new = CpuTrainer(CFG, seed=1, n_step=3)
    t_new.load_state_dict(saved)
    again = FastCollector(t_new, CFG, tables, walks, **{**kw, "cycle": fast.cycle})
    again.load_state(arrays_fast, meta_fast)
    again.begin_epoch(0.3)
    again.cycle_step(t_new)
    arrays_ref, _ = ref.state()
    arrays_new, _ = again.state()
    for k in arrays_ref:
        assert np.array_equal(arrays_ref[k], arrays_new[k], equal_nan=True), k


def test_reference_collector_resumes_its_windows_bitwise(market):
    from foxhunt.reference.trainer import Trainer

    tables, walks = market
    kw = {**KW, "n_step": 3}
    whole, t_whole = Collector(CFG, tables, walks, **kw), Trainer(CFG, seed=1)
    whole.warmup(t_whole, 40)
    arrays, meta = whole.state()
    resumed = Collector(CFG, tables, walks, **{**kw, "cycle": whole.cycle})
    resumed.load_state(arrays, meta)
    for col in (whole, resumed):
        _explore(col, 4)
    a, _ = whole.state()
    b, _ = resumed.state()
    assert any(k.startswith("nstep.") for k in a)
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_loop_with_n_step_resumes_bitwise(tmp_path):
    """The reference loop with n_step = 3, interrupted inside its second epoch (the ring's
    discounts and the windows come back from the resume state) and resumed: the same records
    and final trainer as the uninterrupted run."""
    from foxhunt.reference.checkpoint import load_checkpoint

    config = DQNConfig.preset("tiny", readback_interval=4)
    settings = loop.LoopSettings(folds=1, epochs=2, steps_per_epoch=8, n_envs=4,
                                 warmup_transitions=40, replay_capacity=128, seed=5, n_step=3)
    bars = SyntheticMarket.preset("strong_trend", seed=3, n_bars=800).generate()
    steps = []

    def go(out, **kw):
        return loop.run(config, bars, settings, out_dir=out, on_step=lambda i, s: steps.append(i),
                        **kw)

    whole = go(tmp_path / "whole")
    steps.clear()
    part = go(tmp_path / "part", should_stop=lambda: len(steps) >= settings.steps_per_epoch + 3)
    assert part.status == "interrupted" and len(part.records) == 1
    resumed = go(tmp_path / "part", resume=True)
    untimed = lambda rs: [{k: v for k, v in vars(r).items() if k not in loop.TIMING_FIELDS}  # noqa: E731
                          for r in rs]
    assert untimed(resumed.records) == untimed(whole.records)
    _, a = load_checkpoint(tmp_path / "whole" / "checkpoints" / "last.safetensors")
    _, b = load_checkpoint(tmp_path / "part" / "checkpoints" / "last.safetensors")
    assert all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)
