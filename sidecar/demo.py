"""The quick-start demo: what a session's prefix cache saves, case by case, then a short chat.

    python -m sidecar.demo [--model PATH]

Shows the prompts, runs the three ways a new prompt can relate to what a session holds (the Petals
cases: prefix, prefix with a different suffix, rolling) on a fresh session each, then a three-turn
chat through `messages`. A throw-away generation runs first: the first forward pass of a process
pays one-time costs (allocations, kernel selection) that would otherwise land on the first TTFT shown.
"""

from __future__ import annotations

import argparse
import sys

import torch

from . import Engine
from .errors import NoChatTemplate, SidecarError

PARTS = {
    "A": "The sidecar keeps one session per conversation.",
    "B": " Each call reuses the cache of the longest common prefix.",
    "C": " A different ending shares only the beginning.",
    "D": " Rolling windows recompute.",
}
CASES = [  # name, what it stands for, the two prompts in turn (as strings of part names)
    ("prefix", "A conversation grows: the second prompt extends the first, so all of A is reused.", ("A", "AB")),
    ("prefix with a different suffix", "A branch: the second prompt shares only A with the first, so A is reused.",
     ("AB", "AC")),
    ("rolling", "A window slides: the second prompt drops A, so it shares no prefix and is computed in full\n"
     "   (under causal attention the keys of a shifted window differ: exact reuse is impossible).", ("ABC", "BCD")),
]
CHAT = ["Hello! Who are you?", "What can you do?", "Thanks, that is all."]
NEW_TOKENS = 12
COLUMNS = f"{'prompt':>6} {'reused':>6} {'prefill':>7} {'new':>3} {'ttft ms':>7}"


def numbers(stats) -> str:
    return (f"{stats.prompt_tokens:>6} {stats.reused_tokens:>6} {stats.prefill_tokens:>7} "
            f"{stats.generated_tokens:>3} {stats.ttft_s * 1000:>7.1f}")


def reuse_cases(engine: Engine) -> None:
    print("\nThe prompts, built from four parts:")
    for name, text in PARTS.items():
        print(f"   {name} = {text!r}")
    print(f"\nThe Petals cases: how a new prompt can relate to what a session holds. Two calls each, on a fresh\n"
          f"session, {NEW_TOKENS} new tokens a call; reused tokens come from the cache, prefill tokens are computed.")
    for number, (case, meaning, calls) in enumerate(CASES, 1):
        print(f"\n{number}. {case}. {meaning}")
        print(f"   {'call':<6} {COLUMNS}  text")
        with engine.session() as session:
            for names in calls:
                result = session.generate("".join(PARTS[n] for n in names), max_new_tokens=NEW_TOKENS)
                print(f"   {'+'.join(names):<6} {numbers(result.stats)}  {result.text!r}")
    print("\nThese prompts are short, so TTFT differs little; bench/engine.py measures it on 1024-token prefixes.")


def chat(engine: Engine) -> None:
    print(f"\n{len(CASES) + 1}. chat. {len(CHAT)} turns through messages=[{{\"role\": \"user\", \"content\": ...}}, ...], "
          "rendered by the\n   model's chat template. Each turn sends the whole conversation, answers included, so turn N+1\n"
          "   can reuse all of turn N (prev: its prompt + answer) but one token: the answer's last, sampled but never\n"
          "   fed back to the model.")
    print(f"   {'turn':<4} {'prev':>5} {COLUMNS}  user -> assistant")
    messages: list[dict] = []
    previous = 0
    with engine.session() as session:
        for turn, question in enumerate(CHAT, 1):
            messages.append({"role": "user", "content": question})
            result = session.generate(messages=messages, max_new_tokens=NEW_TOKENS)
            messages.append({"role": "assistant", "content": result.text})
            print(f"   {turn:<4} {previous:>5} {numbers(result.stats)}  {question!r} -> {result.text!r}")
            previous = result.stats.prompt_tokens + result.stats.generated_tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sidecar.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local Hugging Face model directory (default: the embedded tiny model)")
    args = parser.parse_args(argv)
    if args.model is None:
        # The default model is tiny: more threads gain it little, and on a busy machine they make every
        # step wait for a free core (measured 6-15x slower under load), which would swamp the TTFTs shown.
        torch.set_num_threads(1)
    try:
        engine = Engine.load(args.model)
    except SidecarError as error:
        message = " ".join(error.message.split())  # one line, whatever the loader's message spans
        print(f"demo: cannot load --model {args.model}: {message} ({error.code})", file=sys.stderr)
        return 2
    parameters = sum(p.numel() for p in engine.model.parameters())
    print(f"model: {engine.path} ({type(engine.model).__name__}, {parameters:,} parameters, "
          f"torch threads: {torch.get_num_threads()})")
    if args.model is None:
        print("note: the default model has random weights, so its text is gibberish; the point is the cache reuse")
    with engine.session() as warm_up:
        warm_up.generate(PARTS["A"], max_new_tokens=2)
    print("warm-up: one throw-away generation ran first, so no TTFT below includes first-call costs")
    reuse_cases(engine)
    try:
        chat(engine)
    except NoChatTemplate as error:
        print(f"   skipped: {error.message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
