"""``MixedPrecisionOptimizer``: fp32 master weights, fp16 loss scaling, global clipping, per-parameter state access.

The optimizer steps fp32 *master* tensors: the parameters themselves when they are fp32, fp32 copies when they are
bf16/fp16 (updated values are cast back after the step). Gradients come from ``param.main_grad`` (DDP's fp32
buffer) or, for unwrapped modules, ``param.grad``. One step: unscale (fp16) and skip on inf/nan found on any rank,
global norm over model-parallel ranks, clip, count zeros, the torch optimizer's step (``foreach`` on CPU,
``fused`` on CUDA), copy back.

The norm and the zero count take every distinct gradient element once: a rank counts a parameter's gradient only
where it owns it (:meth:`MixedPrecisionOptimizer._counts_in_norm`). When the expert layout differs from the dense
one (``ep > 1`` or another expert tensor-parallel split), the sums run over the whole world and a replicated
parameter is counted on the first rank of its data-parallel group only (``dp_cp`` for dense parameters,
``expert_dp`` for expert ones, see :func:`mcore_parallel.sharding.data_parallel_group`). :class:`~mcore_parallel.optim.distributed.DistributedOptimizer` changes only which
slice of each parameter this rank owns and how updated values return to the model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mcore_parallel.ddp.ddp import DistributedDataParallel
from mcore_parallel.optim.clip import clip_coefficient, clip_grads_, count_zeros_tensor, global_grad_norm_tensor
from mcore_parallel.optim.config import OptimizerConfig
from mcore_parallel.optim.scaler import ConstantLossScaler, DynamicLossScaler, LossScaler
from mcore_parallel.sharding import ShardedTensor, data_parallel_group, shard_group, shard_info
from mcore_parallel.state import Group, ParallelState
from mcore_parallel.tensor import _comm

__all__ = ["MixedPrecisionOptimizer", "StepResult", "ParamShardState", "default_no_weight_decay"]

logger = logging.getLogger(__name__)


def default_no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Biases and 1-D parameters (norm weights) get no weight decay."""
    return name.endswith("bias") or param.dim() < 2


@dataclass(frozen=True)
class StepResult:
    success: bool
    """False when the step was skipped (inf/nan gradients under fp16 loss scaling)."""
    grad_norm_tensor: torch.Tensor | None
    """Global gradient norm before clipping, on the device (None when skipped): reading it is not part of the step."""
    num_zeros_tensor: torch.Tensor | None
    """Zero gradient elements over all ranks, each counted once, on the device (None when skipped or not asked)."""
    loss_scale: float | None
    """The loss scale the gradients were divided by (None without fp16)."""
    skipped: torch.Tensor | None = None
    """With ``step(skip_if_nonfinite=...)``: 1.0 on the device when the fused kernel left the weights unchanged (a
    non-finite loss or gradient norm), else 0.0; None when the host decided (``success`` says it)."""

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm as a float (synchronises with the device; a loop reads it when it logs)."""
        return None if self.grad_norm_tensor is None else float(self.grad_norm_tensor.item())

    @property
    def num_zeros(self) -> int | None:
        """The zero count as an int (synchronises with the device)."""
        return None if self.num_zeros_tensor is None else int(self.num_zeros_tensor.item())


@dataclass(eq=False)
class _Slot:
    name: str
    param: nn.Parameter
    master: torch.Tensor
    lo: int
    hi: int
    counts_in_norm: bool
    decay: bool


@dataclass
class ParamShardState:
    """What this rank holds of one parameter's optimizer state, addressed in the parameter's global shape.

    The local parameter (``local_shape``) is this tensor-parallel (and, for experts, expert-parallel) rank's piece
    of the global (unsharded, unpadded) tensor, as described by :func:`mcore_parallel.sharding.shard_info` over
    ``tp`` (:func:`mcore_parallel.sharding.shard_group`); this rank holds elements
    ``flat_range`` of the local parameter flattened. ``tensors`` maps ``master``, ``exp_avg``, ``exp_avg_sq`` or
    ``momentum_buffer`` to 1-D tensors of that range. :meth:`select` and :meth:`place` convert between global
    tensors and this rank's piece, so a checkpoint can be resharded to any tp/pp/dp layout.
    """

    name: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    flat_range: tuple[int, int]
    step: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    param: torch.Tensor | None = field(default=None, repr=False)
    tp: Group | None = field(default=None, repr=False)

    def _info(self, local: torch.Tensor) -> ShardedTensor:
        return shard_info(self.name, local, self.tp or Group.single(), like=self.param)

    def select(self, global_tensor: torch.Tensor) -> torch.Tensor:
        """This rank's 1-D piece of a tensor given in the global shape."""
        local = torch.zeros(self.local_shape, dtype=global_tensor.dtype, device=global_tensor.device)
        self._info(local).load_from(global_tensor)
        return local.reshape(-1)[self.flat_range[0] : self.flat_range[1]]

    def place(self, global_tensor: torch.Tensor, piece: torch.Tensor) -> None:
        """Write this rank's 1-D ``piece`` into a tensor of the global shape (assembling a checkpoint)."""
        local = torch.zeros(self.local_shape, dtype=global_tensor.dtype, device=global_tensor.device)
        info = self._info(local)
        info.load_from(global_tensor)
        local.view(-1)[self.flat_range[0] : self.flat_range[1]] = piece.to(local)
        info.scatter_into(global_tensor)


def expert_layout_is_dense(state: ParallelState) -> bool:
    """Whether the expert groups are the dense ones (``expert_tp`` = ``tp`` and ``expert_dp`` = ``dp_cp`` on every
    rank, e.g. ``ep == 1`` with the default ``expert_tp``): then expert parameters count in the norm like dense ones.
    The same answer on every rank (it reads the whole layout)."""
    groups = state.layout.groups
    return groups["expert_tp"] == groups["tp"] and groups["expert_dp"] == groups["dp_cp"]


def named_trainable_params(chunks: Sequence[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """``(name, param)`` of every chunk (DDP unwrapped); names must be unique across chunks."""
    out: list[tuple[str, nn.Parameter]] = []
    seen: set[str] = set()
    for chunk in chunks:
        module = chunk.module if isinstance(chunk, DistributedDataParallel) else chunk
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            if name in seen:
                raise ValueError(
                    f"parameter name {name!r} appears in more than one model chunk; give chunks globally unique "
                    "parameter names (e.g. global layer numbers) so optimizer state can be checkpointed"
                )
            seen.add(name)
            out.append((name, p))
    return out


class MixedPrecisionOptimizer:
    """Optimizer over ``model_chunks`` (plain modules or DDP-wrapped) with fp32 master weights."""

    def __init__(
        self,
        model_chunks: Sequence[nn.Module],
        state: ParallelState,
        config: OptimizerConfig | None = None,
        *,
        no_weight_decay: Callable[[str, torch.Tensor], bool] = default_no_weight_decay,
    ) -> None:
        self.chunks, self.state = list(model_chunks), state
        self.config = config = config or OptimizerConfig()
        named = named_trainable_params(self.chunks)
        if not named:
            raise ValueError("the model chunks have no trainable parameters")
        self.fp16 = any(p.dtype == torch.float16 for _, p in named)
        self.scaler: LossScaler | None = None
        if self.fp16:
            self.scaler = (
                ConstantLossScaler(config.loss_scale)
                if config.loss_scale is not None
                else DynamicLossScaler(
                    config.initial_loss_scale, config.min_loss_scale, config.loss_scale_window, config.hysteresis
                )
            )
        self.slots = self._build_slots(named, no_weight_decay)
        self.optimizer = _torch_optimizer(self.slots, config, state.device)
        self._step_count = 0

    # ------------------------------------------------------------------------------------------- layout hooks
    dp_sharded = False
    """Whether data-parallel ranks hold disjoint shards of the gradients (the distributed optimizer)."""

    @property
    def norm_group(self) -> Group:
        """Ranks whose counted gradients are disjoint pieces of the model: tensor x pipeline parallel, or the world
        when expert parameters are laid out differently from dense ones (see the module docstring)."""
        return self.state.mp if expert_layout_is_dense(self.state) else self.state.world

    def _counts_in_norm(self, p: torch.Tensor) -> bool:
        """Whether this rank's gradient of ``p`` counts in the norm: each distinct element on exactly one rank of
        :attr:`norm_group` (TP-replicated tensors on tensor-parallel rank 0, data-parallel replicas on their first
        rank when the norm runs over the world, the shared embedding on the first stage)."""
        if getattr(p, "shared_embedding", False) and not self.state.is_first_stage:
            return False
        if not self.dp_sharded and self.norm_group is self.state.world and data_parallel_group(p, self.state).rank:
            return False
        return bool(getattr(p, "tensor_model_parallel", False)) or shard_group(p, self.state).rank == 0

    def _build_slots(
        self, named: list[tuple[str, nn.Parameter]], no_wd: Callable[[str, torch.Tensor], bool]
    ) -> list[_Slot]:
        slots = []
        for name, p in named:
            master = p if p.dtype == torch.float32 else p.detach().float().clone()
            slots.append(_Slot(name, p, master, 0, p.numel(), self._counts_in_norm(p), not no_wd(name, p)))
        return slots

    def _grad_of(self, s: _Slot) -> torch.Tensor | None:
        g = getattr(s.param, "main_grad", None)
        g = s.param.grad if g is None else g
        if g is None:
            return None
        return g.float().view(s.master.shape) if s.lo == 0 and s.hi == s.param.numel() else g.reshape(-1)[s.lo : s.hi]

    @torch.no_grad()
    def _copy_to_model(self) -> None:
        pairs = [(s.param.data, s.master) for s in self.slots if s.master is not s.param]
        if pairs:  # one multi-tensor copy (with the cast to the model dtype) instead of a kernel per parameter
            torch._foreach_copy_([p for p, _ in pairs], [m.view(p.shape) for p, m in pairs])

    # ------------------------------------------------------------------------------------------- public API
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply the loss by the fp16 loss scale (identity otherwise); pass as the schedule's grad_scale_func."""
        return loss if self.scaler is None else loss * self.scaler.scale

    @property
    def param_groups(self) -> list[dict]:
        return [] if self.optimizer is None else self.optimizer.param_groups

    def master_params(self) -> list[torch.Tensor]:
        return [s.master for s in self.slots]

    def zero_grad(self) -> None:
        """Zero DDP gradient buffers (or drop ``.grad`` of plain modules) of every chunk."""
        for chunk in self.chunks:
            if isinstance(chunk, DistributedDataParallel):
                chunk.zero_grad_buffer()
            else:
                for p in chunk.parameters():
                    p.grad = None

    @property
    def skips_on_device(self) -> bool:
        """Whether :meth:`step` can drop a step on the device (``skip_if_nonfinite``): AdamW's fused kernel without
        fp16 loss scaling. A loop then need not read the loss before stepping (no host sync per step). The same on
        every rank: it follows the config and the device, not what this rank owns."""
        fused = self.config.fused if self.config.fused is not None else self.state.device.type == "cuda"
        return fused and self.scaler is None and self.config.optimizer == "adam"

    @torch.no_grad()
    def step(self, count_zeros: bool | None = None, skip_if_nonfinite: torch.Tensor | None = None) -> StepResult:
        """Unscale, check, clip and apply the gradients; copy the new weights to the model.

        ``count_zeros`` (default: ``config.log_num_zeros_in_grad``) counts the exactly-zero gradient elements, a
        pass over every gradient (left on the device: ``StepResult.num_zeros`` reads it): a training loop asks for
        it only on the steps it logs.
        ``skip_if_nonfinite`` (a device scalar, e.g. the step's loss; needs :attr:`skips_on_device`): the fused
        kernel leaves weights, moments and step count unchanged when it or the global gradient norm is inf/nan,
        decided on the device; ``StepResult.skipped`` says which happened.
        """
        if count_zeros is None:
            count_zeros = self.config.log_num_zeros_in_grad
        if skip_if_nonfinite is not None and not self.skips_on_device:
            raise ValueError(
                "step(skip_if_nonfinite=...) needs the fused AdamW kernel without fp16 loss scaling "
                f"(optimizer={self.config.optimizer!r}, fused={self.config.fused}, device={self.state.device}, "
                f"fp16 scaler={self.scaler is not None}); read the loss on the host and skip the call instead"
            )
        owned = [(s, self._grad_of(s)) for s in self.slots]
        grads = [g for _, g in owned if g is not None]
        counted = [g for s, g in owned if g is not None and s.counts_in_norm]
        try:
            scale = None
            if self.scaler is not None:
                scale = self.scaler.scale
                if grads:
                    torch._foreach_mul_(grads, 1.0 / scale)
                found = torch.zeros(1, dtype=torch.float32, device=self.state.device)
                for g in grads:
                    found = torch.maximum(found, (~torch.isfinite(g)).any().float())
                _comm.all_reduce(found, self.state.world, op=dist.ReduceOp.MAX)
                self.scaler.update(bool(found.item()))
                if found.item():
                    logger.warning("step skipped: inf/nan gradients (loss scale was %g)", scale)
                    return StepResult(False, None, None, scale)
            # no host synchronisation from here on: the norm and the clip factor stay on the device
            norm = global_grad_norm_tensor(counted, self.norm_group, self.state.device)
            zeros = count_zeros_tensor(counted, self.norm_group, self.state.device) if count_zeros else None
            grad_scale = None
            if self.config.clip_grad > 0:
                if self._fused_kernel():
                    # the fused kernel divides each gradient by grad_scale as it reads it: clipping costs no pass
                    grad_scale = 1.0 / clip_coefficient(self.config.clip_grad, norm)
                else:
                    clip_grads_(grads, self.config.clip_grad, norm)
            skipped = None
            if skip_if_nonfinite is not None:
                skipped = (~torch.isfinite(skip_if_nonfinite.reshape(())) | ~torch.isfinite(norm.reshape(()))).float()
            for slot, grad in owned:
                if grad is not None:
                    slot.master.grad = grad.view(slot.master.shape)
            if self.optimizer is not None:
                self.optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
                self.optimizer.found_inf = skipped  # type: ignore[attr-defined]
                self.optimizer.step()
            self._copy_to_model()
            self._step_count += 1
            return StepResult(True, norm, zeros, scale, skipped)
        finally:
            for s in self.slots:
                s.master.grad = None
            if self.optimizer is not None:
                self.optimizer.found_inf = None  # type: ignore[attr-defined]

    def _fused_kernel(self) -> bool:
        """Whether the torch optimizer runs its fused (CUDA) kernel, which takes a ``grad_scale`` tensor."""
        return self.optimizer is not None and bool(self.optimizer.defaults.get("fused"))

    # ------------------------------------------------------------------------------------------- state
    def sharded_state(self) -> Iterator[ParamShardState]:
        """Per parameter: its global shape and this rank's flat range of master weights and optimizer moments."""
        for s in self.slots:
            st = {} if self.optimizer is None else self.optimizer.state.get(s.master, {})
            step = st.get("step", 0)
            tp = shard_group(s.param, self.state)
            entry = ParamShardState(
                s.name,
                shard_info(s.name, s.param, tp).global_shape,
                tuple(s.param.shape),
                (s.lo, s.hi),
                int(step.item() if isinstance(step, torch.Tensor) else step),
                param=s.param,
                tp=tp,
            )
            entry.tensors["master"] = s.master.detach().reshape(-1)
            for key, value in st.items():
                if isinstance(value, torch.Tensor) and value.numel() == s.master.numel() and value.dim() > 0:
                    entry.tensors[key] = value.reshape(-1)
            yield entry

    @torch.no_grad()
    def load_sharded_state(self, global_tensors: Mapping[str, Mapping[str, torch.Tensor]], step: int) -> None:
        """Load master weights and moments given per parameter name in the global (unsharded) shape.

        Any tp/pp/dp layout can load what any other saved: each rank selects its own piece. The model parameters
        are updated from the loaded master weights.
        """

        def pieces(entry: ParamShardState) -> Mapping[str, torch.Tensor]:
            if entry.name not in global_tensors:
                raise KeyError(f"no saved optimizer state for parameter {entry.name!r}")
            return {k: entry.select(v) for k, v in global_tensors[entry.name].items()}

        self.load_flat_state(pieces, step)

    @torch.no_grad()
    def load_flat_state(
        self,
        pieces: Callable[[ParamShardState], Mapping[str, torch.Tensor]],
        step: int,
        agree: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        """Load state given, per entry of :meth:`sharded_state`, this rank's 1-D pieces (``flat_range``) directly.

        ``pieces(entry)`` returns ``{"master": ..., "exp_avg": ..., ...}``; a checkpoint reader uses this to read
        only the slices this rank holds instead of whole global tensors. ``agree(error)``, when given, is called
        after the reads on every rank (``error``: what ``pieces`` raised here, or None) and before the copy into the
        model, which may be a collective (the distributed optimizer's all-gather); it raises to stop every rank.
        """
        if self.optimizer is None:
            if agree is not None:
                agree(None)
            return
        error: BaseException | None = None
        try:
            self._load_pieces(pieces, step)
        except Exception as e:
            error = e
        if agree is not None:
            agree(error)
        if error is not None:
            raise error
        self._step_count = step
        self._copy_to_model()

    def _load_pieces(self, pieces: Callable[[ParamShardState], Mapping[str, torch.Tensor]], step: int) -> None:
        assert self.optimizer is not None
        slots = {s.name: s for s in self.slots}
        for entry in self.sharded_state():
            saved = pieces(entry)
            slot = slots[entry.name]
            slot.master.view(-1).copy_(saved["master"].to(slot.master.device))
            st = self.optimizer.state[slot.master]
            for key, value in saved.items():
                if key == "master":
                    continue
                current = st.get(key)
                if isinstance(current, torch.Tensor) and current.shape == slot.master.shape:
                    current.copy_(value.reshape(slot.master.shape))  # into the existing moment: no new memory
                else:
                    st[key] = value.to(slot.master).reshape(slot.master.shape).clone()
            if len(saved) > 1:
                fused = slot.master.is_cuda
                st["step"] = torch.tensor(
                    float(step), dtype=torch.float32, device=slot.master.device if fused else "cpu"
                )

    def state_dict(self) -> dict:
        return {
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
        }

    def load_state_dict(self, sd: dict) -> None:
        if self.optimizer is not None and sd.get("optimizer") is not None:
            self.optimizer.load_state_dict(sd["optimizer"])
        if self.scaler is not None and sd.get("scaler") is not None:
            self.scaler.load_state_dict(sd["scaler"])


def _torch_optimizer(slots: list[_Slot], config: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer | None:
    decay = [s.master for s in slots if s.decay]
    no_decay = [s.master for s in slots if not s.decay]
    groups = [
        g
        for g in (
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        )
        if g["params"]
    ]
    if not groups:
        return None
    fused = config.fused if config.fused is not None else device.type == "cuda"
    kernel = {"fused": True} if fused else {"foreach": True}
    if config.optimizer == "adam":
        return torch.optim.AdamW(
            groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, **kernel
        )
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum, **kernel)
