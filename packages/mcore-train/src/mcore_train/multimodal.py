"""Vision-language runs: the ``multimodal`` section turned into a :class:`~mcore_models.multimodal.LlavaConfig`, its
checks against the rest of the config, the image-text datasets, and the checkpoint rules of a VLM.

``model`` stays the language model (a GPT preset and its fields); ``multimodal.vision`` names the tower and the other
``multimodal.*`` keys the projector, the image token and the frozen parts. See docs/multimodal.md ("Training").
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcore_models.errors import ConfigError as ModelConfigError
from mcore_models.errors import MCoreModelsError
from mcore_models.multimodal import LlavaConfig
from mcore_models.vision import VisionConfig, vision_preset
from mcore_train.errors import ConfigError

if TYPE_CHECKING:
    from mcore_data.tokenizer import Tokenizer
    from mcore_train.config import TrainConfig

__all__ = ["is_multimodal", "llava_config", "multimodal_problems", "multimodal_datasets", "llava_diffs",
           "default_image_token_id", "load_language", "load_vision"]  # fmt: skip

logger = logging.getLogger(__name__)

_RENAMES = (("language.vocab_size", "model.vocab_size"), ("language.max_position_embeddings",
            "model.max_position_embeddings"))  # fmt: skip


def is_multimodal(config: TrainConfig) -> bool:
    return config.multimodal.vision is not None


def default_image_token_id(tokenizer_vocab: int) -> int:
    """``multimodal.image_token_id``'s default: the tokenizer's vocabulary size, the first id it never produces."""
    return tokenizer_vocab


def _tokenizer_vocab(config: TrainConfig) -> int | None:
    """The tokenizer's vocabulary size when it can be known now (the byte tokenizer, or a model file that exists)."""
    d = config.data
    if d.tokenizer != "byte" and not (d.tokenizer_model and Path(d.tokenizer_model).is_file()):
        return None
    from mcore_train.data import build_tokenizer_for

    try:
        return int(build_tokenizer_for(config).vocab_size)
    except Exception:  # a broken tokenizer file is reported where the data is built
        return None


def _vision(config: TrainConfig, problems: list[str]) -> VisionConfig | None:
    mm = config.multimodal
    assert mm.vision is not None
    fields = {f.name for f in dataclasses.fields(VisionConfig)}
    over: dict[str, Any] = {"params_dtype": config.model.params_dtype}
    for k, v in mm.vision_config.items():
        if k not in fields:
            problems.append(
                f"multimodal.vision_config.{k}: unknown key (VisionConfig fields: {', '.join(sorted(fields))})"
            )
        else:
            over[k] = v
    if mm.vision_feature_layer is not None:
        over["vision_feature_layer"] = mm.vision_feature_layer
    try:
        return vision_preset(mm.vision, **over)
    except KeyError as e:
        problems.append(f"multimodal.vision: {e.args[0]}")
    except ModelConfigError as e:
        problems.extend(f"multimodal.vision_config: {p}" for p in e.problems)
    except (TypeError, ValueError) as e:
        problems.append(f"multimodal.vision_config: {e}")
    return None


def _build(config: TrainConfig, tokenizer_vocab: int | None, problems: list[str]) -> LlavaConfig | None:
    mm, model = config.multimodal, config.model
    vision = _vision(config, problems)
    tid = mm.image_token_id
    if tid is None:
        # without the tokenizer (its file is not there yet) the shapes are checked with a stand-in id; the real id
        # is checked when the run builds the tokenizer
        tid = model.vocab_size - 1 if tokenizer_vocab is None else default_image_token_id(tokenizer_vocab)
        if tokenizer_vocab is not None and tid >= model.vocab_size:
            problems.append(
                f"multimodal.image_token_id (default: the tokenizer's vocabulary size {tokenizer_vocab}, an id the "
                f"text never uses) needs model.vocab_size > {tid}, but it is {model.vocab_size}: set "
                f"model.vocab_size={tid + 1} or more, or multimodal.image_token_id to a reserved token of the tokenizer"
            )
            tid = model.vocab_size - 1  # the other checks go on with a stand-in id
    elif tid >= model.vocab_size:
        problems.append(f"multimodal.image_token_id={tid} is outside the language model's vocabulary "
                        f"(model.vocab_size={model.vocab_size}): raise model.vocab_size or pick a smaller id")  # fmt: skip
        tid = model.vocab_size - 1
    if vision is None:
        return None
    try:
        return LlavaConfig(vision=vision, language=model, image_token_id=tid, projector=mm.projector,
                           projector_bias=mm.projector_bias, pixel_shuffle=mm.pixel_shuffle,
                           vision_feature_select=mm.vision_feature_select, freeze=tuple(mm.freeze))  # fmt: skip
    except ModelConfigError as e:
        for p in e.problems:
            for old, new in _RENAMES:
                p = p.replace(old, new)
            problems.append(f"multimodal: {p}")
    return None


def llava_config(config: TrainConfig, tokenizer_vocab: int) -> LlavaConfig:
    """The run's LlavaConfig (``tokenizer_vocab``: the tokenizer's vocabulary size); a ConfigError naming the keys."""
    problems: list[str] = []
    out = _build(config, tokenizer_vocab, problems)
    if out is None or problems:
        raise ConfigError(problems or ["multimodal: invalid"], header="invalid multimodal configuration")
    return out


def multimodal_problems(config: TrainConfig) -> list[str]:
    """The ``multimodal`` section against the rest of the config (:meth:`TrainConfig.check_layout`)."""
    mm, d, par = config.multimodal, config.data, config.parallel
    if mm.vision is None:
        if d.multimodal:
            return ["data.multimodal=true needs a vision-language model: set multimodal.vision (e.g. tiny-clip)"]
        return []
    problems = []
    if not d.multimodal and not d.mock:
        problems.append(f"multimodal.vision={mm.vision} trains on image-text data: set data.multimodal=true with "
                        "data.path the prefix of `mcore-data multimodal` shards")  # fmt: skip
    if d.mock:
        problems.append("data.mock=true has no images: a vision-language run needs data.multimodal=true shards")
    if par.pp > 1 and "language" in mm.freeze:
        problems.append(f"parallel.pp={par.pp} with multimodal.freeze={mm.freeze}: the pipeline stages after the first "
                        "would hold no trained parameter (the tower and projector live on the first stage); train "
                        "this stage with parallel.pp=1 (and data parallelism), or unfreeze the language model")  # fmt: skip
    if config.training.generate_at_end:
        problems.append("training.generate_at_end with multimodal.vision: the end-of-run sample is text-only; set "
                        "training.generate_at_end=0 (serve the checkpoint with mcore-infer to sample)")  # fmt: skip
    if d.packing:
        problems.append("data.packing=true with multimodal.vision: multimodal samples are not packed; set "
                        "data.packing=false")  # fmt: skip
    if par.cp > 1:
        problems.append(f"parallel.cp={par.cp} with multimodal.vision: context parallelism does not split the "
                        "image tokens; set parallel.cp=1")  # fmt: skip
    if config.model.hybrid_pattern is not None:
        problems.append("multimodal.vision with a hybrid / Mamba language model (model.hybrid_pattern) is not "
                        "supported; use a transformer preset")  # fmt: skip
    for key in ("path", "train_path", "valid_path"):
        items = getattr(d, key)
        if len(items) > 1:
            problems.append(f"data.{key}={items}: multimodal data takes one shards prefix (blends are not supported)")
    llava = _build(config, _tokenizer_vocab(config), problems)
    if llava is not None and d.seq_length < llava.image_tokens + 1:
        problems.append(f"data.seq_length={d.seq_length} cannot hold one image ({llava.image_tokens} image tokens, "
                        f"multimodal.vision={mm.vision}) and a text token: set data.seq_length >= "
                        f"{llava.image_tokens + 1} (more for the caption), or multimodal.pixel_shuffle=true")  # fmt: skip
    if llava is not None:
        problems.extend(f"multimodal.vision: {p}" for p in llava.vision.problems(par.tp) if "tensor" in p)
    return problems


def multimodal_path_problems(config: TrainConfig) -> list[str]:
    """Every ``data.path`` / ``train_path`` / ``valid_path`` prefix without a shards manifest."""
    from mcore_data.multimodal import manifest_path

    out = []
    for key in ("path", "train_path", "valid_path"):
        for prefix in getattr(config.data, key)[:1]:
            if not manifest_path(prefix).is_file():
                out.append(f"data.{key}: no multimodal shards at prefix {prefix!r}: {manifest_path(prefix)} does not "
                           "exist (fix the path, or write the shards with `mcore-data multimodal`)")  # fmt: skip
    return out


def multimodal_datasets(config: TrainConfig, llava: LlavaConfig, tokenizer: Tokenizer,
                        sizes: list[int]) -> tuple[Any, Any, Any]:  # fmt: skip
    """(train, valid, test) :class:`~mcore_data.multimodal_torch.MultimodalDataset`: the train set from
    ``data.path`` (or ``train_path``), sized ``sizes[0]`` (epochs in the seeded order), validation from
    ``data.valid_path`` (None without it), no test set."""
    from mcore_data.multimodal_torch import MultimodalConfig, MultimodalDataset
    from mcore_data.tiling import Tiling

    d, mm = config.data, config.multimodal
    norm: dict[str, Any] = {}
    if mm.image_mean:
        norm = {"mean": tuple(mm.image_mean), "std": tuple(mm.image_std)}
    tiling = Tiling(mm.max_tiles, thumbnail=mm.tile_thumbnail, tags=mm.tile_tags)
    mc = MultimodalConfig(image_token_id=llava.image_token_id, seq_length=d.seq_length,
                          image_size=llava.vision.image_size, image_tokens=llava.image_tokens, loss_on=mm.loss_on,
                          seed=d.seed, tiling=tiling, **norm)  # fmt: skip
    train_prefix = (d.path or d.train_path)[0]
    train = MultimodalDataset(train_prefix, tokenizer, mc, num_samples=max(sizes[0], 1))
    valid = None
    if d.valid_path:
        valid = MultimodalDataset(d.valid_path[0], tokenizer, dataclasses.replace(mc, seed=d.seed + 1),
                                  num_samples=max(sizes[1], 1))  # fmt: skip
    return train, valid, None


# settings that do not change a VLM's weights: a later stage may change them
_RUNTIME_LLAVA = ("freeze",)
_RUNTIME_VISION = ("params_dtype", "attention_dropout", "hidden_dropout", "seed", "extra", "vision_feature_layer")


def llava_diffs(saved: dict[str, Any], configured: LlavaConfig) -> list[str]:
    """``multimodal.<field>: checkpoint has X, config has Y`` for each tower / projector field that differs (the
    language model is compared as ``model.*`` by the trainer); ``freeze`` and runtime fields may differ."""
    out = []
    for k, v in saved.items():
        if k in ("vision", "language", *_RUNTIME_LLAVA):
            continue
        mine = getattr(configured, k, None)
        if mine != v:
            out.append(f"multimodal.{k}: checkpoint has {v!r}, config has {mine!r}")
    vision = configured.vision.to_dict()
    for k, v in saved.get("vision", {}).items():
        if k not in _RUNTIME_VISION and vision.get(k) != v:
            out.append(f"multimodal.vision_config.{k}: checkpoint has {v!r}, config has {vision.get(k)!r}")
    return out


def load_language(chunks: list[Any], path: str) -> Path:
    """``multimodal.language_load``: a GPT checkpoint's weights into the language model of every chunk."""
    from mcore_parallel.checkpoint import load_model, read_metadata
    from mcore_train.trainer import _explicit_load_path

    ckpt = _explicit_load_path(path, key="multimodal.language_load")
    saved = read_metadata(ckpt).get("model")
    if isinstance(saved, dict) and "language" in saved:
        raise ConfigError([f"multimodal.language_load={path}: {ckpt} is a vision-language checkpoint; give a GPT "
                           "(text-only) checkpoint, or use checkpoint.load for a VLM one"])  # fmt: skip
    for chunk in chunks:
        load_model(ckpt, chunk.language.sharded_state_dict())
    logger.info("language model loaded from %s", ckpt)
    return ckpt


def _vision_files(path: str) -> tuple[dict[str, Any], list[Path]]:
    d = Path(path)
    files = sorted(d.glob("*.safetensors")) if d.is_dir() else []
    if not (d / "config.json").is_file() or not files:
        raise ConfigError([f"multimodal.vision_load={path}: not a Hugging Face model directory (config.json and "
                           "*.safetensors: a CLIPVisionModel / SiglipVisionModel, CLIPModel or LLaVA save)"])  # fmt: skip
    import json

    return json.loads((d / "config.json").read_text()), files


def load_vision(chunks: list[Any], path: str, configured: VisionConfig) -> None:
    """``multimodal.vision_load``: a Hugging Face CLIP / SigLIP tower's weights into the first stage's tower; its
    config.json must describe the configured tower (each differing field is named)."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise ConfigError([f"multimodal.vision_load={path} reads safetensors: pip install 'mcore-train[hf]'"]) from None

    from mcore_models.hf_vision import hf_vision_prefix, vision_config_from_hf, vision_hf_to_mcore

    hf, files = _vision_files(path)
    try:
        saved = vision_config_from_hf(hf, vision_feature_layer=configured.vision_feature_layer)
    except MCoreModelsError as e:  # not a CLIP / SigLIP tower
        raise ConfigError([f"multimodal.vision_load={path}: {e}"]) from None
    mine, theirs = configured.to_dict(), saved.to_dict()
    skip = {*_RUNTIME_VISION, "init_method_std"}
    diffs = [f"multimodal.vision_config.{k}: {path} has {v!r}, the configured tower {mine.get(k)!r}"
             for k, v in theirs.items() if k not in skip and mine.get(k) != v]  # fmt: skip
    if diffs:
        raise ConfigError(diffs, header="the vision tower of multimodal.vision_load differs from the configured one")
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {k: h for h in handles for k in h.keys()}  # noqa: SIM118 (a safetensors handle is not iterable)
    state = dict(vision_hf_to_mcore(configured, lambda k: where[k].get_tensor(k), hf_vision_prefix(where)))
    for chunk in chunks:
        if chunk.pre_process:
            chunk.vision.load_global_state_dict(state)
    logger.info("vision tower loaded from %s", path)
