"""Megatron-LM ``tools/preprocess_data.py`` compatibility: sentence lists, --split-sentences, flag spellings, naming."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mcore_data import IndexedDataset
from mcore_data._megatron_args import MEGATRON_TOKENIZERS, resolve_tokenizer
from mcore_data.cli import main
from mcore_data.sentences import regex_split

EOD = 256  # the byte tokenizer's


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(*argv: str) -> int:
    return main(["preprocess", "--no-progress", *argv])


def _seqs(prefix: Path) -> tuple[list[list[int]], list[int]]:
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds.document_indices.tolist()


def test_list_text_is_a_document_of_sentences(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "s.jsonl", [{"text": ["Hi.", "", "Yo"]}, {"text": "ab"}])
    assert _run("--input", str(src), "--output-prefix", str(tmp_path / "o"), "--json-keys", "text", "--append-eod") == 0
    seqs, docs = _seqs(tmp_path / "o_text_document")
    assert seqs == [[72, 105, 46], [89, 111, EOD], [97, 98, EOD]]  # the empty sentence has no sequence
    assert docs == [0, 2, 3]


def test_megatron_spellings_mean_no_eod_unless_append_eod(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "s.jsonl", [{"text": ["a", "b"]}, {"text": "c"}])
    assert _run("--input", str(src), "--output-prefix", str(tmp_path / "o"), "--json-keys", "text") == 0
    assert _seqs(tmp_path / "o_text_document") == ([[97], [98], [99]], [0, 2, 3])


def test_our_spelling_keeps_our_defaults(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "s.jsonl", [{"text": ["a", "b"]}])
    assert _run("--input", str(src), "--output-prefix", str(tmp_path / "o")) == 0
    assert _seqs(tmp_path / "o") == ([[97], [98, EOD]], [0, 2])
    assert _run("--input", str(src), "--output-prefix", str(tmp_path / "m"), "--megatron-naming") == 0
    assert _seqs(tmp_path / "m_text_document") == ([[97], [98]], [0, 2])


@pytest.mark.parametrize("workers", ["1", "2"])
def test_split_sentences_names_sentence_outputs(tmp_path: Path, workers: str) -> None:
    src = _jsonl(tmp_path / "s.jsonl", [{"text": "One. Two! Three"}, {"text": "Four."}])
    out = tmp_path / "o"
    argv = ["--input", str(src), "--output-prefix", str(out), "--split-sentences", "--append-eod", "--workers", workers]
    assert _run(*argv) == 0
    seqs, docs = _seqs(tmp_path / "o_text_sentence")
    assert [bytes(s[:-1] if s[-1] == EOD else s).decode() for s in seqs] == ["One.", "Two!", "Three", "Four."]
    assert [s[-1] == EOD for s in seqs] == [False, False, True, True] and docs == [0, 3, 4]


def test_several_json_keys_give_one_pair_each(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "s.jsonl", [{"text": "ab", "title": "T"}])
    assert _run("--input", str(src), "--output-prefix", str(tmp_path / "o"), "--json-keys", "text", "title") == 0
    assert _seqs(tmp_path / "o_text_document")[0] == [[97, 98]]
    assert _seqs(tmp_path / "o_title_document")[0] == [[84]]


def _gpt2_files(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny GPT-2 style vocab.json/merges.txt: the 256 byte symbols, two merges and <|endoftext|>."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["he"] = len(vocab)
    vocab["ll"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    v, m = tmp_path / "vocab.json", tmp_path / "merges.txt"
    v.write_text(json.dumps(vocab))
    m.write_text("#version: 0.2\nh e\nl l\n")
    return v, m


def test_a_megatron_command_line_runs_with_only_the_command_changed(tmp_path: Path) -> None:
    v, m = _gpt2_files(tmp_path)
    src = _jsonl(tmp_path / "corpus.json", [{"text": "hello"}, {"text": "hell"}])
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "my-gpt2"), "--vocab-file", str(v),
            "--merge-file", str(m), "--dataset-impl", "mmap", "--tokenizer-type", "GPT2BPETokenizer",
            "--append-eod", "--workers", "2", "--partitions", "1", "--log-interval", "1000"]  # fmt: skip
    assert _run(*argv) == 0
    vocab = json.loads(v.read_text())
    seqs, docs = _seqs(tmp_path / "my-gpt2_text_document")
    he, ll, o, eod = vocab["he"], vocab["ll"], vocab["o"], vocab["<|endoftext|>"]
    assert seqs == [[he, ll, o, eod], [he, ll, eod]] and docs == [0, 1, 2]


def _ns(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {"tokenizer_model": "m", "vocab_file": None, "merge_file": None}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize(
    ("megatron", "ours"),
    [
        ("GPTSentencePieceTokenizer", "sentencepiece"),
        ("SentencePieceTokenizer", "sentencepiece"),
        ("Llama2Tokenizer", "sentencepiece"),
        ("HuggingFaceTokenizer", "hf"),
    ],
)
def test_megatron_tokenizer_types_map_to_ours(megatron: str, ours: str) -> None:
    assert resolve_tokenizer(_ns(tokenizer_type=megatron)) == (ours, "m", None)


@pytest.mark.parametrize("name", [k for k, v in MEGATRON_TOKENIZERS.items() if v is None])
def test_unavailable_megatron_tokenizer_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    src = _jsonl(tmp_path / "s.jsonl", [{"text": "a"}])
    assert _run("--input", str(src), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", name) == 2
    assert f"--tokenizer-type {name} is not available" in capsys.readouterr().err


def test_gpt2_without_vocab_files_and_contradicting_eod_flags_exit_2(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "s.jsonl", [{"text": "a"}])
    out = str(tmp_path / "o")
    assert _run("--input", str(src), "--output-prefix", out, "--tokenizer-type", "GPT2BPETokenizer") == 2
    assert _run("--input", str(src), "--output-prefix", out, "--append-eod", "--no-append-eod") == 2


@pytest.mark.parametrize(
    ("text", "sentences"),
    [
        ("One. Two! Three? Four", ["One.", "Two!", "Three?", "Four"]),
        ('He said "Stop." Then left.', ['He said "Stop."', "Then left."]),
        ("Pi is 3.14 today. ok then.", ["Pi is 3.14 today. ok then."]),
        ("Wait... What?!  Yes.\n\nNext para.", ["Wait...", "What?!", "Yes.", "Next para."]),
        ("   ", []),
    ],
)
def test_regex_splitter(text: str, sentences: list[str]) -> None:
    assert regex_split(text) == sentences


def test_regex_splitter_keep_newlines_keeps_every_character() -> None:
    text = "One.\nTwo.  Three."
    parts = regex_split(text, keep_newlines=True)
    assert parts == ["One.\n", "Two.  ", "Three."] and "".join(parts) == text
