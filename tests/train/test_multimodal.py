"""Training LLaVA-style VLMs with ``mcore-train``: learning from images, TP / DP / PP against one process, exact
resume with the data stream, the two training stages, a GPT checkpoint into the language model, config errors."""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mcore_data._png import encode_png
from mcore_data.multimodal import ShardWriter
from mcore_data.multimodal_prep import COLORS
from mcore_models import training_flops_per_token
from mcore_models.flops import llava_training_flops
from mcore_models.multimodal import LlavaModel
from mcore_parallel.checkpoint import latest_checkpoint, read_metadata, read_region
from mcore_parallel.testing import run_distributed
from mcore_train import load_config, pretrain
from mcore_train.cli import main
from mcore_train.multimodal import llava_config
from mcore_train.trainer import setup
from tests.train.test_resume import arrays

RUN = ["training.device=cpu", "logging.progress_bar=false", "logging.log_interval=1000", "data.seq_length=48",
       "scheduler.decay_iters=120"]  # fmt: skip


def colour_shards(prefix: Path, n: int = 64, blank: bool = False) -> list[str]:
    """``n`` 16 px images of one colour each, captioned with the colour's name (grey images with ``blank``)."""
    rng = np.random.default_rng(0)
    names = list(COLORS)
    captions = []
    with ShardWriter(prefix, overwrite=True) as w:
        for _ in range(n):
            name = names[int(rng.integers(len(names)))]
            px = (
                np.full((16, 16, 3), 128, np.uint8) if blank else np.tile(np.array(COLORS[name], np.uint8), (16, 16, 1))
            )
            w.add(encode_png(px), "png", {"caption": name})
            captions.append(name)
    return captions


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prefix = tmp_path_factory.mktemp("mm") / "colours"
    colour_shards(prefix)
    return prefix


def vlm(data: Path, *overrides: str) -> list[str]:
    return [f"data.path={data}", *RUN, *overrides]


def _losses(overrides: list[str]) -> list[float]:
    return pretrain(load_config(recipe="llava-tiny", overrides=overrides)).losses


def test_a_tiny_vlm_learns_captions_that_text_alone_cannot(tmp_path: Path) -> None:
    captions = colour_shards(tmp_path / "c")
    colour_shards(tmp_path / "blank", blank=True)
    # the best a model without the image can do: the captions' entropy over the tokens that carry loss (the
    # caption's bytes, its newline and the EOD), per token
    counts = collections.Counter(captions)
    entropy = -sum(c / len(captions) * math.log(c / len(captions)) for c in counts.values())
    bound = entropy / (sum(len(c) + 2 for c in captions) / len(captions))
    assert 0.2 < bound < 0.3
    seen = _losses(vlm(tmp_path / "c", "training.train_iters=120"))
    blind = _losses(vlm(tmp_path / "blank", "training.train_iters=120"))
    final_seen, final_blind = np.mean(seen[-10:]), np.mean(blind[-10:])
    assert final_seen < bound / 2 < final_blind, (final_seen, final_blind, bound)


def test_tp2_sp_dp2_zero_and_pp2_equal_one_process(shards: Path) -> None:
    args = vlm(shards, "training.train_iters=3")
    one = _losses(args)
    for layout in (["parallel.tp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"],
                   ["optimizer.use_distributed_optimizer=true"], ["parallel.pp=2"]):  # fmt: skip
        losses = run_distributed(_losses, 2, [*args, *layout], timeout=300)[0]
        assert losses == pytest.approx(one, rel=2e-5), layout


def test_recompute_and_compiled_layers_train_like_eager(shards: Path) -> None:
    args = vlm(shards, "training.train_iters=3")
    eager = _losses(args)
    assert _losses([*args, "model.recompute=full"]) == pytest.approx(eager, rel=1e-6)
    assert _losses([*args, "model.recompute=selective"]) == pytest.approx(eager, rel=1e-6)
    # the LM's and the tower's layers compiled (LlavaModel.compile_layers)
    assert _losses([*args, "training.compile=layers"]) == pytest.approx(eager, rel=2e-5)


def test_resume_is_bit_exact_with_the_data_stream(shards: Path, tmp_path: Path) -> None:
    args = vlm(shards, "training.train_iters=4", "model.hidden_dropout=0.1")
    straight = _losses([*args, f"checkpoint.dir={tmp_path / 'a'}"])
    first = _losses([*args, "training.exit_interval=2", f"checkpoint.dir={tmp_path / 'b'}"])
    second = _losses([*args, f"checkpoint.dir={tmp_path / 'b'}"])
    assert len(first) == 2 and first + second == straight
    assert _losses([*args, "multimodal.data_workers=2"]) == straight  # images decoded in DataLoader workers
    a, b = latest_checkpoint(tmp_path / "a"), latest_checkpoint(tmp_path / "b")
    assert read_metadata(b)["consumed_samples"] == 4 * 16 and read_metadata(b)["model"]["image_token_id"] == 259
    names = arrays(a)
    assert names == arrays(b) and any("vision." in str(n) for n in names) and any("projector." in str(n) for n in names)
    for array in names:
        assert torch.equal(read_region(a / array), read_region(b / array)), array
    # the logged model FLOPs count the tower and the projector (one image per sample)
    llava = llava_config(load_config(recipe="llava-tiny", overrides=args), 259)
    per_token = llava_training_flops(llava, batch_size=1, seq_length=48) / 48
    assert per_token > training_flops_per_token(llava.language, 48)
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["tflops_per_gpu"] * 1e12 / r["tokens_per_s"] for r in records if "tflops_per_gpu" in r]
    assert logged and logged == pytest.approx([per_token] * len(logged), rel=1e-9)


def pair_shards(prefix: Path, n: int = 64) -> list[str]:
    """``n`` samples of two images each, a 16 px square then a 32 x 16 one, each of one colour; the caption names
    both colours in order."""
    rng = np.random.default_rng(1)
    names = list(COLORS)
    captions = []
    with ShardWriter(prefix, overwrite=True) as w:
        for _ in range(n):
            a, b = (names[int(i)] for i in rng.integers(len(names), size=2))
            square = np.tile(np.array(COLORS[a], np.uint8), (16, 16, 1))
            wide = np.tile(np.array(COLORS[b], np.uint8), (16, 32, 1))
            caption = f"{a} {b}"
            w.add_images([(encode_png(square), "png"), (encode_png(wide), "png")],
                         {"conversations": [{"role": "user", "content": "<image><image>"},
                                            {"role": "assistant", "content": caption}]})  # fmt: skip
            captions.append(caption)
    return captions


def test_two_images_per_sample_with_tiling_learn_both_colours(tmp_path: Path) -> None:
    captions = pair_shards(tmp_path / "pairs")
    # the 32 x 16 image is a 2 x 1 grid of 16 px tiles plus its thumbnail: 1 + 3 tiles of 16 image tokens a sample
    args = vlm(tmp_path / "pairs", "data.seq_length=160", "multimodal.max_tiles=2", "training.train_iters=120",
               f"checkpoint.dir={tmp_path / 'run'}")  # fmt: skip
    run = setup(load_config(recipe="llava-tiny", overrides=args))
    batch = next(run.train_iterators()[0])
    assert batch["pixels"].shape == (8 * 4, 3, 16, 16) and batch["image_mask"].sum() == 8 * 4 * 16
    assert batch["loss_mask"][batch["image_mask"]].sum() == 0
    tokens = batch["tokens"][0].tolist()
    text = bytes(t for t in tokens if t < 256).decode()
    assert text.count("<tile_1>") == 2 and "<tile_2>" in text and "<tile_global_thumbnail>" in text
    counts = collections.Counter(captions)  # text alone cannot name the colours: the captions' entropy per token
    entropy = -sum(c / len(captions) * math.log(c / len(captions)) for c in counts.values())
    bound = entropy / (sum(len(c) + 2 for c in captions) / len(captions))
    losses = pretrain(load_config(recipe="llava-tiny", overrides=args)).losses
    assert np.mean(losses[-10:]) < bound / 2, (np.mean(losses[-10:]), bound)
    # the logged FLOPs count the tiles the steps read: 4 per sample
    llava = llava_config(load_config(recipe="llava-tiny", overrides=args), 259)
    per_sample = llava_training_flops(llava, batch_size=1, seq_length=160, num_images=4)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["tflops_per_gpu"] * 1e12 / r["samples_per_s"] for r in records if "tflops_per_gpu" in r]
    assert logged and logged == pytest.approx([per_sample] * len(logged), rel=1e-9)
    assert all(r["data_ms_per_step"] > 0 and 0 < r["data_share"] < 1 for r in records if "data_share" in r)


def _weights(ckpt: Path, part: str) -> dict[str, torch.Tensor]:
    return {str(n): read_region(ckpt / n) for n in arrays(ckpt) if str(n).startswith(f"model/{part}.")}


def test_stage_1_then_stage_2_from_a_gpt_checkpoint(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a text-only model with the VLM's language model, saved after one step
    _losses([*RUN, "multimodal.vision=null", "data.multimodal=false", "data.mock=true", "training.train_iters=1",
             f"checkpoint.dir={tmp_path / 'gpt'}"])  # fmt: skip
    gpt = latest_checkpoint(tmp_path / "gpt")
    stage1 = vlm(shards, "training.train_iters=3", "multimodal.freeze=[vision,language]",
                 f"multimodal.language_load={tmp_path / 'gpt'}", f"checkpoint.dir={tmp_path / 's1'}")  # fmt: skip
    run = setup(load_config(recipe="llava-tiny", overrides=stage1))
    assert isinstance(run.chunks[0], LlavaModel) and run.llava is not None
    batch = next(run.train_iterators()[0])  # image and prompt tokens carry no loss
    assert batch["pixels"].shape == (8, 3, 16, 16) and batch["image_mask"].sum() == 8 * 16
    assert batch["loss_mask"][batch["image_mask"]].sum() == 0
    trained = {n for n, p in run.chunks[0].named_parameters() if p.requires_grad}
    assert trained and all(n.startswith("projector.") for n in trained)
    initial = LlavaModel(run.llava).global_state_dict()  # the per-name seeds: the trainer's initial weights
    _losses(stage1)
    s1 = latest_checkpoint(tmp_path / "s1")
    for key, value in _weights(s1, "vision").items():  # frozen: exactly the initial tower
        assert torch.equal(value, initial[key.removeprefix("model/")]), key
    gpt_lm = {str(n).removeprefix("model/"): read_region(gpt / n) for n in arrays(gpt) if str(n).startswith("model/")}
    lm = _weights(s1, "language")
    assert lm and all(torch.equal(v, gpt_lm[k.removeprefix("model/language.")]) for k, v in lm.items())
    assert all(not torch.equal(v, initial[k.removeprefix("model/")]) for k, v in _weights(s1, "projector").items())
    # stage 2 loads stage 1's weights (its optimizer held the projector only) and trains the LM too
    # (with a validation set: data.train_path and data.valid_path)
    stage2 = pretrain(load_config(recipe="llava-tiny", overrides=[
        *RUN, f"data.train_path={shards}", f"data.valid_path={shards}", "training.eval_iters=2",
        "training.train_iters=2", "multimodal.freeze=[vision]", f"checkpoint.load={tmp_path / 's1'}",
        f"checkpoint.dir={tmp_path / 's2'}"]))  # fmt: skip
    s2 = latest_checkpoint(tmp_path / "s2")
    assert len(stage2.losses) == 2 and read_metadata(s2)["step"] == 2
    assert len(stage2.eval_losses) == 1 and 0 < stage2.eval_losses[0][1] < 10
    capsys.readouterr()
    refusals = {
        (f"checkpoint.load={tmp_path / 'gpt'}",): "holds a text-only GPT model; use multimodal.language_load",
        (f"checkpoint.load={s1}", "multimodal.vision_config.num_layers=2"):
            "multimodal.vision_config.num_layers: checkpoint has 3, config has 2",
        (f"checkpoint.load={s1}", "model.num_layers=3"): "model.num_layers: checkpoint has 2, config has 3",
        (f"checkpoint.load={s1}", "multimodal.projector=linear"): "multimodal.projector: checkpoint has 'mlp'",
    }  # fmt: skip
    for overrides, message in refusals.items():
        assert main(["pretrain", "--recipe", "llava-tiny", *vlm(shards, "training.train_iters=1", *overrides)]) == 2
        assert message in capsys.readouterr().err, overrides
    assert main(["checkpoint", "inspect", str(s2)]) == 0
    assert (
        "'vision': 'tiny-clip', 'image_token_id': 259, 'projector': 'mlp', 'freeze': ['vision']"
        in capsys.readouterr().out
    )
    assert all(torch.equal(v, _weights(s1, "vision")[k]) for k, v in _weights(s2, "vision").items())
    assert all(not torch.equal(v, lm[k]) for k, v in _weights(s2, "language").items())


def hf_tower(directory: Path, **changes: object) -> dict[str, torch.Tensor]:
    """A Hugging Face CLIPVisionModel directory holding a tiny-clip tower of other weights (seed 7); its weights as
    the trainer's tower names them."""
    from safetensors.torch import save_file

    from mcore_models.hf_vision import vision_config_to_hf, vision_mcore_to_hf
    from mcore_models.vision import VisionEncoder, vision_preset

    config = vision_preset("tiny-clip", seed=7)
    weights = {n: p.detach().clone() for n, p in VisionEncoder(config).named_parameters()}
    directory.mkdir()
    hf = dict(vision_mcore_to_hf(config, weights.__getitem__, "vision_model."))
    save_file({k: v.contiguous() for k, v in hf.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({**vision_config_to_hf(config), **changes}))
    return weights


def test_a_hugging_face_tower_loads_into_stage_1(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = hf_tower(tmp_path / "clip")
    _losses(vlm(shards, "training.train_iters=1", "multimodal.freeze=[vision,language]",
                f"multimodal.vision_load={tmp_path / 'clip'}", f"checkpoint.dir={tmp_path / 's1'}"))  # fmt: skip
    saved = _weights(latest_checkpoint(tmp_path / "s1"), "vision")
    assert len(saved) == len(weights)
    assert all(torch.equal(v, weights[k.removeprefix("model/vision.")]) for k, v in saved.items())
    hf_tower(tmp_path / "wide", hidden_size=48)
    for where, message in ((tmp_path / "wide", "multimodal.vision_config.hidden_size: "),
                           (tmp_path, "not a Hugging Face model directory")):  # fmt: skip
        assert main(["pretrain", "--recipe", "llava-tiny", *vlm(shards, f"multimodal.vision_load={where}")]) == 2
        assert message in capsys.readouterr().err


def test_config_errors_name_the_keys(shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["pretrain", "--recipe", "llava-tiny", f"data.path={shards}"]
    cases = {
        ("data.seq_length=16",): ["data.seq_length=16 cannot hold one image (16 image tokens", ">= 17"],
        ("multimodal.image_token_id=400", "multimodal.freeze=[eyes]"): [
            "multimodal.image_token_id=400 is outside the language model's vocabulary (model.vocab_size=260)",
            "freeze=['eyes'] has unknown part(s)"],
        ("model.vocab_size=259",): ["needs model.vocab_size > 259"],
        ("multimodal.vision=tiny-clipp",): ["multimodal.vision: unknown vision preset 'tiny-clipp'"],
        ("multimodal.vision_config.img=3",): ["multimodal.vision_config.img: unknown key"],
        ("multimodal.visoin=x",): ["multimodal.visoin: unknown key; did you mean 'vision'?"],
        ("data.mock=true",): ["data.mock=true has no images"],
        ("multimodal.vision=null",): ["data.multimodal=true needs a vision-language model"],
        (f"data.path={tmp_path / 'none'}",): ["data.path: no multimodal shards at prefix"],
        ("training.generate_at_end=8",): ["training.generate_at_end with multimodal.vision"],
        ("parallel.pp=2", "multimodal.freeze=[vision,language]"): ["would hold no trained parameter"],
    }  # fmt: skip
    for overrides, messages in cases.items():
        assert main([*base, *overrides]) == 2, overrides
        err = capsys.readouterr().err
        assert "Traceback" not in err and all(m in err for m in messages), (overrides, err)
    assert main(["pretrain", "--recipe", "tiny", f"data.path={shards}", "multimodal.vision=tiny-clip"]) == 2
    assert "multimodal.vision=tiny-clip trains on image-text data" in capsys.readouterr().err
