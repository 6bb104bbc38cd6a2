"""Entries of the replay kernels: the priorities' prefix sum, proportional sampling on it,
the importance weights, and the device-resident ring (adding transitions at the device cursor,
sampling with the Philox draws, gathering into the batch layout, priority updates).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, Output, SpecEntry
from foxhunt.conformance.specs.inputs import (
    F32,
    I32,
    error_cases,
    f32,
    i32,
    maxabs,
    normal,
    reduction,
    replace,
    uniform,
    wrong_dtype,
)
from foxhunt.conformance.tolerance import EXACT, REDUCTION, Tolerance

#: CUDA ``powf`` (a few ulp, not correctly rounded) against NumPy's float32 ``power`` (glibc
#: ``powf``, within 1 ulp) on the same float32 argument.
POW_ULP = Tolerance.ulp(5)


def _s_prefix(d: Dims, rng) -> Kwargs:
    p = uniform(rng, d.items, 0.0, 1.0)
    p[rng.random(d.items) < 0.1] = 0  # zero priorities are never sampled
    return {"p": p}


def _s_scan_tiles(d: Dims, rng) -> Kwargs:
    """Priorities over ``d.items`` rows, or, where that fits in one tile of the ring scan
    (``tiny``: 515), 2 tiles and 3 elements: every case crosses a tile boundary with a tail."""
    from foxhunt.reference.kernels.replay import RING_SCAN_TILE

    items = d.items if d.items > RING_SCAN_TILE else 2 * RING_SCAN_TILE + 3
    return _s_prefix(dataclasses.replace(d, items=items), rng)


def _s_scan_offsets(d: Dims, rng) -> Kwargs:
    """The tiles' scans and totals of a priority vector, as ``scan_tiles`` leaves them."""
    from foxhunt.reference.kernels.replay import scan_tiles

    return scan_tiles(_s_scan_tiles(d, rng)["p"])._asdict()


def _first_nan(x: np.ndarray) -> int:
    nan = np.flatnonzero(np.isnan(x))
    return int(nan[0]) if nan.size else x.size


def _c_scan_tiles(kwargs, outputs, poisoned) -> list[str]:
    """``block_sums[b]`` is bit for bit the scan at tile ``b``'s last element; within a tile, a
    NaN priority makes every later sum NaN. (Non-negative priorities do NOT always give
    non-decreasing sums: a thread's first sum, fl(base_{t+1} + p), can round below the previous
    thread's last, as with ``prefix_sum``'s kernel; the search stays exact against the twin.)"""
    from foxhunt.reference.kernels.replay import RING_SCAN_TILE, scan_blocks

    p, s, sums = kwargs["p"], outputs["s"], outputs["block_sums"]
    n, problems = p.size, []
    ends = np.minimum(np.arange(1, scan_blocks(n) + 1) * RING_SCAN_TILE, n) - 1
    if not np.array_equal(sums.view(np.uint32), s[ends].view(np.uint32)):
        problems.append("block_sums: not the scan at each tile's last element")
    for start in range(0, n, RING_SCAN_TILE):
        tile_p, tile_s = p[start:start + RING_SCAN_TILE], s[start:start + RING_SCAN_TILE]
        if not np.all(np.isnan(tile_s[_first_nan(tile_p):])):
            problems.append(f"s: a NaN priority in the tile at {start} leaves a later sum not NaN")
    return problems


def _c_scan_offsets(kwargs, outputs, poisoned) -> list[str]:
    """A NaN tile total makes every sum of the later tiles NaN; a NaN tile scan stays NaN;
    tile 0 is passed through bit for bit (its offset is -0.0)."""
    from foxhunt.reference.kernels.replay import RING_SCAN_TILE

    s, sums, out, problems = kwargs["s"], kwargs["block_sums"], outputs["out"], []
    first = _first_nan(sums)
    if not np.all(np.isnan(out[(first + 1) * RING_SCAN_TILE:])):
        problems.append(f"out: a NaN block_sums[{first}] leaves a later tile's sum not NaN")
    if not np.all(np.isnan(out[np.isnan(s)])):
        problems.append("out: a NaN tile scan gives a sum that is not NaN")
    head = slice(0, RING_SCAN_TILE)
    if not np.array_equal(out[head].view(np.uint32), s[head].view(np.uint32)):
        problems.append("out: tile 0 differs from its own scan")
    return problems


def _s_sample(d: Dims, rng) -> Kwargs:
    p = _s_prefix(d, rng)["p"]
    return {"prefix": np.cumsum(p, dtype=F32), "u": uniform(rng, d.batch, 0.0, 1.0)}


def _s_weights(d: Dims, rng) -> Kwargs:
    return {"priorities": uniform(rng, d.items, 0.01, 1.0),
            "idx": rng.integers(0, d.items, d.batch).astype(I32), "beta": 0.4, "n_valid": d.items}


def _state_dim(d: Dims) -> int:
    """The ring's row width: the preset's state_dim, or the case's 259 / 7 (block tails)."""
    if d.case in ("tiny", "seed"):
        from foxhunt.reference.config import DQNConfig

        return DQNConfig.preset(d.case).state_dim
    return d.hidden if d.case == "odd" else d.w_out


def _ring(d: Dims, rng) -> Kwargs:
    """A ring of ``d.items`` rows and 3 branches, a random share filled (priorities zero beyond
    the filled rows), the cursor a few rows before the end (an add wraps around)."""
    cap, sd = d.items, _state_dim(d)
    size = int(rng.integers(d.batch, cap + 1))
    prio = np.zeros(cap, F32)
    prio[:size] = uniform(rng, size, 0.05, 2.0)
    return {"ring_s": normal(rng, (cap, sd)), "ring_a": rng.integers(0, 3, (cap, 3)).astype(I32),
            "ring_r": normal(rng, cap), "ring_s2": normal(rng, (cap, sd)),
            "ring_done": (rng.random(cap) < 0.1).astype(F32), "ring_next_ret": normal(rng, cap, 0.01),
            "ring_regime": rng.integers(0, 3, cap).astype(I32),
            "ring_discount": uniform(rng, cap, 0.9, 1.0), "priority": prio,
            "ring_pos": np.array([cap - min(cap, 3), size], I32)}


def _s_add(d: Dims, rng) -> Kwargs:
    ring = _ring(d, rng)
    n, sd = min(d.batch, d.items), ring["ring_s"].shape[1]
    return {"s": normal(rng, (n, sd)), "a": rng.integers(0, 3, (n, 3)).astype(I32),
            "r": normal(rng, n), "s2": normal(rng, (n, sd)), "done": (rng.random(n) < 0.1).astype(F32),
            "next_ret": normal(rng, n, 0.01), "regime": rng.integers(0, 3, n).astype(I32),
            "discount": uniform(rng, n, 0.9, 1.0), **ring, "max_priority": np.array([2.5], F32),
            # nstep_window's device count: the first rows only (0 to n)
            "n_valid": np.array([int(rng.integers(0, n + 1))], I32)}


def _s_nstep(d: Dims, rng) -> Kwargs:
    """Windows of every fill (``win_len`` 0 to n_step - 1), a third of the episodes ending."""
    n_envs, sd, n_step, nb = min(d.batch, 64), _state_dim(d), 3, 3
    rows = n_envs * n_step
    return {"obs": normal(rng, (n_envs, sd)), "actions": rng.integers(0, 3, (n_envs, nb)).astype(I32),
            "r": normal(rng, n_envs), "done": (rng.random(n_envs) < 0.3).astype(F32),
            "s2": normal(rng, (n_envs, sd)), "next_ret": normal(rng, n_envs, 0.01),
            "regime": rng.integers(0, 3, n_envs).astype(I32),
            "win_s": normal(rng, (n_envs, n_step, sd)),
            "win_a": rng.integers(0, 3, (n_envs, n_step, nb)).astype(I32),
            "win_r": normal(rng, (n_envs, n_step)), "win_next_ret": normal(rng, (n_envs, n_step), 0.01),
            "win_regime": rng.integers(0, 3, (n_envs, n_step)).astype(I32),
            "win_len": rng.integers(0, n_step, n_envs).astype(I32),
            "out_s": normal(rng, (rows, sd)), "out_a": rng.integers(0, 3, (rows, nb)).astype(I32),
            "out_r": normal(rng, rows), "out_s2": normal(rng, (rows, sd)),
            "out_done": np.zeros(rows, F32), "out_next_ret": normal(rng, rows, 0.01),
            "out_regime": rng.integers(0, 3, rows).astype(I32), "out_discount": np.ones(rows, F32),
            "n_step": n_step, "gamma_ref": 0.97}


def _s_ring_sample(d: Dims, rng) -> Kwargs:
    ring = _ring(d, rng)
    return {"prefix": np.cumsum(ring["priority"], dtype=F32), "ring_pos": ring["ring_pos"],
            "key": int(rng.integers(0, 2**63)) * 2 + 1,  # both key words in use
            "cycle": np.array([int(rng.integers(0, 2**40))], np.int64), "n": d.batch}


def _s_gather(d: Dims, rng) -> Kwargs:
    ring = {k: v for k, v in _ring(d, rng).items() if k not in ("priority", "ring_pos")}
    return {"idx": rng.integers(0, d.items, d.batch).astype(I32), **ring}


def _s_update(d: Dims, rng) -> Kwargs:
    """TD errors of several magnitudes (a few repeated rows: the last write wins)."""
    td = normal(rng, d.batch, 3.0)
    return {"td": td, "idx": rng.integers(0, min(d.items, 4 * d.batch), d.batch).astype(I32),
            "priority": uniform(rng, d.items, 0.05, 2.0), "max_priority": np.array([2.0], F32),
            "alpha": 0.6, "eps": 1e-3}


def _s_cycle(d: Dims, rng) -> Kwargs:
    return {"cycle": np.array([int(rng.integers(0, 2**62))], np.int64)}


def _sc_prefix(kwargs, expected):
    return {"out": reduction(kwargs["p"].size, maxabs(kwargs["p"]))}


def _sc_weights(kwargs, expected):
    return {"out": reduction(1, 1.0)}  # one division and one powf per weight, weights in (0, 1]


ENTRIES: tuple[SpecEntry, ...] = (
    # replay: scans are reductions; the binary search on a given prefix is exact
    SpecEntry(
        name="prefix_sum",
        outputs={"out": f32(REDUCTION)},
        sample=_s_prefix,
        targets=("p",),
        errors=error_cases(
            _s_prefix,
            lambda k: wrong_dtype(k, "p"),
            lambda k: replace(k, p=k["p"].reshape(5, -1)),
        ),
        scales=_sc_prefix,
    ),
    # the collection cycle's scan: bit-exact twins (the kernels' own float order)
    SpecEntry(
        name="scan_tiles",
        outputs={"s": f32(EXACT), "block_sums": f32(EXACT)},
        sample=_s_scan_tiles,
        targets=("p",),
        errors=error_cases(
            _s_scan_tiles,
            lambda k: wrong_dtype(k, "p"),
            lambda k: replace(k, p=k["p"][:-3].reshape(8, -1)),
            lambda k: replace(k, p=k["p"][:0]),
        ),
        contract=_c_scan_tiles,
    ),
    SpecEntry(
        name="scan_offsets",
        outputs={"out": f32(EXACT)},
        sample=_s_scan_offsets,
        targets=("s", "block_sums"),
        errors=error_cases(
            _s_scan_offsets,
            lambda k: wrong_dtype(k, "s"),
            lambda k: replace(k, block_sums=k["block_sums"][:-1]),
            lambda k: wrong_dtype(k, "block_sums"),
        ),
        contract=_c_scan_offsets,
    ),
    SpecEntry(
        name="sample_proportional",
        outputs={"out": i32(EXACT)},
        sample=_s_sample,
        targets=("prefix", "u"),
        errors=error_cases(
            _s_sample,
            lambda k: replace(k, prefix=k["prefix"][:0]),
            lambda k: wrong_dtype(k, "u"),
        ),
    ),
    SpecEntry(
        name="importance_weights",
        outputs={"out": f32(REDUCTION)},
        sample=_s_weights,
        targets=("priorities",),
        errors=error_cases(
            _s_weights,
            lambda k: replace(k, idx=np.full_like(k["idx"], k["n_valid"])),
            lambda k: replace(k, beta=1.5),
            lambda k: replace(k, n_valid=0),
        ),
        scales=_sc_weights,
    ),
    # the ring: copies and the Philox draws are exact; new priorities are one powf each
    SpecEntry(
        name="replay_add",
        outputs={f"ring_{name}": (f32 if dtype == F32 else i32)(EXACT)
                 for name, dtype in (("s", F32), ("a", I32), ("r", F32), ("s2", F32),
                                     ("done", F32), ("next_ret", F32), ("regime", I32),
                                     ("discount", F32))}
        | {"priority": f32(EXACT), "ring_pos": i32(EXACT)},
        sample=_s_add,
        targets=("s", "r", "max_priority"),
        errors=error_cases(
            _s_add,
            lambda k: wrong_dtype(k, "s"),
            lambda k: replace(k, ring_pos=np.array([k["priority"].size, 0], I32)),
            lambda k: replace(k, a=k["a"][:, :2]),
            lambda k: replace(k, n_valid=np.array([k["r"].size + 1], I32)),
        ),
    ),
    # n-step transitions: copies, and sums whose float order the kernel follows (no FMA)
    SpecEntry(
        name="nstep_window",
        outputs={name: (i32 if name in ("win_a", "win_regime", "win_len", "out_a", "out_regime",
                                        "n_out") else f32)(EXACT)
                 for name in ("win_s", "win_a", "win_r", "win_next_ret", "win_regime", "win_len",
                              "out_s", "out_a", "out_r", "out_s2", "out_done", "out_next_ret",
                              "out_regime", "out_discount", "n_out")},
        sample=_s_nstep,
        targets=("r", "win_r", "obs"),
        errors=error_cases(
            _s_nstep,
            lambda k: replace(k, win_len=np.full_like(k["win_len"], k["n_step"])),
            lambda k: replace(k, n_step=17),
            lambda k: replace(k, gamma_ref=1.5),
            lambda k: wrong_dtype(k, "r"),
        ),
    ),
    SpecEntry(
        name="replay_sample",
        outputs={"out": i32(EXACT)},
        sample=_s_ring_sample,
        targets=("prefix",),
        errors=error_cases(
            _s_ring_sample,
            lambda k: replace(k, ring_pos=np.array([0, k["prefix"].size + 1], I32)),
            lambda k: replace(k, cycle=k["cycle"].astype(np.uint64)),
            lambda k: replace(k, key=-1),
        ),
    ),
    SpecEntry(
        name="replay_gather",
        outputs={"x": f32(EXACT), "a": i32(EXACT), "r": f32(EXACT), "done": f32(EXACT),
                 "next_ret": f32(EXACT), "regime": i32(EXACT), "discount": f32(EXACT)},
        sample=_s_gather,
        targets=("ring_s", "ring_r"),
        errors=error_cases(
            _s_gather,
            lambda k: replace(k, idx=np.full_like(k["idx"], k["ring_r"].size)),
            lambda k: replace(k, ring_s2=k["ring_s2"][:-1]),
        ),
    ),
    SpecEntry(
        name="replay_update_priorities",
        outputs={"priority": f32(POW_ULP), "max_priority": f32(POW_ULP)},
        sample=_s_update,
        targets=("td", "max_priority"),
        errors=error_cases(
            _s_update,
            lambda k: replace(k, idx=np.full_like(k["idx"], k["priority"].size)),
            lambda k: replace(k, alpha=1.5),
            lambda k: replace(k, eps=0.0),
            lambda k: wrong_dtype(k, "td"),
        ),
    ),
    SpecEntry(
        name="cycle_advance",
        outputs={"out": Output("int64", EXACT)},
        sample=_s_cycle,
        targets=(),  # an int64 counter only: no float to poison
        errors=error_cases(
            _s_cycle,
            lambda k: replace(k, cycle=np.array([-1], np.int64)),
            lambda k: replace(k, cycle=k["cycle"].astype(np.uint64)),
        ),
    ),
)
