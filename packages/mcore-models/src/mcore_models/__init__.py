"""mcore-models: TransformerConfig, layer specs and GPT models (GPT-2 and Llama families) on mcore-parallel.

>>> from mcore_models import GPTModel, preset
>>> model = GPTModel(preset("gpt2-124m").replace(num_layers=2), device="meta")
"""

from mcore_models.config import DTYPES, RopeScaling, TransformerConfig
from mcore_models.errors import ConfigError, ConversionError, MCoreModelsError
from mcore_models.flops import num_parameters, training_flops_per_token
from mcore_models.gpt import GPTModel
from mcore_models.mamba_config import MambaConfig
from mcore_models.presets import PRESETS, preset
from mcore_models.spec import LayerSpec, default_spec
from mcore_models.ssm import Mamba2Mixer, MambaLayer, ssd_scan
from mcore_models.transformer.context import ModelContext

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "TransformerConfig",
    "RopeScaling",
    "DTYPES",
    "GPTModel",
    "LayerSpec",
    "default_spec",
    "ModelContext",
    "MambaConfig",
    "Mamba2Mixer",
    "MambaLayer",
    "ssd_scan",
    "PRESETS",
    "preset",
    "num_parameters",
    "training_flops_per_token",
    "MCoreModelsError",
    "ConfigError",
    "ConversionError",
]
