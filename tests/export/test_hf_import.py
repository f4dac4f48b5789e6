"""``import_hf``: a ``transformers`` model directory becomes an mcore checkpoint that loads under any layout.

HF models are built from configs (no download) with random weights and saved with ``save_pretrained``; the imported
checkpoint must give the HF model's logits at tp1, tp2 and tp2 x pp2 (gloo ranks), and exporting it again must give
back every tensor bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mcore_export import ExportError, LayoutError, MissingTensorError, export_hf, import_hf
from mcore_models import ConversionError, GPTModel
from mcore_models.checkpoint import load_weights, model_config_from_checkpoint, tokenizer_spec_from_checkpoint
from mcore_parallel.checkpoint import read_array_spec, read_metadata
from mcore_parallel.testing import run_distributed
from tests.export._helpers import load_and_run

transformers = pytest.importorskip("transformers")

LLAMA = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0)  # fmt: skip
GPT2 = dict(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64)


def _hf_model(kind: str, **overrides: object) -> torch.nn.Module:
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, **overrides}))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**GPT2, **overrides}))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.2 if p.dim() == 1 else 0.08)
            if p.dim() == 1 and ("norm" in name or ".ln_" in name) and name.endswith("weight"):
                p.add_(1.0)
    return model.eval()


def _save(model: torch.nn.Module, path: Path, **kw: object) -> Path:
    model.save_pretrained(path, **kw)
    return path


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(3))


def _hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


MODELS = {
    "llama-gqa-untied": ("llama", {}),
    "llama-tied-mha": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "gpt2": ("gpt2", {}),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_import_gives_hf_logits_at_tp1(name: str, tmp_path: Path) -> None:
    kind, overrides = MODELS[name]
    hf = _hf_model(kind, **overrides)
    src = _save(hf, tmp_path / "hf", max_shard_size="20KB")  # sharded, with an index
    assert (src / "model.safetensors.index.json").exists()
    ckpt = import_hf(src, tmp_path / "ckpt", tp=2, pp=2)
    config = model_config_from_checkpoint(ckpt)
    assert config.share_embeddings_and_output_weights == (kind == "gpt2" or bool(overrides.get("tie_word_embeddings")))
    model = GPTModel(config).eval()
    load_weights(model, ckpt)
    ids = _ids(config.vocab_size)
    with torch.no_grad():
        ours = model(ids, gather_logits=True)
    torch.testing.assert_close(ours, _hf_logits(hf, ids), rtol=1e-5, atol=1e-5)
    meta = read_metadata(ckpt)
    assert meta["saved_layout"]["tp"] == 2 and meta["saved_layout"]["pp"] == 2
    # arrays are chunked as a tp=2 run would save them: one chunk per TP piece
    qkv = read_array_spec(ckpt / "model" / "decoder.layers.0.self_attention.linear_qkv.weight")
    assert qkv.chunk_shape[0] * 2 == qkv.shape[0]
    assert read_array_spec(ckpt / "model" / "decoder.layers.0.input_layernorm.weight").chunk_shape == (32,)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (2, 2)])
def test_import_serves_at_tp2_and_tp2pp2(tp: int, pp: int, tmp_path: Path) -> None:
    hf = _hf_model("llama")
    ckpt = import_hf(_save(hf, tmp_path / "hf"), tmp_path / "ckpt")  # saved at tp1: loads at any layout
    ids = _ids(LLAMA["vocab_size"])  # type: ignore[arg-type]
    results = run_distributed(load_and_run, tp * pp, str(ckpt), tp, pp, ids)
    expected = _hf_logits(hf, ids)
    outputs = [r for r in results if r is not None]
    assert len(outputs) == tp
    for out in outputs:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama-gqa-untied", "gpt2"])
def test_round_trip_hf_mcore_hf_is_identical(name: str, tmp_path: Path) -> None:
    kind, overrides = MODELS[name]
    src = _save(_hf_model(kind, **overrides), tmp_path / "hf")
    ckpt = import_hf(src, tmp_path / "ckpt", tp=2)
    back = export_hf(ckpt, tmp_path / "back")
    with (
        safe_open(str(src / "model.safetensors"), framework="pt") as a,
        safe_open(str(back / "model.safetensors"), framework="pt") as b,
    ):
        original = {k: a.get_tensor(k) for k in a.keys()}  # noqa: SIM118
        exported = {k: b.get_tensor(k) for k in b.keys()}  # noqa: SIM118
    original = {k: v for k, v in original.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    if kind == "gpt2":
        original.pop("lm_head.weight", None)  # tied: transformers may or may not store it
    assert set(exported) == set(original)
    for k, v in original.items():
        assert torch.equal(exported[k], v), k
    a_cfg = json.loads((src / "config.json").read_text())
    b_cfg = json.loads((back / "config.json").read_text())
    for field in ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads",
                  "intermediate_size", "rope_theta", "rms_norm_eps", "n_embd", "n_layer", "n_head"):  # fmt: skip
        if field in a_cfg and field in b_cfg:
            assert a_cfg[field] == b_cfg[field], field


def test_tokenizer_files_are_copied_and_recorded(tmp_path: Path) -> None:
    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tk.trainers.BpeTrainer(vocab_size=280, special_tokens=["<|endoftext|>"], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(["import me please"] * 10, trainer=trainer)
    src = _save(_hf_model("gpt2", vocab_size=tok.get_vocab_size()), tmp_path / "hf")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(src)
    ckpt = import_hf(src, tmp_path / "ckpt")
    spec = tokenizer_spec_from_checkpoint(ckpt)
    assert spec is not None and spec["kind"] == "hf" and spec["eod_token"] == "<|endoftext|>"
    assert Path(spec["path"]) == ckpt / "tokenizer" / "tokenizer.json"
    assert read_metadata(ckpt)["tokenizer"]["path"] == "tokenizer/tokenizer.json"
    assert tk.Tokenizer.from_file(spec["path"]).encode("import me").ids == tok.encode("import me").ids
    assert (ckpt / "tokenizer" / "tokenizer_config.json").exists()


def test_unknown_architecture_writes_nothing(tmp_path: Path) -> None:
    src = _save(_hf_model("gpt2"), tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(architectures=["BertForMaskedLM"], model_type="bert")
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match="BertForMaskedLM"):
        import_hf(src, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_unsupported_feature_is_named(tmp_path: Path) -> None:
    src = _save(_hf_model("llama", mlp_bias=True), tmp_path / "hf")
    with pytest.raises(ConversionError, match="mlp_bias"):
        import_hf(src, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_missing_tensor_writes_nothing(tmp_path: Path) -> None:
    src = _save(_hf_model("llama"), tmp_path / "hf")
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.1.mlp.up_proj.weight"}  # noqa: SIM118
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        import_hf(src, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    assert not list(tmp_path.glob(".tmp*"))


def test_bad_inputs(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="config.json"):
        import_hf(tmp_path / "empty", tmp_path / "ckpt")
    src = _save(_hf_model("llama"), tmp_path / "hf")
    with pytest.raises(LayoutError, match="tp=3"):
        import_hf(src, tmp_path / "ckpt", tp=3)
    with pytest.raises(LayoutError, match="pp=8"):
        import_hf(src, tmp_path / "ckpt", pp=8)
    assert not (tmp_path / "ckpt").exists()
