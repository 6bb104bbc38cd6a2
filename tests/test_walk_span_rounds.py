"""The evaluator's fused walk on the CPU (issue 20): ``walk_spans.greedy_walk_spans_pass``'s span
launches, then ``walk_rounds.greedy_walk_round``'s rounds with the spans' buffers as their base
(``span_state``, ``span_brk``), against the sequential ``walk.greedy_walk``.

Agents (test_walk_spans' networks): a random tiny network that trades, the same made to buy and
hold (the spans walk every step: the rounds find none left), and the hand network (exposure =
the bar's first feature ``f0``) on a pattern that holds long for a stretch and then trades every
bar or two (the spans commit the stretch, the rounds walk the trades from a held position).
"""

from __future__ import annotations

import numpy as np
import pytest

from foxhunt.reference.kernels import walk, walk_rounds, walk_spans
from test_walk_chunks import _per_branch_sample
from test_walk_spans import (
    NONE,
    SENTINEL,
    START,
    _bad_brk,
    _bits,
    _buffers,
    _buy_and_hold,
    _hand_sample,
    _launch,
    _on_sentinels,
    _row,
    _sample,
    _same,
    _variant,
    _written,
)

F32, I32 = np.float32, np.int32
#: The hand network's exposures: long for 30 bars, then trades every bar or two (60 steps).
MIXED = [1] * 30 + [-1, -1, 1, 0, 0, -1, 1, 1, -1, 1, 1, 1, -1, -1, 0, 1, -1, 1, 1, 0,
                    -1, 1, 0, 0, -1, -1, 1, -1, 0, 1]
#: (span clusters, span launches, chunks = rounds): the evaluator's (16, 8, 16) among them.
GPC = [(4, 2, 4), (3, 5, 6), (16, 8, 16)]


def _agent(name: str, bf16: bool) -> dict:
    if name == "mixed":
        return {**_hand_sample(MIXED), "bf16": bf16}
    trading = _variant(5, (3, 2), bf16)
    return trading if name == "trading" else _buy_and_hold(trading)


def _spans(k, G, P, margins=True):
    """The span buffers after launches ``0 .. P - 1`` (from zeros; no tail)."""
    buffers = _buffers(k["n_steps"], G)
    if not margins:
        buffers = buffers._replace(rec_margin=None)
    for p in range(P):
        buffers = _launch(k, G, P, p, buffers)
    return buffers


def _round(k, C, r, spans, G, P, trace, ends, recs):
    """Round ``r`` on ``C`` chunks with the span base of ``spans`` (G clusters, P launches)."""
    return walk_rounds.greedy_walk_round(
        **k, n_chunks=C, round=r, span_chunks=G, span_passes=P, span_state=spans.state,
        span_brk=spans.brk, trace=trace, ends=ends, rec_reward=recs[0], rec_held=recs[1],
        rec_cost=recs[2], rec_margin=recs[3])


def _rounds(k, G, P, C, spans):
    """Rounds ``0 .. C - 1`` after ``spans``, from zeroed trace and ends: each round's state."""
    state = walk_rounds.WalkRoundState(np.zeros((k["n_steps"], 3), I32),
                                       np.zeros((2, C, 3), I32), *spans[2:])
    out = []
    for r in range(C):
        state = _round(k, C, r, spans, G, P, state.trace, state.ends, state[2:])
        out.append(state)
    return out


def _base(k, G, P, spans):
    """The rounds' base: the state the span walk's launch P commits (its step 1)."""
    return walk_spans.row_state(_launch(k, G, P, P, spans).state[P & 1])


# ------------------------------------------------------------- composite == greedy_walk

@pytest.mark.parametrize("G, P, C", GPC)
@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
@pytest.mark.parametrize("agent", ["holding", "trading", "mixed"])
def test_spans_then_rounds_are_the_sequential_walk_bit_for_bit(agent, bf16, G, P, C):
    k = _agent(agent, bf16)
    ref = walk.greedy_walk(**k)
    n = k["n_steps"]
    trades = int((np.diff(ref.positions) != 0).sum())
    spans = _spans(k, G, P)
    base = int(_base(k, G, P, spans).steps[0])
    if agent == "holding":  # the spans walk everything: the rounds see no step left
        assert (ref.positions == 1).mean() > 0.8 and base == n
    elif agent == "trading":
        assert trades > 5 and base < n
    else:
        np.testing.assert_array_equal(ref.positions, MIXED)
        # the spans commit the long stretch; the rounds start from a held position
        assert 30 < base < n and _base(k, G, P, spans).position[0] != 0
    rounds = _rounds(k, G, P, C, spans)
    assert _same(rounds[-1][2:], ref)
    got = walk_rounds.greedy_walk_spans_and_rounds(**k, span_chunks=G, span_passes=P,
                                                   hold_rows=4, n_chunks=C, rounds=C)
    assert _same(got, ref)
    if agent == "mixed":  # not vacuous: a chunk's flat guess was wrong (a held position)
        assert not _same(rounds[0][2:], ref)


@pytest.mark.parametrize("G, P, C", GPC)
def test_a_support_per_branch_is_the_sequential_walk_bit_for_bit(G, P, C):
    """The conformance ``odd`` sample (distinct supports, ``z_stride = NA``): spans, then
    rounds on their base."""
    k = _per_branch_sample()
    ref = walk.greedy_walk(**k)
    assert int((np.diff(ref.positions) != 0).sum()) > 5
    got = walk_rounds.greedy_walk_spans_and_rounds(**k, span_chunks=G, span_passes=P,
                                                   hold_rows=4, n_chunks=C, rounds=C)
    assert _same(got, ref)


@pytest.mark.parametrize("agent", ["trading", "mixed"])
def test_without_a_margin_buffer_the_rest_is_the_same(agent):
    k, (G, P, C) = _agent(agent, True), GPC[1]
    with_m = _rounds(k, G, P, C, _spans(k, G, P))
    without = _rounds(k, G, P, C, _spans(k, G, P, margins=False))
    for a, b in zip(with_m, without):
        assert b.rec_margin is None and _same(b[:-1], a[:-1])
    assert _same(without[-1][2:5], walk.greedy_walk(**k)[:3])


def test_the_mixed_agent_converges_in_two_rounds():
    """Round 1 reruns each chunk from its predecessor's end and merges within a bar or two
    (the hand network's position is f0 whatever it held); round 2 finds nothing to walk."""
    k, (G, P, C) = _agent("mixed", True), (16, 8, 16)
    ref = walk.greedy_walk(**k)
    spans = _spans(k, G, P)
    rounds = _rounds(k, G, P, C, spans)
    assert _same(rounds[1][2:], ref)
    again = _round(k, C, 2, spans, G, P, rounds[1].trace, rounds[1].ends,
                   _on_sentinels(spans)[2:])
    assert _written(again).size == 0


# ------------------------------------------------------------------------- by hand

def test_the_base_and_round_0_s_rows_by_hand():
    """f0 = 1 x 10, then -1 0 1 -1 0 0 (16 steps), G = 2, P = 2. Launch 0 breaks at step 0
    (buy); launch 1, long from step 1, breaks at step 10 (f0 = -1). The rounds' base commits
    step 10 (the short sale at close[START + 10]): S is short since 1 bar at step 11. Round 0
    writes row 10 and rows 11-15 (chunk 0 from S, the other from flat); round 1 reruns chunk
    1 and never row 10 again; trace[11] is S's key."""
    pattern = [1] * 10 + [-1, 0, 1, -1, 0, 0]
    k = _hand_sample(pattern)
    c = k["close"]
    ref = walk.greedy_walk(**k)
    np.testing.assert_array_equal(ref.positions, pattern)
    G, P, C = 2, 2, 3
    spans = _spans(k, G, P)
    np.testing.assert_array_equal(spans.brk[1][:, 0], [NONE, 9])  # step 1 + 9
    r0 = _round(k, C, 0, spans, G, P, np.zeros((16, 3), I32), np.zeros((2, C, 3), I32),
                _on_sentinels(spans)[2:])
    np.testing.assert_array_equal(_written(r0), np.arange(10, 16))
    assert (r0.rec_held[10], r0.rec_margin[10]) == (-1.0, ref.margins[10])
    np.testing.assert_array_equal(r0.trace[11], [1, _bits(-1.0), _bits(c[START + 10])])
    np.testing.assert_array_equal(r0.trace[:11], 0)  # rows below the base: not the rounds'
    # chunks [11, 13), [13, 15), [15, 16): chunk 0 from S is exact; chunk 1's flat guess at 13
    np.testing.assert_array_equal(r0.trace[13], 0)
    r1 = _round(k, C, 1, spans, G, P, r0.trace, r0.ends, _on_sentinels(spans)[2:])
    assert 10 not in _written(r1) and 13 in _written(r1)
    np.testing.assert_array_equal(r1.ends[1, 0], r0.ends[0, 0])  # chunk 0 stands
    final = _rounds(k, G, P, C, spans)[-1]
    assert _same(final[2:], ref)


def test_a_base_at_the_walk_s_end_writes_nothing():
    """The spans held every remaining step (no break): the base is the walk's end; every round
    writes no row, no trace and no end."""
    k = _agent("holding", True)
    G, P, C = 3, 2, 4
    spans = _spans(k, G, P)
    assert spans.state[1, 1] < k["n_steps"] and (spans.brk[1][:, 0] == NONE).all()
    trace, ends = np.full((k["n_steps"], 3), 7, I32), np.full((2, C, 3), 9, I32)
    for r in range(3):
        out = _round(k, C, r, spans, G, P, trace, ends, _on_sentinels(spans)[2:])
        assert _written(out).size == 0
        assert (out.trace == 7).all() and (out.ends == 9).all()


def test_a_break_at_the_last_step_is_round_0_s_only_row():
    """state[src]: long since 2 bars at step n - 4; the first break at row 3 (step n - 1, the
    last): round 0 commits it (a market sale to flat, the stored margin) and has no step left;
    round 1 writes nothing."""
    k = _sample(1)
    n, G, P, C = k["n_steps"], 2, 3, 4
    spans = _on_sentinels(_buffers(n, G))
    src = (P - 1) & 1
    state, brk = spans.state.copy(), spans.brk.copy()
    state[src] = _row(START + n - 4, n - 4, 2, 1.0, 99.5)
    brk[src] = [[NONE, 0, 0, 0, 0], [3, 1, 0, 0, _bits(0.25)]]
    brk[1 - src] = 77  # the other parity is not read
    spans = spans._replace(state=state, brk=brk)
    trace, ends = np.zeros((n, 3), I32), np.zeros((2, C, 3), I32)
    r0 = _round(k, C, 0, spans, G, P, trace, ends, spans[2:])
    np.testing.assert_array_equal(_written(r0), [n - 1])
    assert r0.rec_held[n - 1] == 0.0 and r0.rec_cost[n - 1] > 0 and r0.rec_margin[n - 1] == 0.25
    assert (r0.trace == 0).all() and (r0.ends == 0).all()
    # the same row as the span walk's own commit (its launch P)
    tail = _launch(k, G, P, P, spans)
    assert _same(r0[2:], tail[2:])
    r1 = _round(k, C, 1, spans, G, P, trace, ends, _on_sentinels(spans)[2:])
    assert _written(r1).size == 0


def test_the_round_does_not_modify_the_span_buffers():
    k, (G, P, C) = _agent("mixed", False), GPC[0]
    spans = _spans(k, G, P)
    copies = [x.copy() for x in spans]
    _rounds(k, G, P, C, spans)
    assert _same(spans, copies)


# ------------------------------------------------------------------------- validation

def _round_kwargs(**changes):
    k = _sample(0, n_steps=12)
    spans = _buffers(12, 2)
    state = spans.state.copy()
    state[0] = _row(START + 4, 4, 0, 0.0, 0.0)  # span_passes 1 reads state[0], brk[0]
    brk = spans.brk.copy()
    brk[0] = [[3, 2, 1, 0, 0], [NONE, 0, 0, 0, 0]]
    rounds = walk_rounds.WalkRoundState(np.zeros((12, 3), I32), np.zeros((2, 3, 3), I32),
                                        *spans[2:])
    out = {**k, "n_chunks": 3, "round": 0, "span_chunks": 2, "span_passes": 1,
           "span_state": state, "span_brk": brk, **rounds._asdict()}
    out.update(changes)
    return out


BAD = [
    ("span_brk", {"span_brk": None}), ("span_state", {"span_state": None}),
    ("span_chunks", {"span_chunks": 0}), ("span_passes", {"span_passes": 0}),
    ("span_passes", {"span_passes": 1.0}),
    ("span_chunks", {**walk_rounds.NO_SPAN_BASE, "span_chunks": 2}),
    ("span_passes", {**walk_rounds.NO_SPAN_BASE, "span_passes": 1}),
    ("span_state", {"span_state": np.zeros((2, 4), I32)}),
    ("span_state", {"span_state": np.zeros((2, 5), F32)}),
    ("span_state", {"span_state": np.array([_row(START + 5, 4, 0, 0.0, 0.0)] * 2, I32)}),
    ("span_brk", {"span_brk": np.zeros((2, 3, 5), I32)}),
    ("span_brk", {"span_brk": _bad_brk([8, 2, 1, 0, 0])}),  # 8 steps left after step 4
    ("span_brk", {"span_brk": _bad_brk([3, 3, 1, 0, 0])}),  # exposure 3 of 3 actions
]


@pytest.mark.parametrize("name, changes", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_span_base_errors_name_the_argument(name, changes):
    with pytest.raises(ValueError, match=name) as err:
        walk_rounds.greedy_walk_round(**_round_kwargs(**changes))
    assert "\n" not in str(err.value)


def test_the_valid_round_kwargs_run():
    """Step 4 + 3 committed, steps 8 .. 11 walked in the chunks."""
    rows = np.full(12, SENTINEL)
    out = walk_rounds.greedy_walk_round(**_round_kwargs(rec_reward=rows, rec_held=rows,
                                                        rec_cost=rows, rec_margin=rows))
    np.testing.assert_array_equal(_written(out), np.arange(7, 12))


@pytest.mark.parametrize("name, value", [("span_chunks", 0), ("span_passes", 0),
                                         ("n_chunks", 0), ("rounds", 0)])
def test_composition_errors_name_the_argument(name, value):
    kwargs = {**_sample(), "span_chunks": 2, "span_passes": 2, "hold_rows": 4, "n_chunks": 2,
              "rounds": 2, name: value}
    with pytest.raises(ValueError, match=name):
        walk_rounds.greedy_walk_spans_and_rounds(**kwargs)

