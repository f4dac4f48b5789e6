"""The training configuration: a tree of small dataclasses, loaded from YAML plus dotted overrides.

``load_config(recipe=..., path=..., overrides=[...])`` starts from a named recipe (or defaults), merges a YAML file,
then applies ``section.key=value`` overrides, and validates everything in one pass: unknown keys (with a did-you-mean),
wrong types and invalid values are all reported together in one :class:`~mcore_train.errors.ConfigError`.
Combinations that depend on the world size (global batch vs micro-batch x dp, layers vs pipeline stages, heads vs
TP) are checked by :meth:`TrainConfig.check_layout` when the run starts. See ``docs/design/003-config.md`` for why
this is a small in-house loader rather than OmegaConf or similar.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mcore_models import TransformerConfig, preset
from mcore_models.errors import ConfigError as ModelConfigError
from mcore_parallel import ParallelConfig
from mcore_parallel.optim import OptimizerConfig
from mcore_train._typed import build, convert, suggest, to_plain
from mcore_train.errors import ConfigError
from mcore_train.profiling import window_problem

__all__ = [
    "TrainConfig",
    "ParallelSection",
    "DataSection",
    "SchedulerSection",
    "TrainingSection",
    "CheckpointSection",
    "LoggingSection",
    "load_config",
]


@dataclass
class ParallelSection:
    """How the model is split across ranks (dp is what remains of the world size)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    cp: int = 1
    """Context-parallel size (reserved: context parallelism is not implemented yet; must be 1)."""
    ep: int = 1
    """Expert-parallel size (reserved for MoE; must be 1 for dense models)."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B)."""
    order: str = "tp-cp-ep-dp-pp"
    """Rank order, fastest first."""
    sequence_parallel: bool = False
    """Sequence parallelism (with tp > 1)."""
    first_stage_layers: int | None = None
    """Layers on the first pipeline stage (the rest split evenly)."""
    last_stage_layers: int | None = None
    """Layers on the last pipeline stage."""
    overlap_grad_reduce: bool = True
    """Overlap gradient all-reduce / reduce-scatter with backward."""
    gradient_accumulation_fusion: bool = False
    """Linear layers add weight gradients straight into the float32 main_grad from their GEMM (no bf16 gradient
    and no separate add per micro-batch)."""
    bucket_size: int | None = 40_000_000
    """Gradient bucket size in elements."""
    backend: str | None = None
    """torch.distributed backend; default nccl with CUDA, else gloo."""
    tp_comm: str = "auto"
    """How sequence-parallel linears exchange the sequence: nccl (collectives overlapped with the GEMMs),
    symmetric_memory (PyTorch's fused all-gather-matmul / matmul-reduce-scatter over peer-to-peer copies between the
    GPUs of one host; needs CUDA, tp > 1 and sequence_parallel), p2p (mcore's own exchange over the same symmetric
    memory: one barrier per exchange instead of three, no copy of the local shard on the compute stream; see
    ``mcore_parallel.tensor.p2p``; at tp2 + SP on 2x H200 92.3-94.4% of one GPU's tokens/s per GPU against 90.1%
    with symmetric_memory, which is +5% over nccl) or auto (where it applies: CUDA, tp > 1 with sequence_parallel, every rank of the tensor-parallel group
    on this host with peer access to this GPU: p2p at tp2, the size measured on GPUs, symmetric_memory at larger tp;
    else nccl)."""

    dp_comm: str = "auto"
    """How the data-parallel gradient reduction and the distributed optimizer's parameter all-gather run: nccl
    (collectives), p2p (peer-to-peer copies between symmetric buffers on the copy engines, which run beside the
    backward's GEMMs where NCCL's kernels wait for free SMs; GPUs of one host with peer access, or CPU) or auto (p2p
    at dp2, the size measured on GPUs, with the whole data-parallel group on this host with peer access; else
    nccl)."""
    tp_comm_chunks: int = 2
    """With tp_comm=p2p: each peer's rows are pulled in this many pieces, each multiplied (or added) as soon as it
    arrives, so less of the copy waits after the local GEMM."""
    tp_comm_in_graph: bool = False
    """Experimental, with symmetric memory: let ``training.compile=layers`` trace the sequence-parallel linears into
    the compiled layers instead of breaking each layer's graph at them (less host work per step)."""

    def __post_init__(self) -> None:
        problems = []
        if self.tp_comm not in ("auto", "nccl", "symmetric_memory", "p2p"):
            problems.append(f"tp_comm={self.tp_comm!r} must be auto, nccl, symmetric_memory or p2p")
        elif self.tp_comm in ("symmetric_memory", "p2p") and (self.tp < 2 or not self.sequence_parallel):
            problems.append(
                f"tp_comm={self.tp_comm} applies to sequence-parallel layers: set tp > 1 (is {self.tp}) and "
                "sequence_parallel=true, or use tp_comm=nccl"
            )
        if self.dp_comm not in ("auto", "nccl", "p2p"):
            problems.append(f"dp_comm={self.dp_comm!r} must be auto, nccl or p2p")
        if self.tp_comm_chunks < 1:
            problems.append(f"tp_comm_chunks={self.tp_comm_chunks} must be at least 1")
        if self.tp_comm_in_graph and self.gradient_accumulation_fusion:
            problems.append(
                "tp_comm_in_graph=true with gradient_accumulation_fusion=true: the traced linears cannot add into "
                "main_grad in place; turn one of them off"
            )
        if self.tp_comm_in_graph and self.tp_comm in ("nccl", "p2p"):
            problems.append(
                f"tp_comm_in_graph=true traces PyTorch's fused ops (tp_comm={self.tp_comm}): set tp_comm=auto or "
                "symmetric_memory"
            )
        if self.cp != 1:
            problems.append(f"cp={self.cp}: context parallelism is not implemented yet; use cp=1")
        if self.ep != 1:
            problems.append(
                f"ep={self.ep}: expert parallelism needs MoE models, which are not implemented yet; use ep=1"
            )
        if problems:
            raise ValueError("; ".join(problems))

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, vpp=self.vpp, order=self.order,
            sequence_parallel=self.sequence_parallel,
        )  # fmt: skip


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
    tokenizer: str = "byte"
    """byte, sentencepiece or hf."""
    tokenizer_model: str | None = None
    """The SentencePiece .model or HF tokenizer.json (copied into every checkpoint)."""
    ordering: str = "fast"
    """Sample order: fast, or megatron (Megatron-LM's exact indices)."""
    cache_dir: str | None = None
    """Index cache directory (default next to the data)."""
    seed: int = 1234
    """Seed of the data shuffles."""
    eod_mask_loss: bool = False
    """No loss on end-of-document tokens."""

    def __post_init__(self) -> None:
        problems = []
        if self.tokenizer not in ("byte", "sentencepiece", "hf"):
            problems.append(f"tokenizer={self.tokenizer!r} must be byte, sentencepiece or hf")
        if self.ordering not in ("fast", "megatron"):
            problems.append(f"ordering={self.ordering!r} must be fast or megatron")
        if self.seq_length < 2:
            problems.append(f"seq_length={self.seq_length} must be at least 2")
        if self.path and (self.train_path or self.valid_path or self.test_path):
            problems.append("give either data.path or data.train_path/valid_path/test_path, not both")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class SchedulerSection:
    """The learning-rate schedule (the peak LR is ``optimizer.lr``)."""

    decay_style: str = "cosine"
    """cosine, linear, constant or wsd (warmup-stable-decay)."""
    warmup_iters: int = 0
    """Linear warmup from 0 to the peak LR."""
    decay_iters: int | None = None
    """Iterations from step 0 to the end of decay (default: training.train_iters)."""
    min_lr: float = 0.0
    """LR at the end of decay."""
    wsd_decay_iters: int | None = None
    """wsd: length of the final decay phase (default 10% of decay_iters)."""
    wsd_decay_style: str = "linear"
    """wsd: shape of the final decay (linear, cosine or sqrt)."""

    def __post_init__(self) -> None:
        problems = []
        if self.decay_style not in ("cosine", "linear", "constant", "wsd"):
            problems.append(f"decay_style={self.decay_style!r} must be cosine, linear, constant or wsd")
        if self.wsd_decay_style not in ("linear", "cosine", "sqrt"):
            problems.append(f"wsd_decay_style={self.wsd_decay_style!r} must be linear, cosine or sqrt")
        if self.warmup_iters < 0 or self.min_lr < 0:
            problems.append("warmup_iters and min_lr must be >= 0")
        if problems:
            raise ValueError("; ".join(problems))


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
    on_nan: str = "stop"
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
    compile: str = "none"
    """``torch.compile``: none, or layers (each transformer layer compiled on its own: fuses norms, RoPE, SwiGLU and
    residual adds; one compilation shared by all layers of the same shape)."""
    compile_mode: str = "default"
    """``torch.compile`` mode of the compiled layers: default, or max-autotune-no-cudagraphs (inductor benchmarks its
    Triton GEMM templates against cuBLAS per shape and can fuse elementwise epilogues into them; compiles for
    minutes)."""
    generate_at_end: int = 0
    """Greedily generate this many tokens from a prompt at the end and log the text (0: off)."""
    generate_prompt: str = "def "
    """The prompt for ``generate_at_end``."""

    def __post_init__(self) -> None:
        problems = []
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            problems.append("micro_batch_size and global_batch_size must be positive")
        if self.train_iters is None and self.train_tokens is None:
            problems.append("set training.train_iters or training.train_tokens")
        if self.on_nan not in ("stop", "skip"):
            problems.append(f"on_nan={self.on_nan!r} must be stop or skip")
        if self.compile not in ("none", "layers"):
            problems.append(f"compile={self.compile!r} must be none or layers")
        if self.compile_mode not in ("default", "max-autotune-no-cudagraphs"):
            problems.append(f"compile_mode={self.compile_mode!r} must be default or max-autotune-no-cudagraphs")
        if self.rampup_batch_size and len(self.rampup_batch_size) != 3:
            problems.append("rampup_batch_size must be [start, increment, ramp samples]")
        if problems:
            raise ValueError("; ".join(problems))


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
        if self.log_interval < 1:
            raise ValueError(f"log_interval={self.log_interval} must be at least 1")
        problem = window_problem(self.profile_steps)
        if problem is not None:
            raise ValueError(problem)


SECTIONS: dict[str, type] = {
    "parallel": ParallelSection,
    "data": DataSection,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerSection,
    "training": TrainingSection,
    "checkpoint": CheckpointSection,
    "logging": LoggingSection,
}


@dataclass
class TrainConfig:
    """The whole run. ``model`` holds a preset name and/or TransformerConfig fields."""

    model: TransformerConfig
    parallel: ParallelSection = field(default_factory=ParallelSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    recipe: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {name: to_plain(getattr(self, name)) for name in ("parallel", "data", "optimizer", "scheduler",
                                                               "training", "checkpoint", "logging")}  # fmt: skip
        return {"recipe": self.recipe, "model": self.model.to_dict(), **out}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def check_layout(self, world_size: int) -> None:
        """Every problem of this config for ``world_size`` ranks, in one ConfigError."""
        from mcore_parallel import RankLayout
        from mcore_parallel.pipeline import stage_layer_range

        problems: list[str] = []
        par, tr = self.parallel, self.training
        try:
            layout = RankLayout.build(par.parallel_config(), world_size)
            dp = layout.dp
        except ValueError as e:
            problems.extend(getattr(e, "problems", [str(e)]))
            dp = 0
        if dp:
            per_step = tr.micro_batch_size * dp
            if tr.global_batch_size % per_step:
                problems.append(
                    f"training.global_batch_size={tr.global_batch_size} is not divisible by micro_batch_size x dp = "
                    f"{tr.micro_batch_size} x {dp} = {per_step}"
                )
            if tr.rampup_batch_size:
                start, inc, _ = tr.rampup_batch_size
                if start % per_step or inc % per_step:
                    problems.append(
                        f"training.rampup_batch_size start {start} and increment {inc} must be multiples of "
                        f"micro_batch_size x dp = {per_step}"
                    )
            vpp = par.vpp or 1
            if par.pp > 1 and tr.global_batch_size // per_step < par.pp:
                problems.append(
                    f"pipeline parallelism needs at least pp={par.pp} micro-batches per step, but global_batch_size / "
                    f"(micro_batch_size x dp) = {tr.global_batch_size} / {per_step} = {tr.global_batch_size // per_step}"
                )
            if par.pp > 1 and vpp > 1 and (tr.global_batch_size // per_step) % par.pp:
                problems.append(
                    f"the interleaved schedule needs the number of micro-batches (global_batch_size / "
                    f"(micro_batch_size x dp) = {tr.global_batch_size // per_step}) to be a multiple of pp={par.pp}"
                )
        try:
            for pp_rank in range(par.pp):
                for vpp_rank in range(par.vpp or 1):
                    stage_layer_range(self.model.num_layers, par.pp, pp_rank, par.vpp or 1, vpp_rank,
                                      par.first_stage_layers, par.last_stage_layers)  # fmt: skip
        except ValueError as e:
            problems.append(f"parallel: {e}")
        problems.extend(f"model: {p}" for p in self.model.problems(par.tp) if "tensor-parallel" in p)
        if par.sequence_parallel and self.data.seq_length % par.tp:
            problems.append(
                f"data.seq_length={self.data.seq_length} must be divisible by tp={par.tp} with sequence_parallel"
            )
        if (
            self.model.position_embedding == "learned_absolute"
            and self.data.seq_length > self.model.max_position_embeddings
        ):
            problems.append(
                f"data.seq_length={self.data.seq_length} exceeds model.max_position_embeddings="
                f"{self.model.max_position_embeddings} (learned positions)"
            )
        sc = self.scheduler
        decay = sc.decay_iters if sc.decay_iters is not None else tr.train_iters
        if decay is not None and sc.decay_style != "constant" and sc.warmup_iters > decay:
            problems.append(
                f"scheduler.warmup_iters={sc.warmup_iters} exceeds the decay length {decay} "
                "(scheduler.decay_iters, default training.train_iters)"
            )
        if self.data.tokenizer != "byte" and not self.data.tokenizer_model:
            problems.append(f"data.tokenizer={self.data.tokenizer!r} needs data.tokenizer_model (the model file)")
        if not (self.data.mock or self.data.path or self.data.train_path):
            problems.append("no training data: set data.path (or data.train_path), or data.mock=true")
        if problems:
            raise ConfigError(problems, header=f"the configuration does not fit {world_size} rank(s)")


# ---------------------------------------------------------------------------------------------------- loading
def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError([f"{dotted}: {k} is not a section"])
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``optimizer.lr=3e-4`` → (``optimizer.lr``, the YAML value of ``3e-4``)."""
    if "=" not in text:
        raise ConfigError([f"override {text!r} must look like section.key=value (e.g. optimizer.lr=3e-4)"])
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else ""
    return key.strip(), value


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _build_model(data: Mapping[str, Any], errors: list[str]) -> TransformerConfig | None:
    data = dict(data)
    name = data.pop("preset", None)
    hints = typing.get_type_hints(TransformerConfig)
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    values: dict[str, Any] = {}
    for k, v in data.items():
        if k not in fields:
            errors.append(f"model.{k}: unknown key{suggest(k, [*fields, 'preset'])}")
            continue
        if k == "rope_scaling" and isinstance(v, Mapping):
            values[k] = dict(v)
            continue
        converted = convert(v, hints[k], f"model.{k}", errors)
        if converted is not None or v is None:
            values[k] = converted
    try:
        if name is not None:
            return preset(str(name), **values)
        return TransformerConfig(**values)
    except KeyError as e:
        errors.append(f"model.preset: {e.args[0]}")
    except ModelConfigError as e:
        errors.extend(f"model: {p}" for p in e.problems)
    except TypeError as e:
        errors.append(f"model: {e}")
    return None


def load_config(
    recipe: str | None = None,
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    base: Mapping[str, Any] | None = None,
) -> TrainConfig:
    """Recipe (or defaults) ← YAML file ← dotted overrides, validated all at once."""
    from mcore_train.recipes import recipe_tree

    tree: dict[str, Any] = {}
    if recipe is not None:
        tree = recipe_tree(recipe)
    if base is not None:
        tree = _merge(tree, base)
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError([f"config file {path} does not exist"]) from None
        except yaml.YAMLError as e:
            raise ConfigError([f"{path}: not valid YAML: {e}"]) from None
        if not isinstance(loaded, dict):
            raise ConfigError([f"{path}: the top level must be a mapping of sections"])
        if "recipe" in loaded and recipe is None:
            tree = _merge(recipe_tree(str(loaded["recipe"])), tree)
        tree = _merge(tree, loaded)
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    return _from_tree(tree, recipe)


def _from_tree(tree: Mapping[str, Any], recipe: str | None) -> TrainConfig:
    errors: list[str] = []
    known = [*SECTIONS, "model", "recipe"]
    for key in tree:
        if key not in known:
            errors.append(f"{key}: unknown section{suggest(key, known)}")
    model = _build_model(tree.get("model", {}) or {}, errors)
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        raw = tree.get(name, {}) or {}
        if not isinstance(raw, Mapping):
            errors.append(f"{name}: expected a mapping, got {raw!r}")
            continue
        sections[name] = build(cls, raw, name, errors)
    if errors:
        raise ConfigError(errors)
    assert model is not None
    return TrainConfig(model=model, recipe=tree.get("recipe", recipe), **sections)
