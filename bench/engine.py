"""Engine benchmarks on the default model, side by side in one run; prints tables, draws a PNG.

    python bench/engine.py [--rounds N] [--out bench/out]

1. TTFT for a 1024-token shared prefix + 32 new tokens, reused vs cold, against the ideal speedup
   cold_prefill(1056) / prefill(32 on 1024 cached) measured on bare forward passes.
2. Prefill of a 512-token prompt in one pass vs forcing it through token by token.
3. Our greedy loop vs model.generate for 128 new tokens (identical tokens checked first).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import median_times, print_table  # noqa: E402
from sidecar import Engine  # noqa: E402
from sidecar.decode import decode_step, prefill  # noqa: E402


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def ttft_pair(engine: Engine, prefix: list[int], new: list[int], rounds: int) -> tuple[float, float]:
    """Median TTFT of the same call on a fresh session (cold) and on one whose cache holds `prefix`."""
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
    return statistics.median(cold_times), statistics.median(warm_times)


def bare_prefill_pair(engine: Engine, prefix: list[int], new: list[int], rounds: int) -> tuple[float, float]:
    """The ideal: forward passes alone, cold over prefix+new vs new on top of a cached prefix."""
    model = engine.model
    cached = DynamicCache()
    with torch.inference_mode():
        prefill(model, cached, prefix, 0, 4096)

        def cold():
            prefill(model, DynamicCache(), prefix + new, 0, 4096)

        def on_top():
            prefill(model, cached, new, len(prefix), 4096)
            cached.crop(-len(new))

        times = median_times({"cold": cold, "on_top": on_top}, rounds)
    return times["cold"], times["on_top"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=str(Path(__file__).parent / "out"))
    args = parser.parse_args()
    engine = Engine.load()
    print(f"default model: {sum(p.numel() for p in engine.model.parameters()):,} parameters, "
          f"{torch.get_num_threads()} threads")

    prefix, new = ids(1024, 1), [3] + ids(31, 2)
    cold, warm = ttft_pair(engine, prefix, new, args.rounds)
    bare_cold, bare_on_top = bare_prefill_pair(engine, prefix, new, args.rounds)
    ideal, achieved = bare_cold / bare_on_top, cold / warm
    print_table(
        f"TTFT, 1024-token shared prefix + 32 new tokens, median of {args.rounds}",
        ["measure", "cold", "reused", "speedup", "of ideal", "target"],
        [
            ["bare forward passes (ideal)", ms(bare_cold), ms(bare_on_top), f"{ideal:.1f}x", "", ""],
            ["session.generate TTFT", ms(cold), ms(warm), f"{achieved:.1f}x", f"{achieved / ideal:.2f}", ">= 0.8"],
        ],
    )

    curve = []
    for length in (64, 128, 256, 512, 768, 1024, 1536, 2000):
        c, w = ttft_pair(engine, ids(length, 3), new[: min(32, 2048 - length - 1)], max(5, args.rounds // 2))
        curve.append((length, c, w))
    print_table("TTFT vs shared prefix length (+32 new tokens)", ["prefix", "cold", "reused", "speedup"],
                [[n, ms(c), ms(w), f"{c / w:.1f}x"] for n, c, w in curve])
    draw(curve, Path(args.out) / "ttft_vs_prefix.png")

    prompt = ids(512, 4)
    with torch.inference_mode():
        def one_pass():
            prefill(engine.model, DynamicCache(), prompt, 0, 512)

        def token_by_token():
            cache = DynamicCache()
            for position, token in enumerate(prompt):
                decode_step(engine.model, cache, token, position)

        times = median_times({"one_pass": one_pass, "token_by_token": token_by_token}, max(5, args.rounds // 3), warmup=1)
    print_table("Prefill of a 512-token prompt", ["method", "median", "speedup", "target"], [
        ["one forward pass", ms(times["one_pass"]), f"{times['token_by_token'] / times['one_pass']:.1f}x", ">= 5x"],
        ["token by token", ms(times["token_by_token"]), "1.0x", ""],
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

    times = median_times({"ours": ours, "generate": theirs}, max(5, args.rounds // 2), warmup=1)
    print_table("Greedy decoding of 128 new tokens (identical tokens)", ["loop", "median", "ratio", "target"], [
        ["our decode loop", ms(times["ours"]), f"{times['ours'] / times['generate']:.2f}", "<= 0.9"],
        ["model.generate", ms(times["generate"]), "1.00", ""],
    ])


def draw(curve, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = [n for n, _, _ in curve]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(lengths, [c * 1e3 for _, c, _ in curve], "o-", label="cold session")
    ax.plot(lengths, [w * 1e3 for _, _, w in curve], "o-", label="reused prefix")
    ax.set_xlabel("shared prefix length (tokens), +32 new tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("TTFT with and without prefix reuse (default model, CPU)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
