"""``mcore-export hf`` / ``import-hf`` for LLaVA: a LlavaModel checkpoint becomes a ``LlavaForConditionalGeneration``
directory transformers loads (no missing or unexpected keys, the same logits for a batch with images, the tokenizer
with its image token), and a LLaVA directory (ours, or one ``save_pretrained`` wrote) becomes a LlavaModel
checkpoint; bad inputs exit 2 with one line naming the file or field, and write nothing."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_export.cli import main
from mcore_models.multimodal import LlavaConfig, LlavaModel, llava_preset
from mcore_models.multimodal.checkpoint import llava_config_from_checkpoint, load_llava_weights, save_llava_weights
from mcore_models.vision import vision_preset
from mcore_parallel import ParallelConfig, ParallelState

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def _tokenizer(tmp: Path) -> dict[str, Any]:
    """A trained byte-level BPE with an ``<image>`` special token; its checkpoint description."""
    tk = tokenizers
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<pad>", "<image>"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["a photo of a cat on a mat"] * 20 + ["describe the image please"] * 20, trainer=trainer)
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    return {"kind": "hf", "path": str(tmp / "tokenizer.json"), "eod_token": "<|endoftext|>", "vocab": tok}


def _randomized(model: LlavaModel) -> LlavaModel:
    """Every parameter drawn from a seed of its name (norms around 1), so no tensor is trivial."""
    for info in model.sharded_state_dict().values():
        g = torch.Generator().manual_seed(zlib.crc32(info.key.encode()))
        t = torch.randn(info.global_shape, generator=g) * (0.2 if len(info.global_shape) == 1 else 0.08)
        if len(info.global_shape) == 1 and "norm" in info.key and info.key.endswith("weight"):
            t += 1.0
        info.load_from(t.to(info.local.dtype))
    return model.eval()


def _checkpoint(root: Path, config: LlavaConfig, tokenizer: dict[str, Any] | None = None) -> LlavaModel:
    model = _randomized(LlavaModel(config))
    meta = {"tokenizer": {k: v for k, v in tokenizer.items() if k != "vocab"}} if tokenizer else None
    save_llava_weights(model, ParallelState.initialize(ParallelConfig()), root, metadata=meta)
    return model


def _batch(config: LlavaConfig, low: int, high: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Text ids in [low, high); one image in row 0, two in row 1 (``image_tokens`` image tokens each, as LLaVA's
    processor expands them)."""
    g = torch.Generator().manual_seed(11)
    n = config.image_tokens
    ids = torch.randint(low, high, (2, 2 * n + 10), generator=g)
    ids[0, 4 : 4 + n] = config.image_token_id
    ids[1, 1 : 1 + n] = config.image_token_id
    ids[1, 3 + n : 3 + 2 * n] = config.image_token_id
    v = config.vision
    return ids, torch.randn(3, v.num_channels, v.image_size, v.image_size, generator=g)


def _logits(model: torch.nn.Module, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(model, LlavaModel):
            return model(ids, pixels, gather_logits=True)
        return model(input_ids=ids, pixel_values=pixels).logits


def _config(tok: dict[str, Any], language: dict[str, Any] | None = None, **overrides: Any) -> LlavaConfig:
    """llava-tiny with the tokenizer's vocabulary and ``<image>`` as the image token."""
    vocab = tok["vocab"]
    return llava_preset(
        "llava-tiny",
        image_token_id=vocab.token_to_id("<image>"),
        language={"vocab_size": vocab.get_vocab_size(), **(language or {})},
        **overrides,
    )


@pytest.mark.parametrize("tower", ["clip", "siglip-tied"])
def test_cli_round_trip_loads_in_transformers(tower: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tok = _tokenizer(tmp_path / "tok")
    if tower == "clip":
        config = _config(tok)
    else:
        tied = {"share_embeddings_and_output_weights": True}
        config = _config(tok, tied, vision=vision_preset("tiny-siglip"), projector_bias=False)
    model = _checkpoint(tmp_path / "run", config, tok)
    hf_dir, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    assert main(["hf", "--checkpoint", str(tmp_path / "run"), "--out", str(hf_dir), "--max-shard-size", "40KB"]) == 0
    assert capsys.readouterr().out.strip() == str(hf_dir)
    assert (hf_dir / "model.safetensors.index.json").exists()

    hf, info = transformers.AutoModelForImageTextToText.from_pretrained(hf_dir, output_loading_info=True)
    assert type(hf).__name__ == "LlavaForConditionalGeneration"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids, pixels = _batch(config, 3, config.language.vocab_size)  # the three special tokens are 0, 1, 2
    ours = _logits(model, ids, pixels)
    torch.testing.assert_close(_logits(hf.eval(), ids, pixels), ours, rtol=1e-5, atol=1e-5)

    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert hf_tok.convert_tokens_to_ids("<image>") == config.image_token_id == hf.config.image_token_id
    assert hf_tok.eos_token_id == tok["vocab"].token_to_id("<|endoftext|>") == hf.config.text_config.eos_token_id
    assert hf.config.image_seq_length == config.image_tokens

    assert main(["import-hf", "--model", str(hf_dir), "--out", str(ckpt), "--tp", "2"]) == 0
    back_config = llava_config_from_checkpoint(ckpt)
    assert back_config.image_tokens == config.image_tokens and back_config.projector_bias == config.projector_bias
    back = LlavaModel(back_config)
    load_llava_weights(back, ckpt)
    mine, theirs = model.global_state_dict(), back.global_state_dict()
    assert set(mine) == set(theirs)
    for k, v in mine.items():
        assert torch.equal(theirs[k], v), k
    assert (ckpt / "tokenizer" / "tokenizer.json").exists()


def test_import_of_a_save_pretrained_directory(tmp_path: Path) -> None:
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=16, patch_size=4)  # fmt: skip
    text = transformers.LlamaConfig(vocab_size=120, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    hf_config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=119,
                                         image_seq_length=16)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlavaForConditionalGeneration(hf_config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf", max_shard_size="30KB")
    assert main(["import-hf", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    config = llava_config_from_checkpoint(tmp_path / "ckpt")
    model = LlavaModel(config).eval()
    load_llava_weights(model, tmp_path / "ckpt")
    ids, pixels = _batch(config, 0, 119)
    torch.testing.assert_close(_logits(model, ids, pixels), _logits(hf, ids, pixels), rtol=1e-5, atol=1e-5)


def _one_error_line(capsys: pytest.CaptureFixture, command: str, *needles: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"mcore-export {command}: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_bad_inputs_exit_2_naming_the_file_or_field(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tok = _tokenizer(tmp_path / "tok")
    # a checkpoint HF cannot represent: nothing written
    _checkpoint(tmp_path / "shuffle", _config(tok, pixel_shuffle=True))
    assert main(["hf", "--checkpoint", str(tmp_path / "shuffle"), "--out", str(tmp_path / "o1")]) == 2
    _one_error_line(capsys, "hf", "pixel_shuffle=True")
    assert not (tmp_path / "o1").exists()
    # other formats refuse a LLaVA checkpoint by name
    _checkpoint(tmp_path / "run", _config(tok), tok)
    assert main(["trtllm", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "o2")]) == 2
    _one_error_line(capsys, "trtllm", "is a LlavaModel checkpoint", "mcore-export hf")
    assert main(["hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    capsys.readouterr()

    def import_broken(name: str, change: Any) -> Path:
        src = tmp_path / name
        src.mkdir()
        for f in (tmp_path / "hf").iterdir():
            (src / f.name).write_bytes(f.read_bytes())
        change(src)
        assert main(["import-hf", "--model", str(src), "--out", str(tmp_path / f"ckpt-{name}")]) == 2
        assert not (tmp_path / f"ckpt-{name}").exists()
        return src

    def edit_config(**fields: Any) -> Any:
        def change(src: Path) -> None:
            cfg = json.loads((src / "config.json").read_text())
            (src / "config.json").write_text(json.dumps({**cfg, **fields}))

        return change

    for name, fields, needle in (
        ("act", dict(projector_hidden_act="silu"), "projector_hidden_act='silu'"),
        ("layers", dict(vision_feature_layer=[-2, -1]), "vision_feature_layer=[-2, -1]"),
        ("token", dict(image_token_index=10**6), "image_token_id=1000000 is outside"),
        ("tower", dict(vision_config={"model_type": "dinov2"}), "vision_config.model_type='dinov2'"),
    ):
        src = import_broken(name, edit_config(**fields))
        _one_error_line(capsys, "import-hf", f"{src}/config.json: ", needle)
    src = import_broken("json", lambda s: (s / "config.json").write_text("{not json"))
    _one_error_line(capsys, "import-hf", f"{src}/config.json is not valid JSON")

    def drop_projector(src: Path) -> None:
        (src / "model.safetensors").write_bytes(b"")  # replaced below: one file without the projector
        sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
        save_file({k: v for k, v in sd.items() if "multi_modal_projector.linear_2" not in k},
                  str(src / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip

    src = import_broken("missing", drop_projector)
    _one_error_line(capsys, "import-hf", str(src), "multi_modal_projector.linear_2.weight")
    assert main(["import-hf", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "c3"), "--tp", "3"]) == 2
    _one_error_line(capsys, "import-hf", "tp=3")
