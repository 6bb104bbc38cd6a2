"""The ISV bus: a float32 vector of named slots, defined once in a registry (SPEC 7).

Every slot has an index, a name, a type, a producer, its consumers, a reset category and a
cold-start value. Indices are the seed's (``seeds/002``, "ISV Slot Allocation Registry") for
every slot implemented here; the seed's gaps stay zero-filled and unnamed. The registry is
validated at import: a duplicate index or name, an index outside ``[0, ISV_LEN)`` (two slots
cannot overlap: each occupies exactly one index), or an inconsistent slot raises.

Types:
  ``f32``      a float32 signal (EMAs, coefficients).
  ``counter``  an integer stored as float32 ("f32 (int cast)" in the seed); exact up to 2^24.
  ``u32bits``  a uint32 bit pattern stored in a float32 slot (the layout fingerprint). It is
               read and written only through ``.view(np.uint32)``; it never passes through float
               arithmetic (a pattern may be a NaN, even a signalling NaN, and must survive).

Reset categories (what ``ISVBus.fold_reset`` does at a walk-forward fold boundary):
  ``FoldReset``             back to the cold-start value.
  ``SoftReset(decay_bars)`` the deviation from cold start decays with half-life ``decay_bars``
                            bars (``ISVBus.soft_reset``); a fold boundary applies one half-life.
  ``SchemaContract``        written at construction from the configuration or the layout; never
                            reset.
  ``CrossFold``             persists across folds (e.g. Mech 6's slow gradient-norm EMA).

foxhunt additions (not in the seed's table): ``GRAD_NORM_SLOW_EMA`` (Mech 6's slow EMA,
CrossFold) sits in the seed's unused gap at index 37.

Branch mapping: the seed's per-branch families are named DIR/MAG/ORD/URG. SPEC's branches
(exposure, order, urgency) are the seed's direction, order and urgency branches; the seed's
magnitude branch has no counterpart here and its slot serves a fourth branch if a
configuration has one (``branch_slot``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

import numpy as np

#: Length of the bus: the seed's ``ISV_TOTAL_DIM`` after the SP5 reservation (``[0..286)``).
ISV_LEN = 286

SLOT_TYPES = ("f32", "counter", "u32bits")

#: Largest integer a ``counter`` slot holds exactly (float32 has a 24-bit significand).
COUNTER_MAX = 2**24

#: Adaptive EMA rate (SPEC 7):
#: ``alpha_base * (1 + SHARPE_GAIN * |clamp(sharpe, -SHARPE_CLAMP, SHARPE_CLAMP)|)``.
ALPHA_BASE_DEFAULT = 0.05
SHARPE_CLAMP = 2.0
SHARPE_GAIN = 0.5
#: Largest ``alpha_base`` for which the adaptive rate stays a convex weight (<= 1).
ALPHA_BASE_MAX = 1.0 / (1.0 + SHARPE_GAIN * SHARPE_CLAMP)

FNV64_OFFSET = 0xCBF29CE484222325
FNV64_PRIME = 0x100000001B3
_U64_MASK = 0xFFFFFFFFFFFFFFFF


# --------------------------------------------------------------------------- reset categories
@dataclass(frozen=True)
class ResetCategory:
    """What a fold boundary does to a slot. ``decay_bars`` is set for ``SoftReset`` only."""

    kind: str
    decay_bars: int | None = None

    KINDS = ("FoldReset", "SoftReset", "SchemaContract", "CrossFold")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"reset kind={self.kind!r}: allowed values are {self.KINDS}")
        if self.kind == "SoftReset":
            if isinstance(self.decay_bars, bool) or not isinstance(self.decay_bars, int) \
                    or self.decay_bars < 1:
                raise ValueError(
                    f"SoftReset decay_bars={self.decay_bars!r}: must be an integer >= 1"
                )
        elif self.decay_bars is not None:
            raise ValueError(
                f"{self.kind} takes no decay_bars (got {self.decay_bars!r}); only SoftReset does"
            )

    def __str__(self) -> str:
        return f"SoftReset({self.decay_bars})" if self.kind == "SoftReset" else self.kind


FoldReset = ResetCategory("FoldReset")
SchemaContract = ResetCategory("SchemaContract")
CrossFold = ResetCategory("CrossFold")


def SoftReset(decay_bars: int) -> ResetCategory:  # noqa: N802 (reads like the seed's enum variant)
    """The seed's ``SoftReset(decay_bars=...)`` category."""
    return ResetCategory("SoftReset", decay_bars)


# --------------------------------------------------------------------------- slots
@dataclass(frozen=True)
class ISVSlot:
    """One named slot of the bus (see the module docstring for types and reset categories)."""

    index: int
    name: str
    type: str
    producer: str
    consumers: tuple[str, ...]
    reset: ResetCategory
    cold_start: float = 0.0

    def canonical(self) -> str:
        """This slot's line of the fingerprint serialisation: ``index|name|type|reset``."""
        return f"{self.index}|{self.name}|{self.type}|{self.reset}"


def _signal(index: int, name: str) -> ISVSlot:
    producer = RESERVED_REGIME if name in _REGIME_SIGNALS else "isv_signal_update"
    return ISVSlot(index, name, "f32", producer, ("ISV encoder", "health report"),
                   FoldReset, 0.0)


#: A slot whose producer string starts with this is kept (at its cold start) on purpose; the
#: rest of the string is the reason.
RESERVED = "reserved: "
_REGIME_SIGNALS = ("ADX_EMA", "REGIME_DISAGREE", "REGIME_VEL_EMA", "REGIME_STABILITY")
RESERVED_REGIME = (RESERVED + "the seed's ADX/CUSUM regime indicators; foxhunt states carry "
                   "neither, so isv_signal_build emits 0 (slots stay 0)")
RESERVED_MAG = (RESERVED + "the seed's magnitude branch (Quarter/Half/Full) has no foxhunt "
                "counterpart (branches are exposure, order type, urgency)")
RESERVED_HOLD = (RESERVED + "foxhunt's exposure branch has no Hold action (short/flat/long "
                 "target positions)")


def is_reserved(s: "ISVSlot") -> bool:
    """True for a slot kept at its cold start on purpose (its producer names the reason)."""
    return s.producer.startswith(RESERVED)


#: The seed's signal slots 0-12, blended by ``isv_signal_update`` (the step computes the raw
#: per-step values; the kernel only applies the adaptive EMA).
SIGNAL_NAMES = (
    "Q_DRIFT",             # (q_mean - q_ema) / max(|q_ema|, 0.1)
    "GRAD_NORM_EMA",       # gradient norm
    "TD_ERR_EMA",          # mean TD error (per-sample loss)
    "ENS_VAR_EMA",         # C51 Q-distribution variance (batch-mean atom spread)
    "ENS_VAR_VEL",         # change of ENS_VAR_EMA
    "REWARD_EMA",          # batch-mean reward
    "ATOM_UTIL_EMA",       # atom utilisation fraction
    "LOSS_EMA",            # total training loss
    "ADX_EMA",             # batch-mean ADX (regime velocity indicator)
    "REGIME_DISAGREE",     # |norm(ADX) - norm(CUSUM)|
    "REGIME_VEL_EMA",      # regime transition velocity
    "REGIME_STABILITY",    # 1 - sigmoid(5 * regime_vel)
    "LEARNING_HEALTH",     # health score in [0, 1]
)
NUM_SIGNALS = len(SIGNAL_NAMES)

#: Per-branch slot order: SPEC branch d uses the seed's slot family member PER_BRANCH_ORDER[d].
PER_BRANCH_ORDER = ("DIR", "ORD", "URG", "MAG")
MAX_ISV_BRANCHES = len(PER_BRANCH_ORDER)
_SEED_BRANCH_OFFSET = {"DIR": 0, "MAG": 1, "ORD": 2, "URG": 3}  # the seed's order in each family

_GAMMA_BASE = 43
_GRAD_TARGET_BASE = 31
_GRAD_SOFT_RESET_BARS = 500
#: SPEC 3's default discount; a bus built from a config overrides it per branch.
GAMMA_COLD_START = 0.99
#: The seed's per-branch gamma schedule (slots 43-46, seed order DIR, MAG, ORD, URG):
#: ``per_branch_gamma_update`` moves each from its base to its max over the epochs.
GAMMA_SCHEDULE_BASE = (0.92, 0.88, 0.85, 0.80)
GAMMA_SCHEDULE_MAX = (0.99, 0.95, 0.93, 0.90)
_V_CENTER_BASE = 23
_V_HALF_BASE = 27
_Q_P05_BASE = 50
_Q_P95_BASE = 54
# Cold starts of the adaptive support and its quantiles: DQNConfig's default [v_min, v_max] =
# [-10, 10] (the seed bootstraps the quantiles at v_min / v_max); a bus built from a config
# overrides them with its own support (config_cold_starts).
QUANTILE_P05_COLD_START = -10.0
QUANTILE_P95_COLD_START = 10.0
SUPPORT_CENTER_COLD_START = 0.0
SUPPORT_HALF_COLD_START = 10.0

REGISTRY: tuple[ISVSlot, ...] = (
    *(_signal(i, n) for i, n in enumerate(SIGNAL_NAMES)),
    ISVSlot(16, "Q_ABS_REF", "f32", "isv_q_abs_ref_update",
            ("Mech 1 target-Q clip", "Mech 2 atom bound", "Mech 5 sentinel thresholds",
             "Mech 9 weight clamp"), FoldReset, 0.0),
    *(ISVSlot(13 + k, f"Q_MAG_MEAN_{m}", "f32", RESERVED_MAG, (), FoldReset, 0.0)
      for k, m in enumerate(("QUARTER", "HALF", "FULL"))),
    *(ISVSlot(17 + k, f"Q_DIR_MEAN_{m}", "f32",
              RESERVED_HOLD if m == "HOLD" else "q_stats_update", ("isv_signal_build",),
              FoldReset, 0.0)
      for k, m in enumerate(("SHORT", "HOLD", "LONG", "FLAT"))),
    ISVSlot(21, "Q_DIR_ABS_REF", "f32", "q_stats_update", ("diagnostic",), FoldReset, 0.0),
    ISVSlot(22, "SHARPE_EMA", "f32", "training loop (host)", ("isv_signal_update",),
            FoldReset, 0.0),
    *(ISVSlot(_V_CENTER_BASE + off, f"V_CENTER_{br}", "f32", "adaptive_support_update",
              ("adaptive atoms",), FoldReset, SUPPORT_CENTER_COLD_START)
      for br, off in _SEED_BRANCH_OFFSET.items()),
    *(ISVSlot(_V_HALF_BASE + off, f"V_HALF_{br}", "f32", "adaptive_support_update",
              ("adaptive atoms",), FoldReset, SUPPORT_HALF_COLD_START)
      for br, off in _SEED_BRANCH_OFFSET.items()),
    *(ISVSlot(_GRAD_TARGET_BASE + off, f"GRAD_NORM_TARGET_{br}", "f32", "grad_balance_isv_update",
              ("per-component gradient report",), SoftReset(_GRAD_SOFT_RESET_BARS), 0.0)
      for br, off in _SEED_BRANCH_OFFSET.items()),
    ISVSlot(35, "GRAD_SCALE_LIMIT", "f32", "grad_balance_isv_update",
            ("per-component gradient report",), SoftReset(_GRAD_SOFT_RESET_BARS), 0.0),
    ISVSlot(37, "GRAD_NORM_SLOW_EMA", "f32", "training loop (readback)",
            ("Mech 6 adaptive grad clip",), CrossFold, 0.0),
    ISVSlot(39, "EPOCH_IDX", "counter", "training loop (epoch boundary)",
            ("adaptive schedules",), FoldReset, 0.0),
    ISVSlot(40, "TOTAL_EPOCHS", "counter", "construct (config)", ("adaptive schedules",),
            SchemaContract, 0.0),
    ISVSlot(41, "EPSILON_EFF", "f32", "epsilon_tau_update", ("epsilon-greedy action select",
            "cql_alpha_ramp"), FoldReset, 0.0),
    ISVSlot(42, "TAU_EFF", "f32", "epsilon_tau_update", ("target-net Polyak update",),
            FoldReset, 0.0),
    *(ISVSlot(_GAMMA_BASE + off, f"GAMMA_{br}_EFF", "f32", "per_branch_gamma_update",
              ("c51_project",), FoldReset, GAMMA_COLD_START)
      for br, off in _SEED_BRANCH_OFFSET.items()),
    ISVSlot(48, "CQL_ALPHA", "f32", "cql_alpha_ramp", ("cql_logit_grad",),
            FoldReset, 1.0),
    *(ISVSlot(_Q_P05_BASE + off, f"Q_P05_{br}", "f32", "q_quantile_update",
              ("adaptive_support_update",), FoldReset, QUANTILE_P05_COLD_START)
      for br, off in _SEED_BRANCH_OFFSET.items()),
    *(ISVSlot(_Q_P95_BASE + off, f"Q_P95_{br}", "f32", "q_quantile_update",
              ("adaptive_support_update",), FoldReset, QUANTILE_P95_COLD_START)
      for br, off in _SEED_BRANCH_OFFSET.items()),
    ISVSlot(96, "H_S2_RMS_EMA", "f32", "isv_h2_rms_update",
            ("Mech 10 h2 clamp", "sentinel slot 49", "aux trunk guard"), FoldReset, 1.0),
    ISVSlot(115, "LAYOUT_FINGERPRINT_LO", "u32bits", "construct (layout_fingerprint)",
            ("checkpoint load",), SchemaContract, 0.0),
    ISVSlot(116, "LAYOUT_FINGERPRINT_HI", "u32bits", "construct (layout_fingerprint)",
            ("checkpoint load",), SchemaContract, 0.0),
    ISVSlot(117, "AUX_LABEL_SCALE_EMA", "f32", "isv_label_scale_update",
            ("aux next-bar label scale",), FoldReset, 0.0),
)
# AUX_LABEL_SCALE_EMA cold-starts at 0 as in the seed, but its producer replaces a slot that is
# not > 0 by the first batch's RMS (kernels.aux.isv_label_scale_update, run before the loss), so
# the epsilon-floored divisor never sits at 1e6 after a fold boundary (the seed's NaN audit).


# --------------------------------------------------------------------------- validation
def validate_registry(slots: Sequence[ISVSlot], length: int = ISV_LEN) -> None:
    """Raise ``ValueError`` if ``slots`` is not a consistent registry for a bus of ``length``.

    Checked: each entry is an ``ISVSlot``; index an int in ``[0, length)``; no duplicate index
    (two slots overlapping) and no duplicate name; name an upper-case identifier; type in
    ``SLOT_TYPES``; cold start finite (integral and within ``COUNTER_MAX`` for counters, 0.0 for
    ``u32bits``); ``u32bits`` slots are ``SchemaContract`` (a reset would write float bits
    over the pattern); consumers a tuple of strings.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length={length!r}: must be an integer >= 1")
    by_index: dict[int, ISVSlot] = {}
    by_name: dict[str, ISVSlot] = {}
    for s in slots:
        if not isinstance(s, ISVSlot):
            raise ValueError(f"registry entry {s!r} is not an ISVSlot")
        if isinstance(s.index, bool) or not isinstance(s.index, int) or not 0 <= s.index < length:
            raise ValueError(f"slot {s.name!r}: index={s.index!r} must be an integer in [0, {length})")
        if s.index in by_index:
            raise ValueError(
                f"ISV slots {by_index[s.index].name!r} and {s.name!r} overlap at index {s.index}"
            )
        if not isinstance(s.name, str) or not s.name.isidentifier() or s.name != s.name.upper():
            raise ValueError(f"slot {s.index}: name={s.name!r} must be an upper-case identifier")
        if s.name in by_name:
            raise ValueError(
                f"ISV slot name {s.name!r} is used twice (indices {by_name[s.name].index} and {s.index})"
            )
        if s.type not in SLOT_TYPES:
            raise ValueError(f"slot {s.name!r}: type={s.type!r}; allowed values are {SLOT_TYPES}")
        if not isinstance(s.reset, ResetCategory):
            raise ValueError(f"slot {s.name!r}: reset={s.reset!r} is not a ResetCategory")
        if not isinstance(s.consumers, tuple) or not all(isinstance(c, str) for c in s.consumers):
            raise ValueError(f"slot {s.name!r}: consumers={s.consumers!r} must be a tuple of str")
        cold = s.cold_start
        if isinstance(cold, bool) or not isinstance(cold, (int, float)) or not math.isfinite(cold):
            raise ValueError(f"slot {s.name!r}: cold_start={cold!r} must be a finite number")
        if s.type == "counter" and (cold != int(cold) or abs(cold) > COUNTER_MAX):
            raise ValueError(
                f"slot {s.name!r}: counter cold_start={cold!r} must be an integer with |x| <= 2**24"
            )
        if s.type == "u32bits":
            if s.reset != SchemaContract:
                raise ValueError(
                    f"slot {s.name!r}: u32bits slots must be SchemaContract (got {s.reset}); a "
                    "reset would write float bits over the pattern"
                )
            if cold != 0.0:
                raise ValueError(
                    f"slot {s.name!r}: u32bits cold_start={cold!r} must be 0.0 (the bits are "
                    "written by the bus, not taken from a float)"
                )
        by_index[s.index] = s
        by_name[s.name] = s


validate_registry(REGISTRY)

_BY_NAME: Mapping[str, ISVSlot] = MappingProxyType({s.name: s for s in REGISTRY})
_BY_INDEX: Mapping[int, ISVSlot] = MappingProxyType({s.index: s for s in REGISTRY})


def slot(name: str) -> ISVSlot:
    """The registry slot called ``name`` (``slot("Q_ABS_REF").index == 16``)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown ISV slot name {name!r}; known: {sorted(_BY_NAME)}") from None


def slot_at(index: int) -> ISVSlot | None:
    """The registry slot at ``index``, or ``None`` for an unused (zero-filled) index."""
    return _BY_INDEX.get(index)


def branch_slot(family: str, branch: int) -> ISVSlot:
    """The per-branch slot of ``family`` (``"GAMMA"`` or ``"GRAD_NORM_TARGET"``) for SPEC branch d.

    Branch d maps to the seed's member ``PER_BRANCH_ORDER[d]`` (exposure -> DIR, order -> ORD,
    urgency -> URG, a fourth branch -> MAG).
    """
    if isinstance(branch, bool) or not isinstance(branch, int) or not 0 <= branch < MAX_ISV_BRANCHES:
        raise ValueError(f"branch={branch!r}: must be an integer in [0, {MAX_ISV_BRANCHES})")
    member = PER_BRANCH_ORDER[branch]
    names = {"GAMMA": f"GAMMA_{member}_EFF", "GRAD_NORM_TARGET": f"GRAD_NORM_TARGET_{member}",
             "V_CENTER": f"V_CENTER_{member}", "V_HALF": f"V_HALF_{member}",
             "Q_P05": f"Q_P05_{member}", "Q_P95": f"Q_P95_{member}"}
    if family not in names:
        raise ValueError(f"family={family!r}: allowed values are {tuple(names)}")
    return slot(names[family])


# Constants for the main indices (the seed's ``*_INDEX`` names).
SIGNAL_INDICES = tuple(range(NUM_SIGNALS))
Q_ABS_REF_INDEX = slot("Q_ABS_REF").index
SHARPE_EMA_INDEX = slot("SHARPE_EMA").index
GRAD_NORM_SLOW_EMA_INDEX = slot("GRAD_NORM_SLOW_EMA").index
EPOCH_IDX_INDEX = slot("EPOCH_IDX").index
TOTAL_EPOCHS_INDEX = slot("TOTAL_EPOCHS").index
GAMMA_INDICES = tuple(branch_slot("GAMMA", d).index for d in range(MAX_ISV_BRANCHES))
CQL_ALPHA_INDEX = slot("CQL_ALPHA").index
H_S2_RMS_EMA_INDEX = slot("H_S2_RMS_EMA").index
FINGERPRINT_LO_INDEX = slot("LAYOUT_FINGERPRINT_LO").index
FINGERPRINT_HI_INDEX = slot("LAYOUT_FINGERPRINT_HI").index
AUX_LABEL_SCALE_EMA_INDEX = slot("AUX_LABEL_SCALE_EMA").index
Q_DIR_ABS_REF_INDEX = slot("Q_DIR_ABS_REF").index
#: Exposure action a (0 short, 1 flat, 2 long; reference.env) -> its Q-mean EMA slot (the
#: seed's direction family: Short 17, Long 19, Flat 20; Hold 18 is reserved).
Q_DIR_ACTION_SLOTS = tuple(slot(f"Q_DIR_MEAN_{m}").index for m in ("SHORT", "FLAT", "LONG"))
EPSILON_EFF_INDEX = slot("EPSILON_EFF").index
TAU_EFF_INDEX = slot("TAU_EFF").index
#: Seed-order (DIR, MAG, ORD, URG) slot bases of the per-branch families.
V_CENTER_INDICES = tuple(_V_CENTER_BASE + k for k in range(MAX_ISV_BRANCHES))
V_HALF_INDICES = tuple(_V_HALF_BASE + k for k in range(MAX_ISV_BRANCHES))
Q_P05_INDICES = tuple(_Q_P05_BASE + k for k in range(MAX_ISV_BRANCHES))
Q_P95_INDICES = tuple(_Q_P95_BASE + k for k in range(MAX_ISV_BRANCHES))
GAMMA_SEED_INDICES = tuple(_GAMMA_BASE + k for k in range(MAX_ISV_BRANCHES))


# --------------------------------------------------------------------------- fingerprint
class FingerprintMismatch(ValueError):
    """A vector (checkpoint) carries a layout fingerprint other than the one expected.

    ``FingerprintMismatch(expected, found, what)`` builds the message from the two u64
    fingerprints (hex); ``FingerprintMismatch(message)`` takes a ready-made message, which must
    then name both fingerprints itself (``expected`` / ``found`` are ``None``).
    """

    def __init__(self, expected: int | str, found: int | None = None,
                 what: str = "ISV vector") -> None:
        if isinstance(expected, str) and found is None:
            self.expected = self.found = None
            super().__init__(expected)
            return
        self.expected = expected
        self.found = found
        super().__init__(
            f"{what}: layout fingerprint 0x{found:016x} does not match this build's "
            f"0x{expected:016x}; the ISV slot layout differs and there are no migrations"
        )


def fnv1a_64(data: bytes) -> int:
    """64-bit FNV-1a of ``data`` (offset 0xcbf29ce484222325, prime 0x100000001b3)."""
    h = FNV64_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV64_PRIME) & _U64_MASK
    return h


def canonical_layout(registry: Iterable[ISVSlot] = REGISTRY, length: int = ISV_LEN) -> bytes:
    """The canonical serialisation hashed by ``layout_fingerprint``.

    UTF-8 text, lines joined by ``"\\n"`` (no trailing newline): first ``len=<length>``, then one
    line ``index|name|type|reset`` per slot, sorted by index, where ``reset`` is ``FoldReset``,
    ``SoftReset(<decay_bars>)``, ``SchemaContract`` or ``CrossFold``. Producer, consumers and
    cold-start values are not structural and are not hashed.
    """
    lines = [f"len={length}"] + [s.canonical() for s in sorted(registry, key=lambda s: s.index)]
    return "\n".join(lines).encode("utf-8")


def layout_fingerprint(registry: Iterable[ISVSlot] = REGISTRY, length: int = ISV_LEN) -> int:
    """64-bit FNV-1a of ``canonical_layout(registry, length)``: an unsigned int < 2**64."""
    return fnv1a_64(canonical_layout(registry, length))


LAYOUT_FINGERPRINT = layout_fingerprint()


def _check_vector(vec: np.ndarray, name: str = "vec", length: int = ISV_LEN) -> None:
    if not isinstance(vec, np.ndarray) or vec.dtype != np.float32 or vec.shape != (length,):
        got = f"{type(vec).__name__} {getattr(vec, 'dtype', '?')} {getattr(vec, 'shape', '?')}"
        raise ValueError(f"{name}: got {got}; need a float32 array of shape ({length},)")


def write_fingerprint(vec: np.ndarray, fingerprint: int = LAYOUT_FINGERPRINT, *,
                      length: int = ISV_LEN) -> None:
    """Store ``fingerprint`` (u64) in ``vec`` in place: low 32 bits at slot 115, high at 116.

    The bits are written through ``vec.view(np.uint32)``; no float conversion happens.
    """
    _check_vector(vec, "vec", length)
    if isinstance(fingerprint, bool) or not isinstance(fingerprint, (int, np.integer)) \
            or not 0 <= int(fingerprint) <= _U64_MASK:
        raise ValueError(f"fingerprint={fingerprint!r}: must be an integer in [0, 2**64)")
    bits = vec.view(np.uint32)
    bits[FINGERPRINT_LO_INDEX] = np.uint32(int(fingerprint) & 0xFFFFFFFF)
    bits[FINGERPRINT_HI_INDEX] = np.uint32(int(fingerprint) >> 32)


def read_fingerprint(vec: np.ndarray, *, length: int = ISV_LEN) -> int:
    """The u64 stored in slots 115 (low) / 116 (high) of ``vec``, read through the uint32 view."""
    _check_vector(vec, "vec", length)
    bits = vec.view(np.uint32)
    return int(bits[FINGERPRINT_LO_INDEX]) | (int(bits[FINGERPRINT_HI_INDEX]) << 32)


def check_fingerprint(vec: np.ndarray, expected: int = LAYOUT_FINGERPRINT, *,
                      what: str = "ISV vector", length: int = ISV_LEN) -> None:
    """Raise ``FingerprintMismatch`` (naming both fingerprints in hex) unless they are equal."""
    found = read_fingerprint(vec, length=length)
    if found != expected:
        raise FingerprintMismatch(expected, found, what)


# --------------------------------------------------------------------------- adaptive rate
def adaptive_ema_rate(sharpe: float, alpha_base: float = ALPHA_BASE_DEFAULT) -> np.float32:
    """``alpha_base * (1 + 0.5 * |clamp(sharpe, -2, 2)|)`` as float32 (SPEC 7).

    NaN Sharpe is treated as 0 (rate = ``alpha_base``): an undefined Sharpe carries no evidence
    for a faster rate. (A bare ``fminf(fmaxf(NaN, -2), 2)`` would give -2 and the *largest*
    rate; the CUDA twin tests ``isnan`` first.) +/-Inf clamps to +/-2 like any large value.
    ``alpha_base`` must be finite and in ``[0, 1/(1 + 0.5*2)] = [0, 0.5]`` so the rate stays <= 1.
    """
    ab = float(alpha_base)
    if not math.isfinite(ab) or not 0.0 <= ab <= ALPHA_BASE_MAX:
        raise ValueError(f"alpha_base={alpha_base!r}: must be finite and in [0, {ALPHA_BASE_MAX}]")
    with np.errstate(over="ignore"):  # a huge float64 Sharpe becomes +/-inf, then clamps to +/-2
        s = np.float32(sharpe)
    if np.isnan(s):
        s = np.float32(0.0)
    clamped = np.fmin(np.fmax(s, np.float32(-SHARPE_CLAMP)), np.float32(SHARPE_CLAMP))
    gain = np.float32(1.0) + np.float32(SHARPE_GAIN) * np.abs(clamped)
    return np.float32(np.float32(ab) * gain)


def config_cold_starts(config) -> dict[str, float]:
    """This run's cold-start values of the slots that describe its ``DQNConfig`` (the per-branch
    gammas ``GAMMA_*_EFF``, ``CQL_ALPHA``, and ``TAU_EFF`` with ``adaptive_epsilon_tau`` on):
    the bus starts from them and a fold reset returns to them, not to the registry's defaults
    (0.99, 1.0 and 0)."""
    out = {slot_at(GAMMA_INDICES[d]).name: float(np.float32(g))
           for d, g in enumerate(config.gammas[: len(GAMMA_INDICES)])}
    out["CQL_ALPHA"] = float(np.float32(config.cql_alpha))
    if config.adaptive_epsilon_tau:  # the Polyak update reads TAU_EFF: it starts at tau
        out["TAU_EFF"] = float(np.float32(config.tau))
    # The adaptive support starts at (and a fold returns to) the configured [v_min, v_max];
    # the seed bootstraps the quantile EMAs at v_min / v_max.
    lo, hi = float(np.float32(config.v_min)), float(np.float32(config.v_max))
    for member in _SEED_BRANCH_OFFSET:
        out[f"Q_P05_{member}"] = lo
        out[f"Q_P95_{member}"] = hi
        out[f"V_CENTER_{member}"] = float(np.float32(0.5 * (config.v_min + config.v_max)))
        out[f"V_HALF_{member}"] = float(np.float32(0.5 * (config.v_max - config.v_min)))
    return out


def bus_for(config) -> "ISVBus":
    """The ISV bus of a trainer of ``config`` (``ISVBus`` with ``config_cold_starts``)."""
    return ISVBus(cold_start_overrides=config_cold_starts(config))


# --------------------------------------------------------------------------- the bus
class ISVBus:
    """The float32 ISV vector with registry-driven access and fold-boundary resets.

    ``cold_start_overrides`` maps slot names to this run's cold-start values (e.g. the per-branch
    gammas and CQL alpha from the configuration, ``TOTAL_EPOCHS``); ``fold_reset`` restores
    these, not the registry defaults. The fingerprint slots hold ``layout_fingerprint(registry,
    length)`` from construction on. Indices outside the registry stay zero unless loaded.
    """

    def __init__(self, registry: Sequence[ISVSlot] = REGISTRY, length: int = ISV_LEN, *,
                 cold_start_overrides: Mapping[str, float] | None = None) -> None:
        registry = tuple(registry)
        validate_registry(registry, length)
        by_name = {s.name: s for s in registry}
        names = set(by_name)
        for required, index in (("LAYOUT_FINGERPRINT_LO", FINGERPRINT_LO_INDEX),
                                ("LAYOUT_FINGERPRINT_HI", FINGERPRINT_HI_INDEX)):
            if required not in names or by_name[required].index != index:
                raise ValueError(
                    f"registry needs the {required} slot at index {index} (the bus stores the "
                    "layout fingerprint there)"
                )
        self.registry = registry
        self.length = length
        self._by_name = {s.name: s for s in registry}
        self.fingerprint = layout_fingerprint(registry, length)
        cold = np.zeros(length, np.float32)
        for s in registry:
            cold[s.index] = np.float32(s.cold_start)
        overrides = dict(cold_start_overrides or {})
        for name, value in overrides.items():
            s = self._slot(name)
            if s.type == "u32bits":
                raise ValueError(f"cold_start_overrides[{name!r}]: u32bits slots cannot be overridden")
            v = float(value)
            if not math.isfinite(v):
                raise ValueError(f"cold_start_overrides[{name!r}]={value!r}: must be finite")
            if s.type == "counter" and (v != int(v) or abs(v) > COUNTER_MAX):
                raise ValueError(
                    f"cold_start_overrides[{name!r}]={value!r}: counter needs an integer <= 2**24"
                )
            cold[s.index] = np.float32(v)
        self._overrides = overrides
        write_fingerprint(cold, self.fingerprint, length=length)
        self._cold = cold
        self._cold.setflags(write=False)
        self._values = cold.copy()

    # -- lookups
    def _slot(self, name: str) -> ISVSlot:
        try:
            return self._by_name[name]
        except KeyError:
            raise ValueError(f"unknown ISV slot name {name!r}; known: {sorted(self._by_name)}") from None

    def cold_start(self, name: str) -> np.float32:
        """This bus's cold-start value of slot ``name`` (registry value or override)."""
        return self._cold[self._slot(name).index]

    def get(self, name: str) -> np.float32:
        """The float32 value of slot ``name`` (``u32bits`` slots: use ``get_bits``)."""
        s = self._slot(name)
        if s.type == "u32bits":
            raise ValueError(f"slot {name!r} holds u32 bits; read it with get_bits()")
        return self._values[s.index]

    def get_bits(self, name: str) -> int:
        """The uint32 bit pattern of slot ``name``."""
        return int(self._values.view(np.uint32)[self._slot(name).index])

    def set(self, name: str, value: float) -> None:
        """Write ``value`` (as float32) to an ``f32`` or ``counter`` slot."""
        s = self._slot(name)
        if s.type == "u32bits":
            raise ValueError(f"slot {name!r} holds u32 bits written only by the bus")
        v = np.float32(value)
        if s.type == "counter" and np.isfinite(v) and (v != np.floor(v) or abs(v) > COUNTER_MAX):
            raise ValueError(f"slot {name!r} is a counter: value={value!r} must be an integer <= 2**24")
        self._values[s.index] = v

    def read_fingerprint(self) -> int:
        return read_fingerprint(self._values, length=self.length)

    # -- resets
    def fold_reset(self) -> None:
        """Fold boundary: FoldReset slots -> cold start; SoftReset slots decay by one half-life
        (``soft_reset(decay_bars)``, i.e. ``c + (v - c) * 0.5``); SchemaContract and CrossFold
        slots untouched."""
        for s in self.registry:
            if s.reset.kind == "FoldReset":
                self._values[s.index] = self._cold[s.index]
            elif s.reset.kind == "SoftReset":
                self._decay(s, s.reset.decay_bars)

    def soft_reset(self, bars: int) -> None:
        """Decay every SoftReset slot toward its cold start over ``bars`` bars.

        ``v' = c + (v - c) * f`` with ``f = 0.5 ** (bars / decay_bars)`` (``decay_bars`` is the
        half-life), computed in float32 (``f`` rounded to float32 once). A non-finite ``v`` is
        reset to ``c``. Other categories are untouched.
        """
        if isinstance(bars, bool) or not isinstance(bars, (int, np.integer)) or bars < 0:
            raise ValueError(f"bars={bars!r}: must be an integer >= 0")
        for s in self.registry:
            if s.reset.kind == "SoftReset":
                self._decay(s, int(bars))

    def _decay(self, s: ISVSlot, bars: int) -> None:
        c = self._cold[s.index]
        v = self._values[s.index]
        if not np.isfinite(v):
            self._values[s.index] = c
            return
        factor = np.float32(0.5 ** (bars / s.reset.decay_bars))
        self._values[s.index] = np.float32(c + np.float32(np.float32(v - c) * factor))

    # -- copies and serialisation
    def copy(self) -> "ISVBus":
        other = ISVBus(self.registry, self.length, cold_start_overrides=self._overrides)
        other._values = self._values.copy()
        return other

    def to_array(self) -> np.ndarray:
        """A float32 copy of the vector (bit-exact, fingerprint bits included)."""
        return self._values.copy()

    def from_array(self, values: np.ndarray, *, check_fingerprint: bool = True) -> None:
        """Load ``values`` (float32, shape ``(length,)``) bit-exactly.

        Raises ``ValueError`` for a wrong dtype or shape (no conversion: a float64 round trip
        would alter the fingerprint bits) and ``FingerprintMismatch`` when the stored
        fingerprint differs from this bus's (unless ``check_fingerprint`` is False).
        """
        _check_vector(values, "values", self.length)
        if check_fingerprint:
            found = read_fingerprint(values, length=self.length)
            if found != self.fingerprint:
                raise FingerprintMismatch(self.fingerprint, found)
        self._values = values.copy()

    def __repr__(self) -> str:
        return (f"ISVBus(length={self.length}, slots={len(self.registry)}, "
                f"fingerprint=0x{self.fingerprint:016x})")


__all__ = [
    "ALPHA_BASE_DEFAULT", "AUX_LABEL_SCALE_EMA_INDEX", "CQL_ALPHA_INDEX", "CrossFold",
    "EPOCH_IDX_INDEX", "FINGERPRINT_HI_INDEX", "FINGERPRINT_LO_INDEX", "FingerprintMismatch",
    "FoldReset", "GAMMA_INDICES", "GRAD_NORM_SLOW_EMA_INDEX", "H_S2_RMS_EMA_INDEX", "ISVBus",
    "ISVSlot", "ISV_LEN", "LAYOUT_FINGERPRINT", "MAX_ISV_BRANCHES", "NUM_SIGNALS",
    "PER_BRANCH_ORDER", "Q_ABS_REF_INDEX", "Q_DIR_ABS_REF_INDEX", "Q_DIR_ACTION_SLOTS",
    "Q_P05_INDICES", "Q_P95_INDICES", "V_CENTER_INDICES", "V_HALF_INDICES", "EPSILON_EFF_INDEX",
    "TAU_EFF_INDEX", "GAMMA_SEED_INDICES", "GAMMA_SCHEDULE_BASE", "GAMMA_SCHEDULE_MAX",
    "RESERVED", "is_reserved", "REGISTRY", "ResetCategory", "SHARPE_EMA_INDEX",
    "SIGNAL_INDICES", "SIGNAL_NAMES", "SLOT_TYPES", "SchemaContract", "SoftReset",
    "TOTAL_EPOCHS_INDEX", "adaptive_ema_rate", "branch_slot", "bus_for", "canonical_layout",
    "check_fingerprint", "config_cold_starts", "fnv1a_64", "layout_fingerprint", "read_fingerprint", "slot", "slot_at",
    "validate_registry", "write_fingerprint",
]
