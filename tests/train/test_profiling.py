"""``logging.profile_steps``: a profiled window of the training loop and its kernel-time summary."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mcore_train import ConfigError, pretrain
from mcore_train.profiling import classify_kernel
from tests.train._util import config


def test_profiled_window_writes_a_summary_and_a_trace(tmp_path: Path) -> None:
    result = pretrain(config("training.train_iters=5", f"logging.dir={tmp_path}", "logging.profile_steps=[2,4]",
                             "logging.profile_trace=true"))  # fmt: skip
    assert result.steps == 5
    text = (tmp_path / "profile-rank0.md").read_text()
    assert text.startswith("# steps 2..3, rank 0")
    assert "per step (2 profiled)" in text
    # the tiny model's linear layers are there, as GEMM time (CPU operators on this machine)
    row = re.search(r"^\| gemm \| ([0-9.]+) \|", text, re.M)
    assert row is not None and float(row.group(1)) > 0, text
    assert (tmp_path / "trace-rank0.json").stat().st_size > 1000


def test_windows_with_profiled_steps_are_flagged(tmp_path: Path) -> None:
    """A logging window holding a profiled step, or the step after the window (enqueued only once the profile was
    written), reports a throughput that includes the profiler: the record says so, the others do not."""
    pretrain(config("training.train_iters=8", f"logging.dir={tmp_path}", "logging.log_interval=2",
                    "logging.profile_steps=[3,5]"))  # fmt: skip
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    flagged = {r["step"]: bool(r.get("profiled")) for r in records if "tokens_per_s" in r}
    assert flagged == {1: False, 2: False, 4: True, 6: True, 8: False}, flagged


def test_a_run_that_stops_before_the_window_ends_writes_nothing(tmp_path: Path) -> None:
    pretrain(config("training.train_iters=3", f"logging.dir={tmp_path}", "logging.profile_steps=[3,6]"))
    assert not (tmp_path / "profile-rank0.md").exists()


@pytest.mark.parametrize("steps", ["[4]", "[0,2]", "[5,5]"])
def test_a_bad_window_is_refused_naming_the_field(steps: str) -> None:
    with pytest.raises(ConfigError, match="profile_steps"):
        config(f"logging.profile_steps={steps}")


def test_kernel_classes() -> None:
    assert classify_kernel("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNN") == "gemm"
    assert classify_kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "collectives (NCCL)"
    assert classify_kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3") == "attention"
    assert classify_kernel("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0") == (
        "triton (fused elementwise, norms, loss)"
    )
    assert classify_kernel("void multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"


def test_annotations_that_repeat_their_kernels_time_are_not_counted() -> None:
    from mcore_train.profiling import _is_annotation

    assert _is_annotation("nccl:_all_gather_base") and _is_annotation("Optimizer.step#AdamW.step")
    assert not _is_annotation("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)")


def test_timeline_busy_idle_and_hidden_collectives() -> None:
    from mcore_train.profiling import timeline

    spans = [(0.0, 10.0, False), (5.0, 12.0, False), (20.0, 30.0, False), (8.0, 16.0, True), (25.0, 40.0, True)]
    t = timeline(spans)
    assert t["window"] == 40.0
    assert t["busy"] == 16.0 + 20.0  # [0, 16) and [20, 40)
    assert t["idle"] == 4.0
    assert t["comm"] == 8.0 + 15.0
    assert t["comm_hidden"] == 4.0 + 5.0  # [8, 12) and [25, 30)
    assert timeline([])["busy"] == 0.0


def test_idle_gaps_by_size_and_by_the_kernels_around_them() -> None:
    from mcore_train.profiling import idle_gaps

    kernels = [
        (0.0, 10.0, "gemm"),
        (2.0, 12.0, "copy"),  # overlaps: no gap, and the later end names the span
        (14.0, 20.0, "norm"),  # 2 µs after copy
        (120.0, 130.0, "gemm"),  # 100 µs after norm
        (130.0, 140.0, "norm"),  # back to back: no gap
        (1140.0, 1150.0, "gemm"),  # 1000 µs after norm
        (1153.0, 1160.0, "copy"),  # 3 µs after gemm
    ]
    g = idle_gaps(kernels)
    assert g["buckets"]["< 5 µs"] == (2, 5.0)
    assert g["buckets"]["5-50 µs"] == (0, 0.0)
    assert g["buckets"]["50-500 µs"] == (1, 100.0)
    assert g["buckets"][">= 500 µs"] == (1, 1000.0)
    assert g["pairs"][0] == ("norm", "gemm", 2, 1100.0)
    assert ("copy", "norm", 1, 2.0) in g["pairs"] and ("gemm", "copy", 1, 3.0) in g["pairs"]
    assert idle_gaps([])["pairs"] == []


def test_host_waits_count_blocking_cuda_calls_by_caller() -> None:
    from types import SimpleNamespace as NS

    from mcore_train.profiling import host_waits

    item = NS(name="aten::_local_scalar_dense")

    def evt(name: str, a: float, b: float, parent: object = None) -> NS:
        return NS(name=name, time_range=NS(start=a, end=b), cpu_parent=parent)

    events = [
        evt("cudaStreamSynchronize", 0, 40, item),
        evt("cudaStreamSynchronize", 100, 110, item),
        evt("cudaMemcpyAsync", 0, 500, item),  # does not block
        evt("cudaDeviceSynchronize", 0, 7),
        evt("cudaLaunchKernel", 0, 900, item),
    ]
    assert host_waits(events) == {
        "aten::_local_scalar_dense > cudaStreamSynchronize": 50.0,
        "(top level) > cudaDeviceSynchronize": 7.0,
    }


def test_host_activity_during_idle_gpu_windows() -> None:
    from types import SimpleNamespace as NS

    from mcore_train.profiling import host_during_gaps, idle_windows

    kernels = [(0.0, 10.0, "a"), (12.0, 20.0, "b"), (100.0, 110.0, "c"), (400.0, 410.0, "d")]
    windows = idle_windows(kernels, 50.0)
    assert windows == [(20.0, 100.0), (110.0, 400.0)]  # the 2 µs gap is below the threshold

    def evt(name: str, a: float, b: float, parent: object = None, device: str = "DeviceType.CPU") -> NS:
        return NS(name=name, time_range=NS(start=a, end=b), cpu_parent=parent, device_type=device)

    compiled = evt("Torch-Compiled Region: 0/1", 15.0, 90.0)
    events = [
        compiled,
        evt("aten::mm", 20.0, 30.0, parent=compiled),  # a child: counted through its parent only
        evt("fused_all_gather_matmul", 95.0, 300.0),
        evt("autograd::engine::evaluate_function: MmBackward0", 350.0, 420.0),
        evt("kernel", 30.0, 60.0, device="DeviceType.CUDA"),  # device records are not host work
    ]
    got = host_during_gaps(events, windows)
    assert got == {
        "Torch-Compiled Region: 0/1": 70.0,  # 20..90
        "fused_all_gather_matmul": 5.0 + 190.0,  # 95..100 and 110..300
        "autograd::engine::evaluate_function: MmBackward0": 50.0,  # 350..400
    }


def test_summary_of_a_gpu_profile_has_the_timeline_tables() -> None:
    """kernel_summary on GPU-like records (faked: this machine has no GPU): kernel classes, idle gaps, the kernels
    around them, what the host ran meanwhile, and blocking CUDA calls."""
    from types import SimpleNamespace as NS

    from mcore_train.profiling import kernel_summary

    cuda, cpu = "DeviceType.CUDA", "DeviceType.CPU"

    def evt(name: str, a: float, b: float, device: str, parent: object = None) -> NS:
        return NS(name=name, key=name, time_range=NS(start=a, end=b), device_type=device, cpu_parent=parent,
                  is_user_annotation=False, self_device_time_total=b - a, self_cpu_time_total=0.0)  # fmt: skip

    events = [
        evt("nvjet_sm90_gemm", 0.0, 800.0, cuda),
        evt("triton_poi_fused_add_0", 1800.0, 1900.0, cuda),  # after a 1 ms idle gap
        evt("Torch-Compiled Region: 2/0", 700.0, 1790.0, cpu),
        evt("cudaStreamSynchronize", 10.0, 700.0, cpu, parent=NS(name="aten::_local_scalar_dense")),
    ]
    prof = NS(events=lambda: events, key_averages=lambda: [e for e in events if e.device_type == cuda])
    text, numbers = kernel_summary(prof, wall_s=0.002, steps=1)
    assert numbers["classes_ms"]["gemm"] == 0.8
    assert "| >= 500 µs | 1.0 | 1.00 |" in text
    assert "| `nvjet_sm90_gemm` | `triton_poi_fused_add_0` | 1.0 | 1.00 |" in text
    assert "| `Torch-Compiled Region: 2/0` | 0.99 |" in text
    assert "| `aten::_local_scalar_dense > cudaStreamSynchronize` | 0.69 |" in text
