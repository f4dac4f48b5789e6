"""Megatron-compatible indexed datasets, tokenizers, GPT and blended datasets, and the mcore-data CLI."""

__version__ = "0.1.0"

__all__ = ["__version__"]
