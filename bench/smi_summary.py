"""Summarise an ``nvidia-smi --query-gpu=index,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,
clocks_throttle_reasons.active --format=csv,noheader,nounits -lms N`` log: per GPU, over the samples where it was
busy (power above a third of its limit), the SM clock against its maximum, the power against its limit, and how
often each throttle reason was active. Tells whether a sustained run was power- or thermally-limited."""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from statistics import median

# bits of nvmlClocksThrottleReasons (nvidia-smi prints the mask in hex)
REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
}


def main(path: str) -> None:
    rows: dict[int, list[tuple[float, float, float, float, float, int]]] = defaultdict(list)
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 7:
            continue
        try:
            idx = int(parts[0])
            clk, clk_max, power, limit, temp = (float(p) for p in parts[1:6])
            mask = int(parts[6], 16)
        except ValueError:
            continue
        rows[idx].append((clk, clk_max, power, limit, temp, mask))
    for idx, samples in sorted(rows.items()):
        busy = [r for r in samples if r[2] > r[3] / 3]
        if not busy:
            print(f"GPU {idx}: {len(samples)} samples, never busy")
            continue
        reasons: Counter[str] = Counter()
        for r in busy:
            for bit, name in REASONS.items():
                if r[5] & bit:
                    reasons[name] += 1
        share = ", ".join(f"{k} {v / len(busy):.0%}" for k, v in reasons.most_common()) or "none"
        print(
            f"GPU {idx}: {len(busy)} busy samples of {len(samples)}; SM clock median {median(r[0] for r in busy):.0f} "
            f"MHz (max {busy[0][1]:.0f}), min {min(r[0] for r in busy):.0f}; power median {median(r[2] for r in busy):.0f} "
            f"W of {busy[0][3]:.0f}; temperature max {max(r[4] for r in busy):.0f} C; throttle reasons: {share}"
        )


if __name__ == "__main__":
    main(sys.argv[1])
