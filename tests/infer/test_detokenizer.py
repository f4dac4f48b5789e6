"""Incremental detokenization (the engine's and the engine process's front end's) against decoding all at once, for
text whose multi-byte characters arrive split over steps, in batches of any size."""

from __future__ import annotations

import random

import pytest

from mcore_data import ByteTokenizer
from mcore_infer.detokenizer import IncrementalText, text_tokens
from mcore_infer.engine import RequestOutput
from mcore_infer.engine_process._client import EngineClient

TEXT = "héllo wörld ✓ 日本語 — ok 🙂 end"


@pytest.mark.parametrize("seed", range(6))
def test_batches_of_any_size_give_the_whole_text(seed: int) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    rng = random.Random(seed)
    text, pieces, i = IncrementalText(tok.decode), [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        pieces.append(text.add(ids[i : i + n], final=i + n >= len(ids)))
        i += n
    assert "".join(pieces) == text.text == TEXT
    assert all("\ufffd" not in p for p in pieces)  # a split character waits for its last byte


def test_a_broken_character_is_emitted_at_the_end() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("ab") + tok.encode("日")[:2]  # the character's last byte never comes
    text = IncrementalText(tok.decode)
    assert text.add(ids[:2]) == "ab"
    assert text.add(ids[2:3]) == ""  # the window ends in an incomplete character: held
    assert text.add(ids[3:]) == ""
    assert text.add([], final=True) == tok.decode(ids)[2:] and text.text == tok.decode(ids)


def test_text_tokens_drop_a_stop_token_only() -> None:
    assert text_tokens(5, "stop", None) == 4  # EOD
    assert text_tokens(5, "stop", 17) == 4  # a stop token id
    assert text_tokens(5, "stop", "\n\n") == 5  # a stop string: the engine cut the text itself
    assert text_tokens(5, "length", None) == 5
    assert text_tokens(0, "abort", None) == 0


def _delta(ids: list[int], n_out: int, finish: str | None = None, stop: str | int | None = None) -> RequestOutput:
    return RequestOutput("r", ids, "", None, None, finish is not None, finish, stop, 3, n_out)


def test_front_end_fills_merged_batches_and_drops_the_stop_token() -> None:
    """The engine process's front end detokenizes what the caller takes at once: the last output of a batch carries
    the text of all its new tokens, a finished one the whole text, without its stop token."""
    tok = ByteTokenizer()
    ids = tok.encode("dé✓")  # 6 bytes
    text = IncrementalText(tok.decode)
    first = [_delta(ids[:1], 1)]
    EngineClient._fill_text(text, first)
    assert first[0].new_text == "d"
    first += [_delta(ids[1:2], 2)]  # half of "é": held back
    EngineClient._fill_text(text, first[1:])
    assert first[1].new_text == ""
    rest = [_delta(ids[2:4], 4), _delta(ids[4:] + [tok.eod], 7, "stop", None)]
    EngineClient._fill_text(text, rest)
    assert [o.new_text for o in rest] == ["", "é✓"] and rest[-1].text == "dé✓"
    assert "".join(o.new_text for o in first + rest) == "dé✓"


@pytest.mark.parametrize("seed", range(4))
def test_tokens_without_text_are_passed_over_with_one_decode_each(seed: int) -> None:
    """Ids that decode to nothing (special tokens; the byte tokenizer's ids past 255) mixed into the text: the stream
    is still the whole text, and a run of them costs one decode per step (the window's text before them is kept),
    not two."""
    tok = ByteTokenizer()
    rng = random.Random(seed)
    ids: list[int] = []
    for b in tok.encode(TEXT):
        ids += [256 + rng.randrange(3) for _ in range(rng.randrange(3))] + [b]
    ids += [257] * 20
    calls = 0

    def decode(xs: list[int]) -> str:
        nonlocal calls
        calls += 1
        return tok.decode(xs)

    text, pieces, i = IncrementalText(decode), [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        pieces.append(text.add(ids[i : i + n]))
        i += n
    text.add([258])
    before = calls
    for _ in range(10):
        assert text.add([258]) == ""
    assert calls - before == 10
    pieces.append(text.add([], final=True))
    assert "".join(pieces) == text.text == TEXT
