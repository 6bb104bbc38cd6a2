"""The collection cycle's prefix sum (``scan_tiles`` + ``scan_offsets``, issue 20): the twins
against a loop-by-loop emulation of the kernels' threads, float64 sums, the NaN/Inf contract,
and sampling on sums that are exact in any order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from foxhunt.reference.kernels import replay

F32 = np.float32
TILE, THREADS, ITEMS, WARP = 1024, 256, 4, 32


def _emulate_tile(x: list) -> list:
    """One block of the kernel, thread by thread, in np.float32 scalars (``x``: TILE values)."""
    add = lambda a, b: F32(F32(a) + F32(b))  # noqa: E731
    loc = [[F32(0)] * ITEMS for _ in range(THREADS)]
    for t in range(THREADS):
        acc = F32(x[t * ITEMS])
        loc[t][0] = acc
        for k in range(1, ITEMS):
            acc = add(acc, x[t * ITEMS + k])
            loc[t][k] = acc

    def tree(values):  # Hillis-Steele over 32 lanes, lanes past len(values) hold -0.0
        v = list(values) + [F32(-0.0)] * (WARP - len(values))
        d = 1
        while d < WARP:
            v = [add(v[i - d], v[i]) if i >= d else v[i] for i in range(WARP)]
            d *= 2
        return v

    lane_excl, warp_tot = [], []
    for w in range(THREADS // WARP):
        incl = tree([loc[w * WARP + lane][-1] for lane in range(WARP)])
        lane_excl += [F32(-0.0)] + incl[:-1]
        warp_tot.append(incl[-1])
    wincl = tree(warp_tot)
    warp_excl = [F32(-0.0)] + wincl[:-1]
    return [add(add(warp_excl[t // WARP], lane_excl[t]), loc[t][k])
            for t in range(THREADS) for k in range(ITEMS)]


def _emulate(p: np.ndarray) -> np.ndarray:
    """scan_tiles then scan_offsets, block by block, sequential offsets."""
    out, off = [], F32(-0.0)
    for start in range(0, p.size, TILE):
        chunk = list(p[start:start + TILE]) + [F32(-0.0)] * max(0, start + TILE - p.size)
        local = _emulate_tile(chunk)[:min(TILE, p.size - start)]
        out += [F32(off + v) for v in local]
        off = F32(off + local[-1])
    return np.array(out, F32)


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32)


def test_the_constants_are_the_kernels():
    assert (replay.RING_SCAN_THREADS, replay.RING_SCAN_ITEMS, replay.RING_SCAN_TILE) == (
        THREADS, ITEMS, TILE)
    src = (Path(replay.__file__).parents[2] / "cuda_src" / "replay.cuh").read_text()
    assert f"#define RING_SCAN_THREADS {THREADS}" in src and f"#define RING_SCAN_ITEMS {ITEMS}" in src


@pytest.mark.parametrize("n", [1, 5, 1023, 1024, 1025, 2 * 1024 + 3])
def test_twins_follow_the_kernels_threads_bit_for_bit(n):
    rng = np.random.default_rng(n)
    p = rng.random(n, dtype=F32) * F32(3.0)
    p[rng.random(n) < 0.1] = 0
    want = _emulate(p)
    tiles = replay.scan_tiles(p)
    ends = np.minimum(np.arange(1, -(-n // TILE) + 1) * TILE, n) - 1
    assert np.array_equal(_bits(tiles.block_sums), _bits(tiles.s[ends]))
    assert np.array_equal(_bits(replay.ring_prefix_sum(p)), _bits(want))


def test_sums_stay_within_the_rounding_bound_and_rise_across_tiles():
    rng = np.random.default_rng(7)
    n = 100_003
    p = rng.random(n, dtype=F32)
    s = replay.ring_prefix_sum(p)
    exact = np.cumsum(p.astype(np.float64))
    gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
    assert np.all(np.abs(s - exact) <= gamma * exact)
    first = np.arange(TILE, n, TILE)
    assert np.all(s[first] >= s[first - 1])


def test_nan_and_inf_propagate_to_every_later_sum_only():
    rng = np.random.default_rng(3)
    p = rng.random(3000, dtype=F32)
    clean = replay.ring_prefix_sum(p)
    for bad, at, want in ((np.nan, 1500, np.isnan), (np.inf, 700, np.isposinf),
                          (np.nan, 0, np.isnan), (np.inf, 2999, np.isposinf)):
        q = p.copy()
        q[at] = bad
        s = replay.ring_prefix_sum(q)
        assert np.all(want(s[at:])), (bad, at)
        assert np.array_equal(s[:at], clean[:at]), (bad, at)
    q = p.copy()
    q[100], q[2000] = np.inf, -np.inf
    s = replay.ring_prefix_sum(q)
    assert np.all(np.isposinf(s[100:2000])) and np.all(np.isnan(s[2000:]))


def test_sampling_unchanged_where_every_order_is_exact():
    """Integer priorities with sums below 2**24: every association is exact, so the ring scan
    equals the sequential prefix_sum bit for bit and the sampled rows are the same."""
    rng = np.random.default_rng(11)
    cap, size = 5000, 4100
    prio = np.zeros(cap, F32)
    prio[:size] = rng.integers(1, 200, size).astype(F32)
    s = replay.ring_prefix_sum(prio)
    assert np.array_equal(_bits(s), _bits(replay.prefix_sum(prio)))
    pos, cycle = np.array([size, size], np.int32), np.array([12345], np.int64)
    assert np.array_equal(replay.replay_sample(s, pos, 99, cycle, 512),
                          replay.replay_sample(replay.prefix_sum(prio), pos, 99, cycle, 512))


def test_scan_offsets_rejects_a_wrong_number_of_tile_sums():
    p = np.ones(2000, F32)
    tiles = replay.scan_tiles(p)
    with pytest.raises(ValueError, match="block_sums: shape"):
        replay.scan_offsets(tiles.s, tiles.block_sums[:1])
    with pytest.raises(ValueError, match="p: shape"):
        replay.scan_tiles(p[:0])


def test_the_collection_plan_scans_with_one_block_per_tile():
    from foxhunt.fast.kernels import replay as fast_replay

    assert fast_replay.plan_scan_tiles(50_000) == ((49,), (THREADS,), 0)
    assert fast_replay.plan_scan_offsets(1024) == ((1,), (THREADS,), 0)
