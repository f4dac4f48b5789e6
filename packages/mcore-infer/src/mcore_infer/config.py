"""``EngineConfig``: sizes and switches of the engine, scheduler, KV cache and model runner."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_data.tiling import Tiling
from mcore_infer.decode import DecodeKernels, DecodePlan, check_decode_kernels

__all__ = ["MAMBA_SSM_DTYPES", "STEP_GRAPH_MAX_TOKENS", "EngineConfig"]

STEP_GRAPH_MAX_TOKENS = 2048
"""The largest step graph by default: a step of more tokens is GPU-bound, its host launches hidden behind it."""


MAMBA_SSM_DTYPES = ("float32", "bfloat16", "float16")
"""``EngineConfig.mamba_ssm_dtype``'s values."""


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
    """Most requests in the running batch; for models with Mamba layers also the request slots of their conv and SSM
    states, allocated at start (``mcore_infer.mamba_cache``)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decode tokens plus prefill chunks): the prefill chunk size."""
    max_queue: int = 4096
    """Most requests waiting for admission; more are refused as overloaded (HTTP 503)."""
    attention_backend: str = "auto"
    """``plain`` (gather + SDPA), ``triton`` (paged kernel) or ``auto`` (triton on CUDA when installed)."""
    cuda_graphs: bool = True
    """Capture steps as CUDA graphs (GPU, Triton attention backend): decode steps by batch size
    (``graph_batch_sizes``), other steps by token count (``step_graph_tokens``)."""
    lookahead: bool = True
    """Launch the next decode step before the host has read this step's tokens (the sampled ids feed the next step
    on the device), so scheduling and bookkeeping overlap the GPU. Only in steady decoding (no prefill, nobody
    waiting) and with one TP rank; outputs are identical to stepping without it (llama-1b on an H200: batch 1 at
    0.912 ms per token with it)."""
    side_stream_copies: bool = True
    """With ``lookahead`` and CUDA graphs: keep the copies off the decode steps' stream. The decode graphs are captured
    twice, over two input buffers used in turn, so the next step's inputs are uploaded on a side stream while this
    step runs; a greedy batch's argmax writes its tokens straight into the next step's input ids; the tokens are
    copied to the host on the side stream. Between two decode steps the stream then runs the argmax only, where it
    ran the argmax, the tokens' copy out, the inputs' copy in and the ids' copy. On by default: on one H100
    (llama-1b, same call) batch 1 took 0.970 against 0.987 ms a token and 64 requests 38,005 against 37,622 and
    37,922 tokens/s; the decode graphs' capture takes twice as long."""
    l2_prefetch: bool = False
    """Steps of at most 4 tokens with the Triton attention on Hopper or later: a row of programs added to each
    attention kernel pulls the layer's output-projection weight into L2 while the others attend (a short context's
    attention leaves HBM idle for its few microseconds), so the projection reads it from there
    (:mod:`mcore_infer.kernels.l2_prefetch`; no value changes). Off until a GPU times it against the default."""
    l2_prefetch_up_mb: float = 0.0
    """With ``l2_prefetch``: a second row of programs also pulls the first this many MB (2^20 bytes) of the layer's
    up projection's weight into L2, for the first programs of that GEMV (llama-1b's is 64 MB; L2 holds 50)."""
    compile: bool = False
    """``torch.compile`` each transformer layer (dynamic token count) before capturing CUDA graphs: the norms, RoPE,
    SwiGLU and residual adds become a few fused kernels; attention and KV-cache writes stay outside the graphs. Off by default
    in the Python API (compiling takes ~25 s on the first steps); ``mcore-infer serve`` / ``generate`` turn it on for a
    CUDA device unless ``--no-compile``."""
    decode_kernels: DecodeKernels | DecodePlan = "auto"
    """The serving-only fusions of each step (:mod:`mcore_infer.decode`): a preset name or a ``DecodePlan``.
    ``auto``: RoPE and the KV write inside the Triton attention kernels (Triton backend) and the deferred residual
    add everywhere, plus the one-row GEMV kernels of steps of at most 4 tokens on CUDA with the Triton backend and
    ``compile``, where the model allows them (tp=1, bias-free projections, SwiGLU for the down projection); each
    fusion a layer cannot take stays off for it. ``none``: no fusion; ``attention``: auto's without the row kernels;
    ``row``: with them; ``norm_linear``: RMSNorm inside the projections instead. A preset or plan other than
    ``auto`` is an error for a model that cannot take one of its fusions."""
    graph_batch_sizes: tuple[int, ...] | None = None
    """Batch sizes to capture; None: 1, 2, 4, 8, then multiples of 16 up to ``max_num_seqs``."""
    step_graph_tokens: tuple[int, ...] | None = None
    """Token counts of the step graphs: a step that is not decode-only (prefill chunks, alone or with decode
    tokens) of at most that many tokens, at most ``max_num_seqs`` requests and as many logits rows replays the graph
    of the next count up instead of launching each kernel from the host (:mod:`mcore_infer.graphs`; not for models
    with Mamba layers). None: 32, 64, ... doubling up to the first count that holds a whole step's token budget, at
    most 2048 (longer steps keep the GPU busy on their own). ``()``: none."""
    seed: int = 0
    """Seed of the generator used by requests without their own seed."""
    mamba_ssm_dtype: str = "float32"
    """Models with Mamba layers: the dtype of each request's SSM state, float32 (the scan's own precision: the engine
    equals the training forward) or bfloat16 / float16 (half the state memory, so twice the requests in it, and half
    the state traffic of a decode step, which is most of a Mamba layer's decode time; the state is rounded after
    every step)."""
    max_images: int = 8
    """Vision-language models: most images per request (more are refused, HTTP 400). With tiling each image is up
    to ``tiling().most_tiles`` tower inputs: a request's prefill encodes up to ``max_images * most_tiles`` tiles at
    once, and its prompt holds ``image_tokens`` tokens per tile."""
    image_mean: tuple[float, ...] | None = None
    """Vision-language models, with ``image_std``: the server normalises pixels in [0, 1] as ``(x - mean) / std``
    per channel (e.g. CLIP's ``(0.4815, 0.4578, 0.4082)`` / ``(0.2686, 0.2613, 0.2758)``), as the model was trained
    (mcore-data's ``MultimodalConfig.mean`` / ``std``); None: pixels stay in [0, 1], mcore-data's default."""
    image_std: tuple[float, ...] | None = None
    max_tiles: int | None = None
    """Vision-language models: image tiling as the model was trained (:mod:`mcore_data.tiling`): most grid tiles per
    image, 1 for no tiling. None (and for ``tile_thumbnail`` / ``tile_tags``): the checkpoint's ``multimodal``
    settings when ``LLM`` loads one, else :class:`~mcore_data.tiling.Tiling`'s defaults (no tiling)."""
    tile_thumbnail: bool | None = None
    """With tiling: the whole image as one more tile after the grid."""
    tile_tags: bool | None = None
    """With tiling: a text tag before each tile's image tokens (``<tile_1>``, ..., ``<tile_global_thumbnail>``)."""

    def tiling(self) -> Tiling:
        """How the server tiles each image (the unset fields at :class:`~mcore_data.tiling.Tiling`'s defaults)."""
        d = Tiling()
        return Tiling(d.max_tiles if self.max_tiles is None else self.max_tiles,
                      d.thumbnail if self.tile_thumbnail is None else self.tile_thumbnail,
                      d.tags if self.tile_tags is None else self.tile_tags)  # fmt: skip

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
        try:
            check_decode_kernels(self.decode_kernels)
        except ValueError as e:
            problems.append(str(e))
        if self.max_num_batched_tokens < self.max_num_seqs and self.max_num_batched_tokens < 1:
            problems.append("max_num_batched_tokens must be positive")
        if self.step_graph_tokens is not None and any(int(t) < 1 for t in self.step_graph_tokens):
            problems.append(f"step_graph_tokens={self.step_graph_tokens}: token counts must be positive")
        if self.attention_backend not in ("auto", "plain", "triton"):
            problems.append(f"attention_backend={self.attention_backend!r}: use auto, plain or triton")
        if self.mamba_ssm_dtype not in MAMBA_SSM_DTYPES:
            problems.append(f"mamba_ssm_dtype={self.mamba_ssm_dtype!r}: use {', '.join(MAMBA_SSM_DTYPES)}")
        if not self.l2_prefetch_up_mb >= 0:
            problems.append(f"l2_prefetch_up_mb={self.l2_prefetch_up_mb} must be >= 0")
        if self.max_images < 0:
            problems.append(f"max_images={self.max_images} must be >= 0")
        if (self.image_mean is None) != (self.image_std is None):
            problems.append("image_mean and image_std go together: give both or neither")
        elif self.image_std is not None and (len(self.image_std) != len(self.image_mean or ()) or 0 in self.image_std):
            problems.append(f"image_mean={self.image_mean} / image_std={self.image_std}: one non-zero std per mean")
        if self.max_tiles is not None and (type(self.max_tiles) is not int or self.max_tiles < 1):
            problems.append(f"max_tiles={self.max_tiles!r} must be an integer >= 1 (1: no tiling)")
        if problems:
            raise ValueError("; ".join(problems))

    def step_graph_sizes(self) -> list[int]:
        """The step graphs' token counts (see ``step_graph_tokens``)."""
        if self.step_graph_tokens is not None:
            return sorted({t for t in self.step_graph_tokens if t > 0})
        budget = max(self.max_num_batched_tokens, self.max_num_seqs)
        sizes = [32]
        while sizes[-1] < min(budget, STEP_GRAPH_MAX_TOKENS):
            sizes.append(sizes[-1] * 2)
        return sizes

    def graph_sizes(self) -> list[int]:
        if self.graph_batch_sizes is not None:
            return sorted({b for b in self.graph_batch_sizes if 0 < b <= self.max_num_seqs})
        sizes = [b for b in (1, 2, 4, 8) if b <= self.max_num_seqs]
        sizes += list(range(16, self.max_num_seqs + 1, 16))
        if sizes[-1] != self.max_num_seqs:
            sizes.append(self.max_num_seqs)
        return sizes
