"""FP8 training through mcore-train (model.fp8): on real text the loss falls and tracks bf16, the weights are cast
once per optimizer step; tp + SP, dp with the distributed optimizer, pp and cp train like one process with the
delayed-scaling histories reduced over each stage's ranks; packed sequences; a checkpoint resumes exactly with its
scales; checkpoints cross backends; compiled layers train like eager; configuration mistakes name the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mcore_parallel.fp8 import fp8_linears
from mcore_parallel.testing import run_distributed
from mcore_train import load_config
from mcore_train.errors import ConfigError
from mcore_train.loop import train
from mcore_train.trainer import setup
from tests.train._util import config

DELAYED = ["model.fp8=hybrid", "model.fp8_recipe=delayed", "model.fp8_amax_history_len=4"]


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo corpus (the standard library's first 20 files, byte tokens)."""
    from mcore_train.cli import prepare_demo

    return prepare_demo(str(tmp_path_factory.mktemp("demo")), max_files=20)


def _train(*overrides: str) -> tuple[list[float], Any]:
    run = setup(config("training.device=cpu", *overrides))
    return train(run).losses, run


def test_fp8_training_on_text_falls_and_tracks_bf16(text: str) -> None:
    data = ["data.mock=false", f"data.path={text}", "training.train_iters=16"]
    bf16, _ = _train(*data)
    fp8, run = _train(*data, "model.fp8=hybrid")
    assert fp8[-1] < 0.65 * fp8[0], fp8  # 5.45 -> about 3.0 on byte-level text
    worst = max(abs(a - b) / b for a, b in zip(fp8, bf16, strict=True))
    assert worst < 0.02, (fp8, bf16)
    layers = fp8_linears(run.chunks)
    assert len(layers) == 8  # layers 1 and 2 of 4 (the first and the last stay bf16), four linears each
    assert all(m.weight_casts == 16 for m in layers)  # one cast per optimizer step, for its 4 micro-batches


def _losses_and_scaling(overrides: list[str]) -> tuple[list[float], dict[str, list[float]]]:
    losses, run = _train("training.train_iters=3", *overrides)
    state = {k: v.local.flatten().tolist() for c in run.chunks for k, v in c.runtime_state_dict().items()}
    return losses, state


LAYOUTS = {
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "tp2-sp-fp8-allgather": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "model.fp8_allgather=true"]),
    "dp2-distributed-optimizer": (2, ["optimizer.use_distributed_optimizer=true"]),
    "pp2": (2, ["parallel.pp=2"]),
    "tp2-sp-dp2": (4, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "cp2": (2, ["parallel.cp=2"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_train_like_one_process(name: str) -> None:
    """The same global batches at another layout: the losses of one process, and on every rank the delayed-scaling
    histories of the whole tensors (reduced over the stage's tp, dp and cp ranks), identical on every rank."""
    world, layout = LAYOUTS[name]
    ref_losses, ref_state = _losses_and_scaling(DELAYED)
    results = run_distributed(_losses_and_scaling, world, [*DELAYED, *layout], timeout=300)
    for losses, _ in results:
        assert losses == pytest.approx(ref_losses, abs=2e-3)
    merged: dict[str, list[float]] = {}
    for _, state in results:
        for key, values in state.items():
            assert merged.setdefault(key, values) == values, f"{key} differs between ranks"
    assert merged.keys() == ref_state.keys() and len(merged) == 16
    # against one process the maxima agree to what FP8 rounding flips move them (an E5M2 step is 25%); a history
    # that missed the cp or dp loss weight would be off by a factor of 2
    for key, values in merged.items():
        assert values == pytest.approx(ref_state[key], rel=0.2), key


OUTPUT_FP8 = [
    *DELAYED,
    "model.share_embeddings_and_output_weights=false",
    "model.fp8_modules=[qkv,proj,fc1,fc2,output]",
]


@pytest.mark.parametrize("name", ["tp2-sp", "pp2"])
def test_the_output_layer_in_fp8_trains_like_one_process(name: str) -> None:
    """``output`` in fp8_modules: the vocab-parallel output layer (split over tp, on pp's last stage) trains like one
    process, its scaling state the whole tensor's on every rank that holds it."""
    world, layout = LAYOUTS[name]
    ref_losses, ref_state = _losses_and_scaling(OUTPUT_FP8)
    assert "output_layer.fp8_scaling.amax_history" in ref_state
    results = run_distributed(_losses_and_scaling, world, [*OUTPUT_FP8, *layout], timeout=300)
    for losses, state in results:
        assert losses == pytest.approx(ref_losses, abs=2e-3)
        if "output_layer.fp8_scaling.amax_history" in state:  # (a pp stage without the output layer has none)
            got = state["output_layer.fp8_scaling.amax_history"]
            assert got == pytest.approx(ref_state["output_layer.fp8_scaling.amax_history"], rel=0.2)
    assert any("output_layer.fp8_scaling.amax_history" in state for _, state in results)


def test_packed_sequences() -> None:
    """Packed rows (per-document attention) with FP8 linears train like packed bf16 ones, to FP8 error."""
    bf16, _ = _train("data.packing=true", "training.train_iters=3")
    fp8, _ = _train("data.packing=true", "training.train_iters=3", *DELAYED)
    assert fp8 == pytest.approx(bf16, rel=1e-2) and fp8 != bf16


def test_resume_restores_the_scales(tmp_path: Path) -> None:
    """Saved at step 3 and resumed, a delayed-scaling run continues the unbroken one bit for bit: its histories and
    scales come back from the checkpoint (a fresh state would scale step 4 by its own tensors)."""
    run_args = [*DELAYED, "training.train_iters=6", "checkpoint.save_interval=3"]
    straight, _ = _train(*run_args, f"checkpoint.dir={tmp_path / 'a'}")
    first, _ = _train(*run_args, "training.exit_interval=3", f"checkpoint.dir={tmp_path / 'b'}")
    second, run = _train(*run_args, f"checkpoint.dir={tmp_path / 'b'}")
    assert run.loaded_from is not None and first + second == straight
    saved = [p.name for p in (tmp_path / "b" / "step_0000003" / "model").iterdir() if ".fp8_scaling." in p.name]
    assert len(saved) == 16 and {name.rsplit(".", 1)[1] for name in saved} == {"amax_history", "scale"}


def test_checkpoints_cross_backends(tmp_path: Path) -> None:
    """A bf16 run's checkpoint resumes as an FP8 run (fresh scaling state) and an FP8 run's as a bf16 one; a
    different amax history length is refused, naming the key."""
    _train("training.train_iters=2", f"checkpoint.dir={tmp_path / 'bf16'}", "checkpoint.save_interval=2")
    losses, run = _train(*DELAYED, "training.train_iters=3", f"checkpoint.load={tmp_path / 'bf16'}")
    assert run.loaded_from is not None and len(losses) == 1
    _train(*DELAYED, "training.train_iters=2", f"checkpoint.dir={tmp_path / 'fp8'}", "checkpoint.save_interval=2")
    losses, run = _train("training.train_iters=3", f"checkpoint.load={tmp_path / 'fp8'}")
    assert run.loaded_from is not None and len(losses) == 1
    with pytest.raises(ConfigError, match="model.fp8_amax_history_len: checkpoint has 4, config has 8"):
        _train(*DELAYED, "model.fp8_amax_history_len=8", "training.train_iters=3",
               f"checkpoint.load={tmp_path / 'fp8'}")  # fmt: skip


@pytest.mark.slow
def test_compiled_layers_train_like_eager() -> None:
    torch._dynamo.reset()
    eager, _ = _train("model.fp8=hybrid", "training.train_iters=3")
    compiled, _ = _train("model.fp8=hybrid", "training.train_iters=3", "training.compile=layers")
    assert compiled == pytest.approx(eager, abs=1e-5)


def test_configuration_mistakes_name_the_key() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(recipe="tiny", overrides=["model.fp8=hybrid", "model.fp8_recipe=current", "model.fp8_margin=-1",
                                              "model.fp8_allgather=maybe"])  # fmt: skip
    text = str(e.value)
    assert "model.fp8_allgather: expected true or false" in text
    with pytest.raises(ConfigError) as e:
        load_config(recipe="tiny", overrides=["model.fp8=hybrid", "model.fp8_recipe=current", "model.fp8_margin=-1"])
    text = str(e.value)
    assert "fp8_recipe='current' is not one of tensorwise, rowwise, delayed" in text and "fp8_margin=-1" in text
    cfg = load_config(recipe="tiny", overrides=["model.fp8=e4m3", "model.fp8_modules=[qkv,fc1]"])
    assert cfg.model.fp8_modules == ("qkv", "fc1") and cfg.model.layer_backend == "fp8"
