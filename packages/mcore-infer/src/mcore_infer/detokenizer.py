"""Incremental detokenization: the text of a growing list of token ids, a few tokens at a time.

One rule for the engine (which needs a request's text to find its stop strings) and the engine process's front end
(which turns the engine's token ids into text itself, so the engine's loop does not): decode the window of tokens
from a little before the last emitted text and emit what it added, unless it ends in a replacement character (a
multi-byte character whose bytes have not all arrived yet; it is emitted once they have, or at the end).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["IncrementalText", "detokenize_step", "text_tokens"]


def detokenize_step(
    decode: Callable[[Sequence[int]], str], ids: Sequence[int], prefix: int, read: int, final: bool
) -> tuple[str, int, int]:
    """The text ``ids[read:]`` adds to the text of ``ids[:read]``, and the new ``(prefix, read)`` offsets; ``final``
    emits a trailing incomplete character too. Nothing is emitted (and the offsets stay) while the window ends in an
    incomplete character; new ids that add no text at all (tokens without text of their own, with no character
    pending) are passed over (``read`` moves past them)."""
    return _step(decode, ids, prefix, read, final, None)[:3]


def _step(
    decode: Callable[[Sequence[int]], str], ids: Sequence[int], prefix: int, read: int, final: bool, before: str | None
) -> tuple[str, int, int, str | None]:
    """:func:`detokenize_step` given ``before`` (the text of ``ids[prefix:read]``, None: not known), and that text
    for the new offsets when this step knows it (it does when the ids added nothing)."""
    if read >= len(ids):
        return "", prefix, read, before
    if before is None:
        before = decode(ids[prefix:read])
    after = decode(ids[prefix:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before) :], max(read - 4, 0), len(ids), None
    if final:
        return after[len(before) :], prefix, len(ids), None
    if after == before:  # nothing pending and nothing new: the next window's text is this one's
        return "", prefix, len(ids), after
    return "", prefix, read, before


def text_tokens(n_tokens: int, finish_reason: str | None, stop_reason: str | int | None) -> int:
    """How many of a request's ``n_tokens`` output tokens are text: all but the last when it ended on EOD or a stop
    token (``finish_reason == "stop"`` without a stop string)."""
    if finish_reason == "stop" and not isinstance(stop_reason, str):
        return max(n_tokens - 1, 0)
    return n_tokens


class IncrementalText:
    """A request's text as its token ids arrive: :meth:`add` returns the text the new ids add."""

    __slots__ = ("before", "decode", "ids", "prefix", "read", "text")

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""
        self.before: str | None = ""  # the text of ids[prefix:read], when known

    def add(self, new_ids: Sequence[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        new, self.prefix, self.read, self.before = _step(self.decode, self.ids, self.prefix, self.read, final,
                                                         self.before)  # fmt: skip
        self.text += new
        return new
