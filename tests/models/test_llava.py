"""LlavaModel in one process: the splice of image embeddings (against a float64 construction by hand), the
projector and pixel shuffle, freezing, pipeline stages, LlavaConfig's errors and round trip, FLOPs, checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mcore_models import ConfigError, GPTModel
from mcore_models.flops import (
    llava_training_flops,
    projector_forward_flops,
    training_flops_per_token,
    vision_forward_flops,
)
from mcore_models.multimodal import LlavaConfig, LlavaModel, Projector, llava_preset, pixel_shuffle
from mcore_models.multimodal.checkpoint import llava_config_from_checkpoint, load_llava_weights, save_llava_weights
from mcore_models.vision import VisionEncoder
from mcore_parallel import ParallelConfig, ParallelState

IMAGE = 255  # llava-tiny's image_token_id
T = 16  # llava-tiny's image_tokens (16 px / 4 px patches, class token dropped)


def _images(n: int, seed: int = 1, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _ids(layout: list[list[tuple[int, int]]], s: int = 48, seed: int = 2) -> torch.Tensor:
    """Random text ids ``[len(layout), s]`` (never the image token) with image-token runs at (start, length)."""
    ids = torch.randint(0, IMAGE, (len(layout), s), generator=torch.Generator().manual_seed(seed))
    for row, runs in enumerate(layout):
        for start, n in runs:
            ids[row, start : start + n] = IMAGE
    return ids


def _model(**overrides: Any) -> LlavaModel:
    return LlavaModel(llava_preset("llava-tiny", **overrides)).double()


def _by_hand(model: LlavaModel, ids: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """``[b, s, hidden]``: the word embeddings with the image embeddings at the image tokens, row-major, in order."""
    table = model.language.embedding.word_embeddings.weight.detach()
    out = table[ids].clone()
    with torch.no_grad():
        img = model.image_embeddings(images).reshape(-1, table.shape[1])
    k = 0
    for b in range(ids.shape[0]):
        for s in range(ids.shape[1]):
            if ids[b, s] == IMAGE:
                out[b, s] = img[k]
                k += 1
    assert k == img.shape[0]
    return out


# ------------------------------------------------------------------------------------------------------ splicing
@pytest.mark.parametrize("lm", ["llama", "gpt2"])
def test_image_embeddings_land_at_the_image_tokens_in_order(lm: str) -> None:
    # gpt2: learned positions, added after the splice (to the image tokens too), as the LM's embedding does
    language = {} if lm == "llama" else dict(position_embedding="learned_absolute", normalization="layernorm",
                                             activation="gelu", add_bias_linear=True)  # fmt: skip
    model = _model(language=language)
    # row 0 holds two images (one split around text), row 1 one; 3 images in all
    ids = _ids([[(2, T), (20, 10), (31, 6)], [(40, 8), (5, 8)]])
    images = _images(3)
    expected = _by_hand(model, ids, images)
    if lm == "gpt2":
        expected = expected + model.language.embedding.position_embeddings.weight[: ids.shape[1]].detach()
    got = model.decoder_input(ids, images).transpose(0, 1)
    torch.testing.assert_close(got, expected, rtol=0.0, atol=0.0)
    # the same positions given as a boolean mask, or as integer positions per row
    mask = ids == IMAGE
    torch.testing.assert_close(model.decoder_input(ids, images, image_positions=mask).transpose(0, 1), expected)
    ids1, img1 = _ids([[(3, T)], [(30, T)]]), _images(2)
    positions = torch.stack([torch.arange(3, 3 + T), torch.arange(30, 30 + T)])
    torch.testing.assert_close(model.decoder_input(ids1, img1, image_positions=positions),
                               model.decoder_input(ids1, img1), rtol=0.0, atol=0.0)  # fmt: skip


def test_image_embeddings_are_the_towers_features_projected() -> None:
    model = _model()
    images = _images(2)
    tower = VisionEncoder(model.config.vision).double()  # the same weights: each drawn from its name's seed
    expected = model.projector(tower(images))
    torch.testing.assert_close(model.image_embeddings(images), expected, rtol=0.0, atol=0.0)
    assert expected.shape == (2, T, 64)


def test_image_token_count_mismatch_is_an_error_naming_both_counts() -> None:
    model = _model()
    ids = _ids([[(0, T)], [(10, T - 1)]])  # 2 * 16 - 1 image tokens
    with pytest.raises(ValueError, match=r"31 image-token positions but 2 image\(s\) x 16 image_tokens = 32"):
        model(ids, _images(2))
    with pytest.raises(ValueError, match="no images were given"):
        model(_ids([[(0, T)]]))
    with pytest.raises(ValueError, match=r"0 image-token positions but 1 image\(s\)"):
        model(_ids([[]]), _images(1))
    with pytest.raises(ValueError, match="must lie in"):
        model(_ids([[(0, T)]]), _images(1), image_positions=torch.arange(40, 40 + T)[None])
    model(_ids([[]]))  # text only: no images, no image tokens


def test_loss_equals_gpt_fed_the_spliced_embeddings() -> None:
    model = _model()
    ids, images = _ids([[(4, T)], [(20, T)]]), _images(2)
    labels = torch.randint(0, 200, ids.shape, generator=torch.Generator().manual_seed(5))
    loss = model(ids, images, labels=labels)
    gpt = GPTModel(model.config.language).double()  # the LM's weights are GPTModel's (same names, same seeds)
    ref = gpt(ids, labels=labels, decoder_input=model.decoder_input(ids, images))
    torch.testing.assert_close(loss, ref, rtol=0.0, atol=0.0)
    # decoder_input = the embedding is the plain model
    torch.testing.assert_close(gpt(ids, labels=labels, decoder_input=gpt.embed(ids)[0]), gpt(ids, labels=labels))
    assert loss.shape == ids.shape
    logits = model(ids, images, gather_logits=True)
    assert logits.shape == (2, 48, 256)


# ----------------------------------------------------------------------------------------------------- projector
def test_pixel_shuffle_concatenates_each_2x2_neighbourhood_row_major() -> None:
    g, c = 4, 2
    # token (r, q) of the 4 x 4 grid holds channels [10 r + q, -(10 r + q)]
    grid = torch.tensor([[[10 * r + q, -(10 * r + q)] for q in range(g)] for r in range(g)], dtype=torch.float64)
    out = pixel_shuffle(grid.reshape(1, g * g, c))
    assert out.shape == (1, 4, 4 * c)
    for i in range(2):
        for j in range(2):
            hood = [grid[2 * i, 2 * j], grid[2 * i, 2 * j + 1], grid[2 * i + 1, 2 * j], grid[2 * i + 1, 2 * j + 1]]
            torch.testing.assert_close(out[0, 2 * i + j], torch.cat(hood), rtol=0.0, atol=0.0)
    with pytest.raises(ValueError, match="even grid, got 3 x 3"):
        pixel_shuffle(torch.zeros(1, 9, 2))
    with pytest.raises(ValueError, match="square grid"):
        pixel_shuffle(torch.zeros(1, 17, 2))


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_projector_shapes_and_math(kind: str) -> None:
    config = llava_preset("llava-tiny", projector=kind)
    proj = Projector(config).double()
    names = [n for n, _ in proj.named_parameters()]
    fc2 = ["linear_fc2.weight", "linear_fc2.bias"] if kind == "mlp" else []
    assert names == ["linear_fc1.weight", "linear_fc1.bias", *fc2]
    features = torch.randn(3, 17, 32, dtype=torch.float64)
    out = proj(features)
    assert out.shape == (3, 16, 64)
    x = F.linear(features[:, 1:], proj.linear_fc1.weight, proj.linear_fc1.bias)
    if kind == "mlp":
        assert proj.linear_fc2 is not None
        x = F.linear(F.gelu(x), proj.linear_fc2.weight, proj.linear_fc2.bias)
    torch.testing.assert_close(out, x, rtol=0.0, atol=0.0)
    assert not Projector(config.replace(projector_bias=False)).linear_fc1.bias


def test_feature_select_and_pixel_shuffle_token_counts() -> None:
    features = torch.randn(2, 17, 32, dtype=torch.float64)
    patches = Projector(llava_preset("llava-tiny")).double()
    full = Projector(llava_preset("llava-tiny", vision_feature_select="all")).double()
    full.load_state_dict(patches.state_dict())
    # class token first (a GEMM over 17 rows may round apart from one over 16 on some CPUs: float64 tolerance)
    torch.testing.assert_close(full(features)[:, 1:], patches(features), rtol=1e-12, atol=1e-12)
    assert full(features).shape == (2, 17, 64)
    shuffled = llava_preset("llava-tiny", pixel_shuffle=True)
    assert shuffled.image_tokens == 4 and shuffled.projector_input_size == 128
    proj = Projector(shuffled).double()
    torch.testing.assert_close(proj.select(features), pixel_shuffle(features[:, 1:]))
    assert proj(features).shape == (2, 4, 64)
    model = LlavaModel(shuffled)
    assert model.image_embeddings(_images(1, dtype=torch.float32)).shape == (1, 4, 64)
    with pytest.raises(ValueError, match="17 tokens per image"):
        proj(features[:, :5])


# ----------------------------------------------------------------------------------------------------- freezing
def _part(name: str) -> str:
    return name.split(".")[0]


def _unused_vision(name: str) -> bool:  # tiny-clip runs 2 of its 3 layers (vision_feature_layer=-2)
    return name.startswith(("vision.decoder.layers.2.", "vision.post_layernorm."))


@pytest.mark.parametrize("freeze", [(), ("vision",), ("vision", "language"), ("projector",)])
def test_freeze_sets_requires_grad_and_frozen_parts_get_no_grad(freeze: tuple[str, ...]) -> None:
    model = _model(freeze=freeze)
    for name, p in model.named_parameters():
        assert p.requires_grad == (_part(name) not in freeze and not _unused_vision(name)), name
    ids, images = _ids([[(0, T)], [(30, T)]]), _images(2)
    labels = torch.randint(0, 200, ids.shape, generator=torch.Generator().manual_seed(5))
    loss = model(ids, images, labels=labels)
    torch.testing.assert_close(loss, _model()(ids, images, labels=labels), rtol=0.0, atol=0.0)  # same forward
    loss.sum().backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_a_frozen_tower_still_runs_forward() -> None:
    frozen, trained = _model(freeze=("vision",)), _model()
    images = _images(2)
    out = frozen.image_embeddings(images)
    assert out.grad_fn is not None  # the projector still trains
    torch.testing.assert_close(out, trained.image_embeddings(images), rtol=0.0, atol=0.0)


# ------------------------------------------------------------------------------------------------------ pipeline
def test_two_pipeline_stages_equal_one_model() -> None:
    config = llava_preset("llava-tiny")
    whole = LlavaModel(config).double()
    first = LlavaModel(config, post_process=False, layers=range(0, 1)).double()
    last = LlavaModel(config, pre_process=False, layers=range(1, 2)).double()
    assert not hasattr(last, "vision") and not hasattr(last, "projector")
    assert {n for n, _ in first.named_parameters()} | {n for n, _ in last.named_parameters()} == {
        n for n, _ in whole.named_parameters()
    }
    ids, images = _ids([[(0, T)], [(30, T)]]), _images(2)
    labels = torch.randint(0, 200, ids.shape, generator=torch.Generator().manual_seed(5))
    hidden = first(ids, images)
    sent = hidden.detach().requires_grad_(True)
    last.set_input_tensor(sent)
    loss = last(None, labels=labels)
    expected = whole(ids, images, labels=labels)
    torch.testing.assert_close(loss, expected, rtol=0.0, atol=1e-12)
    loss.sum().backward()
    hidden.backward(sent.grad)
    expected.sum().backward()
    grads = {n: p.grad for m in (first, last) for n, p in m.named_parameters() if p.requires_grad}
    for name, p in whole.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)
    with pytest.raises(ValueError, match="without pre_process"):
        last(None, images)


# ------------------------------------------------------------------------------------------------------- config
def test_config_problems_name_the_fields() -> None:
    with pytest.raises(ConfigError) as e:
        llava_preset("llava-tiny", projector="mlp3", vision_feature_select="default", freeze=("vision", "eyes"),
                     image_token_id=256, pixel_shuffle=1)  # fmt: skip
    text = str(e.value)
    for needle in ("projector='mlp3'", "vision_feature_select='default'", "unknown part(s) ['eyes']",
                   "image_token_id=256 is outside", "pixel_shuffle=1 must be"):  # fmt: skip
        assert needle in text, text
    assert len(e.value.problems) == 5
    with pytest.raises(ConfigError, match="even patch grid, but the vision tower's grid is 5 x 5"):
        llava_preset("llava-tiny", pixel_shuffle=True, vision={"image_size": 20})
    with pytest.raises(ConfigError, match="vision_feature_select='all' keeps the class token"):
        llava_preset("llava-tiny", pixel_shuffle=True, vision_feature_select="all")
    with pytest.raises(ConfigError, match="freezes every part"):
        llava_preset("llava-tiny", freeze=["vision", "projector", "language"])
    with pytest.raises(ConfigError, match="language.max_position_embeddings=8"):
        llava_preset("llava-tiny", language={"max_position_embeddings": 8})
    with pytest.raises(ConfigError, match=r"unknown LlavaConfig field\(s\) \['colour'\]"):
        LlavaConfig.from_dict({**llava_preset("llava-tiny").to_dict(), "colour": 1})


def test_config_round_trips_through_json_and_presets() -> None:
    config = llava_preset("llava-tiny", freeze=["vision"], pixel_shuffle=True, language={"num_layers": 3})
    assert config.freeze == ("vision",) and config.language.num_layers == 3
    back = LlavaConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert back == config
    big = llava_preset("llava-1b-clip336")
    assert LlavaConfig.from_dict(json.loads(json.dumps(big.to_dict()))) == big
    assert big.image_tokens == 576 and big.vision.vision_feature_layer == -2 and big.projector == "mlp"
    assert big.language.hidden_size == 2048 and big.vision.hidden_size == 1024
    assert llava_preset("llava_1b_clip336", vision_feature_select="all").image_tokens == 577
    with pytest.raises(KeyError, match="unknown LLaVA preset"):
        llava_preset("llava-70b")


# -------------------------------------------------------------------------------------------------------- FLOPs
def test_llava_flops() -> None:
    config = llava_preset("llava-1b-clip336")
    h, t = 1024, 577
    layer = 2 * t * (4 * h * h + 2 * h * 4096) + 4 * t * t * h
    assert vision_forward_flops(config.vision) == 2 * 576 * 3 * 14 * 14 * h + 23 * layer
    assert projector_forward_flops(config) == 576 * (2 * 1024 * 2048 + 2 * 2048 * 2048)
    lm = 4 * 2048 * training_flops_per_token(config.language, 2048)
    vis, proj = 4 * vision_forward_flops(config.vision), 4 * projector_forward_flops(config)
    assert llava_training_flops(config, batch_size=4, seq_length=2048) == pytest.approx(3 * (vis + proj) + lm)
    frozen = config.replace(freeze=("vision", "language"))  # tower forward only; LM forward + activation grads
    assert llava_training_flops(frozen, batch_size=4, seq_length=2048, num_images=4) == pytest.approx(
        vis + 3 * proj + 2 * lm / 3
    )


# -------------------------------------------------------------------------------------------------- checkpoints
def test_checkpoint_round_trip_one_process(tmp_path: Path) -> None:
    config = llava_preset("llava-tiny")
    model = LlavaModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    save_llava_weights(model, ParallelState.initialize(ParallelConfig()), tmp_path)
    assert llava_config_from_checkpoint(tmp_path) == config
    loaded = LlavaModel(config.replace(language=config.language.replace(seed=7), vision=config.vision.replace(seed=8)))
    load_llava_weights(loaded, tmp_path)
    for (name, a), b in zip(loaded.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name
    fresh = LlavaModel(config)
    fresh.load_global_state_dict(model.global_state_dict())
    for (name, a), b in zip(fresh.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(KeyError, match=r"missing \['projector.linear_fc1.bias'\]"):
        fresh.load_global_state_dict(
            {k: v for k, v in model.global_state_dict().items() if k != "projector.linear_fc1.bias"}
        )
