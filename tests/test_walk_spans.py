"""The span walk's reference twin (issue 20): ``walk_spans.greedy_walk_spans_pass`` (one
launch of walk.cu's ``greedy_walk_spans``) and ``walk_spans.greedy_walk_spans_walk`` (launches
0..P composed) against the sequential ``walk.greedy_walk``, on the CPU.

Networks: the conformance samples' random tiny network (it trades), the same with the bias of
the exposure branch's top "long" atom raised (it buys and holds), and test_walk_chunks' hand
network, whose exposure is the bar's first market feature ``f0`` (+1 long, -1 short, 0 flat;
always a market order), so the passes' breaks and records can be derived by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from foxhunt.conformance.kernel_spec import case_dims
from foxhunt.conformance.specs.walk import ENTRIES
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.env import ExecutionCosts
from foxhunt.reference.kernels import walk, walk_spans
from foxhunt.reference.layout import ParamLayout, branch_name
from test_walk_chunks import _hand_network  # the hand network both walks' tests read

F32, I32 = np.float32, np.int32
WALK = {e.name: e for e in ENTRIES}["greedy_walk"]
START = 3
NONE = 2**31 - 1  # int32 max, written out (the contract's value, not the module's constant)
#: Record values no step writes (positions are -1, 0 or 1): rows a launch leaves alone.
SENTINEL = F32(-7.0)
GP = [(1, 0), (1, 3), (3, 1), (4, 2), (8, 5), (5, 20)]


def _sample(seed=0, **changes):
    kwargs = WALK.sample(case_dims("tiny"), np.random.default_rng(seed))
    kwargs.update(changes)
    return kwargs


def _variant(seed, branches, bf16):
    """A tiny sample with another branch set or precision: fresh random parameters (normal,
    gain 1.4 over sqrt(fan in), as the conformance samples')."""
    config = DQNConfig.preset("tiny", branches=branches, precision="bf16" if bf16 else "f32")
    layout = ParamLayout(config)
    rng = np.random.default_rng(100 + seed)
    params = layout.zeros()
    views = layout.views(params)
    for tensor in layout.tensors:
        fan_in = tensor.shape[-1] if len(tensor.shape) == 2 else 1
        views[tensor.name][...] = rng.standard_normal(tensor.shape) * (1.4 / np.sqrt(fan_in))
    return _sample(seed, params=params, branches=tuple(branches), bf16=bf16,
                   param_offsets=walk.walk_offsets(layout, len(branches)))


def _buy_and_hold(kwargs):
    """+50 on the bias of the top atom of the exposure branch's action 2 (long)."""
    na = kwargs["dims"][5]
    names = walk.walk_tensors(len(kwargs["branches"]))
    offset = int(kwargs["param_offsets"][names.index(f"b_{branch_name(0)}2")])
    params = kwargs["params"].copy()
    params[offset + 2 * na + na - 1] += F32(50.0)
    return {**kwargs, "params": params}


def _hand_sample(pattern):
    """The hand network on a table whose bars ``START + k`` have ``f0 = pattern[k]``."""
    pattern = np.asarray(pattern, F32)
    n = pattern.shape[0]
    kwargs = _sample(0)
    T = START + n + 1
    features = kwargs["features"][:T].copy()
    features[START:START + n, 0] = pattern
    return {**kwargs, "params": _hand_network(kwargs), "features": features,
            "close": kwargs["close"][:T], "high": kwargs["high"][:T], "low": kwargs["low"][:T],
            "start": START, "n_steps": n}


def _buffers(n_steps, n_chunks, fill=0.0):
    return walk_spans.WalkSpansState(np.zeros((2, 5), I32), np.zeros((2, n_chunks, 5), I32),
                                     *(np.full(n_steps, fill, F32) for _ in range(4)))


def _launch(kwargs, G, P, p, buffers, hold_rows=4):
    return walk_spans.greedy_walk_spans_pass(
        **kwargs, n_chunks=G, n_passes=P, pass_index=p, hold_rows=hold_rows,
        **dict(zip(walk_spans.WalkSpansState._fields, buffers)))


def _launches(kwargs, G, P, hold_rows=4):
    """The buffers after each launch ``0 .. P`` (from zeros)."""
    buffers, out = _buffers(kwargs["n_steps"], G), []
    for p in range(P + 1):
        buffers = _launch(kwargs, G, P, p, buffers, hold_rows)
        out.append(buffers)
    return out


def _on_sentinels(buffers):
    """``buffers`` with every record row set to SENTINEL."""
    rows = np.full_like(buffers.rec_reward, SENTINEL)
    return buffers._replace(rec_reward=rows, rec_held=rows.copy(), rec_cost=rows.copy(),
                            rec_margin=rows.copy())


def _written(buffers):
    """Which rows a launch on SENTINEL records wrote (all four records, or none)."""
    written = [rec != SENTINEL for rec in buffers[2:]]
    assert all((w == written[1]).all() for w in written)
    return np.flatnonzero(written[1])


def _same(a, b):
    return all(x.tobytes() == y.tobytes() for x, y in zip(a, b))


def _bits(x):
    return int(np.array([x], F32).view(I32)[0])


def _row(t, steps, time, position, entry):
    return [t, steps, time, _bits(position), _bits(entry)]


# ------------------------------------------------------------- composite == greedy_walk

@pytest.mark.parametrize("G, P", GP)
def test_buy_and_hold_spans_are_the_sequential_walk_bit_for_bit(G, P):
    k = _buy_and_hold(_sample(1))
    ref = walk.greedy_walk(**k)
    assert (ref.positions == 1).mean() > 0.8
    launches = _launches(k, G, P)
    final = launches[-1]
    assert _same(final[2:], ref)
    assert _same(walk_spans.greedy_walk_spans_walk(**k, n_chunks=G, n_passes=P, hold_rows=4), ref)
    if P >= 2:  # not vacuous: pass 0 breaks at step 0 (the buy), pass 1 holds to the end
        assert launches[0].brk[0, 0, 0] == 0
        assert final.state[P & 1, 1] == k["n_steps"]  # the tail has nothing left


@pytest.mark.parametrize("G, P", GP)
def test_trading_spans_are_the_sequential_walk_bit_for_bit(G, P):
    k = _sample(0)
    ref = walk.greedy_walk(**k)
    assert (np.diff(ref.positions) != 0).sum() > 5
    assert _same(walk_spans.greedy_walk_spans_walk(**k, n_chunks=G, n_passes=P, hold_rows=3), ref)


@pytest.mark.parametrize("G, P", GP)
def test_without_a_margin_buffer_the_rest_is_the_same(G, P):
    k = _sample(2)
    ref = walk.greedy_walk(**k)
    buffers = _buffers(k["n_steps"], G)._replace(rec_margin=None)
    with_margin = _buffers(k["n_steps"], G)
    for p in range(P + 1):
        buffers = _launch(k, G, P, p, buffers)
        with_margin = _launch(k, G, P, p, with_margin)
        assert buffers.rec_margin is None and _same(buffers[:-1], with_margin[:-1])
    assert _same(buffers[2:5], ref[:3])


@pytest.mark.parametrize("G, P", [(3, 2), (4, 5)])
def test_a_support_per_branch_is_the_sequential_walk_bit_for_bit(G, P):
    """The conformance ``odd`` sample (distinct supports, ``z_stride = NA``)."""
    k = WALK.sample(case_dims("odd"), np.random.default_rng(0))
    assert k["z_stride"] == k["dims"][5] and k["z"].ndim == 2
    ref = walk.greedy_walk(**k)
    assert (np.diff(ref.positions) != 0).sum() > 5
    assert _same(walk_spans.greedy_walk_spans_walk(**k, n_chunks=G, n_passes=P, hold_rows=4), ref)


@pytest.mark.parametrize("branches, bf16", [((3,), True), ((3, 3, 2), True), ((3, 2), False),
                                            ((2, 3), True)])
def test_other_branch_sets_and_f32_are_the_sequential_walk(branches, bf16):
    k = _variant(5, branches, bf16)
    ref = walk.greedy_walk(**k)
    assert (np.diff(ref.positions) != 0).sum() > 5
    for G, P in ((4, 2), (3, 6)):
        got = walk_spans.greedy_walk_spans_walk(**k, n_chunks=G, n_passes=P, hold_rows=1)
        assert _same(got, ref)


def test_non_finite_features_walk_as_greedy_walk():
    k = _buy_and_hold(_sample(1))
    features = k["features"].copy()
    features[START + 10, 0], features[START + 11, 1], features[START + 30, :] = np.nan, np.inf, \
        np.nan
    k = {**k, "features": features}
    ref = walk.greedy_walk(**k)
    assert np.isfinite(ref.margins).all()
    assert _same(walk_spans.greedy_walk_spans_walk(**k, n_chunks=4, n_passes=3, hold_rows=8), ref)


@pytest.mark.parametrize("n_steps, G", [(0, 3), (1, 4), (5, 8)])
def test_short_walks_and_more_clusters_than_steps(n_steps, G):
    k = _sample(0, n_steps=n_steps)
    ref = walk.greedy_walk(**k)
    for P in (0, 1, 4):
        got = walk_spans.greedy_walk_spans_walk(**k, n_chunks=G, n_passes=P, hold_rows=2)
        assert _same(got, ref)
    first = _launch(k, G, 2, 0, _buffers(n_steps, G))
    span = -(-n_steps // G) if n_steps else 0
    busy = -(-n_steps // span) if span else 0  # clusters with rows
    assert (first.brk[0, busy:] == [NONE, 0, 0, 0, 0]).all()


def test_hold_rows_changes_nothing():
    k = _buy_and_hold(_sample(1))
    outs = [_launches(k, 3, 4, hold_rows=h) for h in (1, 7, walk_spans.HOLD_MAX)]
    for a, b in zip(outs[0], outs[1]):
        assert _same(a, b)
    for a, b in zip(outs[0], outs[2]):
        assert _same(a, b)


def test_a_launch_does_not_modify_its_inputs():
    k = _sample(0)
    buffers = _launches(k, 3, 3)[1]
    copies = [a.copy() for a in buffers]
    _launch(k, 3, 3, 2, buffers)
    assert _same(buffers, copies)


# ------------------------------------------------------------------------- by hand

def test_two_clusters_by_hand():
    """f0 = 0 0 1 1 | 0 0 0 0 (flat, flat, long, long, flat ...), G = 2, P = 2.
    Pass 0 (base flat at step 0, hold = flat): cluster 0 (rows 0-3) breaks at j = 2 with
    (long, market, urgency default 0); cluster 1 (rows 4-7) holds flat throughout: NONE.
    Launch 1 commits row 2 (buy at close[START + 2]); base: step 3, long since 1 bar; span 3:
    cluster 0 (rows 3-5) breaks at j = 1 (row 4: flat, market), cluster 1 (rows 6-7) at j = 3
    (long held to row 6 is the hypothesis; f0 = 0 says flat). Launch 2 commits row 4 (the
    minimum, cluster 0) and walks rows 5-7 (the tail)."""
    k = _hand_sample([0, 0, 1, 1, 0, 0, 0, 0])
    c = k["close"]
    ref = walk.greedy_walk(**k)
    np.testing.assert_array_equal(ref.positions, [0, 0, 1, 1, 0, 0, 0, 0])
    G, P = 2, 2
    l0 = _launch(k, G, P, 0, _on_sentinels(_buffers(8, G)))
    np.testing.assert_array_equal(l0.state[0], _row(START, 0, 0, 0.0, 0.0))
    np.testing.assert_array_equal(l0.state[1], 0)
    np.testing.assert_array_equal(l0.brk[0], [[2, 2, 0, 0, _bits(ref.margins[2])],
                                              [NONE, 0, 0, 0, 0]])
    np.testing.assert_array_equal(l0.brk[1], 0)
    np.testing.assert_array_equal(_written(l0), [0, 1, 4, 5, 6, 7])
    np.testing.assert_array_equal(l0.rec_held[[0, 1, 4, 5, 6, 7]], 0)
    assert _same([r[:2] for r in l0[2:]], [r[:2] for r in ref])
    # row 4 was written under "flat held from step 0": no trade; the true walk sells there
    assert l0.rec_cost[4] == 0 and ref.costs[4] > 0

    l1 = _launch(k, G, P, 1, _on_sentinels(l0))
    np.testing.assert_array_equal(l1.state[0], l0.state[0])
    np.testing.assert_array_equal(l1.state[1], _row(START + 3, 3, 1, 1.0, c[START + 2]))
    # the margins of rows 4 and 6 depend on f0 alone: greedy_walk's, whatever the position
    np.testing.assert_array_equal(l1.brk[1], [[1, 1, 0, 0, _bits(ref.margins[4])],
                                              [3, 1, 0, 0, _bits(ref.margins[6])]])
    np.testing.assert_array_equal(l1.brk[0], l0.brk[0])
    np.testing.assert_array_equal(_written(l1), [2, 3])
    assert _same([r[2:4] for r in l1[2:]], [r[2:4] for r in ref])
    assert l1.rec_cost[2] > 0 and l1.rec_held[2] == 1

    l2 = _launch(k, G, P, 2, _on_sentinels(l1))
    np.testing.assert_array_equal(l2.state[0], _row(START + 5, 5, 0, 0.0, c[START + 4]))
    np.testing.assert_array_equal(l2.brk, l1.brk)  # the tail writes no brk
    np.testing.assert_array_equal(_written(l2), [4, 5, 6, 7])
    assert _same([r[4:] for r in l2[2:]], [r[4:] for r in ref])
    full = _launches(k, G, P)[-1]
    assert _same(full[2:], ref)


def _market_step(k, t, target, position):
    """The env step by hand (env_step's formulas, float32): a market order "now" from
    ``position`` to ``target`` at bar ``t``: ``(reward, held, cost)``."""
    costs = ExecutionCosts()
    price, next_close = k["close"][t], k["close"][t + 1]
    range_t = (k["high"][t] - k["low"][t]) / price
    unit = (F32(costs.fee) + F32(costs.half_spread)) + F32(costs.slippage_coef) * range_t
    cost = F32(abs(target - position)) * unit
    reward = F32(target) * ((next_close - price) / price) - cost
    return reward, F32(target), cost


def test_a_commit_walks_the_first_minimum_s_stored_action():
    """state[0]: flat at step 10; brk[0]: breaks at 7, 4, 4, NONE: the minimum 4 first at
    cluster 1 (short, market); cluster 2's different action (long) is not taken. Row 14 gets
    the short sale at close[START + 14] and the stored margin; the base becomes short since 1
    bar at step 15; rows 10-13 (held, written by the previous pass) are not written."""
    k = _sample(1)
    G, P, base_steps = 4, 3, 10
    buffers = _on_sentinels(_buffers(k["n_steps"], G))
    state = buffers.state.copy()
    state[0] = _row(START + base_steps, base_steps, 0, 0.0, 123.5)
    brk = buffers.brk.copy()
    brk[0] = [[7, 2, 1, 0, _bits(9.0)], [4, 0, 0, 0, _bits(0.375)], [4, 2, 1, 0, _bits(5.0)],
              [NONE, 0, 0, 0, 0]]
    brk[1] = 99  # the other parity is not read
    out = _launch(k, G, P, 1, buffers._replace(state=state, brk=brk))
    t = START + base_steps + 4
    np.testing.assert_array_equal(out.state[1], _row(t + 1, 15, 1, -1.0, k["close"][t]))
    np.testing.assert_array_equal(out.state[0], state[0])
    written = _written(out)
    assert written.min() == 14 and 10 not in written
    reward, held, cost = _market_step(k, t, -1, 0)
    assert (out.rec_reward[14], out.rec_held[14], out.rec_cost[14]) == (reward, held, cost)
    assert out.rec_margin[14] == F32(0.375)
    np.testing.assert_array_equal(out.rec_reward[:14], SENTINEL)


def test_a_commit_without_a_break_holds_every_remaining_step():
    """Every cluster held: the base is held to the walk's end (time + rem); nothing written,
    the span pass has no rows (NONE everywhere); a base at the end stays."""
    k = _sample(1, n_steps=20)
    buffers = _on_sentinels(_buffers(20, 3))
    state = buffers.state.copy()
    state[1] = _row(START + 12, 12, 5, 1.0, 101.0)
    brk = buffers.brk.copy()
    brk[1] = [NONE, 0, 0, 0, 0]
    out = _launch(k, 3, 4, 2, buffers._replace(state=state, brk=brk))
    np.testing.assert_array_equal(out.state[0], _row(START + 20, 20, 13, 1.0, 101.0))
    np.testing.assert_array_equal(out.brk[0], [[NONE, 0, 0, 0, 0]] * 3)
    assert _written(out).size == 0
    again = _launch(k, 3, 4, 3, out)
    np.testing.assert_array_equal(again.state[1], out.state[0])
    tail = _launch(k, 3, 3, 3, out)
    np.testing.assert_array_equal(tail.state[1], out.state[0])
    assert _written(tail).size == 0


def test_held_keeps_the_position_and_counts_time_only_when_not_flat():
    s = walk_spans.row_state(np.array(_row(9, 4, 3, -1.0, 98.5), I32))
    np.testing.assert_array_equal(walk_spans.state_row(walk_spans.held(s, 5)),
                                  _row(14, 9, 8, -1.0, 98.5))
    flat = walk_spans.row_state(np.array(_row(9, 4, 0, 0.0, 98.5), I32))
    np.testing.assert_array_equal(walk_spans.state_row(walk_spans.held(flat, 5)),
                                  _row(14, 9, 0, 0.0, 98.5))
    assert [walk_spans.hold_exposure(walk_spans.row_state(np.array(_row(0, 0, 0, p, 0), I32)))
            for p in (-1.0, 0.0, 1.0)] == [0, 1, 2]


# ------------------------------------------------------------------------- validation

def _pass_kwargs(**changes):
    k = _sample(0, n_steps=12)
    buffers = _buffers(12, 2)
    state = buffers.state.copy()
    state[0] = _row(START + 4, 4, 0, 0.0, 0.0)  # pass 1 reads state[0], brk[0]
    brk = buffers.brk.copy()
    brk[0] = [[3, 2, 1, 0, 0], [NONE, 0, 0, 0, 0]]
    out = {**k, "n_chunks": 2, "n_passes": 3, "pass_index": 1, "hold_rows": 4,
           **dict(zip(walk_spans.WalkSpansState._fields, buffers._replace(state=state, brk=brk)))}
    out.update(changes)
    return out


def _bad_state():
    state = np.zeros((2, 5), I32)
    state[0] = _row(START + 5, 4, 0, 0.0, 0.0)  # t != start + steps
    return state


def _bad_brk(row):
    brk = np.zeros((2, 2, 5), I32)
    brk[0] = [row, [NONE, 0, 0, 0, 0]]
    return brk


BAD = [
    ("n_chunks", {"n_chunks": 0}), ("n_chunks", {"n_chunks": 2.0}),
    ("n_passes", {"n_passes": -1}), ("pass_index", {"pass_index": 4}),
    ("pass_index", {"pass_index": -1}), ("pass_index", {"pass_index": True}),
    ("hold_rows", {"hold_rows": 0}), ("hold_rows", {"hold_rows": 17}),
    ("state", {"state": np.zeros((2, 4), I32)}), ("state", {"state": np.zeros((2, 5), F32)}),
    ("state", {"state": _bad_state()}),
    ("brk", {"brk": np.zeros((2, 3, 5), I32)}), ("brk", {"brk": np.zeros((2, 2, 5), np.int64)}),
    ("brk", {"brk": _bad_brk([8, 2, 1, 0, 0])}),  # 8 steps left after step 4
    ("brk", {"brk": _bad_brk([-1, 2, 1, 0, 0])}),
    ("brk", {"brk": _bad_brk([3, 3, 1, 0, 0])}),  # exposure 3 of 3 actions
    ("brk", {"brk": _bad_brk([3, 2, 1, 1, 0])}),  # urgency of a missing branch
    ("rec_reward", {"rec_reward": np.zeros(11, F32)}),
    ("rec_held", {"rec_held": np.zeros(12, np.float64)}),
    ("rec_cost", {"rec_cost": np.zeros((12, 1), F32)}),
    ("rec_margin", {"rec_margin": np.zeros(13, F32)}),
    ("n_steps", {"n_steps": 10_000}), ("start", {"start": -1}),
]


@pytest.mark.parametrize("name, changes", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_pass_errors_name_the_argument(name, changes):
    with pytest.raises(ValueError, match=name) as err:
        walk_spans.greedy_walk_spans_pass(**_pass_kwargs(**changes))
    assert "\n" not in str(err.value)


def test_the_valid_pass_kwargs_run():
    out = walk_spans.greedy_walk_spans_pass(**_pass_kwargs())
    np.testing.assert_array_equal(out.state[1, :2], [START + 8, 8])  # row 7 committed


@pytest.mark.parametrize("name, value", [("n_chunks", 0), ("n_passes", -1), ("hold_rows", 0),
                                         ("hold_rows", 17), ("n_steps", -1)])
def test_walk_errors_name_the_argument(name, value):
    kwargs = {**_sample(), "n_chunks": 2, "n_passes": 2, "hold_rows": 4, name: value}
    with pytest.raises(ValueError, match=name) as err:
        walk_spans.greedy_walk_spans_walk(**kwargs)
    assert "\n" not in str(err.value)


def test_the_spans_kernel_mapping_names_the_pass():
    assert walk_spans.SPANS_KERNELS == {"greedy_walk_spans": walk_spans.greedy_walk_spans_pass}
    assert walk_spans.NONE == NONE
