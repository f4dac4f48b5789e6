"""Export mcore checkpoints to Hugging Face and TensorRT-LLM formats, and import from Hugging Face."""

__version__ = "0.1.0"

__all__ = ["__version__"]
