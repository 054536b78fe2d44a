"""The quick-start demo: load the default model, run one session through the three Petals cases.

    python -m sidecar.demo [--model PATH]
"""

from __future__ import annotations

import argparse

from . import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local Hugging Face model directory (default: the embedded tiny model)")
    args = parser.parse_args()
    engine = Engine.load(args.model)
    print(f"model: {engine.path} ({type(engine.model).__name__}, {sum(p.numel() for p in engine.model.parameters()):,} parameters)")
    if args.model is None:
        print("note: the default model has random weights, so its text is gibberish; the point is the cache reuse")
    a = "The sidecar keeps one session per conversation."
    b = " Each call reuses the cache of the longest common prefix."
    c = " A different ending shares only the beginning."
    d = " Rolling windows recompute."
    cases = [
        ("prefix: a", a), ("prefix: ab", a + b),
        ("different suffix: ab", a + b), ("different suffix: ac", a + c),
        ("rolling: abc", a + b + c), ("rolling: bcd", b + c + d),
    ]
    print(f"\n{'call':<22} {'prompt':>6} {'reused':>6} {'prefill':>7} {'new':>4} {'ttft ms':>8}  text")
    with engine.session() as session:
        for label, prompt in cases:
            result = session.generate(prompt, max_new_tokens=12)
            s = result.stats
            print(f"{label:<22} {s.prompt_tokens:>6} {s.reused_tokens:>6} {s.prefill_tokens:>7} "
                  f"{s.generated_tokens:>4} {s.ttft_s * 1000:>8.2f}  {result.text!r}")
        print(f"\nengine: {engine.stats()}")


if __name__ == "__main__":
    main()
