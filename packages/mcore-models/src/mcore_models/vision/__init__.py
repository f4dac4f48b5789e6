"""Vision encoders for multimodal models: :class:`VisionConfig` and :class:`VisionEncoder` (CLIP / SigLIP ViTs).

>>> from mcore_models.vision import VisionEncoder, vision_preset
>>> encoder = VisionEncoder(vision_preset("tiny-clip"))

Import and export of Hugging Face ``CLIPVisionModel`` / ``SiglipVisionModel`` towers: :mod:`mcore_models.hf_vision`.
"""

from mcore_models.vision.config import VISION_PRESETS, VisionConfig, vision_preset
from mcore_models.vision.encoder import VisionEmbeddings, VisionEncoder

__all__ = ["VisionConfig", "VisionEncoder", "VisionEmbeddings", "VISION_PRESETS", "vision_preset"]
