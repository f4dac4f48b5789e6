"""LLaVA-style vision-language models: :class:`LlavaConfig`, :class:`LlavaModel`, the :class:`Projector`.

>>> from mcore_models.multimodal import LlavaModel, llava_preset
>>> model = LlavaModel(llava_preset("llava-tiny"))

Weights-only checkpoints: :mod:`mcore_models.multimodal.checkpoint`; Hugging Face ``LlavaForConditionalGeneration``
import and export: :mod:`mcore_models.hf_llava`.
"""

from mcore_models.multimodal.config import LLAVA_PRESETS, LlavaConfig, llava_preset
from mcore_models.multimodal.llava import LlavaModel
from mcore_models.multimodal.projector import Projector, pixel_shuffle

__all__ = ["LlavaConfig", "LlavaModel", "Projector", "pixel_shuffle", "LLAVA_PRESETS", "llava_preset"]
