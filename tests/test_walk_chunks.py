"""The chunked (speculative) greedy walk's reference twin (issue 20):
``walk_rounds.greedy_walk_round`` (one round, walk.cu's ``greedy_walk_round``) and
``walk_rounds.greedy_walk_chunked`` (the rounds composed) against the sequential
``walk.greedy_walk``, on the CPU.

Two kinds of network. The conformance samples' random tiny network reads every state column
(position, unrealised PnL, time). And a hand-built one whose action is a function of the bar's
first market feature alone (``f0 = +1``: long, ``-1``: short, ``0``: flat; always a market
order, which always fills), so the positions held are ``f0`` bar by bar: a walk that holds
positions across the chunk boundaries, whose keys and merge points can be derived by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from foxhunt.conformance.kernel_spec import case_dims
from foxhunt.conformance.specs.walk import CHUNKED_ENTRIES, ENTRIES, chunk_ties
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import walk, walk_rounds
from foxhunt.reference.kernels.env import EnvState
from foxhunt.reference.layout import ParamLayout, branch_name

F32, I32 = np.float32, np.int32
WALK = {e.name: e for e in ENTRIES}["greedy_walk"]
CHUNKED = {e.name: e for e in CHUNKED_ENTRIES}["greedy_walk_chunked"]
START = 3
NO_BASE = walk_rounds.NO_SPAN_BASE  # the rounds from step 0 (no span walk before them)
#: The hand network's exposure per step: runs of long (1), short (-1) and flat (0), 60 steps.
RUNS = ((1, 5), (-1, 6), (1, 7), (0, 2), (-1, 9), (1, 5), (-1, 6), (0, 3), (1, 8), (-1, 9))
PATTERN = np.concatenate([np.full(n, e, F32) for e, n in RUNS])


def _sample(seed=0, **changes):
    kwargs = WALK.sample(case_dims("tiny"), np.random.default_rng(seed))
    kwargs.update(changes)
    return kwargs


def _hand_network(kwargs):
    """Parameters of the tiny network: ``h1 = (relu(f0), relu(-f0))``, copied to ``h2`` and to
    the exposure head's hidden row; the exposure logits tilt the atoms by ``z * relu(f0)``
    (long), ``z * relu(-f0)`` (short) and ``z / 2`` (flat, a bias), so the largest tilt (the
    largest expected Q) wins; the order head's bias tilts market by ``z / 2``."""
    config = DQNConfig.preset("tiny")
    layout = ParamLayout(config)
    params = layout.zeros()
    v = layout.views(params)
    z, na = kwargs["z"], config.num_atoms
    exposure, order = branch_name(0), branch_name(1)
    v["w_s1"][0, 0], v["w_s1"][1, 0] = 1.0, -1.0
    v["w_s2"][0, 0] = v["w_s2"][1, 1] = 1.0
    v[f"w_{exposure}1"][0, 0] = v[f"w_{exposure}1"][1, 1] = 1.0
    v[f"w_{exposure}2"][2 * na:3 * na, 0] = z  # long
    v[f"w_{exposure}2"][0:na, 1] = z  # short
    v[f"b_{exposure}2"][na:2 * na] = z / 2  # flat
    v[f"b_{order}2"][0:na] = z / 2  # market
    return params


def _hand_sample(pattern=PATTERN, seed=0):
    """The hand network on a table whose bars ``START + k`` have ``f0 = pattern[k]``."""
    n = pattern.shape[0]
    kwargs = _sample(seed)
    T = START + n + 1
    features = np.random.default_rng(seed).standard_normal((T, kwargs["features"].shape[1]))
    features[START:START + n, 0] = pattern
    assert kwargs["close"].shape[0] >= T
    return {**kwargs, "params": _hand_network(kwargs), "features": features.astype(F32),
            "close": kwargs["close"][:T], "high": kwargs["high"][:T], "low": kwargs["low"][:T],
            "start": START, "n_steps": n}


def _buffers(n_steps, n_chunks):
    return walk_rounds.WalkRoundState(np.zeros((n_steps, 3), I32), np.zeros((2, n_chunks, 3), I32),
                                      *(np.zeros(n_steps, F32) for _ in range(4)))


def _rounds(kwargs, n_chunks, rounds):
    """The buffers after each of ``rounds`` rounds (from zeros)."""
    state, out = _buffers(kwargs["n_steps"], n_chunks), []
    for r in range(rounds):
        state = walk_rounds.greedy_walk_round(
            **kwargs, **NO_BASE, n_chunks=n_chunks, round=r,
            **dict(zip(walk_rounds.WalkRoundState._fields, state)))
        out.append(state)
    return out


#: Record values no step writes (positions are -1, 0 or 1): rows a round leaves alone.
SENTINEL = F32(-7.0)


def _round_on_sentinels(kwargs, n_chunks, r, state):
    """Round ``r`` on ``state``'s trace and ends with every record row set to SENTINEL."""
    rows = np.full(kwargs["n_steps"], SENTINEL)
    return walk_rounds.greedy_walk_round(**kwargs, **NO_BASE, n_chunks=n_chunks, round=r,
                                         trace=state.trace, ends=state.ends, rec_reward=rows,
                                         rec_held=rows, rec_cost=rows, rec_margin=rows)


def _steps_walked(state):
    """Which steps a round on SENTINEL records walked (all four records written, or none)."""
    written = [rec != SENTINEL for rec in state[2:]]
    assert all((w == written[1]).all() for w in written)
    return written[1]


def _same(a, b):
    return all(x.tobytes() == y.tobytes() for x, y in zip(a, b))


def _key(time, position, entry):
    return np.array([time, np.float32(position).view(I32), np.float32(entry).view(I32)], I32)


def test_the_hand_network_holds_the_pattern():
    k = _hand_sample()
    rec = walk.greedy_walk(**k)
    np.testing.assert_array_equal(rec.positions, PATTERN)
    assert walk.first_near_tie(rec.margins, k["z"], k["bf16"]) == k["n_steps"]


def _per_branch_sample(seed=0):
    """The conformance ``odd`` sample: distinct supports per branch, ``z_stride = NA``."""
    kwargs = WALK.sample(case_dims("odd"), np.random.default_rng(seed))
    assert kwargs["z_stride"] == kwargs["dims"][5] and kwargs["z"].ndim == 2
    return kwargs


@pytest.mark.parametrize("n_chunks", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("network", ["hand", "random", "per-branch"])
def test_n_chunks_rounds_are_the_sequential_walk_bit_for_bit(network, n_chunks):
    k = {"hand": _hand_sample, "random": lambda: _sample(seed=1),
         "per-branch": lambda: _per_branch_sample(seed=4)}[network]()
    ref = walk.greedy_walk(**k)
    got = walk_rounds.greedy_walk_chunked(**k, n_chunks=n_chunks, rounds=n_chunks)
    assert _same(got, ref)
    # not vacuous: some chunk's true start (the state after its predecessor's last step) is
    # not flat, so its round-0 guess was wrong
    starts = [walk_rounds.chunk_steps(k["n_steps"], n_chunks, g)[0] for g in range(1, n_chunks)]
    assert n_chunks == 1 or any(ref.positions[k0 - 1] != 0 for k0 in starts)


def test_round_one_reruns_stop_where_the_runs_meet_as_derived_by_hand():
    """Round 1 reruns chunk g from inp (its predecessor's round-0 end) and merges with its
    round-0 run (flat at k0; both take the action f0 of each bar). The two differ until the
    first step m >= k0 where the rerun trades (f0 != the position before it: k0 if f0[k0] !=
    inp's position): there both fill at close[m] (time 1, or flat), or the round-0 run stays
    flat as the rerun goes flat. So it rewrites rows k0 .. m (to k1 without a merge); an inp
    that is flat equals trace[k0] and the chunk is skipped."""
    k, n_chunks = _hand_sample(), 8
    r0 = _rounds(k, n_chunks, 1)[0]
    r1 = _round_on_sentinels(k, n_chunks, 1, r0)
    merged_early = held_start = 0
    for g in range(1, n_chunks):
        k0, k1 = walk_rounds.chunk_steps(k["n_steps"], n_chunks, g)
        position_in = r0.ends[0, g - 1, 1:2].view(F32)[0]
        changed = _steps_walked(r1)[k0:k1].sum()
        assert (r0.trace[k0:k1] != r1.trace[k0:k1]).any(axis=1).sum() == changed
        if position_in == 0:
            assert changed == 0
            continue
        held_start += 1
        before = np.concatenate([[position_in], PATTERN[k0:k1 - 1]])
        m = k0 + int(np.argmax(PATTERN[k0:k1] != before)) if (PATTERN[k0:k1] != before).any() \
            else k1
        assert changed == min(m + 1, k1) - k0, g
        merged_early += changed < k1 - k0
        assert (r1.ends[1, g] == r0.ends[0, g]).all() if m + 1 < k1 else True
    assert held_start >= 2 and merged_early >= 2


def test_two_chunks_trace_and_ends_by_hand():
    """Bars f0 = 1 1 1 1 | 1 1 -1 0, chunks [0, 4) and [4, 8); c_k = close[START + k]."""
    pattern = np.array([1, 1, 1, 1, 1, 1, -1, 0], F32)
    k = _hand_sample(pattern)
    c = k["close"][START:]
    r0, r1, r2 = _rounds(k, 2, 3)
    flat = np.zeros(3, I32)
    # round 0: chunk 0 opens long at c0; chunk 1 opens long at c4 from its flat guess, flips
    # short at c6 and closes at c7 (flat: the entry is dropped from the key)
    want0 = [flat, _key(1, 1, c[0]), _key(2, 1, c[0]), _key(3, 1, c[0]),
             flat, _key(1, 1, c[4]), _key(2, 1, c[4]), _key(1, -1, c[6])]
    np.testing.assert_array_equal(r0.trace, np.stack(want0))
    np.testing.assert_array_equal(r0.ends[0], np.stack([_key(4, 1, c[0]), flat]))
    np.testing.assert_array_equal(r0.ends[1], 0)
    # round 1: chunk 1 reruns from (4, long, c0), walks steps 4..6 and merges at row 7
    want1 = want0[:4] + [_key(4, 1, c[0]), _key(5, 1, c[0]), _key(6, 1, c[0]), want0[7]]
    np.testing.assert_array_equal(r1.trace, np.stack(want1))
    np.testing.assert_array_equal(np.flatnonzero(_steps_walked(_round_on_sentinels(k, 2, 1, r0))),
                                  [4, 5, 6])
    np.testing.assert_array_equal(r1.ends[1], r0.ends[0])
    np.testing.assert_array_equal(r1.ends[0], r0.ends[0])
    # the guess opened a position at row 4 (a cost); the true walk held it (none)
    assert r0.rec_cost[4] > 0 and r1.rec_cost[4] == 0
    assert _same(r1[2:], walk.greedy_walk(**k))
    # round 2: inp == trace[4]: skipped, ends copied to buffer 0
    assert _same(r2[:1] + r2[2:], r1[:1] + r1[2:])
    np.testing.assert_array_equal(r2.ends[0], r1.ends[1])


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_after_r_rounds_chunk_g_is_the_walk_from_flat_at_chunk_g_minus_r_plus_1(seed, rounds):
    k, n_chunks = _sample(seed), 4
    got = walk_rounds.greedy_walk_chunked(**k, n_chunks=n_chunks, rounds=rounds)
    for g in range(n_chunks):
        k0, k1 = walk_rounds.chunk_steps(k["n_steps"], n_chunks, g)
        h0 = walk_rounds.chunk_steps(k["n_steps"], n_chunks, max(0, g - rounds + 1))[0]
        ref = walk.greedy_walk(**{**k, "start": k["start"] + h0, "n_steps": k1 - h0})
        for a, b in zip(got, ref):
            assert a[k0:k1].tobytes() == b[k0 - h0:].tobytes(), (g, rounds)


def test_fewer_rounds_than_chunks_differ_from_the_sequential_walk():
    k = _hand_sample()
    ref = walk.greedy_walk(**k)
    assert not _same(walk_rounds.greedy_walk_chunked(**k, n_chunks=8, rounds=1), ref)


def test_a_round_after_convergence_changes_nothing_and_steps_nowhere():
    k, n_chunks = _sample(seed=1), 5
    done = _rounds(k, n_chunks, n_chunks + 1)[-1]  # one more: both ends buffers converged
    for r in (n_chunks + 1, n_chunks + 2):
        out = _round_on_sentinels(k, n_chunks, r, done)
        np.testing.assert_array_equal(out.trace, done.trace)
        np.testing.assert_array_equal(out.ends, done.ends)
        assert not _steps_walked(out).any()  # every chunk skipped: no record row written


@pytest.mark.parametrize("entry", [0.0, 101.25, -5.0, np.inf, np.nan, 3e38])
def test_a_flat_state_s_entry_price_changes_nothing(entry):
    """From (0, 0, e) the records, trace and end are those from flat (and greedy_walk's from
    that bar); the random network reads the PnL column, where an entry of a held position
    does change the margins."""
    k, n_chunks, g = _sample(seed=2), 2, 1
    k0, k1 = walk_rounds.chunk_steps(k["n_steps"], n_chunks, g)

    def from_key(key):
        state = _buffers(k["n_steps"], n_chunks)
        ends = state.ends.copy()
        ends[0, 0] = key
        trace = np.full_like(state.trace, -1)  # no key has time -1: no skip, no merge
        return walk_rounds.greedy_walk_round(
            **k, **NO_BASE, n_chunks=n_chunks, round=1, trace=trace, ends=ends,
            **dict(zip(walk_rounds.WalkRoundState._fields[2:], state[2:])))

    flat = from_key(np.zeros(3, I32))
    got = from_key(_key(0, 0.0, entry))
    assert walk_rounds.key_state(_key(0, 0.0, entry), k["start"], k0).entry_price.tobytes() == \
        np.float32(entry).tobytes()
    assert _same(got[2:], flat[2:]) and _same(got[:1], flat[:1])  # records, trace
    np.testing.assert_array_equal(got.ends[1, 1], flat.ends[1, 1])  # chunk 1's end
    ref = walk.greedy_walk(**{**k, "start": k["start"] + k0, "n_steps": k1 - k0})
    for a, b in zip(got[2:], ref):
        assert a[k0:].tobytes() == b.tobytes()
    held_a, held_b = from_key(_key(1, 1.0, 90.0)), from_key(_key(1, 1.0, 110.0))
    assert held_a.rec_margin[k0] != held_b.rec_margin[k0]


def test_walk_key_and_key_state_are_inverse_and_drop_a_flat_entry():
    state = EnvState(np.array([9], I32), np.array([4], I32), np.array([3], I32),
                     np.array([-1.0], F32), np.array([98.5], F32))
    key = walk_rounds.walk_key(state)
    np.testing.assert_array_equal(key, _key(3, -1.0, 98.5))
    back = walk_rounds.key_state(key, 5, 4)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(back, state))
    flat = state._replace(position=np.zeros(1, F32), time_in_position=np.zeros(1, I32))
    np.testing.assert_array_equal(walk_rounds.walk_key(flat), walk_rounds.FLAT_KEY)


@pytest.mark.parametrize("n_steps, n_chunks", [(5, 8), (1, 3), (0, 2)])
def test_more_chunks_than_steps_leave_the_empty_chunks_alone(n_steps, n_chunks):
    k = _sample(seed=3, n_steps=n_steps)
    state = _rounds(k, n_chunks, n_chunks)[-1] if n_steps else None
    ref = walk.greedy_walk(**k)
    assert _same(walk_rounds.greedy_walk_chunked(**k, n_chunks=n_chunks, rounds=n_chunks), ref)
    if state is not None:
        busy = -(-n_steps // (-(-n_steps // n_chunks)))  # chunks with steps
        np.testing.assert_array_equal(state.ends[:, busy:], 0)


def test_without_a_margin_buffer_the_rest_is_the_same():
    k, n_chunks = _sample(seed=1), 3
    state = _buffers(k["n_steps"], n_chunks)
    for r in range(n_chunks):
        with_m = walk_rounds.greedy_walk_round(
            **k, **NO_BASE, n_chunks=n_chunks, round=r,
            **dict(zip(walk_rounds.WalkRoundState._fields, state)))
        without = walk_rounds.greedy_walk_round(
            **k, **NO_BASE, n_chunks=n_chunks, round=r,
            **dict(zip(walk_rounds.WalkRoundState._fields[:-1], state[:-1])), rec_margin=None)
        assert without.rec_margin is None and _same(without[:-1], with_m[:-1])
        state = with_m


def test_the_round_does_not_modify_its_inputs():
    k, n_chunks = _sample(seed=1), 3
    state = _rounds(k, n_chunks, 1)[0]
    copies = [a.copy() for a in state]
    walk_rounds.greedy_walk_round(**k, **NO_BASE, n_chunks=n_chunks, round=1,
                                  **dict(zip(walk_rounds.WalkRoundState._fields, state)))
    assert _same(state, copies)


# ------------------------------------------------------------------------- validation

def _round_kwargs():
    k = _sample(seed=0, n_steps=6)
    return {**k, "n_chunks": 2, "round": 1, **NO_BASE,
            **dict(zip(walk_rounds.WalkRoundState._fields, _buffers(6, 2)))}


BAD_ROUND = [
    ("n_chunks", 0), ("n_chunks", 2.0), ("round", -1), ("round", True),
    ("trace", np.zeros((6, 3), np.int64)), ("trace", np.zeros((5, 3), I32)),
    ("ends", np.zeros((2, 3, 3), I32)), ("ends", np.zeros((2, 2, 3), F32)),
    ("rec_reward", np.zeros(5, F32)), ("rec_held", np.zeros(6, np.float64)),
    ("rec_cost", np.zeros((6, 1), F32)), ("rec_margin", np.zeros(7, F32)),
    ("n_steps", 10_000), ("start", -1),
]


@pytest.mark.parametrize("name, value", BAD_ROUND, ids=[f"{n}-{i}" for i, (n, _) in
                                                         enumerate(BAD_ROUND)])
def test_round_errors_name_the_argument(name, value):
    with pytest.raises(ValueError, match=name) as err:
        walk_rounds.greedy_walk_round(**{**_round_kwargs(), name: value})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name, value", [("n_chunks", 0), ("rounds", 0), ("rounds", "2"),
                                         ("n_steps", -1)])
def test_chunked_errors_name_the_argument(name, value):
    with pytest.raises(ValueError, match=name):
        walk_rounds.greedy_walk_chunked(**{**_sample(), "n_chunks": 2, "rounds": 2, name: value})


# ------------------------------------------------------------- the conformance entry

@pytest.mark.parametrize("case", ["tiny", "seed"])
def test_the_chunked_entry_s_samples_run_and_keep_its_contract(case):
    k = CHUNKED.sample(case_dims(case), np.random.default_rng(5))
    assert k["n_chunks"] == 4 and k["rounds"] in (1, 2, 4)
    assert case == "tiny" or k["rounds"] == 4
    out = walk_rounds.greedy_walk_chunked(**k)
    outputs = dict(zip(CHUNKED.output_names, out))
    assert not CHUNKED.contract(k, outputs, None)
    assert all(np.isfinite(v).all() for v in outputs.values())
    scales = CHUNKED.scales(k, outputs)
    assert scales["positions"]["exact"].mean() > 0.5  # the samples decide most steps
    for bad, exc in CHUNKED.errors(np.random.default_rng(6)):
        with pytest.raises(exc):
            walk_rounds.greedy_walk_chunked(**bad)


def test_chunk_ties_follow_each_chunk_s_walk_from_its_first_chunk():
    """A bar with f0 = 1/2 ties long and flat exactly (margin 0) at step 20, in chunk 1 of 4
    (15 steps each). rounds = 2: chunk g holds the walk from chunk max(0, g - 1), so chunk 1
    is exact before 20, chunk 2 (its walk passes step 20) nowhere, chunks 0 and 3 everywhere
    (a chunk without a tie: its end). rounds = 4: the whole walk's first tie, 20, from chunk 1
    on."""
    pattern = PATTERN.copy()
    pattern[20] = 0.5
    k = _hand_sample(pattern)
    for rounds, want in ((2, (15, 20, 20, 60)), (4, (15, 20, 20, 20))):
        kw = {**k, "n_chunks": 4, "rounds": rounds}
        out = walk_rounds.greedy_walk_chunked(**kw)
        assert out.margins[20] == 0
        np.testing.assert_array_equal(chunk_ties(kw, out.margins), np.repeat(want, 15))
        exact = CHUNKED.scales(kw, dict(zip(CHUNKED.output_names, out)))["rewards"]["exact"]
        np.testing.assert_array_equal(np.flatnonzero(~exact),
                                      np.arange(20, 45) if rounds == 2 else np.arange(20, 60))
