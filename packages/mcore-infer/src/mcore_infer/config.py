"""``EngineConfig``: sizes and switches of the engine, scheduler, KV cache and model runner."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineConfig", "ROW_KERNELS"]

ROW_KERNELS = ("fuse_swiglu_down", "fuse_proj_partials", "row_gemv")
"""The one-row Triton kernels of small decode steps. Each field is ``True`` (on; an error names what the model
lacks), ``False`` (off) or ``None`` (auto, the default): on when the runner is on CUDA with the Triton attention
backend, ``compile`` is set (their partial sums are summed inside the compiled residual add), ``fuse_norm_linear`` is
off and the model allows the kernel (tp=1, bias-free projections, SwiGLU for ``fuse_swiglu_down``); otherwise off.
Batch 1 on an H200 (llama-1b, the eighth session): 0.916 ms per token with the three on."""


@dataclass
class EngineConfig:
    """Every field has a default; ``None`` means "derive from the model or the device"."""

    block_size: int = 16
    """Tokens per KV-cache block (a power of two >= 16 for the GPU kernel)."""
    num_blocks: int | None = None
    """KV-cache blocks (one is reserved as scratch); None: from ``memory_fraction`` on GPU, else enough for
    ``max_num_seqs`` full-length requests."""
    memory_fraction: float = 0.85
    """On GPU, the share of device memory that weights, activations and the KV cache may use together."""
    max_model_len: int | None = None
    """Longest prompt + completion; None: the model's ``max_position_embeddings``."""
    max_num_seqs: int = 256
    """Most requests in the running batch."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decode tokens plus prefill chunks): the prefill chunk size."""
    max_queue: int = 4096
    """Most requests waiting for admission; more are refused as overloaded (HTTP 503)."""
    attention_backend: str = "auto"
    """``plain`` (gather + SDPA), ``triton`` (paged kernel) or ``auto`` (triton on CUDA when installed)."""
    cuda_graphs: bool = True
    """Capture decode steps as CUDA graphs (GPU only)."""
    lookahead: bool = True
    """Launch the next decode step before the host has read this step's tokens (the sampled ids feed the next step
    on the device), so scheduling and bookkeeping overlap the GPU. Only in steady decoding (no prefill, nobody
    waiting) and with one TP rank; outputs are identical to stepping without it (on by default since the eighth
    session: llama-1b on an H200, batch 1 0.912 ms per token with it)."""
    compile: bool = False
    """``torch.compile`` each transformer layer (dynamic token count) before capturing CUDA graphs: the norms, RoPE,
    SwiGLU and residual adds become a few fused kernels; attention and KV-cache writes run as before. Off by default
    in the Python API (compiling takes ~25 s on the first steps); ``mcore-infer serve`` / ``generate`` turn it on for a
    CUDA device unless ``--no-compile``."""
    fuse_rope: bool = True
    """Apply RoPE inside the Triton KV-write and paged-attention kernels (they read q, k and v straight from the QKV
    projection's output), instead of in kernels of their own: two fewer kernels per layer and step. Triton backend
    only; the same results up to rounding."""
    fuse_kv_write: bool = True
    """In decode steps (one new token per request), the paged-attention kernel takes each token's own key and value
    from its inputs and writes them to the cache itself, instead of a KV-write kernel first (one kernel fewer per
    layer and step). Triton backend only; the same results up to rounding."""
    fuse_residual: bool = True
    """Each layer's last residual add is done by the next layer, where its first norm reads the sum: with
    ``compile``, the add and the norm are one kernel (one kernel fewer per layer and step). Same results up to
    rounding."""
    fuse_norm_linear: bool = False
    """Steps of at most 16 tokens (small decode batches) run each RMSNorm inside the projection after it, with the
    residual add before it and SwiGLU after the up projection (one Triton kernel instead of three per norm; see
    ``GPTModel.fuse_norm_linear``). RMSNorm models with bias-free projections; the same results up to rounding."""
    fuse_swiglu_down: bool | None = None
    """None (auto) is on where it applies (see :data:`ROW_KERNELS`). Steps of at most 4 tokens compute each MLP's SwiGLU inside its down projection (a split-K Triton GEMV that
    reads ``[gate | up]``; ``GPTModel.fuse_swiglu_down``): one kernel fewer per layer. SwiGLU models without linear
    biases at tp=1; the same results up to rounding. Not with ``fuse_norm_linear`` (whose layers bypass the MLP)."""
    fuse_proj_partials: bool | None = None
    """None (auto) is on where it applies (see :data:`ROW_KERNELS`). Steps of at most 4 tokens compute each attention output projection as split-K float32 partial sums that the
    residual add after it sums (``GPTModel.fuse_proj_partials``; one Triton kernel, no cuBLAS split-K reduction).
    Bias-free projections at tp=1; the same results up to one rounding."""
    row_gemv: bool | None = None
    """None (auto) is on where it applies (see :data:`ROW_KERNELS`). Steps of at most 4 tokens run the QKV projection with the one-row Triton GEMV instead of cuBLAS
    (``GPTModel.use_row_gemv``). Bias-free projections at tp=1; the same results up to summation order. Not with
    ``fuse_norm_linear`` (whose kernels are those projections)."""
    graph_batch_sizes: tuple[int, ...] | None = None
    """Batch sizes to capture; None: 1, 2, 4, 8, then multiples of 16 up to ``max_num_seqs``."""
    seed: int = 0
    """Seed of the generator used by requests without their own seed."""

    def __post_init__(self) -> None:
        problems = []
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            problems.append(f"block_size={self.block_size} must be a power of two")
        if self.num_blocks is not None and self.num_blocks < 2:
            problems.append(f"num_blocks={self.num_blocks} must be at least 2")
        if not 0.0 < self.memory_fraction <= 1.0:
            problems.append(f"memory_fraction={self.memory_fraction} must be in (0, 1]")
        if self.max_num_seqs < 1:
            problems.append("max_num_seqs must be positive")
        if self.fuse_swiglu_down is True and self.fuse_norm_linear:
            problems.append(
                "fuse_swiglu_down and fuse_norm_linear are exclusive (norm_linear layers bypass the MLP's "
                "down-projection kernel); set one of them to False"
            )
        if self.row_gemv is True and self.fuse_norm_linear:
            problems.append("row_gemv and fuse_norm_linear are exclusive (both replace the QKV and up projections)")
        if self.fuse_proj_partials is True and self.fuse_norm_linear:
            problems.append(
                "fuse_proj_partials and fuse_norm_linear are exclusive (the fused norm reads the projection's "
                "summed output); set one of them to False"
            )
        if self.max_num_batched_tokens < self.max_num_seqs and self.max_num_batched_tokens < 1:
            problems.append("max_num_batched_tokens must be positive")
        if self.attention_backend not in ("auto", "plain", "triton"):
            problems.append(f"attention_backend={self.attention_backend!r}: use auto, plain or triton")
        if problems:
            raise ValueError("; ".join(problems))

    def graph_sizes(self) -> list[int]:
        if self.graph_batch_sizes is not None:
            return sorted({b for b in self.graph_batch_sizes if 0 < b <= self.max_num_seqs})
        sizes = [b for b in (1, 2, 4, 8) if b <= self.max_num_seqs]
        sizes += list(range(16, self.max_num_seqs + 1, 16))
        if sizes[-1] != self.max_num_seqs:
            sizes.append(self.max_num_seqs)
        return sizes
