"""The mcore-data CLI end to end on the demo corpus (standard library sources) with every tokenizer."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mcore_data import IndexedDataset, build_tokenizer
from mcore_data.cli import main


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("corpus") / "demo.jsonl"
    assert main(["demo-corpus", "--out", str(out), "--max-files", "60"]) == 0
    return out


@pytest.fixture(scope="module")
def models(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("tok")
    assert (
        main(
            [
                "train-tokenizer",
                "--input",
                str(corpus),
                "--type",
                "sentencepiece-bpe",
                "--vocab-size",
                "400",
                "--output",
                str(d / "sp"),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "train-tokenizer",
                "--input",
                str(corpus),
                "--type",
                "hf-bpe",
                "--vocab-size",
                "400",
                "--output",
                str(d / "hf" / "tokenizer.json"),
            ]
        )
        == 0
    )
    return {"byte": "", "sentencepiece": str(d / "sp.model"), "hf": str(d / "hf" / "tokenizer.json")}


def _preprocess(corpus: Path | str, out: Path, kind: str, model: str, *extra: str) -> int:
    args = [
        "preprocess",
        "--input",
        str(corpus),
        "--output-prefix",
        str(out),
        "--tokenizer-type",
        kind,
        "--no-progress",
        *extra,
    ]
    if model:
        args += ["--tokenizer-model", model]
    return main(args)


@pytest.mark.parametrize("kind", ["byte", "sentencepiece", "hf"])
def test_preprocess_each_tokenizer_1_vs_2_workers(
    corpus: Path, models: dict[str, str], tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = models[kind]
    assert _preprocess(corpus, tmp_path / "w1", kind, model, "--workers", "1", "--main-process", "reader") == 0
    assert _preprocess(corpus, tmp_path / "w2", kind, model, "--workers", "2", "--main-process", "tokenizer") == 0
    # one process in all: the main process tokenizes everything itself (what auto picks on a one-core machine)
    assert _preprocess(corpus, tmp_path / "w0", kind, model, "--workers", "1", "--main-process", "tokenizer") == 0
    for suffix in (".bin", ".idx"):  # the output depends neither on the worker count nor on the main process's role
        assert (tmp_path / f"w1{suffix}").read_bytes() == (tmp_path / f"w2{suffix}").read_bytes()
        assert (tmp_path / f"w1{suffix}").read_bytes() == (tmp_path / f"w0{suffix}").read_bytes()
    out = capsys.readouterr().out
    assert "documents 60" in out and "MB/s" in out
    ds = IndexedDataset(tmp_path / "w1")
    tok = build_tokenizer(kind, model or None)
    assert ds.num_documents == 60 and ds.dtype == np.uint16
    first = json.loads(corpus.read_text().splitlines()[0])["text"]
    doc = ds.document(0)
    assert int(doc[-1]) == tok.eod  # EOD appended
    assert doc[:-1].tolist() == tok.encode(first)
    if kind != "sentencepiece":  # sentencepiece normalises whitespace
        assert tok.decode(doc[:-1]) == first
    # inspect decodes a document and a sample
    assert (
        main(
            [
                "inspect",
                str(tmp_path / "w1"),
                "--tokenizer-type",
                kind,
                *(["--tokenizer-model", model] if model else []),
                "--document",
                "0",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip()[:20] == tok.decode(doc[:-1]).strip()[:20]


@pytest.mark.parametrize("main_process", ["reader", "tokenizer"])
def test_malformed_lines_stop_or_are_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], main_process: str
) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "a"}\n{"text": "b"\n\n{"body": "c"}\n{"text": 3}\n{"text": "d"}\n')
    opts = ("--main-process", main_process, "--workers", "2")
    assert _preprocess(src, tmp_path / "o", "byte", "", *opts) == 2
    err = capsys.readouterr().err
    assert f"{src}:2:" in err and "--skip-malformed" in err
    assert not (tmp_path / "o.idx").exists() and not (tmp_path / "o.bin").exists()
    assert _preprocess(src, tmp_path / "o", "byte", "", "--skip-malformed", *opts) == 0
    out = capsys.readouterr().out
    assert "skipped (malformed) 3" in out and "documents 2" in out and "blank 1" in out
    ds = IndexedDataset(tmp_path / "o")
    assert [ds[0].tolist(), ds[1].tolist()] == [[97, 256], [100, 256]]


def test_text_dirs_gz_and_json_key(tmp_path: Path) -> None:
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("first file\nline two\n")
    with gzip.open(d / "sub" / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"content": "gz doc"}) + "\n")
    assert _preprocess(d, tmp_path / "o", "byte", "", "--json-key", "content") == 0
    ds = IndexedDataset(tmp_path / "o")
    assert bytes(ds[0][:-1].astype(np.uint8)).decode() == "first file\nline two\n"
    assert bytes(ds[1][:-1].astype(np.uint8)).decode() == "gz doc"
    assert _preprocess(d / "a.txt", tmp_path / "l", "byte", "", "--text-unit", "line") == 0
    assert IndexedDataset(tmp_path / "l").num_documents == 2


def test_refuses_overwrite_and_merge(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _preprocess(corpus, tmp_path / "a", "byte", "") == 0
    before = (tmp_path / "a.bin").stat().st_mtime_ns
    assert _preprocess(corpus, tmp_path / "a", "byte", "") == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "a.bin").stat().st_mtime_ns == before
    assert _preprocess(corpus, tmp_path / "a", "byte", "", "--overwrite") == 0
    shutil.copy(tmp_path / "a.bin", tmp_path / "b.bin")
    shutil.copy(tmp_path / "a.idx", tmp_path / "b.idx")
    assert (
        main(["merge", "--input", str(tmp_path / "a"), str(tmp_path / "b"), "--output-prefix", str(tmp_path / "m")])
        == 0
    )
    m, a = IndexedDataset(tmp_path / "m"), IndexedDataset(tmp_path / "a")
    assert m.num_documents == 2 * a.num_documents and np.array_equal(m.document(a.num_documents), a.document(0))


def test_build_index_then_inspect(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _preprocess(corpus, tmp_path / "a", "byte", "") == 0
    assert (
        main(
            [
                "build-index",
                "--data-prefix",
                str(tmp_path / "a"),
                "--seq-length",
                "256",
                "--split",
                "90,10,0",
                "--train-samples",
                "20000",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    train = int(out.split("train: ")[1].split()[0].replace(",", ""))
    assert 20000 <= train < 20000 + 8678 and "test: empty" in out
    assert len(list((tmp_path / "cache" / "GPTDataset_indices").glob("*.npy"))) == 6
    assert main(["inspect", str(tmp_path / "a"), "--json", "--validate"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["documents"] == 60 and stats["dtype"] == "uint16"
    assert main(["inspect", str(tmp_path / "a"), "--sample", "3", "--seq-length", "256", "--split", "90,10,0"]) == 0
    assert len(capsys.readouterr().out.split()) == 257


def test_console_script_starts_fast_without_torch(corpus: Path, tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "mcore-data"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mcore_data.cli"]
    r = subprocess.run(
        [*cmd, "preprocess", "--input", str(corpus), "--output-prefix", str(tmp_path / "x"), "--workers", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "docs/s" in r.stderr and "documents 60" in r.stdout


@pytest.mark.parametrize("kind", ["byte", "sentencepiece", "hf"])
def test_batch_encoding_equals_one_text_at_a_time(corpus: Path, models: dict[str, str], kind: str) -> None:
    """encode_batch (the preprocess path, e.g. HF's offset-free batch API) gives exactly the ids of encode."""
    tok = build_tokenizer(kind, models[kind] or None)
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()[:20]] + ["", " ", "é\n\tx"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_tokenizer_role_leaves_the_calling_process_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The main process tokenizes in the tokenizer role; afterwards its environment and globals are restored."""
    from mcore_data import preprocess as pp

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "abc"}\n{"text": "de"}\n')
    assert _preprocess(src, tmp_path / "o", "byte", "", "--main-process", "tokenizer") == 0
    assert "TOKENIZERS_PARALLELISM" not in os.environ and pp._TOKENIZER is None
    assert IndexedDataset(tmp_path / "o").num_documents == 2
