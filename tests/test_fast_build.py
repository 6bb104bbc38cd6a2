"""CPU tests of the fast path's plumbing: NVRTC builds of every ``cuda_src/*.cu`` (PTX for sm_80
and sm_90; NVRTC needs no GPU), the disk cache and its key, PTX parameter parsing, kernel
argument packing, arena layout, the row-major -> column-major GEMM mapping, and importing
``foxhunt.fast`` without a driver."""

from __future__ import annotations

import io
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (the test extra) is not installed")

from foxhunt.fast import _build
from foxhunt.fast._build import (
    KernelCompileError,
    ParamType,
    cache_key,
    compile_sources,
    entry_params,
    kernel_source_names,
    normalize_arch,
    source_files,
)
from foxhunt.fast.device import ALIGNMENT, ArenaLayout, Kernel, PackedArgs
from foxhunt.fast.gemm import EPILOGUES, GemmSpec, colmajor_problem

try:
    _nvrtc_ok = bool(_build.nvrtc_version())
except Exception as exc:  # noqa: BLE001
    pytest.skip(f"NVRTC cannot be loaded: {exc}", allow_module_level=True)

SOURCES = source_files()
UNITS = kernel_source_names(SOURCES)
HEADERS = {n: b for n, b in SOURCES.items() if n.endswith(_build.HEADER_SUFFIXES)}

AXPY = b'extern "C" __global__ void k(float* y, const float* x, float a, int n) {\n' \
       b'  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = a * x[i] + y[i];\n}\n'


# --------------------------------------------------------------------------------------------
# Every kernel file compiles (per file, so a failure names its file)
# --------------------------------------------------------------------------------------------


def test_cuda_src_has_units():
    assert UNITS, "cuda_src/ holds no .cu file"
    assert all(name.endswith(".cu") for name in UNITS)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("unit", UNITS)
def test_every_kernel_file_compiles(unit, arch, package_build):
    """Each file of the package's build for ``arch`` (NVRTC compiles every file on its own, its
    headers beside it): sm_80 as PTX, sm_90 as cubin (the build the GPU tests load; a cubin
    build makes the PTX too): the session's shared build (``conftest.package_build``), which
    ``test_member_build``, ``test_walk`` and
    ``test_all_files_compile_to_sm90_cubin_with_unique_kernel_names`` read too."""
    module, kind = package_build(arch), package_build.kinds[arch]
    assert unit in module.images
    mine = {k for k, f in module.kernels.items() if f == unit}
    assert mine, f"cuda_src/{unit} defines no extern \"C\" __global__ kernel"
    assert mine == set(entry_params(module.ptx[unit]))
    assert f".target sm_{arch[3:]}" in module.ptx[unit]
    if kind == "ptx":
        assert module.images[unit].endswith(b"\0")  # cuModuleLoadData needs NUL-terminated PTX
    else:
        assert module.images[unit][:4] == b"\x7fELF", f"cuda_src/{unit} did not produce a cubin"
    assert module.logs[unit] == "", f"NVRTC warnings for cuda_src/{unit}:\n{module.logs[unit]}"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_spectral_kernels_compile_with_the_cluster_the_plans_launch(arch, tmp_path):
    """spectral.cu compiles its cluster size into both kernels (``.reqnctapercluster``: 8 from
    sm_90, none before); the launch plans of fast.kernels.spectral use the same number, so a
    launch never splits a matrix differently from the kernel's own arithmetic."""
    import re

    from foxhunt.fast.kernels.spectral import plan_batched_spectral_norm, plan_spectral_norm

    unit = "spectral.cu"
    ptx = compile_sources(arch, "ptx", cache_root=tmp_path,
                          sources={unit: SOURCES[unit], **HEADERS}).ptx[unit]
    entries = re.findall(r"\.entry (\w+)\((?:.|\n)*?\)\n((?:\.\w+[^\n]*\n)*)\{", ptx)
    clusters = {}
    for name, directives in entries:
        found = re.search(r"\.reqnctapercluster (\d+), 1, 1", directives)
        clusters[name] = int(found.group(1)) if found else 1
    cluster = plan_spectral_norm(arch)[0]
    assert clusters == {"spectral_norm": cluster, "batched_spectral_norm": cluster}
    assert cluster == (8 if arch == "sm_90" else 1)
    assert plan_batched_spectral_norm(10, arch)[0] == 10 * cluster


def test_all_files_compile_to_sm90_cubin_with_unique_kernel_names(package_build):
    module = package_build("sm_90")
    assert set(module.images) == set(UNITS)
    for name, image in module.images.items():
        assert image[:4] == b"\x7fELF", f"cuda_src/{name} did not produce a cubin"
    # Module construction raises on a duplicate; check the mapping covers every PTX entry.
    for unit in UNITS:
        assert set(entry_params(module.ptx[unit])) == {k for k, f in module.kernels.items() if f == unit}


def test_options_keep_ieee_semantics():
    opts = _build.COMPILE_OPTIONS
    assert "-fmad=false" in opts and "-ftz=false" in opts
    assert "-prec-div=true" in opts and "-prec-sqrt=true" in opts
    assert not any("fast_math" in o or "fast-math" in o for o in opts)


def test_fmad_false_keeps_product_and_sum_separate(tmp_path):
    plain = compile_sources("sm_90", "ptx", cache_root=tmp_path, sources={"k.cu": AXPY})
    assert "fma.rn.f32" not in plain.ptx["k.cu"]
    assert "mul.rn.f32" in plain.ptx["k.cu"] and "add.rn.f32" in plain.ptx["k.cu"]
    # Control: the same source with contraction allowed does fuse (so the check above can fail).
    fused = compile_sources("sm_90", "ptx", cache_root=tmp_path, sources={"k.cu": AXPY},
                            extra_options=("-fmad=true",))
    assert "fma.rn.f32" in fused.ptx["k.cu"]


def test_headers_are_found_in_memory_and_toolkit_headers_via_include(tmp_path):
    sources = {
        "a.cu": b'#include "sub/common.cuh"\n#include <cuda_bf16.h>\n'
                b'extern "C" __global__ void use_header(unsigned short* o, float x)'
                b' { o[0] = __bfloat16_as_ushort(__float2bfloat16_rn(x * HALF)); }\n',
        "sub/common.cuh": b"#pragma once\n#define HALF 0.5f\n",
    }
    module = compile_sources("sm_80", "ptx", cache_root=tmp_path, sources=sources)
    assert dict(module.kernels) == {"use_header": "a.cu"}
    assert module.params["use_header"] == (ParamType("u64"), ParamType("f32"))


def test_compile_error_names_the_file_and_carries_the_log(tmp_path):
    sources = {
        "good.cu": AXPY,
        "bad.cu": b'extern "C" __global__ void broken(float* y) { y[0] = undefined_name; }\n',
    }
    with pytest.raises(KernelCompileError) as info:
        compile_sources("sm_90", "ptx", cache_root=tmp_path, sources=sources)
    assert set(info.value.errors) == {"bad.cu"}
    message = str(info.value)
    assert "cuda_src/bad.cu" in message and "undefined_name" in message
    assert "good.cu" not in message
    # A failed build writes no cache entry (only the lock its build held may be there).
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".json.lock")] == []


def test_duplicate_kernel_names_across_files_are_rejected(tmp_path):
    with pytest.raises(KernelCompileError, match="kernel 'k' is also defined"):
        compile_sources("sm_90", "ptx", cache_root=tmp_path, sources={"one.cu": AXPY, "two.cu": AXPY})


@pytest.mark.parametrize("arch, expected", [("sm_90", 90), ("compute_80", 80), ("sm86", 86),
                                            ("90", 90), (90, 90), ((8, 9), 89)])
def test_normalize_arch_accepts_the_usual_spellings(arch, expected):
    assert normalize_arch(arch) == expected


@pytest.mark.parametrize("arch", ["sm_75", 70, "hopper", "", (9,), None, 9.0])
def test_normalize_arch_rejects_others(arch):
    with pytest.raises(ValueError, match="arch"):
        normalize_arch(arch)


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="kind"):
        compile_sources("sm_90", "fatbin")


def test_private_files_are_separable_from_registry_sources():
    names = {"_selftest.cu": b"", "dense.cu": b"", "common.cuh": b""}
    assert kernel_source_names(names) == ["_selftest.cu", "dense.cu"]
    assert kernel_source_names(names, include_private=False) == ["dense.cu"]


# --------------------------------------------------------------------------------------------
# Cache key and cache behaviour
# --------------------------------------------------------------------------------------------

_BASE = dict(files={"a.cu": b"kernel a", "b.cuh": b"header"}, options=("-std=c++17", "-fmad=false"),
             nvrtc_version=(13, 0), arch=90, kind="cubin", toolkit_headers="13000")


def _key(**changes):
    args = {**_BASE, **changes}
    return cache_key(args["files"], args["options"], args["nvrtc_version"], args["arch"],
                     args["kind"], args["toolkit_headers"])


def test_cache_key_is_deterministic_and_ignores_dict_order():
    assert _key() == _key()
    assert _key() == _key(files={"b.cuh": b"header", "a.cu": b"kernel a"})
    assert len(_key()) == 64 and int(_key(), 16) >= 0


@pytest.mark.parametrize("change", [
    {"files": {"a.cu": b"kernel A", "b.cuh": b"header"}},            # a source byte
    {"files": {"a.cu": b"kernel a", "b.cuh": b"header2"}},           # a header
    {"files": {"a2.cu": b"kernel a", "b.cuh": b"header"}},           # a rename
    {"files": {"a.cu": b"kernel a", "b.cuh": b"header", "c.cu": b""}},  # a new file
    {"files": {"a.cu": b"kernel a"}},                                # a removed file
    {"options": ("-std=c++17", "-fmad=true")},
    {"options": ("-std=c++17",)},
    {"nvrtc_version": (13, 1)},
    {"arch": 80},
    {"kind": "ptx"},
    {"toolkit_headers": "13010"},
])
def test_cache_key_changes_with_every_input(change):
    assert _key(**change) != _key()


def test_cache_key_is_not_fooled_by_shifting_bytes_between_name_and_content():
    assert _key(files={"ab": b"c"}) != _key(files={"a": b"bc"})


def test_cache_hit_returns_the_same_module(tmp_path):
    first = compile_sources("sm_90", "cubin", cache_root=tmp_path, sources={"k.cu": AXPY})
    second = compile_sources("sm_90", "cubin", cache_root=tmp_path, sources={"k.cu": AXPY})
    assert not first.from_cache and second.from_cache
    assert first.key == second.key and dict(first.images) == dict(second.images)
    assert dict(second.kernels) == {"k": "k.cu"}
    # No temporary files left: the entry, and the lock its build held (_build_lock).
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{first.key}.json",
                                                          f"{first.key}.json.lock"]


def test_two_builds_of_one_key_at_once_compile_it_once(tmp_path, monkeypatch):
    """Two threads wanting the same build at once (as two pytest-xdist workers or two trainers
    do): the first compiles it under the key's file lock, the second waits and reads it from
    the cache; NVRTC runs once."""
    import threading
    import time

    calls = []
    compile_one = _build._compile_one

    def slow(*args):
        calls.append(args[0])
        time.sleep(0.5)  # the other thread arrives while this build is under way
        return compile_one(*args)

    monkeypatch.setattr(_build, "_compile_one", slow)
    results = [None, None]

    def build(i):
        results[i] = compile_sources("sm_90", "ptx", cache_root=tmp_path, sources={"k.cu": AXPY})

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["k.cu"]
    assert sorted(m.from_cache for m in results) == [False, True]
    assert dict(results[0].images) == dict(results[1].images)


def test_changed_source_misses_the_cache(tmp_path):
    first = compile_sources("sm_90", "ptx", cache_root=tmp_path, sources={"k.cu": AXPY})
    changed = compile_sources("sm_90", "ptx", cache_root=tmp_path,
                              sources={"k.cu": AXPY, "extra.cuh": b"// unused\n"})
    assert changed.key != first.key and not changed.from_cache


@pytest.mark.parametrize("damage", ["truncate", "flip_image", "not_json"])
def test_damaged_cache_entry_is_rebuilt(tmp_path, damage):
    first = compile_sources("sm_90", "cubin", cache_root=tmp_path, sources={"k.cu": AXPY})
    path = tmp_path / f"{first.key}.json"
    text = path.read_text()
    if damage == "truncate":
        path.write_text(text[: len(text) // 2])
    elif damage == "not_json":
        path.write_text("garbage")
    else:
        payload = json.loads(text)
        payload["files"]["k.cu"]["image"] = payload["files"]["k.cu"]["image"][::-1]
        path.write_text(json.dumps(payload))
    rebuilt = compile_sources("sm_90", "cubin", cache_root=tmp_path, sources={"k.cu": AXPY})
    assert not rebuilt.from_cache and dict(rebuilt.images) == dict(first.images)
    assert compile_sources("sm_90", "cubin", cache_root=tmp_path, sources={"k.cu": AXPY}).from_cache


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FOXHUNT_CACHE_DIR", str(tmp_path / "explicit"))
    assert _build.cache_dir() == tmp_path / "explicit" / "nvrtc"
    monkeypatch.delenv("FOXHUNT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _build.cache_dir() == tmp_path / "xdg" / "foxhunt" / "nvrtc"
    monkeypatch.setenv("FOXHUNT_CACHE_DIR", str(tmp_path / "explicit"))
    module = compile_sources("sm_90", "ptx", sources={"k.cu": AXPY})
    assert (tmp_path / "explicit" / "nvrtc" / f"{module.key}.json").is_file()


# --------------------------------------------------------------------------------------------
# PTX parameters and argument packing
# --------------------------------------------------------------------------------------------

_PTX = """
.version 8.0
.target sm_90
.visible .entry first(
	.param .u64 .ptr .global .align 4 first_param_0,
	.param .f32 first_param_1,
	.param .u32 first_param_2
)
{ ret; }
.weak .entry second(
	.param .align 16 .b8 second_param_0[24],
	.param .u64 second_param_1
)
{ ret; }
.visible .entry third()
{ ret; }
"""


def test_entry_params_reads_names_types_and_aggregates():
    params = entry_params(_PTX)
    assert list(params) == ["first", "second", "third"]
    assert params["first"] == (ParamType("u64"), ParamType("f32"), ParamType("u32"))
    assert params["second"] == (ParamType("b8", 24, 16), ParamType("u64"))
    assert params["second"][0].nbytes == 24 and params["second"][0].alignment == 16
    assert params["third"] == ()


def test_entry_params_reads_only_declarations_that_start_their_line():
    ptx = ("// a comment naming .entry ghost(\n"
           "  .visible  .entry real(\n\t.param .u32 real_param_0\n)\n{ ret; }\n"
           ".global .u32 note; .entry not_at_line_start(\n)\n")
    assert entry_params(ptx) == {"real": (ParamType("u32"),)}


def _unpacked(packed: PackedArgs, sizes):
    addresses = packed._pointers
    storage = packed._storage
    base = storage.ctypes.data
    return [storage[a - base: a - base + s].tobytes() for a, s in zip(addresses, sizes)]


def test_packing_follows_the_parameter_types():
    kernel = Kernel("first", None, entry_params(_PTX)["first"])
    packed = kernel.pack(0x7F00_1234_5600, np.float32(1.5), -3)
    raw = _unpacked(packed, [8, 4, 4])
    assert int.from_bytes(raw[0], "little") == 0x7F00_1234_5600
    assert np.frombuffer(raw[1], np.float32)[0] == np.float32(1.5)
    assert np.frombuffer(raw[2], np.int32)[0] == -3
    assert kernel.pack(16, 2, 7) is not None  # an int is fine for a float parameter


@pytest.mark.parametrize("args, error", [
    ((16, 1.5), TypeError),                        # too few
    ((16, 1.5, 3, 4), TypeError),                  # too many
    ((16, 1.5, 2.0), TypeError),                   # a float for an int parameter
    ((1.0, 1.5, 3), TypeError),                    # a float for a pointer
    ((16, "x", 3), TypeError),
    ((16, np.float64(1.0), 3), TypeError),         # an 8-byte float for a 4-byte one
    ((16, 1.5, 1 << 32), ValueError),              # does not fit 4 bytes
    ((16, 1.5, np.int64(1)), TypeError),           # an 8-byte integer for a 4-byte one
])
def test_packing_rejects_mismatched_arguments(args, error):
    kernel = Kernel("first", None, entry_params(_PTX)["first"])
    with pytest.raises(error, match="first"):
        kernel.pack(*args)


def test_packing_aggregates_takes_exact_bytes():
    kernel = Kernel("second", None, entry_params(_PTX)["second"])
    raw = _unpacked(kernel.pack(bytes(range(24)), 5), [24, 8])
    assert raw[0] == bytes(range(24))
    with pytest.raises(TypeError, match="24 raw bytes"):
        kernel.pack(bytes(8), 5)


# --------------------------------------------------------------------------------------------
# Arena layout (pure)
# --------------------------------------------------------------------------------------------


def test_arena_layout_aligns_and_never_overlaps():
    layout = ArenaLayout()
    shapes = [((3,), np.float32), ((257, 259), np.float32), ((0,), np.int32), ((5,), np.uint16),
              ((1,), np.float64), ((64, 64), np.uint8)]
    specs = [layout.add(f"b{i}", s, d) for i, (s, d) in enumerate(shapes)]
    ends = []
    for spec in specs:
        assert spec.offset % ALIGNMENT == 0
        ends.append((spec.offset, spec.offset + max(spec.nbytes, 1)))
    for (s0, e0), (s1, _) in itertools.pairwise(ends):
        assert e0 <= s1
    assert layout.nbytes == ends[-1][1]
    assert specs[1].nbytes == 257 * 259 * 4 and specs[2].nbytes == 0


def test_arena_layout_errors():
    layout = ArenaLayout(capacity=1024)
    layout.add("a", (200,), np.float32)
    with pytest.raises(ValueError, match="already exists"):
        layout.add("a", (1,), np.float32)
    with pytest.raises(ValueError, match="does not fit"):
        layout.add("b", (200,), np.float32)  # 800 bytes at offset 1024
    with pytest.raises(ValueError, match="negative"):
        layout.add("c", (-1,), np.float32)
    with pytest.raises(ValueError, match="name"):
        layout.add("", (1,), np.float32)
    with pytest.raises(KeyError, match="no buffer 'zz'"):
        layout["zz"]


# --------------------------------------------------------------------------------------------
# GEMM: the row-major -> column-major mapping, against a NumPy emulation of cuBLAS
# --------------------------------------------------------------------------------------------


def _colmajor(buf, rows, cols, ld):
    """The column-major [rows, cols] matrix with leading dimension ld over a flat buffer."""
    return np.lib.stride_tricks.as_strided(buf, (rows, cols), (buf.itemsize, ld * buf.itemsize))


def _rowmajor(buf, rows, cols, ld):
    return np.lib.stride_tricks.as_strided(buf, (rows, cols), (ld * buf.itemsize, buf.itemsize))


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("pad", [0, 3])
def test_colmajor_problem_computes_the_row_major_product(trans_a, trans_b, pad):
    m, n, k = 5, 7, 3
    rng = np.random.default_rng(1)
    a_rows, a_cols = (k, m) if trans_a else (m, k)
    b_rows, b_cols = (n, k) if trans_b else (k, n)
    spec = GemmSpec(m, n, k, trans_a, trans_b, lda=a_cols + pad, ldb=b_cols + pad, ldc=n + pad)
    a_buf = rng.standard_normal(a_rows * spec.lda)
    b_buf = rng.standard_normal(b_rows * spec.ldb)
    a = _rowmajor(a_buf, a_rows, a_cols, spec.lda)
    b = _rowmajor(b_buf, b_rows, b_cols, spec.ldb)
    expected = (a.T if trans_a else a) @ (b.T if trans_b else b)

    prob = colmajor_problem(spec)
    # cuBLAS: D = op(A_cm) @ op(B_cm); its "A" is our B's buffer, its "B" our A's.
    x = _colmajor(b_buf, prob.a_rows, prob.a_cols, prob.ld_a)
    y = _colmajor(a_buf, prob.b_rows, prob.b_cols, prob.ld_b)
    op_x = x.T if prob.transa else x
    op_y = y.T if prob.transb else y
    assert op_x.shape == (prob.m, prob.k) and op_y.shape == (prob.k, prob.n)
    d_buf = np.full(prob.d_cols * prob.ld_d, np.nan)
    _colmajor(d_buf, prob.d_rows, prob.d_cols, prob.ld_d)[...] = op_x @ op_y
    np.testing.assert_allclose(_rowmajor(d_buf, m, n, spec.ldc), expected, rtol=1e-12)

    # Epilogue vectors: cuBLAS BIAS/DRELU_BGRAD/BGRADA are per row of D (= per column of our C),
    # BGRADA reduces op(A_cm) over k, BGRADB reduces op(B_cm) over k.
    assert prob.m == n
    for epilogue in ("bias", "relu_bias", "relu_aux_bias", "drelu_bgrad"):
        assert GemmSpec(m, n, k, trans_a, trans_b, epilogue=epilogue).bias_len == prob.m
    op_a, op_b = (a.T if trans_a else a), (b.T if trans_b else b)
    # Our epilogue names are cuBLASLt's: "bgrada" reduces cuBLAS's A (our B), "bgradb" cuBLAS's B
    # (our A).
    if not trans_b:  # the only layout cuBLASLt reduces (GemmSpec rejects the other)
        spec_b = GemmSpec(m, n, k, trans_a, trans_b, epilogue="bgrada")
        assert spec_b.bias_len == prob.m and colmajor_problem(spec_b).epilogue == "BGRADA"
        np.testing.assert_allclose(op_x.sum(axis=1), op_b.sum(axis=0), rtol=1e-12)  # BGRADA reduces our B
    if trans_a:
        spec_a = GemmSpec(m, n, k, trans_a, trans_b, epilogue="bgradb")
        assert spec_a.bias_len == prob.n and colmajor_problem(spec_a).epilogue == "BGRADB"
        np.testing.assert_allclose(op_y.sum(axis=0), op_a.sum(axis=1), rtol=1e-12)  # BGRADB reduces our A


def test_gemm_spec_shapes_and_aux_layout():
    spec = GemmSpec(300, 259, 17, trans_a=True, precision="bf16", epilogue="relu_aux_bias")
    assert spec.a_shape == (17, 300) and spec.b_shape == (17, 259) and spec.c_shape == (300, 259)
    assert (spec.lda, spec.ldb, spec.ldc) == (300, 259, 259)
    assert spec.input_dtype == np.uint16 and GemmSpec(1, 1, 1).input_dtype == np.float32
    # one bit per element of a row of C, rows padded to 128 bits: ceil(259 / 128) * 128 = 384
    assert spec.aux_ld == 384 and spec.aux_nbytes == 384 // 8 * 300
    assert GemmSpec(4, 128, 2, epilogue="drelu_bgrad").aux_ld == 128
    assert GemmSpec(4, 129, 2, epilogue="drelu_bgrad").aux_ld == 256
    assert GemmSpec(4, 5, 6).aux_ld is None and GemmSpec(4, 5, 6).bias_len is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(m=0, n=1, k=1), "m"),
    (dict(m=1, n=2.0, k=1), "n"),
    (dict(m=1, n=1, k=1, precision="fp16"), "precision"),
    (dict(m=1, n=1, k=1, epilogue="gelu"), "epilogue"),
    (dict(m=4, n=4, k=1, epilogue="drelu_bgrad"), "k"),
    (dict(m=4, n=8, k=2, lda=1), "lda"),
    (dict(m=4, n=8, k=2, trans_b=True, ldb=1), "ldb"),
    (dict(m=4, n=8, k=2, ldc=7), "ldc"),
    (dict(m=4, n=8, k=2, trans_a=1), "trans_a"),
    (dict(m=4, n=8, k=2, alpha=float("nan")), "alpha"),
    (dict(m=4, n=8, k=2, trans_b=True, epilogue="bgrada"), "trans_b"),
    (dict(m=4, n=8, k=2, epilogue="bgradb"), "trans_a"),
])
def test_gemm_spec_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GemmSpec(**kwargs)


def test_gemm_epilogue_list_is_complete():
    assert set(EPILOGUES) == {None, "bias", "relu_bias", "relu_aux_bias", "drelu_bgrad",
                              "bgrada", "bgradb"}


# --------------------------------------------------------------------------------------------
# Importing without a driver; the launcher registry
# --------------------------------------------------------------------------------------------


def test_import_loads_no_cuda_library():
    code = (
        "import sys, foxhunt.fast, foxhunt.fast.kernels, foxhunt.fast.gemm, foxhunt.fast.graphs\n"
        "bad = [m for m in sys.modules if m.startswith(('cuda.bindings.driver', 'nvmath'))]\n"
        "assert not bad, bad\n"
        "ok, reason = foxhunt.fast.cuda_available()\n"
        "assert isinstance(ok, bool) and isinstance(reason, str) and reason\n"
        "print(ok)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in ("True", "False")


def test_without_a_device_errors_say_so():
    from foxhunt.fast import Device, NoCudaDeviceError, cuda_available

    ok, reason = cuda_available()
    if ok:
        pytest.skip(f"a CUDA device is present ({reason})")
    with pytest.raises(NoCudaDeviceError, match="no CUDA device/driver was found"):
        Device()
    with pytest.raises(NoCudaDeviceError, match="no CUDA device/driver"):
        compile_sources(None)


def test_fast_kernel_registry_mirrors_the_reference():
    import foxhunt.fast.kernels as fast_kernels
    import foxhunt.reference.kernels as reference_kernels

    assert fast_kernels.AREAS == reference_kernels.AREAS
    unknown = set(fast_kernels.KERNELS) - set(reference_kernels.KERNELS)
    assert not unknown, f"fast launchers without a reference twin: {sorted(unknown)}"
    missing = set(reference_kernels.KERNELS) - set(fast_kernels.KERNELS)
    assert not missing, f"reference kernels without a fast launcher: {sorted(missing)}"


def test_nvrtc_output_buffers_leave_python_constants_alone(tmp_path):
    """NVRTC writes its log, PTX and cubin into buffers the caller allocates. An empty log has
    size 1 (its NUL), and ``b" " * 1`` is CPython's cached one-byte ``b" "``: writing the NUL
    there turned every later ``b" "`` of the process into ``b"\\0"`` (under xdist, numpy's
    ``np.load`` then failed with "source code cannot contain null bytes" in whatever test came
    next). A clean compile (empty log) must leave the cached byte a space."""
    module = compile_sources("sm_80", "ptx", cache_root=tmp_path, sources={"axpy.cu": AXPY})
    assert module.logs["axpy.cu"] == ""  # the size-1 log this test is about
    assert bytes([32])[0] == 32 and (b"a b"[1:2])[0] == 32
    buf = io.BytesIO()
    np.save(buf, np.arange(3, dtype=np.float32))
    buf.seek(0)
    np.testing.assert_array_equal(np.load(buf), np.arange(3, dtype=np.float32))


def test_finalizer_releases_wait_for_the_open_captures():
    """``device.release`` (what the finalizers of device buffers, pinned blocks and GEMM plans
    call) defers its call while a capture is open (a cuMemFree in the capturing thread would
    invalidate the capture) and runs it when the last one ends."""
    from foxhunt.fast import device

    done = []
    device.release(done.append, "now")
    assert done == ["now"]
    device.capture_begins()
    device.capture_begins()  # nested: graphs built inside another capture's lifetime
    device.release(done.append, "a")
    device.release(done.append, "b")
    assert done == ["now"]
    device.capture_ends()
    assert done == ["now"]  # one capture still open
    device.capture_ends()
    assert sorted(done) == ["a", "b", "now"] and device._DEFERRED == []
    device.capture_ends()  # an unbalanced end neither underflows nor runs anything twice
    device.release(done.append, "c")
    assert done[-1] == "c" and device._CAPTURES == [0]
