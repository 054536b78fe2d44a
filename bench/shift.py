"""Rolling shift against exact recompute when a 1,024-token window slides by 256 tokens.

    .venv/bin/python bench/shift.py [--quick] [--rounds N] [--slides N] [--models default,wide,trained]

The target: the shifted window's first token at least 2x sooner (768 of its 1,024 tokens are reused).

Two figures per model and `keep` (0, and 4 leading tokens kept as attention sinks):
- speed: time to first token of the slid window, shifted (`reuse="shift"`: 768 cached tokens moved,
  256 prefilled) against exact (a full prefill of 1,024 tokens), in alternating rounds, each from a
  fork of one session that holds the previous window;
- divergence: one session reads the corpus as a rolling window (each slide shifts a cache that earlier
  slides shifted already, as a long chat would), teacher-forced for 16 tokens after each window; each
  window is also run cold. Their next-token distributions are compared: top-1 agreement, and the
  KL divergence KL(exact || shifted) in nats, mean and max.

Models: `default` (the embedded tiny Llama, 4 layers of 256), `wide` (a random Llama-style model of
8 layers of 512, built here, so that a prefill costs what a small real model's does) and `trained` (the
default model's architecture trained here on the tokenizer's corpus, bench/trained.py: 3 to 4 minutes on
first use, cached after). The random models' distributions are nearly flat, so their divergence figures
say how far the approximation moves the numbers; the trained model's are peaked, so its top-1 agreement
says how often the shifted cache would change a greedy choice. Every model reads the corpus's held-out
tail (never trained on), cycled if the slides need more text than it holds.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import trained  # noqa: E402
from bench.common import Target, judged, print_table, ratio_spread, spread  # noqa: E402
from sidecar import Engine  # noqa: E402

WINDOW, SLIDE, FORCED = 1024, 256, 16


def wide_engine(tokenizer) -> Engine:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    return Engine(LlamaForCausalLM(config).eval(), tokenizer)


def trained_engine() -> Engine:
    """The trained model, loaded from its cached directory (trained first if absent), after printing what
    training measured: readers see how peaked its distributions are."""
    path = trained.materialise()
    report = trained.report(path)
    settings = report["settings"]
    print(f"trained model: {settings['steps']} steps of {settings['batch']} x {settings['seq_len']} tokens on "
          f"{report['train_tokens']:,} tokens in {report['seconds']:.0f} s; training loss {report['first_loss']:.2f} -> "
          f"{report['final_loss']:.2f} (mean of the last 10 steps); held-out loss {report['held_out_loss']:.2f}, "
          f"entropy {report['held_out_entropy']:.2f} nats")
    return Engine.load(path)


def rolling_text(tokenizer, needed: int) -> list[int]:
    """BOS, then the corpus's held-out tail, cycled (and said so) if `needed` tokens outgrow it."""
    _, held_out = trained.corpus_split(tokenizer, trained.Training())
    if needed > len(held_out):
        print(f"note: the held-out text ({len(held_out):,} tokens) is cycled to reach {needed:,}")
    return [tokenizer.bos_token_id] + held_out * (1 + needed // len(held_out))


def window(text: list[int], slide: int, keep: int) -> list[int]:
    """The window after `slide` slides, its first `keep` tokens those of the text."""
    start = slide * SLIDE
    return text[:keep] + text[start + keep : start + WINDOW]


def ttft(engine: Engine, text: list[int], keep: int, rounds: int) -> dict[str, list[float]]:
    """Seconds to the first token of the slid window, shifted and exact, in alternating rounds."""
    samples = {"exact": [], "shift": []}
    options = {"exact": {}, "shift": {"reuse": "shift", "keep": keep}}
    with engine.session() as base:
        base.generate(token_ids=window(text, 0, keep), max_new_tokens=0)
        for i in range(rounds + 2):  # two warm-up rounds
            for name in samples:
                with base.fork() as session:
                    result = session.generate(token_ids=window(text, 1, keep), max_new_tokens=1, eos_token_ids=[],
                                              **options[name])
                assert result.stats.shifted_tokens == (WINDOW - SLIDE - keep if name == "shift" else 0)
                if i >= 2:
                    samples[name].append(result.stats.ttft_s)
    return samples


class Forced:
    """A processor that records each step's log-probabilities and forces the text's next token, so that
    the shifted and the exact runs read the same tokens and their distributions compare position by position."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.seen: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, context) -> torch.Tensor:
        step = context.length - context.input_length
        self.seen.append(logits[0].float().log_softmax(-1))
        forced = torch.full_like(logits, float("-inf"))
        forced[:, self.tokens[step]] = 0
        return forced


def divergence(engine: Engine, text: list[int], keep: int, slides: int) -> tuple[float, float, float, float]:
    """Top-1 agreement, mean / max KL(exact || shifted) over `slides` slides of a rolling window, and the
    mean entropy of the exact distributions (how flat they are: top-1 of a flat one is fragile)."""
    agree, kls, entropies = [], [], []
    with engine.session() as rolling:
        for slide in range(slides + 1):
            tokens = window(text, slide, keep)
            end = slide * SLIDE + WINDOW
            shifted, exact = Forced(text[end : end + FORCED]), Forced(text[end : end + FORCED])
            result = rolling.generate(token_ids=tokens, max_new_tokens=FORCED, eos_token_ids=[], processors=[shifted],
                                      reuse="shift", keep=keep)
            assert slide == 0 or result.stats.shifted_tokens > 0
            if slide == 0:  # the first window is computed exactly: nothing to compare
                continue
            with engine.session() as cold:
                cold.generate(token_ids=tokens, max_new_tokens=FORCED, eos_token_ids=[], processors=[exact])
            for p, q in zip(exact.seen, shifted.seen):
                agree.append(bool(p.argmax() == q.argmax()))
                kls.append(float((p.exp() * (p - q)).sum()))
                entropies.append(float(-(p.exp() * p).sum()))
    return 100 * sum(agree) / len(agree), statistics.mean(kls), max(kls), statistics.mean(entropies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--slides", type=int, default=12, help="slides of the divergence run")
    parser.add_argument("--models", help="default,wide,trained (--quick: default)")
    parser.add_argument("--quick", action="store_true",
                        help="3 rounds, 4 slides, the default model only (no training)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.slides = 3, 4
    args.models = args.models or ("default" if args.quick else "default,wide,trained")
    default = Engine.load()
    engines = {"default": lambda: default, "wide": lambda: wide_engine(default.tokenizer), "trained": trained_engine}
    text = rolling_text(default.tokenizer, WINDOW + args.slides * SLIDE + FORCED)
    speed, drift = [], []
    for name in args.models.split(","):
        engine = engines[name]()
        for keep in (0, 4):
            times = ttft(engine, text, keep, args.rounds)
            ratio = [a / b for a, b in zip(times["exact"], times["shift"])]
            speedup = statistics.median(ratio)
            speed.append([name, keep, spread(times["exact"]), spread(times["shift"]), ratio_spread(ratio),
                          *judged(speedup, Target(2, at_least=True, unit="x"))])
            top1, mean_kl, max_kl, entropy = divergence(engine, text, keep, args.slides)
            drift.append([name, keep, f"{args.slides * FORCED}", f"{top1:.1f}%", f"{mean_kl:.2e}", f"{max_kl:.2e}",
                          f"{entropy:.2f} of {math.log(engine.vocab_size):.2f}", *judged(top1, None)])
    print_table(f"Time to first token when a {WINDOW:,}-token window slides by {SLIDE} ({args.rounds} alternating "
                "rounds; exact: full prefill, shift: reuse=\"shift\")",
                ["model", "keep", "exact", "shift", "speedup", "target", "verdict"], speed)
    print_table(f"Divergence of shifted caches from exact recompute over a rolling window ({args.slides} slides of "
                f"{SLIDE}, {FORCED} teacher-forced tokens each; KL(exact || shift) in nats)",
                ["model", "keep", "positions", "top-1 agreement", "mean KL", "max KL", "exact entropy", "target",
                 "verdict"], drift)


if __name__ == "__main__":
    main()
