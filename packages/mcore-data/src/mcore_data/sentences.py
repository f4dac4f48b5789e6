"""Sentence splitting for ``preprocess --split-sentences``: NLTK's punkt when it is installed, else a regex splitter.

The regex splitter ends a sentence after ``.``, ``!`` or ``?`` (possibly repeated, possibly followed by closing
quotes or brackets) when whitespace follows and then anything but an ASCII lowercase letter. It knows no abbreviations, so
``Dr. Smith`` is two sentences; install ``nltk`` (with its ``punkt`` data) for better splits. Like punkt, the
whitespace between sentences is dropped unless ``keep_newlines`` asks to keep it with the sentence before.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache

__all__ = ["regex_split", "sentence_splitter"]

_BOUNDARY = re.compile(r"([.!?]+[\"'\u201d\u2019)\]]*)(\s+)(?=[^\s\w]|[^\W\d_a-z]|\d)")


def regex_split(text: str, keep_newlines: bool = False) -> list[str]:
    """``text`` cut into sentences by the documented regex; empty pieces are dropped."""
    out: list[str] = []
    start = 0
    for m in _BOUNDARY.finditer(text):
        end = m.end() if keep_newlines else m.end(1)
        out.append(text[start:end])
        start = m.end()
    out.append(text[start:] if keep_newlines else text[start:].rstrip())
    return [s for s in out if s.strip()]


@lru_cache(maxsize=4)
def sentence_splitter(lang: str = "english", keep_newlines: bool = False) -> Callable[[str], list[str]]:
    """A splitter: NLTK punkt for ``lang`` if ``nltk`` and its data are installed, else :func:`regex_split`."""
    try:
        import nltk  # type: ignore[import-not-found,unused-ignore]

        punkt = nltk.data.load(f"tokenizers/punkt/{lang}.pickle")
    except (ImportError, LookupError, OSError):
        return lambda text: regex_split(text, keep_newlines)
    if keep_newlines:
        spans = punkt.span_tokenize
        return lambda text: [text[a:b] + _gap(text, b) for a, b in spans(text)]
    return lambda text: [s for s in punkt.tokenize(text) if s.strip()]


def _gap(text: str, end: int) -> str:
    """The whitespace after position ``end`` (kept with the sentence before it)."""
    m = re.match(r"\s*", text[end:])
    return m.group(0) if m else ""
