"""Sessions that do not compute again what is already cached, in alternating rounds against those that do:

1. save + restore of a 1,024-token session, then its next call, against a fresh session that prefills
   the same 1,024 tokens (target: at least 5x faster);
2. 20 sessions sharing a 1,024-token system prompt, each with its own 32-token question: the total of
   their times to first token with prefixes shared across sessions against an engine without (target:
   at least 5x), the KV memory held for the system prompt (target: one copy, not 20), and what a decode
   step costs a session continuing a shared prefix rather than its own copy.

    .venv/bin/python bench/sessions.py [--quick] [--rounds N] [--tokens N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Target, judged, print_table, ratio_spread, sample_times, spread  # noqa: E402
from sidecar import Engine  # noqa: E402


def save_and_restore(engine, args) -> None:
    """Two readings of "save + restore vs recomputing": a session brought back holding its cache against
    one prefilled again (nothing generated), and the same followed by its next call on both sides (what
    a user waits for: the call after a restore still runs one token over the whole cache)."""
    prompt = [3 + (i * 7919) % (engine.vocab_size - 3) for i in range(args.tokens)]
    alone = Engine(engine.model, engine.tokenizer, share_prefixes=False)  # a fresh session recomputes
    with engine.session() as session, tempfile.TemporaryDirectory() as folder:
        session.generate(token_ids=prompt, max_new_tokens=1, eos_token_ids=[])
        history = list(session.history)
        path = Path(folder) / "s.safetensors"

        def recompute(then_call):
            def call():
                with alone.session() as fresh:
                    fresh.generate(token_ids=history + [5] if then_call else history, max_new_tokens=int(then_call),
                                   eos_token_ids=[])
            return call

        def restore(then_call):
            def call():
                session.save(path)
                with engine.restore(path) as restored:
                    if then_call:
                        result = restored.generate(token_ids=history + [5], max_new_tokens=1, eos_token_ids=[])
                        assert result.stats.reused_tokens == session.cached
            return call

        times = sample_times({"recompute": recompute(False), "save + restore": restore(False),
                              "recompute + call": recompute(True), "save + restore + call": restore(True)},
                             args.rounds)
        size = path.stat().st_size
    rows = []
    for label, cold, warm in (("session held again", "recompute", "save + restore"),
                              ("then its next call (one token)", "recompute + call", "save + restore + call")):
        ratio = [a / b for a, b in zip(times[cold], times[warm])]
        rows += [[f"{label}: recompute (fresh session, full prefill)", spread(times[cold]), "1.00x", "-", "-"],
                 [f"{label}: save + restore", spread(times[warm]), ratio_spread(ratio),
                  *judged(statistics.median(ratio), Target(5, at_least=True, unit="x"))]]
    print_table(f"A {len(history)}-token session saved and restored ({args.rounds} alternating rounds; file "
                f"{size / 2**20:.1f} MiB)", ["case", "time", "speedup", "target", "verdict"], rows)


def shared_system_prompt(engine, args) -> None:
    sharing = Engine(engine.model, engine.tokenizer)
    alone = Engine(engine.model, engine.tokenizer, share_prefixes=False)
    vocab, rounds = engine.vocab_size, max(3, args.rounds // 3)
    held, ttft = {}, {"shared": [], "alone": []}
    for r in range(rounds):  # a new system prompt each round: what earlier rounds cached does not help
        system = [3 + (i * 7919 + r * 104729) % (vocab - 3) for i in range(args.tokens)]
        for name, candidate in (("shared", sharing), ("alone", alone))[:: 1 if r % 2 else -1]:
            before = candidate.store.used_bytes  # what earlier rounds left cached
            sessions = [candidate.session() for _ in range(args.sessions)]
            total = 0.0
            for i, session in enumerate(sessions):
                question = [3 + (i * 31 + j * 17 + r) % (vocab - 3) for j in range(32)]
                result = session.generate(token_ids=system + question, max_new_tokens=1, eos_token_ids=[])
                total += result.stats.ttft_s
            ttft[name].append(total)
            held[name] = candidate.store.used_bytes - before
            for session in sessions:
                session.close()
    per_token = engine.store.bytes_per_token
    ratio = [a / b for a, b in zip(ttft["alone"], ttft["shared"])]
    speedup = statistics.median(ratio)
    # what is held beyond the sessions' own questions, in system prompts
    copies = {name: (b / per_token - args.sessions * 32) / args.tokens for name, b in held.items()}
    decode = decode_after_prefix(sharing, alone, args)
    print_table(
        f"{args.sessions} sessions, one {args.tokens}-token system prompt, each its own 32-token question "
        f"({rounds} alternating rounds)",
        ["case", "sum of TTFTs", "speedup", "KV held / system prompts held", "target", "verdict"],
        [["each session prefills it (--no-share-prefixes)", spread(ttft["alone"], scale=1, unit="s"), "1.00x",
          f"{held['alone'] / 2**20:.1f} MiB / {copies['alone']:.1f}", "-", "-"],
         ["prefixes shared across sessions", spread(ttft["shared"], scale=1, unit="s"),
          ratio_spread(ratio),
          f"{held['shared'] / 2**20:.1f} MiB / {copies['shared']:.1f}",
          *judged(speedup, Target(5, at_least=True, unit="x"))],
         ["  memory for the system prompt", "-", "-", f"{copies['shared']:.1f} copies",
          *judged(copies["shared"], Target(1.05, unit=" copies"))],
         ["decode step, own copy of the prefix", spread(decode["alone"]), "1.00x", "-", "-", "-"],
         ["decode step, continuing a shared prefix", spread(decode["shared"]),
          f"{statistics.median(decode['alone']) / statistics.median(decode['shared']):.2f}x", "-", "-", "-"]],
    )


def decode_after_prefix(sharing, alone, args) -> dict[str, list[float]]:
    """Seconds per decode step of one session after the system prompt: reading a shared prefix in parts
    (merged by their log-sum-exps) against reading its own copy (one SDPA call)."""
    vocab = sharing.vocab_size
    system = [3 + (i * 7919 + 7) % (vocab - 3) for i in range(args.tokens)]
    owner = sharing.session()
    owner.generate(token_ids=system + [5], max_new_tokens=1, eos_token_ids=[])
    steps = 32

    def per_step(engine) -> float:
        with engine.session() as session:
            result = session.generate(token_ids=system + [6, 7], max_new_tokens=steps, eos_token_ids=[])
        return (result.stats.total_s - result.stats.ttft_s) / (steps - 1)

    values = {"shared": [], "alone": []}
    for _ in range(max(3, args.rounds // 3)):
        values["shared"].append(per_step(sharing))
        values["alone"].append(per_step(alone))
    owner.close()
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 5
    engine = Engine.load()
    save_and_restore(engine, args)
    shared_system_prompt(engine, args)


if __name__ == "__main__":
    main()
