"""Parameter layout: the network's tensors in one flat float32 buffer (SPEC 3).

Tensors, in the seeds' GOFF order::

    0 w_s1  1 b_s1  2 w_s2  3 b_s2            trunk
    4 w_v1  5 b_v1  6 w_v2  7 b_v2            value head
    8 + 4d .. 11 + 4d: w_<br>1 b_<br>1 w_<br>2 b_<br>2   branch d (exposure, order, urgency, ...)

Weights are row-major ``[out, in]``; the second layer of branch ``d`` has ``out = n_d * NA``
(action-major: row ``a * NA + j`` is action ``a``, atom ``j``). Every tensor starts at an element
offset that is a multiple of 64 (256 bytes of float32); the padding between tensors is always
zero. The BF16 mirror is a ``uint16`` buffer of the same length indexed by the same element
offsets. The ``seed`` preset has exactly 289,611 parameters (padding not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import DQNConfig

#: Alignment of every tensor start, in bytes of the float32 master buffer.
ALIGN_BYTES = 256
ALIGN_ELEMS = ALIGN_BYTES // np.dtype(np.float32).itemsize

#: Names of the first three branches (the seeds' exposure / order type / urgency).
BRANCH_NAMES = ("exposure", "order", "urgency")

#: Mech 5 diagnostic groups.
GROUPS = ("trunk", "value", "branch")


def branch_name(d: int) -> str:
    return BRANCH_NAMES[d] if d < len(BRANCH_NAMES) else f"branch{d}"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the layout: GOFF ``index``, ``name``, ``shape``, element ``offset``."""

    index: int
    name: str
    shape: tuple[int, ...]
    offset: int
    group: str

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def is_weight(self) -> bool:
        return len(self.shape) == 2

    @property
    def end(self) -> int:
        return self.offset + self.size


def _align(n: int) -> int:
    return -(-n // ALIGN_ELEMS) * ALIGN_ELEMS


class ParamLayout:
    """Names, shapes and aligned offsets of the parameters of ``config``'s network."""

    def __init__(self, config: DQNConfig):
        c = config
        self.config = c
        shapes: list[tuple[str, tuple[int, ...], str]] = [
            ("w_s1", (c.shared_h1, c.state_dim), "trunk"),
            ("b_s1", (c.shared_h1,), "trunk"),
            ("w_s2", (c.shared_h2, c.shared_h1), "trunk"),
            ("b_s2", (c.shared_h2,), "trunk"),
            ("w_v1", (c.value_h, c.shared_h2), "value"),
            ("b_v1", (c.value_h,), "value"),
            ("w_v2", (c.num_atoms, c.value_h), "value"),
            ("b_v2", (c.num_atoms,), "value"),
        ]
        for d, n in enumerate(c.branches):
            br = branch_name(d)
            shapes += [
                (f"w_{br}1", (c.adv_h, c.shared_h2), "branch"),
                (f"b_{br}1", (c.adv_h,), "branch"),
                (f"w_{br}2", (n * c.num_atoms, c.adv_h), "branch"),
                (f"b_{br}2", (n * c.num_atoms,), "branch"),
            ]
        tensors = []
        offset = 0
        for index, (name, shape, group) in enumerate(shapes):
            spec = TensorSpec(index, name, shape, offset, group)
            tensors.append(spec)
            offset = _align(spec.end)
        self.tensors: tuple[TensorSpec, ...] = tuple(tensors)
        self.by_name = {t.name: t for t in self.tensors}
        #: Padded length of the flat buffer (a multiple of ``ALIGN_ELEMS``).
        self.num_elements = offset
        #: Number of parameters, padding not counted.
        self.total_params = sum(t.size for t in self.tensors)
        #: The weight matrices (2 + 2 + 2 * n_branches), in GOFF order.
        self.weight_matrices: tuple[TensorSpec, ...] = tuple(t for t in self.tensors if t.is_weight)
        #: Element range of the trunk tensors (the trunk is contiguous at the start).
        self.trunk_end = self.by_name["b_s2"].end

    def __repr__(self) -> str:
        return (f"ParamLayout({len(self.tensors)} tensors, total_params={self.total_params}, "
                f"num_elements={self.num_elements})")

    def __getitem__(self, name: str) -> TensorSpec:
        try:
            return self.by_name[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r}; tensors: {[t.name for t in self.tensors]}") from None

    def zeros(self, dtype=np.float32) -> np.ndarray:
        return np.zeros(self.num_elements, dtype=dtype)

    def check_buffer(self, flat: np.ndarray, what: str = "buffer") -> None:
        if not isinstance(flat, np.ndarray) or flat.ndim != 1 or flat.shape[0] != self.num_elements:
            shape = getattr(flat, "shape", None)
            raise ValueError(
                f"{what}: expected a 1-D array of {self.num_elements} elements for this layout, "
                f"got shape {shape}"
            )

    def view(self, flat: np.ndarray, name: str) -> np.ndarray:
        """Tensor ``name`` of ``flat`` as a shaped view (no copy; writes go to ``flat``)."""
        self.check_buffer(flat)
        t = self[name]
        return flat[t.offset:t.end].reshape(t.shape)

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """All tensors of ``flat`` as shaped views, by name, in GOFF order."""
        self.check_buffer(flat)
        return {t.name: flat[t.offset:t.end].reshape(t.shape) for t in self.tensors}

    def padding_mask(self) -> np.ndarray:
        """Boolean mask of the padding elements (always zero in every buffer)."""
        mask = np.ones(self.num_elements, dtype=bool)
        for t in self.tensors:
            mask[t.offset:t.end] = False
        return mask

    def canonical(self) -> str:
        """Canonical text of the layout (one ``index|name|shape|offset`` line per tensor)."""
        return "\n".join(
            f"{t.index}|{t.name}|{'x'.join(map(str, t.shape))}|{t.offset}" for t in self.tensors
        )


def init_params(layout: ParamLayout, seed: int) -> np.ndarray:
    """Deterministic initial parameters: ``W ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, biases 0.

    Draws from ``np.random.default_rng(seed)`` in GOFF order, in float64, then rounds to
    float32 once. Padding is zero.
    """
    rng = np.random.default_rng(seed)
    flat = layout.zeros()
    for t in layout.weight_matrices:
        bound = 1.0 / np.sqrt(t.shape[1])
        flat[t.offset:t.end] = rng.uniform(-bound, bound, size=t.size).astype(np.float32)
    return flat
