"""What a run tells its user: log lines from the first step on with an ETA, FLOP/s that never read 0.0 on a CPU, a
closing line that says which loss it reports, and the end-of-run sample (temperature + repetition penalty)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from mcore_models import GPTModel, TransformerConfig
from mcore_train import pretrain
from mcore_train.api import summary
from mcore_train.generate import Sampling, generate, greedy_generate
from mcore_train.loop import TrainResult, _logs, format_duration
from tests.train._util import config


def test_logged_steps_cover_the_first_interval() -> None:
    assert [s for s in range(1, 31) if _logs(s, 1, 30, 10)] == [1, 2, 4, 8, 10, 20, 30]
    assert [s for s in range(1, 8) if _logs(s, 1, 7, 1)] == list(range(1, 8))
    assert [s for s in range(101, 126) if _logs(s, 101, 125, 10)] == [101, 102, 104, 108, 110, 120, 125]  # resumed


def test_format_duration() -> None:
    got = [format_duration(s) for s in (0.4, 42, 187, 7500, 3 * 86400 + 4 * 3600 + 59)]
    assert got == ["0s", "42s", "3m07s", "2h05m", "3d04h"]


def test_log_lines_from_step_one_with_eta_and_gflops_on_cpu(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="mcore_train"):
        result = pretrain(config("training.train_iters=12", "logging.log_interval=5", f"logging.dir={tmp_path}",
                                 "training.device=cpu"))  # fmt: skip
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [int(re.match(r"step (\d+)/12", line).group(1)) for line in lines] == [1, 2, 4, 5, 10, 12]
    assert "ETA" not in lines[0] and all(re.search(r"\| ETA \d+s$", line) for line in lines[1:-1])
    assert "ETA" not in lines[-1]  # the last step: nothing left
    assert all(re.search(r"\| \d+\.\d GFLOP/s/rank \|", line) for line in lines)
    assert not any("TFLOP/s" in line for line in lines)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 4, 5, 10, 12]
    # the closing line's training loss is the last log line's: the mean of steps 11 and 12
    assert result.logged_loss == (11, 12, pytest.approx(sum(result.losses[-2:]) / 2))
    assert records[-1]["loss"] == pytest.approx(result.logged_loss[2])
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("done:")]
    assert done == [f"done: 12 steps (train_iters); training loss {result.logged_loss[2]:.4f} (mean of steps 11-12, "
                    "as logged)"]  # fmt: skip


def test_summary_names_the_validation_perplexity() -> None:
    r = TrainResult(300, 1.6891, "train_iters", eval_losses=[(300, 1.6814)], logged_loss=(291, 300, 1.61464))
    assert summary(r, 259) == (
        "done: 300 steps (train_iters); training loss 1.6146 (mean of steps 291-300, as logged); validation loss "
        "1.6814 at step 300, perplexity 5.37 (a uniform guess over the 259 tokens: 259)"
    )
    assert summary(TrainResult(5, None, "SIGTERM", logged_loss=(5, 5, 2.0)), 259) == (
        "done: 5 steps (SIGTERM); training loss 2.0000 (mean of step 5, as logged)"
    )


def _model() -> GPTModel:
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=50,
                            max_position_embeddings=64, activation="swiglu", normalization="rmsnorm",
                            position_embedding="rope", add_bias_linear=False)  # fmt: skip
    model = GPTModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    return model


def test_repetition_penalty_is_transformers_rule() -> None:
    transformers = pytest.importorskip("transformers")
    model, prompt = _model(), [3, 7, 7, 1]
    got = generate(model, prompt, 10, Sampling(repetition_penalty=1.3), vocab_size=40)
    ids = torch.tensor([prompt])
    processor = transformers.RepetitionPenaltyLogitsProcessor(1.3)
    want = []
    with torch.no_grad():
        for _ in range(10):
            scores = processor(ids, model(ids, gather_logits=True)[:, -1, :40].float())
            nxt = int(scores.argmax())
            want.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    assert got == want and all(t < 40 for t in got)
    assert greedy_generate(model, prompt, 10) != got  # the penalty changed something


def test_sampling_is_seeded_and_stops_at_eod() -> None:
    model, prompt = _model(), [3, 7, 7, 1]
    a = generate(model, prompt, 20, Sampling(temperature=0.8, seed=5))
    assert a == generate(model, prompt, 20, Sampling(temperature=0.8, seed=5))
    assert a != generate(model, prompt, 20, Sampling(temperature=0.8, seed=6))
    stop = a[3]
    cut = generate(model, prompt, 20, Sampling(temperature=0.8, seed=5), stop_id=stop)
    assert cut == a[: a.index(stop) + 1]


def test_end_of_run_sample_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="mcore_train"):
        result = pretrain(config("training.train_iters=2", "training.generate_at_end=8"))
    assert result.generated is not None and result.generated.startswith("def ")
    text = caplog.text
    assert "sample (temperature 0.5, seed 1234, repetition penalty 1.2; " in text and "tokens after 'def '" in text
