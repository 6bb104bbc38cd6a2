"""Find the ``extern "C" __global__`` kernels in ``cuda_src/`` and their parameter lists.

A small purpose-built scanner, not a C++ parser: comments are stripped (string and character
literals respected), then every ``__global__`` function whose declaration is ``extern "C"``
(directly, ``extern "C" __global__ void k(...)``, or inside an ``extern "C" { ... }`` block)
is recorded with its parameters. ``__launch_bounds__(...)``, ``__maxnreg__(...)`` and
``__cluster_dims__(...)`` (with nested parentheses) may stand before or after ``void``. Parameters are split at top-level commas; each becomes
``(type, name)`` with whitespace normalised (``"const float* __restrict__"``, ``"x"``).
A kernel defined twice (two files, or one file twice) is an error: with C linkage the
names would clash when the sources are linked into one module. ``kernel_spans`` says where each
kernel's declaration, parameters and body lie (for source transforms: ``fast.member_build``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

#: Source suffixes scanned for kernels.
SUFFIXES = (".cu", ".cuh")

_IDENT = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True)
class KernelDecl:
    """One ``extern "C" __global__`` kernel: name, parameters, and where it is defined;
    ``early``: its body's first statement is ``fh_early_wait();`` (``cuda_src/early_launch.cuh``:
    nothing is read or written before the kernels it depends on are done), so the plans may
    launch it early (``graph_lowering.EARLY_LAUNCH``)."""

    name: str
    params: tuple[tuple[str, str], ...]
    file: str
    line: int
    early: bool = False

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


class CudaParseError(ValueError):
    """A kernel declaration the scanner cannot read, or a kernel name defined twice."""


#: What ``strip_comments`` looks at, leftmost first: a ``//`` comment (to the end of its line),
#: a ``/* */`` comment, an unterminated ``/*`` (an error), a string or character literal (a
#: backslash escapes the next character; unterminated, it runs to the end of the text).
_COMMENT_OR_LITERAL = re.compile(
    r"//[^\n]*|/\*.*?\*/|/\*|\"(?:\\.|\\\Z|[^\"\\])*(?:\"|\Z)|'(?:\\.|\\\Z|[^'\\])*(?:'|\Z)",
    re.S)


def _strip_one(match: re.Match) -> str:
    text = match.group()
    if text.startswith("//"):
        return ""  # the newline after it stays
    if text.startswith("/*"):
        if len(text) < 4 or not text.endswith("*/"):
            raise CudaParseError("unterminated /* comment")
        return "\n" * text.count("\n") or " "  # line numbers kept
    return text  # a literal, as it is


def strip_comments(source: str) -> str:
    """Remove ``//`` and ``/* */`` comments, keeping string/char literals and line numbers (a
    ``/* */`` comment becomes its newlines, or one space)."""
    return _COMMENT_OR_LITERAL.sub(_strip_one, source)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _balanced(text: str, i: int, open_ch: str = "(", close_ch: str = ")") -> int:
    """Index just past the bracket matching ``text[i] == open_ch``."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_ch:
            depth += 1
        elif text[j] == close_ch:
            depth -= 1
            if depth == 0:
                return j + 1
    raise CudaParseError(f"unbalanced {open_ch!r} starting at offset {i}")


def _extern_c_ranges(text: str) -> list[tuple[int, int]]:
    """Spans of ``extern "C" { ... }`` blocks."""
    ranges = []
    for m in re.finditer(r'extern\s*"C"\s*\{', text):
        start = m.end() - 1
        ranges.append((start, _balanced(text, start, "{", "}")))
    return ranges


def split_params(param_text: str) -> tuple[tuple[str, str], ...]:
    """``"const float* __restrict__ x, int n"`` -> ``(("const float* __restrict__", "x"), ("int", "n"))``."""
    text = param_text.strip()
    if text in ("", "void"):
        return ()
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    params = []
    for raw in parts:
        decl = raw.split("=", 1)[0].strip()  # drop a default argument
        array = ""
        if decl.endswith("]"):
            decl, array = decl[:decl.rindex("[")].rstrip(), "*"
        names = list(_IDENT.finditer(decl))
        if len(names) < 2:
            raise CudaParseError(f"cannot read parameter {raw.strip()!r} (need a type and a name)")
        last = names[-1]
        ptype = " ".join(decl[:last.start()].split()) + array
        ptype = re.sub(r"\s*\*\s*", "* ", ptype)  # "float *x" and "float* x" read alike
        ptype = re.sub(r"\*\s+(?=\*)", "*", ptype).strip()
        params.append((ptype, last.group()))
    return tuple(params)


_GLOBAL = re.compile(r"\b__global__\b")
_QUALIFIER = re.compile(r"(?:static|inline|__forceinline__|__noinline__|__launch_bounds__|__maxnreg__|"
                        r"__cluster_dims__)\b")


def _read_kernel(text: str, i: int) -> tuple[str, str, int] | None:
    """From just after ``__global__``: ``(name, param_text, end)`` of a ``void`` kernel, or None."""
    seen_void = False
    while True:
        i = _skip_ws(text, i)
        m = _IDENT.match(text, i)
        if not m:
            return None
        word = m.group()
        i = m.end()
        if word in ("__launch_bounds__", "__maxnreg__", "__cluster_dims__"):
            i = _skip_ws(text, i)
            if i >= len(text) or text[i] != "(":
                raise CudaParseError(f"{word} without arguments at offset {i}")
            i = _balanced(text, i)
        elif _QUALIFIER.fullmatch(word):
            continue
        elif word == "void" and not seen_void:
            seen_void = True
        elif seen_void:
            j = _skip_ws(text, i)
            if j < len(text) and text[j] == "<":  # template specialisation: not a C kernel
                return None
            if j >= len(text) or text[j] != "(":
                return None
            end = _balanced(text, j)
            return word, text[j + 1:end - 1], end
        else:
            return None


@dataclass(frozen=True)
class KernelSpan:
    """Where one ``extern "C" __global__`` kernel lies in a comment-free text (offsets into it):
    ``start`` its declaration's first character (``extern`` of a direct ``extern "C"``; in an
    ``extern "C" { }`` block its first attribute, else ``__global__``), ``global_start`` that of
    ``__global__``, ``name_start`` its name's, ``params`` its ``(`` and one past its ``)``,
    ``body`` its ``{`` and one past the matching ``}`` (braces inside string and character
    literals, as in inline ``asm``, not counted), or None for a declaration without a body."""

    name: str
    start: int
    global_start: int
    name_start: int
    params: tuple[int, int]
    body: tuple[int, int] | None


# The first statement of a kernel the plans may launch early (``KernelDecl.early``).
_EARLY_WAIT = re.compile(r"\s*fh_early_wait\s*\(\s*\)\s*;")
# Attributes and qualifiers that may stand between `extern "C"` and `__global__`.
_LEAD = r"(?:(?:__launch_bounds__|__maxnreg__|__cluster_dims__)\s*\([^;{}]*?\)\s*|(?:static|inline)\s+)*"


def kernel_spans(text: str) -> list[KernelSpan]:
    """Every ``extern "C" __global__`` kernel of ``text`` (``strip_comments``'s output), in
    order: the kernels :func:`parse_kernels` reads, with where their parts are."""
    blocks = _extern_c_ranges(text)
    code = None  # text with its literals blanked (same length): where the bodies' braces count
    spans: list[KernelSpan] = []
    for m in _GLOBAL.finditer(text):
        prefix = text[:m.start()].rstrip()
        # Directly `extern "C"` (possibly with qualifiers such as __launch_bounds__ between).
        head = re.search(r'extern\s*"C"\s*(' + _LEAD + ')$', prefix)
        inside_block = any(a < m.start() < b for a, b in blocks)
        if not (head or inside_block):
            continue
        parsed = _read_kernel(text, m.end())
        if parsed is None:
            continue
        name, param_text, end = parsed
        open_paren = end - len(param_text) - 2
        if head:
            start = head.start()
        else:
            lead = re.search(_LEAD + "$", prefix)
            start = lead.start() if lead.group() else m.start()
        body = None
        j = _skip_ws(text, end)
        if j < len(text) and text[j] == "{":
            if code is None:
                code = _COMMENT_OR_LITERAL.sub(lambda lit: " " * len(lit.group()), text)
            body = (j, _balanced(code, j, "{", "}"))
        spans.append(KernelSpan(name, start, m.start(), text.rindex(name, 0, open_paren),
                                (open_paren, end), body))
    return spans


def waits_first(text: str, span: KernelSpan) -> bool:
    """Whether the body of kernel ``span`` (in ``text``, ``strip_comments``' output) begins
    with ``fh_early_wait();``: ``KernelDecl.early``."""
    return span.body is not None and _EARLY_WAIT.match(text, span.body[0] + 1) is not None


def parse_kernels(source: str, file: str = "<string>") -> dict[str, KernelDecl]:
    """``{name: KernelDecl}`` for every ``extern "C" __global__`` kernel in ``source``."""
    text = strip_comments(source)
    found: dict[str, KernelDecl] = {}
    for span in kernel_spans(text):
        name, (open_paren, end) = span.name, span.params
        line = text.count("\n", 0, span.global_start) + 1
        decl = KernelDecl(name, split_params(text[open_paren + 1:end - 1]), file, line,
                          waits_first(text, span))
        if name in found:
            raise CudaParseError(f"kernel {name!r} defined twice: {found[name].where} and {decl.where}")
        found[name] = decl
    return found


def parse_cuda_dir(cuda_dir: str | Path, exclude: frozenset[str] | set[str] = frozenset()
                   ) -> dict[str, KernelDecl]:
    """All kernels of ``cuda_dir/*.cu`` and ``*.cuh`` (sorted by file name), skipping the file
    names in ``exclude``; a name defined in two files raises :class:`CudaParseError`."""
    cuda_dir = Path(cuda_dir)
    if not cuda_dir.is_dir():
        raise FileNotFoundError(f"CUDA source directory {cuda_dir} does not exist")
    found: dict[str, KernelDecl] = {}
    for path in sorted(p for p in cuda_dir.iterdir() if p.suffix in SUFFIXES and p.is_file()):
        if path.name in exclude:
            continue
        for name, decl in parse_kernels(path.read_text(encoding="utf-8"), path.name).items():
            if name in found:
                raise CudaParseError(f"kernel {name!r} defined twice: {found[name].where} and {decl.where}")
            found[name] = decl
    return found


@functools.lru_cache(maxsize=1)
def package_kernels() -> dict[str, KernelDecl]:
    """Every kernel of the installed ``foxhunt.cuda_src`` (read as ``fast._build`` reads it, so a
    checkout, an editable install and a wheel agree); a name defined twice raises."""
    from foxhunt.fast._build import source_files

    found: dict[str, KernelDecl] = {}
    for name, data in source_files().items():
        if not name.endswith(SUFFIXES):
            continue
        for kernel, decl in parse_kernels(data.decode("utf-8"), name).items():
            if kernel in found:
                raise CudaParseError(f"kernel {kernel!r} defined twice: {found[kernel].where} and {decl.where}")
            found[kernel] = decl
    return found
