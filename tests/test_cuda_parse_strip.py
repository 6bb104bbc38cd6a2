"""``cuda_parse.strip_comments`` (one regular expression) against a character-by-character
scanner written here as the oracle, on random texts made of the characters that matter."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foxhunt.fast._build import source_files
from foxhunt.fast.cuda_parse import SUFFIXES, CudaParseError, strip_comments


def scan(source: str) -> str:
    """The oracle: walk the text once, one character (or escape) at a time."""
    out, i, n = [], 0, len(source)
    while i < n:
        c, nxt = source[i], source[i + 1:i + 2]
        if c == "/" and nxt == "/":
            j = source.find("\n", i)
            i = n if j < 0 else j
        elif c == "/" and nxt == "*":
            j = source.find("*/", i + 2)
            if j < 0:
                raise CudaParseError("unterminated /* comment")
            out.append("\n" * source.count("\n", i, j + 2) or " ")
            i = j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and source[j] != c:
                j += 2 if source[j] == "\\" else 1
            out.append(source[i:j + 1])
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def outcome(fn, text):
    try:
        return fn(text)
    except CudaParseError as exc:
        return ("error", str(exc))


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet='/*"\'\\\na ', max_size=40))
def test_strip_comments_matches_the_scanner(text):
    assert outcome(strip_comments, text) == outcome(scan, text)


def test_strip_comments_on_the_package_sources():
    sources = {n: d.decode() for n, d in source_files().items() if n.endswith(SUFFIXES)}
    assert sources
    for name, text in sources.items():
        stripped = strip_comments(text)
        assert stripped == scan(text), name
        assert stripped.count("\n") == text.count("\n"), name  # line numbers kept


@pytest.mark.parametrize("text, expected", [
    ("a // c\nb", "a \nb"),
    ("a /* x\ny */ b", "a \n b"),
    ("a /**/ b", "a   b"),
    ('s = "// not /* a comment"; // gone', 's = "// not /* a comment"; '),
    ("c = '\\'' /* x */", "c = '\\''  "),
])
def test_strip_comments_examples(text, expected):
    assert strip_comments(text) == expected


def test_unterminated_block_comment_is_an_error():
    with pytest.raises(CudaParseError, match="unterminated"):
        strip_comments("int a; /* never closed")
