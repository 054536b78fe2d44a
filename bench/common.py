"""Timing helpers shared by the benchmarks: interleaved rounds, medians, targets and their verdicts, a table."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable


def median_times(candidates: dict[str, Callable[[], object]], rounds: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each candidate, measured in alternating rounds so noise hits all alike."""
    return {name: statistics.median(values) for name, values in sample_times(candidates, rounds, warmup).items()}


def sample_times(candidates: dict[str, Callable[[], object]], rounds: int, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds of every call of each candidate after the warm-up, in alternating rounds."""
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for i in range(warmup + rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                samples[name].append(elapsed)
    return samples


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class Target:
    """What a row promises: a value at most `bound` (or at least, with `at_least`), in the unit shown after it."""

    bound: float
    at_least: bool = False
    unit: str = ""

    def __str__(self) -> str:
        return f"{'>=' if self.at_least else '<='} {self.bound:,g}{self.unit}"

    def met(self, value: float) -> bool:
        return value >= self.bound if self.at_least else value <= self.bound


NO_TARGET = ["-", "-"]  # the target and verdict cells of a row that promises nothing


def judged(value: float, target: Target | None) -> list[str]:
    """A row's `target` and `verdict` cells: the target, then `met` or `MISSED`; NO_TARGET without one."""
    if target is None:
        return NO_TARGET
    return [str(target), "met" if target.met(value) else "MISSED"]


def spread(values: list[float], *, scale: float = 1e3, unit: str = "ms", digits: int = 2) -> str:
    """A median with the range it came from, e.g. `12.30 ms [11.90-15.00]`: how far the machine's noise moved it."""
    def number(value: float) -> str:
        return f"{value * scale:.{digits}f}"

    return f"{number(statistics.median(values))} {unit} [{number(min(values))}-{number(max(values))}]"


def ratio_spread(ratios: list[float]) -> str:
    """A median ratio with the range of the rounds' own, e.g. `3.35x [2.96-3.68]`."""
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"


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
