"""fast.graphs.priority_ranks: the launch-priority rank of each node of a captured graph (pure
Python; the GPU side, that the ranks reach the kernel nodes, is in tests/test_fast_gpu.py)."""

from __future__ import annotations

import pytest

from foxhunt.fast.graphs import priority_ranks


def test_ranks_follow_the_longest_chain_still_to_run():
    # a -> b -> c -> d, and a side node s after a: chains still to run (bottom levels)
    # a 4, b 3, c 2, d 1, s 1; depth 4; rank = (4 - bottom) * 6 // 4.
    edges = [("a", "b"), ("b", "c"), ("c", "d"), ("a", "s")]
    assert priority_ranks("abcds", edges, 6) == {"a": 0, "b": 1, "c": 3, "d": 4, "s": 4}


def test_a_short_side_branch_ranks_below_the_chain_beside_it():
    # Two branches after r, joined by j: r -> x1 -> x2 -> x3 -> j and r -> y -> j.
    edges = [("r", "x1"), ("x1", "x2"), ("x2", "x3"), ("x3", "j"), ("r", "y"), ("y", "j")]
    ranks = priority_ranks(["r", "x1", "x2", "x3", "y", "j"], edges, 3)
    # bottom: j 1, x3 2, x2 3, x1 4, y 2, r 5; depth 5; rank = (5 - bottom) * 3 // 5.
    assert ranks == {"r": 0, "x1": 0, "x2": 1, "x3": 1, "y": 1, "j": 2}
    assert ranks["x1"] < ranks["y"]


def test_one_level_and_lone_nodes():
    assert priority_ranks(["a", "b"], [], 6) == {"a": 0, "b": 0}
    assert priority_ranks(["a", "b", "c"], [("a", "b"), ("b", "c")], 1) == {"a": 0, "b": 0, "c": 0}
    assert priority_ranks([], [], 6) == {}


def test_groups_are_ranked_as_graphs_of_their_own():
    # One graph: a -> b -> c (graph 1) then c -> x -> y (graph 2), and a side node s after a.
    # As one graph: depth 5, bottom a 5, b 4, c 3, s 1; rank = (5 - bottom) * 6 // 5.
    edges = [("a", "b"), ("b", "c"), ("a", "s"), ("c", "x"), ("x", "y")]
    keys = ["a", "b", "c", "s", "x", "y"]
    assert priority_ranks(keys, edges, 6) == {"a": 0, "b": 1, "c": 2, "s": 4, "x": 3, "y": 4}
    # In groups {a, b, c, s} and {x, y}, the edge c -> x between them is dropped: graph 1's depth
    # 3 (bottom a 3, b 2, c 1, s 1), graph 2's depth 2 (x 2, y 1), as each graph by itself.
    grouped = priority_ranks(keys, edges, 6, groups=[["a", "b", "c", "s"], ["x", "y"]])
    assert grouped == {"a": 0, "b": 2, "c": 4, "s": 4, "x": 0, "y": 3}
    assert grouped == {**priority_ranks("abcs", edges[:3], 6), **priority_ranks("xy", edges[4:], 6)}
    assert priority_ranks(keys, edges, 6, groups=[keys]) == priority_ranks(keys, edges, 6)


@pytest.mark.parametrize("groups", [[["a"]], [["a", "b"], ["b"]], [["a", "b", "z"]]],
                         ids=["missing", "twice", "foreign"])
def test_groups_that_do_not_partition_the_keys_are_refused(groups):
    with pytest.raises(ValueError, match=r"^priority_ranks: groups must partition the 2 keys"):
        priority_ranks("ab", [("a", "b")], 6, groups=groups)


def test_a_cycle_is_refused():
    with pytest.raises(ValueError, match="cycle"):
        priority_ranks("ab", [("a", "b"), ("b", "a")], 6)
