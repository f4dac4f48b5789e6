"""Inference engines, sampling, a generation API and an OpenAI-compatible HTTP server for mcore models."""

__version__ = "0.1.0"

__all__ = ["__version__"]
