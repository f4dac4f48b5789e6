"""``import_hf`` / ``export_hf`` (and the CLI) for Mamba-2 and hybrid models: ``Mamba2ForCausalLM`` and
``NemotronHForCausalLM``.

HF models are built from configs (random weights, no download) and saved with ``save_pretrained``; the imported
checkpoint must give HF's logits in GPTModel (fp32, 1e-5), also at tp 2, the export must load with
``AutoModelForCausalLM.from_pretrained`` with no missing or unexpected keys and the same logits, and its safetensors
must equal the original file tensor for tensor. A checkpoint saved by mcore exports with mcore's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mcore_export import export_hf, import_hf, trtllm_architecture
from mcore_export.cli import main
from mcore_models import ConversionError, GPTModel, preset
from mcore_models.checkpoint import load_weights, model_config_from_checkpoint
from mcore_parallel import ParallelConfig, ParallelState
from mcore_parallel.checkpoint import read_metadata
from mcore_parallel.checkpoint.zarr_io import write_group_metadata
from mcore_parallel.testing import run_distributed
from tests._hf_ssm_cases import CASES, TOKENS, arch, hf_logits, hf_model, mcore_config, native
from tests.export._helpers import logits, reference_model, save

transformers = pytest.importorskip("transformers")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
    return out


def _mcore_logits(ckpt: Path | str, ids: torch.Tensor = TOKENS, tp: ParallelConfig | None = None) -> torch.Tensor:
    config = model_config_from_checkpoint(ckpt)
    state = ParallelState.initialize(tp) if tp is not None else None
    model = GPTModel(config.replace(seed=7), tp=state.tp if state else None).eval()
    load_weights(model, ckpt)
    return logits(model, ids)


def _load(path: Path) -> torch.nn.Module:
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return loaded.eval()


@pytest.mark.parametrize("name", list(CASES))
def test_import_export_round_trip(name: str, tmp_path: Path) -> None:
    hf = hf_model(name)
    src = tmp_path / "hf"
    hf.save_pretrained(src, max_shard_size="60KB" if name == "nemotron-h" else "5GB")
    ckpt = import_hf(src, tmp_path / "ckpt", tp=2 if name == "nemotron-h" else 1)
    config = model_config_from_checkpoint(ckpt)
    assert config == mcore_config(name)
    assert read_metadata(ckpt)["imported_from"]["architecture"] == arch(name)
    expected = hf_logits(hf)
    torch.testing.assert_close(_mcore_logits(ckpt), expected, rtol=1e-5, atol=1e-5)

    back = export_hf(ckpt, tmp_path / "back", max_shard_size=40_000 if name == "mamba2-g1" else 5 * 10**9)
    cfg = json.loads((back / "config.json").read_text())
    assert cfg["architectures"] == [arch(name)] and cfg["torch_dtype"] == "float32"
    loaded = _load(back)
    assert type(loaded).__name__ == arch(name)
    torch.testing.assert_close(hf_logits(loaded), expected, rtol=1e-5, atol=1e-5)
    original, exported = _tensors(src), _tensors(back)
    assert set(exported) == set(original)
    for k, v in original.items():
        assert torch.equal(exported[k], v), k


def test_cli_round_trip(tmp_path: Path) -> None:
    hf = hf_model("nemotron-h")
    hf.save_pretrained(tmp_path / "hf")
    assert main(["import-hf", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back"), "--dtype", "bf16"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32)
    torch.testing.assert_close(hf_logits(loaded.eval()), hf_logits(hf), rtol=0.1, atol=0.1)


@pytest.mark.parametrize(("pattern", "tied", "expected_arch"), [("MMM", True, "Mamba2ForCausalLM"),
                                                                ("M*-M-", False, "NemotronHForCausalLM")])  # fmt: skip
def test_native_checkpoint_exports_and_imports_back(pattern: str, tied: bool, expected_arch: str,
                                                    tmp_path: Path) -> None:  # fmt: skip
    config = native(pattern, tied=tied)
    ckpt = save(config, tmp_path / "ckpt")
    out = export_hf(ckpt, tmp_path / "hf")
    loaded = _load(out)
    assert type(loaded).__name__ == expected_arch
    reference = reference_model(config)
    expected = logits(reference, TOKENS)
    torch.testing.assert_close(hf_logits(loaded), expected, rtol=1e-5, atol=1e-5)
    again = import_hf(out, tmp_path / "again")
    torch.testing.assert_close(_mcore_logits(again), expected, rtol=1e-5, atol=1e-5)
    model = GPTModel(model_config_from_checkpoint(again))
    load_weights(model, again)
    ours, theirs = reference.global_state_dict(), model.global_state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_moe_layers_are_refused_on_import(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "hf"
    hf_model("nemotron-h").save_pretrained(src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("layers_block_type")
    (src / "config.json").write_text(json.dumps({**cfg, "hybrid_override_pattern": "M*-ME"}))
    with pytest.raises(ConversionError, match="MoE layers"):
        import_hf(src, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    assert main(["import-hf", "--model", str(src), "--out", str(tmp_path / "ckpt")]) == 2
    assert "MoE layers" in capsys.readouterr().err


def test_norm_before_gate_is_refused_on_export(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    hf_model("mamba2-g1").save_pretrained(src)
    ckpt = import_hf(src, tmp_path / "ckpt")
    attrs = read_metadata(ckpt)
    attrs["model"]["mamba"]["norm_before_gate"] = True
    write_group_metadata(ckpt, attrs)
    (tmp_path / "exports").mkdir()
    with pytest.raises(ConversionError, match="norm_before_gate"):
        export_hf(ckpt, tmp_path / "exports" / "hf")
    assert not list((tmp_path / "exports").iterdir())


def test_imported_hybrid_serves_under_tensor_parallelism(tmp_path: Path) -> None:
    hf = hf_model("nemotron-h")
    hf.save_pretrained(tmp_path / "hf")
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ckpt", tp=2)
    outputs = run_distributed(_mcore_logits, 2, str(ckpt), TOKENS, ParallelConfig(tp=2))
    assert len(outputs) == 2
    for out in outputs:
        torch.testing.assert_close(out, hf_logits(hf), rtol=1e-5, atol=1e-5)


def test_trtllm_export_refuses_hybrid_models_naming_the_pattern() -> None:
    for name in ("mamba2-130m", "nemotron-h-8b"):
        with pytest.raises(ConversionError, match="hybrid_pattern=.*export those with 'mcore-export hf'"):
            trtllm_architecture(preset(name))
