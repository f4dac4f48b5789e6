"""``export_hf``: checkpoints saved under any layout load in ``transformers`` with no custom code, same logits.

Checkpoints are saved by gloo ranks (tp2 x pp2) or a single process from a randomised model; the export is loaded with
``AutoModelForCausalLM.from_pretrained`` and its fp32 logits must equal GPTModel's (1e-5).
"""

from __future__ import annotations

import gc
import json
import logging
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import mcore_export._source as source_module
from mcore_export import MissingTensorError, OutputExistsError, export_hf
from mcore_models import ConversionError, TransformerConfig
from tests.export._helpers import cached_checkpoint, gpt2, llama, logits, reference_model, save

transformers = pytest.importorskip("transformers")

CASES = {
    "llama-gqa-untied": (llama(), 2, 2),
    "llama-mqa-tied": (llama(num_query_groups=1, share_embeddings_and_output_weights=True), 1, 1),
    "llama-mha-tied-tp2pp2": (llama(num_query_groups=4, share_embeddings_and_output_weights=True), 2, 2),
    "gpt2-tp2pp2": (gpt2(), 2, 2),
    "gpt2-exact-gelu": (gpt2(activation="gelu", num_layers=3), 1, 1),
}


def _ids(config: TransformerConfig) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5))


def _hf_logits(out: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_in_transformers_with_same_logits(case: str, ckpt_cache: dict, ckpt_root: Path,
                                                       tmp_path: Path) -> None:  # fmt: skip
    config, tp, pp = CASES[case]
    ckpt = cached_checkpoint(ckpt_cache, ckpt_root, case, config, tp, pp)
    out = export_hf(ckpt, tmp_path / "hf", dtype="fp32")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM" if case.startswith("llama") else "GPT2LMHeadModel"]
    assert cfg["torch_dtype"] == "float32"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == cfg["architectures"][0]
    ids = _ids(config)
    torch.testing.assert_close(_hf_logits(out, ids), logits(reference_model(config), ids), rtol=1e-5, atol=1e-5)


def test_sharded_safetensors_index(ckpt_cache: dict, ckpt_root: Path, tmp_path: Path) -> None:
    config, tp, pp = CASES["llama-gqa-untied"]
    ckpt = cached_checkpoint(ckpt_cache, ckpt_root, "llama-gqa-untied", config, tp, pp)
    limit = 20_000
    out = export_hf(ckpt, tmp_path / "hf", max_shard_size=limit)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert not (out / "model.safetensors").exists()
    assert len(shards) > 2 and shards == sorted(set(index["weight_map"].values()))
    assert all(s == f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i, s in enumerate(shards))
    seen, total = {}, 0
    for s in shards:
        with safe_open(str(out / s), framework="pt") as f:
            sizes = {k: f.get_tensor(k).numel() * 4 for k in f.keys()}  # noqa: SIM118
        assert sum(sizes.values()) <= limit or len(sizes) == 1, s
        seen.update({k: s for k in sizes})
        total += sum(sizes.values())
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == total
    ids = _ids(config)
    torch.testing.assert_close(_hf_logits(out, ids), logits(reference_model(config), ids), rtol=1e-5, atol=1e-5)


def test_bf16_export(ckpt_cache: dict, ckpt_root: Path, tmp_path: Path) -> None:
    config, tp, pp = CASES["gpt2-tp2pp2"]
    ckpt = cached_checkpoint(ckpt_cache, ckpt_root, "gpt2-tp2pp2", config, tp, pp)
    out = export_hf(ckpt, tmp_path / "hf", dtype="bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ref = reference_model(config).global_state_dict()
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
        wte = f.get_tensor("transformer.wte.weight")
    assert torch.equal(wte, ref["embedding.word_embeddings.weight"].to(torch.bfloat16))


@pytest.mark.parametrize("case", ["llama-gqa-untied", "gpt2-tp2pp2"])
def test_streams_one_tensor_at_a_time(case: str, ckpt_cache: dict, ckpt_root: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """When a tensor is read, at most one previously read tensor is still alive (the one being written)."""
    config, tp, pp = CASES[case]
    ckpt = cached_checkpoint(ckpt_cache, ckpt_root, case, config, tp, pp)
    alive: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
    most = []
    real = source_module.read_region

    def tracking(*args: object, **kwargs: object) -> torch.Tensor:
        gc.collect()
        most.append(len(alive))
        t = real(*args, **kwargs)  # type: ignore[arg-type]
        alive.add(t)
        return t

    monkeypatch.setattr(source_module, "read_region", tracking)
    export_hf(ckpt, tmp_path / "hf", max_shard_size=10**9)
    assert len(most) == len([p for p in (ckpt / "model").iterdir() if p.is_dir()])  # each tensor read once
    assert max(most) <= 1


def test_hf_tokenizer_files(ckpt_root: Path, tmp_path: Path) -> None:
    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<pad>"],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    tok.train_from_iterator(["hello world, export me"] * 20 + ["the quick brown fox jumps"] * 20, trainer=trainer)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    config = llama(vocab_size=tok.get_vocab_size())
    spec = {"kind": "hf", "path": str(tok_dir / "tokenizer.json"), "eod_token": "<|endoftext|>"}
    ckpt = save(config, tmp_path / "ckpt", tokenizer=spec)
    out = export_hf(ckpt, tmp_path / "hf")
    assert (out / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    text = "hello quick world"
    assert hf_tok(text)["input_ids"] == fast(text)["input_ids"] == tok.encode(text).ids
    eos = tok.token_to_id("<|endoftext|>")
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == eos
    assert hf_tok.pad_token_id == tok.token_to_id("<pad>")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eos
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == eos
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == eos


def test_no_tokenizer_recorded_writes_no_tokenizer_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = save(gpt2(), tmp_path / "ckpt")  # the byte tokenizer's export: test_byte_tokenizer.py
    with caplog.at_level(logging.WARNING):
        out = export_hf(ckpt, tmp_path / "hf")
    assert "records no tokenizer" in caplog.text
    assert not any(p.name.startswith("tokenizer") for p in out.iterdir())
    assert json.loads((out / "config.json").read_text())["eos_token_id"] is None


def _nothing_written(parent: Path, out: Path) -> None:
    assert not out.exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(".tmp")]


@pytest.mark.parametrize(
    ("config", "feature"),
    [
        (llama(qk_layernorm=True), "qk_layernorm"),
        (llama(add_qkv_bias=True), "add_qkv_bias"),
        (gpt2(num_query_groups=2), "grouped-query attention"),
        (llama(normalization="layernorm"), "no Hugging Face class"),
    ],
    ids=["qk-layernorm", "qkv-bias", "gpt2-gqa", "layernorm-rope"],
)
def test_unrepresentable_architecture_writes_nothing(config: TransformerConfig, feature: str,
                                                     tmp_path: Path) -> None:  # fmt: skip
    ckpt = save(config, tmp_path / "ckpt")
    (tmp_path / "exports").mkdir()
    with pytest.raises(ConversionError, match=feature):
        export_hf(ckpt, tmp_path / "exports" / "hf")
    _nothing_written(tmp_path / "exports", tmp_path / "exports" / "hf")


def test_missing_tensor_writes_nothing(tmp_path: Path) -> None:
    ckpt = save(llama(), tmp_path / "ckpt")
    shutil.rmtree(ckpt / "model" / "decoder.layers.1.mlp.linear_fc2.weight")
    (tmp_path / "exports").mkdir()
    with pytest.raises(MissingTensorError, match="decoder.layers.1.mlp.linear_fc2.weight"):
        export_hf(ckpt, tmp_path / "exports" / "hf")
    _nothing_written(tmp_path / "exports", tmp_path / "exports" / "hf")


def test_non_empty_output_refused_unless_overwrite(ckpt_cache: dict, ckpt_root: Path, tmp_path: Path) -> None:
    config, tp, pp = CASES["llama-mqa-tied"]
    ckpt = cached_checkpoint(ckpt_cache, ckpt_root, "llama-mqa-tied", config, tp, pp)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        export_hf(ckpt, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    export_hf(ckpt, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    export_hf(ckpt, empty)  # an existing empty directory is fine
    assert (empty / "config.json").exists()


def test_sentencepiece_tokenizer_becomes_llama_tokenizer(tmp_path: Path) -> None:
    spm = pytest.importorskip("sentencepiece")
    pytest.importorskip("google.protobuf")  # transformers needs it to read tokenizer.model
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["hello world, a sentencepiece export test"] * 40 + ["more words here"] * 40))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=60,
                                   model_type="bpe", minloglevel=2)  # fmt: skip
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    spec = {"kind": "sentencepiece", "path": str(tmp_path / "sp.model")}
    ckpt = save(llama(vocab_size=sp.get_piece_size()), tmp_path / "ckpt", tokenizer=spec)
    out = export_hf(ckpt, tmp_path / "hf")
    assert (out / "tokenizer.model").read_bytes() == (tmp_path / "sp.model").read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("hello world", add_special_tokens=False)["input_ids"] == sp.encode("hello world")
    assert tok.eos_token_id == sp.eos_id()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == sp.eos_id()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == sp.eos_id()
