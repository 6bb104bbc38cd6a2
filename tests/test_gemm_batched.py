"""Batched GEMM plans (``batch`` members, ``batch_stride`` bytes apart: fast/gemm.py's module
docstring, "Batched plans"), the population's GEMMs (SPEC 12).

On the CPU: the argument checks, the plan-cache key, the cuBLASLt attributes a ``GemmPlan``
sets (through a stand-in for the binding that records them), and ``CpuGemm``: a batched run
equals ``batch`` separate runs on the same bytes and NumPy computed here in float64. On a GPU
(marked ``gpu``; skipped with the reason where there is no CUDA device or no nvmath-python):
the batched cuBLASLt plan equals the CPU twin exactly on integer operands, and on random ones
each member equals a batch=1 plan on that member's operands, bitwise where both use the same
algorithm, and the CPU twin within the GEMM bounds of ``test_fast_gpu``.

Every test lays the members out as the population arena does: member ``i``'s operands at
member 0's addresses plus ``i * stride``, with sentinel bytes after each member's operands that
no GEMM may touch.
"""

from __future__ import annotations

import collections
import ctypes
import enum
import warnings

import numpy as np
import pytest
from test_fast_gpu import U, _assert_within, _gemm_bound, _representable, _to_device_layout

from foxhunt.fast.cpu_executor import CpuGemm, HostArena, Memory, cpu_planner
from foxhunt.fast.device import cuda_available
from foxhunt.fast.gemm import EPILOGUES, PRECISIONS, GemmPlan, GemmPlanError, GemmSpec, PlanCache
from foxhunt.fast.records import Buf, Gemm
from foxhunt.fast.step_layout import BufferTable

F32, U8 = np.dtype(np.float32), np.dtype(np.uint8)
BATCH = 3
PAD = 320  # sentinel bytes after each member's operands: the stride is more than their sum
SENTINEL = 0xA5
#: The transposes each epilogue is used with (GemmSpec's layout rules for the bias gradients);
#: the plain GEMM also scales (alpha) and accumulates into C (beta), per member.
CASES = {None: (False, True), "bias": (False, True), "relu_bias": (False, True),
         "relu_aux_bias": (False, True), "drelu_bgrad": (False, False), "bgrada": (True, False),
         "bgradb": (True, False)}
WITH_BIAS = {"bias", "relu_bias", "relu_aux_bias", "drelu_bgrad", "bgrada", "bgradb"}
WITH_AUX = {"relu_aux_bias", "drelu_bgrad"}
BIAS_OUT = {"drelu_bgrad", "bgrada", "bgradb"}
CPU_SHAPE = (13, 37, 9)
GPU_SHAPES = [(64, 96, 48), (33, 67, 19)]


def _kw(epilogue, precision, shape, padded=False) -> dict:
    m, n, k = shape
    trans_a, trans_b = CASES[epilogue]
    kw = dict(m=m, n=n, k=k, trans_a=trans_a, trans_b=trans_b, precision=precision,
              epilogue=epilogue, alpha=2.0 if epilogue is None else 1.0,
              beta=-1.0 if epilogue is None else 0.0)
    if padded:  # row strides past the stored row length: the gaps must be neither read nor written
        spec = GemmSpec(**kw)
        kw.update(lda=spec.a_shape[1] + 3, ldb=spec.b_shape[1] + 5, ldc=n + 2)
    return kw


# --------------------------------------------------------------------------------------------
# Members in one host block
# --------------------------------------------------------------------------------------------


def _dtype(spec, name):
    return {"a": spec.input_dtype, "b": spec.input_dtype, "c": F32, "bias": F32, "aux": U8}[name]


def _layout(spec: GemmSpec, batch: int):
    """``batch`` members' operands (``a0``, ``b0``, ... ``a1``, ...) and sentinel pads in one
    host arena; returns ``(table, arena, stride)`` (stride: bytes from a member to the next)."""
    table = BufferTable()
    for i in range(batch):
        for name, nbytes in spec.operand_nbytes.items():
            table._add(f"{name}{i}", nbytes // _dtype(spec, name).itemsize, _dtype(spec, name))
        table._add(f"pad{i}", PAD, U8)
    arena = HostArena(table.specs)
    stride = arena.ptr("a1") - arena.ptr("a0") if batch > 1 else 0
    for i in range(batch):
        for name in (*spec.operand_nbytes, "pad"):
            assert arena.ptr(f"{name}{i}") == arena.ptr(f"{name}0") + i * stride
    return table, arena, stride


def _copy(table, arena):
    """Another arena of the same layout holding the same bytes, and its memory."""
    twin = HostArena(table.specs)
    twin.block[:] = arena.block
    return twin, Memory([(table, twin)], {})


def _index(shape, ld) -> np.ndarray:
    """Flat indices of a row-major ``shape`` matrix with row stride ``ld``."""
    return np.arange(shape[0])[:, None] * ld + np.arange(shape[1])[None, :]


def _stored_shapes(spec):
    return {"a": (spec.a_shape, spec.lda), "b": (spec.b_shape, spec.ldb), "c": (spec.c_shape, spec.ldc)}


def _fill(arena, spec, batch, rng, kind: str) -> None:
    """Operands of every member: ``"ints"`` (nonzero integers in [-4, 4]: every product and sum
    is exact in every precision, so all implementations agree exactly) or ``"random"`` (normal
    values the precision holds exactly); NaN in the gaps of padded rows; random aux bytes (the
    mask "drelu_bgrad" reads); NaN in an output bias; sentinel pads."""
    for i in range(batch):
        for name, (shape, ld) in _stored_shapes(spec).items():
            flat = np.full(arena.array(f"{name}{i}").size, np.nan, np.float32)
            if kind == "ints":
                values = rng.choice([-4, -3, -2, -1, 1, 2, 3, 4], size=shape).astype(np.float32)
            else:
                values = _representable(rng, shape, spec.precision if name != "c" else "f32")
            flat[_index(shape, ld)] = values
            arena.array(f"{name}{i}")[...] = _to_device_layout(flat, spec.precision) \
                if name != "c" else flat
        if spec.epilogue in WITH_BIAS:
            # Half-integers: a pre-activation is never exactly 0 (where implementations may
            # set or clear the ReLU bit), and every sum stays exact.
            bias = (rng.integers(-6, 7, spec.bias_len) + 0.5).astype(np.float32)
            arena.array(f"bias{i}")[...] = np.nan if spec.epilogue in BIAS_OUT else bias
        if spec.epilogue in WITH_AUX:
            arena.array(f"aux{i}")[...] = rng.integers(0, 256, spec.aux_nbytes, dtype=np.uint8)
        arena.array(f"pad{i}")[...] = SENTINEL


def _member(arena, spec, i) -> dict[str, np.ndarray]:
    return {name: arena.array(f"{name}{i}") for name in spec.operand_nbytes}


def _node(plan, i=0) -> Gemm:
    s = plan.spec
    return Gemm(plan, Buf(f"a{i}"), Buf(f"b{i}"), Buf(f"c{i}"),
                Buf(f"bias{i}") if s.epilogue in WITH_BIAS else None,
                Buf(f"aux{i}") if s.epilogue in WITH_AUX else None)


def _decode(x: np.ndarray, precision: str) -> np.ndarray:
    """Stored operand -> float64 (BF16 bit patterns widened by hand)."""
    if precision == "bf16":
        return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def _aux_bits(aux: np.ndarray, m: int, n: int) -> np.ndarray:
    """The ReLU bitmask as bool ``[m, n]``: bit ``j % 8`` of byte ``j // 8`` of row ``i``."""
    rows = aux.reshape(m, -1).astype(np.int64)
    j = np.arange(n)
    return ((rows[:, j // 8] >> (j % 8)) & 1).astype(bool)


def _numpy(spec: GemmSpec, arrays: dict) -> dict[str, np.ndarray]:
    """One member's results in float64, from its operands (independent of the CPU twin):
    ``c``, the bias gradient ``bias`` and the forward ``pre``-activation and ``bits`` where the
    epilogue has them, and ``op_a``/``op_b``/``c0`` for error bounds."""
    (a_shape, lda), (b_shape, ldb), (c_shape, ldc) = _stored_shapes(spec).values()
    a = _decode(arrays["a"], spec.precision)[_index(a_shape, lda)]
    b = _decode(arrays["b"], spec.precision)[_index(b_shape, ldb)]
    c0 = arrays["c"].astype(np.float64)[_index(c_shape, ldc)]
    op_a, op_b = (a.T if spec.trans_a else a), (b.T if spec.trans_b else b)
    out = {"op_a": op_a, "op_b": op_b, "c0": c0}
    c = spec.alpha * (op_a @ op_b) + (spec.beta * c0 if spec.beta else 0.0)
    ep = spec.epilogue
    if ep in ("bias", "relu_bias", "relu_aux_bias"):
        pre = c + arrays["bias"].astype(np.float64)[None, :]
        out["pre"], out["bits"] = pre, pre > 0
        c = pre if ep == "bias" else np.where(pre > 0, pre, 0.0)
    elif ep == "drelu_bgrad":
        c = np.where(_aux_bits(arrays["aux"], spec.m, spec.n), c, 0.0)
        out["bias"] = c.sum(axis=0)
    elif ep == "bgradb":
        out["bias"] = op_a.sum(axis=1)
    elif ep == "bgrada":
        out["bias"] = op_b.sum(axis=0)
    out["c"] = c
    return out


def _c(arrays, spec) -> np.ndarray:
    return arrays["c"][_index(spec.c_shape, spec.ldc)]


def _assert_member_exact(spec, got: dict, want: dict, before: dict, what: str) -> None:
    """``got`` (one member after the GEMM) holds exactly the float64 results ``want``; inputs and
    padding untouched (``before``: the member before the GEMM)."""
    assert np.array_equal(_c(got, spec), want["c"]), f"{what}: C"
    gaps = np.ones(got["c"].size, bool)
    gaps[_index(spec.c_shape, spec.ldc)] = False
    assert np.array_equal(got["c"][gaps], before["c"][gaps], equal_nan=True), f"{what}: C's row gaps"
    for name in ("a", "b"):
        assert np.array_equal(got[name].view(U8), before[name].view(U8)), f"{what}: {name} written"
    if spec.epilogue in BIAS_OUT:
        assert np.array_equal(got["bias"], want["bias"]), f"{what}: bias gradient"
    elif spec.epilogue in WITH_BIAS:
        assert np.array_equal(got["bias"].view(U8), before["bias"].view(U8)), f"{what}: bias written"
    if spec.epilogue == "relu_aux_bias":
        assert np.array_equal(_aux_bits(got["aux"], spec.m, spec.n), want["bits"]), f"{what}: aux"
    elif spec.epilogue == "drelu_bgrad":
        assert np.array_equal(got["aux"], before["aux"]), f"{what}: aux written"


def _assert_pads(arena, batch, what):
    for i in range(batch):
        assert (arena.array(f"pad{i}") == SENTINEL).all(), f"{what}: member {i}'s pad was written"


# --------------------------------------------------------------------------------------------
# Arguments and the plan-cache key
# --------------------------------------------------------------------------------------------


MAKERS = {
    "CpuGemm": lambda m, n, k, **kw: CpuGemm(m, n, k, **kw),
    "GemmPlan": lambda m, n, k, **kw: GemmPlan(None, m, n, k, **kw),  # refused before any GPU work
    "PlanCache.key": lambda m, n, k, **kw: PlanCache.key(m, n, k, **kw),
    "cpu_planner": lambda m, n, k, **kw: cpu_planner()(m, n, k, **kw),
}


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_batch_arguments_are_refused_by_name_with_what_is_allowed(make):
    for bad in (0, -1, 2.0, True, "3", 2**31):
        with pytest.raises(ValueError, match=r"^batch: .* expected an int in \[1, 2147483647\]$"):
            make(16, 40, 8, batch=bad, batch_stride=4096)
    with pytest.raises(ValueError, match=r"^batch_stride: 256 is not allowed with batch=1; expected 0$"):
        make(16, 40, 8, batch_stride=256)
    for bad in (0, -256, 100, 2560 + 128):
        with pytest.raises(ValueError, match=rf"^batch_stride: {bad} is not allowed with batch=2; "
                                             r"expected a positive multiple of 256 \(bytes\)$"):
            make(16, 40, 8, batch=2, batch_stride=bad)
    for bad in (True, 512.0, None):
        with pytest.raises(ValueError, match=r"^batch_stride: .* expected an int \(bytes\)$"):
            make(16, 40, 8, batch=2, batch_stride=bad)
    # C (16 x 40 f32) spans 2560 bytes, more than A (512) or B (1280): a stride of 2304 would
    # overlap member 0's C with member 1's.
    with pytest.raises(ValueError, match=r"^batch_stride: 2304 is not allowed; operand c spans 2560 "
                                         r"bytes, so members would overlap \(expected >= 2560\)$"):
        make(16, 40, 8, batch=2, batch_stride=2304)


def test_a_cpu_plan_keeps_its_batch():
    plan = cpu_planner()(16, 40, 8, batch=4, batch_stride=2560)
    assert (plan.batch, plan.batch_stride) == (4, 2560)
    assert (CpuGemm(16, 40, 8).batch, CpuGemm(16, 40, 8).batch_stride) == (1, 0)


def test_operand_extents_and_element_strides_by_hand():
    from foxhunt.fast.gemm import batch_strides

    # bf16, trans_a: A stored [k, m] = [8, 16] with lda 20 -> (7 * 20 + 16) * 2 bytes.
    spec = GemmSpec(16, 40, 8, trans_a=True, precision="bf16", epilogue="relu_aux_bias", lda=20)
    # aux: ceil(40 / 8) = 5 bytes a row, padded to 16; 16 rows.
    assert spec.operand_nbytes == {"a": 312, "b": 640, "c": 2560, "bias": 160, "aux": 256}
    assert batch_strides(spec, 4096) == {"a": 2048, "b": 2048, "c": 1024, "bias": 1024, "aux": 32768}
    assert batch_strides(GemmSpec(16, 40, 8), 4096) == {"a": 1024, "b": 1024, "c": 1024}
    assert batch_strides(GemmSpec(16, 40, 8, trans_a=True, epilogue="bgradb"), 512) == \
        {"a": 128, "b": 128, "c": 128, "bias": 128}


def test_the_key_of_an_unbatched_plan_is_unchanged_and_a_batched_one_ends_with_the_batch():
    plain = PlanCache.key(4, 6, 8, epilogue="bias")
    assert plain == (GemmSpec(4, 6, 8, epilogue="bias"), 256, 32 << 20, 0)
    assert PlanCache.key(4, 6, 8, epilogue="bias", batch=1, batch_stride=0) == plain
    batched = PlanCache.key(4, 6, 8, epilogue="bias", batch=3, batch_stride=512)
    assert batched == (*plain, 3, 512)
    others = {PlanCache.key(4, 6, 8, epilogue="bias", batch=b, batch_stride=s)
              for b, s in ((4, 512), (3, 768), (2, 512))}
    assert len({plain, batched, *others}) == 5


def test_the_plan_cache_asks_again_for_a_batched_gemm_and_passes_the_batch_on():
    made = []

    def make(m, n, k, heuristic=None, **kw):
        made.append(kw)
        return collections.namedtuple("Plan", "heuristic")(heuristic or ("algo", len(made)))

    cache = PlanCache(make)
    plain = cache(8, 8, 8, epilogue="relu_bias")
    batched = [cache(8, 8, 8, epilogue="relu_bias", batch=5, batch_stride=1024) for _ in range(2)]
    assert cache.queries == 2 and batched[0].heuristic != plain.heuristic
    assert batched[1].heuristic == batched[0].heuristic  # an equal batched GEMM: no new query
    assert [kw.get("batch") for kw in made] == [None, 5, 5]
    assert made[2]["batch_stride"] == 1024


# --------------------------------------------------------------------------------------------
# The attributes a GemmPlan sets (a recording stand-in for nvmath.bindings.cublasLt)
# --------------------------------------------------------------------------------------------


class _FakeLt:
    """Records every attribute a plan sets: ``log`` entries ``(object, attribute name, value)``,
    layouts named ``layout0..2`` in creation order (``layouts``: their type, rows, cols, ld).
    Attribute value types as the cuBLASLt documentation gives them."""

    class MatmulDescAttribute(enum.IntEnum):
        TRANSA = 3
        TRANSB = 4
        EPILOGUE = 7
        BIAS_POINTER = 8
        BIAS_BATCH_STRIDE = 10
        EPILOGUE_AUX_POINTER = 11
        EPILOGUE_AUX_LD = 12
        EPILOGUE_AUX_BATCH_STRIDE = 13
        SM_COUNT_TARGET = 15

    class MatrixLayoutAttribute(enum.IntEnum):
        BATCH_COUNT = 5
        STRIDED_BATCH_OFFSET = 6

    class MatmulPreferenceAttribute(enum.IntEnum):
        MAX_WORKSPACE_BYTES = 1
        MIN_ALIGNMENT_A_BYTES = 5
        MIN_ALIGNMENT_B_BYTES = 6
        MIN_ALIGNMENT_C_BYTES = 7
        MIN_ALIGNMENT_D_BYTES = 8

    Epilogue = enum.IntEnum("Epilogue", {"DEFAULT": 1, "BIAS": 4, "RELU_BIAS": 6, "RELU_AUX_BIAS": 134,
                                         "DRELU_BGRAD": 152, "BGRADA": 256, "BGRADB": 512})
    matmul_heuristic_result_dtype = np.dtype([("algo", np.uint64, (8,)), ("workspace_size", np.uint64),
                                              ("state", np.int32), ("waves_count", np.float32),
                                              ("reserved", np.int32, (4,))])
    _TYPES = {"TRANSA": np.int32, "TRANSB": np.int32, "EPILOGUE": np.uint32, "BIAS_POINTER": np.uint64,
              "BIAS_BATCH_STRIDE": np.int64, "EPILOGUE_AUX_POINTER": np.uint64,
              "EPILOGUE_AUX_LD": np.int64, "EPILOGUE_AUX_BATCH_STRIDE": np.int64,
              "SM_COUNT_TARGET": np.int32, "BATCH_COUNT": np.int32, "STRIDED_BATCH_OFFSET": np.int64,
              "MAX_WORKSPACE_BYTES": np.uint64, "MIN_ALIGNMENT_A_BYTES": np.uint32,
              "MIN_ALIGNMENT_B_BYTES": np.uint32, "MIN_ALIGNMENT_C_BYTES": np.uint32,
              "MIN_ALIGNMENT_D_BYTES": np.uint32}

    def __init__(self):
        self.log: list[tuple] = []
        self.layouts: dict[str, tuple] = {}

    def create(self):
        return 1

    def _dtype(self, attr):
        return np.dtype(self._TYPES[attr.name])

    get_matmul_desc_attribute_dtype = get_matrix_layout_attribute_dtype = \
        get_matmul_preference_attribute_dtype = _dtype

    def _set(self, obj, attr, ptr, size):
        dtype = self._dtype(attr)
        assert size == dtype.itemsize, f"{attr.name}: {size} bytes, cuBLASLt takes {dtype}"
        self.log.append((obj, attr.name, np.frombuffer(ctypes.string_at(ptr, size), dtype)[0].item()))

    matmul_desc_set_attribute = matrix_layout_set_attribute = matmul_preference_set_attribute = _set

    def matmul_desc_create(self, compute, scale):
        return "desc"

    def matmul_preference_create(self):
        return "pref"

    def matrix_layout_create(self, dtype, rows, cols, ld):
        name = f"layout{len(self.layouts)}"
        self.layouts[name] = (dtype, rows, cols, ld)
        return name

    def matmul_algo_get_heuristic(self, handle, desc, a, b, c, d, pref, count, result, found):
        ctypes.c_int32.from_address(found).value = 1  # a zeroed result: state 0, no workspace

    def matmul_desc_destroy(self, obj):
        pass

    matrix_layout_destroy = matmul_preference_destroy = matmul_desc_destroy


class _FakeDevice:
    ordinal = -1

    def make_current(self):
        pass


def _recorded_plan(monkeypatch, **kw) -> _FakeLt:
    from foxhunt.fast import gemm

    lt = _FakeLt()
    monkeypatch.setattr(gemm, "_cublaslt", lambda: lt)
    monkeypatch.setattr(gemm, "_HANDLES", {})  # the fake handle never reaches the real cache
    GemmPlan(_FakeDevice(), **kw).close()
    return lt


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("epilogue", EPILOGUES, ids=str)
def test_a_batched_plan_sets_the_batch_attributes_and_an_unbatched_one_none(monkeypatch, epilogue,
                                                                          precision):
    kw = _kw(epilogue, precision, CPU_SHAPE)
    stride = 4096 * 3
    single = _recorded_plan(monkeypatch, **kw)
    default = _recorded_plan(monkeypatch, **kw, batch=1, batch_stride=0)
    batched = _recorded_plan(monkeypatch, **kw, batch=BATCH, batch_stride=stride)
    assert single.log == default.log and single.layouts == default.layouts == batched.layouts
    assert not [entry for entry in single.log if "BATCH" in entry[1]]
    # What batching adds, and nothing else: per layout its batch count and its stride in its
    # own elements (type 0 is CUDA_R_32F, 14 CUDA_R_16BF), per epilogue vector its stride.
    itemsize = {0: 4, 14: 2}
    want = [(name, attr, value) for name, (dtype, *_) in single.layouts.items()
            for attr, value in (("BATCH_COUNT", BATCH),
                                ("STRIDED_BATCH_OFFSET", stride // itemsize[dtype]))]
    if epilogue in WITH_BIAS:
        want.append(("desc", "BIAS_BATCH_STRIDE", stride // 4))  # f32 bias elements
    if epilogue in WITH_AUX:
        want.append(("desc", "EPILOGUE_AUX_BATCH_STRIDE", stride * 8))  # bits
    added = collections.Counter(batched.log) - collections.Counter(single.log)
    assert sorted(added.elements()) == sorted(want)
    kept = collections.Counter(batched.log) - collections.Counter(want)
    assert kept == collections.Counter(single.log)
    # The layouts' types are the precision's: A and B in its input type, C in f32.
    in_type = 14 if precision == "bf16" else 0
    assert [t for t, *_ in single.layouts.values()] == [in_type, in_type, 0]


# --------------------------------------------------------------------------------------------
# CpuGemm: a batched run is batch separate runs
# --------------------------------------------------------------------------------------------


def _case(epilogue, precision, shape, seed: int, kind: str, padded: bool = False):
    """``(kw, spec, table, arena, stride)`` of one case, the arena filled (``_fill``)."""
    kw = _kw(epilogue, precision, shape, padded)
    spec = GemmSpec(**kw)
    table, arena, stride = _layout(spec, BATCH)
    _fill(arena, spec, BATCH, np.random.default_rng(seed), kind)
    return kw, spec, table, arena, stride


def _batched_and_separate(kw, table, arena, stride):
    """Run the batched ``CpuGemm`` on ``arena`` in place and ``BATCH`` batch=1 ``CpuGemm``s, one
    per member, on a copy of it; the copy (after its runs)."""
    separate, separate_mem = _copy(table, arena)
    plan = CpuGemm(**kw, batch=BATCH, batch_stride=stride)
    plan.run(Memory([(table, arena)], {}), _node(plan))
    single = CpuGemm(**kw)
    for i in range(BATCH):
        single.run(separate_mem, _node(single, i))
    return separate


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded_ld"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("epilogue", EPILOGUES, ids=str)
def test_a_batched_cpu_gemm_is_batch_separate_gemms_and_matches_numpy(epilogue, precision, padded):
    kw, spec, table, arena, stride = _case(epilogue, precision, CPU_SHAPE, 11, "ints", padded)
    before, _ = _copy(table, arena)
    separate = _batched_and_separate(kw, table, arena, stride)
    assert np.array_equal(arena.block, separate.block), "batched != separate runs, bit for bit"
    for i in range(BATCH):
        want = _numpy(spec, _member(before, spec, i))
        _assert_member_exact(spec, _member(arena, spec, i), want, _member(before, spec, i),
                             f"member {i}")
    _assert_pads(arena, BATCH, "CPU")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_batched_cpu_gemm_on_random_operands_is_separate_gemms_bit_for_bit(precision):
    """TF32 rounding and float32 sums included: each member is computed as a lone GEMM."""
    for epilogue in EPILOGUES:
        kw, spec, table, arena, stride = _case(epilogue, precision, CPU_SHAPE, 13, "random")
        separate = _batched_and_separate(kw, table, arena, stride)
        assert np.array_equal(arena.block, separate.block), f"{epilogue}: batched != separate"
        c = [_c(_member(arena, spec, i), spec) for i in range(BATCH)]
        assert not np.array_equal(c[0], c[1]), "members hold different operands"


def test_a_member_outside_the_arena_is_an_error():
    kw = _kw("bias", "f32", CPU_SHAPE)
    table, arena, stride = _layout(GemmSpec(**kw), 2)
    plan = CpuGemm(**kw, batch=3, batch_stride=stride)  # one member more than the arena holds
    with pytest.raises(ValueError, match="is in no arena of this plan"):
        plan.run(Memory([(table, arena)], {}), _node(plan))


# --------------------------------------------------------------------------------------------
# GPU: the cuBLASLt batched plan
# --------------------------------------------------------------------------------------------


_CUDA, _CUDA_REASON = cuda_available()
needs_gpu = pytest.mark.skipif(not _CUDA, reason=f"no CUDA device/driver: {_CUDA_REASON}")


@pytest.fixture(scope="module")
def device():
    from foxhunt.fast.device import Device

    return Device()


class _DeviceBlock:
    """A host arena's whole block on the device (the same offsets), to run plans on."""

    def __init__(self, device, table, arena):
        self.device, self.table, self.arena = device, table, arena
        self.buf = device.alloc(arena.block.size)  # cuMemAlloc: 256-byte aligned, as the arena

    def ptr(self, name: str) -> int:
        return self.buf.ptr + self.arena.spec(name).offset

    def run(self, plan, i: int = 0) -> HostArena:
        """Upload the host block, run ``plan`` on member ``i``'s pointers, return the result."""
        s = plan.spec
        self.device.copy_to_device(self.buf.ptr, self.arena.block)
        plan.run(self.ptr(f"a{i}"), self.ptr(f"b{i}"), self.ptr(f"c{i}"),
                 bias_ptr=self.ptr(f"bias{i}") if s.epilogue in WITH_BIAS else None,
                 aux_ptr=self.ptr(f"aux{i}") if s.epilogue in WITH_AUX else None,
                 stream=self.device.stream)
        self.device.stream.synchronize()
        out = HostArena(self.table.specs)
        self.device.copy_to_host(out.block, self.buf.ptr)
        return out

    def close(self):
        self.buf.free()


def gpu_cases(test):
    """A GPU test over every shape of ``GPU_SHAPES``, precision and epilogue (skipped with the
    reason where there is no CUDA device)."""
    for mark in (pytest.mark.parametrize("epilogue", EPILOGUES, ids=str),
                 pytest.mark.parametrize("precision", PRECISIONS),
                 pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s))),
                 pytest.mark.gpu, needs_gpu):
        test = mark(test)
    return test


def _cpu_twin(table, arena, kw, stride):
    """The CPU twin's batched run on a copy of ``arena`` (the copy, after the run)."""
    twin, twin_mem = _copy(table, arena)
    cpu = CpuGemm(**kw, batch=BATCH, batch_stride=stride)
    cpu.run(twin_mem, _node(cpu))
    return twin


def _gpu_plans(device, kw, stride, batch=BATCH):
    """The batched plan (``stride``: one or per operand); skipped (with the reason) where
    cuBLASLt has no algorithm even for one member, a limit of cuBLASLt rather than of batching."""
    try:
        GemmPlan(device, **kw).close()
    except GemmPlanError as exc:
        pytest.skip(f"cuBLASLt has no unbatched algorithm for this GEMM: {exc}")
    return GemmPlan(device, **kw, batch=batch, batch_stride=stride)


def _run_closed(device, table, arena, plan) -> HostArena:
    """``plan`` run once on the device copy of ``arena`` (its batch 0's pointers), then closed;
    the device block after the run."""
    block = _DeviceBlock(device, table, arena)
    try:
        return block.run(plan)
    finally:
        block.close()
        plan.close()


@gpu_cases
def test_gpu_batched_plan_equals_the_cpu_twin_on_integer_operands(device, lt, epilogue, precision,
                                                                  shape):
    """Integer operands: every product and sum is exact, so any algorithm gives the CPU twin's
    (and NumPy's) values exactly, member by member."""
    kw, spec, table, arena, stride = _case(epilogue, precision, shape, 17, "ints")
    got = _run_closed(device, table, arena, _gpu_plans(device, kw, stride))
    twin = _cpu_twin(table, arena, kw, stride)
    for i in range(BATCH):
        before = _member(arena, spec, i)
        _assert_member_exact(spec, _member(got, spec, i), _numpy(spec, before), before,
                             f"GPU member {i}")
        _assert_member_exact(spec, _member(twin, spec, i), _numpy(spec, before), before,
                             f"CPU member {i}")
    _assert_pads(got, BATCH, "GPU")


def _same_algorithm_plan(device, kw, batched):
    """A batch=1 plan with the batched plan's algorithm when cuBLASLt's check accepts it for
    one member (then the two must agree bit for bit), else with its own: ``(plan, same)``."""
    try:
        return GemmPlan(device, **kw, heuristic=batched.heuristic, verify=True), True
    except GemmPlanError:
        return GemmPlan(device, **kw), False


def _bounds(spec, want: dict) -> dict[str, np.ndarray]:
    """Allowed |GPU - float64| per output (``test_fast_gpu``'s GEMM bound)."""
    k = spec.k
    extra = np.abs(want["c"])
    if spec.beta:
        extra = extra + 2 * abs(spec.beta) * np.abs(want["c0"])
    if "pre" in want:
        extra = np.abs(want["pre"]) + np.abs(want["pre"] - (want["op_a"] @ want["op_b"]))
    c = abs(spec.alpha) * _gemm_bound(want["op_a"], want["op_b"], k, extra)
    out = {"c": c}
    if spec.epilogue == "drelu_bgrad":
        out["bias"] = c.sum(axis=0) + 2 * spec.m * U * (np.abs(want["c"]) + c).sum(axis=0) + 1e-30
    elif spec.epilogue in ("bgrada", "bgradb"):
        reduced = want["op_b"] if spec.epilogue == "bgrada" else want["op_a"].T
        out["bias"] = 2 * k * U * np.abs(reduced).sum(axis=0) + 1e-30
    return out


@gpu_cases
def test_gpu_batched_members_equal_single_plans_and_the_cpu_twin(device, lt, epilogue, precision,
                                                                 shape):
    """Random operands the precision holds exactly: member ``i`` of the batched plan equals a
    batch=1 plan run on member ``i``'s operands, bit for bit with the same algorithm (within the
    bound otherwise, with a warning saying so); and both GPU results and the CPU twin lie
    within the GEMM bound of the float64 result, so GPU and CPU twin within twice it."""
    kw, spec, table, arena, stride = _case(epilogue, precision, shape, 19, "random")
    batched = _gpu_plans(device, kw, stride)
    single, same = _same_algorithm_plan(device, kw, batched)
    block = _DeviceBlock(device, table, arena)
    try:
        got = block.run(batched)
        alone = [block.run(single, i) for i in range(BATCH)]
    finally:
        block.close()
        batched.close()
        single.close()
    if not same:
        warnings.warn(f"{epilogue} {precision} {shape}: cuBLASLt's batched algorithm does not run "
                      "one member; members compared with single plans within the GEMM bound")
    twin = _cpu_twin(table, arena, kw, stride)
    _assert_pads(got, BATCH, "GPU")
    outputs = ["c", *(["bias"] if epilogue in BIAS_OUT else [])]
    for i in range(BATCH):
        want = _numpy(spec, _member(arena, spec, i))
        bound = _bounds(spec, want)
        mine, lone, cpu_i = (_member(x, spec, i) for x in (got, alone[i], twin))
        results = {"gpu": mine, "single": lone, "cpu": cpu_i}
        for name in outputs:
            pick = (lambda r: _c(r, spec)) if name == "c" else (lambda r: r["bias"])  # noqa: E731
            if same:
                assert np.array_equal(pick(mine).view(np.uint32), pick(lone).view(np.uint32)), \
                    f"member {i} {name}: batched and single plans of one algorithm differ"
            for who, result in results.items():
                _assert_within(pick(result), want[name], bound[name], f"{who} member {i} {name}")
            _assert_within(pick(mine), pick(cpu_i).astype(np.float64), 2 * bound[name],
                           f"GPU vs CPU twin member {i} {name}")
        if epilogue == "relu_aux_bias":
            certain = np.abs(want["pre"]) > bound["c"]  # away from 0 the sign is certain
            for who, result in results.items():
                bits = _aux_bits(result["aux"], spec.m, spec.n)
                assert np.array_equal(bits[certain], want["bits"][certain]), f"{who} member {i} aux"
                assert np.array_equal(bits, _c(result, spec) > 0), f"{who} member {i}: aux != C > 0"
            if same:
                assert np.array_equal(_aux_bits(mine["aux"], spec.m, spec.n),
                                      _aux_bits(lone["aux"], spec.m, spec.n)), f"member {i} aux bits"


# --------------------------------------------------------------------------------------------
# Per-operand strides (the stacked C51 + CQL backward: two batches sharing the read operands)
# --------------------------------------------------------------------------------------------


def _shared(epilogue) -> set[str]:
    """The operands the stacked backward shares between its batches (stride 0): B (the weights
    or activations), a bias the epilogue only reads, the bitmask DRELU_BGRAD reads."""
    out = {"b"}
    if epilogue in WITH_BIAS and epilogue not in BIAS_OUT:
        out.add("bias")
    if epilogue == "drelu_bgrad":
        out.add("aux")
    return out


def _stacked_case(epilogue, precision, shape, seed: int, kind: str):
    """``(kw, spec, table, arena, strides)``: 2 batches, each operand of ``_shared`` once
    (``<name>0``), every other one per batch (``<name>0``, ``<name>1``, adjacent), then a pad;
    filled as ``_fill`` fills a member; ``strides``: the per-operand batch strides (bytes)."""
    kw = _kw(epilogue, precision, shape)
    spec = GemmSpec(**kw)
    shared = _shared(epilogue)
    table = BufferTable()
    for name, nbytes in spec.operand_nbytes.items():
        for i in range(1 if name in shared else 2):
            table._add(f"{name}{i}", nbytes // _dtype(spec, name).itemsize, _dtype(spec, name))
    table._add("pad0", PAD, U8)
    arena = HostArena(table.specs)
    strides = {name: 0 if name in shared else arena.ptr(f"{name}1") - arena.ptr(f"{name}0")
               for name in spec.operand_nbytes}
    full = BufferTable()  # the two members' operands as _fill lays them out, then copied over
    for i in range(2):
        for name, nbytes in spec.operand_nbytes.items():
            full._add(f"{name}{i}", nbytes // _dtype(spec, name).itemsize, _dtype(spec, name))
        full._add(f"pad{i}", PAD, U8)
    source = HostArena(full.specs)
    _fill(source, spec, 2, np.random.default_rng(seed), kind)
    for name in table.specs:
        arena.array(name)[...] = source.array(name)
    return kw, spec, table, arena, strides


def _stacked_member(arena, spec, i) -> dict[str, np.ndarray]:
    shared = _shared(spec.epilogue)
    return {name: arena.array(f"{name}{0 if name in shared else i}") for name in spec.operand_nbytes}


def _stacked_node(plan) -> Gemm:
    s = plan.spec
    second = tuple((name, Buf(f"{name}1")) for name, stride in plan.batch_stride if stride)
    return Gemm(plan, Buf("a0"), Buf("b0"), Buf("c0"),
                Buf("bias0") if s.epilogue in WITH_BIAS else None,
                Buf("aux0") if s.epilogue in WITH_AUX else None, second)


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_per_operand_strides_are_refused_by_name_with_what_is_allowed(make):
    kw = _kw("drelu_bgrad", "f32", CPU_SHAPE)  # c and bias written, a, b, aux read
    spec = GemmSpec(**kw)
    ok = {"a": 4096, "b": 0, "c": 4096, "bias": 256, "aux": 0}
    with pytest.raises(ValueError, match=r"^batch_stride: per-operand strides are not allowed with "
                                         r"batch=1; expected 0$"):
        make(**kw, batch_stride=ok)
    missing = {k: v for k, v in ok.items() if k != "aux"}
    with pytest.raises(ValueError, match=r"^batch_stride: operands \['a', 'b', 'bias', 'c'\] are not "
                                         r"allowed for epilogue 'drelu_bgrad'; expected a stride for "
                                         r"each of \['a', 'aux', 'b', 'bias', 'c'\]$"):
        make(**kw, batch=2, batch_stride=missing)
    with pytest.raises(ValueError, match=r"^batch_stride\['c'\]: 0 is not allowed; expected a "
                                         r"positive multiple of 256 \(bytes\)$"):
        make(**kw, batch=2, batch_stride={**ok, "c": 0})
    with pytest.raises(ValueError, match=r"^batch_stride\['b'\]: 100 is not allowed; expected a "
                                         r"non-negative multiple of 256 \(bytes\)$"):
        make(**kw, batch=2, batch_stride={**ok, "b": 100})
    with pytest.raises(ValueError, match=r"^batch_stride\['a'\]: -256 is not allowed"):
        make(**kw, batch=2, batch_stride={**ok, "a": -256})
    extent = spec.operand_nbytes["c"]
    small = extent // 256 * 256
    with pytest.raises(ValueError, match=rf"^batch_stride\['c'\]: {small} is not allowed; the plan "
                                         rf"writes operand c, which spans {extent} bytes, so batches "
                                         rf"would overlap \(expected >= {extent}\)$"):
        make(**kw, batch=2, batch_stride={**ok, "c": small})
    with pytest.raises(ValueError, match=r"^batch_stride\['a'\]: 1.5 is not allowed; expected an "
                                         r"int \(bytes\)$"):
        make(**kw, batch=2, batch_stride={**ok, "a": 1.5})


def test_per_operand_strides_are_kept_in_operand_order_and_in_the_key():
    from foxhunt.fast.gemm import batch_strides, check_batch

    spec = GemmSpec(16, 40, 8, epilogue="drelu_bgrad")
    given = {"aux": 0, "c": 4096, "bias": 256, "b": 0, "a": 2048}
    batch, strides = check_batch(2, given, spec)
    assert (batch, strides) == (2, (("a", 2048), ("b", 0), ("c", 4096), ("bias", 256), ("aux", 0)))
    assert batch_strides(spec, strides) == {"a": 512, "b": 0, "c": 1024, "bias": 64, "aux": 0}
    bf16 = GemmSpec(16, 40, 8, precision="bf16")
    assert batch_strides(bf16, check_batch(2, {"a": 512, "b": 0, "c": 2560}, bf16)[1]) == \
        {"a": 256, "b": 0, "c": 640}
    key = PlanCache.key(16, 40, 8, epilogue="drelu_bgrad", batch=2, batch_stride=given)
    assert key[-2:] == (2, strides)
    assert key != PlanCache.key(16, 40, 8, epilogue="drelu_bgrad", batch=2,
                                batch_stride={**given, "b": 256})
    assert CpuGemm(16, 40, 8, epilogue="drelu_bgrad", batch=2, batch_stride=given).batch_stride \
        == strides


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("epilogue", EPILOGUES, ids=str)
def test_a_plan_with_per_operand_strides_sets_each_operands_own(monkeypatch, epilogue, precision):
    kw = _kw(epilogue, precision, CPU_SHAPE)
    spec = GemmSpec(**kw)
    strides = {name: 0 if name in _shared(epilogue) else 8192 * (i + 1)
               for i, name in enumerate(spec.operand_nbytes)}
    single = _recorded_plan(monkeypatch, **kw)
    stacked = _recorded_plan(monkeypatch, **kw, batch=2, batch_stride=strides)
    itemsize = {0: 4, 14: 2}
    # cuBLAS's A layout (layout0) is our B, its B (layout1) our A, layout2 is C.
    ours = dict(zip(single.layouts, ("b", "a", "c")))
    want = [(layout, attr, value) for layout, (dtype, *_) in single.layouts.items()
            for attr, value in (("BATCH_COUNT", 2),
                                ("STRIDED_BATCH_OFFSET", strides[ours[layout]] // itemsize[dtype]))]
    if epilogue in WITH_BIAS:
        want.append(("desc", "BIAS_BATCH_STRIDE", strides["bias"] // 4))
    if epilogue in WITH_AUX:
        want.append(("desc", "EPILOGUE_AUX_BATCH_STRIDE", strides["aux"] * 8))
    added = collections.Counter(stacked.log) - collections.Counter(single.log)
    assert sorted(added.elements()) == sorted(want)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("epilogue", EPILOGUES, ids=str)
def test_a_stacked_cpu_gemm_is_two_gemms_on_the_shared_operands(epilogue, precision):
    """Two batches, the read operands of ``_shared`` stored once (stride 0): each batch's
    results are exactly NumPy's on its operands (integer operands), the shared operands and the
    pad untouched, and the bytes equal two batch=1 runs."""
    kw, spec, table, arena, strides = _stacked_case(epilogue, precision, CPU_SHAPE, 23, "ints")
    before, _ = _copy(table, arena)
    separate, separate_mem = _copy(table, arena)
    plan = CpuGemm(**kw, batch=2, batch_stride=strides)
    plan.run(Memory([(table, arena)], {}), _stacked_node(plan))
    single = CpuGemm(**kw)
    for i in range(2):
        s = spec
        pick = lambda name: f"{name}{0 if name in _shared(epilogue) else i}"  # noqa: E731
        single.run(separate_mem, Gemm(single, Buf(pick("a")), Buf(pick("b")), Buf(pick("c")),
                                      Buf(pick("bias")) if s.epilogue in WITH_BIAS else None,
                                      Buf(pick("aux")) if s.epilogue in WITH_AUX else None))
    assert np.array_equal(arena.block, separate.block), "stacked != two runs, bit for bit"
    for i in range(2):
        was = _stacked_member(before, spec, i)
        _assert_member_exact(spec, _stacked_member(arena, spec, i), _numpy(spec, was), was,
                             f"batch {i}")
    assert (arena.array("pad0") == SENTINEL).all()
    c = [_c(_stacked_member(arena, spec, i), spec) for i in range(2)]
    assert not np.array_equal(c[0], c[1]), "the batches hold different operands"


def test_the_binder_takes_batch_ones_operands_one_stride_past_batch_zeros():
    """Batch 1's operands are blocks of batch 0's buffers (``BufferTable._add_stacked``), each
    exactly its stride past; the record reads and writes both batches' regions."""
    from foxhunt.fast.binder import Binder
    from foxhunt.fast.records import PlanError

    kw = _kw("drelu_bgrad", "f32", CPU_SHAPE)
    spec = GemmSpec(**kw)
    table = BufferTable()
    for name, nbytes in spec.operand_nbytes.items():
        count, dtype = nbytes // _dtype(spec, name).itemsize, _dtype(spec, name)
        if name in _shared("drelu_bgrad"):
            table._add(f"{name}0", count, dtype)
        else:
            table._add_stacked(f"{name}s", (f"{name}0", f"{name}1"), count, dtype)
    strides = {name: 0 if name in _shared("drelu_bgrad") else
               table.region(Buf(f"{name}1")).byte_start for name in spec.operand_nbytes}
    assert strides["c"] >= spec.operand_nbytes["c"] and strides["c"] % 256 == 0
    binder = Binder(table.region, constants={})
    plan = CpuGemm(**kw, batch=2, batch_stride=strides)
    first = dict(a="a0", b="b0", c="c0", bias="bias0", aux="aux0")
    node = binder.gemm(plan, **first, second={"a": "a1", "c": "c1", "bias": "bias1"})
    assert node.second == (("a", Buf("a1")), ("c", Buf("c1")), ("bias", Buf("bias1")))
    got = {(a.buffer, a.start, a.write) for a in node.accesses}
    for name in ("a", "c", "bias"):
        write = name != "a"
        assert {(f"{name}s", 0, write), (f"{name}s", strides[name], write)} <= got, name
    assert {("b0", 0, False), ("aux0", 0, False)} <= got
    assert "batch 1: a=a1 c=c1 bias=bias1" in str(node)
    with pytest.raises(PlanError, match=r"batch 1's operands \['a', 'c'\] given; the plan strides "
                                        r"\['a', 'bias', 'c'\]$"):
        binder.gemm(plan, **first, second={"a": "a1", "c": "c1"})
    with pytest.raises(PlanError, match=r"operand c: batch 1's c0 is not \d+ bytes past c0 in one "
                                        r"buffer$"):
        binder.gemm(plan, **first, second={"a": "a1", "c": "c0", "bias": "bias1"})
    with pytest.raises(PlanError, match="batch 1's operands given, but the plan has no per-operand"):
        binder.gemm(CpuGemm(**kw), **first, second={"a": "a1"})
    with pytest.raises(PlanError, match="a plan with per-operand strides binds 2 batches; it has 3"):
        binder.gemm(CpuGemm(**kw, batch=3, batch_stride=strides), **first,
                    second={"a": "a1", "c": "c1", "bias": "bias1"})


# GPU: the cuBLASLt plan with per-operand strides


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("epilogue", EPILOGUES, ids=str)
def test_gpu_stacked_plan_equals_numpy_and_the_cpu_twin_on_integer_operands(device, lt, epilogue,
                                                                          precision):
    """Every epilogue with the read operands shared (stride 0): exact on integer operands, batch
    by batch, and byte for byte the CPU twin's block."""
    shape = GPU_SHAPES[0]
    kw, spec, table, arena, strides = _stacked_case(epilogue, precision, shape, 29, "ints")
    got = _run_closed(device, table, arena, _gpu_plans(device, kw, strides, batch=2))
    twin, twin_mem = _copy(table, arena)
    cpu = CpuGemm(**kw, batch=2, batch_stride=strides)
    cpu.run(twin_mem, _stacked_node(cpu))
    for i in range(2):
        was = _stacked_member(arena, spec, i)
        _assert_member_exact(spec, _stacked_member(got, spec, i), _numpy(spec, was), was,
                             f"GPU batch {i}")
    assert (got.array("pad0") == SENTINEL).all()
    assert np.array_equal(got.block, twin.block), "GPU != CPU twin, byte for byte"
