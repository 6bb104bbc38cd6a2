"""Checks a launch record against its kernel and the step layout when the record is made.

``Binder(regions, constants=, host_nbytes=)`` makes the records of ``foxhunt.fast.records``
(``Ops`` calls it): a kernel launch fails with ``PlanError`` naming the kernel and the parameter
for a missing, extra or misspelt argument; a buffer bound to a scalar parameter or a scalar to a
pointer; an int parameter given a float (or a float64); a buffer whose dtype is not the
parameter's element type; a written (non-``const``) parameter bound to a read-only buffer (the
batch, the constants); a region shorter than the extent the kernel's twin declares for that
parameter (``foxhunt.fast.cpu_kernels``); a null pointer where the twin does not allow one. A
GEMM's operands are checked against its ``GemmSpec`` (dtypes, stored extents, epilogue
vectors), a copy's ends against their sizes. Each record carries the regions it reads and
writes (``Access``) for ``dataflow.check_dataflow``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import numpy as np

from foxhunt.fast.gemm import written_operands
from foxhunt.fast.records import (
    F32,
    I32,
    I64,
    U8,
    U16,
    U64,
    Access,
    Buf,
    Copy,
    Gemm,
    Host,
    Launch,
    LaunchShape,
    Param,
    PlanError,
    Region,
    as_buf,
    kernel_params,
)
from foxhunt.fast.step_layout import elements

#: Element type of a pointer parameter -> the buffer dtype it must point into (a descriptor
#: struct is read as bytes: its twin declares its extent in bytes).
ELEMENT_DTYPES = {"float": F32, "int": I32, "long long": I64, "unsigned short": U16,
                  "unsigned long long": U64, "unsigned char": U8, "SpectralMatrix": U8}
#: Scalar parameter types -> (kind, low, high): the values a by-value argument may take.
SCALAR_TYPES = {"int": ("int", -(1 << 31), 1 << 31), "long long": ("int", -(1 << 63), 1 << 63),
                "unsigned": ("int", 0, 1 << 32), "unsigned int": ("int", 0, 1 << 32),
                "float": ("float", None, None), "double": ("double", None, None)}
#: Buffer roles: what a written parameter may not be bound to.
READ_ONLY_ROLES = frozenset({"batch", "constant"})
#: ``Copy`` kinds (the driver call each becomes on the GPU).
COPY_KINDS = ("htod", "dtod", "dtoh")


class Binder:
    """Checks records as they are made (module docstring).

    ``regions(buf) -> Region`` resolves a buffer name (raises ``KeyError`` for an unknown one);
    ``host_nbytes``: the host buffers' sizes; ``constants``: host values of the constant
    buffers (what an extent that depends on a table, e.g. ``n_actions``, reads);
    ``alignment(buf)``: the byte alignment of a region's first element (for GEMM plans).
    """

    def __init__(self, regions: Callable[[Buf], Region], *, constants: Mapping[str, np.ndarray],
                 host_nbytes: Mapping[str, int] = MappingProxyType({})):
        self.regions = regions
        self.constants = constants
        self.host_nbytes = dict(host_nbytes)

    # -- helpers
    def region(self, buf: Buf, what: str) -> Region:
        try:
            region = self.regions(buf)
        except KeyError as exc:
            raise PlanError(f"{what}: {exc.args[0] if exc.args else buf}") from None
        if region.available < 0:
            raise PlanError(f"{what}: {buf} starts past the end of buffer {buf.name!r}")
        return region

    def table(self, buf: Buf, count: int, dtype: np.dtype, what: str) -> np.ndarray:
        """``count`` values of a constant buffer at ``buf`` (for extents that read a table)."""
        region = self.region(buf, what)
        if region.role != "constant" or region.buffer not in self.constants:
            raise PlanError(f"{what}: its extent reads {buf}, which is not a constant buffer")
        flat = np.ascontiguousarray(self.constants[region.buffer]).reshape(-1).view(np.uint8)
        start = region.byte_start
        values = flat[start:start + count * dtype.itemsize].view(dtype)
        if values.size != count:
            raise PlanError(f"{what}: its extent reads {count} {dtype} values of {buf}, which holds "
                            f"{values.size}")
        return values

    # -- kernel launches
    def launch(self, kernel: str, plan, args: Mapping[str, object]) -> Launch:
        from foxhunt.fast.cpu_kernels import TWINS, Args, shape_of

        params = kernel_params().get(kernel)
        if params is None:
            raise PlanError(f"kernel {kernel}: no such kernel in cuda_src")
        twin = TWINS.get(kernel)
        if twin is None:
            raise PlanError(f"kernel {kernel}: no CPU twin in foxhunt.fast.cpu_kernels.TWINS")
        names = [p.name for p in params]
        missing = [n for n in names if n not in args]
        extra = [n for n in args if n not in names]
        if extra:
            raise PlanError(f"kernel {kernel}: no parameter {extra[0]!r} (parameters: {', '.join(names)})")
        if missing:
            raise PlanError(f"kernel {kernel}: parameter {missing[0]!r} is not bound")
        shape = LaunchShape.of(plan, kernel)
        bound: dict[str, object] = {}
        regions: dict[str, Region] = {}
        scalars: dict[str, object] = {}
        for p in params:
            value = as_buf(args[p.name])
            where = f"kernel {kernel}: parameter {p.name!r} ({p.ctype})"
            if p.pointer:
                if value is None:
                    if p.name not in twin.nullable:
                        raise PlanError(f"{where}: a null pointer is not allowed here")
                elif not isinstance(value, Buf):
                    raise PlanError(f"{where}: expected a buffer, got {value!r}")
                else:
                    region = self.region(value, where)
                    want = ELEMENT_DTYPES.get(p.element)
                    if want is None:
                        raise PlanError(f"{where}: element type {p.element!r} has no buffer dtype")
                    if region.dtype != want:
                        raise PlanError(f"{where}: bound to {value} of dtype {region.dtype}; "
                                        f"expected {want}")
                    if not p.const and region.role in READ_ONLY_ROLES:
                        raise PlanError(f"{where}: writes, but {value} is a read-only "
                                        f"{region.role} buffer")
                    regions[p.name] = region
            else:
                scalars[p.name] = value = _check_scalar(where, p, value)
            bound[p.name] = value
        # Extents: every bound region holds at least what the twin declares for its parameter.
        ns = Args(scalars, shape, table=lambda name, count, dtype: self.table(
            bound[name], count, dtype, f"kernel {kernel}: parameter {name!r}"))
        accesses = []
        for p in params:
            if p.name not in regions:
                continue
            region = regions[p.name]
            count = elements(shape_of(twin.extents[p.name], ns))
            if count > region.available:
                raise PlanError(f"kernel {kernel}: parameter {p.name!r} needs {count} elements; "
                                f"{bound[p.name]} holds {region.available}")
            accesses.append(Access(region.buffer, region.byte_start, count * region.dtype.itemsize,
                                   not p.const, f"kernel {kernel} parameter {p.name!r}"))
        return Launch(kernel, shape, MappingProxyType(bound), tuple(accesses))

    # -- GEMMs
    def gemm(self, plan, *, a, b, c, bias=None, aux=None, second=None) -> Gemm:
        """A GEMM record. ``second``: with a plan of two batches and per-operand strides
        (``gemm`` module docstring), batch 1's buffer of every operand whose stride is not 0; each
        must lie in the same buffer as batch 0's, exactly that stride past it."""
        a, b, c, bias, aux = (as_buf(x) for x in (a, b, c, bias, aux))
        spec = plan.spec
        in_dtype = spec.input_dtype
        accesses = []
        first = {"a": a, "b": b, "c": c, "bias": bias, "aux": aux}
        second = self._second(plan, first, second)

        def operand(name, buf, dtype, count, write):
            for member, buf in enumerate((buf,) + ((second[name],) if name in second else ())):
                one(name + (" (batch 1)" if member else ""), buf, dtype, count, write)

        def one(name, buf, dtype, count, write):
            where = f"GEMM {spec.m}x{spec.n}x{spec.k} ({spec.epilogue}) operand {name}"
            if not isinstance(buf, Buf):
                raise PlanError(f"{where}: expected a buffer, got {buf!r}")
            region = self.region(buf, where)
            if region.dtype != dtype:
                raise PlanError(f"{where}: bound to {buf} of dtype {region.dtype}; expected {dtype}")
            if write and region.role in READ_ONLY_ROLES:
                raise PlanError(f"{where}: writes, but {buf} is a read-only {region.role} buffer")
            if count > region.available:
                raise PlanError(f"{where}: needs {count} elements; {buf} holds {region.available}")
            accesses.append(Access(region.buffer, region.byte_start, count * dtype.itemsize, write, where))

        def stored(shape, ld):
            return (shape[0] - 1) * ld + shape[1]

        operand("a", a, in_dtype, stored(spec.a_shape, spec.lda), False)
        operand("b", b, in_dtype, stored(spec.b_shape, spec.ldb), False)
        if spec.beta != 0.0:
            operand("c", c, F32, stored(spec.c_shape, spec.ldc), False)
        operand("c", c, F32, stored(spec.c_shape, spec.ldc), True)
        written = written_operands(spec)
        if spec.bias_len is not None:
            operand("bias", bias, F32, spec.bias_len, "bias" in written)
        elif bias is not None:
            raise PlanError(f"GEMM epilogue {spec.epilogue!r}: takes no bias, got {bias}")
        if spec.aux_ld is not None:
            operand("aux", aux, U8, spec.aux_nbytes, "aux" in written)
        elif aux is not None:
            raise PlanError(f"GEMM epilogue {spec.epilogue!r}: takes no aux bitmask, got {aux}")
        return Gemm(plan, a, b, c, bias, aux, tuple(second.items()), tuple(accesses))

    def _second(self, plan, first: Mapping[str, Buf | None], second) -> dict[str, Buf]:
        strides = getattr(plan, "batch_stride", 0)
        spec = plan.spec
        where = f"GEMM {spec.m}x{spec.n}x{spec.k} ({spec.epilogue})"
        if not isinstance(strides, tuple):
            if second:
                raise PlanError(f"{where}: batch 1's operands given, but the plan has no "
                                "per-operand strides")
            return {}
        if plan.batch != 2:
            raise PlanError(f"{where}: a plan with per-operand strides binds 2 batches; it has "
                            f"{plan.batch}")
        moving = {name: stride for name, stride in strides if stride}
        second = {name: as_buf(buf) for name, buf in dict(second or {}).items()}
        if set(second) != set(moving):
            raise PlanError(f"{where}: batch 1's operands {sorted(second)} given; the plan "
                            f"strides {sorted(moving)}")
        for name, stride in moving.items():
            r0 = self.region(first[name], f"{where} operand {name}")
            r1 = self.region(second[name], f"{where} operand {name} (batch 1)")
            if r1.buffer != r0.buffer or r1.byte_start - r0.byte_start != stride:
                raise PlanError(f"{where} operand {name}: batch 1's {second[name]} is not "
                                f"{stride} bytes past {first[name]} in one buffer")
        return second

    # -- copies
    def copy(self, dst, src, nbytes: int, kind: str) -> Copy:
        if kind not in COPY_KINDS:
            raise PlanError(f"copy kind {kind!r}: expected one of {', '.join(COPY_KINDS)}")
        dst, src = as_buf(dst), as_buf(src)
        sides = {"htod": (Buf, Host), "dtod": (Buf, Buf), "dtoh": (Host, Buf)}[kind]
        accesses = []
        for what, end, want, write in (("dst", dst, sides[0], True), ("src", src, sides[1], False)):
            where = f"copy {kind} {what}"
            if not isinstance(end, want):
                raise PlanError(f"{where}: expected a {want.__name__}, got {end!r}")
            if isinstance(end, Host):
                size = self.host_nbytes.get(end.name)
                if size is None:
                    raise PlanError(f"{where}: no host buffer {end.name!r}")
            else:
                region = self.region(end, where)
                if write and region.role == "constant":
                    raise PlanError(f"{where}: writes the constant buffer {end}")
                size = region.available * region.dtype.itemsize
                accesses.append(Access(region.buffer, region.byte_start, int(nbytes), write, where))
            if nbytes > size:
                raise PlanError(f"{where}: {nbytes} bytes do not fit {end} ({size} bytes)")
        return Copy(dst, src, int(nbytes), kind, tuple(accesses))


def _check_scalar(where: str, p: Param, value):
    kind = SCALAR_TYPES.get(p.element)
    if kind is None:
        raise PlanError(f"{where}: scalar type {p.element!r} is not supported")
    if isinstance(value, (Buf, Host)) or value is None:
        raise PlanError(f"{where}: a scalar parameter, got {value if value is not None else 'None'}")
    if isinstance(value, (bool, np.bool_)):
        raise PlanError(f"{where}: got the bool {value!r}; pass an int or a float")
    if kind[0] == "int":
        if not isinstance(value, (int, np.integer)):
            raise PlanError(f"{where}: expected an int, got {value!r}")
        if not kind[1] <= int(value) < kind[2]:
            raise PlanError(f"{where}: {value} does not fit")
        return int(value)
    if kind[0] == "double":  # e.g. eval_metrics' bars_per_year: any float, kept as float64
        if not isinstance(value, (float, np.floating)):
            raise PlanError(f"{where}: expected a float, got {value!r}")
        return np.float64(value)
    if isinstance(value, np.floating) and value.dtype != F32:
        raise PlanError(f"{where}: expected a float32, got a {value.dtype}")
    if not isinstance(value, (float, np.floating)):
        raise PlanError(f"{where}: expected a float, got {value!r}")
    return np.float32(value)


__all__ = ["Binder", "COPY_KINDS", "ELEMENT_DTYPES", "READ_ONLY_ROLES", "SCALAR_TYPES"]
