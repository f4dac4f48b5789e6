"""The model runner: one forward step of ``GPTModel`` over a flat batch of decode tokens and prefill chunks.

It owns the KV cache, the device-side inputs and the decode module (:func:`~mcore_infer.decode.prepare_for_decode`:
the caller's model with ``EngineConfig.decode_kernels``' fusions, sharing its parameters; with ``compile`` its
per-layer wrappers are compiled, never the caller's layers). A step arrives as a :class:`StepBatch` (host lists made by the
scheduler); the runner packs them into one int64 array, copies it to the device once, and calls the model with a
:class:`~mcore_infer.attention.PagedAttentionContext`. Steps made only of decode tokens replay a CUDA graph captured
for the next larger batch size, other steps of up to 2048 tokens one captured for the next larger token count (GPU,
triton backend; :mod:`mcore_infer.graphs`); padded rows write to the scratch block and attend to nothing.
Models whose steps read device values on the host (MoE layers outside ``grouped_mm``'s conditions, see
:func:`graph_blockers`) are not captured: their steps run eagerly.

Models with Mamba layers also hold each request's conv and SSM states (:mod:`mcore_infer.mamba_cache`, allocated
before the KV cache so its memory budget counts them; KV blocks are allocated for the attention layers only): a step
carries its requests' state slots (packed with the other inputs; a buffer of the CUDA graphs) and the slots that start
fresh, zeroed before the forward; the context's ``mamba`` view hands them to the mixers.

Vision-language models (a :class:`~mcore_models.multimodal.LlavaModel`): the runner runs its language model; a
step with image tokens in its prefill chunks (:mod:`mcore_infer.images`) runs eagerly, never through a CUDA graph
(the graphs take token ids only), with the word embeddings' image rows replaced by the image embeddings as the
first layer's input. At tp > 1 the vision tower is split over the TP ranks too (a collective): the first rank
sends the followers each request's pixels before it encodes them and each image step's rows
(:mod:`mcore_infer.tp_images`), so every rank runs the tower and splices the same rows.

Tensor parallelism: the first rank of the TP group runs the scheduler and broadcasts each :class:`StepBatch` to the
other ranks (``torch.distributed.broadcast_object_list`` over the TP group); they run :meth:`ModelRunner.follow`,
which executes the same steps until told to stop. Logits are gathered over the TP group, so every rank could
sample; only the first rank does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mcore_infer._triton_attention import triton_available
from mcore_infer.attention import PagedAttentionContext, Segment
from mcore_infer.config import EngineConfig
from mcore_infer.decode import prepare_for_decode
from mcore_infer.graphs import DecodeSets, StaticInputs, capture_graphs, replay_decode, replay_step, step_graph_fits
from mcore_infer.images import ImageSplice, VisionInfo, vision_info
from mcore_infer.kernels import l2_prefetch
from mcore_infer.kv_cache import BlockManager, KVCache, blocks_for
from mcore_infer.mamba_cache import MambaCache, MambaStepView, SlotManager, attention_layer_numbers, mamba_mixers
from mcore_infer.tp_images import DriverImages, DropImages, FollowerImages
from mcore_models import GPTModel
from mcore_models.moe import grouped_mm_applies, moe_layers
from mcore_models.multimodal import LlavaModel
from mcore_parallel import Group

__all__ = ["KEEP_ALIVE", "ModelRunner", "StepBatch", "graph_blockers"]

KEEP_ALIVE = "keep-alive"
"""What :meth:`ModelRunner.keep_alive` sends the followers of an idle engine."""

log = logging.getLogger(__name__)


def graph_blockers(model: nn.Module) -> list[str]:
    """Why ``model``'s decode steps cannot be captured as CUDA graphs (empty: they can). A dropless MoE layer at
    ep=1 has static shapes (one argsort of the choices) and runs its experts with ``grouped_mm`` on CUDA in bfloat16
    or float16; otherwise its experts loop over row blocks sized on the host (``counts.tolist()``, a synchronisation
    capture refuses), expert parallelism exchanges the row counts on the host, and a capacity depends on the step's
    token count (a captured batch's padding rows would take capacity from real tokens)."""
    layers: dict[str, list[int]] = {}
    for number, layer in moe_layers([model]):
        moe, experts = layer.moe, cast(Any, layer.experts)
        why = []
        if layer.ctx.expert_parallel.size > 1:
            why.append(f"expert parallelism (ep={layer.ctx.expert_parallel.size}) reads the row counts on the host")
        if moe.capacity_factor is not None:
            why.append(f"moe.capacity_factor={moe.capacity_factor}: the capacity follows the step's token count")
        w = experts.linear_fc1.weight
        if not (grouped_mm_applies(w) and grouped_mm_applies(experts.linear_fc2.weight)):
            why.append(
                f"the experts' weights ({w.dtype} on {w.device.type}) run the per-expert loop, which reads the row "
                "counts on the host (grouped_mm needs CUDA, bfloat16 or float16, widths that are multiples of 8)"
            )
        for reason in why:
            layers.setdefault(reason, []).append(number)
    return [f"MoE layers {','.join(map(str, numbers))}: {reason}" for reason, numbers in layers.items()]


@dataclass
class StepBatch:
    """One step: flat tokens with positions and cache slots; per request a segment and a block table."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    logits_index: list[int] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)
    """Per segment, its request's Mamba state slot (0 for models without Mamba layers)."""
    fresh_slots: list[int] = field(default_factory=list)
    """The Mamba state slots of the requests that start from an empty state in this step (zeroed first)."""

    @property
    def decode_only(self) -> bool:
        return len(self.tokens) == len(self.segments)

    def add(
        self, tokens: list[int], start_pos: int, table: list[int], block_size: int, logits: str, state_slot: int = 0
    ) -> None:
        """Append ``tokens`` at positions ``start_pos..``; ``logits``: ``none``, ``last`` or ``all`` rows;
        ``state_slot``: the request's Mamba state slot (zeroed first when ``start_pos`` is 0)."""
        n = len(tokens)
        t0 = len(self.tokens)
        self.state_slots.append(state_slot)
        if state_slot and not start_pos:
            self.fresh_slots.append(state_slot)
        if n == 1 and logits == "last":  # a decode token: the common case, kept cheap
            self.tokens.append(tokens[0])
            self.positions.append(start_pos)
            self.slots.append(table[start_pos // block_size] * block_size + start_pos % block_size)
            self.segments.append(Segment(t0, t0 + 1, len(self.block_tables), start_pos + 1))
            self.block_tables.append(table)
            self.logits_index.append(t0)
            return
        self.tokens.extend(tokens)
        pos = range(start_pos, start_pos + n)
        self.positions.extend(pos)
        self.slots.extend(table[p // block_size] * block_size + p % block_size for p in pos)
        self.segments.append(Segment(t0, t0 + n, len(self.block_tables), start_pos + n))
        self.block_tables.append(table)
        if logits == "last":
            self.logits_index.append(t0 + n - 1)
        elif logits == "all":
            self.logits_index.extend(range(t0, t0 + n))


class ModelRunner:
    """Runs steps of one ``GPTModel`` or ``LlavaModel`` (this rank's TP shard) over a paged KV cache."""

    def __init__(self, model: GPTModel | LlavaModel, config: EngineConfig, tp: Group | None = None) -> None:
        self.vlm: LlavaModel | None = None
        self.vision: VisionInfo | None = None
        """Set for a vision-language model: what requests' images must be (:mod:`mcore_infer.images`)."""
        if isinstance(model, LlavaModel):
            self.vlm, model = model, model.language
            self.vision = vision_info(self.vlm, config.max_images, config.image_mean, config.image_std,
                                      config.tiling())  # fmt: skip
        self.model = model  # the caller's (in eval mode): read, never changed
        self.config = config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" and triton_available() else "plain"
        self.backend = backend
        max_len = config.max_model_len or model.config.max_position_embeddings
        self.decode = prepare_for_decode(model, config.decode_kernels, device_type=self.device.type, backend=backend,
                                         compiled=config.compile, max_positions=max_len)  # fmt: skip
        self.plan = self.decode.plan
        if config.compile:
            self.decode.compile_layers()  # compiled on the first steps (and the CUDA-graph warm-up)
        self.tp = tp or Group.single("tp")
        self.driver_images: DriverImages | None = None
        """A VLM at tp > 1, on the first rank: the embeddings it mirrors on the followers
        (:mod:`mcore_infer.tp_images`)."""
        self.follower_images: FollowerImages | None = None
        """A VLM at tp > 1, on the other ranks: the first rank's embeddings, by key."""
        if self.vlm is not None and self.tp.size > 1:
            if self.tp.rank == 0:
                self.driver_images = DriverImages(self)
            else:
                self.follower_images = FollowerImages(self)
        self.keep_alive_s = 60.0
        """Seconds of idling after which :meth:`keep_alive` tells the followers the first rank is alive."""
        self._last_broadcast = time.monotonic()
        mc = model.config
        self.vocab_size = mc.vocab_size
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.block_size = config.block_size
        self.groups = mc.query_groups // self.tp.size
        self.max_blocks_per_seq = blocks_for(self.max_model_len, self.block_size)
        self._init_mamba(model)  # before the KV cache: the memory budget counts the states
        nlayers = len(self.kv_layers)
        num_blocks = config.num_blocks or self._blocks_from_memory(nlayers, mc.head_dim)
        self.cache = KVCache.allocate(
            nlayers, num_blocks, self.block_size, self.groups, mc.head_dim, self.dtype, self.device
        )
        self.blocks = BlockManager(num_blocks, self.block_size)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        """Decode graphs by batch size (:mod:`mcore_infer.graphs`)."""
        self.step_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, int]] = {}
        """Step graphs by token count: the graph, its logits and how many logits rows it makes."""
        self._graph_sizes: list[int] = []
        self.decode_sets: DecodeSets | None = None
        """The decode graphs' input sets (one, or two used in turn: ``EngineConfig.side_stream_copies``)."""
        self.step_inputs: StaticInputs | None = None
        self.prefetch = self._prefetch_weights(model, config) if config.l2_prefetch and backend == "triton" else None
        """Layer number -> the weights its attention pulls into L2 (``EngineConfig.l2_prefetch``)."""
        log.info("KV cache: %d blocks of %d tokens, attention %s", num_blocks, self.block_size, backend)

    @staticmethod
    def _prefetch_weights(model: GPTModel, config: EngineConfig) -> dict[int, list[l2_prefetch.Region]] | None:
        """By layer number, each attention layer's output-projection weight (whole) and, with
        ``l2_prefetch_up_mb``, the first bytes of its MLP's up-projection weight, where the device can prefetch."""
        found = {}
        up_bytes = int(config.l2_prefetch_up_mb * 2**20)
        for key, layer in model.decoder.layers.items():
            proj = getattr(getattr(layer, "self_attention", None), "linear_proj", None)
            weight = getattr(proj, "weight", None)
            if not (isinstance(weight, torch.Tensor) and l2_prefetch.supported(weight)):
                continue
            regions = [(weight, weight.numel() * weight.element_size())]
            up = getattr(getattr(getattr(layer, "mlp", None), "linear_fc1", None), "weight", None)
            if up_bytes and isinstance(up, torch.Tensor):
                regions.append((up, up_bytes))
            found[int(key)] = regions
        return found or None

    # ------------------------------------------------------------------------------------------------- sizing
    def _init_mamba(self, model: GPTModel) -> None:
        """The layers with KV blocks, and for Mamba layers their states (:mod:`mcore_infer.mamba_cache`): a conv and
        an SSM state per layer for each of ``max_num_seqs`` request slots (plus the scratch slot)."""
        self.kv_layers = attention_layer_numbers(model)
        mixers = mamba_mixers(model)
        self.mamba: MambaCache | None = None
        self.state_slots: SlotManager | None = None
        if not mixers:
            return
        slots = self.config.max_num_seqs + 1
        ssm_dtype = getattr(torch, self.config.mamba_ssm_dtype)
        size = MambaCache.bytes_for(mixers, slots, ssm_dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(self.config.memory_fraction * total) - (total - free) - (2 << 30)
            if size > budget:
                raise RuntimeError(
                    f"the Mamba states of max_num_seqs={self.config.max_num_seqs} requests take {size / 2**30:.1f} "
                    f"GiB, {budget / 2**30:.1f} GiB are left under memory_fraction: lower max_num_seqs (or set "
                    "mamba_ssm_dtype=bfloat16: half the SSM states' memory)"
                )
        self.mamba = MambaCache.allocate(mixers, slots, self.device, ssm_dtype)
        self.state_slots = SlotManager(slots)
        log.info("Mamba states: %d layers x %d request slots, %.1f MiB (SSM states in %s)", len(mixers), slots - 1,
                 size / 2**20, str(next(iter(self.mamba.ssm.values())).dtype).removeprefix("torch."))  # fmt: skip

    def _blocks_from_memory(self, nlayers: int, head_dim: int) -> int:
        per_block = KVCache.bytes_per_block(nlayers, self.block_size, self.groups, head_dim, self.dtype)
        if per_block == 0:  # no attention layer (a pure Mamba model): blocks only count tokens
            return self.config.max_num_seqs * self.max_blocks_per_seq + 1
        if self.device.type == "cuda":  # (the Mamba states are allocated already: mem_get_info counts them)
            free, total = torch.cuda.mem_get_info(self.device)
            reserve = 2 << 30  # activations of a prefill step and CUDA graphs
            budget = int(self.config.memory_fraction * total) - (total - free) - reserve
            if budget < 2 * per_block:
                raise RuntimeError(f"no room for a KV cache: {budget / 2**30:.1f} GiB left under memory_fraction")
            # never more than every running request at full length needs
            cap = self.config.max_num_seqs * self.max_blocks_per_seq + 1
            return max(2, min(budget // per_block, cap))
        return self.config.max_num_seqs * self.max_blocks_per_seq + 1

    # ------------------------------------------------------------------------------------------------ running
    def execute(
        self, batch: StepBatch, device_ids: torch.Tensor | None = None, images: ImageSplice | None = None
    ) -> torch.Tensor:
        """Run one step; returns logits ``[len(batch.logits_index), vocab]`` (model dtype, full vocab).

        ``device_ids`` (one id per token, on the device) replace ``batch.tokens``: a step launched before the tokens
        it consumes are known on the host (the engine's lookahead; one TP rank only). ``images``: the step's image
        rows (a VLM's prefill; the step runs eagerly).
        """
        if self.tp.size > 1:
            if device_ids is not None:
                raise ValueError("device-side input ids need tp=1 (followers replay host batches)")
            self._send_followers(batch if self.driver_images is None else self.driver_images.message(batch, images))
        return self._run(batch, device_ids, images)

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """A VLM's image embeddings ``[n * image_tokens, hidden]`` of pixels ``[n, C, S, S]`` (at tp > 1 every rank runs
        this at once, on the same pixels: :mod:`mcore_infer.tp_images`)."""
        assert self.vlm is not None
        emb = self.vlm.image_embeddings(pixels.to(self.device, self.dtype))
        return emb.reshape(-1, emb.shape[-1])

    def follow(self) -> None:
        """On a non-first TP rank: execute the first rank's steps until it calls :meth:`stop_followers`."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=self.tp.ranks[0], group=self.tp.pg)
            if box[0] is None:
                return
            if isinstance(box[0], StepBatch):
                self._run(box[0])
            elif isinstance(box[0], DropImages):  # a VLM's images (:mod:`mcore_infer.tp_images`)
                assert self.follower_images is not None
                self.follower_images.handle(box[0])
            # (anything else is keep_alive's message)

    def stop_followers(self) -> None:
        if self.tp.size > 1 and self.tp.rank == 0:
            self._flush_drops()
            dist.broadcast_object_list([None], src=self.tp.ranks[0], group=self.tp.pg)

    def keep_alive(self) -> None:
        """On the first TP rank of an idle engine (its loops call this while they wait for requests): once
        :attr:`keep_alive_s` have passed since the last step, a message the followers pass over. They wait for the
        next step inside a collective, which fails after the process group's timeout (10 minutes by default): an
        idle tensor-parallel server would otherwise lose its followers. A VLM's embedding drops not sent yet (its
        last requests' images, :mod:`mcore_infer.tp_images`) go at once instead."""
        if self.tp.size > 1 and self.tp.rank == 0:
            if self._flush_drops():  # an idle engine's followers free the embeddings its last requests dropped
                return
            if time.monotonic() - self._last_broadcast >= self.keep_alive_s:
                self._send_followers(KEEP_ALIVE)

    def _flush_drops(self) -> bool:
        """Send the followers the embeddings' drops not sent yet (a VLM at tp > 1); whether there were any."""
        if self.driver_images is None or not self.driver_images.drops:
            return False
        self._send_followers(DropImages(self.driver_images.take_drops()))
        return True

    def _send_followers(self, item: Any) -> None:
        dist.broadcast_object_list([item], src=self.tp.ranks[0], group=self.tp.pg)
        self._last_broadcast = time.monotonic()

    @torch.inference_mode()
    def _run(
        self, batch: StepBatch, device_ids: torch.Tensor | None = None, images: ImageSplice | None = None
    ) -> torch.Tensor:
        n = len(batch.tokens)
        if self.decode_sets is not None:
            self.decode_sets.drawn = None  # (a decode graph's replay sets it again)
        if images is None and batch.decode_only and self.graphs and n <= self._graph_sizes[-1]:
            return replay_decode(self, batch, device_ids)
        if images is None and self.step_graphs and step_graph_fits(self, batch):
            return replay_step(self, batch, device_ids)
        s = len(batch.segments)
        width = max((len(t) for t in batch.block_tables), default=1) or 1
        r = len(batch.logits_index)
        bt = np.zeros((s, width), dtype=np.int64)
        for i, t in enumerate(batch.block_tables):
            bt[i, : len(t)] = t
        rows = np.repeat(np.arange(s), [g.end - g.start for g in batch.segments])
        pos = np.asarray(batch.positions, dtype=np.int64)
        packed = np.concatenate(
            [np.asarray(batch.tokens, np.int64), pos, np.asarray(batch.slots, np.int64), rows, pos + 1]
            + [np.asarray(batch.logits_index, np.int64), np.asarray(batch.state_slots, np.int64), bt.reshape(-1)]
        )
        dev = torch.from_numpy(packed).to(self.device, non_blocking=True)
        ids, positions, slots, tseq, tctx = (dev[i * n : (i + 1) * n] for i in range(5))
        if device_ids is not None:
            ids.copy_(device_ids)
        logits_index = dev[5 * n : 5 * n + r]
        state_slots = dev[5 * n + r : 5 * n + r + s]
        block_tables = dev[5 * n + r + s :].view(s, width)
        ctx = self.attention_context(slots, block_tables, tseq, tctx, logits_index, self.backend, batch.decode_only,
                                     self._mamba_step(batch, state_slots), batch.segments, batch.block_tables)  # fmt: skip
        hidden = None
        if images is not None:  # the word embeddings with the image rows replaced (LlavaModel's own splice)
            assert self.vlm is not None
            hidden = self.vlm.splice(ids[None], images.embeds, images.index, positions[None])
        out = self.decode(ids[None], positions[None], gather_logits=True, inference_context=ctx, decoder_input=hidden)
        return out[0]

    def next_decode_ids(self, n: int) -> torch.Tensor | None:
        """Where a draw of ``n`` tokens may write them for the next decode step's graph to read in place (two input
        sets, ``EngineConfig.side_stream_copies``); None otherwise."""
        return None if self.decode_sets is None else self.decode_sets.next_ids(n)

    def drawn_ids(self, n: int) -> torch.Tensor | None:
        """The greedy tokens of the last step's ``n`` logits rows if its decode graph drew them
        (``DecodePlan.argmax_in_graph``), in :meth:`next_decode_ids`; None otherwise."""
        return None if self.decode_sets is None else self.decode_sets.drawn_ids(n)

    def attention_context(
        self,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        tseq: torch.Tensor,
        tctx: torch.Tensor,
        logits_index: torch.Tensor | None,
        backend: str,
        decode: bool,
        mamba: MambaStepView | None,
        segments: list[Segment] | None = None,
        block_tables_host: list[list[int]] | None = None,
    ) -> PagedAttentionContext:
        """The attention context of one step, eager or captured in a CUDA graph (:mod:`mcore_infer.graphs`): the
        step's device tensors with every option the decode plan sets, from this one place, so both paths run the
        same kernels (the graphs once dropped the plan's attention launch). ``decode``: each token is the one new
        token of its request (the KV write inside the attention kernel where the plan says so)."""
        return PagedAttentionContext(
            self.cache,
            self.model.layer_numbers.start,
            slots,
            block_tables,
            tseq,
            tctx,
            logits_index,
            backend=backend,
            segments=segments,
            block_tables_host=block_tables_host,
            fuse_rotary=self.plan.rope_in_attention,
            fuse_kv_write=decode and self.plan.kv_write_in_attention,
            pdl=self.plan.pdl,
            fold_combine=self.plan.combine_in_attention,
            attention_launch=self.plan.launches.attention,
            prefetch=self.prefetch,
            kv_layers=self.kv_layers,
            mamba=mamba,
        )

    def _mamba_step(self, batch: StepBatch, state_slots: torch.Tensor) -> MambaStepView | None:
        """The step's view of the Mamba states (None without Mamba layers), after zeroing the fresh requests'."""
        if self.mamba is None:
            return None
        if batch.fresh_slots:
            self.mamba.reset(torch.tensor(batch.fresh_slots, device=self.device))
        if batch.decode_only:
            return MambaStepView(self.mamba, state_slots)
        segments = [(g.start, g.end, batch.state_slots[g.row]) for g in batch.segments]
        return MambaStepView(self.mamba, state_slots, segments)

    # ------------------------------------------------------------------------------------------- CUDA graphs
    def capture_graphs(self) -> None:
        """Capture decode steps by batch size and other steps by token count (:mod:`mcore_infer.graphs`; CUDA +
        triton backend only, else a no-op). A model whose steps cannot be captured (:func:`graph_blockers`) is left
        to run eagerly, with a warning that says why."""
        if self.device.type != "cuda" or self.backend != "triton" or not self.config.cuda_graphs:
            return
        blockers = graph_blockers(self.model)
        if blockers:
            log.warning("CUDA graphs off, every step runs eagerly: %s", "; ".join(blockers))
            return
        capture_graphs(self)

    def free_blocks(self, table: list[int]) -> None:
        self.blocks.free(table)
