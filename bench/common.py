"""Timing helpers shared by the benchmarks: interleaved rounds, medians, a plain-text table."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_times(candidates: dict[str, Callable[[], object]], rounds: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each candidate, measured in alternating rounds so noise hits all alike."""
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for i in range(warmup + rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                samples[name].append(elapsed)
    return {name: statistics.median(values) for name, values in samples.items()}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for j, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"
