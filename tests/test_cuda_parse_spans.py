"""``cuda_parse.kernel_spans``: where each kernel's declaration, parameters and body lie, on a
hand-written source (slices written out by hand) and on every ``cuda_src`` file (bodies
checked against a character-by-character brace scanner written here)."""

from __future__ import annotations

import pytest

from foxhunt.fast._build import source_files
from foxhunt.fast.cuda_parse import SUFFIXES, kernel_spans, parse_kernels, strip_comments

SOURCE = r'''#define N 4
extern "C" __global__ void __launch_bounds__(N, 2) after(float* x,
                                                         int n) { char c = '}'; x[0] = n; }
__device__ float helper(float v) { return v; }
extern "C" __launch_bounds__(64) __global__ void before(int* y) { asm volatile("{ }"); if (y) { y[0] = 1; } }
extern "C" {
__global__ __launch_bounds__(32) void in_block(void) {}
}
extern "C" __global__ void declared_only(float* x);
'''


def test_spans_of_a_hand_written_source():
    spans = {s.name: s for s in kernel_spans(SOURCE)}
    assert list(spans) == ["after", "before", "in_block", "declared_only"]

    def part(span, field):
        a, b = getattr(span, field)
        return SOURCE[a:b]

    after = spans["after"]
    assert SOURCE[after.start:after.name_start] == 'extern "C" __global__ void __launch_bounds__(N, 2) '
    assert SOURCE[after.global_start:].startswith("__global__ void __launch")
    assert part(after, "params") == "(float* x,\n" + " " * 57 + "int n)"
    assert part(after, "body") == "{ char c = '}'; x[0] = n; }"

    before = spans["before"]
    assert SOURCE[before.start:before.name_start] == 'extern "C" __launch_bounds__(64) __global__ void '
    assert part(before, "body") == '{ asm volatile("{ }"); if (y) { y[0] = 1; } }'

    in_block = spans["in_block"]  # in a block: the declaration starts at __global__
    assert in_block.start == in_block.global_start
    assert SOURCE[in_block.start:in_block.name_start] == "__global__ __launch_bounds__(32) void "
    assert part(in_block, "params") == "(void)" and part(in_block, "body") == "{}"

    assert spans["declared_only"].body is None
    assert part(spans["declared_only"], "params") == "(float* x)"


def scan_body_end(text: str, i: int) -> int:
    """The oracle: one past the '}' closing the '{' at ``text[i]``, walking one character (or
    escape) at a time and skipping string and character literals."""
    depth = 0
    while True:
        c = text[i]
        if c in "\"'":
            i += 1
            while text[i] != c:
                i += 2 if text[i] == "\\" else 1
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1


PACKAGE = {n: strip_comments(d.decode()) for n, d in source_files().items() if n.endswith(SUFFIXES)}


@pytest.mark.parametrize("name", sorted(PACKAGE))
def test_spans_of_every_cuda_src_file(name):
    text = PACKAGE[name]
    spans = kernel_spans(text)
    assert [s.name for s in spans] == list(parse_kernels(text, name))
    previous_end = 0
    for span in spans:
        assert previous_end <= span.start <= span.global_start < span.name_start
        assert text.startswith(('extern "C"', "__global__"), span.start)
        assert text.startswith(span.name, span.name_start)
        assert text[span.name_start + len(span.name):span.params[0]].strip() == ""
        assert text[span.params[0]] == "(" and text[span.params[1] - 1] == ")"
        assert span.body is not None, f"{name}: {span.name} has no body"
        assert text[span.params[1]:span.body[0]].strip() == ""
        assert span.body[1] == scan_body_end(text, span.body[0])
        previous_end = span.body[1]
