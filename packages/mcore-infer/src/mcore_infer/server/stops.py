"""Stop strings of streamed requests, applied by the server: text is sent as soon as it cannot be the start of a
stop string, i.e. only the longest end of the text that is a prefix of some stop string waits for the next token.

The engine would hold back ``len(longest stop string) - 1`` characters of every stream (7 for the chat template's
``<|user|>``), so a streamed request with stop strings goes to the engine without them, the server finds them here,
ends the choice at the first one (``finish_reason: "stop"``, ``stop_reason`` the string) and closes the engine's
stream, which aborts the request and frees its blocks. The result is the same text the engine would have produced:
the earliest occurrence of any stop string ends it, and the tokens after the one that completed it are dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from mcore_infer.async_engine import AsyncEngine
from mcore_infer.engine import RequestOutput
from mcore_infer.sampling import SamplingParams

__all__ = ["StopFilter", "held_back", "stream_with_stops"]


def held_back(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of one of ``stops`` (what must wait)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopFilter:
    """Turns one request's streamed outputs (generated without stop strings) into what they would be with them."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops, self.held = list(stops), ""

    def _first_hit(self, text: str) -> tuple[int, str] | None:
        hit: tuple[int, str] | None = None
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, s)
        return hit

    def apply(self, out: RequestOutput) -> RequestOutput:
        """``out`` with the text that is safe to send; finished at the first stop string."""
        text = self.held + out.new_text
        hit = self._first_hit(text)
        if hit is not None:
            self.held = ""
            return replace(out, new_text=text[: hit[0]], finished=True, finish_reason="stop", stop_reason=hit[1])
        keep = 0 if out.finished else held_back(text, self.stops)
        self.held = text[len(text) - keep :]
        return replace(out, new_text=text[: len(text) - keep])


async def stream_with_stops(
    engine: AsyncEngine, ids: list[int], params: SamplingParams
) -> AsyncIterator[list[RequestOutput]]:
    """``engine.generate_batches(ids, params, stream=True)``, with ``params.stop`` applied by a :class:`StopFilter`."""
    if not params.stop:
        async for outs in engine.generate_batches(ids, params, stream=True):
            yield outs
        return
    stops = StopFilter(params.stop)
    inner = engine.generate_batches(ids, replace(params, stop=[]), stream=True)
    async with contextlib.aclosing(inner):  # leaving early (a stop string) aborts the request at once
        async for outs in inner:
            kept = []
            for o in outs:
                kept.append(stops.apply(o))
                if kept[-1].finished:
                    break
            yield kept
            if kept[-1].finished:
                return
