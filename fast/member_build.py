"""The population build of ``cuda_src``: every kernel given a member dimension, by a source
transform (no kernel edited by hand), compiled as a module of its own (SPEC 12, issue 24).

The population engine keeps N members' step buffers in one device arena: member m's copy of
every buffer lies at member 0's address + m * S bytes (one stride S for every buffer), and it
launches every kernel of the step once for all members with ``gridDim.z = N``. For each
``extern "C" __global__`` kernel of a ``.cu`` translation unit (as ``fast.cuda_parse`` finds
them, ``extern "C" { }`` blocks included) the transform writes

- its body as ``static __device__ __forceinline__ void <name>__member_body(<same params>)
  { <same body> }``: the same text, without the kernel's head (``extern "C" __global__``,
  ``__launch_bounds__``, ``__maxnreg__``, ``__cluster_dims__``), and
- a kernel under the old name and the old head (the same attributes, where they stood),
  ``<name>(<same params>, long long member_stride, const unsigned char* member_scalars)``,
  whose body calls ``<name>__member_body`` with every pointer parameter moved to its member's
  copy, by BYTES (a null pointer stays null: a kernel skips an output it is given none for)::

      (p == nullptr ? (T*)nullptr : (T*)((char*)p + (long long)blockIdx.z * member_stride))

  (``const char*`` where T is const; ``T*`` is the parameter's type without its own qualifiers,
  so ``const float* __restrict__ p`` passes ``(const float*)((const char*)p + ...)`` and the
  body function's parameter keeps its ``__restrict__``), and every scalar either as it is
  (``member_scalars`` null) or, per member, from the launch's scalar block: the j-th scalar
  parameter (in parameter order) read as its own type from byte ``SCALAR_SLOT_BYTES * j`` of
  ``member_scalars + blockIdx.z * member_stride`` (the block lies in the arena like every other
  buffer: member m's copy holds member m's values; ``member_scalar_block`` packs one). This is
  how members differ in a scalar hyper-parameter (lr, tau, a loss weight, the IQN generator's
  key) without any kernel taking it through a pointer; a launch whose scalars are the same for
  every member passes null and reads its scalar arguments.

The body function is inlined, so the kernel's code is the plain kernel's code after that
pointer arithmetic. ``member_stride = 0`` with ``gridDim.z = 1`` is the plain kernel's
behaviour. Line numbers are kept (the body function's head keeps the old head's line breaks;
the wrapper follows the body's closing brace on its line), so NVRTC's messages and ``-lineinfo``
name the lines of ``cuda_src``; comments are dropped (``cuda_parse.strip_comments``).

What the engine must guarantee: every pointer a kernel receives points into the member-0 copy
of the arena (a buffer shared by all members is replicated per member, since every pointer
moves); pointers held INSIDE a buffer (the ``SpectralMatrix`` descriptors of
``batched_spectral_norm``) do not move with it: member m's copy of such a buffer holds member
m's addresses; no kernel uses the z dimension (``blockIdx.z``, ``gridDim.z``, ``%ctaid.z``:
checked here, in every ``.cu`` and header, textually); ``__device__`` variables of a module
(``walk_profile``, built only with ``-DWALK_PROFILE``) are one copy for all members.
"""

from __future__ import annotations

import re
import threading

import numpy as np

from foxhunt.fast._build import (
    HEADER_SUFFIXES,
    SOURCE_SUFFIX,
    Module,
    compile_sources,
    normalize_arch,
    source_files,
)
from foxhunt.fast.cuda_parse import (kernel_spans, parse_kernels, split_params, strip_comments,
                                     waits_first)

#: The wrapper's first trailing parameter: bytes between member m's and member m + 1's buffers.
MEMBER_STRIDE_PARAM = "member_stride"
#: The wrapper's last parameter: member 0's scalar block of the launch, or null (module docstring).
MEMBER_SCALARS_PARAM = "member_scalars"
#: Bytes per scalar slot of a scalar block (every kernel scalar is a C type of at most 8 bytes).
SCALAR_SLOT_BYTES = 8
#: The C scalar types a kernel parameter may have, with the little-endian dtype of its slot.
SCALAR_DTYPES = {"float": "<f4", "double": "<f8", "int": "<i4", "unsigned": "<u4",
                 "unsigned int": "<u4", "long long": "<i8"}
#: ``<kernel name> + BODY_SUFFIX`` names the body function of a kernel.
BODY_SUFFIX = "__member_body"

_BODY_HEAD = "static __device__ __forceinline__ void"
# The scalar read of a wrapper, defined once per translation unit (before its first wrapper).
_SCALAR_HELPER = ("template <typename T> static __device__ __forceinline__ T fh_member_scalar("
                  "const unsigned char* s, int slot, T plain) { return s == nullptr ? plain : "
                  f"*reinterpret_cast<const T*>(s + {SCALAR_SLOT_BYTES} * slot); }}")
# Any use of the z dimension, which the member build takes for the member index (inline PTX too).
_Z_USE = re.compile(r"\b(?:blockIdx|gridDim)\s*\.\s*z\b|%n?ctaid\.z\b")
# Qualifiers of a pointer itself (after its last '*'), dropped from the cast's type.
_OWN_QUALIFIERS = frozenset({"const", "volatile", "__restrict__", "__restrict"})
_CV = ("const", "volatile")


class MemberBuildError(ValueError):
    """A ``cuda_src`` file the member transform cannot take (named, with the reason)."""


def _check_no_z(text: str, file: str) -> None:
    """Raise if comment-free ``text`` uses the z dimension anywhere (kernel or helper)."""
    use = _Z_USE.search(text)
    if use:
        line = text.count("\n", 0, use.start()) + 1
        raise MemberBuildError(
            f"{file}:{line}: uses {use.group()!r}; the member build gives blockIdx.z to the "
            "population member, so no kernel or device function may use the z dimension")


def _pointer_cast(ptype: str, where: str) -> tuple[str, str] | None:
    """``(pointer type, char pointer type)`` of a pointer parameter typed ``ptype``
    (``split_params``' spelling): ``"const float* __restrict__"`` -> ``("const float*",
    "const char*")``, ``"float* const*"`` -> ``("float* const*", "const char*")``; None for a
    scalar (a by-value struct included: its pointers, if any, do not move)."""
    star = ptype.rfind("*")
    if star < 0:
        return None
    own = ptype[star + 1:].split()
    if not set(own) <= _OWN_QUALIFIERS:
        raise MemberBuildError(f"{where}: cannot read the pointer parameter type {ptype!r}")
    pointee = ptype[:star]
    inner = pointee.rfind("*")  # the pointee is itself a pointer: its own qualifiers decide
    words = set(pointee[inner + 1:].split())
    char = " ".join([q for q in _CV if q in words] + ["char*"])
    return ptype[:star + 1].strip(), char


def _member_arg(ptype: str, name: str, where: str, slot: int) -> str:
    """The wrapper's argument for parameter ``name``: a pointer moved to its member's copy, or
    scalar number ``slot`` of the member's scalar block (the plain argument without one)."""
    cast = _pointer_cast(ptype, where)
    if cast is None:
        if ptype not in SCALAR_DTYPES:
            raise MemberBuildError(f"{where}: scalar parameter {name!r} has type {ptype!r}; "
                                   f"allowed: {sorted(SCALAR_DTYPES)}")
        return f"fh_member_scalar<{ptype}>(fh_ms, {slot}, {name})"
    pointer, char = cast
    return (f"({name} == nullptr ? ({pointer})nullptr : "
            f"({pointer})(({char}){name} + (long long)blockIdx.z * {MEMBER_STRIDE_PARAM}))")


def scalar_params(params) -> tuple[tuple[str, str], ...]:
    """The scalar ``(type, name)`` parameters of a kernel (``cuda_parse`` spelling), in order:
    parameter j of this tuple reads slot j of a scalar block."""
    return tuple((t, n) for t, n in params if "*" not in t)


def member_scalar_block(params, values) -> np.ndarray:
    """The scalar block (uint8, ``SCALAR_SLOT_BYTES`` per scalar) of one launch of a kernel with
    ``params`` (``cuda_parse`` ``(type, name)`` pairs) for ONE member: ``values[name]`` for every
    scalar parameter, each little-endian in its slot, the slot's other bytes zero. A missing or
    unknown name, or a value its C type cannot hold exactly (an int out of range, a fraction for
    an int), raises ``ValueError`` naming it."""
    scalars = scalar_params(params)
    names = [n for _, n in scalars]
    extra = sorted(set(values) - set(names))
    missing = [n for n in names if n not in values]
    if extra or missing:
        raise ValueError(f"member scalars: missing {missing}, unknown {extra}; the kernel's "
                         f"scalar parameters are {names}")
    block = np.zeros(SCALAR_SLOT_BYTES * len(scalars), np.uint8)
    for j, (ptype, name) in enumerate(scalars):
        dtype = np.dtype(SCALAR_DTYPES[ptype])
        value = values[name]
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            if isinstance(value, (bool, np.bool_)) or not float(value).is_integer() \
                    or not info.min <= int(value) <= info.max:
                raise ValueError(f"member scalars: {name}={value!r} is not an integer in "
                                 f"[{info.min}, {info.max}] ({ptype})")
            cast = np.array(int(value), dtype=dtype)
        else:
            cast = np.array(value, dtype=np.float64).astype(dtype)
        block[SCALAR_SLOT_BYTES * j:SCALAR_SLOT_BYTES * j + dtype.itemsize] = \
            np.frombuffer(cast.tobytes(), np.uint8)
    return block


def member_source(source: str, file: str = "<string>") -> str:
    """The member build of one ``cuda_src`` translation unit (see the module docstring): every
    ``extern "C" __global__`` kernel split into its body function and a wrapper taking
    ``long long member_stride`` last. Raises :class:`MemberBuildError` for a use of the z
    dimension, a kernel declared without a body, or a parameter already named
    ``member_stride``."""
    text = strip_comments(source)
    _check_no_z(text, file)
    out: list[str] = []
    done = 0
    helper_written = False
    for span in kernel_spans(text):
        line = text.count("\n", 0, span.global_start) + 1
        where = f"{file}:{line}: kernel {span.name!r}"
        if span.body is None:
            raise MemberBuildError(f"{where} is declared without a body; the member build "
                                   "needs its definition in the same file")
        (open_paren, close_end), (_, body_end) = span.params, span.body
        param_text = text[open_paren + 1:close_end - 1]
        params = split_params(param_text)
        for reserved in (MEMBER_STRIDE_PARAM, MEMBER_SCALARS_PARAM, "fh_ms"):
            if any(name == reserved for _, name in params):
                raise MemberBuildError(f"{where} already has a parameter named {reserved!r}")
        head = text[span.start:span.name_start]
        name_end = span.name_start + len(span.name)
        line_breaks = "\n" * head.count("\n")
        out.append(text[done:span.start])
        # The body function: the old head's line breaks kept, then the name, params and body.
        out.append(f"{_BODY_HEAD}{line_breaks} {span.name}{BODY_SUFFIX}")
        out.append(text[name_end:body_end])
        # The kernel, on the closing brace's line (no line break: later lines keep their numbers).
        trailing = f"long long {MEMBER_STRIDE_PARAM}, const unsigned char* {MEMBER_SCALARS_PARAM}"
        wrapper_params = f"{' '.join(param_text.split())}, {trailing}" if params else trailing
        slots = iter(range(len(params)))
        args = ", ".join(_member_arg(ptype, name, where, next(slots) if "*" not in ptype else -1)
                         for ptype, name in params)
        scalars = ""
        if scalar_params(params):
            scalars = (f"const unsigned char* fh_ms = {MEMBER_SCALARS_PARAM} == nullptr ? nullptr : "
                       f"{MEMBER_SCALARS_PARAM} + (long long)blockIdx.z * {MEMBER_STRIDE_PARAM}; ")
        # A kernel the plans launch early waits before its member scalars are read, too.
        wait = "fh_early_wait(); " if waits_first(text, span) else ""
        if not helper_written:
            out.append(f" {_SCALAR_HELPER}")
            helper_written = True
        out.append(f" {' '.join(head.split())} {span.name}({wrapper_params}) "
                   f"{{ {wait}{scalars}{span.name}{BODY_SUFFIX}({args}); }}")
        done = body_end
    out.append(text[done:])
    return "".join(out)


def member_source_files() -> dict[str, bytes]:
    """``fast._build.source_files()`` with every ``.cu`` translation unit through
    :func:`member_source`; headers as they are (checked: no kernel, no use of the z dimension)."""
    files: dict[str, bytes] = {}
    for name, data in source_files().items():
        if name.endswith(SOURCE_SUFFIX):
            files[name] = member_source(data.decode("utf-8"), name).encode("utf-8")
            continue
        if name.endswith(HEADER_SUFFIXES):
            text = data.decode("utf-8")
            kernels = parse_kernels(text, name)
            if kernels:
                first = next(iter(kernels.values()))
                raise MemberBuildError(
                    f"{first.where}: header defines the extern \"C\" kernel {first.name!r}; "
                    "kernels must live in .cu files for the member build")
            _check_no_z(strip_comments(text), name)
        files[name] = data
    return files


_MEMBER_MODULES: dict[int, Module] = {}  # member_module's answers, by architecture
_MEMBER_LOCK = threading.Lock()


def member_module(arch) -> Module:
    """The population module: :func:`member_source_files` compiled by
    ``fast._build.compile_sources`` (cubin, the disk cache on: its key covers the transformed
    sources, so it never meets the plain module's entry), once per process and architecture.
    The plain ``package_module`` is untouched."""
    arch_num = normalize_arch(arch)
    with _MEMBER_LOCK:
        module = _MEMBER_MODULES.get(arch_num)
        if module is None:
            module = _MEMBER_MODULES[arch_num] = compile_sources(arch_num,
                                                                 sources=member_source_files())
    return module


__all__ = [
    "BODY_SUFFIX",
    "MEMBER_SCALARS_PARAM",
    "MEMBER_STRIDE_PARAM",
    "SCALAR_DTYPES",
    "SCALAR_SLOT_BYTES",
    "MemberBuildError",
    "member_module",
    "member_source",
    "member_scalar_block",
    "member_source_files",
    "scalar_params",
]
