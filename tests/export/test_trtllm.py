"""``export_trtllm``: rank files re-assembled by an independent reading of the format reproduce the model.

The format's rules are re-implemented here from the TensorRT-LLM reference (not from the exporter): per-rank fused
``[Q_r; K_r; V_r]`` with KV heads duplicated consecutively when there are fewer than tp; ``mlp.fc`` = the activated
branch (HF ``gate_proj``), ``mlp.gate`` = the multiplied one (HF ``up_proj``); row/column splits; ``lm_head`` padded to a
multiple of tp; layers renumbered per stage (``tensor_split`` placement). Expected weights come from the model in
Hugging Face naming (``mcore_models.hf.mcore_to_hf``, itself checked against ``transformers``). A tensor-parallel
forward pass over the rank files (each rank its own heads and its own duplicated KV head, partial outputs summed)
must also give GPTModel's logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from mcore_export import ExportError, LayoutError, build_engine, export_trtllm
from mcore_models import ConversionError, TransformerConfig
from mcore_models.hf import mcore_to_hf
from tests.export._helpers import cached_checkpoint, gpt2, llama, logits, reference_model, save

CONFIGS = {
    "llama-gqa": llama(num_layers=4),  # 4 heads, 2 KV heads, vocab 101: kv < tp at tp 4, padding at tp 2 and 4
    "llama-mha-tied": llama(num_query_groups=4, share_embeddings_and_output_weights=True, num_layers=3),
    "llama-mqa": llama(num_query_groups=1, num_layers=2),
    "gpt2": gpt2(num_layers=4),
}


def _stage_layers(num_layers: int, pp: int) -> list[list[int]]:
    # current TensorRT-LLM: torch.tensor_split(arange(L), pp): the first L % pp stages get one more layer
    return [chunk.tolist() for chunk in torch.tensor_split(torch.arange(num_layers), pp)]


def _load_ranks(out: Path) -> tuple[dict[str, Any], list[dict[str, torch.Tensor]]]:
    cfg = json.loads((out / "config.json").read_text())
    world = cfg["mapping"]["world_size"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json"] + sorted(
        f"rank{r}.safetensors" for r in range(world)
    )
    ranks = []
    for r in range(world):
        with safe_open(str(out / f"rank{r}.safetensors"), framework="pt") as f:
            ranks.append({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return cfg, ranks


def _expected_names(cfg: dict[str, Any], first: bool, last: bool, n_layers: int) -> set[str]:
    gpt = cfg["architecture"] == "GPTForCausalLM"
    norm = ("weight", "bias") if gpt else ("weight",)
    names = set()
    if first:
        names.add("transformer.vocab_embedding.weight")
        if cfg["position_embedding_type"] == "learned_absolute":
            names.add("transformer.position_embedding.weight")
    for j in range(n_layers):
        p = f"transformer.layers.{j}"
        names |= {f"{p}.input_layernorm.{n}" for n in norm} | {f"{p}.post_layernorm.{n}" for n in norm}
        gated = cfg["hidden_act"] in ("silu", "swiglu")
        for lin in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.proj") + (("mlp.gate",) if gated else ()):
            names.add(f"{p}.{lin}.weight")
            if gpt and cfg["bias"]:
                names.add(f"{p}.{lin}.bias")
    if last:
        names |= {f"transformer.ln_f.{n}" for n in norm} | {"lm_head.weight"}
    return names


def _reassemble(cfg: dict[str, Any], ranks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full weights in HF Llama naming (q/k/v, gate/up/down, ...) from the rank files."""
    tp, pp = cfg["mapping"]["tp_size"], cfg["mapping"]["pp_size"]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"]
    kv_dup = max(nkv, tp)  # KV heads after duplication
    V = cfg["vocab_size"]
    out: dict[str, torch.Tensor] = {}
    stages = _stage_layers(cfg["num_hidden_layers"], pp)
    for s in range(pp):
        files = [ranks[s * tp + t] for t in range(tp)]
        for f in files:
            assert set(f) == _expected_names(cfg, s == 0, s == pp - 1, len(stages[s])), f"stage {s}"
        if s == 0:
            emb = files[0]["transformer.vocab_embedding.weight"]
            assert all(torch.equal(f["transformer.vocab_embedding.weight"], emb) for f in files)  # not split
            out["embed"] = emb
            if "transformer.position_embedding.weight" in files[0]:
                out["wpe"] = files[0]["transformer.position_embedding.weight"]
        for j, layer in enumerate(stages[s]):
            p, o = f"transformer.layers.{j}", f"layers.{layer}"
            qkv = [f[f"{p}.attention.qkv.weight"] for f in files]
            for f_ in qkv:
                assert f_.shape[0] == (nh + 2 * kv_dup) * d // tp
            q_rows, kv_rows = nh * d // tp, kv_dup * d // tp
            q = torch.cat([t[:q_rows] for t in qkv])
            k_dup = torch.cat([t[q_rows : q_rows + kv_rows] for t in qkv])
            v_dup = torch.cat([t[q_rows + kv_rows :] for t in qkv])
            rep = kv_dup // nkv  # each KV head repeated `rep` times consecutively
            k_heads, v_heads = k_dup.view(nkv, rep, d, -1), v_dup.view(nkv, rep, d, -1)
            assert all(torch.equal(k_heads[:, i], k_heads[:, 0]) for i in range(rep))
            assert all(torch.equal(v_heads[:, i], v_heads[:, 0]) for i in range(rep))
            out[f"{o}.q"], out[f"{o}.k"], out[f"{o}.v"] = (
                q,
                k_heads[:, 0].reshape(nkv * d, -1),
                v_heads[:, 0].reshape(nkv * d, -1),
            )
            out[f"{o}.o"] = torch.cat([f[f"{p}.attention.dense.weight"] for f in files], dim=1)
            out[f"{o}.fc"] = torch.cat([f[f"{p}.mlp.fc.weight"] for f in files])
            if f"{p}.mlp.gate.weight" in files[0]:
                out[f"{o}.gate"] = torch.cat([f[f"{p}.mlp.gate.weight"] for f in files])
            out[f"{o}.proj"] = torch.cat([f[f"{p}.mlp.proj.weight"] for f in files], dim=1)
            for n in ("input_layernorm", "post_layernorm"):
                for kind in ("weight", "bias"):
                    if f"{p}.{n}.{kind}" in files[0]:
                        out[f"{o}.{n}.{kind}"] = files[0][f"{p}.{n}.{kind}"]
            if f"{p}.attention.qkv.bias" in files[0]:
                b = [f[f"{p}.attention.qkv.bias"] for f in files]
                out[f"{o}.qkv_bias"] = torch.cat(
                    [torch.cat([t[:q_rows] for t in b]), torch.cat([t[q_rows : q_rows + kv_rows] for t in b]),
                     torch.cat([t[q_rows + kv_rows :] for t in b])])  # fmt: skip
                out[f"{o}.o_bias"] = files[0][f"{p}.attention.dense.bias"]  # not split
                assert all(torch.equal(f[f"{p}.attention.dense.bias"], out[f"{o}.o_bias"]) for f in files)
                out[f"{o}.fc_bias"] = torch.cat([f[f"{p}.mlp.fc.bias"] for f in files])
                out[f"{o}.proj_bias"] = files[0][f"{p}.mlp.proj.bias"]
        if s == pp - 1:
            head = torch.cat([f["lm_head.weight"] for f in files])
            assert head.shape[0] == math.ceil(V / tp) * tp  # padded to a multiple of tp
            assert torch.count_nonzero(head[V:]) == 0
            out["lm_head"] = head[:V]
            for kind in ("weight", "bias"):
                if f"transformer.ln_f.{kind}" in files[0]:
                    out[f"ln_f.{kind}"] = files[0][f"transformer.ln_f.{kind}"]
    return out


def _check_against_model(config: TransformerConfig, full: dict[str, torch.Tensor]) -> None:
    sd = reference_model(config).global_state_dict()
    hf = dict(mcore_to_hf(config, sd.__getitem__))
    H = config.hidden_size
    if config.normalization == "rmsnorm":
        assert torch.equal(full["embed"], hf["model.embed_tokens.weight"])
        assert torch.equal(full["lm_head"], hf.get("lm_head.weight", hf["model.embed_tokens.weight"]))
        assert torch.equal(full["ln_f.weight"], hf["model.norm.weight"])
        for i in range(config.num_layers):
            h, o = f"model.layers.{i}", f"layers.{i}"
            for ours, theirs in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                                 ("o", "self_attn.o_proj"), ("fc", "mlp.gate_proj"), ("gate", "mlp.up_proj"),
                                 ("proj", "mlp.down_proj"), ("input_layernorm", "input_layernorm"),
                                 ("post_layernorm", "post_attention_layernorm")):  # fmt: skip
                key = f"{o}.{ours}" if ours in ("q", "k", "v", "o", "fc", "gate", "proj") else f"{o}.{ours}.weight"
                assert torch.equal(full[key], hf[f"{h}.{theirs}.weight"]), key
        return
    # GPT-2 naming: Conv1D weights are [in, out]
    assert torch.equal(full["embed"], hf["transformer.wte.weight"])
    assert torch.equal(full["wpe"], hf["transformer.wpe.weight"])
    assert torch.equal(full["lm_head"], hf["transformer.wte.weight"])
    for kind in ("weight", "bias"):
        assert torch.equal(full[f"ln_f.{kind}"], hf[f"transformer.ln_f.{kind}"])
    for i in range(config.num_layers):
        h, o = f"transformer.h.{i}", f"layers.{i}"
        q, k, v = hf[f"{h}.attn.c_attn.weight"].t().split(H)
        assert torch.equal(full[f"{o}.q"], q) and torch.equal(full[f"{o}.k"], k) and torch.equal(full[f"{o}.v"], v)
        assert torch.equal(full[f"{o}.qkv_bias"], hf[f"{h}.attn.c_attn.bias"])
        assert torch.equal(full[f"{o}.o"], hf[f"{h}.attn.c_proj.weight"].t())
        assert torch.equal(full[f"{o}.o_bias"], hf[f"{h}.attn.c_proj.bias"])
        assert torch.equal(full[f"{o}.fc"], hf[f"{h}.mlp.c_fc.weight"].t())
        assert torch.equal(full[f"{o}.fc_bias"], hf[f"{h}.mlp.c_fc.bias"])
        assert torch.equal(full[f"{o}.proj"], hf[f"{h}.mlp.c_proj.weight"].t())
        assert torch.equal(full[f"{o}.proj_bias"], hf[f"{h}.mlp.c_proj.bias"])
        for ours, theirs in (("input_layernorm", "ln_1"), ("post_layernorm", "ln_2")):
            for kind in ("weight", "bias"):
                assert torch.equal(full[f"{o}.{ours}.{kind}"], hf[f"{h}.{theirs}.{kind}"])


def _rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate-half RoPE (``rope_gpt_neox``) on ``[b, heads, s, d]``."""
    d, s = x.shape[-1], x.shape[-2]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _trt_forward(cfg: dict[str, Any], ranks: list[dict[str, torch.Tensor]], ids: torch.Tensor) -> torch.Tensor:
    """The model as TensorRT-LLM would run it: every rank its own heads and MLP slice, partial outputs summed."""
    tp, pp = cfg["mapping"]["tp_size"], cfg["mapping"]["pp_size"]
    nh, nkv, d, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"], cfg["norm_epsilon"]
    gpt = cfg["architecture"] == "GPTForCausalLM"
    h_loc, kv_loc = nh // tp, max(nkv, tp) // tp
    b, s = ids.shape

    def norm(x: torch.Tensor, f: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        if gpt:
            return F.layer_norm(x, x.shape[-1:], f[f"{name}.weight"].double(), f[f"{name}.bias"].double(), eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * f[f"{name}.weight"].double()

    def bias(f: dict[str, torch.Tensor], name: str) -> torch.Tensor | int:
        return f[name].double() if name in f else 0

    x = ranks[0]["transformer.vocab_embedding.weight"].double()[ids]
    if "transformer.position_embedding.weight" in ranks[0]:
        x = x + ranks[0]["transformer.position_embedding.weight"].double()[:s]
    mask = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)
    for stage in range(pp):
        files = [ranks[stage * tp + t] for t in range(tp)]
        n_layers = len({k.split(".")[2] for k in files[0] if k.startswith("transformer.layers.")})
        for j in range(n_layers):
            p = f"transformer.layers.{j}"
            hidden = norm(x, files[0], f"{p}.input_layernorm")
            attn_out = bias(files[0], f"{p}.attention.dense.bias")  # row-parallel bias: added once
            for f in files:
                qkv = hidden @ f[f"{p}.attention.qkv.weight"].double().t() + bias(f, f"{p}.attention.qkv.bias")
                q, k, v = qkv.split([h_loc * d, kv_loc * d, kv_loc * d], dim=-1)
                q = q.view(b, s, h_loc, d).transpose(1, 2)
                k = k.view(b, s, kv_loc, d).transpose(1, 2).repeat_interleave(h_loc // kv_loc, dim=1)
                v = v.view(b, s, kv_loc, d).transpose(1, 2).repeat_interleave(h_loc // kv_loc, dim=1)
                if cfg["position_embedding_type"] == "rope_gpt_neox":
                    q, k = _rope(q, cfg["rotary_base"]), _rope(k, cfg["rotary_base"])
                att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + mask, dim=-1) @ v
                attn_out = (
                    attn_out
                    + att.transpose(1, 2).reshape(b, s, h_loc * d) @ f[f"{p}.attention.dense.weight"].double().t()
                )
            x = x + attn_out
            hidden = norm(x, files[0], f"{p}.post_layernorm")
            mlp_out = bias(files[0], f"{p}.mlp.proj.bias")
            for f in files:
                fc = hidden @ f[f"{p}.mlp.fc.weight"].double().t() + bias(f, f"{p}.mlp.fc.bias")
                act = cfg["hidden_act"]
                if act == "gelu":  # TensorRT-LLM's gelu is the tanh approximation
                    inter = F.gelu(fc, approximate="tanh")
                elif act == "squared-relu":
                    inter = F.relu(fc).square()
                else:  # silu (Llama) / swiglu (GPT): the activated branch is mlp.fc, multiplied by mlp.gate
                    gate = hidden @ f[f"{p}.mlp.gate.weight"].double().t() + bias(f, f"{p}.mlp.gate.bias")
                    inter = F.silu(fc) * gate
                mlp_out = mlp_out + inter @ f[f"{p}.mlp.proj.weight"].double().t()
            x = x + mlp_out
    last = [ranks[(pp - 1) * tp + t] for t in range(tp)]
    x = norm(x, last[0], "transformer.ln_f")
    logits = torch.cat([x @ f["lm_head.weight"].double().t() for f in last], dim=-1)
    return logits[..., : cfg["vocab_size"]]


LAYOUTS = [(tp, pp) for tp in (1, 2, 4) for pp in (1, 2)]


@pytest.mark.parametrize(("tp", "pp"), LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
@pytest.mark.parametrize("name", ["llama-gqa", "gpt2"])
def test_rank_files_reassemble_to_the_model(name: str, tp: int, pp: int, ckpt_cache: dict, ckpt_root: Path,
                                            tmp_path: Path) -> None:  # fmt: skip
    config = CONFIGS[name]
    ckpt = cached_checkpoint(ckpt_cache, ckpt_root, f"trt-{name}", config, 2, 2)  # trained at tp2 x pp2
    out = export_trtllm(ckpt, tmp_path / "trt", tp=tp, pp=pp)
    cfg, ranks = _load_ranks(out)
    assert cfg["mapping"] == {"world_size": tp * pp, "tp_size": tp, "pp_size": pp, "cp_size": 1, "gpus_per_node": 8}
    _check_against_model(config, _reassemble(cfg, ranks))
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(tp * 10 + pp))
    expected = logits(reference_model(config), ids).double()
    torch.testing.assert_close(_trt_forward(cfg, ranks, ids), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "tp", "pp"),
    [("llama-mqa", 4, 1), ("llama-mha-tied", 2, 2), ("llama-mqa", 2, 2)],
    ids=["mqa-kv1-tp4", "mha-tied-layers3-pp2", "mqa-tp2pp2"],
)
def test_kv_duplication_tied_and_uneven_stages(name: str, tp: int, pp: int, tmp_path: Path) -> None:
    config = CONFIGS[name]
    ckpt = save(config, tmp_path / "ckpt")
    cfg, ranks = _load_ranks(export_trtllm(ckpt, tmp_path / "trt", tp=tp, pp=pp))
    assert cfg["num_key_value_heads"] == config.query_groups  # the original count, not the duplicated one
    if config.num_layers == 3 and pp == 2:  # stage 0 gets layers 0,1 and stage 1 layer 2, renumbered from 0
        assert {k.split(".")[2] for k in ranks[0] if k.startswith("transformer.layers.")} == {"0", "1"}
        assert {k.split(".")[2] for k in ranks[tp] if k.startswith("transformer.layers.")} == {"0"}
    _check_against_model(config, _reassemble(cfg, ranks))
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_trt_forward(cfg, ranks, ids), logits(reference_model(config), ids).double(),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_config_fields(tmp_path: Path) -> None:
    config = llama(rotary_base=500000.0, rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 16})  # fmt: skip
    ckpt = save(config, tmp_path / "ckpt")
    cfg, ranks = _load_ranks(export_trtllm(ckpt, tmp_path / "trt", tp=2, pp=1, dtype="bf16"))
    assert cfg["architecture"] == "LlamaForCausalLM" and cfg["dtype"] == "bfloat16"
    assert cfg["logits_dtype"] == "float32"
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (101, 32, 2)  # unpadded, global
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"]) == (4, 2, 8)
    assert (cfg["intermediate_size"], cfg["hidden_act"], cfg["norm_epsilon"]) == (48, "silu", 1e-6)
    assert cfg["position_embedding_type"] == "rope_gpt_neox" and cfg["rotary_base"] == 500000.0
    assert cfg["rotary_scaling"]["type"] == "llama3" and cfg["rotary_scaling"]["factor"] == 8.0
    assert cfg["max_position_embeddings"] == 64 and cfg["tie_word_embeddings"] is False
    assert cfg["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": None}
    assert cfg["use_parallel_embedding"] is False and cfg["mlp_bias"] is False and cfg["attn_bias"] is False
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for r in ranks for t in r.values())
    g = json.loads((export_trtllm(save(gpt2(), tmp_path / "g"), tmp_path / "gt", tp=2) / "config.json").read_text())
    assert g["architecture"] == "GPTForCausalLM" and g["hidden_act"] == "gelu" and g["bias"] is True
    assert g["position_embedding_type"] == "learned_absolute" and g["gpt_variant"] == "gpt2"


def test_refusals_write_nothing(tmp_path: Path) -> None:
    ckpt = save(llama(), tmp_path / "ckpt")  # 4 heads, 2 KV heads, ffn 48
    for tp, pp, match in ((3, 1, "not divisible by tp=3"), (1, 3, "pp=3 is larger"), (8, 1, "tp=8")):
        with pytest.raises(LayoutError, match=match):
            export_trtllm(ckpt, tmp_path / "trt", tp=tp, pp=pp)
    with pytest.raises(ConversionError, match="qk_layernorm"):
        export_trtllm(save(llama(qk_layernorm=True), tmp_path / "qk"), tmp_path / "trt")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ExportError, match="not empty"):
        export_trtllm(ckpt, tmp_path / "busy")
    assert not (tmp_path / "trt").exists()
    assert not list(tmp_path.glob(".tmp*"))


def test_engine_build_needs_tensorrt_llm(tmp_path: Path) -> None:
    if __import__("importlib").util.find_spec("tensorrt_llm") is not None:
        pytest.skip("tensorrt_llm is installed")
    with pytest.raises(ExportError, match="tensorrt-llm"):
        build_engine(tmp_path / "trt", tmp_path / "engine")


@pytest.mark.parametrize(
    "config",
    [
        gpt2(
            activation="swiglu",
            position_embedding="rope",
            add_bias_linear=False,
            ffn_hidden_size=48,
            num_query_groups=2,
            share_embeddings_and_output_weights=False,
        ),
        gpt2(activation="squared_relu", num_layers=3),
    ],
    ids=["gpt-rope-swiglu-gqa-nobias", "gpt-squared-relu"],
)
def test_gpt_variants_forward(config: TransformerConfig, tmp_path: Path) -> None:
    """GPTForCausalLM beyond GPT-2: rotary positions, gated MLP (fc activated, gate multiplied), GQA, no biases."""
    ckpt = save(config, tmp_path / "ckpt")
    for tp, pp in ((1, 1), (2, 2)):
        cfg, ranks = _load_ranks(export_trtllm(ckpt, tmp_path / f"trt{tp}{pp}", tp=tp, pp=pp))
        assert cfg["architecture"] == "GPTForCausalLM" and "gpt_variant" not in cfg
        assert cfg["hidden_act"] == {"swiglu": "swiglu", "squared_relu": "squared-relu"}[config.activation]
        for r in range(tp * pp):
            stage = r // tp
            n = len(_stage_layers(config.num_layers, pp)[stage])
            assert set(ranks[r]) == _expected_names(cfg, stage == 0, stage == pp - 1, n)
        ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(_trt_forward(cfg, ranks, ids), logits(reference_model(config), ids).double(),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
