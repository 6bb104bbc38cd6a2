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
  ``<name>(<same params>, long long member_stride)``, whose body calls ``<name>__member_body``
  with every pointer parameter moved to its member's copy, by BYTES::

      (T*)((char*)p + (long long)blockIdx.z * member_stride)

  (``const char*`` where T is const; ``T*`` is the parameter's type without its own qualifiers,
  so ``const float* __restrict__ p`` passes ``(const float*)((const char*)p + ...)`` and the
  body function's parameter keeps its ``__restrict__``), and every scalar as it is.

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

from foxhunt.fast._build import (
    HEADER_SUFFIXES,
    SOURCE_SUFFIX,
    Module,
    compile_sources,
    normalize_arch,
    source_files,
)
from foxhunt.fast.cuda_parse import kernel_spans, parse_kernels, split_params, strip_comments

#: The wrapper's trailing parameter: bytes between member m's and member m + 1's buffers.
MEMBER_STRIDE_PARAM = "member_stride"
#: ``<kernel name> + BODY_SUFFIX`` names the body function of a kernel.
BODY_SUFFIX = "__member_body"

_BODY_HEAD = "static __device__ __forceinline__ void"
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


def _member_arg(ptype: str, name: str, where: str) -> str:
    cast = _pointer_cast(ptype, where)
    if cast is None:
        return name
    pointer, char = cast
    return f"({pointer})(({char}){name} + (long long)blockIdx.z * {MEMBER_STRIDE_PARAM})"


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
    for span in kernel_spans(text):
        line = text.count("\n", 0, span.global_start) + 1
        where = f"{file}:{line}: kernel {span.name!r}"
        if span.body is None:
            raise MemberBuildError(f"{where} is declared without a body; the member build "
                                   "needs its definition in the same file")
        (open_paren, close_end), (_, body_end) = span.params, span.body
        param_text = text[open_paren + 1:close_end - 1]
        params = split_params(param_text)
        if any(name == MEMBER_STRIDE_PARAM for _, name in params):
            raise MemberBuildError(f"{where} already has a parameter named {MEMBER_STRIDE_PARAM!r}")
        head = text[span.start:span.name_start]
        name_end = span.name_start + len(span.name)
        line_breaks = "\n" * head.count("\n")
        out.append(text[done:span.start])
        # The body function: the old head's line breaks kept, then the name, params and body.
        out.append(f"{_BODY_HEAD}{line_breaks} {span.name}{BODY_SUFFIX}")
        out.append(text[name_end:body_end])
        # The kernel, on the closing brace's line (no line break: later lines keep their numbers).
        stride = f"long long {MEMBER_STRIDE_PARAM}"
        wrapper_params = f"{' '.join(param_text.split())}, {stride}" if params else stride
        args = ", ".join(_member_arg(ptype, name, where) for ptype, name in params)
        out.append(f" {' '.join(head.split())} {span.name}({wrapper_params}) "
                   f"{{ {span.name}{BODY_SUFFIX}({args}); }}")
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
    "MEMBER_STRIDE_PARAM",
    "MemberBuildError",
    "member_module",
    "member_source",
    "member_source_files",
]
