"""Named recipes: functions returning a :class:`~mcore_train.config.TrainConfig`, the starting point of
``load_config(recipe=...)`` and ``mcore-train pretrain --recipe NAME``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mcore_models import TransformerConfig, preset
from mcore_parallel.optim import OptimizerConfig
from mcore_train.config import TrainConfig, config_changes
from mcore_train.sections import (
    CheckpointSection,
    DataSection,
    MultimodalSection,
    ParallelSection,
    SchedulerSection,
    TrainingSection,
)

__all__ = ["RECIPES", "recipe_tree"]


def tiny() -> TrainConfig:
    """A small Llama-style model on byte tokens that trains on a laptop CPU in minutes (the demo)."""
    model = TransformerConfig(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                              ffn_hidden_size=384, activation="swiglu", normalization="rmsnorm",
                              position_embedding="rope", add_bias_linear=False, vocab_size=259,
                              make_vocab_size_divisible_by=64, max_position_embeddings=256,
                              share_embeddings_and_output_weights=True)  # fmt: skip
    training = TrainingSection(micro_batch_size=8, global_batch_size=16, train_iters=300, eval_interval=100,
                               eval_iters=4, generate_at_end=120)  # fmt: skip
    return TrainConfig(
        model=model,
        data=DataSection(seq_length=256, tokenizer="byte", split="98,2,0"),
        optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.01, adam_beta2=0.95, clip_grad=1.0),
        scheduler=SchedulerSection(decay_style="cosine", warmup_iters=20, min_lr=3e-4),
        training=training,
        checkpoint=CheckpointSection(save_interval=100, keep_last=2),  # logging: the default, every 10 steps
    )


def _pretraining(
    preset_name: str,
    *,
    seq: int,
    lr: float,
    warmup: int,
    micro_batch: int,
    global_batch: int,
    iters: int,
    eval_interval: int,
    save_interval: int,
    parallel: ParallelSection | None = None,
) -> TrainConfig:
    """A bf16 pretraining run of a model preset: AdamW (beta2 0.95, wd 0.1, clip 1), cosine to lr/10, ZeRO-1."""
    return TrainConfig(
        model=preset(preset_name, params_dtype="bfloat16"),
        parallel=parallel or ParallelSection(),
        data=DataSection(seq_length=seq, tokenizer="hf"),
        optimizer=OptimizerConfig(
            lr=lr, weight_decay=0.1, adam_beta2=0.95, clip_grad=1.0, use_distributed_optimizer=True
        ),
        scheduler=SchedulerSection(decay_style="cosine", warmup_iters=warmup, min_lr=lr / 10),
        training=TrainingSection(
            micro_batch_size=micro_batch, global_batch_size=global_batch, train_iters=iters, eval_interval=eval_interval
        ),
        checkpoint=CheckpointSection(save_interval=save_interval, async_save=True),
    )


def gpt2_124m() -> TrainConfig:
    return _pretraining("gpt2-124m", seq=1024, lr=6e-4, warmup=700, micro_batch=16, global_batch=512, iters=20000,
                        eval_interval=1000, save_interval=1000)  # fmt: skip


def llama_1b() -> TrainConfig:
    return _pretraining("llama-1b", seq=4096, lr=3e-4, warmup=2000, micro_batch=4, global_batch=256, iters=100000,
                        eval_interval=2000, save_interval=1000)  # fmt: skip


def llama3_8b() -> TrainConfig:
    return _pretraining("llama3-8b", seq=8192, lr=3e-4, warmup=2000, micro_batch=1, global_batch=128, iters=100000,
                        eval_interval=2000, save_interval=500,
                        parallel=ParallelSection(tp=2, pp=1, sequence_parallel=True))  # fmt: skip


def moe_tiny() -> TrainConfig:
    """``tiny``'s run (byte tokens, CPU in minutes) with the ``moe-tiny`` model: 2 layers, 8 experts of width 64, top-2
    routing with a small load-balancing loss; ``parallel.ep=2`` over two processes splits the experts."""
    run = tiny()
    run.model = preset("moe-tiny", vocab_size=259)  # the byte tokenizer's 256 bytes and its special tokens
    return run


def moe_8x4k() -> TrainConfig:
    """llama-1b's attention with 8 experts of width 4096 (top-2), llama-1b's run; one H200 holds it, add
    ``parallel.ep=N`` on N GPUs."""
    return _pretraining("moe-8x4k", seq=4096, lr=3e-4, warmup=2000, micro_batch=4, global_batch=256, iters=100000,
                        eval_interval=2000, save_interval=1000)  # fmt: skip


def moe_32x1k() -> TrainConfig:
    """As ``moe-8x4k`` with 32 experts of width 1024 (top-8): the same active FLOPs, finer experts."""
    return _pretraining("moe-32x1k", seq=4096, lr=3e-4, warmup=2000, micro_batch=4, global_batch=256, iters=100000,
                        eval_interval=2000, save_interval=1000)  # fmt: skip


def mixtral_8x7b() -> TrainConfig:
    """Mixtral 8x7B (47 B parameters, 13 B active): 4 pipeline stages, the 8 experts over 8 ranks (32 GPUs)."""
    return _pretraining("mixtral-8x7b", seq=4096, lr=3e-4, warmup=2000, micro_batch=1, global_batch=256,
                        iters=100000, eval_interval=2000, save_interval=500,
                        parallel=ParallelSection(pp=4, ep=8))  # fmt: skip


def qwen3_moe_30b_a3b() -> TrainConfig:
    """Qwen3-30B-A3B (128 experts, top-8): the experts over the 8 GPUs of one node."""
    return _pretraining("qwen3-moe-30b-a3b", seq=4096, lr=3e-4, warmup=2000, micro_batch=1, global_batch=256,
                        iters=100000, eval_interval=2000, save_interval=500,
                        parallel=ParallelSection(ep=8))  # fmt: skip


def deepseek_v3() -> TrainConfig:
    """DeepSeek-V3's sizes (671 B parameters; see the preset for what is modelled): 16 pipeline stages (the 3 dense
    layers first, 2 layers on the last stage beside the output layer, 4 on each other), the 256 experts over 64
    ranks (1024 GPUs)."""
    return _pretraining("deepseek-v3", seq=4096, lr=2.2e-4, warmup=2000, micro_batch=1, global_batch=2048,
                        iters=100000, eval_interval=2000, save_interval=500,
                        parallel=ParallelSection(pp=16, ep=64, first_stage_layers=3, last_stage_layers=2))  # fmt: skip


def hybrid_tiny() -> TrainConfig:
    """``tiny``'s run (byte tokens, CPU in minutes) with the ``hybrid-tiny`` model: Mamba-2, attention and MLP layers
    (pattern ``M*-M-``)."""
    run = tiny()
    run.model = preset("hybrid-tiny", vocab_size=259)
    return run


def mamba2_130m() -> TrainConfig:
    """Mamba-2 130M (24 Mamba-2 layers, no attention): the published recipe's 5x GPT-3's learning rate."""
    return _pretraining("mamba2-130m", seq=2048, lr=3e-3, warmup=1000, micro_batch=16, global_batch=256,
                        iters=100000, eval_interval=2000, save_interval=1000)  # fmt: skip


def mamba2_1_3b() -> TrainConfig:
    """Mamba-2 1.3B (48 Mamba-2 layers of width 2048)."""
    return _pretraining("mamba2-1.3b", seq=2048, lr=1e-3, warmup=2000, micro_batch=8, global_batch=256,
                        iters=100000, eval_interval=2000, save_interval=1000)  # fmt: skip


def hybrid_1b() -> TrainConfig:
    """``hybrid-1b``: llama-1b's width and parameter count as 14 Mamba-2, 2 attention and 16 MLP layers; llama-1b's
    run."""
    return _pretraining("hybrid-1b", seq=4096, lr=3e-4, warmup=2000, micro_batch=4, global_batch=256, iters=100000,
                        eval_interval=2000, save_interval=1000)  # fmt: skip


def nemotron_h_8b() -> TrainConfig:
    """Nemotron-H-8B's sizes and pattern at seq 8192 over tp2 + sequence parallelism."""
    return _pretraining("nemotron-h-8b", seq=8192, lr=3e-4, warmup=2000, micro_batch=1, global_batch=128,
                        iters=100000, eval_interval=2000, save_interval=500,
                        parallel=ParallelSection(tp=2, sequence_parallel=True))  # fmt: skip


def llava_tiny() -> TrainConfig:
    """A tiny LLaVA (tiny-clip tower, mlp projector, llava-tiny's 2-layer LM) on byte tokens and 16 px images: trains
    on a CPU in seconds (tests, the docs' two-stage example). The image token is 259, the byte tokenizer's first
    unused id; every sample's 16 image tokens and a short caption fit in 96 tokens."""
    from mcore_models.multimodal import llava_preset

    lm = llava_preset("llava-tiny").language.replace(vocab_size=260)  # the byte tokenizer's 259 ids + the image
    return TrainConfig(
        model=lm,
        data=DataSection(seq_length=96, tokenizer="byte", multimodal=True),
        optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.0, adam_beta2=0.95, clip_grad=1.0),
        scheduler=SchedulerSection(decay_style="cosine", warmup_iters=10, min_lr=3e-4),
        training=TrainingSection(micro_batch_size=8, global_batch_size=16, train_iters=100, eval_iters=0),
        checkpoint=CheckpointSection(keep_last=2),
        multimodal=MultimodalSection(vision="tiny-clip"),
    )


def llava_1b_clip336() -> TrainConfig:
    """The benchmark shape: CLIP ViT-L/14-336 (features of layer -2, 576 image tokens, CLIP's pixel normalization)
    through LLaVA-1.5's mlp projector into llama-1b, seq 4096, one image per sample, bf16, ZeRO-1; llama-1b's
    pretraining run otherwise (set data.tokenizer_model; the image token defaults to the tokenizer's vocabulary
    size, which must be below model.vocab_size)."""
    run = _pretraining("llama-1b", seq=4096, lr=2e-5, warmup=100, micro_batch=4, global_batch=256, iters=5000,
                       eval_interval=1000, save_interval=500)  # fmt: skip
    run.data = DataSection(seq_length=4096, tokenizer="hf", multimodal=True)
    run.training.eval_iters = 0
    run.multimodal = MultimodalSection(vision="clip-vit-l14-336", vision_feature_layer=-2,
                                       image_mean=[0.48145466, 0.4578275, 0.40821073],
                                       image_std=[0.26862954, 0.26130258, 0.27577711],
                                       data_workers=4)  # fmt: skip
    return run


RECIPES: dict[str, Callable[[], TrainConfig]] = {
    "tiny": tiny,
    "gpt2-124m": gpt2_124m,
    "llama-1b": llama_1b,
    "llama3-8b": llama3_8b,
    "moe-tiny": moe_tiny,
    "moe-8x4k": moe_8x4k,
    "moe-32x1k": moe_32x1k,
    "mixtral-8x7b": mixtral_8x7b,
    "qwen3-moe-30b-a3b": qwen3_moe_30b_a3b,
    "deepseek-v3": deepseek_v3,
    "mamba2-130m": mamba2_130m,
    "mamba2-1.3b": mamba2_1_3b,
    "hybrid-1b": hybrid_1b,
    "nemotron-h-8b": nemotron_h_8b,
    "hybrid-tiny": hybrid_tiny,
    "llava-tiny": llava_tiny,
    "llava-1b-clip336": llava_1b_clip336,
}


def recipe_tree(name: str) -> dict[str, Any]:
    """Recipe ``name`` as the plain tree :func:`~mcore_train.config.load_config` merges a YAML file and overrides
    into (:func:`~mcore_train.config.config_changes`)."""
    from mcore_train.errors import ConfigError

    if name not in RECIPES:
        raise ConfigError([f"recipe: unknown recipe {name!r}; known: {', '.join(RECIPES)}"])
    return {"recipe": name, **config_changes(RECIPES[name]())}
