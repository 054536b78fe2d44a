"""Saved sessions against recomputing them: save + restore of a 1,024-token session, then its next call,
against a fresh session that prefills the same 1,024 tokens, measured in alternating rounds.

    .venv/bin/python bench/sessions.py [--quick] [--rounds N] [--tokens N]

The issue's target: save + restore at least 5x faster than recomputing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Target, judged, print_table, sample_times, spread  # noqa: E402
from sidecar import Engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 5
    engine = Engine.load()
    prompt = [3 + (i * 7919) % (engine.vocab_size - 3) for i in range(args.tokens)]
    with engine.session() as session:
        session.generate(token_ids=prompt, max_new_tokens=1, eos_token_ids=[])
        history = list(session.history)
        folder = Path(tempfile.mkdtemp())
        path = folder / "s.safetensors"

        def recompute():
            with engine.session() as fresh:
                fresh.generate(token_ids=history + [5], max_new_tokens=1, eos_token_ids=[])

        def save_and_restore():
            session.save(path)
            with engine.restore(path) as restored:
                result = restored.generate(token_ids=history + [5], max_new_tokens=1, eos_token_ids=[])
            assert result.stats.reused_tokens == session.cached

        times = sample_times({"recompute": recompute, "save + restore": save_and_restore}, args.rounds)
    ratio = [a / b for a, b in zip(times["recompute"], times["save + restore"])]
    speedup = statistics.median(ratio)
    print_table(
        f"A {len(history)}-token session, then one more token ({args.rounds} alternating rounds; file "
        f"{path.stat().st_size / 2**20:.1f} MiB)",
        ["case", "time per call", "speedup", "target", "verdict"],
        [["recompute (fresh session, full prefill)", spread(times["recompute"]), "1.00x", "-", "-"],
         ["save + restore + the call", spread(times["save + restore"]),
          f"{speedup:.2f}x [{min(ratio):.2f}-{max(ratio):.2f}]", *judged(speedup, Target(5, at_least=True, unit="x"))]],
    )


if __name__ == "__main__":
    main()
