"""NVRTC build of every kernel in ``cuda_src/``, with an on-disk cache.

Translation units: one NVRTC program per ``cuda_src/*.cu`` file. A compile error then names its
file, and file-local helpers (``static __device__``) in two files cannot collide. Headers
(``*.cuh``, ``*.h``) under ``cuda_src/`` are handed to NVRTC in memory under their relative
names, so ``#include "common.cuh"`` works from a source checkout, an editable install or a
wheel (the files are found through ``importlib.resources``, package ``foxhunt.cuda_src``).
Toolkit headers (``cuda_bf16.h``) come from ``-I`` the CUDA runtime's header directory, found
with ``cuda.pathfinder``. Kernel names must be unique across files (checked here).

Options (``COMPILE_OPTIONS``): IEEE float semantics, no fast math.

- ``-fmad=false``: NVRTC contracts ``a * b + c`` into one FMA by default (one rounding). The
  NumPy reference rounds the product and the sum separately, so contraction would make
  elementwise kernels differ from it by up to an ULP per contracted op. A kernel that wants an
  FMA calls ``fmaf`` explicitly, and its reference emulates it (exactly, in float64 with
  one final float32 rounding of the fused result) and says so in its docstring.
- ``-ftz=false -prec-div=true -prec-sqrt=true``: keep subnormals, IEEE-rounded ``/`` and
  ``sqrtf`` (the NVRTC defaults, spelled out because the contract depends on them).
- no ``--use_fast_math``: intrinsics (``__expf``...) are only used where a kernel declares
  them, with a ULP bound in its conformance entry.
- ``-lineinfo``: source line tables for the profiler; does not change the generated code.

``kind="cubin"`` (default) builds machine code for one real architecture (``sm_90``): what the
fast path loads. ``kind="ptx"`` builds for the virtual architecture (``compute_90``): what CI
does on a machine without a GPU (NVRTC needs no driver). Both keep the PTX text, which is
where kernel names and parameter types are read from (``Module.kernels``,
``Module.params``). PTX made by an NVRTC newer than the installed driver does not load; the
driver loads cubins from any NVRTC of its major version or older.

Cache: ``$FOXHUNT_CACHE_DIR`` (else ``$XDG_CACHE_HOME/foxhunt``, else ``~/.cache/foxhunt``),
subfolder ``nvrtc/``, one JSON file per key. The key is a sha256 over every file under
``cuda_src/`` (names and contents), the options, the NVRTC version, the CUDA runtime headers'
version, the architecture and the kind. Writes are atomic (a temporary file in the same
folder, then ``os.replace``), so concurrent builders never see a torn entry; an unreadable
entry is rebuilt and overwritten.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import hashlib
import importlib.resources
import json
import os
import re
import tempfile
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from foxhunt.fast.ptx_params import ParamType, entry_params

SOURCE_PACKAGE = "foxhunt.cuda_src"
SOURCE_SUFFIX = ".cu"
HEADER_SUFFIXES = (".cuh", ".h")
# Files whose name starts with this are build infrastructure (self-test kernels), not kernels
# with a reference twin: the kernel registry skips them.
PRIVATE_PREFIX = "_"

KINDS = ("cubin", "ptx")
MIN_ARCH = 80  # SPEC section 9: sm_80 and newer

COMPILE_OPTIONS = (
    "-std=c++17",
    "-fmad=false",
    "-ftz=false",
    "-prec-div=true",
    "-prec-sqrt=true",
    "-lineinfo",
)

CACHE_FORMAT = "foxhunt-nvrtc-cache-1"
CACHE_ENV = "FOXHUNT_CACHE_DIR"


class KernelCompileError(RuntimeError):
    """NVRTC rejected one or more ``cuda_src`` files.

    ``errors`` maps each failing file name to NVRTC's log; the message holds them all.
    """

    def __init__(self, arch: str, errors: Mapping[str, str]):
        self.arch = arch
        self.errors = dict(errors)
        parts = [f"NVRTC failed to compile {len(self.errors)} file(s) for {arch}:"]
        for name, log in sorted(self.errors.items()):
            parts.append(f"--- cuda_src/{name} ---\n{log.rstrip()}")
        super().__init__("\n".join(parts))


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------


def source_files() -> dict[str, bytes]:
    """Every file under ``cuda_src/`` (relative POSIX name -> bytes), Python files excluded.

    Read through ``importlib.resources`` so it works from a checkout and from a wheel.
    """
    root = importlib.resources.files(SOURCE_PACKAGE)
    found: dict[str, bytes] = {}

    def walk(node, prefix: str) -> None:
        for child in node.iterdir():
            name = prefix + child.name
            if child.is_dir():
                if child.name != "__pycache__":
                    walk(child, name + "/")
            elif not child.name.endswith((".py", ".pyc")):
                found[name] = child.read_bytes()

    walk(root, "")
    return dict(sorted(found.items()))


def kernel_source_names(files: Mapping[str, bytes], *, include_private: bool = True) -> list[str]:
    """The ``*.cu`` translation units among ``files``, sorted (``_``-prefixed ones optional)."""
    return sorted(
        name
        for name in files
        if name.endswith(SOURCE_SUFFIX)
        and (include_private or not name.rsplit("/", 1)[-1].startswith(PRIVATE_PREFIX))
    )


# --------------------------------------------------------------------------------------------
# Architecture, options, key
# --------------------------------------------------------------------------------------------


def normalize_arch(arch) -> int:
    """``"sm_90"``, ``"compute_90"``, ``"sm90"``, ``"90"``, ``90`` or ``(9, 0)`` -> ``90``.

    Raises ValueError for anything else, or for an architecture older than ``sm_80``.
    """
    value = None
    if isinstance(arch, tuple) and len(arch) == 2 and all(isinstance(v, int) for v in arch):
        value = arch[0] * 10 + arch[1]
    elif isinstance(arch, int) and not isinstance(arch, bool):
        value = arch
    elif isinstance(arch, str):
        match = re.fullmatch(r"(?:sm_?|compute_?)?(\d{2,3})", arch.strip())
        if match:
            value = int(match.group(1))
    if value is None:
        raise ValueError(
            f"arch: {arch!r} is not an architecture; expected e.g. 'sm_90', 90 or (9, 0)"
        )
    if value < MIN_ARCH:
        raise ValueError(f"arch: sm_{value} is not supported; foxhunt needs sm_{MIN_ARCH} or newer")
    return value


def arch_option(arch: int, kind: str) -> str:
    """NVRTC's ``--gpu-architecture``: real (``sm_XX``) for cubin, virtual for PTX."""
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not allowed; expected one of {KINDS}")
    return f"--gpu-architecture={'sm' if kind == 'cubin' else 'compute'}_{arch}"


def cache_key(
    files: Mapping[str, bytes],
    options: tuple[str, ...],
    nvrtc_version: tuple[int, int],
    arch: int,
    kind: str,
    toolkit_headers: str = "",
) -> str:
    """sha256 (hex) over every source file (name and bytes, in name order), the options, the
    NVRTC version, the toolkit headers' version string, the architecture and the kind."""
    digest = hashlib.sha256()

    def put(blob: bytes) -> None:
        # Length-prefixed, so no two different inputs concatenate to the same stream.
        digest.update(len(blob).to_bytes(8, "little"))
        digest.update(blob)

    put(CACHE_FORMAT.encode())
    put(str(len(files)).encode())
    for name in sorted(files):
        put(name.encode())
        put(bytes(files[name]))
    put("\0".join(options).encode())
    put(f"{nvrtc_version[0]}.{nvrtc_version[1]}".encode())
    put(toolkit_headers.encode())
    put(str(arch).encode())
    put(kind.encode())
    return digest.hexdigest()


def cache_root() -> Path:
    """foxhunt's cache folder: ``$FOXHUNT_CACHE_DIR``, else ``$XDG_CACHE_HOME/foxhunt``, else
    ``~/.cache/foxhunt`` (compiled modules in ``nvrtc/``, cuBLASLt's algorithm choices in
    ``cublaslt/``: ``fast.gemm_algos``)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "foxhunt"


def cache_dir() -> Path:
    """Where compiled modules are cached (see the module docstring)."""
    return cache_root() / "nvrtc"


# --------------------------------------------------------------------------------------------
# The compiled module
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Module:
    """Every ``cuda_src/*.cu`` compiled for one architecture.

    ``images[file]`` is what ``cuModuleLoadData`` takes (cubin bytes, or NUL-terminated PTX);
    ``ptx[file]`` the PTX text; ``logs[file]`` NVRTC's warnings (empty when clean);
    ``kernels`` maps each kernel name to its file; ``params`` each kernel name to its
    parameter types. ``from_cache`` says whether this came from the disk cache.
    """

    arch: int
    kind: str
    key: str
    options: tuple[str, ...]
    nvrtc_version: tuple[int, int]
    images: Mapping[str, bytes]
    ptx: Mapping[str, str]
    logs: Mapping[str, str]
    from_cache: bool = False
    kernels: Mapping[str, str] = field(init=False)
    params: Mapping[str, tuple[ParamType, ...]] = field(init=False)

    def __post_init__(self):
        kernels: dict[str, str] = {}
        params: dict[str, tuple[ParamType, ...]] = {}
        for name in sorted(self.ptx):
            for kernel, types in entry_params(self.ptx[name]).items():
                if kernel in kernels:
                    raise KernelCompileError(
                        f"sm_{self.arch}",
                        {name: f"kernel {kernel!r} is also defined in cuda_src/{kernels[kernel]}; "
                               "kernel names must be unique across files"},
                    )
                kernels[kernel] = name
                params[kernel] = types
        object.__setattr__(self, "kernels", MappingProxyType(kernels))
        object.__setattr__(self, "params", MappingProxyType(params))

    @property
    def arch_name(self) -> str:
        return f"sm_{self.arch}"


# --------------------------------------------------------------------------------------------
# NVRTC
# --------------------------------------------------------------------------------------------


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "NVRTC is not available: install cuda-bindings and nvidia-cuda-nvrtc "
            f"(pip install 'foxhunt[gpu]'): {exc}"
        ) from exc
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    err, major, minor = nvrtc.nvrtcVersion()
    _nvrtc_check(nvrtc, err, "nvrtcVersion")
    return int(major), int(minor)


def supported_archs() -> tuple[int, ...]:
    nvrtc = _nvrtc()
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    _nvrtc_check(nvrtc, err, "nvrtcGetSupportedArchs")
    return tuple(int(a) for a in archs)


def _nvrtc_check(nvrtc, err, what: str) -> None:
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, text = nvrtc.nvrtcGetErrorString(err)
        raise RuntimeError(f"{what} failed: {text.decode(errors='replace')}")


def toolkit_include_dir() -> str:
    """The CUDA runtime's header folder (holds ``cuda_bf16.h``)."""
    try:
        from cuda import pathfinder
    except ImportError as exc:  # pragma: no cover
        raise RuntimeError(f"cuda-pathfinder is not installed: {exc}") from exc
    located = pathfinder.find_nvidia_header_directory("cudart")
    if located is None:
        raise RuntimeError(
            "the CUDA runtime headers (cuda_bf16.h) were not found: install nvidia-cuda-runtime"
        )
    return str(located)


def _toolkit_headers_version(include_dir: str) -> str:
    """``CUDART_VERSION`` from the runtime headers NVRTC will include (part of the key)."""
    try:
        text = (Path(include_dir) / "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return "unknown"
    match = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    return match.group(1) if match else "unknown"


def _out_buffer(size: int) -> bytearray:
    """A fresh writable buffer for an NVRTC getter. Never ``b" " * size``: NVRTC writes into the
    buffer, and for ``size == 1`` (an empty log: just its NUL) that expression is CPython's
    cached one-byte ``b" "``, which NVRTC then overwrote with ``b"\\0"`` process-wide (every
    later ``b" "`` was a NUL: numpy's header parser then failed with "source code cannot contain
    null bytes" in whatever test ran next)."""
    return bytearray(size)


def _program_log(nvrtc, prog) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    _nvrtc_check(nvrtc, err, "nvrtcGetProgramLogSize")
    buf = _fill(nvrtc.nvrtcGetProgramLog, prog, _out_buffer(size))
    return buf.rstrip(b"\0").decode(errors="replace")


def _fill(getter, prog, buf: bytearray) -> bytearray:
    """``getter(prog, buf)`` (an NVRTC ``nvrtcGet*`` that writes ``buf``), checked; ``buf``."""
    (err,) = getter(prog, buf)
    _nvrtc_check(_nvrtc(), err, getter.__name__)
    return buf


def _compile_one(name: str, source: bytes, headers: Mapping[str, bytes], options, kind: str):
    """Compile one translation unit: returns (image, ptx_text, log) or (None, None, log)."""
    nvrtc = _nvrtc()
    header_names = sorted(headers)
    err, prog = nvrtc.nvrtcCreateProgram(
        source,
        f"cuda_src/{name}".encode(),
        len(header_names),
        [headers[h] for h in header_names],
        [h.encode() for h in header_names],
    )
    _nvrtc_check(nvrtc, err, f"nvrtcCreateProgram(cuda_src/{name})")
    try:
        encoded = [o.encode() for o in options]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        log = _program_log(nvrtc, prog)
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, text = nvrtc.nvrtcGetErrorString(result)
            return None, None, log or text.decode(errors="replace")
        err, ptx_size = nvrtc.nvrtcGetPTXSize(prog)
        _nvrtc_check(nvrtc, err, "nvrtcGetPTXSize")
        ptx = bytes(_fill(nvrtc.nvrtcGetPTX, prog, _out_buffer(ptx_size)))
        if kind == "cubin":
            err, size = nvrtc.nvrtcGetCUBINSize(prog)
            _nvrtc_check(nvrtc, err, "nvrtcGetCUBINSize")
            image = bytes(_fill(nvrtc.nvrtcGetCUBIN, prog, _out_buffer(size)))
        else:
            image = ptx if ptx.endswith(b"\0") else ptx + b"\0"
        return image, ptx.rstrip(b"\0").decode(), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# --------------------------------------------------------------------------------------------
# Cache I/O
# --------------------------------------------------------------------------------------------


def _cache_read(path: Path, key: str):
    try:
        payload = json.loads(path.read_text())
        if payload.get("format") != CACHE_FORMAT or payload.get("key") != key:
            return None
        images, ptx, logs = {}, {}, {}
        for name, entry in payload["files"].items():
            image = base64.b64decode(entry["image"])
            if hashlib.sha256(image).hexdigest() != entry["sha256"]:
                return None
            images[name], ptx[name], logs[name] = image, entry["ptx"], entry["log"]
        return images, ptx, logs
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _cache_write(path: Path, key: str, images, ptx, logs) -> None:
    payload = {
        "format": CACHE_FORMAT,
        "key": key,
        "files": {
            name: {
                "image": base64.b64encode(images[name]).decode(),
                "sha256": hashlib.sha256(images[name]).hexdigest(),
                "ptx": ptx[name],
                "log": logs[name],
            }
            for name in images
        },
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(payload, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        warnings.warn(f"foxhunt: could not write the kernel cache {path}: {exc}", stacklevel=3)


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------


def compile_sources(
    arch=None,
    kind: str = "cubin",
    *,
    cache: bool = True,
    cache_root: str | os.PathLike | None = None,
    sources: Mapping[str, bytes] | None = None,
    extra_options: tuple[str, ...] = (),
) -> Module:
    """Compile every ``cuda_src/*.cu`` with NVRTC (or take it from the disk cache).

    ``arch``: ``None`` takes the compute capability of CUDA device 0 (needs a driver;
    raises ``NoCudaDeviceError`` without one: pass ``arch="sm_90"`` to build without a GPU).
    ``kind``: ``"cubin"`` or ``"ptx"``. ``cache_root`` overrides the cache folder;
    ``sources`` replaces the package's files (name -> bytes, headers included) for tests.
    Raises ``KernelCompileError`` listing every file that failed, with NVRTC's log.
    """
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not allowed; expected one of {KINDS}")
    if arch is None:
        from foxhunt.fast.device import default_arch

        arch = default_arch()
    arch_num = normalize_arch(arch)
    files = dict(source_files() if sources is None else sources)
    units = kernel_source_names(files)
    headers = {n: b for n, b in files.items() if n.endswith(HEADER_SUFFIXES)}

    include_dir = toolkit_include_dir()
    options = (*COMPILE_OPTIONS, *extra_options, arch_option(arch_num, kind), f"-I{include_dir}")
    version = nvrtc_version()
    if arch_num not in supported_archs():
        raise ValueError(
            f"arch: sm_{arch_num} is not supported by NVRTC {version[0]}.{version[1]} "
            f"(supported: {', '.join(f'sm_{a}' for a in supported_archs())})"
        )
    key = cache_key(files, options, version, arch_num, kind, _toolkit_headers_version(include_dir))
    path = Path(cache_root) / f"{key}.json" if cache_root is not None else cache_dir() / f"{key}.json"

    def cached():
        hit = _cache_read(path, key)
        if hit is None or set(hit[0]) != set(units):
            return None
        images, ptx, logs = hit
        return Module(arch_num, kind, key, options, version, MappingProxyType(images),
                      MappingProxyType(ptx), MappingProxyType(logs), from_cache=True)

    if not cache:
        return _compile_units(units, files, headers, options, kind, arch_num, key, version, None)
    module = cached()
    if module is None:
        # One process builds a key at a time: one waiting here reads the other's build.
        with _build_lock(path):
            module = cached() or _compile_units(units, files, headers, options, kind, arch_num,
                                                key, version, path)
    return module


def _compile_units(units, files, headers, options, kind: str, arch_num: int, key: str, version,
                   path: Path | None) -> Module:
    """Compile ``units`` with NVRTC (a thread per unit, up to the CPU count); write the cache
    file ``path`` unless it is None."""
    images, ptx, logs, errors = {}, {}, {}, {}
    workers = max(1, min(len(units), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {name: pool.submit(_compile_one, name, files[name], headers, options, kind)
                   for name in units}
        for name, future in futures.items():
            image, text, log = future.result()
            if image is None:
                errors[name] = log
            else:
                images[name], ptx[name], logs[name] = image, text, log
    if errors:
        raise KernelCompileError(f"sm_{arch_num}", errors)
    module = Module(arch_num, kind, key, options, version, MappingProxyType(images),
                    MappingProxyType(ptx), MappingProxyType(logs), from_cache=False)
    if path is not None:
        _cache_write(path, key, images, ptx, logs)
    return module


@contextlib.contextmanager
def _build_lock(path: Path):
    """Hold ``<path>.lock`` (``filelock``) while the build of cache file ``path`` is made and
    written, so that processes wanting the same build (pytest-xdist workers, two trainers
    starting together) make it once; without a writable cache folder, no lock (each builds)."""
    import filelock

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(str(path) + ".lock")
        lock.acquire()
    except OSError:
        yield
        return
    try:
        yield
    finally:
        lock.release()


_PACKAGE_MODULES: dict[int, Module] = {}  # package_module's answers, by architecture
_PACKAGE_LOCK = threading.Lock()


def package_module(arch) -> Module:
    """``compile_sources(arch)`` (the package's own ``cuda_src``, the disk cache on) once per
    process: the trainers, evaluators and collectors of a process share one ``Module``, and a
    second trainer does not read the cache again. A call while another thread builds it waits
    for that build (``fast.prewarm`` starts one early)."""
    arch_num = normalize_arch(arch)
    with _PACKAGE_LOCK:
        module = _PACKAGE_MODULES.get(arch_num)
        if module is None:
            module = _PACKAGE_MODULES[arch_num] = compile_sources(arch_num)
    return module


__all__ = [
    "COMPILE_OPTIONS",
    "KernelCompileError",
    "Module",
    "ParamType",
    "cache_dir",
    "cache_key",
    "cache_root",
    "compile_sources",
    "package_module",
    "entry_params",
    "kernel_source_names",
    "normalize_arch",
    "nvrtc_version",
    "source_files",
]
