"""mcore-export: Hugging Face export and import, TensorRT-LLM checkpoint export, streaming one tensor at a time.

>>> from mcore_export import export_hf, import_hf, export_trtllm
>>> export_hf("runs/llama/step_001000", "exports/llama-hf", dtype="bf16")  # doctest: +SKIP
"""

from mcore_export.errors import ExportError, LayoutError, MissingTensorError, OutputExistsError
from mcore_export.hf import export_hf, hf_config_for, import_hf
from mcore_export.trtllm import build_engine, export_trtllm, pipeline_layers, trtllm_architecture, trtllm_config

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "export_hf",
    "import_hf",
    "hf_config_for",
    "export_trtllm",
    "trtllm_config",
    "trtllm_architecture",
    "pipeline_layers",
    "build_engine",
    "ExportError",
    "OutputExistsError",
    "MissingTensorError",
    "LayoutError",
]
