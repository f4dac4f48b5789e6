"""Inference engines, sampling, a generation API and an OpenAI-compatible HTTP server for mcore models.

``LLM(checkpoint).generate(prompts, SamplingParams(...))`` for offline use; ``mcore-infer serve --checkpoint DIR``
for the HTTP server (``pip install mcore-infer[server]``).
"""

from mcore_infer._attention_host import AttentionLaunch
from mcore_infer.api import LLM, Generation, load_model
from mcore_infer.config import EngineConfig
from mcore_infer.decode import DECODE_PRESETS, DecodeLaunches, DecodeModel, DecodePlan, prepare_for_decode
from mcore_infer.engine import LLMEngine, RequestOutput
from mcore_infer.errors import (
    ContextLengthError,
    EngineDeadError,
    InferError,
    InvalidRequestError,
    MissingDependencyError,
    OverloadedError,
)
from mcore_infer.runner import ModelRunner, StepBatch
from mcore_infer.sampling import Sampler, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "DECODE_PRESETS",
    "AttentionLaunch",
    "ContextLengthError",
    "DecodeLaunches",
    "DecodeModel",
    "DecodePlan",
    "EngineConfig",
    "EngineDeadError",
    "Generation",
    "InferError",
    "InvalidRequestError",
    "LLM",
    "LLMEngine",
    "MissingDependencyError",
    "ModelRunner",
    "OverloadedError",
    "RequestOutput",
    "Sampler",
    "SamplingParams",
    "StepBatch",
    "__version__",
    "load_model",
    "prepare_for_decode",
]
