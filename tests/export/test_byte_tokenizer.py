"""The byte tokenizer's Hugging Face form: a checkpoint trained on mcore's byte tokenizer exports a ``tokenizer.json``
that ``AutoTokenizer`` loads from the directory and that encodes and decodes text as mcore does (ASCII, multi-byte
UTF-8, invalid bytes, text spelling a special token), and a ``config.json`` whose ``eos_token_id`` is EOD, so Hugging
Face greedy ``generate`` stops on the very token where mcore's generation stops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mcore_export import export_hf
from mcore_models import GPTModel, TransformerConfig
from mcore_models.checkpoint import save_weights
from mcore_parallel import ParallelConfig, ParallelState
from tests.export._helpers import llama, randomize

transformers = pytest.importorskip("transformers")

EOD = 256
TEXTS = [
    "def add(a, b):\n\treturn a + b  # ASCII\n",
    "déjà vu — naïve café, 日本語, emoji 🎉 and a tab\t",
    "text that spells <|endoftext|> or <pad> or <s> stays bytes",
    "  leading and trailing spaces  ",
    "",
]


def _config() -> TransformerConfig:
    return llama(vocab_size=259)  # the byte tokenizer's 256 bytes, EOD, PAD and BOS


def _model(config: TransformerConfig, scale: float | None = None, like: int | None = None) -> GPTModel:
    """The randomised model; with ``scale``, the output row of EOD is ``scale`` times the row of token ``like``, so
    greedy decoding emits EOD where it would otherwise emit ``like`` (and wherever EOD wins anyway)."""
    model = randomize(GPTModel(config)).eval()
    if scale is not None and like is not None:
        with torch.no_grad():
            w = model.output_layer.weight
            w[EOD] = scale * w[like]
    return model


def _save_rank(config: TransformerConfig, root: str, scale: float | None, like: int | None) -> None:
    state = ParallelState.initialize(ParallelConfig())
    meta = {"tokenizer": {"kind": "byte", "path": None}}
    save_weights(_model(config, scale, like), state, root, metadata=meta)


def _mcore_greedy(model: GPTModel, prompt: list[int], max_new: int) -> list[int]:
    """mcore's generation rule (mcore_train.generate / mcore-infer): greedy, ending after the EOD token."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids]), gather_logits=True)
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            if nxt == EOD:
                break
            ids.append(nxt)
    return out


def _export(tmp_path: Path, scale: float | None = None, like: int | None = None) -> Path:
    from mcore_parallel.testing import run_distributed

    run_distributed(_save_rank, 1, _config(), str(tmp_path / "ckpt"), scale, like)
    return export_hf(tmp_path / "ckpt" / "step_0000000", tmp_path / "hf")


def test_autotokenizer_round_trips_like_mcore(tmp_path: Path) -> None:
    out = _export(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (256, 257, 258) and len(tok) == 259
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == EOD
    assert config["pad_token_id"] == 257 and config["bos_token_id"] == 258
    try:
        from mcore_data.tokenizer import ByteTokenizer
    except ImportError:  # the export package's own test session has no mcore-data: the byte rule stands in for it
        ByteTokenizer = None
    for text in TEXTS:
        ids = tok(text)["input_ids"]  # add_special_tokens as transformers defaults: still no BOS/EOS added
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
        assert tok.decode([*ids, EOD], skip_special_tokens=True) == text
        if ByteTokenizer is not None:
            assert ids == ByteTokenizer().encode(text)
            assert tok.decode([*ids, EOD, 257], skip_special_tokens=True) == ByteTokenizer().decode([*ids, EOD, 257])
    broken = [0xE6, 0x97, 65, 0xFF, 66, 0xF0, 0x9F]  # a cut multi-byte character, an invalid byte, a cut emoji
    assert tok.decode(broken) == bytes(broken).decode("utf-8", errors="replace")
    if ByteTokenizer is not None:
        assert tok.decode(broken) == ByteTokenizer().decode(broken)


def test_hf_generate_stops_at_eod_where_mcore_stops(tmp_path: Path) -> None:
    config = _config()
    prompt = list(b"def f(x):\n    return")
    plain = _mcore_greedy(_model(config), prompt, 12)
    assert EOD not in plain
    like = plain[4]  # EOD takes this token's place: mcore stops at the fifth new token
    expected = _mcore_greedy(_model(config, 1.05, like), prompt, 12)
    assert expected == [*plain[:4], EOD]

    out = _export(tmp_path, 1.05, like)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tok(bytes(prompt).decode(), return_tensors="pt").input_ids
    assert ids[0].tolist() == prompt
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    new = gen[0, len(prompt) :].tolist()
    assert new == expected  # the same tokens, ending with EOD: generate stopped there (12 were allowed)
    assert tok.decode(new, skip_special_tokens=True) == bytes(expected[:-1]).decode(errors="replace")


def test_import_of_the_export_records_the_byte_tokenizer(tmp_path: Path) -> None:
    from mcore_export import import_hf
    from mcore_parallel.checkpoint import read_metadata

    out = _export(tmp_path)
    ckpt = import_hf(out, tmp_path / "back")
    assert read_metadata(ckpt)["tokenizer"] == {"kind": "byte", "path": None}
    assert (
        export_hf(ckpt, tmp_path / "again").joinpath("tokenizer.json").read_bytes()
        == (out / "tokenizer.json").read_bytes()
    )
