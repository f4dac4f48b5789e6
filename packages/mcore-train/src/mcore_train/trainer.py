"""Building a run: parallel state, model chunks, DDP, optimizer, scheduler, data, checkpoint resume.

:func:`setup` turns a validated :class:`~mcore_train.config.TrainConfig` into a :class:`Run`; the loop lives in
:mod:`mcore_train.loop`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mcore_data.torch import BatchConfig
from mcore_models import GPTModel, TransformerConfig
from mcore_models.backends import describe_backend
from mcore_models.hybrid import stage_layers
from mcore_models.multimodal import LlavaConfig, LlavaModel
from mcore_models.spec import default_spec
from mcore_models.transformer.ring_attention import context_parallel_spec
from mcore_parallel import ParallelState, ShardedTensor
from mcore_parallel.checkpoint import (
    CheckpointFormatError,
    CheckpointManager,
    latest_checkpoint,
    read_metadata,
)
from mcore_parallel.checkpoint.zarr_io import Verify
from mcore_parallel.context_parallel import resolve_cp_comm
from mcore_parallel.ddp import DistributedDataParallel
from mcore_parallel.optim import MixedPrecisionOptimizer, get_optimizer
from mcore_parallel.pipeline import sync_shared_embedding_weights
from mcore_parallel.tensor import RNGStatesTracker, model_parallel_seed, with_symmetric_memory
from mcore_parallel.topology import resolve_dp_comm, resolve_tp_comm
from mcore_train.config import TrainConfig
from mcore_train.data import MicroBatchIterator, RunData, build_run_data, build_tokenizer_for
from mcore_train.errors import ConfigError
from mcore_train.multimodal import is_multimodal, llava_config, llava_diffs, load_language, load_vision
from mcore_train.scheduler import LRScheduler
from mcore_train.speed import SpeedChoices, describe, resolve_speed

__all__ = ["Run", "setup", "build_model_chunks", "compile_layers", "rank_state", "restore_rank_state"]

logger = logging.getLogger(__name__)


@dataclass
class Run:
    config: TrainConfig
    state: ParallelState
    model_config: TransformerConfig
    chunks: list[Any]
    ddp: list[DistributedDataParallel]
    optimizer: MixedPrecisionOptimizer
    scheduler: LRScheduler
    tracker: RNGStatesTracker
    data: RunData
    batch_config: BatchConfig
    checkpoints: CheckpointManager | None
    train_iters: int
    step: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    skipped_steps: int = 0
    loaded_from: Path | None = None
    last_saved_step: int | None = None
    speed: SpeedChoices | None = None
    """The speed switches as resolved for this run's device (``training.compile``, the fusion)."""
    llava: LlavaConfig | None = None
    """A vision-language run's model (``multimodal.vision``): the chunks are LlavaModels whose LM is ``model_config``."""

    @property
    def items(self) -> dict[str, ShardedTensor]:
        """What a checkpoint holds of the model: every parameter, and the backend's runtime state (FP8 scaling
        histories; optional, so a checkpoint of another backend or recipe still loads)."""
        out: dict[str, ShardedTensor] = {}
        for chunk in self.chunks:
            out.update(chunk.sharded_state_dict())
            out.update(chunk.runtime_state_dict())
        return out

    def train_iterators(self) -> list[MicroBatchIterator]:
        """One iterator per model chunk (each chunk consumes every micro-batch once)."""
        return [self._iterator(self.data.train, self.consumed_samples) for _ in self.ddp]

    def eval_iterators(self, evaluation_index: int) -> list[MicroBatchIterator] | None:
        if self.data.valid is None:
            return None
        start = evaluation_index * self.config.training.eval_iters * self.config.training.global_batch_size
        return [self._iterator(self.data.valid, start) for _ in self.ddp]

    def _iterator(self, dataset: Any, start: int) -> MicroBatchIterator:
        mbs = self.config.training.micro_batch_size
        return MicroBatchIterator(dataset, self.batch_config, mbs, self.state.dp.rank, self.state.dp_size, start,
                                  self.state.device, self.config.multimodal.data_workers)  # fmt: skip


def build_model_chunks(
    config: TrainConfig,
    model_config: TransformerConfig,
    state: ParallelState,
    tracker: RNGStatesTracker | None,
    compile: str | None = None,
    llava: LlavaConfig | None = None,
) -> list[Any]:
    """The model chunks of this rank (LlavaModels with ``llava``, the tower and projector on the first stage);
    ``compile`` is ``training.compile`` resolved (default: resolved here for ``state.device``, see
    :func:`~mcore_train.speed.resolve_speed`)."""
    if compile is None:
        compile = resolve_speed(config, state.device).compile
    par = config.parallel
    vpp = par.vpp or 1
    cp_comm = resolve_cp_comm(par.cp_comm, config.data.seq_length, state.cp.size)
    spec = context_parallel_spec(default_spec(), state.cp, cp_comm)  # ring attention over cp (when cp > 1)
    if state.cp.size > 1 and state.rank == 0:
        logger.info("context parallelism: cp=%d, %d tokens per cp rank, ring attention with cp_comm=%s",
                    state.cp.size, config.data.seq_length // state.cp.size, cp_comm)  # fmt: skip
    chunks = []
    for v in range(vpp):
        layers = stage_layers(model_config, par.pp, state.pp.rank, vpp, v, par.first_stage_layers,
                              par.last_stage_layers)  # fmt: skip
        kind: Any = GPTModel if llava is None else LlavaModel  # a LlavaModel's LM is llava.language (model_config)
        chunks.append(
            kind(
                model_config if llava is None else llava,
                tp=state.tp,
                sequence_parallel=state.sequence_parallel,
                pre_process=state.is_first_stage and v == 0,
                post_process=state.is_last_stage and v == vpp - 1,
                layers=layers,
                rng_tracker=tracker,
                device=state.device,
                ep=state.ep,
                expert_tp=state.expert_tp,
                balance=state.tp_dp_cp,
                spec=spec,
            )
        )
    if compile == "layers":
        mode = config.training.compile_mode
        compile_layers(chunks, None if mode == "default" else mode)
    return chunks


def compile_layers(chunks: list[Any], mode: str | None = None) -> None:
    """Compile every transformer layer in place (parameter names and checkpoints are unchanged)."""
    for chunk in chunks:
        chunk.compile_layers(dynamic=False, mode=mode)
    logger.info(
        "compiled %d transformer layers with torch.compile",
        sum(len(getattr(c, "language", c).decoder.layers) for c in chunks),
    )


def rank_state(run: Run) -> dict[str, Any]:
    """RNG streams of this rank (saved with every checkpoint for exact resume)."""
    out: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "tracker": run.tracker.state_dict()}
    if run.state.device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(run.state.device)
    return out


def restore_rank_state(run: Run, saved: dict[str, Any] | None) -> None:
    if saved is None:
        logger.warning("no RNG state saved for rank %d: dropout masks after resume will differ", run.state.rank)
        return
    torch.set_rng_state(saved["torch_cpu"])
    if "cuda" in saved and run.state.device.type == "cuda":
        torch.cuda.set_rng_state(saved["cuda"], run.state.device)
    run.tracker.load_state_dict(saved["tracker"])


def _train_iters(config: TrainConfig) -> int:
    tr = config.training
    if tr.train_iters is not None:
        return tr.train_iters
    assert tr.train_tokens is not None
    return math.ceil(tr.train_tokens / (tr.global_batch_size * config.data.seq_length))


def _explicit_load_path(load: str, key: str = "checkpoint.load") -> Path:
    """``checkpoint.load``: a checkpoint directory, or a run directory whose ``latest`` names one; else an error."""
    p = Path(load)
    if not p.exists():
        raise CheckpointFormatError(f"{key}={load}: {p} does not exist")
    if not p.is_dir():
        raise CheckpointFormatError(f"{key}={load}: {p} is a file, not a checkpoint directory")
    if (p / "zarr.json").exists():
        return p
    found = latest_checkpoint(p)
    if found is None:
        raise CheckpointFormatError(
            f"{key}={load}: {p} is not a checkpoint (no {p / 'zarr.json'}) nor a run directory "
            f"with checkpoints (no {p / 'latest'})"
        )
    return found


def _load_path(config: TrainConfig) -> Path | None:
    ck = config.checkpoint
    if ck.load is not None:
        return _explicit_load_path(ck.load)
    if ck.dir is not None and ck.auto_resume:
        found = latest_checkpoint(ck.dir)
        if found is None:
            logger.info("no checkpoint in %s (no %s): starting from step 0", ck.dir, Path(ck.dir) / "latest")
        return found
    return None


def _with_tp_exchange(config: TrainConfig, state: ParallelState) -> ParallelState:
    """``state`` whose tensor-parallel group carries the exchange ``parallel.tp_comm`` resolves to on this machine
    (:func:`~mcore_parallel.topology.resolve_tp_comm`); the model chunks are built with that group."""
    tp_comm = resolve_tp_comm(config.parallel.tp_comm, config.parallel.sequence_parallel, state)
    if tp_comm == "p2p" and config.parallel.tp_comm_in_graph:  # tracing the linears needs PyTorch's fused ops
        tp_comm = "symmetric_memory"
    if tp_comm == "symmetric_memory":
        if state.device.type != "cuda":
            raise ConfigError(
                [
                    f"parallel.tp_comm=symmetric_memory needs CUDA GPUs (this run is on {state.device.type}); "
                    "use parallel.tp_comm=nccl"
                ]
            )
        tp = with_symmetric_memory(state.tp, in_graph=config.parallel.tp_comm_in_graph)
    elif tp_comm == "p2p":  # on CPU through shared memory (tests); on GPUs through symmetric memory
        tp = with_symmetric_memory(state.tp, exchange="mcore", chunks=config.parallel.tp_comm_chunks)
    else:
        return state
    return dataclasses.replace(state, tp=tp)


def _check_expert_groups(config: TrainConfig, state: ParallelState) -> None:
    """Expert tensor parallelism runs over the tensor-parallel ranks themselves, which depends on the rank order."""
    if config.model.moe is None or state.expert_tp.size == 1 or state.expert_tp.ranks == state.tp.ranks:
        return
    raise ConfigError([
        f"parallel.expert_tp={state.expert_tp.size} puts ranks {list(state.expert_tp.ranks)} in one expert "
        f"tensor-parallel group, but this rank's tensor-parallel group is {list(state.tp.ranks)}: with "
        f"parallel.order={config.parallel.order!r} they differ; put tp first in parallel.order (e.g. "
        "tp-cp-ep-dp-pp) or set parallel.expert_tp=1"
    ])  # fmt: skip


def _batch_config(config: TrainConfig, data: RunData) -> BatchConfig:
    """What each micro-batch carries; ``data.packing``: each token's document and positions restarting per
    document (from the EOD tokens)."""
    packing = config.data.packing
    if packing and "M" in (config.model.hybrid_pattern or ""):
        raise ConfigError([
            f"data.packing=true with Mamba layers (model.hybrid_pattern={config.model.hybrid_pattern!r}): the scan "
            "would carry its state across documents; set data.packing=false"
        ])  # fmt: skip
    return BatchConfig(eod_id=data.tokenizer.eod, eod_mask_loss=config.data.eod_mask_loss,
                       reset_position_ids=packing, document_ids=packing)  # fmt: skip


def setup(config: TrainConfig) -> Run:
    """Everything a run needs, resumed from a checkpoint when one is configured or found."""
    state = ParallelState.initialize(config.parallel, backend=config.parallel.backend, device=config.training.device)
    config.check_layout(state.world_size)
    _check_expert_groups(config, state)
    state = _with_tp_exchange(config, state)
    model_config = config.model
    tracker = model_parallel_seed(config.training.seed, tp_rank=state.tp.rank, pp_rank=state.pp.rank,
                                  device=state.device)  # fmt: skip
    speed = resolve_speed(config, state.device)
    if state.rank == 0:
        logger.info("%s", describe(speed))
        logger.info("%s", describe_backend(model_config))
    llava = llava_config(config, build_tokenizer_for(config).vocab_size) if is_multimodal(config) else None
    chunks = build_model_chunks(config, model_config, state, tracker, compile=speed.compile, llava=llava)
    path = _load_path(config)
    if llava is not None and path is None:  # pretrained parts, before the optimizer copies the weights
        if config.multimodal.language_load:
            load_language(chunks, config.multimodal.language_load)
        if config.multimodal.vision_load:
            load_vision(chunks, config.multimodal.vision_load, llava.vision)
    ddp_config = dataclasses.replace(
        config.parallel.ddp,
        use_distributed_optimizer=config.optimizer.use_distributed_optimizer,
        exchange=resolve_dp_comm(config.parallel.dp_comm, state),
        gradient_accumulation_fusion=speed.gradient_accumulation_fusion,
    )
    ddp = [DistributedDataParallel(c, state, ddp_config) for c in chunks]
    sync_shared_embedding_weights(ddp, state)
    optimizer = get_optimizer(config.optimizer, ddp, state)
    train_iters = _train_iters(config)
    scheduler = LRScheduler(config.scheduler, config.optimizer.lr, train_iters)
    data = build_run_data(config, train_iters, llava)
    batch_config = _batch_config(config, data)
    manager = None
    if config.checkpoint.dir is not None:
        manager = CheckpointManager(config.checkpoint.dir, state, keep_last=config.checkpoint.keep_last,
                                    async_save=config.checkpoint.async_save)  # fmt: skip
    run = Run(config, state, model_config, chunks, ddp, optimizer, scheduler, tracker, data, batch_config, manager,
              train_iters, speed=speed, llava=llava)  # fmt: skip
    if path is not None:
        _resume(run, path)
    return run


def _own_checkpoint(config: TrainConfig, path: Path) -> Path | None:
    """The latest checkpoint of this run's own ``checkpoint.dir`` when ``checkpoint.load`` (``path``) only gives the
    run its starting weights (fine-tuning, a new VLM stage): rerunning an interrupted fine-tune continues it, as
    Megatron's ``--load`` does beside ``--pretrained-checkpoint``, instead of starting it again from the weights."""
    ck = config.checkpoint
    if ck.load is None or ck.dir is None or not ck.auto_resume:
        return None
    found = latest_checkpoint(ck.dir)
    return None if found is None or found.resolve() == path.resolve() else found


def _resume(run: Run, path: Path, own: bool = False) -> None:
    meta = read_metadata(path)
    saved_model = meta.get("model")
    new_stage = _check_saved_model(run, path, saved_model)
    choice = run.config.checkpoint.verify
    verify: Verify = "sample" if choice == "sample" else choice not in ("off", False)
    manager = run.checkpoints or CheckpointManager(path.parent, run.state)
    if (run.config.checkpoint.finetune or new_stage) and not own:
        mine = _own_checkpoint(run.config, path)
        if mine is not None:
            logger.info("resuming this run from %s (checkpoint.load=%s gave it its starting weights)", mine, path)
            return _resume(run, mine, own=True)
        manager.load(run.items, None, path, verify=verify)  # weights only (every rank checks, then all load)
        # the optimizer's fp32 master weights must start from the loaded weights too
        _reseed_master(run)
        run.loaded_from = path
        logger.info("%s from the weights of %s", "a new training stage" if new_stage else "fine-tuning", path)
        return
    _, meta, saved_rank_state = manager.load(run.items, run.optimizer, path, verify=verify)
    run.step = int(meta.get("step", 0))
    run.consumed_samples = int(meta.get("consumed_samples", 0))
    run.consumed_tokens = int(meta.get("consumed_tokens", 0))
    run.skipped_steps = int(meta.get("skipped_steps", 0))
    if meta.get("loss_scaler") is not None and run.optimizer.scaler is not None:
        run.optimizer.scaler.load_state_dict(meta["loss_scaler"])
    restore_rank_state(run, saved_rank_state)
    run.loaded_from = path
    if run.config.checkpoint.dir is not None and path.parent.resolve() == Path(run.config.checkpoint.dir).resolve():
        run.last_saved_step = run.step  # resuming in place: this step's checkpoint exists already
    logger.info("resumed from %s at step %d (%d samples consumed)", path, run.step, run.consumed_samples)


def _check_saved_model(run: Run, path: Path, saved: dict[str, Any] | None) -> bool:
    """Refuse a checkpoint of another architecture; True when it is a VLM checkpoint of another training stage
    (another ``multimodal.freeze``: its optimizer holds other parameters, so only the weights load)."""
    if saved is None:
        return False
    is_vlm = "language" in saved
    if is_vlm != (run.llava is not None):
        what = "a vision-language (LLaVA) model" if is_vlm else "a text-only GPT model"
        fix = "set multimodal.vision as it was saved" if is_vlm else "use multimodal.language_load for a GPT checkpoint"
        raise ConfigError([f"checkpoint {path} holds {what}; {fix}"], header="the checkpoint does not fit the run")
    diffs = _model_diffs(TransformerConfig.from_dict(saved["language"] if is_vlm else saved), run.model_config)
    if run.llava is not None:
        diffs.extend(llava_diffs(saved, run.llava))
    if diffs:
        raise ConfigError(diffs, header=f"the model in {path} differs from the configured one")
    return run.llava is not None and tuple(saved.get("freeze", ())) != run.llava.freeze


# settings that change how the model runs, not what its weights are: a resumed run may change them (the layer
# backend too: every backend has the same parameters, and FP8 scaling state is optional in a checkpoint)
_RUNTIME_FIELDS = ("recompute", "recompute_modules", "recompute_num_layers", "cross_entropy_fusion", "attention_backend",
                   "attention_contiguous", "swiglu_backward", "params_dtype", "extra", "attention_dropout",
                   "hidden_dropout", "seed", "backend", "fp8", "fp8_recipe", "fp8_amax_compute_algo", "fp8_margin",
                   "fp8_modules", "fp8_first_layers_bf16", "fp8_last_layers_bf16", "fp8_allgather",
                   "fp8_wgrad", "defer_residual_add")  # fmt: skip
_RUNTIME_MOE_FIELDS = ("token_dispatcher",)
# how the scan, convolution and norm are computed, not what
_RUNTIME_MAMBA_FIELDS = ("scan", "chunk_size", "decode_kernel", "conv_kernel", "norm_kernel")
_SUBCONFIG_RUNTIME = {"moe": _RUNTIME_MOE_FIELDS, "mamba": _RUNTIME_MAMBA_FIELDS}


def _model_diffs(saved: TransformerConfig, configured: TransformerConfig) -> list[str]:
    """``model.<field>: checkpoint has X, config has Y`` for every architecture field that differs."""
    out: list[str] = []
    for f in dataclasses.fields(saved):
        a, b = getattr(saved, f.name), getattr(configured, f.name)
        if f.name == "fp8_amax_history_len" and a != b and _delayed(saved) and _delayed(configured):
            out.append(f"model.fp8_amax_history_len: checkpoint has {a}, config has {b} (the saved amax histories "
                       f"have {a} steps); set model.fp8_amax_history_len={a}")  # fmt: skip
        if f.name in _RUNTIME_FIELDS or f.name == "fp8_amax_history_len" or a == b:
            continue
        if f.name == "hybrid_pattern" and a is not None and b is not None and a.replace("|", "") == b.replace("|", ""):
            continue  # the same layers; '|' only places them on pipeline stages
        if f.name in _SUBCONFIG_RUNTIME and a is not None and b is not None:
            runtime = _SUBCONFIG_RUNTIME[f.name]
            out.extend(f"model.{f.name}.{g.name}: checkpoint has {getattr(a, g.name)!r}, config has "
                       f"{getattr(b, g.name)!r}" for g in dataclasses.fields(a)
                       if g.name not in runtime and getattr(a, g.name) != getattr(b, g.name))  # fmt: skip
            continue
        out.append(f"model.{f.name}: checkpoint has {a!r}, config has {b!r}")
    return out


def _delayed(config: TransformerConfig) -> bool:
    return config.layer_backend == "fp8" and config.fp8_recipe == "delayed"


def _reseed_master(run: Run) -> None:
    """Copy the (just loaded) model weights into the optimizer's fp32 master copies."""
    with torch.no_grad():
        for slot in run.optimizer.slots:
            src = slot.param.detach().reshape(-1)[slot.lo : slot.hi]
            slot.master.view(-1).copy_(src.float())
