"""How much of a streamed text must wait because it could still become a stop string."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["held_back"]


def held_back(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of one of ``stops``: the characters a stream
    holds until the next token decides (everything before them cannot be part of a stop string)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
