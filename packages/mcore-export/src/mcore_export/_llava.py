"""LLaVA checkpoints in the Hugging Face export and import (:mod:`mcore_export.hf` dispatches here).

An mcore LLaVA checkpoint is a :class:`~mcore_models.multimodal.LlavaModel`'s arrays (``model/vision.*``,
``model/projector.*``, ``model/language.*``) with ``metadata["model"]`` = :meth:`LlavaConfig.to_dict` (a dict with
``vision`` and ``language``); the HF side is ``LlavaForConditionalGeneration``. Key layouts and configs come from
:mod:`mcore_models.hf_llava`; files, shards, dtype and tokenizer are handled as for GPT models.
"""

from __future__ import annotations

from typing import Any

from mcore_export.errors import LayoutError
from mcore_models.hf_llava import LLAVA_ARCHITECTURE
from mcore_models.multimodal import LlavaConfig, LlavaModel
from mcore_parallel import Group
from mcore_parallel.sharding import ShardedTensor

__all__ = ["is_llava_metadata", "is_llava_hf_config", "check_llava_layout", "llava_layout_infos"]


def is_llava_metadata(model: Any) -> bool:
    """Whether a checkpoint's ``metadata["model"]`` describes a LlavaModel (not a GPTModel)."""
    return isinstance(model, dict) and {"vision", "language"} <= set(model)


def is_llava_hf_config(hf: dict[str, Any]) -> bool:
    """Whether an HF ``config.json`` is LLaVA's (by architecture, else by model_type)."""
    arch = (hf.get("architectures") or [None])[0]
    return arch == LLAVA_ARCHITECTURE or (arch is None and hf.get("model_type") == "llava")


def check_llava_layout(config: LlavaConfig, tp: int, pp: int) -> None:
    """Refuse a tp x pp the model cannot be split into: the language model's rules, and the tower's heads and MLP
    divisible by tp (the tower lives on the first stage)."""
    lm = config.language
    problems = lm.problems(tp) + [f"vision: {p}" for p in config.vision.problems(tp)]
    if tp < 1 or pp < 1 or pp > lm.num_layers or problems:
        raise LayoutError(
            f"tp={tp}, pp={pp} does not fit the model ({lm.num_layers} language layers): "
            + "; ".join(problems or ["tp and pp must be at least 1 and pp at most language.num_layers"])
        )


def llava_layout_infos(config: LlavaConfig, tp: int) -> dict[str, ShardedTensor]:
    """Every global parameter of the LlavaModel by key, with the chunking a tp-way run saves it with."""
    meta_model = LlavaModel(config, tp=Group("tp", tuple(range(tp)), 0, None), device="meta")
    infos: dict[str, ShardedTensor] = {}
    for info in meta_model.sharded_state_dict().values():
        infos.setdefault(info.key, info)
    return infos
