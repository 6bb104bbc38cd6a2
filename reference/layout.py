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

Second-wave tensors (SPEC 4; issue 18 contract) follow the core tensors, each present only
when its source's weight is > 0, in this order (``AXH = aux_hidden``, ``R = n_regimes``,
``A = sum(branches)``, rows branch-major)::

    aux  (next-bar head)  w_nb1 [AXH, SH2]  b_nb1 [AXH]  w_nb2 [1, AXH]  b_nb2 [1]
         (regime head)    w_rg1 [AXH, SH2]  b_rg1 [AXH]  w_rg2 [R, AXH]  b_rg2 [R]
    iqn                   w_phi [SH2, iqn_embed]  b_phi [SH2]  w_iq [A, SH2]  b_iq [A]
    ens  (k = 1..K-1)     w_e{k}1 [VH, SH2]  b_e{k}1 [VH]  w_e{k}2 [NA, VH]  b_e{k}2 [NA]

Ranges (element offsets, ``[start, end)``): the trunk ``[0, trunk_end)``, trunk and value
head ``[0, value_end)``, the core ``[0, core_end)``, what the main Adam updates ``[0,
main_adam_end)`` (core and aux heads), ``iqn_range`` (the IQN head's own Adam) and
``ens_range`` (the frozen ensemble priors: never updated). With every source off the layout
is the core layout, offset for offset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .config import DQNConfig

#: Alignment of every tensor start, in bytes of the float32 master buffer.
ALIGN_BYTES = 256
ALIGN_ELEMS = ALIGN_BYTES // np.dtype(np.float32).itemsize

#: Names of the first three branches (the seeds' exposure / order type / urgency).
BRANCH_NAMES = ("exposure", "order", "urgency")

#: Mech 5 diagnostic groups of the core tensors.
GROUPS = ("trunk", "value", "branch")

#: The second-wave tensor groups, in layout order.
HEAD_GROUPS = ("aux", "iqn", "ens")

#: Groups whose weight matrices are trained (Adam and spectral norm): every group but the
#: ensemble's frozen randomized priors (Osband et al. 2018).
FROZEN_GROUPS = ("ens",)


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
        return int(math.prod(self.shape))

    @property
    def is_weight(self) -> bool:
        return len(self.shape) == 2

    @property
    def end(self) -> int:
        return self.offset + self.size

    @property
    def is_core(self) -> bool:
        return self.group in GROUPS


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
        shapes += second_wave_shapes(c)
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
        #: Number of parameters, padding not counted (core and every second-wave head).
        self.total_params = sum(t.size for t in self.tensors)
        #: Parameters of the core tensors (289,611 for ``seed``) and of each head group (0 when
        #: its source is off).
        self.core_params = sum(t.size for t in self.tensors if t.is_core)
        self.head_params = {g: sum(t.size for t in self.tensors if t.group == g)
                            for g in HEAD_GROUPS}
        #: The trained weight matrices, in GOFF order: the core's 2 + 2 + 2 * n_branches, then
        #: the aux and IQN heads' (spectral norm and its u/v vectors cover exactly these; the
        #: frozen ensemble priors are not among them).
        self.weight_matrices: tuple[TensorSpec, ...] = tuple(
            t for t in self.tensors if t.is_weight and t.group not in FROZEN_GROUPS)
        #: Ends of the trunk, of the trunk + value head, and of the core tensors.
        self.trunk_end = self.by_name["b_s2"].end
        self.value_end = self.by_name["b_v2"].end
        self.core_end = max(t.end for t in self.tensors if t.is_core)
        ranges = {g: self._group_range(g) for g in HEAD_GROUPS}
        #: The main Adam covers ``[0, main_adam_end)``: the core and the aux heads.
        self.main_adam_end = ranges["aux"][1] if ranges["aux"] else self.core_end
        #: ``(start, end)`` of the IQN head's tensors (its own Adam), or ``None``.
        self.iqn_range: tuple[int, int] | None = ranges["iqn"]
        #: ``(start, end)`` of the frozen ensemble priors, or ``None``.
        self.ens_range: tuple[int, int] | None = ranges["ens"]

    def _group_range(self, group: str) -> tuple[int, int] | None:
        ts = [t for t in self.tensors if t.group == group]
        return (ts[0].offset, ts[-1].end) if ts else None

    def counts_text(self) -> str:
        """``core=289,611 aux=... iqn=... ens=...``: the core's and each second-wave head's
        parameter count, ``off`` for a head whose source is off (``foxhunt info``)."""
        heads = " ".join(f"{g}={n:,}" if n else f"{g}=off" for g, n in self.head_params.items())
        return f"core={self.core_params:,} {heads}"

    def group_tensors(self, group: str) -> tuple[TensorSpec, ...]:
        """The tensors of one group (``GROUPS`` or ``HEAD_GROUPS``), in layout order."""
        return tuple(t for t in self.tensors if t.group == group)

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


def second_wave_shapes(c: DQNConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, group)`` of the second-wave tensors ``c`` turns on, in layout order (the
    module docstring's table)."""
    out: list[tuple[str, tuple[int, ...], str]] = []
    axh, sh2 = c.aux_hidden, c.shared_h2
    for on, key, n_out in ((c.aux_next_bar_on, "nb", 1), (c.aux_regime_on, "rg", c.n_regimes)):
        if on:
            out += [(f"w_{key}1", (axh, sh2), "aux"), (f"b_{key}1", (axh,), "aux"),
                    (f"w_{key}2", (n_out, axh), "aux"), (f"b_{key}2", (n_out,), "aux")]
    if c.iqn_on:
        a = sum(c.branches)
        out += [("w_phi", (sh2, c.iqn_embed), "iqn"), ("b_phi", (sh2,), "iqn"),
                ("w_iq", (a, sh2), "iqn"), ("b_iq", (a,), "iqn")]
    if c.ens_on:
        for k in range(1, c.ens_heads):
            out += [(f"w_e{k}1", (c.value_h, sh2), "ens"), (f"b_e{k}1", (c.value_h,), "ens"),
                    (f"w_e{k}2", (c.num_atoms, c.value_h), "ens"),
                    (f"b_e{k}2", (c.num_atoms,), "ens")]
    return out


def init_params(layout: ParamLayout, seed: int) -> np.ndarray:
    """Deterministic initial parameters: ``W ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, biases 0.

    The core weights draw from ``np.random.default_rng(seed)`` in GOFF order (so a config's
    core parameters do not depend on its second-wave switches); the weights of head group
    ``HEAD_GROUPS[g]`` draw from their own generator ``np.random.default_rng([seed, g + 1])``
    in layout order (turning one source on changes no other's init). Every draw is float64,
    rounded to float32 once. Padding is zero. The ensemble priors are initialised like any
    head and then never change.
    """
    flat = layout.zeros()
    rngs = {"core": np.random.default_rng(seed)}
    rngs.update({g: np.random.default_rng([seed, i + 1]) for i, g in enumerate(HEAD_GROUPS)})
    for t in layout.tensors:
        if t.is_weight:
            rng = rngs["core" if t.is_core else t.group]
            bound = 1.0 / np.sqrt(t.shape[1])
            flat[t.offset:t.end] = rng.uniform(-bound, bound, size=t.size).astype(np.float32)
    return flat
