"""The batched engine, side by side in one run: prints one table of medians, ratios and verdicts.

    .venv/bin/python bench/batching.py [--runs 3] [--quick] [--baseline DIR] [--no-peer] [--threads 1] [--model mid]

Default model, CPU, one torch thread (--threads: more, for the server and the in-process rows alike),
greedy unless said. `--model mid` runs the same rows on MID, a random Llama of 50M parameters built like
the default model (its tokenizer, 8 layers of width 768): a step of the default model is mostly the
fixed cost of a few hundred small operations, one of MID mostly reading its 200 MB of weights, as a
real model's is; the targets are the issue's, set for the default model. Server rows run the real server
(`python -m sidecar --model default`) over pipes; in-process rows use the Python API. Compared
measurements alternate run by run, so a noisy moment hits both sides.

1. 8 sessions at once (prompts of 8 lengths, 96 new tokens each) through the server, against the same
   8 prompts one at a time: aggregate tokens/s (target >= 4x). Twice: prompts of 16-512 tokens, whose
   prefill (the same work either way) is a third of the batched run, and chat-sized ones of 8-96.
   Under each, the same on decode steps alone, in process (engine ticks of the 8 sessions against ticks
   of the middle prompt's session alone), beside the bound of item 2; and for the chat-sized prompts once
   more, each after one 200-token system prompt whose cache they all continue, as an app's chats do.
2. The same 8 prompts through transformers' own continuous batching (`generate_batch`), as the peer
   figure; it cannot carry our processors (--no-peer skips it: it takes about 16 s a run here). And the
   bound on what batching can give on this machine, with no engine at all: transformers' own forward
   (`DynamicCache`, SDPA) decoding 8 rows of one length against 1 row, at the 8 prompts' mean context
   halfway through their 96 tokens; ideal batching (no padding, no prefill), so row 1, whose prompts
   differ in length and whose prefill is the same work either way, cannot reach it.
3. 8 samples of 64 tokens from a 512-token prompt (one request, `num_samples: 8`) against 8 separate
   requests sent at once on 8 sessions (target >= 3x). Under it, in process: a decode step of the 8
   samples against one of a single row at the same context, and what the row would give if the 8 rows
   cost one row's step (derived: the samples' time less 64 times the steps' difference); that is the
   most batching the samples could gain, since the separate requests are batched too.
4. Beam search, 4 beams and 64 tokens, against transformers' beam search on the same model (identical
   sequences checked first; target <= 0.9x its time), after a 32-token and a 512-token prompt (whose
   cache the beams share instead of copying and reordering it every step).
5. A short streamed request sent right behind an 1,800-token prompt: the time to its first token and
   the time to the long prompt's first token (its prefill's end); target: the short one first.
6. One session alone, decode ms/token over 128 tokens: this revision, and with `--baseline DIR` a
   checkout of another revision (e.g. the one before the batched engine) side by side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import NO_TARGET, Target, judged, print_table, ratio_spread, spread  # noqa: E402
from protocol.peer import Peer  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
LENGTHS = (16, 48, 96, 160, 240, 320, 416, 512)
SHORT_LENGTHS = (8, 12, 16, 24, 32, 48, 64, 96)  # chat-sized: prefill is a small part of the work
NEW_TOKENS = 96


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [ids(n, 100 + n) for n in LENGTHS]
SHORT_PROMPTS = [ids(n, 200 + n) for n in SHORT_LENGTHS]
SAMPLES_PROMPT, SAMPLE_TOKENS = ids(512, 7), 64
SYSTEM = ids(200, 55)  # a system prompt every chat of an app begins with
MID = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 12,
       "num_key_value_heads": 4}  # --model mid: the default model's other settings, wider and deeper


class Server:
    """A server of one checkout, with a clock on every message it sends."""

    def __init__(self, checkout: Path, threads: int, model: str = "default"):
        env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": str(threads)}
        self.peer = Peer([sys.executable, "-m", "sidecar", "--model", model, "--log-level", "ERROR"],
                         env=env, stderr=subprocess.DEVNULL, cwd=checkout)
        self.sessions = 0

    def open(self) -> str:
        self.sessions += 1
        name = f"b{self.sessions}"
        assert self.peer.call("open_session", session=name)["ok"]
        return name

    def close(self, name: str) -> None:
        self.peer.call("close_session", session=name)

    def run(self, requests: list[dict]) -> tuple[float, dict[int, float], dict[int, dict]]:
        """Sends every request at once; returns the time until the last reply, each request's first-event
        time (from the send), and the replies."""
        started = time.perf_counter()
        pending = {}
        for request in requests:
            rid = self.peer.next_id()
            pending[rid] = request
            self.peer.send({"id": rid, "op": "generate", **request})
        first, replies = {}, {}
        while len(replies) < len(pending):
            message = self.peer.read_message()
            rid = message.get("id")
            first.setdefault(rid, time.perf_counter() - started)
            if "event" not in message:
                replies[rid] = message
        for reply in replies.values():
            assert reply["ok"], reply
        return time.perf_counter() - started, first, replies

    def stop(self) -> None:
        self.peer.close()


def aggregate(server: Server, prompts: list[list[int]]) -> tuple[float, float]:
    """Tokens/s of 8 prompts at once on 8 sessions, and of the same 8 one at a time on one session each."""
    sessions = [server.open() for _ in prompts]
    requests = [{"session": s, "token_ids": p, "max_new_tokens": NEW_TOKENS, "eos_token_ids": []}
                for s, p in zip(sessions, prompts)]
    together, _, _ = server.run(requests)
    for s in sessions:
        server.close(s)
    sessions = [server.open() for _ in prompts]
    alone = sum(server.run([dict(r, session=s)])[0] for r, s in zip(requests, sessions))
    for s in sessions:
        server.close(s)
    tokens = len(prompts) * NEW_TOKENS
    return tokens / together, tokens / alone


def samples(server: Server) -> tuple[float, float]:
    """Seconds for 8 x 64 sampled tokens from one 512-token prompt: num_samples 8, and 8 separate requests."""
    prompt = SAMPLES_PROMPT
    one = server.open()
    n_samples, _, replies = server.run([{"session": one, "token_ids": prompt, "max_new_tokens": SAMPLE_TOKENS, "eos_token_ids": [],
                                         "strategy": "sample", "seed": 1, "num_samples": 8}])
    assert all(len(s["token_ids"]) == SAMPLE_TOKENS for r in replies.values() for s in r["result"]["sequences"])
    server.close(one)
    sessions = [server.open() for _ in range(8)]
    separate, _, _ = server.run([{"session": s, "token_ids": prompt, "max_new_tokens": SAMPLE_TOKENS, "eos_token_ids": [],
                                  "strategy": "sample", "seed": i} for i, s in enumerate(sessions)])
    for s in sessions:
        server.close(s)
    return n_samples, separate


def short_behind_long(server: Server) -> tuple[float, float]:
    """Time to the first token of a short streamed request sent right behind an 1,800-token prompt, and of that prompt."""
    long_session, short_session = server.open(), server.open()
    _, first, replies = server.run([
        {"session": long_session, "token_ids": ids(1800, 8), "max_new_tokens": 4, "eos_token_ids": [], "stream": True},
        {"session": short_session, "token_ids": ids(12, 9), "max_new_tokens": 4, "eos_token_ids": [], "stream": True},
    ])
    long_id, short_id = sorted(replies)
    server.close(long_session)
    server.close(short_session)
    return first[short_id], first[long_id]


def solo_decode(server: Server) -> float:
    """ms per token of one session alone, 128 greedy tokens after a 32-token prompt."""
    session = server.open()
    seconds, _, _ = server.run([{"session": session, "token_ids": ids(32, 5), "max_new_tokens": 128, "eos_token_ids": []}])
    server.close(session)
    return seconds / 128 * 1e3


def beams(engine, prompt: list[int], rounds: int = 5) -> tuple[float, float]:
    """Median seconds of our beam search and transformers' (4 beams, 64 tokens), alternating, over `rounds`;
    the sequences are checked identical first."""
    case = dict(num_beams=4, max_new_tokens=64, num_return_sequences=1)
    ours_s, theirs_s = [], []
    for _ in range(rounds):
        with engine.session() as session:
            started = time.perf_counter()
            ours = session.generate(token_ids=prompt, strategy="beam", eos_token_ids=[2], **case)
            ours_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        with torch.inference_mode():
            theirs = engine.model.generate(torch.tensor([prompt]), do_sample=False, eos_token_id=2, pad_token_id=0, **case)
        theirs_s.append(time.perf_counter() - started)
        expected = theirs[0, len(prompt):].tolist()
        assert ours.token_ids == expected[: len(ours.token_ids)], "beam search outputs differ: refusing to time them"
    return statistics.median(ours_s), statistics.median(theirs_s)


def decode_steps(engine, prompts: list[list[int]], steps: int = 16, system: list[int] | None = None) -> list[float]:
    """Seconds of each of `steps` engine ticks (one forward pass for every row) once all `prompts`, each on a
    session of its own, are past their prefill and decoding. With `system`, an idle session holds it first
    and the prompts begin with it: they continue its cache, as chats of one system prompt do."""
    host = engine.session()
    if system:
        host.generate(token_ids=system + [5], max_new_tokens=1, eos_token_ids=[])
    sessions = [engine.session() for _ in prompts]
    streams = [s.stream(token_ids=p, max_new_tokens=steps + 8, eos_token_ids=[]) for s, p in zip(sessions, prompts)]
    times = decoding_ticks(engine.scheduler, steps)
    for stream, session in zip(streams, sessions):
        stream.cancel()
        session.close()
    host.close()
    return times


def sample_steps(engine, prompt: list[int], samples: int, steps: int = 16) -> list[float]:
    """Seconds of each of `steps` engine ticks of one sampling generation of `samples` rows, past its prefill
    and the first 8 tokens (the context of the samples row halfway, for its 512-token prompt)."""
    with engine.session() as session:
        stream = session.stream(token_ids=prompt, strategy="sample", seed=1, num_samples=samples,
                                max_new_tokens=steps + 16, eos_token_ids=[])
        times = decoding_ticks(engine.scheduler, steps, skip=8)
        stream.cancel()
    return times


def decoding_ticks(scheduler, steps: int, skip: int = 0) -> list[float]:
    """Ticks until every generation is past its prefill and decoding, `skip` more, then returns the seconds
    of each of `steps` ticks."""
    while scheduler.waiting or any(run.prefilling or not run.rows for run in scheduler.running):
        scheduler.tick()
    for _ in range(skip):
        scheduler.tick()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        scheduler.tick()
        times.append(time.perf_counter() - started)
    return times


def engine_batching(engine, prompts: list[list[int]], system: list[int] | None = None) -> tuple[float, float]:
    """Median seconds of a decode step of 1 session (the middle prompt) and of all 8 together."""
    return alternating(lambda: decode_steps(engine, [prompts[len(prompts) // 2]], system=system),
                       lambda: decode_steps(engine, prompts, system=system))


def ideal_batching(model, context: int, steps: int = 16) -> tuple[float, float]:
    """Median seconds of one decode step of transformers' own forward at `context` tokens, 1 row and 8 rows
    (see the module docstring, item 2)."""
    from transformers import DynamicCache

    def step_times(rows: int) -> list[float]:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            token = model(torch.tensor([ids(context, 9)] * rows), cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            times = []
            for _ in range(steps):
                started = time.perf_counter()
                token = model(token, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                times.append(time.perf_counter() - started)
        return times

    return alternating(lambda: step_times(1), lambda: step_times(8))


def alternating(one, eight, rounds: int = 3) -> tuple[float, float]:
    """The medians of the step times `one()` and `eight()` return, called in turn `rounds` times each."""
    ones, eights = [], []
    for _ in range(rounds):
        ones += one()
        eights += eight()
    return statistics.median(ones), statistics.median(eights)


def transformers_batch(model_dir: Path) -> float:
    """Seconds for the 8 prompts x 96 tokens through transformers' `generate_batch` (its paged cache on CPU)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, attn_implementation="sdpa").eval()
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    started = time.perf_counter()
    outputs = model.generate_batch(inputs=PROMPTS, generation_config=config, progress_bar=False)
    seconds = time.perf_counter() - started
    assert all(len(o.generated_tokens) == NEW_TOKENS for o in outputs.values()), "generate_batch stopped early"
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one run, no transformers peer")
    parser.add_argument("--baseline", type=Path, help="a checkout of another revision: its solo decode side by side")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers' generate_batch (about 16 s a run)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server and of this process")
    parser.add_argument("--model", choices=("default", "mid"), default="default",
                        help="mid: the rows on a 50M-parameter random Llama (see above)")
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    torch.set_num_threads(args.threads)
    from sidecar import Engine
    from sidecar.default_model import CONFIG, materialise

    model_dir = materialise(config={**CONFIG, **MID}, name="mid") if args.model == "mid" else materialise()
    engine = Engine.load(model_dir)
    server = Server(HERE, args.threads, str(model_dir))
    baseline = Server(args.baseline.resolve(), args.threads, str(model_dir)) if args.baseline else None
    got: dict[str, list[float]] = {}

    def record(name, value):
        got.setdefault(name, []).append(value)

    beam_prompts = {"beam": ids(32, 6), "long_beam": ids(512, 6)}
    for prompt in beam_prompts.values():
        beams(engine, prompt, rounds=1)  # warm-up (and the identity check)
    for run in range(runs):
        together, alone = aggregate(server, PROMPTS)
        record("together", together)
        record("alone", alone)
        together, alone = aggregate(server, SHORT_PROMPTS)
        record("short_together", together)
        record("short_alone", alone)
        if not (args.quick or args.no_peer):
            record("peer", transformers_batch(model_dir))
        for name, prompts in (("", PROMPTS), ("short_", SHORT_PROMPTS)):
            one, eight = engine_batching(engine, prompts)
            record(f"{name}decode", 8 * one / eight)
            one, eight = ideal_batching(engine.model, round(statistics.mean(map(len, prompts))) + NEW_TOKENS // 2)
            record(f"{name}bound", 8 * one / eight)
        one, eight = engine_batching(engine, [SYSTEM + p for p in SHORT_PROMPTS], system=SYSTEM)
        record("system_decode", 8 * one / eight)
        n_samples, separate = samples(server)
        record("n_samples", n_samples)
        record("separate", separate)
        one, eight = alternating(lambda: sample_steps(engine, SAMPLES_PROMPT, 1), lambda: sample_steps(engine, SAMPLES_PROMPT, 8))
        record("sample_step_1", one)
        record("sample_step_8", eight)
        record("samples_ceiling", separate / (n_samples - SAMPLE_TOKENS * (eight - one)))
        for name, prompt in beam_prompts.items():
            ours, theirs = beams(engine, prompt)
            record(f"{name}_ours", ours)
            record(f"{name}_theirs", theirs)
        short, long = short_behind_long(server)
        record("short_first", short)
        record("long_first", long)
        record("solo", solo_decode(server))
        if baseline:
            record("solo_baseline", solo_decode(baseline))
        print(f"run {run + 1}/{runs} done", file=sys.stderr)
    server.stop()
    if baseline:
        baseline.stop()

    med = {name: statistics.median(values) for name, values in got.items()}
    tokens = len(PROMPTS) * NEW_TOKENS
    def rate(name):
        return f"{med[name]:.0f} [{min(got[name]):.0f}-{max(got[name]):.0f}]"

    rows = [
        [f"8 sessions at once, prompts of {LENGTHS[0]}-{LENGTHS[-1]}, 96 tokens each: tok/s", rate("together"),
         rate("alone") + " (one at a time)", f"{med['together'] / med['alone']:.2f}x",
         *judged(med["together"] / med["alone"], Target(4, at_least=True, unit="x"))],
        [f"the same with chat-sized prompts of {SHORT_LENGTHS[0]}-{SHORT_LENGTHS[-1]}: tok/s", rate("short_together"),
         rate("short_alone") + " (one at a time)", f"{med['short_together'] / med['short_alone']:.2f}x",
         *judged(med["short_together"] / med["short_alone"], Target(4, at_least=True, unit="x"))],
    ]
    for at, name, prompts in ((1, "", PROMPTS), (3, "short_", SHORT_PROMPTS)):  # under the row of its prompts
        context = round(statistics.mean(map(len, prompts))) + NEW_TOKENS // 2
        rows.insert(at, [f"  decode steps only, in process: 8 sessions of prompts {len(prompts[0])}-{len(prompts[-1])} "
                     f"vs the middle one alone: tok/s", ratio_spread(got[f"{name}decode"]),
                     ratio_spread(got[f"{name}bound"]) + f" (bound: transformers, 8 equal rows of {context} tokens)",
                     f"{med[f'{name}decode'] / med[f'{name}bound']:.2f} of the bound", *NO_TARGET])
    rows.insert(4, [f"  the same, each chat continuing one {len(SYSTEM)}-token system prompt (its cache shared): tok/s",
                    ratio_spread(got["system_decode"]), "-", "-", *NO_TARGET])
    if "peer" in got:
        rows.append(["the same 8 through transformers' generate_batch (peer)", spread(got["peer"], scale=1, unit="s"),
                     f"{tokens / med['peer']:.0f} tok/s", f"{med['together'] * med['peer'] / tokens:.1f}x ours", *NO_TARGET])
    rows += [
        ["8 samples x 64 tokens, 512-token prompt: num_samples 8 vs 8 requests", spread(got["n_samples"], scale=1, unit="s"),
         spread(got["separate"], scale=1, unit="s"), f"{med['separate'] / med['n_samples']:.2f}x",
         *judged(med["separate"] / med["n_samples"], Target(3, at_least=True, unit="x"))],
        ["  decode steps only, in process: 8 samples vs 1 row, ms a step", spread(got["sample_step_8"], scale=1e3, unit="ms"),
         spread(got["sample_step_1"], scale=1e3, unit="ms"), f"{med['sample_step_8'] / med['sample_step_1']:.2f}x",
         *NO_TARGET],
        ["  the row if 8 samples cost 1 row a step (derived: its time less 64 x the steps' difference)",
         ratio_spread(got["samples_ceiling"]), "-", f"{med['samples_ceiling']:.2f}x", *NO_TARGET],
        *[[f"beam search, 4 beams x 64 tokens, {label} prompt (median of 5 alternations a run): ours vs transformers",
           spread(got[f"{name}_ours"], scale=1, unit="s"), spread(got[f"{name}_theirs"], scale=1, unit="s"),
           f"{med[f'{name}_ours'] / med[f'{name}_theirs']:.2f}", *judged(med[f"{name}_ours"] / med[f"{name}_theirs"], Target(0.9))]
          for name, label in (("beam", "32-token"), ("long_beam", "512-token"))],
        ["short streamed request behind an 1,800-token prompt: first tokens (short, long)", spread(got["short_first"]),
         spread(got["long_first"]), f"{med['long_first'] / med['short_first']:.1f}x sooner",
         "short first", "met" if all(s < l for s, l in zip(got["short_first"], got["long_first"])) else "MISSED"],
        ["one session alone: decode ms/token (128 tokens)", spread(got["solo"], scale=1, unit="ms"),
         spread(got["solo_baseline"], scale=1, unit="ms") + " (baseline)" if baseline else "-",
         f"{med['solo'] / med['solo_baseline']:.2f}" if baseline else "-",
         *(judged(med["solo"] / med["solo_baseline"], Target(1.05)) if baseline else NO_TARGET)],
    ]
    threads = f"{args.threads} thread" + ("s" if args.threads > 1 else "")
    model = "default model" if args.model == "default" else "MID (50M parameters, random)"
    print_table(f"Batched engine, {model}, CPU, {threads}, median of {runs} run(s) [min-max]",
                ["measure", "ours", "compared with", "ratio", "target", "verdict"], rows)


if __name__ == "__main__":
    main()
