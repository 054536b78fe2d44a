"""Processor cost per step against transformers' LogitsProcessorList, side by side in one run.

Batch 8 x vocab 32000, float32, CPU. Every pair is checked for identical output before it is timed.
    python bench/processors.py [--quick] [--rounds N]      (--quick: 60 rounds instead of 300, a few seconds)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from transformers.generation import logits_process as hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Target, judged, median_times, print_table, us  # noqa: E402
from processors import ArrayProcessor, Chain, Context, RepetitionPenalty, Temperature, TopK, TopP  # noqa: E402

BATCH, VOCAB, PROMPT = 8, 32000, 256


def lm_like_logits(generator: torch.Generator) -> torch.Tensor:
    """Heavy-headed like a language model's: a few dozen plausible tokens well above a long flat tail."""
    logits = torch.randn(BATCH, VOCAB, generator=generator) * 2.0
    favourites = torch.randint(0, VOCAB, (BATCH, 40), generator=generator)
    boosts = 8.0 + torch.randn(BATCH, 40, generator=generator) * 2.0
    return logits.scatter_add(1, favourites, boosts)


def flat_logits(generator: torch.Generator) -> torch.Tensor:
    return torch.randn(BATCH, VOCAB, generator=generator)


def nucleus_stats(logits: torch.Tensor, p: float) -> str:
    probs = logits.softmax(-1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean().item()
    kept = TopP(p).transform(logits, None).isfinite().sum(-1).float().mean().item()
    return f"entropy {entropy:.2f} nats, nucleus {kept:.0f} tokens"


class Decode:
    """A decode loop's view: one sequence that grows by a token per step, for both implementations."""

    def __init__(self, chain: Chain, theirs: hf.LogitsProcessorList, generator: torch.Generator, steps: int):
        self.chain, self.theirs, self.generator = chain, theirs, generator
        self.sequence = torch.randint(0, VOCAB, (BATCH, PROMPT + steps + 8), generator=generator)
        self.length = PROMPT
        self.states = chain.init(self.context())
        self.logits = lm_like_logits(generator)

    def context(self) -> Context:
        return Context(self.sequence, self.length, PROMPT, VOCAB)

    def ours(self):
        self.states, out = self.chain.process(self.states, self.logits, self.context())
        self.length += 1
        return out

    def transformers(self):
        return self.theirs(self.sequence[:, : self.length], self.logits)


def check_identical(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.equal(a, b):
        raise SystemExit(f"{what}: outputs differ, refusing to time them")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="60 rounds instead of 300")
    parser.add_argument("--rounds", type=int, help="steps timed per case (default 300)")
    args = parser.parse_args()
    args.rounds = args.rounds or (60 if args.quick else 300)
    torch.set_num_threads(1)
    rows = []

    decode = Decode(
        Chain([RepetitionPenalty(1.1), Temperature(0.7), TopK(50), TopP(0.9)]),
        hf.LogitsProcessorList(
            [hf.RepetitionPenaltyLogitsProcessor(1.1), hf.TemperatureLogitsWarper(0.7),
             hf.TopKLogitsWarper(50), hf.TopPLogitsWarper(0.9)]
        ),
        torch.Generator().manual_seed(0),
        steps=args.rounds + 10,
    )
    expected = decode.transformers()
    check_identical(decode.ours(), expected, "chain")
    times = median_times({"ours": decode.ours, "transformers": decode.transformers}, args.rounds)
    ratio = times["ours"] / times["transformers"]
    rows.append(["chain rep1.1+temp0.7+topk50+topp0.9", us(times["ours"]), us(times["transformers"]),
                 f"{ratio:.3f}", *judged(ratio, Target(0.5))])

    for label, make, target in (("LM-like", lm_like_logits, Target(0.2)), ("flat randn", flat_logits, Target(0.3))):
        logits = make(torch.Generator().manual_seed(1))
        ours, theirs = TopP(0.9), hf.TopPLogitsWarper(0.9)
        check_identical(ours.transform(logits, None), theirs(None, logits), f"top_p {label}")
        times = median_times({"ours": lambda: ours.transform(logits, None), "transformers": lambda: theirs(None, logits)}, args.rounds)
        ratio = times["ours"] / times["transformers"]
        rows.append([f"top_p 0.9 alone, {label} ({nucleus_stats(logits, 0.9)})", us(times["ours"]),
                     us(times["transformers"]), f"{ratio:.3f}", *judged(ratio, target)])

    print_table(
        f"Logits processors, batch {BATCH} x vocab {VOCAB}, float32, 1 thread, median of {args.rounds} steps",
        ["case", "ours", "transformers", "ratio", "target", "verdict"],
        rows,
    )

    identity = lambda logits, context: logits  # noqa: E731
    np_logits = np.random.default_rng(0).standard_normal((4, 30000)).astype(np.float32)
    np_ids = np.zeros((4, 8), dtype=np.int64)
    t_logits, t_ids = torch.from_numpy(np_logits), torch.from_numpy(np_ids)
    on_numpy, on_torch = ArrayProcessor([identity]), ArrayProcessor([identity])
    times = median_times(
        {"numpy": lambda: on_numpy(np_ids, np_logits), "torch": lambda: on_torch(t_ids, t_logits)}, args.rounds * 10
    )
    print_table(
        "Any-array entry point, pass-through processor on (4, 30000) float32: whole call, median",
        ["input", "per call", "target", "verdict"],
        [[name, us(times[name]), *judged(times[name] * 1e6, Target(10, unit=" us"))] for name in ("numpy", "torch")],
    )


if __name__ == "__main__":
    main()
