"""cuBLASLt GEMMs, planned once and run many times (graph-capturable).

Convention: every matrix is a row-major C array. A plan computes

    C = alpha * op(A) @ op(B) + beta * C        (then the epilogue)

with ``op(X) = X.T`` when ``trans_x``: ``op(A)`` is ``[m, k]``, ``op(B)`` is ``[k, n]``, ``C`` is
``[m, n]``. A is stored ``[m, k]`` (``[k, m]`` when ``trans_a``), B ``[k, n]`` (``[n, k]`` when
``trans_b``); ``lda``/``ldb``/``ldc`` are the row strides in elements (default: dense).

cuBLAS is column-major. A row-major ``[r, c]`` array with row stride ``ld`` *is* the
column-major ``[c, r]`` array with leading dimension ``ld``, i.e. its transpose. So we ask
cuBLAS for ``C.T = op(B).T @ op(A).T``: cuBLAS's "A" is our B and cuBLAS's "B" is our A, its
``m`` is our ``n`` and its ``n`` our ``m`` (``colmajor_problem`` does the mapping; it is pure and
tested on the CPU). The epilogues are named in *our* row-major terms:

=================  ============================================================  ===============
epilogue           effect (row-major)                                            cuBLASLt
=================  ============================================================  ===============
None               ``C = alpha op(A) op(B) + beta C``                            DEFAULT
"bias"             ``C[i, j] += bias[j]`` (bias ``[n]`` f32)                       BIAS
"relu_bias"        ``C = relu(op(A) op(B) + bias)``                                RELU_BIAS
"relu_aux_bias"    as relu_bias, and writes the ReLU bitmask ``aux``                RELU_AUX_BIAS
"drelu_bgrad"      ``C = (op(A) op(B)) * mask(aux)``; ``bias[j] = sum_i C[i, j]``   DRELU_BGRAD
"bgradb"           plain product; ``bias[i] = sum_k op(A)[i, k]`` (``[m]``)        BGRADB
"bgrada"           plain product; ``bias[j] = sum_k op(B)[k, j]`` (``[n]``)        BGRADA
=================  ============================================================  ===============

Every epilogue is named as cuBLASLt names it. The bias-gradient ones reduce a *cuBLAS*
operand: cuBLAS's B is our row-major A (so "bgradb" reduces our A) and cuBLAS's A is our B
("bgrada" reduces our B). For "bias"-like epilogues ``bias_ptr`` is an input; for the
``*grad*`` ones it is the output (f32). The ReLU ``aux`` bitmask holds one bit per element of
C, one padded bit-row per row of C: ``aux_ld = round_up(ceil(n / 8), 16) * 8`` bits,
``aux_nbytes = aux_ld / 8 * m`` bytes (``GemmSpec.aux_nbytes``); "drelu_bgrad" reads the mask
a "relu_aux_bias" plan of the same ``(m, n)`` wrote. Weight-gradient GEMMs: ``dW[in, out] =
X.T @ dZ`` with ``db`` is ``trans_a=True`` + "bgrada"; ``dW[out, in] = dZ.T @ X`` with ``db``
is ``trans_a=True`` + "bgradb" (cuBLASLt's BGRADB with transposed B in its terms, the
configuration nvmath and TransformerEngine use). The reduced operand must be stored
``[k, *]``: "bgrada" needs ``trans_b=False``, "bgradb" needs ``trans_a=True`` (cuBLASLt 13.0
on sm_90 supports no other layout; ``GemmSpec`` rejects them).

NaN behaviour of the fused ReLU epilogues (seen on an H200, cuBLAS 13.0): a NaN pre-activation
stays NaN in C (the reference's ``add_bias_relu``, ``t <= 0 ? 0 : t``); its aux bit depends on
the algorithm: the f32 plans set it, the bf16 plans of the ``seed`` and ``tiny`` steps' forward
shapes leave it clear (``tests/test_fast_gpu.py``, session 21). Every other output's bit is
``not C <= 0``. DRELU_BGRAD is a select (a NaN gradient under a clear bit gives 0, a set bit
passes the gradient), so RELU_AUX_BIAS + DRELU_BGRAD follow the reference's ``relu_mask``
(``h <= 0 ? 0 : dy``) except at a NaN output whose bit is clear, where the gradient becomes 0:
the step does not use the pair (``step_program``'s docstring).

Precisions (scale type and C/D are always f32):

- ``"f32"``: A, B f32, ``CUBLAS_COMPUTE_32F``: SGEMM-equivalent, no TF32.
- ``"tf32"``: A, B f32, ``CUBLAS_COMPUTE_32F_FAST_TF32``: inputs rounded to TF32 on the tensor
  cores, f32 accumulation (the "bf16" step's backward: cuBLAS has no f32 x bf16 GEMM).
- ``"bf16"``: A, B BF16 (uint16 bit patterns on the host), ``CUBLAS_COMPUTE_32F``: BF16
  tensor-core products, f32 accumulation, f32 C.

A plan fixes the algorithm (cuBLASLt's top heuristic, so a run is bitwise repeatable) and owns
a workspace of exactly the size that algorithm asks for, allocated once. ``run`` only sets the
bias/aux pointers when they change and calls ``cublasLtMatmul``: no allocation, no sync, so it
can be captured in a CUDA graph. Operands must be ``min_alignment``-byte aligned (default
256, what arena buffers are); ``run`` checks.

Batched plans (a population's members, SPEC 12): ``batch`` > 1 plans one cuBLASLt
strided-batched GEMM of ``batch`` independent members. Member ``i``'s A, B, C, bias and aux
lie ``i * batch_stride`` bytes past member 0's (the pointers ``run`` takes); ``batch_stride``
is a positive multiple of 256 bytes, at least every operand's extent
(``GemmSpec.operand_nbytes``: members never overlap), and 0 when ``batch`` is 1
(``check_batch``). The plan sets ``BATCH_COUNT`` and ``STRIDED_BATCH_OFFSET`` on the A, B and
C/D layouts and, where the epilogue has them, ``BIAS_BATCH_STRIDE`` and
``EPILOGUE_AUX_BATCH_STRIDE``, each in elements of its operand (``batch_strides``: the ReLU
bitmask's element is one bit); with ``batch`` 1 it sets none of them. Per the cuBLASLt
documentation (https://docs.nvidia.com/cuda/cublas/#cublasltmatmuldescattributes-t and
#cublasltepilogue-t): the bias batch stride serves the bias input (BIAS, RELU_BIAS,
RELU_AUX_BIAS) and the bias-gradient output (DRELU_BGRAD, BGRADA, BGRADB); the aux batch stride
serves the ReLU bitmask (RELU_AUX_BIAS writes it, DRELU_BGRAD reads it) and must be a multiple
of 128 bits; epilogues other than DEFAULT are refused only in the pointer-array and grouped
batch modes, not in the strided mode used here; every matrix must have the same batch count.
nvmath-python's matmul (``linalg/_internal/epilog_protocol.py``) batches every one of these
epilogues (the ReLU-aux ones from the cuBLASLt of CUDA 11.5, the gradients from CUDA 11.8).

Per-operand strides (the step's stacked C51 + CQL backward, SPEC 11): ``batch_stride`` may
instead map each operand the epilogue has (``"a"``, ``"b"``, ``"c"`` and, where the epilogue has
them, ``"bias"`` and ``"aux"``) to its own stride in bytes. An operand the plan only reads may
have stride 0 (every batch reads the same matrix: the step's shared weights and activations,
or a ReLU bitmask that DRELU_BGRAD reads); an operand it writes (C; the bias gradient of
DRELU_BGRAD, BGRADA and BGRADB; the bitmask RELU_AUX_BIAS writes) needs a stride of at least its
extent, so batches never write the same bytes. Every stride is a multiple of
``BATCH_STRIDE_ALIGN`` (``check_batch``).

Requires ``nvmath-python`` (``nvmath.bindings.cublasLt``), imported lazily and alone
(``import_without_package_init``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

PRECISIONS = ("f32", "bf16", "tf32")
#: Whether a plan's RELU_BIAS epilogue keeps a NaN pre-activation NaN in C (the reference's
#: ``add_bias_relu``, ``t <= 0 ? 0 : t``), per precision, as seen on an H200 with cuBLAS 13.0.
#: f32 and bf16: yes (``tests/test_fast_gpu.py::test_relu_bias_epilogue_keeps_nan``). tf32: not
#: in the step's shapes: with it the tf32 step's NaN injections into ``s`` and a parameter left
#: the reference's h1 / grad_buf sentinels clear (``foxhunt conformance --full``, session 26,
#: call C); with a plain GEMM and ``add_bias_relu`` they pass (call D). (What the TF32 epilogue
#: makes of a NaN is not characterised: in one 256x128x256 plan not every NaN became 0.) Where
#: it does not, the step runs the GEMM plain and ``add_bias_relu`` after it
#: (``StepProgram.linear``).
RELU_EPILOGUE_KEEPS_NAN = {"f32": True, "bf16": True, "tf32": False}
EPILOGUES = (None, "bias", "relu_bias", "relu_aux_bias", "drelu_bgrad", "bgrada", "bgradb")

# Epilogue name -> cuBLASLt epilogue name (the same name: see the docstring).
_CUBLAS_EPILOGUE = {ep: "DEFAULT" if ep is None else ep.upper() for ep in EPILOGUES}
_NEEDS_BIAS = frozenset({"bias", "relu_bias", "relu_aux_bias", "drelu_bgrad", "bgrada", "bgradb"})
_NEEDS_AUX = frozenset({"relu_aux_bias", "drelu_bgrad"})

# cudaDataType_t and cublasComputeType_t values (library/cuda headers; stable ABI).
CUDA_R_32F = 0
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_COMPUTE_32F_FAST_TF32 = 77

DEFAULT_WORKSPACE_LIMIT = 32 << 20  # bytes cuBLASLt may ask for; the plan allocates only what it uses
AUX_ROW_ALIGN_BYTES = 16  # cuBLASLt's ReLU bitmask rows are padded to 128 bits


class GemmPlanError(RuntimeError):
    """cuBLASLt offers no algorithm for this GEMM configuration."""


class CublasUnavailableError(RuntimeError):
    """nvmath-python (the cuBLASLt binding) is not installed or cuBLASLt cannot be loaded."""


def _round_up(value: int, base: int) -> int:
    return (value + base - 1) // base * base


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: {value!r} is not a positive int")
    return int(value)


@dataclass(frozen=True)
class GemmSpec:
    """A validated GEMM description (pure, no GPU). See the module docstring."""

    m: int
    n: int
    k: int
    trans_a: bool = False
    trans_b: bool = False
    precision: str = "f32"
    epilogue: str | None = None
    lda: int | None = None
    ldb: int | None = None
    ldc: int | None = None
    alpha: float = 1.0
    beta: float = 0.0

    def __post_init__(self):
        for name in ("m", "n", "k"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        for name in ("trans_a", "trans_b"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name}: {getattr(self, name)!r} is not a bool")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: {self.precision!r} is not allowed; expected one of {PRECISIONS}")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"epilogue: {self.epilogue!r} is not allowed; expected one of {EPILOGUES}")
        if self.epilogue == "drelu_bgrad" and self.k < 2:
            raise ValueError("k: 1 is not supported by cuBLASLt's DRELU_BGRAD epilogue; need k >= 2")
        # cuBLASLt only reduces an operand stored with k as its row index (observed: cuBLAS 13.0
        # on sm_90 answers CUBLAS_STATUS_NOT_SUPPORTED for the other layout, every precision).
        if self.epilogue == "bgrada" and self.trans_b:
            raise ValueError("trans_b: epilogue 'bgrada' needs B stored [k, n] (trans_b=False); "
                             "cuBLASLt does not reduce a transposed B")
        if self.epilogue == "bgradb" and not self.trans_a:
            raise ValueError("trans_a: epilogue 'bgradb' needs A stored [k, m] (trans_a=True); "
                             "cuBLASLt does not reduce an untransposed A")
        for name, rows_cols in (("lda", self.a_shape), ("ldb", self.b_shape), ("ldc", self.c_shape)):
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, rows_cols[1])
            elif _positive_int(name, value) < rows_cols[1]:
                raise ValueError(
                    f"{name}: {value} is smaller than the stored row length {rows_cols[1]}"
                )
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if not np.isfinite(np.float32(value)):
                raise ValueError(f"{name}: {value!r} is not a finite float32")

    @property
    def a_shape(self) -> tuple[int, int]:
        """Stored (row-major) shape of A."""
        return (self.k, self.m) if self.trans_a else (self.m, self.k)

    @property
    def b_shape(self) -> tuple[int, int]:
        return (self.n, self.k) if self.trans_b else (self.k, self.n)

    @property
    def c_shape(self) -> tuple[int, int]:
        return (self.m, self.n)

    @property
    def input_dtype(self) -> np.dtype:
        """Host dtype of A and B: uint16 BF16 bit patterns for "bf16", else float32."""
        return np.dtype(np.uint16 if self.precision == "bf16" else np.float32)

    @property
    def bias_len(self) -> int | None:
        """Length of the f32 bias (input) or bias-gradient (output) vector, if any."""
        if self.epilogue not in _NEEDS_BIAS:
            return None
        return self.m if self.epilogue == "bgradb" else self.n

    @property
    def aux_ld(self) -> int | None:
        """ReLU bitmask leading dimension in bits (a multiple of 128), if any."""
        if self.epilogue not in _NEEDS_AUX:
            return None
        return _round_up(-(-self.n // 8), AUX_ROW_ALIGN_BYTES) * 8

    @property
    def aux_nbytes(self) -> int | None:
        return None if self.aux_ld is None else self.aux_ld // 8 * self.m

    @property
    def operand_nbytes(self) -> dict[str, int]:
        """Bytes each operand spans from its pointer: ``((rows - 1) * ld + cols) * itemsize``
        for A, B and C, and the bias and aux vectors when the epilogue has them."""
        def stored(shape, ld, itemsize):
            return ((shape[0] - 1) * ld + shape[1]) * itemsize
        size = self.input_dtype.itemsize
        out = {"a": stored(self.a_shape, self.lda, size), "b": stored(self.b_shape, self.ldb, size),
               "c": stored(self.c_shape, self.ldc, 4)}
        if self.bias_len is not None:
            out["bias"] = self.bias_len * 4
        if self.aux_nbytes is not None:
            out["aux"] = self.aux_nbytes
        return out


@dataclass(frozen=True)
class ColMajorProblem:
    """The column-major cuBLAS problem equivalent to a row-major ``GemmSpec``.

    ``D (m x n, ld_d) = op_a(A_cm) @ op_b(B_cm)`` where ``A_cm`` is our B viewed column-major
    (``a_rows x a_cols``, ``ld_a``) and ``B_cm`` our A; ``D`` is our C.
    """

    m: int
    n: int
    k: int
    transa: bool
    transb: bool
    a_rows: int
    a_cols: int
    ld_a: int
    b_rows: int
    b_cols: int
    ld_b: int
    d_rows: int
    d_cols: int
    ld_d: int
    epilogue: str


def colmajor_problem(spec: GemmSpec) -> ColMajorProblem:
    """Map a row-major spec to cuBLAS's column-major problem (operands swapped)."""
    b_rows_stored, b_cols_stored = spec.b_shape
    a_rows_stored, a_cols_stored = spec.a_shape
    return ColMajorProblem(
        m=spec.n,
        n=spec.m,
        k=spec.k,
        # our B stored [k, n] is, column-major, [n, k] = op(B).T already; stored [n, k] needs T.
        transa=bool(spec.trans_b),
        transb=bool(spec.trans_a),
        a_rows=b_cols_stored,
        a_cols=b_rows_stored,
        ld_a=spec.ldb,
        b_rows=a_cols_stored,
        b_cols=a_rows_stored,
        ld_b=spec.lda,
        d_rows=spec.n,
        d_cols=spec.m,
        ld_d=spec.ldc,
        epilogue=_CUBLAS_EPILOGUE[spec.epilogue],
    )


# --------------------------------------------------------------------------------------------
# cuBLASLt
# --------------------------------------------------------------------------------------------


#: The one nvmath module the GEMMs use.
CUBLASLT_MODULE = "nvmath.bindings.cublasLt"


def import_without_package_init(name: str):
    """Import module ``name`` (``"a.b.c"``) without running the ``__init__`` of the packages
    above it that are not imported yet; an imported module is returned as it is.

    ``import nvmath.bindings.cublasLt`` runs ``nvmath/__init__.py``, which imports all of
    nvmath (fft, linalg, sparse, tensor) and every binding (cuFFT, cuSOLVER, cuSPARSE, ...):
    0.54 s of the fast trainer's start on the H200 (profile), for one binding. Here each
    missing parent is put in ``sys.modules`` as an empty package (its spec and ``__path__``,
    no code run) while ``name`` loads, and taken out again afterwards, so a later
    ``import nvmath`` runs the real ``__init__`` (which finds the loaded submodules in
    ``sys.modules``). The module's own imports load as usual."""
    import importlib
    import importlib.util
    import sys

    if name in sys.modules:
        return sys.modules[name]
    placeholders = []
    try:
        parts = name.split(".")
        path = None
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in sys.modules:
                path = getattr(sys.modules[parent], "__path__", None)
                continue
            spec = importlib.util.find_spec(parent) if path is None else \
                importlib.machinery.PathFinder.find_spec(parent, path)
            if spec is None or spec.submodule_search_locations is None:
                raise ModuleNotFoundError(f"No module named {parent!r}", name=parent)
            sys.modules[parent] = importlib.util.module_from_spec(spec)  # no exec_module
            placeholders.append(parent)
            path = spec.submodule_search_locations
        return importlib.import_module(name)
    finally:
        for parent in placeholders:
            sys.modules.pop(parent, None)


def _cublaslt():
    try:
        cublasLt = import_without_package_init(CUBLASLT_MODULE)
    except Exception as exc:
        raise CublasUnavailableError(
            "GEMMs need nvmath-python (nvmath.bindings.cublasLt) and cuBLAS: "
            f"pip install 'foxhunt[gpu]' ({type(exc).__name__}: {exc})"
        ) from exc
    return cublasLt


def cublaslt_version() -> int:
    """The loaded cuBLASLt's version (``cublasLtGetVersion``: part of ``gemm_algos``'
    fingerprint)."""
    return int(_cublaslt().get_version())


_HANDLES: dict[int, int] = {}  # device ordinal -> its cuBLASLt handle (one per process)
_HANDLES_LOCK = threading.Lock()


def cublaslt_handle(device) -> int:
    """The cuBLASLt handle of ``device``'s ordinal: created once per process (about 70 ms on
    the H200; ``device.prewarm`` may create it on another thread) and kept to the end."""
    with _HANDLES_LOCK:
        handle = _HANDLES.get(device.ordinal)
        if handle is None:
            lt = _cublaslt()
            device.make_current()
            handle = _HANDLES[device.ordinal] = lt.create()
    return handle


def check_sm_count_target(value) -> int:
    """``sm_count_target``: 0 (cuBLASLt plans for the whole device) or the number of SMs it
    should plan for (``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET``: a GEMM that runs beside other
    work, as the step's parallel branches do); a non-negative int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"sm_count_target: {value!r} is not allowed; expected an int >= 0 "
                         "(0: the whole device)")
    return int(value)


#: A batched plan's member stride is a multiple of this many bytes (the arena's alignment, so
#: every member's operands are as aligned as member 0's).
BATCH_STRIDE_ALIGN = 256
_MAX_BATCH = 2**31 - 1  # CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT is an int32


#: The operands a batched plan strides, in the order a per-operand stride is kept.
BATCH_OPERANDS = ("a", "b", "c", "bias", "aux")


def written_operands(spec: GemmSpec) -> frozenset[str]:
    """The operands a plan of ``spec`` writes: C, the bias vector of a bias-gradient epilogue and
    the ReLU bitmask of "relu_aux_bias"."""
    out = {"c"}
    if spec.epilogue in ("drelu_bgrad", "bgrada", "bgradb"):
        out.add("bias")
    if spec.epilogue == "relu_aux_bias":
        out.add("aux")
    return frozenset(out)


def _stride_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{what}: {value!r} is not allowed; expected an int (bytes)")
    return int(value)


def check_batch(batch, batch_stride, spec: GemmSpec | None = None):
    """Validated ``(batch, batch_stride)`` (module docstring, "Batched plans"): ``batch`` an int
    in [1, 2^31 - 1]; ``batch_stride`` in bytes, 0 when ``batch`` is 1, else a positive multiple
    of ``BATCH_STRIDE_ALIGN`` and, given ``spec``, at least its largest operand extent. Or, with
    ``batch`` > 1 and ``spec`` given, a mapping of per-operand strides ("Per-operand strides"),
    returned as a tuple of ``(operand, bytes)`` pairs in ``BATCH_OPERANDS`` order."""
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) \
            or not 1 <= batch <= _MAX_BATCH:
        raise ValueError(f"batch: {batch!r} is not allowed; expected an int in [1, {_MAX_BATCH}]")
    batch = int(batch)
    if isinstance(batch_stride, (Mapping, tuple)):
        return batch, _check_operand_strides(batch, dict(batch_stride), spec)
    batch_stride = _stride_int(batch_stride, "batch_stride")
    if batch == 1:
        if batch_stride != 0:
            raise ValueError(f"batch_stride: {batch_stride} is not allowed with batch=1; expected 0")
        return batch, batch_stride
    if batch_stride <= 0 or batch_stride % BATCH_STRIDE_ALIGN:
        raise ValueError(f"batch_stride: {batch_stride} is not allowed with batch={batch}; expected "
                         f"a positive multiple of {BATCH_STRIDE_ALIGN} (bytes)")
    if spec is not None:
        name, extent = max(spec.operand_nbytes.items(), key=lambda item: item[1])
        if batch_stride < extent:
            raise ValueError(f"batch_stride: {batch_stride} is not allowed; operand {name} spans "
                             f"{extent} bytes, so members would overlap (expected >= {extent})")
    return batch, batch_stride


def _check_operand_strides(batch: int, strides: dict, spec: GemmSpec | None) -> tuple:
    if batch == 1:
        raise ValueError("batch_stride: per-operand strides are not allowed with batch=1; expected 0")
    if spec is None:
        raise ValueError("batch_stride: per-operand strides need the GEMM's spec to be checked")
    extents = spec.operand_nbytes
    missing, extra = sorted(set(extents) - set(strides)), sorted(set(strides) - set(extents))
    if missing or extra:
        raise ValueError(f"batch_stride: operands {sorted(strides)} are not allowed for epilogue "
                         f"{spec.epilogue!r}; expected a stride for each of {sorted(extents)}")
    written = written_operands(spec)
    out = []
    for name in BATCH_OPERANDS:
        if name not in extents:
            continue
        value = _stride_int(strides[name], f"batch_stride[{name!r}]")
        low = extents[name] if name in written else 0
        if value < 0 or value % BATCH_STRIDE_ALIGN or (name in written and value == 0):
            raise ValueError(f"batch_stride[{name!r}]: {value} is not allowed; expected a "
                             f"{'positive' if name in written else 'non-negative'} multiple of "
                             f"{BATCH_STRIDE_ALIGN} (bytes)")
        if value < low:
            raise ValueError(f"batch_stride[{name!r}]: {value} is not allowed; the plan writes "
                             f"operand {name}, which spans {low} bytes, so batches would overlap "
                             f"(expected >= {low})")
        out.append((name, value))
    return tuple(out)


def operand_offsets(batch_stride, index: int) -> dict[str, int]:
    """Bytes past member 0's pointer of each operand of batch member ``index`` (a checked
    ``batch_stride``: one int for every operand, or the per-operand pairs)."""
    if isinstance(batch_stride, tuple):
        return {name: index * value for name, value in batch_stride}
    return {name: index * batch_stride for name in BATCH_OPERANDS}


def batch_strides(spec: GemmSpec, batch_stride) -> dict[str, int]:
    """The member stride ``batch_stride`` (bytes; one for every operand or a checked per-operand
    tuple) in elements of each operand, as cuBLASLt takes it: A and B in input elements, C (and
    D) and the bias vector in f32 elements, the ReLU bitmask in bits
    (``EPILOGUE_AUX_BATCH_STRIDE``)."""
    size = spec.input_dtype.itemsize
    per = {"a": size, "b": size, "c": 4, "bias": 4}
    present = ["a", "b", "c"] + (["bias"] if spec.bias_len is not None else []) \
        + (["aux"] if spec.aux_ld is not None else [])
    byte = operand_offsets(batch_stride, 1)
    return {name: (byte[name] * 8 if name == "aux" else byte[name] // per[name])
            for name in present}


def _set_attr(setter, dtype_of, obj, attr, value) -> None:
    buf = np.array([value], dtype=dtype_of(attr))
    setter(obj, attr, buf.ctypes.data, buf.itemsize)


class GemmPlan:
    """A planned cuBLASLt GEMM (see the module docstring for the convention and epilogues).

    ``GemmPlan(device, m, n, k, trans_a=, trans_b=, precision=, epilogue=, lda=, ldb=, ldc=,
    alpha=, beta=, min_alignment=256, workspace_limit=32 MiB, sm_count_target=0, batch=1,
    batch_stride=0)``; then ``plan.run(a_ptr, b_ptr, c_ptr, bias_ptr=, aux_ptr=, stream=)`` any
    number of times (with ``batch`` > 1: member 0's pointers; module docstring, "Batched plans").
    Raises ``GemmPlanError`` when cuBLASLt has no algorithm for the configuration.
    """

    def __init__(self, device, m, n, k, *, trans_a=False, trans_b=False, precision="f32",
                 epilogue=None, lda=None, ldb=None, ldc=None, alpha=1.0, beta=0.0,
                 min_alignment: int = 256, workspace_limit: int = DEFAULT_WORKSPACE_LIMIT,
                 heuristic: np.ndarray | bytes | None = None, verify: bool = False,
                 sm_count_target: int = 0, batch: int = 1, batch_stride: int | Mapping = 0):
        self._objects: list[tuple] = []  # (destroy function, handle) for close()
        self._workspace = None
        self.spec = GemmSpec(m, n, k, trans_a, trans_b, precision, epilogue, lda, ldb, ldc,
                             alpha, beta)
        if min_alignment not in (4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"min_alignment: {min_alignment!r} is not a power of two in [4, 256]")
        self.min_alignment = min_alignment
        self.sm_count_target = check_sm_count_target(sm_count_target)
        self.batch, self.batch_stride = check_batch(batch, batch_stride, self.spec)
        self.device = device
        self.problem = colmajor_problem(self.spec)
        lt = _cublaslt()
        self._lt = lt
        self._handle = cublaslt_handle(device)
        try:
            self._plan(lt, workspace_limit, heuristic, verify)
        except BaseException:
            self.close()
            raise

    def _plan(self, lt, workspace_limit: int, heuristic, verify: bool) -> None:
        spec, prob = self.spec, self.problem
        compute = CUBLAS_COMPUTE_32F_FAST_TF32 if spec.precision == "tf32" else CUBLAS_COMPUTE_32F
        in_type = CUDA_R_16BF if spec.precision == "bf16" else CUDA_R_32F
        desc_attr = lt.MatmulDescAttribute

        def set_desc(attr, value):
            _set_attr(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype,
                      self._desc, attr, value)

        self._desc = lt.matmul_desc_create(compute, CUDA_R_32F)
        self._objects.append((lt.matmul_desc_destroy, self._desc))
        set_desc(desc_attr.TRANSA, 1 if prob.transa else 0)  # CUBLAS_OP_T = 1, CUBLAS_OP_N = 0
        set_desc(desc_attr.TRANSB, 1 if prob.transb else 0)
        set_desc(desc_attr.EPILOGUE, int(lt.Epilogue[prob.epilogue]))
        if self.sm_count_target:
            set_desc(desc_attr.SM_COUNT_TARGET, self.sm_count_target)
        # Placeholder (aligned, never dereferenced) pointers so the heuristic sees a complete
        # epilogue; run() sets the real ones.
        self._bias_ptr = self._aux_ptr = None
        if spec.bias_len is not None:
            set_desc(desc_attr.BIAS_POINTER, 256)
        if spec.aux_ld is not None:
            set_desc(desc_attr.EPILOGUE_AUX_LD, spec.aux_ld)
            set_desc(desc_attr.EPILOGUE_AUX_POINTER, 256)
        strides = batch_strides(spec, self.batch_stride) if self.batch > 1 else {}
        if "bias" in strides:  # per member: the bias input or the bias-gradient output
            set_desc(desc_attr.BIAS_BATCH_STRIDE, strides["bias"])
        if "aux" in strides:
            set_desc(desc_attr.EPILOGUE_AUX_BATCH_STRIDE, strides["aux"])

        def layout(dtype, rows, cols, ld):
            handle = lt.matrix_layout_create(dtype, rows, cols, ld)
            self._objects.append((lt.matrix_layout_destroy, handle))
            return handle

        self._layout_a = layout(in_type, prob.a_rows, prob.a_cols, prob.ld_a)
        self._layout_b = layout(in_type, prob.b_rows, prob.b_cols, prob.ld_b)
        self._layout_c = layout(CUDA_R_32F, prob.d_rows, prob.d_cols, prob.ld_d)
        if strides:  # cuBLAS's A is our B and its B our A (same element size); C is also D
            layout_attr = lt.MatrixLayoutAttribute
            for handle, stride in ((self._layout_a, strides["b"]), (self._layout_b, strides["a"]),
                                   (self._layout_c, strides["c"])):
                for attr, value in ((layout_attr.BATCH_COUNT, self.batch),
                                    (layout_attr.STRIDED_BATCH_OFFSET, stride)):
                    _set_attr(lt.matrix_layout_set_attribute,
                              lt.get_matrix_layout_attribute_dtype, handle, attr, value)

        pref = lt.matmul_preference_create()
        self._objects.append((lt.matmul_preference_destroy, pref))
        pref_attr = lt.MatmulPreferenceAttribute

        def set_pref(attr, value):
            _set_attr(lt.matmul_preference_set_attribute,
                      lt.get_matmul_preference_attribute_dtype, pref, attr, value)
        set_pref(pref_attr.MAX_WORKSPACE_BYTES, int(workspace_limit))
        for attr in (pref_attr.MIN_ALIGNMENT_A_BYTES, pref_attr.MIN_ALIGNMENT_B_BYTES,
                     pref_attr.MIN_ALIGNMENT_C_BYTES, pref_attr.MIN_ALIGNMENT_D_BYTES):
            set_pref(attr, self.min_alignment)

        result_dtype = lt.matmul_heuristic_result_dtype
        if isinstance(heuristic, (bytes, bytearray)):  # gemm_algos.AlgoStore: a stored answer
            if len(heuristic) != result_dtype.itemsize:
                raise GemmPlanError(f"a stored cuBLASLt answer of {len(heuristic)} bytes is not "
                                    f"a heuristic result ({result_dtype.itemsize} bytes)")
            heuristic = np.frombuffer(heuristic, dtype=result_dtype)
        given = heuristic is not None
        if given:  # PlanCache: the algorithm cuBLASLt chose for an equal plan
            self._heuristic = np.array(heuristic, dtype=result_dtype, copy=True)
        else:
            self._heuristic = np.zeros(1, dtype=result_dtype)
            found = np.zeros(1, dtype=np.int32)
            self.device.make_current()
            try:
                lt.matmul_algo_get_heuristic(
                    self._handle, self._desc, self._layout_a, self._layout_b, self._layout_c,
                    self._layout_c, pref, 1, self._heuristic.ctypes.data, found.ctypes.data)
            except Exception as exc:
                raise GemmPlanError(f"cuBLASLt has no algorithm for {self.describe()}: {exc}") \
                    from exc
            if found[0] < 1 or int(self._heuristic["state"][0]) != 0:
                raise GemmPlanError(f"cuBLASLt has no algorithm for {self.describe()}")
        self._algo_ptr = self._heuristic.ctypes.data + self._heuristic.dtype.fields["algo"][1]
        if given and verify:
            self._verify(lt, workspace_limit)
        self.workspace_nbytes = int(self._heuristic["workspace_size"][0])
        if self.workspace_nbytes:
            self._workspace = self.device.alloc(_round_up(self.workspace_nbytes, 256))
        self._workspace_ptr = self._workspace.ptr if self._workspace is not None else 0
        self._alpha = np.array([self.spec.alpha], dtype=np.float32)
        self._beta = np.array([self.spec.beta], dtype=np.float32)

    def _verify(self, lt, workspace_limit: int) -> None:
        """``cublasLtMatmulAlgoCheck`` of the given algorithm on this plan's descriptors; its
        workspace size replaces the stored one. GemmPlanError when cuBLASLt rejects it or it
        needs more workspace than ``workspace_limit``."""
        checked = np.zeros(1, dtype=lt.matmul_heuristic_result_dtype)
        self.device.make_current()
        try:
            lt.matmul_algo_check(self._handle, self._desc, self._layout_a, self._layout_b,
                                 self._layout_c, self._layout_c, self._algo_ptr,
                                 checked.ctypes.data)
        except Exception as exc:
            raise GemmPlanError(f"cuBLASLt rejects the stored algorithm for {self.describe()}: "
                                f"{exc}") from exc
        workspace = int(checked["workspace_size"][0])
        if workspace > workspace_limit:
            raise GemmPlanError(f"the stored algorithm for {self.describe()} needs {workspace} "
                                f"bytes of workspace; the limit is {workspace_limit}")
        self._heuristic["workspace_size"][0] = workspace

    def describe(self) -> str:
        s = self.spec
        return (f"GEMM m={s.m} n={s.n} k={s.k} trans_a={s.trans_a} trans_b={s.trans_b} "
                f"precision={s.precision} epilogue={s.epilogue} lda={s.lda} ldb={s.ldb} "
                f"ldc={s.ldc} alignment={self.min_alignment}"
                + (f" batch={self.batch} batch_stride={self.batch_stride}" if self.batch > 1 else ""))

    @property
    def heuristic(self) -> np.ndarray:
        """cuBLASLt's chosen algorithm (a copy), to plan an equal GEMM without asking again."""
        return self._heuristic.copy()

    def _check_ptr(self, name: str, ptr, alignment: int) -> int:
        if isinstance(ptr, bool) or not isinstance(ptr, (int, np.integer)) or ptr <= 0:
            raise ValueError(f"{name}: {ptr!r} is not a device pointer (a positive int)")
        if ptr % alignment:
            raise ValueError(f"{name}: {ptr:#x} is not {alignment}-byte aligned as this plan requires")
        return int(ptr)

    def run(self, a_ptr: int, b_ptr: int, c_ptr: int, *, bias_ptr: int | None = None,
            aux_ptr: int | None = None, stream=None) -> None:
        """Enqueue the GEMM on ``stream`` (required): C (``c_ptr``, in place when beta != 0)
        from A and B; ``bias_ptr`` / ``aux_ptr`` as the epilogue needs (module docstring)."""
        lt, spec = self._lt, self.spec
        a_ptr = self._check_ptr("a_ptr", a_ptr, self.min_alignment)
        b_ptr = self._check_ptr("b_ptr", b_ptr, self.min_alignment)
        c_ptr = self._check_ptr("c_ptr", c_ptr, self.min_alignment)
        if stream is None:
            raise ValueError("stream: a GEMM needs an explicit stream (device.stream)")
        attr = lt.MatmulDescAttribute
        if spec.bias_len is not None:
            bias_ptr = self._check_ptr("bias_ptr", bias_ptr, 16)
            if bias_ptr != self._bias_ptr:
                _set_attr(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype,
                          self._desc, attr.BIAS_POINTER, bias_ptr)
                self._bias_ptr = bias_ptr
        elif bias_ptr is not None:
            raise ValueError(f"bias_ptr: epilogue {spec.epilogue!r} takes no bias")
        if spec.aux_ld is not None:
            aux_ptr = self._check_ptr("aux_ptr", aux_ptr, 16)
            if aux_ptr != self._aux_ptr:
                _set_attr(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype,
                          self._desc, attr.EPILOGUE_AUX_POINTER, aux_ptr)
                self._aux_ptr = aux_ptr
        elif aux_ptr is not None:
            raise ValueError(f"aux_ptr: epilogue {spec.epilogue!r} takes no aux bitmask")
        stream_ptr = stream.ptr if hasattr(stream, "ptr") else int(stream)
        # Operands swapped: cuBLAS "A" is our B, cuBLAS "B" is our A (module docstring).
        lt.matmul(self._handle, self._desc, self._alpha.ctypes.data,
                  b_ptr, self._layout_a, a_ptr, self._layout_b,
                  self._beta.ctypes.data, c_ptr, self._layout_c, c_ptr, self._layout_c,
                  self._algo_ptr, self._workspace_ptr, self.workspace_nbytes, stream_ptr)

    def close(self) -> None:
        """Destroy the descriptors and free the workspace (the plan is unusable after)."""
        while self._objects:
            destroy, handle = self._objects.pop()
            try:
                destroy(handle)
            except Exception:  # noqa: BLE001
                pass
        workspace = getattr(self, "_workspace", None)
        if workspace is not None:
            workspace.free()
            self._workspace = None

    def __del__(self):
        try:
            from foxhunt.fast.device import release

            release(self.close)  # a capture in progress: closed when the last capture ends
        except Exception:  # noqa: BLE001
            pass


class PlanCache:
    """A planner (``StepProgram``'s ``planner``) that asks cuBLASLt's heuristic once per
    distinct GEMM.

    ``PlanCache(make)`` with ``make(m, n, k, heuristic=None, **kw)`` a planner
    (``functools.partial(GemmPlan, device)``). Every call returns a NEW plan (its own
    descriptors and workspace: two records of one shape may run at once on parallel graph
    branches, and a shared workspace or descriptor would be a race); a call with the same
    ``GemmSpec`` (shape, transposes, precision, epilogue, strides, alpha, beta),
    ``min_alignment`` and ``workspace_limit`` as an earlier one passes the algorithm chosen
    then (``plan.heuristic``) instead of asking again, and a configuration ``make`` refused
    (``GemmPlanError``) is refused again without asking. The seed step asks for 141 plans of
    far fewer distinct GEMMs (the same layer shapes in the online, target and evaluation
    passes).

    ``store`` (a ``gemm_algos.AlgoStore``, optional) keeps the answers between processes: a
    GEMM new to this cache takes the stored algorithm when cuBLASLt's check accepts it
    (``verify=True``; ``loaded`` counts them), else asks the heuristic and stores the answer."""

    def __init__(self, make, store=None):
        self._make = make
        self.store = store
        self._algos: dict = {}  # key -> heuristic result, or the GemmPlanError
        self.plans: list = []  # every plan made, for close()
        self.requests = 0  # planner calls, for the tests and the profile
        self.queries = 0  # of which asked the heuristic
        self.loaded = 0  # of which took a stored algorithm (checked)

    @staticmethod
    def key(m, n, k, *, trans_a=False, trans_b=False, precision="f32", epilogue=None, lda=None,
            ldb=None, ldc=None, alpha=1.0, beta=0.0, min_alignment: int = 256,
            workspace_limit: int = DEFAULT_WORKSPACE_LIMIT, sm_count_target: int = 0,
            batch: int = 1, batch_stride: int | Mapping = 0) -> tuple:
        """What decides a plan: the validated spec (defaults filled in), alignment, workspace,
        SM count target, and for a batched plan (``batch`` > 1) the batch and member stride at
        the end (an unbatched plan's key is as it was before batching existed, so the answers
        ``gemm_algos`` stored for it stay valid)."""
        spec = GemmSpec(m, n, k, trans_a, trans_b, precision, epilogue, lda, ldb, ldc, alpha, beta)
        batch, batch_stride = check_batch(batch, batch_stride, spec)
        key = spec, int(min_alignment), int(workspace_limit), int(sm_count_target)
        return key + (batch, batch_stride) if batch > 1 else key

    def __call__(self, m, n, k, **kw):
        self.requests += 1
        key = self.key(m, n, k, **kw)
        if key not in self._algos:
            plan = self._from_store(key, m, n, k, **kw)
            if plan is None:
                self.queries += 1
                try:
                    plan = self._make(m, n, k, **kw)
                except GemmPlanError as exc:
                    self._algos[key] = exc
                    raise
                if self.store is not None:
                    self.store.put(key, plan.heuristic.tobytes())
            self._algos[key] = plan.heuristic
        else:
            known = self._algos[key]
            if isinstance(known, GemmPlanError):
                raise GemmPlanError(str(known))  # a new one: re-raising one grows its traceback
            plan = self._make(m, n, k, heuristic=known, **kw)
        self.plans.append(plan)
        return plan

    def _from_store(self, key, m, n, k, **kw):
        """A plan with the stored algorithm of ``key`` if the store has one cuBLASLt accepts
        (a rejected one is forgotten), else None."""
        stored = None if self.store is None else self.store.get(key)
        if stored is None:
            return None
        try:
            plan = self._make(m, n, k, heuristic=stored, verify=True, **kw)
        except GemmPlanError:
            self.store.forget(key)
            return None
        self.loaded += 1
        return plan

    def close(self) -> None:
        """Close every plan made (they are unusable after)."""
        for plan in self.plans:
            plan.close()
        self.plans.clear()


def gemm(a: np.ndarray, b: np.ndarray, *, trans_a: bool = False, trans_b: bool = False,
         mode: str = "f32", rounded: bool = False) -> np.ndarray:
    """Numpy-in/numpy-out test entry of the cuBLASLt GEMM, with the signature of the reference
    ``foxhunt.reference.kernels.dense.gemm`` (``op(a) @ op(b)``, f32 result).

    ``mode="bf16"`` rounds ``a`` and ``b`` to BF16 on the host (the reference's bit-exact
    ``f32_to_bf16``, as the trainer's mirrors are) and runs the BF16 tensor-core GEMM; ``"tf32"``
    and ``"f32"`` pass f32 operands. For conformance and debugging only (plans and buffers are
    made per call; the trainer plans once). ``rounded`` is accepted for signature parity and
    changes nothing (rounding is idempotent; cuBLAS rounds on the tensor cores anyway).
    """
    from foxhunt.fast.kernels._runtime import runtime
    from foxhunt.reference.kernels import dense as ref_dense

    ref_dense.gemm(np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32), mode=mode)  # validates mode
    a = np.ascontiguousarray(a, np.float32)
    b = np.ascontiguousarray(b, np.float32)
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    k2, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if k != k2:
        raise ValueError(f"gemm: inner dimensions differ: op(a) is {m}x{k}, op(b) is {k2}x{n}")
    if mode == "bf16":
        a, b = ref_dense.f32_to_bf16(a), ref_dense.f32_to_bf16(b)
    rt = runtime()
    dev = rt.device
    plan = GemmPlan(dev, m, n, k, trans_a=trans_a, trans_b=trans_b, precision=mode)
    bufs = [dev.alloc(max(x.nbytes, 256)) for x in (a, b)]
    c = np.empty((m, n), np.float32)
    c_buf = dev.alloc(max(c.nbytes, 256))
    try:
        for buf, host in zip(bufs, (a, b)):
            dev.copy_to_device(buf.ptr, host, wait=False)
        plan.run(bufs[0].ptr, bufs[1].ptr, c_buf.ptr, stream=rt.stream)
        return dev.copy_to_host(c, c_buf.ptr)
    finally:
        for buf in (*bufs, c_buf):
            buf.free()


__all__ = [
    "EPILOGUES",
    "PRECISIONS",
    "ColMajorProblem",
    "CublasUnavailableError",
    "GemmPlan",
    "GemmPlanError",
    "GemmSpec",
    "PlanCache",
    "BATCH_OPERANDS",
    "batch_strides",
    "check_batch",
    "operand_offsets",
    "written_operands",
    "colmajor_problem",
    "cublaslt_handle",
    "cublaslt_version",
    "gemm",
    "import_without_package_init",
]
