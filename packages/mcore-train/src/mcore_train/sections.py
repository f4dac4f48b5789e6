"""The sections of a training configuration that mcore-train owns, and the parallel section built on
``mcore_parallel``'s own configs.

Each is a small dataclass: every field has a default and a one-line doc; a field with a fixed set of values is a
``Literal`` (checked, with the choices named, by the loader in :mod:`mcore_train._typed`); ``__post_init__`` checks
ranges and combinations of fields. :class:`~mcore_train.config.TrainConfig` puts them together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mcore_parallel import ParallelConfig
from mcore_parallel.ddp import DDPConfig
from mcore_parallel.errors import ParallelConfigError
from mcore_train._typed import inline
from mcore_train.profiling import window_problem

__all__ = [
    "ParallelSection",
    "DataSection",
    "SchedulerSection",
    "TrainingSection",
    "CheckpointSection",
    "LoggingSection",
    "MultimodalSection",
]


def _raise(problems: list[str]) -> None:
    if problems:
        raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class ParallelSection(ParallelConfig):
    """How the model is split across ranks (dp is what remains of the world size) and how its gradients are reduced.

    It is the run's :class:`~mcore_parallel.ParallelConfig` (``tp``, ``pp``, ``cp``, ``ep``, ``expert_tp``, ``vpp``,
    ``order``, ``sequence_parallel``), which builds the :class:`~mcore_parallel.ParallelState`, and holds the run's
    :class:`~mcore_parallel.ddp.DDPConfig` as ``ddp``, whose fields are keys of this section too
    (``parallel.bucket_size``); the trainer fills in the DDP config's ``use_distributed_optimizer`` (from
    ``optimizer.use_distributed_optimizer``) and ``exchange`` (from ``dp_comm``). ``ep`` and ``expert_tp`` apply to
    the MoE layers of a model with ``model.moe``; their checks against the model are
    :meth:`~mcore_train.config.TrainConfig.check_layout`'s.
    """

    first_stage_layers: int | None = None
    """Layers on the first pipeline stage (the rest split evenly)."""
    last_stage_layers: int | None = None
    """Layers on the last pipeline stage."""
    ddp: DDPConfig = field(
        default_factory=DDPConfig,
        metadata=inline(("use_distributed_optimizer", "exchange", "gradient_accumulation_fusion")),
    )
    """Gradient buckets: ``bucket_size``, ``overlap_grad_reduce``."""
    gradient_accumulation_fusion: Literal["auto", True, False] = "auto"
    """Linear layers add their weight gradients into the float32 ``main_grad`` from the weight-gradient GEMM itself
    (the DDP config's ``gradient_accumulation_fusion``; weights the layers own, not a tied output layer's): true,
    false, or auto (true on CUDA, except with ``tp_comm_in_graph``; false on CPU; see :mod:`mcore_train.speed`)."""
    backend: str | None = None
    """torch.distributed backend; default nccl with CUDA, else gloo."""
    tp_comm: Literal["auto", "nccl", "symmetric_memory", "p2p"] = "auto"
    """How sequence-parallel linears exchange the sequence: nccl (collectives overlapped with the GEMMs),
    symmetric_memory (PyTorch's fused all-gather-matmul / matmul-reduce-scatter over peer-to-peer copies between the
    GPUs of one host; needs CUDA, tp > 1 and sequence_parallel), p2p (mcore's own exchange over the same symmetric
    memory: one barrier per exchange instead of three, no copy of the local shard on the compute stream; see
    ``mcore_parallel.tensor.p2p``; at tp2 + SP on 2x H200 92.3-94.4% of one GPU's tokens/s per GPU against 90.1%
    with symmetric_memory, which is +5% over nccl) or auto (where it applies: CUDA, tp > 1 with sequence_parallel,
    every rank of the tensor-parallel group on this host with peer access to this GPU: p2p at tp2, the size measured
    on GPUs, symmetric_memory at larger tp; else nccl)."""
    dp_comm: Literal["auto", "nccl", "p2p"] = "auto"
    """How the data-parallel gradient reduction and the distributed optimizer's parameter all-gather run: nccl
    (collectives), p2p (peer-to-peer copies between symmetric buffers on the copy engines, which run beside the
    backward's GEMMs where NCCL's kernels wait for free SMs; GPUs of one host with peer access, or CPU) or auto (p2p
    at dp2, the size measured on GPUs, with the whole data-parallel group on this host with peer access; else
    nccl)."""
    tp_comm_chunks: int = 2
    """With tp_comm=p2p: each peer's rows are pulled in this many pieces, each multiplied (or added) as soon as it
    arrives, so less of the copy waits after the local GEMM."""
    cp_comm: Literal["auto", "p2p", "allgather"] = "auto"
    """With cp > 1, how ring attention moves keys and values over the context-parallel group: p2p (a ring of
    sends to the next rank, each overlapped with a block's attention; two K/V blocks in memory), allgather (one
    all-gather of every rank's K/V, overlapped with the local block; the whole sequence's K/V in memory for the
    layer) or auto (p2p from 4096 tokens per cp rank, allgather below: ``mcore_parallel.context_parallel``)."""
    tp_comm_in_graph: bool = False
    """Experimental, with symmetric memory: let ``training.compile=layers`` trace the sequence-parallel linears into
    the compiled layers instead of breaking each layer's graph at them (less host work per step)."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        try:
            super().__post_init__()  # the layout's own checks
        except ParallelConfigError as e:
            problems.extend(e.problems)
        if self.tp_comm in ("symmetric_memory", "p2p") and (self.tp < 2 or not self.sequence_parallel):
            problems.append(
                f"tp_comm={self.tp_comm} applies to sequence-parallel layers: set tp > 1 (is {self.tp}) and "
                "sequence_parallel=true, or use tp_comm=nccl"
            )
        if self.tp_comm_chunks < 1:
            problems.append(f"tp_comm_chunks={self.tp_comm_chunks} must be at least 1")
        if self.tp_comm_in_graph and self.gradient_accumulation_fusion is True:
            problems.append(
                "tp_comm_in_graph=true with gradient_accumulation_fusion=true: the traced linears cannot add into "
                "main_grad in place; turn one of them off"
            )
        if self.tp_comm_in_graph and self.tp_comm in ("nccl", "p2p"):
            problems.append(
                f"tp_comm_in_graph=true traces PyTorch's fused ops (tp_comm={self.tp_comm}): set tp_comm=auto or "
                "symmetric_memory"
            )
        _raise(problems)


@dataclass
class DataSection:
    """Where samples come from."""

    path: list[str] = field(default_factory=list)
    """One prefix, or a blend 'weight prefix weight prefix ...', split into train/valid/test by ``split``."""
    train_path: list[str] = field(default_factory=list)
    """Per-split blends (instead of ``path``)."""
    valid_path: list[str] = field(default_factory=list)
    """Per-split blend of the validation set."""
    test_path: list[str] = field(default_factory=list)
    """Per-split blend of the test set."""
    split: str = "969,30,1"
    """Train/valid/test document weights when ``path`` is used."""
    mock: bool = False
    """Random tokens instead of files (for smoke tests and benchmarks)."""
    seq_length: int = 1024
    """Tokens per sample."""
    tokenizer: Literal["byte", "sentencepiece", "hf"] = "byte"
    """byte, sentencepiece or hf."""
    tokenizer_model: str | None = None
    """The SentencePiece .model or HF tokenizer.json (copied into every checkpoint)."""
    ordering: Literal["fast", "megatron"] = "fast"
    """Sample order: fast, or megatron (Megatron-LM's exact indices)."""
    cache_dir: str | None = None
    """Index cache directory (default next to the data)."""
    seed: int = 1234
    """Seed of the data shuffles."""
    eod_mask_loss: bool = False
    """No loss on end-of-document tokens."""
    packing: bool = False
    """Packed sequences: every sample holds documents back to back (as the dataset concatenates them), and attention
    stays inside each document (per-document causal attention, the boundaries after every EOD token), with position
    ids restarting per document (flex_attention with a document block mask on CUDA; see docs/training.md)."""
    multimodal: bool = False
    """Image-text data: ``path`` (or ``train_path``, with ``valid_path`` for validation) is the prefix of
    ``mcore-data multimodal`` shards, read by ``mcore_data.multimodal_torch.MultimodalDataset`` (needs
    ``multimodal.vision``; see docs/multimodal.md)."""

    def __post_init__(self) -> None:
        problems = []
        if self.seq_length < 2:
            problems.append(f"seq_length={self.seq_length} must be at least 2")
        if self.path and (self.train_path or self.valid_path or self.test_path):
            problems.append("give either data.path or data.train_path/valid_path/test_path, not both")
        _raise(problems)


@dataclass
class SchedulerSection:
    """The learning-rate schedule (the peak LR is ``optimizer.lr``)."""

    decay_style: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """cosine, linear, constant or wsd (warmup-stable-decay)."""
    warmup_iters: int = 0
    """Linear warmup from 0 to the peak LR."""
    decay_iters: int | None = None
    """Iterations from step 0 to the end of decay (default: training.train_iters)."""
    min_lr: float = 0.0
    """LR at the end of decay."""
    wsd_decay_iters: int | None = None
    """wsd: length of the final decay phase (default 10% of decay_iters)."""
    wsd_decay_style: Literal["linear", "cosine", "sqrt"] = "linear"
    """wsd: shape of the final decay."""

    def __post_init__(self) -> None:
        if self.warmup_iters < 0 or self.min_lr < 0:
            raise ValueError("warmup_iters and min_lr must be >= 0")


@dataclass
class TrainingSection:
    """Batch sizes, length of the run, evaluation and exit conditions."""

    micro_batch_size: int = 1
    """Samples per micro-batch per data-parallel rank."""
    global_batch_size: int = 8
    """Samples per optimizer step (micro-batch x dp x accumulation steps)."""
    rampup_batch_size: list[int] = field(default_factory=list)
    """Batch-size ramp-up: [start, increment, ramp samples] (Megatron's --rampup-batch-size)."""
    train_iters: int | None = 100
    """Stop after this many steps."""
    train_tokens: int | None = None
    """Or stop after this many tokens."""
    eval_interval: int | None = None
    """Evaluate on the validation split every N steps (and at the end); None: only at the end."""
    eval_iters: int = 10
    """Validation batches per evaluation (0 disables evaluation)."""
    exit_interval: int | None = None
    """Save and exit when the step number is a multiple of this (Megatron's --exit-interval)."""
    exit_duration_minutes: float | None = None
    """Save and exit after this much wall-clock time."""
    on_nan: Literal["stop", "skip"] = "stop"
    """On a nan/inf loss: stop (with the step named) or skip (drop the step's update)."""
    read_loss_every_step: bool = False
    """Read each step's loss on the host before its update (a host sync per step; the GPU idles while the next step
    is prepared). By default, when the optimizer can skip a nan/inf step on the device (fused AdamW, the default on
    GPUs), the loss is read one step later, after the next step is enqueued; a nan loss and a stop request then act
    one step later. For comparisons and debugging."""
    seed: int = 1234
    """Seed of initialisation and dropout."""
    device: str | None = None
    """Override the device (default: cuda with CUDA, else cpu)."""
    compile: Literal["auto", "none", "layers"] = "auto"
    """``torch.compile``: none, layers (each transformer layer compiled on its own: fuses norms, RoPE, SwiGLU and
    residual adds; one compilation shared by all layers of the same shape), or auto (layers on CUDA, except for MoE
    layers that train on auxiliary losses; none on CPU; see :mod:`mcore_train.speed`)."""
    compile_mode: Literal["default", "max-autotune-no-cudagraphs"] = "default"
    """``torch.compile`` mode of the compiled layers: default, or max-autotune-no-cudagraphs (inductor benchmarks its
    Triton GEMM templates against cuBLAS per shape and can fuse elementwise epilogues into them; compiles for
    minutes)."""
    generate_at_end: int = 0
    """Sample this many tokens from a prompt at the end (temperature 0.5, repetition penalty 1.2, seeded by
    ``training.seed``) and log the text (0: off)."""
    generate_prompt: str = "def "
    """The prompt for ``generate_at_end``."""

    def __post_init__(self) -> None:
        problems = []
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            problems.append("micro_batch_size and global_batch_size must be positive")
        if self.train_iters is None and self.train_tokens is None:
            problems.append("set training.train_iters or training.train_tokens")
        if self.rampup_batch_size and len(self.rampup_batch_size) != 3:
            problems.append("rampup_batch_size must be [start, increment, ramp samples]")
        _raise(problems)


@dataclass
class CheckpointSection:
    """Saving and loading."""

    dir: str | None = None
    """Where checkpoints go (None: never save)."""
    save_interval: int | None = None
    """Save every N steps (and always at the end and on SIGTERM/SIGINT or the time limit)."""
    keep_last: int | None = 3
    """Keep the newest N checkpoints."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    load: str | None = None
    """A checkpoint (or run directory) to start from; default: resume from ``dir`` if it has one."""
    finetune: bool = False
    """Load weights only: fresh optimizer, schedule, step 0 and data from the start."""
    auto_resume: bool = True
    """Resume from ``dir``'s latest checkpoint when present."""
    save_at_end: bool = True
    """Save when training ends."""
    verify: Literal["full", "sample", "off", False] = "full"
    """The CRC-32C checks while loading: ``full`` every chunk's, ``sample`` the first chunk of every array and one in
    eight of the others, ``off`` (which YAML reads as false) none. Every chunk's presence and size is always checked."""


@dataclass
class LoggingSection:
    """What is reported and where."""

    log_interval: int = 10
    """Log every N steps."""
    dir: str | None = None
    """Directory for metrics.jsonl and TensorBoard (default: the checkpoint dir)."""
    jsonl: bool = True
    """Write metrics.jsonl."""
    tensorboard: bool = False
    """Write TensorBoard events (pip install mcore-train[tensorboard])."""
    wandb_project: str | None = None
    """Log to Weights & Biases (pip install mcore-train[wandb])."""
    progress_bar: bool = True
    """A progress bar with ETA on rank 0."""
    peak_tflops: float | None = None
    """Peak bf16 TFLOP/s per GPU for MFU (default: known for H100/H200/A100)."""
    profile_steps: list[int] = field(default_factory=list)
    """Profile steps [first, end) with torch.profiler, e.g. [6, 8]: a kernel-time summary per profiled rank,
    profile-rank<R>.md, in the log directory."""
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """Ranks that profile."""
    profile_trace: bool = False
    """Also write the Chrome/Perfetto trace trace-rank<R>.json (large)."""

    def __post_init__(self) -> None:
        problems = []
        if self.log_interval < 1:
            problems.append(f"log_interval={self.log_interval} must be at least 1")
        window = window_problem(self.profile_steps)
        if window is not None:
            problems.append(window)
        _raise(problems)


@dataclass
class MultimodalSection:
    """A LLaVA-style vision-language model (``mcore_models.multimodal.LlavaModel``): ``model`` is its language
    model, ``vision`` names the tower; unset ``vision`` trains a text-only model (see docs/multimodal.md)."""

    vision: str | None = None
    """The vision tower's preset (``mcore_models.vision.vision_preset``: tiny-clip, tiny-siglip, clip-vit-l14-336,
    siglip-so400m-14-384); None: no tower, a text-only run."""
    vision_config: dict[str, Any] = field(default_factory=dict)
    """VisionConfig fields changed on top of the preset (``multimodal.vision_config.image_size=32``); the tower's
    ``params_dtype`` defaults to ``model.params_dtype``."""
    vision_feature_layer: int | None = None
    """The tower's hidden state the projector reads (-1 last, -2 LLaVA's; None: the preset's)."""
    projector: Literal["mlp", "linear"] = "mlp"
    """mlp (Linear, GELU, Linear: LLaVA-1.5) or linear."""
    projector_bias: bool = True
    """Biases on the projector's linears."""
    pixel_shuffle: bool = False
    """2x2 token reduction before the projector (InternVL / NVLM): a quarter of the image tokens."""
    vision_feature_select: Literal["patches", "all"] = "patches"
    """patches (the class token dropped) or all."""
    max_tiles: int = 1
    """Image tiling (NVLM / InternVL): each image cut into at most this many tower-sized tiles, the grid closest to
    its aspect ratio (mcore_data.tiling); 1: no tiling (the image resized to one tile)."""
    tile_thumbnail: bool = True
    """With tiling: the whole image resized to one tile follows its grid (when the grid has more than one tile)."""
    tile_tags: bool = True
    """With tiling: a text tag (<tile_1>, ..., <tile_global_thumbnail>) before each tile's image tokens."""
    image_token_id: int | None = None
    """The token the image embeddings replace; None: the tokenizer's vocabulary size (the first id the tokenizer
    never produces; model.vocab_size must exceed it)."""
    freeze: list[str] = field(default_factory=list)
    """Parts not trained: [vision, language] for stage 1 (projector pretraining), [vision] for stage 2."""
    loss_on: Literal["assistant", "all"] = "assistant"
    """Loss on the assistant turns (captions) and the final EOD, or on every text token; never on image tokens."""
    image_mean: list[float] = field(default_factory=list)
    """With ``image_std``: pixels normalized per channel (e.g. CLIP's [0.4815, 0.4578, 0.4082]); empty: [0, 1]."""
    image_std: list[float] = field(default_factory=list)
    """Per-channel standard deviation of the normalization (e.g. CLIP's [0.2686, 0.2613, 0.2758])."""
    data_workers: int = 0
    """DataLoader worker processes that decode and resize the images (0: in the training process); the batches are
    the same either way."""
    language_load: str | None = None
    """A GPT checkpoint (mcore-train's, or a run directory) loaded into the language model before training (the
    first stage of a VLM from a pretrained LM); ignored when resuming a VLM checkpoint."""

    vision_load: str | None = None
    """A Hugging Face vision tower (a directory with config.json and *.safetensors: CLIPVisionModel, SiglipVisionModel,
    CLIPModel or a LLaVA save) loaded into the tower before training; its config must match the configured tower
    (e.g. clip-vit-l14-336 for openai/clip-vit-large-patch14-336); ignored when resuming a VLM checkpoint."""

    def __post_init__(self) -> None:
        problems = []
        if len(self.image_mean) != len(self.image_std) or len(self.image_mean) not in (0, 3):
            problems.append("image_mean and image_std must both be 3 numbers (one per channel), or both empty")
        if self.data_workers < 0:
            problems.append(f"data_workers={self.data_workers} must be >= 0")
        if self.max_tiles < 1:
            problems.append(f"max_tiles={self.max_tiles} must be >= 1 (1: no tiling)")
        if self.image_token_id is not None and self.image_token_id < 0:
            problems.append(f"image_token_id={self.image_token_id} must be a non-negative token id")
        _raise(problems)
