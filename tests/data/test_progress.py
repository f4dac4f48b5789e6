"""Progress of the long steps: log lines with a rate and an ETA when stderr is not a terminal, a bar when it is, and
tokenizer training reporting both its phases (reading the corpus, then the trainer's own work)."""

from __future__ import annotations

import io
import json
import logging
import re
import time
from pathlib import Path

import pytest

from mcore_data._progress import Heartbeat, Progress, format_duration


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_lines_with_rate_and_eta_without_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="mcore_data"):
        p = Progress("reading", 4e6, "B", interval=0.0, stream=io.StringIO())
        p.update(1e6)
        p.update(1e6)
        p.close()
    lines = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(r"reading: 1\.0 MB / 4\.0 MB \(25%\), [\d,.]+ MB/s, ETA \d+(s|m\d\ds)", lines[0]), lines
    assert lines[1].startswith("reading: 2.0 MB / 4.0 MB (50%)")
    assert re.fullmatch(r"reading: 2\.0 MB in \d+s \([\d,.]+ MB/s\)", lines[2]), lines
    assert len(lines) == 3


def test_a_terminal_gets_a_bar_and_no_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    term = _Terminal()
    with caplog.at_level(logging.INFO, logger="mcore_data"):
        p = Progress("reading", 10, "documents", interval=0.0, stream=term)
        for _ in range(10):
            p.update(1)
        p.close()
    assert "reading: 100%" in term.getvalue() and "10/10" in term.getvalue()
    assert not caplog.records


def test_disabled_is_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="mcore_data"):
        p = Progress("reading", 10, "documents", enabled=False, interval=0.0, stream=_Terminal())
        p.update(5)
        p.close()
        with Heartbeat("merging", enabled=False, interval=0.01):
            time.sleep(0.05)
    assert not caplog.records


def test_heartbeat_logs_while_the_step_runs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="mcore_data"), Heartbeat("merging", interval=0.02, stream=io.StringIO()):
        time.sleep(0.2)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "merging ..." and re.fullmatch(r"merging: done in \d+s", lines[-1])
    assert any(line.startswith("merging: still running, ") for line in lines[1:-1])


def test_format_duration() -> None:
    assert [format_duration(s) for s in (3, 187, 7500)] == ["3s", "3m07s", "2h05m"]


def _corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    docs = [f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


@pytest.mark.parametrize("progress", [True, False])
def test_hf_bpe_training_reports_both_phases(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                             progress: bool) -> None:  # fmt: skip
    pytest.importorskip("tokenizers")
    from mcore_data.tokenizer_training import train_hf_bpe

    with caplog.at_level(logging.INFO, logger="mcore_data"):
        train_hf_bpe([_corpus(tmp_path)], tmp_path / "tok", 300, progress=progress)
    text = caplog.text
    size = (tmp_path / "corpus.jsonl").stat().st_size / 1e6
    assert (f"reading the corpus: {size:,.1f} MB in " in text) is progress
    assert ("computing the merges (vocabulary 300): done in " in text) is progress
    assert "trained HF byte-level BPE" in text


def test_sentencepiece_training_reports_both_phases(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("sentencepiece")
    from mcore_data.tokenizer_training import train_sentencepiece

    with caplog.at_level(logging.INFO, logger="mcore_data"):
        train_sentencepiece([_corpus(tmp_path)], tmp_path / "sp", 320, max_docs=200, progress=True)
    assert "reading the corpus: 200 documents in " in caplog.text
    assert "training the SentencePiece bpe model: done in " in caplog.text
