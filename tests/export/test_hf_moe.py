"""``import_hf`` / ``export_hf`` for mixture-of-experts models: Mixtral, Qwen2-MoE and Qwen3-MoE.

HF models are built from configs (random weights, no download) and saved with ``save_pretrained`` (the hub's
per-expert layout); the imported checkpoint must give HF's logits in GPTModel (fp32, 1e-5), the export must load with
``AutoModelForCausalLM.from_pretrained`` with no missing or unexpected keys and the same logits, and its safetensors
must equal the original file tensor for tensor. Files in the fused layout of the ``transformers`` module import too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mcore_export import export_hf, import_hf, trtllm_architecture
from mcore_export.cli import main
from mcore_models import ConversionError, GPTModel, TransformerConfig
from mcore_models.checkpoint import load_weights, model_config_from_checkpoint
from mcore_models.moe import MoEConfig
from mcore_parallel import ParallelConfig, ParallelState
from mcore_parallel.checkpoint import read_metadata
from mcore_parallel.checkpoint.zarr_io import write_group_metadata
from mcore_parallel.testing import run_distributed
from tests._hf_moe_cases import hf_model
from tests.export._helpers import llama, logits, reference_model, save

transformers = pytest.importorskip("transformers")

ARCHS = {"mixtral": "MixtralForCausalLM", "qwen2-moe-step2": "Qwen2MoeForCausalLM", "qwen3-moe": "Qwen3MoeForCausalLM"}


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(3))


def _hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
    return out


def _mcore_logits(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    config = model_config_from_checkpoint(ckpt)
    model = GPTModel(config.replace(seed=7)).eval()
    load_weights(model, ckpt)
    return logits(model, ids)


@pytest.mark.parametrize("name", list(ARCHS))
def test_import_export_round_trip(name: str, tmp_path: Path) -> None:
    hf = hf_model(name)
    src = tmp_path / "hf"
    hf.save_pretrained(src, max_shard_size="40KB" if name == "mixtral" else "5GB")
    ckpt = import_hf(src, tmp_path / "ckpt", tp=2)
    config = model_config_from_checkpoint(ckpt)
    assert config.moe is not None and config.extra["hf_architecture"] == ARCHS[name]
    assert read_metadata(ckpt)["imported_from"]["architecture"] == ARCHS[name]
    ids = _ids(config.vocab_size)
    expected = _hf_logits(hf, ids)
    torch.testing.assert_close(_mcore_logits(ckpt, ids), expected, rtol=1e-5, atol=1e-5)

    back = export_hf(ckpt, tmp_path / "back", max_shard_size=40_000 if name == "qwen3-moe" else 5 * 10**9)
    cfg = json.loads((back / "config.json").read_text())
    assert cfg["architectures"] == [ARCHS[name]] and cfg["torch_dtype"] == "float32"
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(back, output_loading_info=True)
    assert type(loaded).__name__ == ARCHS[name]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    torch.testing.assert_close(_hf_logits(loaded.eval(), ids), expected, rtol=1e-5, atol=1e-5)
    original, exported = _tensors(src), _tensors(back)
    assert set(exported) == set(original)
    for k, v in original.items():
        assert torch.equal(exported[k], v), k


def test_fused_layout_files_import(tmp_path: Path) -> None:
    hf = hf_model("qwen2-moe-step2")
    hub, fused = tmp_path / "hub", tmp_path / "fused"
    hf.save_pretrained(hub)
    hf.save_pretrained(fused)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(fused / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    assert "model.layers.1.mlp.experts.gate_up_proj" in _tensors(fused)
    a = import_hf(hub, tmp_path / "a")
    b = import_hf(fused, tmp_path / "b")
    ids = _ids(97)
    torch.testing.assert_close(_mcore_logits(b, ids), _hf_logits(hf, ids), rtol=1e-5, atol=1e-5)
    ea, eb = export_hf(a, tmp_path / "ea"), export_hf(b, tmp_path / "eb")
    ta, tb = _tensors(ea), _tensors(eb)
    assert set(ta) == set(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_cli_round_trip(tmp_path: Path) -> None:
    hf = hf_model("qwen3-moe")
    hf.save_pretrained(tmp_path / "hf")
    assert main(["import-hf", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back"), "--dtype", "bf16"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32)
    ids = _ids(97)
    torch.testing.assert_close(_hf_logits(loaded.eval(), ids), _hf_logits(hf, ids), rtol=0.1, atol=0.1)


def test_mixtral_sliding_window_is_refused_on_import(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "hf"
    hf_model("mixtral").save_pretrained(src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "sliding_window": 4096}))
    with pytest.raises(ConversionError, match="sliding_window=4096"):
        import_hf(src, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    assert main(["import-hf", "--model", str(src), "--out", str(tmp_path / "ckpt")]) == 2
    assert "sliding_window" in capsys.readouterr().err


def test_expert_bias_is_refused_on_export(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    hf_model("mixtral").save_pretrained(src)
    ckpt = import_hf(src, tmp_path / "ckpt")
    attrs = read_metadata(ckpt)
    attrs["model"]["moe"]["router_enable_expert_bias"] = True
    write_group_metadata(ckpt, attrs)
    (tmp_path / "exports").mkdir()
    with pytest.raises(ConversionError, match="router_enable_expert_bias"):
        export_hf(ckpt, tmp_path / "exports" / "hf")
    assert not list((tmp_path / "exports").iterdir())


def _native_mixtral(**moe: object) -> TransformerConfig:
    return llama(num_layers=2, hidden_size=64, ffn_hidden_size=48, moe=MoEConfig(num_experts=4, router_topk=2,
                 ffn_hidden_size=32, **moe))  # type: ignore[arg-type]  # fmt: skip


def test_native_moe_checkpoint_exports_as_mixtral(tmp_path: Path) -> None:
    config = _native_mixtral()
    ckpt = save(config, tmp_path / "ckpt")
    out = export_hf(ckpt, tmp_path / "hf")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(loaded).__name__ == "MixtralForCausalLM" and not info["missing_keys"]
    ids = _ids(config.vocab_size)
    torch.testing.assert_close(_hf_logits(loaded.eval(), ids), logits(reference_model(config), ids), rtol=1e-5,
                               atol=1e-5)  # fmt: skip


def test_native_expert_bias_checkpoint_is_refused(tmp_path: Path) -> None:
    ckpt = save(_native_mixtral(router_enable_expert_bias=True), tmp_path / "ckpt")
    assert (ckpt / "model" / "decoder.layers.0.mlp.router.expert_bias" / "zarr.json").exists()
    with pytest.raises(ConversionError, match="router_enable_expert_bias"):
        export_hf(ckpt, tmp_path / "hf")


def _load_parallel(ckpt: str, parallel: ParallelConfig, ids: torch.Tensor) -> torch.Tensor:
    state = ParallelState.initialize(parallel)
    config = model_config_from_checkpoint(ckpt)
    model = GPTModel(config.replace(seed=5), tp=state.tp, sequence_parallel=state.sequence_parallel, ep=state.ep,
                     expert_tp=state.expert_tp, balance=state.tp_dp_cp).eval()  # fmt: skip
    load_weights(model, ckpt)
    return logits(model, ids)


LAYOUTS = {
    "ep2": (2, ParallelConfig(ep=2)),
    "tp2-sp-etp2": (2, ParallelConfig(tp=2, sequence_parallel=True)),
    "tp2-sp-ep2-etp1": (4, ParallelConfig(tp=2, ep=2, expert_tp=1, sequence_parallel=True)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_imported_moe_serves_under_expert_and_tensor_parallelism(layout: str, tmp_path: Path) -> None:
    world, parallel = LAYOUTS[layout]
    hf = hf_model("qwen2-moe-step2")
    hf.save_pretrained(tmp_path / "hf")
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ckpt", tp=parallel.tp)
    ids = _ids(97)
    expected = _hf_logits(hf, ids)
    outputs = run_distributed(_load_parallel, world, str(ckpt), parallel, ids)
    assert len(outputs) == world
    for out in outputs:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_trtllm_export_refuses_moe() -> None:
    with pytest.raises(ConversionError, match="moe"):
        trtllm_architecture(_native_mixtral())
