"""Structured generation, side by side in one run: what a JSON-schema constraint costs per step and to compile,
in ours (on its automaton, and on llguidance's JSON grammar, which runs the schemas outlines-core would not
compile exactly), llguidance, outlines and xgrammar, and JSON-constrained generation on the default model.

    python bench/structured.py [--quick] [--runs 5] [--walks 64] [--out bench/out]

Two vocabularies: a 32k byte-level BPE trained like the default model's own 1k one (same trainer,
pre-tokenizer, decoder and special tokens as sidecar/default_model/train_tokenizer.py) on the Python
standard library's sources, cached in --out; and the default model's 1k tokenizer. One schema, SCHEMA:
nested objects, an array with maxItems, an enum, string lengths and a pattern, required and optional fields.

1. Walks: one seeded random walk through the schema per row. At each step the row takes a random token
   that all the backends allow (never the end of sequence while anything else is allowed), so every
   backend replays the very same walks; the masks are compared with ours on the way. A walk ends where
   its document is complete.
2. Per-step cost per row, batch 1 and 8 (8 walks of about one length side by side, cut to the shortest):
   a step advances every row by its last token and masks the logits. Ours: `chain.process` of the bound chain. llguidance:
   consume_token, fill_next_token_bitmask (batch 8: fill_next_token_bitmask_par on an LLExecutor),
   apply_token_bitmask_inplace. outlines: its own transformers logits processor. xgrammar: accept_token,
   fill_next_token_bitmask (batch 8: its BatchGrammarMatcher), apply_token_bitmask_inplace. Each backend's
   per-generation set-up and first mask are not timed. Median and p99 over every step of every run, with
   the [min-max] of the runs' own. Target: ours <= 30 us a row, and below llguidance in every run.
3. Compile time, cold, of what each backend does per schema (its per-model tokenizer set-up apart): ours
   is configure + bind with the compile cache and the remembered schema checks cleared. Target: no slower
   than the fastest other. Ours and llguidance make each state's mask the first time a walk reaches it,
   inside the timed steps.
4. End to end on the default model: greedy JSON-constrained generation against unconstrained generation of
   the same number of tokens (max_new_tokens = the constrained length, eos_token_ids=[]), tokens/s of whole
   calls; the first constrained call, which compiles, reported apart. Target >= 0.9x.

Each run goes through every backend in turn (the order rotated run by run), walk group by walk group, so a
noisy moment hits them all; one torch thread, as in the other benchmarks. The default (5 runs, 64 walks)
takes about two minutes here, a third of it compiling ours on the 32k vocabulary; --quick (1 run, 16 walks)
under one. Output: the tables, also in OUT/structured.txt, and OUT/structured.png.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import NO_TARGET, Target, judged, percentile, print_table, spread, us  # noqa: E402
from processors import Chain, Context, JsonSchema, Regex, configure  # noqa: E402
from processors.structured import Vocabulary  # noqa: E402
from processors.structured import compile as structured_compile  # noqa: E402
from processors.structured import constraints, grammar, json_schema  # noqa: E402
from processors.structured.grammar import bind_llguidance  # noqa: E402
from sidecar.default_model import train_tokenizer as recipe  # noqa: E402

DEFAULT_TOKENIZER = Path(recipe.__file__).parent / "tokenizer.json"
BATCHES = (1, 8)
TARGET_US = 30.0

SCHEMA = {
    "type": "object",
    "properties": {
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "name": {"type": "string", "maxLength": 24},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["address", "name", "role"],
    "additionalProperties": False,
}
SCHEMA_TEXT = json.dumps(SCHEMA)


def trained_32k(out: Path) -> Path:
    """The 32k tokenizer, trained once (seconds) and cached: the default model's recipe on a bigger corpus."""
    path = out / "structured_tokenizer_32k.json"
    if path.exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def corpus():
        for name in sorted(glob.glob(f"{sysconfig.get_paths()['stdlib']}/**/*.py", recursive=True)):
            if "site-packages" in name:
                continue
            try:
                yield Path(name).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32000, special_tokens=recipe.SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def hf_tokenizer(path: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="</s>", bos_token="<s>", pad_token="<pad>")


class Backend:
    """One constraint library behind one interface. `setup_s`: its per-model set-up (tokenizer tables), once.

    `compile()` is what it does per schema; `start(rows, logits, steps)` begins a generation and returns the
    first masked logits (untimed); `prepare(tokens, logits)` returns the timed step: advance every row by
    `tokens` (int64 [rows]) and return the masked logits."""

    name: str
    setup_s: float


def forget_checks() -> None:
    """Clears what is remembered per schema text (its checks, backend, llguidance grammar and start matcher),
    so that a compile timed cold checks the schema as a new one."""
    for cached in (json_schema._check_schema, constraints._validate_grammar, json_schema.dfa_obstacle_of,
                   json_schema.llguidance_grammar):
        cached.cache_clear()
    grammar._started.clear()


class Ours(Backend):
    name = "ours"

    def __init__(self, tokenizer, size: int):
        started = time.perf_counter()
        self.vocabulary = Vocabulary.from_tokenizer(tokenizer, size=size)
        # the fork server's start and its trie of this vocabulary, once per process and vocabulary
        Chain([configure(Regex, pattern="a")]).bind(self.vocabulary, eos_token_ids=[tokenizer.eos_token_id])
        self.setup_s = time.perf_counter() - started
        self.size, self.eos = size, tokenizer.eos_token_id

    def compile(self):
        structured_compile._cache.clear()
        forget_checks()
        self.chain = Chain([configure(JsonSchema, schema=SCHEMA)]).bind(self.vocabulary, eos_token_ids=[self.eos])

    def start(self, rows, logits, steps):
        self.sequence = torch.zeros(rows, steps + 2, dtype=torch.long)
        self.length = 1
        context = Context(self.sequence, 1, 1, self.size)
        self.states = self.chain.init(context)
        self.states, out = self.chain.process(self.states, logits, context)
        return out

    def prepare(self, tokens, logits):
        self.sequence[:, self.length] = tokens
        self.length += 1
        context = Context(self.sequence, self.length, 1, self.size)

        def step():
            self.states, out = self.chain.process(self.states, logits, context)
            return out

        return step


class OursOnLLGuidance(Ours):
    """Ours with the schema run on llguidance's JSON grammar, as a schema outlines-core would not compile
    exactly is: the same schema, so its step compares with ours on the automaton and with llguidance's own."""

    name = "ours, llguidance backend"

    def compile(self):
        forget_checks()
        constraint = configure(JsonSchema, schema=SCHEMA)
        self.chain = Chain([bind_llguidance(constraint, json_schema.llguidance_grammar(constraint.schema), self.vocabulary,
                                            [self.eos], "cpu")])


class InPlace(Backend):
    """A backend that masks logits in place: each step gets its own copy of them (copied untimed)."""

    def work(self, logits):
        if getattr(self, "buffer", None) is None or self.buffer.shape != logits.shape:
            self.buffer = torch.empty_like(logits)
        return self.buffer.copy_(logits)


class Matchers(InPlace):
    """A backend with one matcher per row, moved token by token, whose masks go through a bitmask."""

    def start(self, rows, logits, steps):
        self.matchers = [self.new_matcher() for _ in range(rows)]
        self.pairs = [(m, i) for i, m in enumerate(self.matchers)]  # each matcher with its row
        self.bitmask = self.allocate(rows)
        return self.mask(self.work(logits))

    def prepare(self, tokens, logits):
        work = self.work(logits)

        def step():
            for matcher, token in zip(self.matchers, tokens.tolist()):
                self.consume(matcher, token)
            return self.mask(work)

        return step


class LLGuidance(Matchers):
    name = "llguidance"

    def __init__(self, tokenizer, size: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.kernels = llguidance, llguidance.torch
        started = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=size)
        self.setup_s = time.perf_counter() - started
        self.size, self.executor = size, llguidance.LLExecutor()

    def compile(self):
        self.grammar = self.llg.LLMatcher.grammar_from_json_schema(SCHEMA)
        matcher = self.llg.LLMatcher(self.tokenizer, self.grammar)
        assert not matcher.is_error(), matcher.get_error()

    def new_matcher(self):
        return self.llg.LLMatcher(self.tokenizer, self.grammar)

    def allocate(self, rows):
        return self.kernels.allocate_token_bitmask(rows, self.size)

    def consume(self, matcher, token):
        matcher.consume_token(token)

    def mask(self, logits):
        if len(self.matchers) == 1:
            self.kernels.fill_next_token_bitmask(self.matchers[0], self.bitmask, 0)
        else:
            self.kernels.fill_next_token_bitmask_par(self.executor, self.pairs, self.bitmask)
        self.kernels.apply_token_bitmask_inplace(logits, self.bitmask)
        return logits


class Outlines(InPlace):
    """outlines' own logits processor for transformers (`OutlinesCoreLogitsProcessor`), on outlines' own
    vocabulary and index, built as its `OutlinesCoreBackend` builds them."""

    name = "outlines"

    def __init__(self, tokenizer, size: int):
        from outlines.backends.outlines_core import OutlinesCoreBackend
        from outlines.models.transformers import TransformerTokenizer

        started = time.perf_counter()
        self.vocabulary = OutlinesCoreBackend.create_outlines_core_vocabulary(
            tokenizer.get_vocab(), tokenizer.eos_token_id, tokenizer.eos_token,
            TransformerTokenizer(tokenizer).convert_token_to_string)
        self.setup_s = time.perf_counter() - started

    def compile(self):
        from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        self.index = Index(build_regex_from_schema(SCHEMA_TEXT), self.vocabulary)
        self.processor_class = OutlinesCoreLogitsProcessor

    def start(self, rows, logits, steps):
        self.processor = self.processor_class(self.index, "torch")
        self.sequence = torch.zeros(rows, steps + 2, dtype=torch.long)
        self.length = 1
        return self.processor(self.sequence[:, :1], self.work(logits))

    def prepare(self, tokens, logits):
        self.sequence[:, self.length] = tokens
        self.length += 1
        ids, work = self.sequence[:, : self.length], self.work(logits)
        return lambda: self.processor(ids, work)


class XGrammar(Matchers):
    name = "xgrammar"

    def __init__(self, tokenizer, size: int):
        import xgrammar

        self.xgr = xgrammar
        started = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=size, stop_token_ids=[tokenizer.eos_token_id])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.setup_s = time.perf_counter() - started
        self.size, self.batch = size, xgrammar.BatchGrammarMatcher()

    def compile(self):
        self.compiled = self.compiler.compile_json_schema(SCHEMA_TEXT)

    def new_matcher(self):
        return self.xgr.GrammarMatcher(self.compiled)

    def allocate(self, rows):
        return self.xgr.allocate_token_bitmask(rows, self.size)

    def consume(self, matcher, token):
        matcher.accept_token(token)

    def mask(self, logits):
        if len(self.matchers) == 1:
            self.matchers[0].fill_next_token_bitmask(self.bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(self.matchers, self.bitmask)
        self.xgr.apply_token_bitmask_inplace(logits, self.bitmask)
        return logits


BACKENDS = (Ours, OursOnLLGuidance, LLGuidance, Outlines, XGrammar)


def walk(backends: list[Backend], rng: np.random.Generator, size: int, eos: int, agreement: dict) -> list[int]:
    """One random walk every backend allows. Per backend and step, `agreement` gets whether its mask is
    exactly ours and whether it allows the end of sequence (ours is the first backend)."""
    flat = torch.zeros(1, size)
    allowed = [b.start(1, flat, 1024)[0].isfinite() for b in backends]
    tokens = []
    while True:
        for backend, mask in zip(backends, allowed):
            agreement.setdefault(backend.name, []).append((bool(torch.equal(mask, allowed[0])), bool(mask[eos])))
        common = torch.stack(allowed).all(0)
        common[eos] = False
        candidates = common.nonzero().squeeze(1)
        if len(candidates) == 0:
            return tokens
        token = int(candidates[rng.integers(len(candidates))])
        tokens.append(token)
        allowed = [b.prepare(torch.tensor([token]), flat)()[0].isfinite() for b in backends]


def replay(backend: Backend, group: list[list[int]], logits: torch.Tensor) -> list[float]:
    """Seconds per row of every step of `group`'s walks side by side (cut to the shortest)."""
    steps = min(len(w) for w in group)
    tokens = torch.tensor([w[:steps] for w in group], dtype=torch.long).T.contiguous()
    backend.start(len(group), logits, steps)
    times = []
    for k in range(steps):
        step = backend.prepare(tokens[k], logits)
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) / len(group))
    return times


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def per_step_and_compile(label: str, path: Path, runs: int, walks: int):
    """Walks for one vocabulary, then `runs` rounds of cold compiles and replays; returns the samples."""
    tokenizer = hf_tokenizer(path)
    size, eos = len(tokenizer), tokenizer.eos_token_id
    backends = [cls(tokenizer, size) for cls in BACKENDS]
    for backend in backends:
        backend.compile()
    rng = np.random.default_rng(0)
    agreement: dict[str, list[bool]] = {}
    paths = [walk(backends, rng, size, eos, agreement) for _ in range(walks)]
    logits = {batch: torch.randn(batch, size, generator=torch.Generator().manual_seed(batch)) for batch in BATCHES}
    by_length = sorted(paths, key=len)  # side by side with walks of about their length: less is cut
    groups = {1: [[w] for w in paths], 8: [by_length[i : i + 8] for i in range(0, walks - 7, 8)]}
    for backend in backends:  # warm-up: llguidance's mask kernel compiles itself (torch.compile) per shape
        for batch in BATCHES:
            replay(backend, groups[batch][0], logits[batch])
    steps: dict[tuple, list[list[float]]] = {}
    compiles: dict[str, list[float]] = {}
    for run in range(runs):
        order = backends[run % len(backends):] + backends[: run % len(backends)]
        for backend in order:
            compiles.setdefault(backend.name, []).append(timed(backend.compile))
        for batch in BATCHES:
            samples = {b.name: [] for b in backends}
            for group in groups[batch]:
                for backend in order:
                    samples[backend.name] += replay(backend, group, logits[batch])
            for name, values in samples.items():
                steps.setdefault((batch, name), []).append(values)
        print(f"{label}: run {run + 1}/{runs} done", file=sys.stderr)
    lengths = [len(w) for w in paths]
    return {"label": label, "size": size, "backends": backends, "steps": steps, "compiles": compiles,
            "agreement": agreement, "lengths": lengths, "group_steps": [min(len(w) for w in g) for g in groups[8]]}


def step_rows(result) -> list[list[object]]:
    def run_range(runs, statistic):
        values = [statistic(run) for run in runs]
        return f"[{min(values) * 1e6:.1f}-{max(values) * 1e6:.1f}]"

    def p99(values):
        return percentile(values, 0.99)

    rows = []
    for batch in BATCHES:
        ours, llg = result["steps"][(batch, "ours")], result["steps"][(batch, "llguidance")]
        ours_median = statistics.median(v for run in ours for v in run)
        for backend in result["backends"]:
            runs = result["steps"][(batch, backend.name)]
            pooled = [v for run in runs for v in run]
            median = statistics.median(pooled)
            cells = [result["label"], batch, backend.name, us(median), run_range(runs, statistics.median),
                     us(p99(pooled)), run_range(runs, p99), f"{median / ours_median:.2f}x"]
            if backend.name == "ours":
                beaten = sum(statistics.median(o) < statistics.median(t) for o, t in zip(ours, llg))
                met = median * 1e6 <= TARGET_US and beaten == len(ours)
                cells += [f"<= {TARGET_US:g} us & < llguidance ({beaten}/{len(ours)} runs)", "met" if met else "MISSED"]
            else:
                cells += NO_TARGET
            rows.append(cells)
    return rows


def compile_rows(result) -> list[list[object]]:
    medians = {name: statistics.median(values) for name, values in result["compiles"].items()}
    fastest = min(v for name, v in medians.items() if not name.startswith("ours"))
    rows = []
    for backend in result["backends"]:
        values = result["compiles"][backend.name]
        cells = [result["label"], backend.name, spread(values), f"{backend.setup_s * 1e3:.1f} ms"]
        if backend.name == "ours":
            target = Target(round(fastest * 1e3, 2), unit=" ms")
            cells += [f"{medians['ours'] / fastest:.1f}x the fastest", *judged(medians["ours"] * 1e3, target)]
        else:
            cells += ["", *NO_TARGET]
        rows.append(cells)
    return rows


def agreement_rows(result) -> list[list[object]]:
    lengths, ours = result["lengths"], result["agreement"]["ours"]
    rows = []
    for name, steps in result["agreement"].items():
        if name == "ours":
            continue
        same = sum(s for s, _ in steps)
        ours_only = sum(o and not t for (_, o), (_, t) in zip(ours, steps))
        theirs_only = sum(t and not o for (_, o), (_, t) in zip(ours, steps))
        rows.append([result["label"], name, f"{100 * same / len(steps):.0f}% of {len(steps)} steps",
                     f"{ours_only} / {theirs_only}", f"{statistics.median(lengths)} [{min(lengths)}-{max(lengths)}]",
                     f"{sum(result['group_steps'])}"])
    return rows


PROMPTS = ["Describe a user as JSON:", "Profile of an editor, in JSON.", "A guest from Lyon:", "The admin account record:"]


def end_to_end(runs: int, rounds: int):
    """Greedy JSON-constrained calls against unconstrained ones of the same lengths, alternating call by call,
    `rounds` times over the prompts a run; tokens/s of each run."""
    from sidecar import Engine

    engine = Engine.load()
    constraint = configure(JsonSchema, schema=SCHEMA)

    def constrained(prompt):
        with engine.session() as session:
            return session.generate(prompt, max_new_tokens=256, processors=[constraint]).token_ids

    def free(prompt, n):
        with engine.session() as session:
            return session.generate(prompt, max_new_tokens=n, eos_token_ids=[]).token_ids

    free(PROMPTS[0], 16)  # the model's own first call apart
    structured_compile._cache.clear()
    first = timed(lambda: constrained(PROMPTS[0]))
    lengths = {p: len(constrained(p)) for p in PROMPTS}
    for p in PROMPTS:  # warm-up, and the check that both sides generate the same number of tokens
        assert len(free(p, lengths[p])) == lengths[p]
    got = {"json": [], "free": []}
    for run in range(runs):
        seconds = {"json": 0.0, "free": 0.0}
        for i, p in enumerate(PROMPTS * rounds):
            sides = (("json", lambda: constrained(p)), ("free", lambda: free(p, lengths[p])))
            for side, call in sides if (run + i) % 2 == 0 else reversed(sides):
                seconds[side] += timed(call)
        for side in got:
            got[side].append(rounds * sum(lengths.values()) / seconds[side])
    return first, lengths, got


def draw(results, path: Path) -> None:
    """Per-row median step cost of each backend, by vocabulary and batch, on a log scale (they differ tenfold)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [(r, batch) for r in results for batch in BATCHES]
    names = [b.name for b in results[0]["backends"]]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        medians = [statistics.median(v for run in r["steps"][(batch, name)] for v in run) * 1e6 for r, batch in cases]
        ax.bar([i + j * width for i in range(len(cases))], medians, width, label=name)
    ax.axhline(TARGET_US, color="black", linestyle="--", linewidth=1, label=f"target {TARGET_US:g} us")
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(cases))])
    ax.set_xticklabels([f"{r['label']}, batch {batch}" for r, batch in cases])
    ax.set_yscale("log")
    ax.set_ylabel("median step cost per row (us, log scale)")
    ax.set_title("JSON-schema constraint: advance + mask per decode step (CPU, 1 thread)")
    ax.grid(alpha=0.3, axis="y", which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="1 run and 16 walks")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--walks", type=int, help="random walks per vocabulary (default 64, a multiple of 8)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "out"))
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    walks = args.walks or (16 if args.quick else 64)
    out = Path(args.out)
    torch.set_num_threads(1)

    results = [per_step_and_compile("32k BPE", trained_32k(out), runs, walks),
               per_step_and_compile("default 1k", DEFAULT_TOKENIZER, runs, walks)]
    first, lengths, e2e = end_to_end(runs, 1 if args.quick else 3)

    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        print_table(f"JSON schema, per decode step (advance + mask), per row: median and p99 over every step of "
                    f"{runs} run(s), [min-max] of the runs'; 1 torch thread",
                    ["vocab", "batch", "backend", "median", "run range", "p99", "run range", "vs ours", "target", "verdict"],
                    [row for r in results for row in step_rows(r)])
        print_table(f"Compile, cold, per schema: median of {runs} run(s) [min-max]",
                    ["vocab", "backend", "compile", "per-model set-up (once)", "ratio", "target", "verdict"],
                    [row for r in results for row in compile_rows(r)])
        print("note: llguidance compiles lazily: its matcher builds the lexer up front and each mask as it is "
              "needed, so part of its compiling is inside its per-step times (and in its untimed first mask). "
              "So does ours over both vocabularies (every byte is a token): its compile makes the byte automaton, "
              "and the first step into each state walks that state's tokens (its p99).")
        print("note: xgrammar compiles with its default max_threads=8 on this machine's "
              f"{torch.multiprocessing.cpu_count()} cores; ours compiles in one child (forked from its fork server), single-threaded.")
        print_table("Masks along the walks, compared with ours (the walks keep to tokens all the backends allow)",
                    ["vocab", "backend", "mask identical to ours", "steps allowing EOS: ours only / theirs only",
                     "walk length (tokens)", "batch-8 steps a run"],
                    [row for r in results for row in agreement_rows(r)])
        med = {side: statistics.median(values) for side, values in e2e.items()}
        ratio = med["json"] / med["free"]
        extra_ms = (1 / med["json"] - 1 / med["free"]) * 1e3
        print_table(f"End to end, default model, greedy, {len(PROMPTS)} prompts of {sum(lengths.values())} new "
                    f"tokens in all ({', '.join(map(str, lengths.values()))}), each call alternating with its peer, "
                    f"median of {runs} run(s) [min-max]",
                    ["measure", "value", "ratio", "target", "verdict"], [
            ["JSON-constrained tokens/s", spread(e2e["json"], scale=1, unit="tok/s", digits=0), f"{ratio:.2f}x",
             *judged(ratio, Target(0.9, at_least=True, unit="x"))],
            ["unconstrained tokens/s (same lengths, eos_token_ids=[])", spread(e2e["free"], scale=1, unit="tok/s", digits=0),
             "1.00x", *NO_TARGET],
            ["the constraint's cost per token", f"{extra_ms:.3f} ms", "", *NO_TARGET],
            ["first constrained call (compiles the schema)", f"{first * 1e3:.0f} ms", "", *NO_TARGET],
        ])
    print(report.getvalue())
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.txt").write_text(report.getvalue())
    draw(results, out / "structured.png")
    print(f"wrote {out / 'structured.txt'} and {out / 'structured.png'}")


if __name__ == "__main__":
    main()
