"""``fast.member_build``: the member transform on a hand-written source (the wrapper's text
written out by hand; NVRTC compiles it for sm_80 and sm_90, and the PTX entries keep the plain
kernels' directives), its errors, and the whole package (the member build against the plain
build and against the parameter types read from the C source). CPU only: NVRTC needs no GPU."""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (the test extra) is not installed")

from foxhunt.fast import member_build
from foxhunt.fast._build import HEADER_SUFFIXES, ParamType, compile_sources, source_files
from foxhunt.fast.device import cuda_available
from foxhunt.fast.cuda_parse import kernel_spans, package_kernels, parse_kernels, strip_comments
from foxhunt.fast.member_build import (
    MEMBER_SCALARS_PARAM,
    MEMBER_STRIDE_PARAM,
    MemberBuildError,
    member_module,
    member_source,
    member_source_files,
)

STRIDE = ("long long", "member_stride")
SCALARS = ("const unsigned char*", "member_scalars")
TRAILING = (STRIDE, SCALARS)
# The wrapper's member scalar block pointer (member m's copy), written out by hand.
FH_MS = ("const unsigned char* fh_ms = member_scalars == nullptr ? nullptr : "
         "member_scalars + (long long)blockIdx.z * member_stride; ")

HAND = r'''#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CLUSTER 2
#else
#define CLUSTER 1
#undef __cluster_dims__
#define __cluster_dims__(...)
#endif

static __device__ float twice(float v) { return v + v; }  // blockIdx.z in a comment is fine

extern "C" __global__ void __launch_bounds__(128) __cluster_dims__(CLUSTER, 1, 1)
after_void(const float* __restrict__ x, float* __restrict__ y, float** ptrs,
           const float* const* cptrs, double a, int n) {
    extern __shared__ float smem[];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    smem[threadIdx.x] = x[i];
    y[i] = twice(smem[threadIdx.x]) * (float)a + *cptrs[0];
    ptrs[0][i] = y[i];
}

extern "C" __global__ __launch_bounds__(64, 2) void before_void(unsigned short* __restrict__ out,
                                                                const int* idx, long long count) {
    if (count == 0) {
        return;
    }
    asm volatile("{ .reg .u32 t; mov.u32 t, 0; }");
    out[0] = (unsigned short)idx[0];
}

extern "C" __global__ void __maxnreg__(40) with_maxnreg(float* w) { w[threadIdx.x] += 1.0f; }

extern "C" {
__global__ void in_block(float* w, float s) { w[threadIdx.x] *= s; }
}

extern "C" __global__ void no_params(void) {}
'''

# The wrapper's call, written out by hand (the transform's contract).
AFTER_VOID_CALL = (
    "after_void__member_body("
    "(x == nullptr ? (const float*)nullptr : (const float*)((const char*)x + (long long)blockIdx.z * member_stride)), "
    "(y == nullptr ? (float*)nullptr : (float*)((char*)y + (long long)blockIdx.z * member_stride)), "
    "(ptrs == nullptr ? (float**)nullptr : (float**)((char*)ptrs + (long long)blockIdx.z * member_stride)), "
    "(cptrs == nullptr ? (const float* const*)nullptr : (const float* const*)((const char*)cptrs + (long long)blockIdx.z * member_stride)), "
    "fh_member_scalar<double>(fh_ms, 0, a), fh_member_scalar<int>(fh_ms, 1, n));"
)
BEFORE_VOID_CALL = (
    "before_void__member_body("
    "(out == nullptr ? (unsigned short*)nullptr : (unsigned short*)((char*)out + (long long)blockIdx.z * member_stride)), "
    "(idx == nullptr ? (const int*)nullptr : (const int*)((const char*)idx + (long long)blockIdx.z * member_stride)), "
    "fh_member_scalar<long long>(fh_ms, 0, count));"
)

# PTX directives of each .entry (launch bounds, register limit, cluster shape), by kernel.
_ENTRY = re.compile(r"\.entry (\w+)\((?:.|\n)*?\)\n((?:\.\w+[^\n]*\n)*)\{")


def entry_directives(ptx: str) -> dict[str, str]:
    return {name: directives for name, directives in _ENTRY.findall(ptx)}


# ------------------------------------------------------------------------ hand-written source


def test_hand_written_wrappers_offset_every_pointer_by_bytes():
    out = member_source(HAND, "hand.cu")
    assert FH_MS + AFTER_VOID_CALL in out
    assert FH_MS + BEFORE_VOID_CALL in out
    assert (FH_MS + "in_block__member_body((w == nullptr ? (float*)nullptr : (float*)((char*)w "
            "+ (long long)blockIdx.z * member_stride)), fh_member_scalar<float>(fh_ms, 0, s));") in out
    # No scalar: no block pointer read.
    assert ("with_maxnreg(float* w, long long member_stride, const unsigned char* member_scalars) "
            "{ with_maxnreg__member_body((w == nullptr ? (float*)nullptr : (float*)((char*)w + "
            "(long long)blockIdx.z * member_stride))); }") in out
    assert ("no_params(long long member_stride, const unsigned char* member_scalars) "
            "{ no_params__member_body(); }") in out
    assert out.count("T fh_member_scalar(") == 1  # the scalar read, defined once per unit


def test_a_wrapper_of_an_early_kernel_waits_before_it_reads_its_scalars():
    """A kernel the plans launch early (its first statement ``fh_early_wait();``) gets a wrapper
    that waits before it reads its member scalar block; the body keeps its own wait."""
    early = ('extern "C" __global__ void waits(float* w, float s) {\n'
             "    fh_early_wait();  // a comment\n    w[threadIdx.x] *= s;\n}\n")
    out = member_source(early, "early.cu")
    assert ("waits(float* w, float s, long long member_stride, const unsigned char* member_scalars) "
            "{ fh_early_wait(); " + FH_MS + "waits__member_body(") in out
    body = out[out.index("waits__member_body("):]
    assert body.index("fh_early_wait();") < body.index("w[threadIdx.x] *= s;")
    assert parse_kernels(early, "early.cu")["waits"].early
    assert parse_kernels(out, "early.cu")["waits"].early
    assert not any(decl.early for decl in parse_kernels(member_source(HAND, "hand.cu")).values())
    assert "fh_early_wait" not in member_source(HAND, "hand.cu")


def test_hand_written_heads_keep_their_attributes_on_the_wrapper_only():
    out = member_source(HAND, "hand.cu")
    assert ('extern "C" __global__ void __launch_bounds__(128) __cluster_dims__(CLUSTER, 1, 1) '
            "after_void(const float* __restrict__ x, float* __restrict__ y, float** ptrs, "
            "const float* const* cptrs, double a, int n, long long member_stride, "
            "const unsigned char* member_scalars) {") in out
    assert ('extern "C" __global__ __launch_bounds__(64, 2) void before_void(') in out
    assert ('extern "C" __global__ void __maxnreg__(40) with_maxnreg(float* w, long long member_stride, '
            "const unsigned char* member_scalars)") in out
    for name in ("after_void", "before_void", "with_maxnreg", "in_block", "no_params"):
        head = re.search(r"static __device__ __forceinline__ void\s+" + name + "__member_body", out)
        assert head, name
    # The body functions' parameters are the kernels' own (restrict kept).
    assert re.search(r"after_void__member_body\(const float\* __restrict__ x, float\* __restrict__ y,"
                     r"\s+float\*\* ptrs,", out)
    assert out.count("__launch_bounds__") == 2 and out.count("__cluster_dims__(CLUSTER") == 1
    # The in-block kernel's wrapper stays inside the extern "C" block.
    block = out[out.index('extern "C" {'):]
    assert block.index("__global__ void in_block(") < block.index("\n}\n")


def test_hand_written_kernels_keep_their_parameters_plus_the_stride():
    plain = parse_kernels(HAND, "hand.cu")
    member = parse_kernels(member_source(HAND, "hand.cu"), "hand.cu")
    assert list(member) == list(plain) == ["after_void", "before_void", "with_maxnreg", "in_block",
                                           "no_params"]
    for name, decl in plain.items():
        assert member[name].params == decl.params + TRAILING, name
    assert TRAILING == (("long long", MEMBER_STRIDE_PARAM), ("const unsigned char*", MEMBER_SCALARS_PARAM))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_hand_written_member_source_compiles_like_the_plain_one(arch, tmp_path):
    plain = compile_sources(arch, "ptx", cache_root=tmp_path, sources={"hand.cu": HAND.encode()})
    member = compile_sources(arch, "ptx", cache_root=tmp_path,
                             sources={"hand.cu": member_source(HAND, "hand.cu").encode()})
    assert member.logs["hand.cu"] == "", member.logs["hand.cu"]
    assert set(member.kernels) == set(plain.kernels) == set(parse_kernels(HAND))
    for name, types in plain.params.items():
        assert member.params[name] == types + (ParamType("u64"), ParamType("u64")), name
    ptx = member.ptx["hand.cu"]
    assert entry_directives(ptx) == entry_directives(plain.ptx["hand.cu"])
    directives = entry_directives(ptx)
    assert ".maxntid 128, 1, 1" in directives["after_void"]
    assert ".maxnreg 40" in directives["with_maxnreg"]
    assert (".reqnctapercluster 2, 1, 1" in directives["after_void"]) == (arch == "sm_90")
    assert "__member_body" not in ptx  # inlined: no function of its own
    assert "%ctaid.z" in ptx and "%ctaid.z" not in plain.ptx["hand.cu"]


def test_line_numbers_are_kept():
    original = strip_comments(HAND).split("\n")
    out = member_source(HAND, "hand.cu").split("\n")
    assert len(out) == len(original)
    assert out[10] == "static __device__ __forceinline__ void"  # the head's two lines, kept
    assert out[11] == (" after_void__member_body(const float* __restrict__ x, float* __restrict__ y, "
                       "float** ptrs,")
    assert out[19].startswith("}") and AFTER_VOID_CALL in out[19]


@pytest.mark.parametrize("bad, message", [
    ('extern "C" __global__ void k(float* x) { x[blockIdx.z] = 0; }', "z.cu:1: uses 'blockIdx.z'"),
    ('\nextern "C" __global__ void k(float* x) { x[0] = gridDim . z; }', "z.cu:2: uses 'gridDim . z'"),
    ('__device__ int z() { int r; asm("mov.u32 %0, %ctaid.z;" : "=r"(r)); return r; }',
     "z.cu:1: uses '%ctaid.z'"),
    ('extern "C" __global__ void k(float* x);', "z.cu:1: kernel 'k' is declared without a body"),
    ('extern "C" __global__ void k(float* x, long long member_stride) {}',
     "z.cu:1: kernel 'k' already has a parameter named 'member_stride'"),
])
def test_member_source_errors_name_the_file_and_line(bad, message):
    with pytest.raises(MemberBuildError, match=re.escape(message)):
        member_source(bad, "z.cu")


@pytest.mark.parametrize("header, message", [
    (b'extern "C" __global__ void hk(float* x) { x[0] = 1.0f; }\n',
     "bad.cuh:1: header defines the extern \"C\" kernel 'hk'"),
    (b"__device__ int zi() { return blockIdx.z; }\n", "bad.cuh:1: uses 'blockIdx.z'"),
])
def test_headers_with_a_kernel_or_a_z_use_are_refused(monkeypatch, header, message):
    fake = {"a.cu": b'#include "bad.cuh"\nextern "C" __global__ void k(float* x) {}\n', "bad.cuh": header}
    monkeypatch.setattr(member_build, "source_files", lambda: fake)
    with pytest.raises(MemberBuildError, match=re.escape(message)):
        member_source_files()


# ------------------------------------------------------------------------------ the package

# PTX parameter types of the C parameter types of cuda_src (pointers are 64-bit addresses).
PTX_OF_C = {"int": "u32", "unsigned": "u32", "unsigned int": "u32", "float": "f32",
            "double": "f64", "long long": "u64"}


def ptx_type_of(ctype: str) -> str:
    return "u64" if "*" in ctype else PTX_OF_C[ctype]


#: Whether this machine has a CUDA device (the population then loads ``member_module``'s cubin).
_GPU = cuda_available()[0]


@pytest.fixture(scope="module", params=[80, 90], ids=["sm_80", "sm_90"])
def modules(request, nvrtc_cache, package_build):
    """(arch, member module, plain module): one compile each per test session. The plain
    module is the session's package build (``conftest.package_build``: sm_90 cubin, sm_80
    PTX); on a machine with a GPU, sm_90 builds the population's own ``member_module`` (cubin,
    the module a population loads) beside it; otherwise (CI) each architecture compiles the
    member sources as PTX (NVRTC's part of the build: a cubin of them cost CI's two cores
    about 27 s for sm_80 and 17 s more than the PTX for sm_90; ptxas is exercised by the
    package's sm_90 cubin, and ``member_module``'s one build per process is tested on its own
    below)."""
    arch = request.param
    plain = package_build(f"sm_{arch}")
    if arch == 90 and _GPU:
        return arch, member_module(arch), plain
    return arch, compile_sources(arch, "ptx", cache_root=nvrtc_cache, sources=member_source_files()), plain


def test_member_module_has_every_kernel_with_the_two_trailing_parameters(modules):
    arch, member, plain = modules
    kernels = package_kernels()
    assert set(member.kernels) == set(plain.kernels) == set(kernels)
    assert dict(member.kernels) == dict(plain.kernels)  # each kernel in the same file
    for name, decl in kernels.items():
        expected = tuple(ParamType(ptx_type_of(ctype)) for ctype, _ in decl.params)
        assert plain.params[name] == expected, name  # the plain module: no member_stride
        assert member.params[name] == expected + (ParamType("u64"), ParamType("u64")), name
    assert member.logs == {unit: "" for unit in member.images}
    assert member.key != plain.key
    if arch == 90 and _GPU:  # the population's module, built once per process
        assert member_module(f"sm_{arch}") is member


def test_member_module_is_built_once_per_process_and_architecture(monkeypatch):
    """``member_module``: the member sources compiled (cubin, the disk cache on) on the first
    call for an architecture, the same module on every later call however it is named."""
    calls = []

    def build(arch, *args, **kwargs):
        calls.append((arch, args, kwargs))
        return object()

    monkeypatch.setattr(member_build, "compile_sources", build)
    monkeypatch.setattr(member_build, "_MEMBER_MODULES", {})
    first = member_module("sm_90")
    assert member_module(90) is first and member_module((9, 0)) is first
    other = member_module("sm_80")
    assert other is not first and member_module(80) is other
    assert [arch for arch, _, _ in calls] == [90, 80]
    assert all(args == () and kwargs == {"sources": member_source_files()}
               for _, args, kwargs in calls)


def test_member_module_entries_keep_the_plain_directives(modules):
    arch, member, plain = modules
    for unit in plain.ptx:
        directives = entry_directives(plain.ptx[unit])
        assert set(directives) == {k for k, f in plain.kernels.items() if f == unit}, unit
        assert entry_directives(member.ptx[unit]) == directives, unit
    ens = entry_directives(member.ptx["ensemble.cu"])["ens_kl_grad"]
    assert (".reqnctapercluster 8, 1, 1" in ens) == (arch == 90)


def test_cluster_kernel_keeps_its_attribute_on_the_wrapper():
    out = member_source(source_files()["ensemble.cu"].decode(), "ensemble.cu")
    wrapper = next(line for line in out.split("\n") if "ens_kl_grad(" in line and "__global__" in line)
    assert ('extern "C" __global__ void __launch_bounds__(REDUCE_MAX_THREADS) '
            "__cluster_dims__(FH_CLUSTER, 1, 1) ens_kl_grad(") in wrapper
    head = out[out.index("ens_kl_grad__member_body") - 60:out.index("ens_kl_grad__member_body")]
    assert head.rstrip().endswith("static __device__ __forceinline__ void")
    assert out.count("__cluster_dims__") == 1


def test_member_source_files_transform_the_units_only():
    plain, member = source_files(), member_source_files()
    assert set(member) == set(plain)
    for name, data in plain.items():
        if name.endswith(HEADER_SUFFIXES):
            assert member[name] == data, name
        elif name.endswith(".cu"):
            text = member[name].decode()
            assert text.count("\n") == data.decode().count("\n"), name
            assert text.count("__member_body(") == 2 * len(parse_kernels(data.decode(), name)), name
            # the early kernels stay early (their wrappers wait first), no other kernel is
            assert ({k: d.early for k, d in parse_kernels(text, name).items()}
                    == {k: d.early for k, d in parse_kernels(data.decode(), name).items()}), name


@pytest.mark.parametrize("name", sorted(n for n in source_files() if n.endswith(".cu")))
def test_package_lines_are_kept(name):
    """Every line of the unit is as it was, except a kernel's head lines (now the body
    function's) and its closing line, which the wrapper follows."""
    original = strip_comments(source_files()[name].decode())
    before, after = original.split("\n"), member_source(original, name).split("\n")
    assert len(after) == len(before)
    heads, closings = set(), set()
    for span in kernel_spans(original):
        first = original.count("\n", 0, span.start)
        heads.update(range(first, original.count("\n", 0, span.name_start) + 1))
        closings.add(original.count("\n", 0, span.body[1]))
    for i, (old, new) in enumerate(zip(before, after)):
        if i in closings:
            assert new.startswith(old) and "__member_body(" in new[len(old):], (name, i + 1)
        elif i not in heads:
            assert new == old, (name, i + 1)


# ------------------------------------------------------------------------ member scalar blocks
def test_scalar_block_packs_each_scalar_in_its_slot():
    """Slot j (8 bytes) holds the j-th scalar parameter little-endian, the rest zero; pointers
    take no slot (struct.pack is the independent encoding)."""
    import struct

    params = parse_kernels(HAND)["after_void"].params  # x, y, ptrs, cptrs, double a, int n
    assert member_build.scalar_params(params) == (("double", "a"), ("int", "n"))
    block = member_build.member_scalar_block(params, {"a": 0.1, "n": -3})
    assert block.dtype == np.uint8 and block.tobytes() == struct.pack("<d", 0.1) + struct.pack("<iI", -3, 0)
    kernel = parse_kernels(HAND)["before_void"].params  # long long count
    assert member_build.member_scalar_block(kernel, {"count": 2**40}).tobytes() == struct.pack("<q", 2**40)
    axpy = parse_kernels(source_files()["_selftest.cu"].decode())["selftest_axpy"].params
    assert member_build.member_scalar_block(axpy, {"a": 2.5, "n": 7}).tobytes() == \
        struct.pack("<fI", 2.5, 0) + struct.pack("<iI", 7, 0)
    assert member_build.member_scalar_block(parse_kernels(HAND)["no_params"].params, {}).size == 0


@pytest.mark.parametrize("values,message", [
    ({"a": 1.0}, r"missing \['n'\], unknown \[\]"),
    ({"a": 1.0, "n": 1, "b": 2}, r"missing \[\], unknown \['b'\]"),
    ({"a": 1.0, "n": 2**31}, r"n=2147483648 is not an integer in \[-2147483648, 2147483647\] \(int\)"),
    ({"a": 1.0, "n": 1.5}, r"n=1.5 is not an integer"),
    ({"a": 1.0, "n": True}, r"n=True is not an integer"),
])
def test_scalar_block_refuses_a_bad_value_by_name(values, message):
    with pytest.raises(ValueError, match=message):
        member_build.member_scalar_block(parse_kernels(HAND)["after_void"].params, values)


def _gpu_reason() -> str | None:
    from foxhunt.fast.device import cuda_available

    ok, reason = cuda_available()
    return None if ok else reason


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=f"no CUDA device/driver: {_gpu_reason()}")
@pytest.mark.parametrize("with_scalars", [False, True], ids=["shared-scalars", "member-scalars"])
def test_gpu_member_launch_moves_every_pointer_and_reads_each_members_scalars(with_scalars):
    """``selftest_axpy`` of the member module over 3 members (gridDim.z = 3) of a 256-byte-
    strided arena: member m computes y_m = a * x_m + y_m on its own copies, with one shared
    ``a`` and ``n`` (null scalar block), or with member m's own ``a_m`` and ``n_m`` from its
    block (the blocks at the same stride); the bytes past each member's n stay untouched."""
    from foxhunt.fast.device import Device

    n, members, stride = 40, 3, 1024  # bytes per member: y [0, 160), x [256, 416), block [512, 528)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((members, n)).astype(np.float32), rng.standard_normal((members, n)).astype(np.float32)
    a, counts = np.float32([2.0, -0.5, 3.25]), [n, 17, 0]
    arena = np.zeros((members, stride), np.uint8)
    params = parse_kernels(source_files()["_selftest.cu"].decode())["selftest_axpy"].params
    for m in range(members):
        arena[m, 0:4 * n] = np.frombuffer(y[m].tobytes(), np.uint8)
        arena[m, 256:256 + 4 * n] = np.frombuffer(x[m].tobytes(), np.uint8)
        arena[m, 512:528] = member_build.member_scalar_block(params, {"a": a[m], "n": counts[m]})
    dev = Device(0)
    module = dev.load_module(member_module(dev.arch))
    buf = dev.alloc(arena.nbytes)
    try:
        dev.copy_to_device(buf.ptr, arena)
        block_ptr = buf.ptr + 512 if with_scalars else 0
        module.kernel("selftest_axpy").launch((1, 1, members), 64, buf.ptr, buf.ptr + 256,
                                              np.float32(a[0]), n, stride, block_ptr,
                                              stream=dev.stream)
        out = dev.copy_to_host(np.empty_like(arena), buf.ptr)
    finally:
        buf.free()
        module.close()
    got = out[:, :4 * n].copy().view(np.float32)
    for m in range(members):
        scale, count = (a[m], counts[m]) if with_scalars else (a[0], n)
        want = y[m].copy()
        want[:count] = scale * x[m][:count] + y[m][:count]  # two roundings, as the kernel (no FMA)
        assert np.array_equal(got[m], want), m
        assert np.array_equal(out[m, 256:], arena[m, 256:])  # x and the block untouched
