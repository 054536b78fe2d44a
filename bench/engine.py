"""Engine benchmarks on the default model, side by side in one run; prints tables, draws a PNG.

    python bench/engine.py [--quick] [--rounds N] [--out bench/out]

1. TTFT for a 1024-token shared prefix + 32 new tokens, reused vs cold, against the ideal speedup
   cold_prefill(1056) / prefill(32 on 1024 cached) measured on bare forward passes.
2. TTFT against the length of the shared prefix, cold and reused: the curve drawn in the PNG.
3. Prefill of a 512-token prompt in one pass vs one token per pass (an engine with prefill_chunk=1).
4. Our greedy loop vs model.generate for 128 new tokens (identical tokens checked first).

The default (15 rounds, 8 prefix lengths) takes minutes; --quick (3 rounds, 4 lengths) under one.
Compared measurements alternate round by round, so a noisy moment hits both; tables give medians
with their [min-max] range where the range says something. One torch thread, as in bench/processors.py:
the model is tiny, and on a shared machine a second thread mostly waits for a busy core (measured
6-15x slower under load), which would bury the differences measured here in noise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import NO_TARGET, Target, judged, median_times, print_table, sample_times, spread  # noqa: E402
from sidecar import Engine  # noqa: E402


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def ttft_pair(engine: Engine, prefix: list[int], new: list[int], rounds: int) -> tuple[list[float], list[float]]:
    """TTFTs of the same call on a fresh session (cold) and on one whose cache holds `prefix`, alternating.

    The first two rounds are warm-up and are dropped."""
    cold_times, warm_times = [], []
    warm = engine.session()
    for i in range(rounds + 2):
        with engine.session() as cold:
            cold_result = cold.generate(token_ids=prefix + new, max_new_tokens=1)
        warm.generate(token_ids=prefix, max_new_tokens=1)  # back to exactly `prefix` cached (1 token re-fed)
        warm_result = warm.generate(token_ids=prefix + new, max_new_tokens=1)
        assert warm_result.stats.reused_tokens == len(prefix) and warm_result.token_ids == cold_result.token_ids
        if i >= 2:
            cold_times.append(cold_result.stats.ttft_s)
            warm_times.append(warm_result.stats.ttft_s)
    warm.close()
    return cold_times, warm_times


def bare_prefill_pair(engine: Engine, prefix: list[int], new: list[int], rounds: int) -> tuple[float, float]:
    """The ideal: forward passes alone, cold over prefix+new vs new on top of a cached prefix."""
    model = engine.model
    cached = DynamicCache()

    def forward(cache, token_ids, start):
        positions = torch.arange(start, start + len(token_ids))
        model(input_ids=torch.tensor([token_ids]), past_key_values=cache, use_cache=True, cache_position=positions,
              position_ids=positions[None], logits_to_keep=1)

    with torch.inference_mode():
        forward(cached, prefix, 0)

        def cold():
            forward(DynamicCache(), prefix + new, 0)

        def on_top():
            forward(cached, new, len(prefix))
            cached.crop(-len(new))

        times = median_times({"cold": cold, "on_top": on_top}, rounds)
    return times["cold"], times["on_top"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="3 rounds and 4 prefix lengths: under a minute")
    parser.add_argument("--rounds", type=int, help="rounds of the 1024-token TTFT (default 15; other sections scale)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "out"))
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 15)
    lengths = (64, 256, 1024, 2000) if args.quick else (64, 128, 256, 512, 768, 1024, 1536, 2000)
    torch.set_num_threads(1)
    engine = Engine.load()
    print(f"default model: {sum(p.numel() for p in engine.model.parameters()):,} parameters, 1 thread")

    prefix, new = ids(1024, 1), [3] + ids(31, 2)
    cold, warm = ttft_pair(engine, prefix, new, rounds)
    bare_cold, bare_on_top = bare_prefill_pair(engine, prefix, new, rounds)
    ideal, achieved = bare_cold / bare_on_top, statistics.median(cold) / statistics.median(warm)
    print_table(
        f"TTFT, 1024-token shared prefix + 32 new tokens, median of {rounds} [min-max]",
        ["measure", "cold", "reused", "speedup", "of ideal", "target", "verdict"],
        [
            ["bare forward passes (ideal)", ms(bare_cold), ms(bare_on_top), f"{ideal:.1f}x", "", *NO_TARGET],
            ["session.generate TTFT", spread(cold), spread(warm), f"{achieved:.1f}x", f"{achieved / ideal:.2f}",
             *judged(achieved / ideal, Target(0.8, at_least=True))],
        ],
    )

    curve_rounds = rounds if args.quick else max(5, rounds // 2)
    curve = []
    for length in lengths:
        c, w = ttft_pair(engine, ids(length, 3), new[: min(32, 2048 - length - 1)], curve_rounds)
        curve.append((length, c, w))
    print_table(f"TTFT vs shared prefix length (+32 new tokens), median of {curve_rounds} [min-max]",
                ["prefix", "cold", "reused", "speedup", "target", "verdict"],
                [[n, spread(c), spread(w), f"{statistics.median(c) / statistics.median(w):.1f}x", *NO_TARGET]
                 for n, c, w in curve])
    draw(curve, Path(args.out) / "ttft_vs_prefix.png")

    prompt = ids(512, 4)
    one_token_per_pass = Engine(engine.model, engine.tokenizer, prefill_chunk=1)

    def prefill_with(which):
        with which.session() as session:
            session.generate(token_ids=prompt, max_new_tokens=0)

    times = median_times({"one_pass": lambda: prefill_with(engine), "token_by_token": lambda: prefill_with(one_token_per_pass)},
                         1 if args.quick else max(5, rounds // 3), warmup=1)
    speedup = times["token_by_token"] / times["one_pass"]
    print_table("Prefill of a 512-token prompt", ["method", "median", "speedup", "target", "verdict"], [
        ["one forward pass", ms(times["one_pass"]), f"{speedup:.1f}x", *judged(speedup, Target(5, at_least=True, unit="x"))],
        ["token by token", ms(times["token_by_token"]), "1.0x", *NO_TARGET],
    ])

    prompt = ids(32, 5)
    with engine.session() as session:
        ours_tokens = session.generate(token_ids=prompt, max_new_tokens=128, eos_token_ids=[]).token_ids
    with torch.inference_mode():
        theirs_tokens = engine.model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, 32, dtype=torch.long), max_new_tokens=128,
            min_new_tokens=128, do_sample=False, pad_token_id=0,
        )[0, 32:].tolist()
    assert ours_tokens == theirs_tokens, "greedy outputs differ: refusing to time them"

    def ours():
        with engine.session() as s:
            s.generate(token_ids=prompt, max_new_tokens=128, eos_token_ids=[])

    def theirs():
        with torch.inference_mode():
            engine.model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, 32, dtype=torch.long), max_new_tokens=128,
                min_new_tokens=128, do_sample=False, pad_token_id=0,
            )

    decode_rounds = rounds if args.quick else max(5, rounds // 2)
    times = sample_times({"ours": ours, "generate": theirs}, decode_rounds, warmup=1)
    ratio = statistics.median(times["ours"]) / statistics.median(times["generate"])
    print_table(f"Greedy decoding of 128 new tokens (identical tokens), median of {decode_rounds} [min-max]",
                ["loop", "median", "ratio", "target", "verdict"], [
        ["our decode loop", spread(times["ours"]), f"{ratio:.2f}", *judged(ratio, Target(0.9))],
        ["model.generate", spread(times["generate"]), "1.00", *NO_TARGET],
    ])


def draw(curve, path: Path) -> None:
    """Cold and reused TTFT against the prefix length, medians with their range shaded, on a log scale:
    the reused line sits one to two orders of magnitude below the cold one and must stay readable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = [n for n, _, _ in curve]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    handles = []
    for column in (1, 2):
        samples = [[t * 1e3 for t in point[column]] for point in curve]
        line, = ax.plot(lengths, [statistics.median(s) for s in samples], "o-")
        band = ax.fill_between(lengths, [min(s) for s in samples], [max(s) for s in samples], color=line.get_color(),
                               alpha=0.2, linewidth=0)
        handles.append((band, line))
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("shared prefix length (tokens), +32 new tokens")
    ax.set_ylabel("time to first token (ms, log scale)")
    ax.set_title("TTFT with and without prefix reuse (default model, CPU, 1 thread)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(handles, ["cold session", "reused prefix"], title="median, min-max shaded", loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}")

if __name__ == "__main__":
    main()
