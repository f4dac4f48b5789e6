"""``import-megatron``: Megatron-LM checkpoints written by megatron-core itself give Megatron's logits in mcore.

The fixtures (``fixtures/megatron/``, written by ``fixtures/make_megatron_fixtures.py`` with megatron-core 0.19.2 on
CPU) hold one tiny model per case, saved by Megatron-LM's own ``save_checkpoint`` at the named layout and format,
with megatron's logits on fixed tokens (``expected.pt``, computed by megatron at the saved layout where it has one
pipeline stage).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from mcore_export.cli import main
from mcore_export.megatron import MegatronFormatError, import_megatron
from mcore_export.megatron._unpickle import MegatronObject, load_pickled
from mcore_export.megatron.reader import open_checkpoint
from mcore_models import GPTModel
from mcore_models.checkpoint import load_weights, model_config_from_checkpoint
from mcore_parallel import ParallelConfig, ParallelState
from mcore_parallel.checkpoint import CheckpointManager, read_metadata, read_region
from mcore_parallel.optim import MixedPrecisionOptimizer, OptimizerConfig
from mcore_parallel.testing import run_distributed
from tests.export._helpers import load_and_run

FIXTURES = Path(__file__).parent / "fixtures" / "megatron"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.pt").exists())
TOL = dict(rtol=1e-5, atol=1e-5)


def expected(name: str) -> dict[str, torch.Tensor]:
    return torch.load(FIXTURES / name / "expected.pt")


def mcore_logits(ckpt: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = GPTModel(model_config_from_checkpoint(ckpt)).eval()
    load_weights(model, ckpt)
    with torch.no_grad():
        return model(tokens, gather_logits=True)


def test_the_fixtures_cover_the_layouts() -> None:
    assert {"llama_dist_tp1", "llama_tied_legacy_tp2pp2", "gpt2_legacy_tp1", "gpt2_dist_tp2", "moe_dist_tp1",
            "moe_legacy_ep2"} <= set(CASES)  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_import_gives_megatrons_logits(name: str, tmp_path: Path) -> None:
    ckpt = import_megatron(FIXTURES / name, tmp_path / "ckpt")
    e = expected(name)
    torch.testing.assert_close(mcore_logits(ckpt, e["tokens"]), e["logits"], **TOL)
    meta = read_metadata(ckpt)
    assert meta["imported_from"]["iteration"] == 10
    assert meta["step"] == 0  # weights only: training starts over unless the optimizer comes along


@pytest.mark.parametrize(("name", "tp", "pp"), [("gpt2_dist_tp2", 1, 2), ("llama_tied_legacy_tp2pp2", 2, 2)])
def test_tp2_saved_checkpoint_serves_at_other_layouts(name: str, tp: int, pp: int, tmp_path: Path) -> None:
    ckpt = import_megatron(FIXTURES / name, tmp_path / "ckpt", tp=2)
    e = expected(name)
    outputs = [r for r in run_distributed(load_and_run, tp * pp, str(ckpt), tp, pp, e["tokens"]) if r is not None]
    assert len(outputs) == tp
    for out in outputs:
        torch.testing.assert_close(out, e["logits"], **TOL)


def test_vocab_size_drops_megatrons_padding(tmp_path: Path) -> None:
    ckpt = import_megatron(FIXTURES / "gpt2_legacy_tp1", tmp_path / "ckpt", vocab_size=60)
    assert model_config_from_checkpoint(ckpt).vocab_size == 60
    e = expected("gpt2_legacy_tp1")
    torch.testing.assert_close(mcore_logits(ckpt, e["tokens"]), e["logits"][..., :60], **TOL)


def _resume(ckpt: str) -> dict[str, float]:
    state = ParallelState.initialize(ParallelConfig())
    model = GPTModel(model_config_from_checkpoint(ckpt))
    optimizer = MixedPrecisionOptimizer([model], state, OptimizerConfig(clip_grad=0.0))
    items = model.sharded_state_dict()
    _, meta, _ = CheckpointManager(Path(ckpt).parent, state).load(items, optimizer, ckpt)
    megatron = open_checkpoint(FIXTURES / "llama_dist_tp1")
    saved = {(k, s): t for k, s, t in megatron.optimizer_tensors(2)}
    diffs = {"step": float(meta["step"])}
    for entry in optimizer.sharded_state():
        key = next(i.key for i in items.values() if i.local is entry.param)
        for s in ("exp_avg", "exp_avg_sq"):
            mine = entry.tensors[s].reshape(entry.local_shape)[: saved[(key, s)].shape[0]]  # the vocabulary padding cut
            diffs[f"{key}/{s}"] = (mine - saved[(key, s)]).abs().max().item()
    return diffs


def test_optimizer_state_comes_along_and_resumes(tmp_path: Path) -> None:
    ckpt = import_megatron(FIXTURES / "llama_dist_tp1", tmp_path / "ckpt", optimizer=True)
    rows = (slice(0, 64),)  # the whole (unpadded) array
    master = read_region(ckpt / "optimizer" / "output_layer.weight" / "master", rows)
    torch.testing.assert_close(master, read_region(ckpt / "model" / "output_layer.weight", rows))
    (diffs,) = run_distributed(_resume, 1, str(ckpt))
    assert diffs.pop("step") == 10
    assert len(diffs) == 2 * 15 and max(diffs.values()) == 0.0


def test_optimizer_of_a_legacy_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(MegatronFormatError, match="torch_dist checkpoints only"):
        import_megatron(FIXTURES / "gpt2_legacy_tp1", tmp_path / "ckpt", optimizer=True)
    assert not (tmp_path / "ckpt").exists()


def _plain(args: object) -> None:
    """Replace the stood-in megatron objects of ``args`` by their values (so the test can ``torch.save`` them)."""
    for k, v in vars(args).items():
        if isinstance(v, MegatronObject):
            setattr(args, k, v.value)


def _rewrite_legacy(src: Path, dst: Path, change: object) -> Path:
    """A copy of a legacy checkpoint with every rank file's dict passed through ``change``."""
    shutil.copytree(src, dst)
    for f in dst.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        sd = load_pickled(f)
        _plain(sd["args"])
        change(sd)  # type: ignore[operator]
        torch.save(sd, f)
    return dst


def _grouped(layout: str) -> object:
    def change(sd: dict) -> None:
        model = sd["model"]
        for layer in (0, 1):
            p = f"decoder.layers.{layer}.mlp.experts."
            fc1 = [model.pop(f"{p}local_experts.{j}.linear_fc1.weight") for j in (0, 1)]
            fc2 = [model.pop(f"{p}local_experts.{j}.linear_fc2.weight") for j in (0, 1)]
            for j in (0, 1):
                for fc in ("linear_fc1", "linear_fc2"):
                    model.pop(f"{p}local_experts.{j}.{fc}._extra_state")
            if layout == "weight1":  # GroupedMLP: [hidden, n * fc1 width] viewed [n, hidden, width]
                model[f"{p}weight1"] = torch.stack([w.t() for w in fc1]).reshape(fc1[0].shape[1], -1)
                model[f"{p}weight2"] = torch.stack([w.t() for w in fc2]).reshape(-1, fc2[0].shape[0])
            else:  # TEGroupedMLP: one weight<j> per local expert
                for j in (0, 1):
                    model[f"{p}linear_fc1.weight{j}"], model[f"{p}linear_fc2.weight{j}"] = fc1[j], fc2[j]

    return change


@pytest.mark.parametrize("layout", ["weight1", "te_grouped"])
def test_grouped_gemm_expert_layouts(layout: str, tmp_path: Path) -> None:
    src = _rewrite_legacy(FIXTURES / "moe_legacy_ep2", tmp_path / "src", _grouped(layout))
    ckpt = import_megatron(src, tmp_path / "ckpt")
    e = expected("moe_legacy_ep2")
    torch.testing.assert_close(mcore_logits(ckpt, e["tokens"]), e["logits"], **TOL)


GPT2_FLAGS = ("--num-layers 2 --hidden-size 16 --num-attention-heads 4 --ffn-hidden-size 64 --normalization LayerNorm "
              "--position-embedding-type learned_absolute --max-position-embeddings 16 --vocab-size 60 "
              "--make-vocab-size-divisible-by 16")  # fmt: skip


def _no_args(sd: dict) -> None:
    del sd["args"]


def test_config_from_flags_without_saved_args(tmp_path: Path) -> None:
    src = _rewrite_legacy(FIXTURES / "gpt2_legacy_tp1", tmp_path / "src", _no_args)
    with pytest.raises(MegatronFormatError, match="--num-attention-heads N"):
        import_megatron(src, tmp_path / "ckpt")
    with pytest.raises(MegatronFormatError, match=r"mlp.linear_fc1.weight: shape \(64, 16\), the model's is \(48"):
        import_megatron(
            src, tmp_path / "ckpt", flags=GPT2_FLAGS.replace("--ffn-hidden-size 64", "--ffn-hidden-size 48")
        )
    assert not (tmp_path / "ckpt").exists()
    ckpt = import_megatron(src, tmp_path / "ckpt", flags=GPT2_FLAGS)
    e = expected("gpt2_legacy_tp1")
    torch.testing.assert_close(mcore_logits(ckpt, e["tokens"]), e["logits"], **TOL)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_bad_inputs_are_named_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "out")
    code, err = _cli(capsys, "import-megatron", "--checkpoint", str(tmp_path / "nope"), "--out", out)
    assert code == 2 and "does not exist" in err
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "gpt2_dist_tp2" / "iter_0000010", run / "iter_0000010")
    code, err = _cli(capsys, "import-megatron", "--checkpoint", str(run), "--out", out)
    assert code == 2 and "pass --iteration N" in err and "iter_0000010" in err
    code, err = _cli(capsys, "import-megatron", "--checkpoint", str(run), "--out", out, "--iteration", "20")
    assert code == 2 and "no checkpoint of iteration 20" in err
    (run / "iter_0000030").mkdir()
    (run / "iter_0000030" / "model.bin").write_bytes(b"x")
    code, err = _cli(capsys, "import-megatron", "--checkpoint", str(run / "iter_0000030"), "--out", out)
    assert code == 2 and "unknown checkpoint format" in err
    args = ["import-megatron", "--checkpoint", str(FIXTURES / "gpt2_dist_tp2"), "--out", out]
    code, err = _cli(capsys, *args, "--", "--hidden-size", "32")
    assert code == 2 and "config mismatch: --hidden-size 32 but the checkpoint's args have hidden_size=16" in err
    code, err = _cli(capsys, *args, "--", "--num-layerz", "3")
    assert code == 2 and "not read by the importer: ['--num-layerz', '3']" in err
    (run / "iter_0000040" / "mp_rank_00").mkdir(parents=True)
    (run / "iter_0000040" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"not a pickle")
    code, err = _cli(capsys, "import-megatron", "--checkpoint", str(run), "--out", out, "--iteration", "40")
    assert code == 2 and "model_optim_rng.pt: not a torch.save file" in err
    assert not Path(out).exists()


def test_cli_import_reads_the_latest_iteration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ckpt"
    assert main(["import-megatron", "--checkpoint", str(FIXTURES / "llama_dist_tp1"), "--out", str(out),
                 "--iteration", "10", "--optimizer"]) == 0  # fmt: skip
    assert capsys.readouterr().out.strip() == str(out)
    assert read_metadata(out)["step"] == 10
    assert (out / "optimizer" / "decoder.layers.1.mlp.linear_fc1.weight" / "exp_avg_sq" / "zarr.json").exists()
