"""Raw input chunking: every line once, in order, with its line number; chunks shrink at the tail when asked."""

from __future__ import annotations

from pathlib import Path

from mcore_data.inputs import iter_chunks


def _lines(tmp_path: Path, n: int) -> Path:
    p = tmp_path / "in.jsonl"
    p.write_bytes(b"".join(b'{"text": "%s"}\n' % (b"x" * (1000 + i % 7)) for i in range(n)))
    return p


def test_chunks_cover_every_line_in_order(tmp_path: Path) -> None:
    src = _lines(tmp_path, 3000)
    for tail_parts in (0, 8):
        chunks = list(iter_chunks([src], chunk_bytes=1 << 18, tail_parts=tail_parts))
        assert b"".join(u for c in chunks for u in c.units) == src.read_bytes()
        line = 1
        for c in chunks:
            assert c.first_line == line and c.nbytes == sum(map(len, c.units))
            line += len(c.units)


def test_tail_chunks_shrink(tmp_path: Path) -> None:
    src = _lines(tmp_path, 3000)  # ~3 MB
    plain = [c.nbytes for c in iter_chunks([src], chunk_bytes=1 << 18)]
    tail = [c.nbytes for c in iter_chunks([src], chunk_bytes=1 << 18, tail_parts=8)]
    assert max(plain[:-1]) < (1 << 18) + 2000 and min(plain[:-1]) >= 1 << 18  # fixed size without tail_parts
    assert tail[0] >= 1 << 18  # full size while much input is left
    assert max(tail[-4:]) < 1 << 17 and min(tail[:-1]) >= 1 << 16  # small at the end, never below 64 KiB
