"""Transformer building blocks: attention, MLP, norms, RoPE and the layer."""
