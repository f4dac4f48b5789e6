"""MoE through the real training loop (CPU, gloo, float32): every expert-parallel layout trains the ``moe-tiny``
model like one process on the same global batches (losses, gradient norms, the logged routing metrics), and the
MoE keys of the configuration are checked with the field named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mcore_parallel.checkpoint import latest_checkpoint, read_metadata, read_region
from mcore_parallel.testing import run_distributed
from mcore_train import ConfigError, load_config, pretrain
from tests.train._util import CPU_RUN
from tests.train.test_resume import arrays

# the moe-tiny model (2 layers, hidden 64, 8 experts, top-2) with a load-balancing and a z-loss worth training on
MOE = [*CPU_RUN, "model.moe.aux_loss_coeff=0.1", "model.moe.z_loss_coeff=0.001"]
KEYS = ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_load_max", "moe/layer1/load_min")


def moe_config(*overrides: str, world_size: int | None = None) -> Any:
    return load_config(recipe="moe-tiny", overrides=[*MOE, *overrides], world_size=world_size)


def _records(overrides: list[str], log_dir: str) -> list[dict[str, float]] | None:
    """Train; rank 0 returns the logged value of every key of ``KEYS`` per step (from its metrics.jsonl)."""
    result = pretrain(moe_config(*overrides, f"logging.dir={log_dir}"))
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return None
    lines = [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]
    records = [{k: r.get(k) for k in KEYS} for r in lines if "loss" in r]
    assert [r["loss"] for r in records] == result.losses
    return records


def _in(world: int, overrides: list[str], log_dir: Path) -> list[dict[str, float]]:
    out = run_distributed(_records, world, overrides, str(log_dir), timeout=300) if world > 1 else None
    return out[0] if out is not None else _records(overrides, str(log_dir))  # type: ignore[return-value]


def assert_same(got: list[dict[str, float]] | None, want: list[dict[str, float]] | None, label: str) -> None:
    """Per step, every logged value of ``KEYS`` within float32 rounding (absent where the reference lacks it)."""
    assert got is not None and want is not None and len(got) == len(want), label
    for step, (a, b) in enumerate(zip(got, want, strict=True), 1):
        for key in KEYS:
            expected = None if b[key] is None else pytest.approx(b[key], rel=1e-5, abs=1e-6)
            assert a[key] == expected, (label, step, key, a[key], b[key])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, float]]:
    records = _records([], str(tmp_path_factory.mktemp("moe-reference")))
    assert records is not None
    return records


TP2_SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
LAYOUTS = {
    "ep2": (2, ["parallel.ep=2"]),
    "ep4": (4, ["parallel.ep=4"]),
    "ep2-tp2-sp-etp1": (4, [*TP2_SP, "parallel.ep=2", "parallel.expert_tp=1"]),
    "ep2-tp2-sp-etp2": (4, [*TP2_SP, "parallel.ep=2", "parallel.expert_tp=2"]),
    "ep2-pp2": (4, ["parallel.pp=2", "parallel.ep=2"]),
    "dp4-ep2-distopt": (4, ["parallel.ep=2", "optimizer.use_distributed_optimizer=true"]),
    "ep2-allgather": (2, ["parallel.ep=2", "model.moe.token_dispatcher=allgather"]),
    "ep2-recompute": (2, ["parallel.ep=2", "model.recompute=full"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_layouts_train_like_one_process(name: str, reference: list[dict[str, float]],
                                                        tmp_path: Path) -> None:  # fmt: skip
    world, overrides = LAYOUTS[name]
    got = _in(world, overrides, tmp_path)
    assert len(reference) == 3 and reference[0]["loss"] != reference[-1]["loss"]  # the steps trained
    assert_same(got, reference, name)


def test_expert_biases_and_the_sequence_loss_train_like_one_process(tmp_path: Path) -> None:
    """DeepSeek's balancing (aux-loss-free expert biases moved after each step by the tokens per expert summed over
    the stage's ranks, and the per-sequence loss) at tp2 (SP) x ep2 against one process."""
    bias = ["model.moe.router_enable_expert_bias=true", "model.moe.router_bias_update_rate=0.05",
            "model.moe.load_balancing_type=seq_aux_loss", "model.moe.router_score_function=sigmoid"]  # fmt: skip
    one = _records(bias, str(tmp_path / "one"))
    four = _in(4, [*bias, *TP2_SP, "parallel.ep=2", "parallel.expert_tp=1"], tmp_path / "four")
    assert_same(four, one, "tp2-sp-ep2, expert bias")


@pytest.mark.slow
@pytest.mark.parametrize("losses", ["no-aux", "aux"])
def test_compiled_moe_layers_train_like_eager(losses: str, tmp_path: Path) -> None:
    overrides = ["training.train_iters=2"]
    if losses == "no-aux":
        overrides += ["model.moe.aux_loss_coeff=0", "model.moe.z_loss_coeff=null"]
    eager = _records(overrides, str(tmp_path / "eager"))
    torch._dynamo.reset()
    compiled = _records([*overrides, "training.compile=layers"], str(tmp_path / "compiled"))
    assert_same(compiled, eager, losses)


def test_a_pipeline_stage_without_moe_layers_logs_the_others(tmp_path: Path) -> None:
    """With ``moe.layer_freq=[0, 1]`` the first stage has no MoE layer: it still joins the metrics' all-reduce, and
    rank 0 (on that stage) logs the second stage's layer."""
    overrides = ["parallel.pp=2", "model.moe.layer_freq=[0,1]", "training.train_iters=2"]
    one = _records(overrides[1:], str(tmp_path / "one"))
    two = _in(2, overrides, tmp_path / "two")
    assert one is not None and len(one) == 2 and one[0]["moe/layer1/load_min"] is not None
    assert_same(two, one, "pp2, layer_freq [0, 1]")


def test_moe_config_errors_name_the_field() -> None:
    cases = {
        ("model.moe.num_expert=4",): "model.moe.num_expert: unknown key; did you mean 'num_experts'?",
        ("model.moe.router_topk=two",): "model.moe.router_topk: expected an integer, got 'two'",
        ("model.moe.token_dispatcher=ring",): "model.moe.token_dispatcher='ring' must be one of alltoall, allgather",
        ("model.moe.router_topk=9",): "model: moe.router_topk=9 exceeds moe.num_experts=8",
        ("parallel.ep=3",): "model.moe.num_experts=8 is not divisible by parallel.ep=3",
        ("parallel.tp=2", "parallel.expert_tp=1"): "needs parallel.sequence_parallel=true",
        ("parallel.tp=4", "model.num_attention_heads=4", "model.num_query_groups=4", "parallel.expert_tp=2",
         "parallel.sequence_parallel=true"): "parallel.expert_tp=2 must be 1",
        ("model.moe=null", "parallel.ep=2"): "parallel.ep=2 splits the experts of MoE layers, but the model is dense",
    }  # fmt: skip
    for overrides, message in cases.items():
        with pytest.raises(ConfigError) as exc:
            moe_config(*overrides, world_size=12)
        assert any(message in p for p in exc.value.problems), (overrides, exc.value.problems)


def test_moe_keys_from_overrides_and_yaml_keep_the_presets_other_settings(tmp_path: Path) -> None:
    cfg = moe_config("model.moe.num_experts=4", "parallel.ep=2", world_size=2)
    moe = cfg.model.moe
    assert moe is not None and (moe.num_experts, moe.ffn_hidden_size, moe.router_topk) == (4, 64, 2)
    assert cfg.model.extra["preset"] == "moe-tiny" and cfg.parallel.ep == 2
    path = tmp_path / "run.yaml"
    path.write_text("model: {preset: moe-tiny, moe: {num_experts: 4, capacity_factor: 1.5}}\nparallel: {ep: 2}\n")
    cfg = load_config(path=path, overrides=["data.mock=true"], world_size=2)
    moe = cfg.model.moe
    assert moe is not None and (moe.num_experts, moe.capacity_factor) == (4, 1.5)  # the YAML's keys
    assert (moe.ffn_hidden_size, moe.aux_loss_coeff) == (64, 1e-2)  # over the preset's
    dense = load_config(recipe="tiny", overrides=["model.moe.num_experts=4", "data.mock=true"]).model
    assert dense.moe is not None and dense.moe.num_experts == 4  # a dense model gets MoEConfig's other defaults
    assert moe_config("model.moe=null").model.moe is None


def _losses(overrides: list[str]) -> list[float]:
    return pretrain(moe_config(*overrides)).losses


def test_a_checkpoint_saved_at_ep4_resumes_exactly_and_at_ep1(tmp_path: Path) -> None:
    """Saved after 3 of 5 steps at ep4 (aux-loss-free expert biases on, so they are saved and moved too): resumed at
    ep4 the losses are the unbroken run's bit for bit; loaded by one process they are within float32 rounding."""
    run = ["training.train_iters=5", "scheduler.decay_iters=5", "model.moe.router_enable_expert_bias=true",
           "model.moe.router_bias_update_rate=0.05"]  # fmt: skip
    four = [*run, "parallel.ep=4"]
    straight = run_distributed(_losses, 4, [*four, f"checkpoint.dir={tmp_path / 'straight'}"], timeout=300)[0]
    first = run_distributed(_losses, 4, [*four, "training.exit_interval=3", f"checkpoint.dir={tmp_path / 'a'}"],
                            timeout=300)[0]  # fmt: skip
    saved = latest_checkpoint(tmp_path / "a")
    assert saved is not None and read_metadata(saved)["step"] == 3 and len(first) == 3
    second = run_distributed(_losses, 4, [*four, f"checkpoint.dir={tmp_path / 'a'}"], timeout=300)[0]
    assert first + second == straight
    one = _losses([*run, f"checkpoint.load={saved}", f"checkpoint.dir={tmp_path / 'one'}"])
    assert one == pytest.approx(straight[3:], rel=1e-5, abs=1e-6)
    # every expert in one array whatever the layout, the biases with them
    experts = [a for a in arrays(saved) if "experts" in str(a) and str(a).startswith("model")]
    assert experts and all(read_region(saved / a).shape[0] == 8 for a in experts), experts
    bias = [a for a in arrays(saved) if str(a).endswith("expert_bias")]
    assert len(bias) == 2 and all(read_region(saved / a).abs().sum() > 0 for a in bias), bias


def test_interleaved_pipeline_with_expert_parallelism_trains_like_one_process(tmp_path: Path) -> None:
    """Four layers as two virtual stages on each of two pipeline ranks (interleaved 1F1B), experts over ep2."""
    layers = ["model.num_layers=4"]
    one = _records(layers, str(tmp_path / "one"))
    four = _in(4, [*layers, "parallel.pp=2", "parallel.vpp=2", "parallel.ep=2"], tmp_path / "four")
    assert_same(four, one, "pp2-vpp2-ep2")
