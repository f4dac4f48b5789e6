"""TransformerConfig, layer specs and GPT models (GPT-2 and Llama families) built on mcore-parallel."""

__version__ = "0.1.0"

__all__ = ["__version__"]
