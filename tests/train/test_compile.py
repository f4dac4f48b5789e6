"""training.compile=layers: compiled transformer layers train exactly like eager ones (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from mcore_parallel.testing import run_distributed
from mcore_train.api import pretrain
from mcore_train.trainer import setup

from ._util import config


def test_compiled_layers_match_eager() -> None:
    torch._dynamo.reset()
    eager = pretrain(config("training.train_iters=3", "training.device=cpu"))
    torch._dynamo.utils.counters.clear()
    compiled = pretrain(config("training.train_iters=3", "training.device=cpu", "training.compile=layers"))
    # inductor really ran: graphs were captured (one per distinct layer shape, shared by the four layers)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert len(compiled.losses) == 3
    for a, b in zip(eager.losses, compiled.losses, strict=True):
        assert abs(a - b) < 1e-5, (eager.losses, compiled.losses)


def _losses(overrides: list[str]) -> list[float]:
    return pretrain(config(*overrides)).losses


def _losses_and_collective_breaks(overrides: list[str]) -> tuple[list[float], int]:
    torch._dynamo.utils.counters.clear()
    losses = _losses(overrides)
    breaks = sum(n for k, n in torch._dynamo.utils.counters["graph_break"].items() if "torch.compiler.disable" in k)
    return losses, breaks


def test_compiled_layers_and_fused_loss_under_tensor_and_sequence_parallelism() -> None:
    """Compiled layers under TP/SP, with the fused output-layer loss, train the same (tp=2 + SP on gloo, both levers
    on = one process, eager, unfused). The TP/SP collectives stay out of the compiled graphs (graph breaks at
    ``mappings._eager``): traced, they trained wrongly with NCCL on GPUs while gloo still matched."""
    reference = _losses(["training.train_iters=3", "training.device=cpu"])
    tp2, breaks = run_distributed(_losses_and_collective_breaks, 2,
                                  ["training.train_iters=3", "training.device=cpu", "parallel.tp=2",
                                   "parallel.sequence_parallel=true", "training.compile=layers",
                                   "model.cross_entropy_fusion=true"],
                                  timeout=600)[0]  # fmt: skip
    assert tp2 == pytest.approx(reference, abs=1e-5)
    assert breaks > 0  # the collectives ran outside the compiled graphs


def _losses_and_fused_loss_passes(overrides: list[str]) -> tuple[list[float], list[str]]:
    from mcore_parallel.tensor import cross_entropy as ce

    passes: list[str] = []
    real = ce._compiled

    def counted(name: str):  # type: ignore[no-untyped-def]
        passes.append(name)
        return real(name)

    ce._compiled = counted  # type: ignore[assignment]
    try:
        return _losses(overrides), passes
    finally:
        ce._compiled = real  # type: ignore[assignment]


def test_compiled_layers_use_the_fused_vocab_parallel_loss() -> None:
    """With tp > 1 and the unfused output layer, compile_layers runs the loss as the fused vocabulary-parallel
    cross-entropy (compiled passes, eager all-reduces): losses equal one eager process."""
    reference = _losses(["training.train_iters=3", "training.device=cpu"])
    tp2, passes = run_distributed(_losses_and_fused_loss_passes, 2,
                                  ["training.train_iters=3", "training.device=cpu", "parallel.tp=2",
                                   "parallel.sequence_parallel=true", "training.compile=layers"], timeout=600)[0]  # fmt: skip
    assert tp2 == pytest.approx(reference, abs=1e-5)
    assert {"row_max", "row_stats", "logits_grad"} <= set(passes)


def test_compile_keeps_parameter_names() -> None:
    run = setup(config("training.train_iters=3", "training.device=cpu", "training.compile=layers"))
    names = [n for n, _ in run.chunks[0].named_parameters()]
    assert names and not any("_orig_mod" in n for n in names)  # checkpoints stay loadable either way
    layers = list(run.chunks[0].decoder.layers.values())
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)  # compiled in place


def test_compile_choice_is_checked() -> None:
    with pytest.raises(ValueError, match="training.compile='all' must be one of auto, none, layers"):
        config("training.compile=all")


def test_tp_comm_in_graph_combinations_are_checked() -> None:
    from mcore_train import ConfigError

    with pytest.raises(ConfigError, match="tp_comm_in_graph=true with gradient_accumulation_fusion=true"):
        config("parallel.tp_comm_in_graph=true", "parallel.gradient_accumulation_fusion=true")
    with pytest.raises(ConfigError, match=r"tp_comm_in_graph=true traces PyTorch's fused ops \(tp_comm=nccl\)"):
        config("parallel.tp_comm_in_graph=true", "parallel.tp_comm=nccl")
    with pytest.raises(ConfigError, match=r"tp_comm_in_graph=true traces PyTorch's fused ops \(tp_comm=p2p\)"):
        config("parallel.tp_comm_in_graph=true", "parallel.tp_comm=p2p")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_symmetric_memory_linears_traced_into_compiled_layers_train_the_same() -> None:
    """``parallel.tp_comm_in_graph``: tp2 + SP through symmetric memory with the linears traced by torch.compile
    trains like the same run with them left out of the graphs (and like one eager process), with fewer breaks."""
    reference = _losses(["training.train_iters=3"])
    common = ["training.train_iters=3", "parallel.tp=2", "parallel.sequence_parallel=true", "training.compile=layers",
              "parallel.tp_comm=symmetric_memory", "training.device=cuda"]  # fmt: skip
    out, breaks_out = run_distributed(_losses_and_collective_breaks, 2, common, backend="nccl", timeout=600)[0]
    traced, breaks_in = run_distributed(_losses_and_collective_breaks, 2, [*common, "parallel.tp_comm_in_graph=true"],
                                        backend="nccl", timeout=600)[0]  # fmt: skip
    assert traced == pytest.approx(out, abs=1e-4)
    assert traced == pytest.approx(reference, abs=1e-3)
    assert breaks_in < breaks_out


def test_compile_mode_reaches_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    from mcore_models.transformer.layer import TransformerLayer
    from mcore_train import ConfigError

    modes = []
    monkeypatch.setattr(TransformerLayer, "compile", lambda self, **kw: modes.append(kw.get("mode")))
    setup(config("training.train_iters=3", "training.device=cpu", "training.compile=layers",
                 "training.compile_mode=max-autotune-no-cudagraphs"))  # fmt: skip
    assert modes == ["max-autotune-no-cudagraphs"] * 4  # the tiny model's four layers
    with pytest.raises(
        ConfigError, match="training.compile_mode='fast' must be one of default, max-autotune-no-cudagraphs"
    ):
        config("training.compile_mode=fast")
