"""Configs, recipes, the pretraining entry point and training loop for mcore."""

__version__ = "0.1.0"

__all__ = ["__version__"]
