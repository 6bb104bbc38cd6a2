"""The fast side of the ``walk_rounds`` area (mirrors ``foxhunt.reference.kernels.walk_rounds``,
the chunked walk's twin): walk.cu's ``greedy_walk_round`` under its registry twin's signature.
Its launchers (``greedy_walk_round``: one round; ``greedy_walk_chunked``: the rounds composed from
flat; ``greedy_walk_span_rounds``: the span passes, then the rounds on their base, as the
evaluator runs them) live with the other walk.cu launchers in :mod:`.walk`, which plans them
together; this module only registers the name.
"""

from __future__ import annotations

from foxhunt.fast.kernels.walk import greedy_walk_chunked

#: As the reference's ``walk_rounds.KERNELS``: the kernel is tested its rounds composed.
KERNELS = {"greedy_walk_round": greedy_walk_chunked}

__all__ = ["KERNELS"]
