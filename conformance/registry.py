"""The kernel registry: every kernel's entry bound by name to its reference function and fast
test entry (:data:`SPECS`), and the check that ``cuda_src/``, the reference ``KERNELS``, the
fast ``KERNELS`` and the entries describe the same kernels (:func:`check_consistency`).

A :class:`~foxhunt.conformance.kernel_spec.KernelSpec` pairs the reference function
(``foxhunt.reference.kernels.KERNELS[name]``) with the fast path's numpy-in/numpy-out test entry
(``foxhunt.fast.kernels.KERNELS[name]``, same signature) and the kernel's
:class:`~foxhunt.conformance.kernel_spec.SpecEntry` (``foxhunt.conformance.specs``, by area):
how to test it, and the tolerance of each output. An entry whose name pairs with no reference
function is an error when the specs are built, not a silent skip.

Which CUDA kernels must be twinned: every ``extern "C" __global__`` kernel of ``cuda_src/``,
except those of infrastructure sources (file names starting with ``_``, such as the build and
launch self test ``_selftest.cu``) that the fast package never launches. A kernel is *launched*
when the fast package names it in a string literal (its launch records and launchers name
kernels that way: :func:`kernels_named_by`), so a kernel an underscore file holds but the step
launches needs its twins like any other.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Collection, Mapping

from foxhunt.fast.cuda_parse import KernelDecl, parse_cuda_dir
from foxhunt.conformance.kernel_spec import (
    EXTREMAL_SETS,
    OVERFLOW_FREE_INJECTION,
    SHAPE_CASES,
    Dims,
    KernelSpec,
    Output,
    SpecEntry,
    case_dims,
)
from foxhunt.conformance.specs import SPEC_TABLE

#: Reference kernels that deliberately have no CUDA kernel: ``{name: reason}``. (Helpers such
#: as ``hard_sync`` and the GEMM emulation are not in the reference ``KERNELS`` at all.)
DIVERGENCES: Mapping[str, str] = MappingProxyType({
    "greedy_walk_span_rounds": "the evaluator's fused walk, a test entry: greedy_walk_spans' "
                               "span launches, then greedy_walk_round's rounds on their base",
})


def default_cuda_dir() -> Path:
    """``cuda_src/`` of the installed package (works from a wheel and an editable install)."""
    return Path(str(resources.files("foxhunt.cuda_src")))


def default_fast_dir() -> Path:
    """The installed ``foxhunt.fast`` package directory (its sources name what it launches)."""
    return Path(str(resources.files("foxhunt.fast")))


def is_infrastructure_source(file_name: str) -> bool:
    """Sources whose names start with ``_`` hold infrastructure (self tests), not the step."""
    return file_name.startswith("_")


def infrastructure_sources(cuda_dir: str | Path) -> tuple[str, ...]:
    return tuple(sorted(p.name for p in Path(cuda_dir).iterdir()
                        if p.suffix in (".cu", ".cuh") and is_infrastructure_source(p.name)))


def kernels_named_by(package_dir: str | Path, kernel_names: Collection[str]) -> frozenset[str]:
    """The names in ``kernel_names`` that a ``.py`` file under ``package_dir`` holds as a string
    literal (a launch record's or launcher's kernel name)."""
    wanted = frozenset(kernel_names)
    found: set[str] = set()
    for path in sorted(Path(package_dir).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in wanted:
                found.add(node.value)
    return frozenset(found)


def cuda_kernels(cuda_dir: str | Path, launched: Collection[str] = ()) -> dict[str, KernelDecl]:
    """The kernels of ``cuda_dir`` that need twins: every kernel of a specification source, and
    the kernels of infrastructure sources whose names are in ``launched``."""
    every = parse_cuda_dir(cuda_dir)
    return {name: decl for name, decl in every.items()
            if not is_infrastructure_source(Path(decl.file).name) or name in launched}


# ----------------------------------------------------------------------- fast-path access
def cuda_availability() -> tuple[bool, str]:
    """``(available, reason)`` from ``foxhunt.fast.cuda_available()``; never raises."""
    try:
        fast = importlib.import_module("foxhunt.fast")
        ok, reason = fast.cuda_available()
    except Exception as exc:  # noqa: BLE001 - any failure means "no usable fast path here"
        return False, f"foxhunt.fast.cuda_available() failed: {type(exc).__name__}: {exc}"
    return bool(ok), str(reason)


def load_fast_kernels() -> tuple[Mapping[str, Callable], str | None]:
    """``(KERNELS, problem)``: the fast test entries, or ``({}, why)`` when they cannot be
    loaded (the consistency check then reports every kernel as missing its fast entry)."""
    try:
        module = importlib.import_module("foxhunt.fast.kernels")
        kernels = module.KERNELS
    except Exception as exc:  # noqa: BLE001
        return {}, f"loading foxhunt.fast.kernels.KERNELS failed: {type(exc).__name__}: {exc}"
    return MappingProxyType(dict(kernels)), None


def reference_kernels() -> Mapping[str, Callable]:
    from foxhunt.reference.kernels import KERNELS

    return KERNELS


def build_specs(ref_kernels: Mapping[str, Callable], fast_kernels: Mapping[str, Callable],
                table: Mapping[str, SpecEntry] = SPEC_TABLE) -> dict[str, KernelSpec]:
    """A :class:`KernelSpec` for every reference kernel that has an entry, in reference order.
    An entry whose name is no reference kernel raises ``KeyError`` (a name that pairs with
    nothing); a reference kernel without an entry is :func:`check_consistency`'s to report."""
    orphans = sorted(set(table) - set(ref_kernels))
    if orphans:
        raise KeyError(f"conformance entries {orphans} name no reference kernel in "
                       "foxhunt.reference.kernels.KERNELS")
    return {name: KernelSpec(name, ref, fast_kernels.get(name), table[name])
            for name, ref in ref_kernels.items() if name in table}


def _signature_key(fn: Callable) -> list[tuple]:
    sig = inspect.signature(fn)
    return [(p.name, p.kind.name, repr(p.default)) for p in sig.parameters.values()]


def check_consistency(cuda_dir: str | Path | None, ref_kernels: Mapping[str, Callable],
                      fast_kernels: Mapping[str, Callable], specs: Mapping[str, Any],
                      divergences: Mapping[str, str] = DIVERGENCES, *,
                      launched: Collection[str] = ()) -> list[str]:
    """Every way the kernel sets disagree, one string per problem (empty: consistent).

    ``specs`` maps kernel names to their entries (or specs); ``launched`` names the kernels the
    fast package launches (:func:`kernels_named_by`), which need twins even where an
    infrastructure source holds them. ``cuda_dir=None`` leaves the CUDA side out. Problems:
    a CUDA kernel without a reference twin or without a fast entry; a reference kernel without
    a CUDA kernel or a fast entry (unless ``divergences`` says why); a fast entry without a
    reference twin; a reference/fast signature mismatch; a reference kernel without an entry
    and an entry without a reference kernel; stale ``divergences``.
    """
    problems: list[str] = []
    cuda = cuda_kernels(cuda_dir, launched) if cuda_dir is not None else {}
    ref_names, fast_names, cuda_names = set(ref_kernels), set(fast_kernels), set(cuda)

    for name in sorted(divergences):
        if name not in ref_names:
            problems.append(f"DIVERGENCES lists {name!r}, which is not a reference kernel")
        elif name in cuda_names:
            problems.append(f"DIVERGENCES lists {name!r}, but cuda_src defines it "
                            f"({cuda[name].where}): remove the stale entry")
    for name in sorted(cuda_names - ref_names):
        problems.append(f"CUDA kernel {name!r} ({cuda[name].where}) has no reference twin "
                        "in foxhunt.reference.kernels.KERNELS")
    for name in sorted(cuda_names - ref_names - fast_names):
        problems.append(f"CUDA kernel {name!r} ({cuda[name].where}) has no fast test entry "
                        "in foxhunt.fast.kernels.KERNELS")
    if cuda_dir is not None:
        for name in sorted(ref_names - cuda_names - set(divergences)):
            problems.append(f"reference kernel {name!r} has no CUDA kernel in cuda_src/ "
                            "(add it, or list it in DIVERGENCES with a reason)")
    for name in sorted(ref_names - fast_names - set(divergences)):
        problems.append(f"reference kernel {name!r} has no fast test entry in "
                        "foxhunt.fast.kernels.KERNELS")
    for name in sorted(fast_names - ref_names):
        problems.append(f"fast kernel {name!r} has no reference twin")
    for name in sorted(ref_names & fast_names):
        if _signature_key(ref_kernels[name]) != _signature_key(fast_kernels[name]):
            problems.append(
                f"signature mismatch for {name!r}: reference {inspect.signature(ref_kernels[name])}"
                f" vs fast {inspect.signature(fast_kernels[name])}")
    for name in sorted(ref_names - set(specs)):
        problems.append(f"reference kernel {name!r} has no conformance entry (add a SpecEntry "
                        "to its area's ENTRIES in foxhunt.conformance.specs)")
    for name in sorted(set(specs) - ref_names):
        problems.append(f"conformance entry {name!r} has no reference kernel")
    return problems


def consistency_problems() -> list[str]:
    """:func:`check_consistency` on the installed tree: ``cuda_src/``, the reference and fast
    kernels, every entry, and the kernels the fast package launches."""
    cuda_dir = default_cuda_dir()
    every = parse_cuda_dir(cuda_dir)
    launched = kernels_named_by(default_fast_dir(), every)
    problems = [] if FAST_LOAD_PROBLEM is None else [FAST_LOAD_PROBLEM]
    return problems + check_consistency(cuda_dir, REF_KERNELS, FAST_KERNELS, SPEC_TABLE,
                                        launched=launched)


# ------------------------------------------------------------------------- module state
#: The reference kernels, the fast test entries and the problem (if any) met loading them.
REF_KERNELS: Mapping[str, Callable] = reference_kernels()
FAST_KERNELS, FAST_LOAD_PROBLEM = load_fast_kernels()

#: One KernelSpec per reference kernel that has an entry.
SPECS: Mapping[str, KernelSpec] = MappingProxyType(build_specs(REF_KERNELS, FAST_KERNELS))

__all__ = [
    "DIVERGENCES", "EXTREMAL_SETS", "FAST_KERNELS", "FAST_LOAD_PROBLEM", "OVERFLOW_FREE_INJECTION",
    "REF_KERNELS", "SHAPE_CASES", "SPECS", "SPEC_TABLE", "Dims", "KernelSpec", "Output",
    "SpecEntry", "build_specs", "case_dims", "check_consistency", "consistency_problems",
    "cuda_availability", "cuda_kernels", "default_cuda_dir", "default_fast_dir",
    "infrastructure_sources", "is_infrastructure_source", "kernels_named_by",
    "load_fast_kernels", "reference_kernels",
]
