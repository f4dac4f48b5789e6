"""Megatron-LM's legacy per-rank checkpoints: ``mp_rank_XX[_YYY[_ZZZ]]/model_optim_rng.pt``, merged into global tensors.

Each file is one rank's ``torch.save`` of ``{"args", "iteration", "checkpoint_version", "model" (or ``model0``,
``model1``, ... with virtual pipeline stages), ...}``: ``XX`` is the tensor-parallel rank, ``YYY`` the pipeline rank
(when pp > 1) and ``ZZZ`` the expert-parallel rank (when ep > 1). Its tensors are the rank's pieces, with local layer
numbers (``decoder.layers.0`` is the stage's first layer) and local expert numbers. Merging, per tensor:

- column-parallel (split along dim 0): ``linear_qkv``, ``linear_fc1`` (a SwiGLU ``[gate_r; up_r]`` per rank, so the
  halves are joined separately), the word embedding and output layer (padded vocabulary rows);
- row-parallel (dim 1): ``linear_proj``, ``linear_fc2``;
- everything else (norms, the row-parallel biases, the router, position embeddings) is replicated: rank 0's is kept;
- experts: ``experts.local_experts.<j>.linear_fc{1,2}.weight`` (SequentialMLP), grouped GEMM's ``experts.weight1``
  (``[hidden, local_experts * fc1_width]``, viewed ``[local_experts, hidden, fc1_width]``) and ``experts.weight2``
  (``[local_experts * ffn, hidden]``), or Transformer Engine's ``experts.linear_fc1.weight<j>``; expert ``j`` of
  expert-parallel rank ``e`` is global expert ``e * local_experts + j``; expert tensor parallelism equals tp or is 1.

One pipeline stage's files are loaded at a time.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mcore_export.megatron._unpickle import MegatronFormatError, load_pickled
from mcore_export.megatron.layout import is_glu_fc1, join_glu, to_mcore_name

__all__ = ["LegacyCheckpoint", "stage_layers"]

logger = logging.getLogger(__name__)
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias")
_ROW = ("linear_proj.weight", "linear_fc2.weight")
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12]\.weight)|(linear_fc[12]\.weight)(\d+))$")


def stage_layers(args: Any) -> list[range]:
    """The global layers of each model chunk, in order ``[vp0 pp0, vp0 pp1, ..., vp1 pp0, ...]`` (``args``' layout)."""
    n, pp = int(args.num_layers), int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    per_vp = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    first = getattr(args, "decoder_first_pipeline_num_layers", None)
    last = getattr(args, "decoder_last_pipeline_num_layers", None)
    if per_vp:
        sizes = [int(per_vp)] * (n // int(per_vp))
    else:
        sizes = [0] * pp
        rest, middle = n, pp
        if first is not None:
            sizes[0], rest, middle = int(first), rest - int(first), middle - 1
        if last is not None and pp > 1:
            sizes[-1], rest, middle = int(last), rest - int(last), middle - 1
        lo = 1 if first is not None else 0
        for s in range(lo, lo + middle):
            sizes[s] = rest // max(middle, 1)
    if sum(sizes) != n:
        raise MegatronFormatError(f"the args' pipeline layout {sizes} does not add up to num_layers={n}")
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


class LegacyCheckpoint:
    """One legacy checkpoint directory (``iter_NNNNNNN`` with ``mp_rank_*`` subdirectories)."""

    format = "legacy"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files: dict[tuple[int, ...], Path] = {}
        for d in sorted(path.glob("mp_rank_*")):
            m = _RANK_DIR.match(d.name)
            if m is None or not (d / "model_optim_rng.pt").exists():
                raise MegatronFormatError(f"{d}: expected mp_rank_XX[_YYY[_ZZZ]]/model_optim_rng.pt")
            self.files[tuple(int(g) for g in m.groups() if g is not None)] = d / "model_optim_rng.pt"
        first = load_pickled(next(iter(self.files.values())))
        self.args = first.get("args")
        self.iteration = int(first.get("iteration", 0) or 0)
        version = float(first.get("checkpoint_version", 0) or 0)
        if version < 3.0:
            raise MegatronFormatError(f"{path}: checkpoint_version {version}: QKV layouts before version 3.0 are not "
                                      "read; load and re-save it with a current Megatron-LM")  # fmt: skip

    def layout(self) -> tuple[int, int, int]:
        a = self.args
        tp = int(getattr(a, "tensor_model_parallel_size", 1) or 1)
        pp = int(getattr(a, "pipeline_model_parallel_size", 1) or 1)
        ep = int(getattr(a, "expert_model_parallel_size", 1) or 1)
        want = {(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)}
        have = {self._rank(k, pp, ep) for k in self.files}
        if have != want:
            raise MegatronFormatError(
                f"{self.path}: the args say tp={tp} pp={pp} ep={ep} but the mp_rank_* directories are "
                f"{sorted(p.parent.name for p in self.files.values())} (missing ranks {sorted(want - have)})"
            )
        return tp, pp, ep

    @staticmethod
    def _rank(key: tuple[int, ...], pp: int, ep: int) -> tuple[int, int, int]:
        if len(key) == 3:
            return key
        if len(key) == 2:
            return (key[0], key[1], 0) if pp > 1 else (key[0], 0, key[1])
        return key[0], 0, 0

    def _stage(self, p: int, tp: int, pp: int, ep: int) -> dict[tuple[int, int], dict[str, Any]]:
        out = {}
        for key, f in self.files.items():
            t, pr, e = self._rank(key, pp, ep)
            if pr == p:
                out[(t, e)] = load_pickled(f)
        return out

    def model_tensors(self, num_layers: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(mcore name, global tensor) of every model tensor, one pipeline stage at a time."""
        tp, pp, ep = self.layout()
        chunks = stage_layers(self.args)
        if sum(len(c) for c in chunks) != num_layers:
            raise MegatronFormatError(f"{self.path}: the args' layers ({chunks}) are not num_layers={num_layers}")
        vp = len(chunks) // pp
        for p in range(pp):
            files = self._stage(p, tp, pp, ep)
            for v in range(vp):
                name = "model" if vp == 1 else f"model{v}"
                missing = [k for k, sd in files.items() if not isinstance(sd.get(name), dict)]
                if missing:
                    raise MegatronFormatError(f"{self.path}: rank files {missing} of stage {p} have no {name!r}")
                pieces: dict[tuple[int, int], dict[str, Any]] = {k: sd[name] for k, sd in files.items()}
                yield from self._merge(pieces, chunks[v * pp + p].start, tp, ep)

    def _merge(
        self, pieces: dict[tuple[int, int], dict[str, Any]], offset: int, tp: int, ep: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        gated = bool(getattr(self.args, "swiglu", False))
        experts: dict[tuple[int, str], dict[int, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
        for key in pieces[(0, 0)]:
            m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", key)
            inner = to_mcore_name(m.group(2)) if m else (None if key.endswith("_extra_state") else key)
            if inner is None or pieces[(0, 0)][key] is None:
                continue
            name = f"decoder.layers.{offset + int(m.group(1))}.{inner}" if m else inner
            if m and m.group(2).startswith("mlp.experts."):
                for (t, e), sd in pieces.items():
                    for j, part, tensor in _local_experts(m.group(2), sd[key], self.args):
                        experts[(offset + int(m.group(1)), part)][e * 1000 + j][t] = tensor
                continue
            yield name, _merge_tp([pieces[(t, 0)][key] for t in range(tp)], inner, gated)
        etp = int(getattr(self.args, "expert_tensor_parallel_size", None) or tp)
        for (layer, part), by_expert in sorted(experts.items()):
            merged = [_merge_tp([ranks[t] for t in sorted(ranks)][:etp], part, gated)
                      for _, ranks in sorted(by_expert.items())]  # fmt: skip
            yield f"decoder.layers.{layer}.mlp.experts.{part}", torch.stack(merged)


def _local_experts(inner: str, t: torch.Tensor, args: Any) -> list[tuple[int, str, torch.Tensor]]:
    """(local expert, ``linear_fc1.weight``/``linear_fc2.weight``, its [out, in] tensor) of one rank's expert tensor."""
    if inner in ("mlp.experts.weight1", "mlp.experts.weight2"):
        n = int(args.num_experts) // int(getattr(args, "expert_model_parallel_size", 1) or 1)
        hidden = int(args.hidden_size)
        if inner.endswith("1"):  # [hidden, n * width] viewed [n, hidden, width]: expert j's fc1 is w[j].T
            w = t.reshape(n, hidden, -1).transpose(1, 2)
            return [(j, "linear_fc1.weight", w[j].contiguous()) for j in range(n)]
        w = t.reshape(n, -1, hidden).transpose(1, 2)  # [n * ffn, hidden] viewed [n, ffn, hidden]
        return [(j, "linear_fc2.weight", w[j].contiguous()) for j in range(n)]
    m = _EXPERT.match(inner)
    if m is None:
        raise MegatronFormatError(f"expert tensor {inner!r} is not a layout the importer reads")
    if m.group(1) is not None:
        return [(int(m.group(1)), m.group(2), t)]
    return [(int(m.group(4)), m.group(3), t)]


def _merge_tp(parts: list[torch.Tensor], inner: str, gated: bool) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    if inner.endswith(_COLUMN) or inner in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return join_glu(parts) if is_glu_fc1(inner, gated) else torch.cat(parts, dim=0)
    if inner.endswith(_ROW):
        return torch.cat(parts, dim=1)
    return parts[0]
