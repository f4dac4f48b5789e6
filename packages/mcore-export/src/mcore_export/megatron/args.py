"""Megatron-LM's arguments (``args``, the ``argparse.Namespace`` a checkpoint saves) and mcore's ``TransformerConfig``.

:func:`config_from_args` reads a checkpoint's args (or the Megatron flags given on the command line when it has none:
:func:`parse_megatron_flags`), refusing what mcore's model cannot represent with the flag to change;
:func:`args_from_config` is the reverse for ``mcore-export megatron``. :data:`MODEL_FLAGS` lists the Megatron flags
read here, each with its ``args`` attribute, so saved args, command-line flags and the docs agree.
"""

from __future__ import annotations

import argparse
import logging
import shlex
from collections.abc import Sequence
from typing import Any

import torch

from mcore_export.megatron._unpickle import MegatronFormatError
from mcore_models import RopeScaling, TransformerConfig
from mcore_models.moe_config import MoEConfig

__all__ = ["MODEL_FLAGS", "config_from_args", "args_from_config", "parse_megatron_flags", "merge_flags"]

logger = logging.getLogger(__name__)


def _flag_bool(text: str) -> bool:
    return text.lower() in ("1", "true", "yes")


# (flag, args attribute, type; None = a store_true switch)
MODEL_FLAGS: list[tuple[str, str, Any]] = [
    ("--num-layers", "num_layers", int),
    ("--hidden-size", "hidden_size", int),
    ("--ffn-hidden-size", "ffn_hidden_size", int),
    ("--num-attention-heads", "num_attention_heads", int),
    ("--group-query-attention", "group_query_attention", None),
    ("--num-query-groups", "num_query_groups", int),
    ("--kv-channels", "kv_channels", int),
    ("--seq-length", "seq_length", int),
    ("--max-position-embeddings", "max_position_embeddings", int),
    ("--position-embedding-type", "position_embedding_type", str),
    ("--rotary-base", "rotary_base", float),
    ("--rotary-percent", "rotary_percent", float),
    ("--use-rope-scaling", "use_rope_scaling", None),
    ("--rope-scaling-factor", "rope_scaling_factor", float),
    ("--normalization", "normalization", str),
    ("--norm-epsilon", "layernorm_epsilon", float),
    ("--swiglu", "swiglu", None),
    ("--squared-relu", "squared_relu", None),
    ("--openai-gelu", "openai_gelu", None),
    ("--disable-bias-linear", "add_bias_linear", "negate"),
    ("--add-qkv-bias", "add_qkv_bias", None),
    ("--qk-layernorm", "qk_layernorm", None),
    ("--untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights", None),
    ("--vocab-size", "vocab_size", int),
    ("--make-vocab-size-divisible-by", "make_vocab_size_divisible_by", int),
    ("--init-method-std", "init_method_std", float),
    ("--attention-dropout", "attention_dropout", float),
    ("--hidden-dropout", "hidden_dropout", float),
    ("--bf16", "bf16", None),
    ("--fp16", "fp16", None),
    ("--num-experts", "num_experts", int),
    ("--moe-ffn-hidden-size", "moe_ffn_hidden_size", int),
    ("--moe-router-topk", "moe_router_topk", int),
    ("--moe-router-score-function", "moe_router_score_function", str),
    ("--moe-router-pre-softmax", "moe_router_pre_softmax", None),
    ("--moe-router-topk-scaling-factor", "moe_router_topk_scaling_factor", float),
    ("--moe-router-load-balancing-type", "moe_router_load_balancing_type", str),
    ("--moe-aux-loss-coeff", "moe_aux_loss_coeff", float),
    ("--moe-z-loss-coeff", "moe_z_loss_coeff", float),
    ("--moe-shared-expert-intermediate-size", "moe_shared_expert_intermediate_size", int),
    ("--moe-expert-capacity-factor", "moe_expert_capacity_factor", float),
    ("--moe-token-dispatcher-type", "moe_token_dispatcher_type", str),
    ("--moe-grouped-gemm", "moe_grouped_gemm", None),
    ("--tensor-model-parallel-size", "tensor_model_parallel_size", int),
    ("--pipeline-model-parallel-size", "pipeline_model_parallel_size", int),
    ("--expert-model-parallel-size", "expert_model_parallel_size", int),
    ("--num-layers-per-virtual-pipeline-stage", "num_layers_per_virtual_pipeline_stage", int),
]
_REFUSED = {  # args attribute: (what, value that is fine)
    "multi_latent_attention": ("multi-latent attention (--multi-latent-attention)", False),
    "layernorm_zero_centered_gamma": ("zero-centred norm weights (--apply-layernorm-1p)", False),
    "apply_residual_connection_post_layernorm": ("--apply-residual-connection-post-layernorm", False),
    "rotary_interleaved": ("interleaved rotary embeddings (--rotary-interleaved)", False),
    "hybrid_layer_pattern": ("hybrid (Mamba) models (--hybrid-layer-pattern)", None),
    "window_size": ("sliding-window attention (--window-size)", None),
    "mtp_num_layers": ("multi-token prediction layers (--mtp-num-layers)", None),
    "heterogeneous_layers_config_path": ("heterogeneous layers (--heterogeneous-layers-config-path)", None),
    "quick_geglu": ("--quick-geglu", False),
    "moe_use_upcycling": ("--moe-use-upcycling", False),
}


def parse_megatron_flags(flags: Sequence[str] | str) -> argparse.Namespace:
    """The Megatron flags of :data:`MODEL_FLAGS` (``["--num-layers", "2", ...]`` or one string) as an args namespace
    holding only the flags given."""
    p = argparse.ArgumentParser(prog="megatron flags", add_help=False, exit_on_error=False)
    for flag, attr, kind in MODEL_FLAGS:
        if kind is None:
            p.add_argument(flag, dest=attr, action="store_const", const=True, default=argparse.SUPPRESS)
        elif kind == "negate":
            p.add_argument(flag, dest=attr, action="store_const", const=False, default=argparse.SUPPRESS)
        else:
            p.add_argument(flag, dest=attr, type=kind, default=argparse.SUPPRESS)
    words = shlex.split(flags) if isinstance(flags, str) else list(flags)
    try:
        ns, unknown = p.parse_known_args(words)
    except (argparse.ArgumentError, SystemExit) as e:
        raise MegatronFormatError(f"Megatron flags {' '.join(words)!r}: {e}") from None
    if unknown:
        known = ", ".join(f for f, _, _ in MODEL_FLAGS)
        raise MegatronFormatError(f"Megatron flags not read by the importer: {unknown}; it reads {known}")
    if getattr(ns, "num_query_groups", None) is not None:
        ns.group_query_attention = True
    return ns


def merge_flags(saved: Any | None, flags: argparse.Namespace, where: str) -> argparse.Namespace:
    """The checkpoint's args with the command-line flags filled in; a flag that contradicts the saved args is an
    error naming both (the checkpoint's args describe the tensors it holds)."""
    out = argparse.Namespace(**(vars(saved) if saved is not None else {}))
    wrong = []
    for attr, value in vars(flags).items():
        old = getattr(out, attr, None)
        if saved is not None and old is not None and old != value and attr != "vocab_size":
            flag = next(f for f, a, _ in MODEL_FLAGS if a == attr)
            wrong.append(f"{flag} {value!r} but the checkpoint's args have {attr}={old!r}")
        setattr(out, attr, value)
    if wrong:
        raise MegatronFormatError(f"{where}: config mismatch: " + "; ".join(wrong) + " (drop the flag, or fix it)")
    return out


def _get(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def _need(args: Any, name: str, where: str) -> Any:
    value = getattr(args, name, None)
    if value is None:
        flag = next((f for f, a, _ in MODEL_FLAGS if a == name), f"--{name.replace('_', '-')}")
        raise MegatronFormatError(
            f"{where}: the model's {name} is not known: the checkpoint saved no args with it; pass {flag} N "
            "(Megatron's flag, after --) as the training run used it"
        )
    return value


def _refusals(args: Any, where: str) -> None:
    bad = [what for attr, (what, fine) in _REFUSED.items() if getattr(args, attr, fine) not in (fine, None, False, 0)]
    norm = str(_get(args, "normalization", "LayerNorm"))
    if norm not in ("LayerNorm", "RMSNorm"):
        bad.append(f"--normalization {norm}")
    if _get(args, "softmax_type", "vanilla") != "vanilla":
        bad.append(f"--softmax-type {args.softmax_type}")
    if _get(args, "num_experts", 0) and _get(args, "moe_router_load_balancing_type", "aux_loss") == "sinkhorn":
        bad.append("--moe-router-load-balancing-type sinkhorn")
    if bad:
        raise MegatronFormatError(f"{where}: mcore's GPT model cannot represent: {'; '.join(bad)}")


def _activation(args: Any) -> str:
    if _get(args, "swiglu", False):
        return "swiglu"
    if _get(args, "squared_relu", False):
        return "squared_relu"
    return "gelu_tanh" if _get(args, "openai_gelu", False) else "gelu"


def _moe(args: Any) -> MoEConfig | None:
    experts = _get(args, "num_experts", 0)
    if not experts:
        return None
    balance = _get(args, "moe_router_load_balancing_type", "aux_loss")
    dispatcher = _get(args, "moe_token_dispatcher_type", "allgather")
    freq = _get(args, "moe_layer_freq", 1)
    return MoEConfig(
        num_experts=experts,
        ffn_hidden_size=_get(args, "moe_ffn_hidden_size"),
        layer_freq=list(freq) if isinstance(freq, (list, tuple)) else int(freq),
        router_topk=_get(args, "moe_router_topk", 2),
        router_score_function=_get(args, "moe_router_score_function", "softmax"),
        router_pre_softmax=bool(_get(args, "moe_router_pre_softmax", False)),
        router_topk_scaling_factor=_get(args, "moe_router_topk_scaling_factor"),
        router_num_groups=_get(args, "moe_router_num_groups"),
        router_group_topk=_get(args, "moe_router_group_topk"),
        router_enable_expert_bias=bool(_get(args, "moe_router_enable_expert_bias", False)),
        router_bias_update_rate=_get(args, "moe_router_bias_update_rate", 1e-3),
        input_jitter_eps=_get(args, "moe_input_jitter_eps"),
        z_loss_coeff=_get(args, "moe_z_loss_coeff"),
        load_balancing_type=balance,
        aux_loss_coeff=float(_get(args, "moe_aux_loss_coeff", 0.0) or 0.0),
        shared_expert_ffn_hidden_size=_get(args, "moe_shared_expert_intermediate_size"),
        shared_expert_gate=bool(_get(args, "moe_shared_expert_gate", False)),
        capacity_factor=_get(args, "moe_expert_capacity_factor"),
        token_drop_policy=_get(args, "moe_token_drop_policy", "probs"),
        pad_expert_input_to_capacity=bool(_get(args, "moe_pad_expert_input_to_capacity", False)),
        token_dispatcher="allgather" if dispatcher == "allgather" else "alltoall",
    )


def _dtype(args: Any) -> str:
    if _get(args, "bf16", False):
        return "bfloat16"
    if _get(args, "fp16", False):
        return "float16"
    stored = getattr(args, "params_dtype", None)
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(stored, "float32") if stored else "float32"


def _padded_vocab(args: Any, where: str) -> int:
    """``args.padded_vocab_size``, else Megatron's padding of ``--vocab-size`` (to ``--make-vocab-size-divisible-by``
    times the tensor-parallel size)."""
    padded = getattr(args, "padded_vocab_size", None)
    if padded is not None:
        return int(padded)
    vocab = _need(args, "vocab_size", where)
    multiple = int(_get(args, "make_vocab_size_divisible_by", 128)) * int(_get(args, "tensor_model_parallel_size", 1))
    return -(-int(vocab) // multiple) * multiple


def config_from_args(args: Any, where: str, vocab_size: int | None = None) -> TransformerConfig:
    """The ``TransformerConfig`` of a Megatron GPT model described by ``args`` (``where`` names the source in errors).

    The vocabulary is Megatron's padded one (``args.padded_vocab_size``: its embedding rows and logits) unless
    ``vocab_size`` (at most that) is given."""
    _refusals(args, where)
    heads = _need(args, "num_attention_heads", where)
    hidden = _need(args, "hidden_size", where)
    kv = getattr(args, "kv_channels", None)
    position = _get(args, "position_embedding_type", "learned_absolute")
    rope = None
    if position == "rope" and _get(args, "use_rope_scaling", False):
        rope = RopeScaling(factor=float(_get(args, "rope_scaling_factor", 8.0)))
    padded = _padded_vocab(args, where)
    if vocab_size is not None and not 0 < vocab_size <= padded:
        raise MegatronFormatError(f"{where}: --vocab-size {vocab_size} must be in [1, {padded}] (the padded vocab)")
    fields: dict[str, Any] = dict(
        num_layers=_need(args, "num_layers", where),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=_get(args, "num_query_groups") if _get(args, "group_query_attention", False) else None,
        kv_channels=kv if kv is not None and kv * heads != hidden else None,
        ffn_hidden_size=_get(args, "ffn_hidden_size"),
        activation=_activation(args),
        normalization="rmsnorm" if _get(args, "normalization", "LayerNorm") == "RMSNorm" else "layernorm",
        norm_eps=float(_get(args, "layernorm_epsilon", _get(args, "norm_epsilon", 1e-5))),
        add_bias_linear=bool(_get(args, "add_bias_linear", True)),
        add_qkv_bias=bool(_get(args, "add_qkv_bias", False)),
        qk_layernorm=bool(_get(args, "qk_layernorm", False)),
        attention_dropout=float(_get(args, "attention_dropout", 0.1)),
        hidden_dropout=float(_get(args, "hidden_dropout", 0.1)),
        position_embedding=position if position in ("rope", "learned_absolute", "none") else "none",
        max_position_embeddings=_get(args, "max_position_embeddings", _get(args, "seq_length", 2048)),
        rotary_base=float(_get(args, "rotary_base", 10000)),
        rotary_percent=float(_get(args, "rotary_percent", 1.0)),
        rope_scaling=rope,
        vocab_size=vocab_size or padded,
        share_embeddings_and_output_weights=not _get(args, "untie_embeddings_and_output_weights", False),
        init_method_std=float(_get(args, "init_method_std", 0.02)),
        params_dtype=_dtype(args),
        moe=_moe(args),
        extra={"megatron_padded_vocab_size": padded},
    )
    if position not in ("rope", "learned_absolute", "none"):
        raise MegatronFormatError(f"{where}: --position-embedding-type {position} is not supported (rope, "
                                  "learned_absolute or none)")  # fmt: skip
    try:
        return TransformerConfig(**fields)
    except ValueError as e:
        raise MegatronFormatError(f"{where}: the args do not describe a valid model: {e}") from None


def args_from_config(
    config: TransformerConfig, tp: int, pp: int, padded_vocab: int, **extra: Any
) -> argparse.Namespace:
    """Megatron-LM args (the attributes a training run saves) describing ``config`` under ``tp`` x ``pp``."""
    c = config
    moe = c.moe
    args = argparse.Namespace(
        num_layers=c.num_layers,
        hidden_size=c.hidden_size,
        ffn_hidden_size=c.ffn_size,
        num_attention_heads=c.num_attention_heads,
        group_query_attention=c.query_groups != c.num_attention_heads,
        num_query_groups=c.query_groups,
        kv_channels=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        seq_length=c.max_position_embeddings,
        position_embedding_type=c.position_embedding,
        add_position_embedding=c.position_embedding == "learned_absolute",
        rotary_base=int(c.rotary_base) if float(c.rotary_base).is_integer() else c.rotary_base,
        rotary_percent=c.rotary_percent,
        use_rope_scaling=c.rope_scaling is not None,
        rope_scaling_factor=c.rope_scaling.factor if c.rope_scaling is not None else 8.0,
        normalization="RMSNorm" if c.normalization == "rmsnorm" else "LayerNorm",
        layernorm_epsilon=c.norm_eps,
        swiglu=c.activation == "swiglu",
        squared_relu=c.activation == "squared_relu",
        openai_gelu=c.activation == "gelu_tanh",
        add_bias_linear=c.add_bias_linear,
        add_qkv_bias=c.add_qkv_bias,
        qk_layernorm=c.qk_layernorm,
        untie_embeddings_and_output_weights=not c.share_embeddings_and_output_weights,
        vocab_size=c.vocab_size,
        padded_vocab_size=padded_vocab,
        init_method_std=c.init_method_std,
        attention_dropout=c.attention_dropout,
        hidden_dropout=c.hidden_dropout,
        bf16=c.params_dtype == "bfloat16",
        fp16=c.params_dtype == "float16",
        params_dtype=c.dtype,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=1,
        num_experts=moe.num_experts if moe else None,
        moe_ffn_hidden_size=moe.expert_ffn(c.ffn_size) if moe else None,
        moe_router_topk=moe.router_topk if moe else 2,
        moe_router_score_function=moe.router_score_function if moe else "softmax",
        moe_router_pre_softmax=moe.router_pre_softmax if moe else False,
        moe_router_load_balancing_type=moe.load_balancing_type if moe else "aux_loss",
        moe_aux_loss_coeff=moe.aux_loss_coeff if moe else 0.0,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size if moe else None,
        moe_layer_freq=moe.layer_freq if moe else 1,
        ckpt_format="torch_dist",
        use_dist_ckpt=True,
        **extra,
    )
    return args
