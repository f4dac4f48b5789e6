"""Megatron-Core anchor for mcore's training benchmarks (not a test): one GPU, one process.

Trains ``llama-1b``, ``moe-8x4k`` or ``moe-32x1k`` (mcore's presets, rebuilt as a Megatron-Core ``GPTModel``) on
mock random tokens with Megatron's own training pieces: the local layer spec (no Transformer Engine; experts are
``SequentialMLP``), for MoE the ``alltoall`` token dispatcher, dropless routing with the aux load-balancing loss,
``DistributedDataParallel`` (fp32 grad buffers) and the distributed optimizer (bf16 params, fp32 master weights,
Adam), stepped through ``get_forward_backward_func()``. Prints and writes tokens/s, seconds per step, peak memory,
model TFLOP/s by mcore's ``training_flops_per_token`` and MFU against a bf16 8192^3 matmul measured first.

Deviation: Megatron-Core 0.19.2's local spec has no SDPA core attention (its ``DotProductAttention`` materialises
the s x s scores; SDPA there exists only through the proprietary Kitchen extension), so the spec's
``core_attention`` is replaced by ``SDPAttention`` below: ``F.scaled_dot_product_attention``, causal, native GQA.

    python3 bench/megatron_bench.py --model moe-8x4k --micro-batch 2 --steps 8 --json OUT.json
    python3 bench/megatron_bench.py --model llama-1b --seq 32768 --micro-batch 1 --global-batch 4 --steps 4
    python3 bench/megatron_bench.py --smoke   # tiny model; without a GPU it only builds (Megatron needs CUDA)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _timing import bf16_matmul_tflops
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import MegatronModule, TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

MODELS = {"llama-1b": None, "moe-8x4k": (8, 4096, 2), "moe-32x1k": (32, 1024, 8)}  # experts, expert ffn, top-k
CORE_ATTENTION = "SDPAttention (torch scaled_dot_product_attention, causal, enable_gqa) in place of DotProductAttention"


class SDPAttention(MegatronModule):
    """``DotProductAttention``'s interface over torch SDPA: ``[s, b, n, d]`` queries, ``[s, b, g, d]`` keys and
    values in, ``[s, b, n * d]`` out; causal, no dropout, one tensor/context-parallel rank."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):  # fmt: skip
        super().__init__(config=config)
        assert attn_mask_type == AttnMaskType.causal and config.attention_dropout == 0.0
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        assert attention_bias is None and packed_seq_params is None
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        gqa = k.shape[1] != q.shape[1]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="moe-8x4k")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per step (micro-batch multiple)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--json", default=None, help="write the result here")
    parser.add_argument("--smoke", action="store_true", help="tiny config (2 layers, hidden 64, 4 experts, seq 128)")
    return parser.parse_args()


def _build(args: argparse.Namespace, cuda: bool) -> tuple[Any, Any, dict[str, Any]]:
    """Megatron's TransformerConfig and GPTModel (local spec, SDPA core attention) and the run's sizes."""
    moe = (4, 64, 2) if args.smoke else MODELS[args.model]
    layers, hidden, heads, groups, vocab = (2, 64, 4, 2, 256) if args.smoke else (16, 2048, 32, 8, 32768)
    seq, mb = (128, 2) if args.smoke else (args.seq, args.micro_batch)
    global_batch = mb * 2 if args.smoke else args.global_batch
    assert global_batch % mb == 0, "--global-batch must be a multiple of --micro-batch"
    dispatcher = "alltoall" if cuda else "allgather"  # alltoall makes a CUDA stream in its constructor
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=4 * hidden, kv_channels=hidden // heads, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", layernorm_epsilon=1e-5, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, use_cpu_initialization=not cuda,
        **({} if moe is None else dict(
            num_moe_experts=moe[0], moe_ffn_hidden_size=moe[1], moe_router_topk=moe[2],
            moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type=dispatcher,
            moe_grouped_gemm=False, moe_expert_capacity_factor=None)),
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(num_experts=None if moe is None else moe[0], moe_grouped_gemm=False,
                                    normalization="RMSNorm")  # fmt: skip
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq,
        position_embedding_type="rope", rotary_base=500000, share_embeddings_and_output_weights=False,
    )  # fmt: skip
    if cuda:
        model.cuda()
    dims = dict(seq=seq, mb=mb, global_batch=global_batch, vocab=vocab, dispatcher=dispatcher if moe else None)
    return config, model, dims


def _train(args: argparse.Namespace, config: Any, model: Any, dims: dict[str, Any]) -> dict[str, Any]:
    """Megatron's DDP, distributed optimizer and schedule on mock tokens: warm-up, then the timed steps."""
    seq, mb, vocab, global_batch = dims["seq"], dims["mb"], dims["vocab"], dims["global_batch"]
    position_ids = torch.arange(seq, device="cuda").unsqueeze(0).expand(mb, -1)

    def batches() -> Any:
        while True:
            tokens = torch.randint(0, vocab, (mb, seq + 1), device="cuda")
            yield tokens[:, :-1], tokens[:, 1:]

    def forward_step(data_iterator: Any, model: Any) -> Any:
        tokens, labels = next(data_iterator)
        per_token = model(tokens, position_ids, None, labels=labels)  # [b, s] cross-entropy
        return per_token, lambda out: (out.float().mean(), {"lm loss": out.detach().float().mean()})

    data = batches()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-4, bf16=True, use_distributed_optimizer=True, clip_grad=1.0,
                        weight_decay=0.1),
        [model],
    )  # fmt: skip
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()
    num_microbatches = global_batch // mb

    def step() -> float:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=data, model=model,
                                  num_microbatches=num_microbatches, seq_length=seq, micro_batch_size=mb)  # fmt: skip
        ok, _grad_norm, _ = optimizer.step()
        assert ok, "optimizer step skipped"
        return float(sum(x["lm loss"] for x in losses) / len(losses))

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    loss = float("nan")
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / args.steps
    return {
        "params": sum(p.numel() for p in model.parameters()), "num_microbatches": num_microbatches,
        "step_s": step_s, "tokens_per_s": global_batch * seq / step_s, "loss": loss,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
    }  # fmt: skip


def main() -> None:
    args = _args()
    cuda = torch.cuda.is_available()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    if cuda:
        torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl" if cuda else "gloo", init_method="env://", rank=0, world_size=1)
    peak = bf16_matmul_tflops() if cuda else float("nan")
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    # without CUDA the training RNG tracker cannot hold states: the inference one (no-op forks) stands in
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=not cuda)
    config, model, dims = _build(args, cuda)
    if not cuda:  # Megatron's RoPE, DDP buffers, alltoall dispatcher and schedules all need CUDA: stop here
        n = sum(p.numel() for p in model.parameters())
        print(json.dumps({"no_cuda": "config, spec and GPTModel built; nothing run", "params": n}))
        return
    result = {
        "framework": "megatron-core", "megatron_core": _version(), "torch": torch.__version__,
        "model": "smoke" if args.smoke else args.model, "seq": dims["seq"], "micro_batch": dims["mb"],
        "global_batch": dims["global_batch"], "steps": args.steps, "spec": "local" + (" (SequentialMLP)" if MODELS.get(args.model) else ""),
        "dispatcher": dims["dispatcher"], "core_attention": CORE_ATTENTION, "matmul_tflops": peak,
        "gpu": torch.cuda.get_device_name(), **_train(args, config, model, dims),
    }  # fmt: skip
    if not args.smoke:
        sys.path[:0] = [str(p) for p in sorted((Path(__file__).resolve().parents[1] / "packages").glob("*/src"))]
        from mcore_models import preset, training_flops_per_token

        flops = training_flops_per_token(preset(args.model), dims["seq"])
        tflops = result["tokens_per_s"] * flops / 1e12
        result.update(model_tflops=tflops, mfu=tflops / peak)
    line = json.dumps(result)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    torch.distributed.destroy_process_group()


def _version() -> str:
    from megatron.core.package_info import __version__

    return __version__


if __name__ == "__main__":
    main()
