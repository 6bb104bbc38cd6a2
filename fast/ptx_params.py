"""Kernel names and parameter types read from PTX text (what a compiled module's launches are
packed by: ``kernel_launch.Kernel``), for ``fast._build.Module``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# ``.entry name(`` found by its literal (fast: a module's PTX is megabytes), then checked to
# start its line, after optional ``.visible`` / ``.weak`` (_ENTRY_PREFIX).
_ENTRY_RE = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\(")
_ENTRY_PREFIX = re.compile(r"[ \t]*(?:\.visible[ \t]+|\.weak[ \t]+)?")
_PARAM_TYPES = {
    "u8": 1, "s8": 1, "b8": 1,
    "u16": 2, "s16": 2, "b16": 2, "f16": 2,
    "u32": 4, "s32": 4, "b32": 4, "f32": 4,
    "u64": 8, "s64": 8, "b64": 8, "f64": 8,
}


@dataclass(frozen=True)
class ParamType:
    """One kernel parameter as PTX declares it: ``ptx_type`` (``"u64"``, ``"f32"``, ...),
    ``count`` (> 1 for a by-value aggregate declared ``.b8 name[N]``), ``align`` in bytes."""

    ptx_type: str
    count: int = 1
    align: int = 0

    @property
    def nbytes(self) -> int:
        return _PARAM_TYPES[self.ptx_type] * self.count

    @property
    def alignment(self) -> int:
        return self.align or _PARAM_TYPES[self.ptx_type]


def entry_params(ptx: str) -> dict[str, tuple[ParamType, ...]]:
    """Kernel name -> its parameter types, for every ``.entry`` in PTX text."""
    out: dict[str, tuple[ParamType, ...]] = {}
    for match in _ENTRY_RE.finditer(ptx):
        line_start = ptx.rfind("\n", 0, match.start()) + 1
        if not _ENTRY_PREFIX.fullmatch(ptx, line_start, match.start()):
            continue  # not a declaration (".entry" inside a comment or another directive)
        close = ptx.find(")", match.end())
        if close < 0:
            raise ValueError(f"ptx: unterminated parameter list of entry {match.group(1)!r}")
        params = []
        for decl in ptx[match.end():close].split(","):
            decl = decl.strip()
            if not decl:
                continue
            tokens = decl.split()
            if tokens[0] != ".param":
                raise ValueError(f"ptx: unexpected parameter declaration {decl!r}")
            ptx_type, align, count = None, 0, 1
            # In ".param .u64 .ptr .global .align 4 p", the .align is the pointee's alignment.
            is_pointer = ".ptr" in tokens
            for i, token in enumerate(tokens[1:], start=1):
                if token == ".align" and not is_pointer:
                    align = int(tokens[i + 1])
                elif token.startswith(".") and token[1:] in _PARAM_TYPES and ptx_type is None:
                    ptx_type = token[1:]
            array = re.search(r"\[(\d+)\]\s*$", decl)
            if array:
                count = int(array.group(1))
            if ptx_type is None:
                raise ValueError(f"ptx: no type in parameter declaration {decl!r}")
            params.append(ParamType(ptx_type, count, align))
        out[match.group(1)] = tuple(params)
    return out


__all__ = ["ParamType", "entry_params"]
