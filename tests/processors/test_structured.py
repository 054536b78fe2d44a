"""Constraints against independent references: the `regex` module's partial fullmatch for the masks of
regular constraints, a plain-Python walk for user automata, a recursive checker for a context-free grammar,
and the tokenizer's own encoding for the bytes of each token."""

import gc
import itertools
import json
import os
import random
import re
import string
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import regex
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import PreTrainedTokenizerFast

import processors as P
from processors import Chain, Context, configure
from processors.structured import AutomatonProcessor, Choice, Dfa, Grammar, GrammarProcessor, JsonSchema, Regex, Vocabulary
from processors.structured import anchors, schema_fit
from processors.structured import automaton as automaton_module
from processors.structured import build as build_module
from processors.structured import grammar as grammar_module
from processors.structured import compile as structured_compile
from processors.structured import forkserver as forkserver_module
from processors.structured.automaton import TokenAutomaton
from processors.structured.lazy import LazyAutomaton
from processors.structured.trie import TokenTrie

ROOT = Path(__file__).resolve().parents[2]
EOS = 2
NEG_INF = float("-inf")


@pytest.fixture(scope="module")
def tokenizer():
    return PreTrainedTokenizerFast(tokenizer_file=str(ROOT / "sidecar/default_model/tokenizer.json"),
                                   eos_token="</s>", bos_token="<s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return Vocabulary.from_tokenizer(tokenizer, 1024)


class ForksHere:
    """Stands in for the fork server by forking this process, so that a test's patches of the child's
    code (`forkserver.compile_child` and what it calls) hold in the child."""

    def __init__(self):
        self.pids = []

    def fork(self, source, vocabulary, timeout_s, write_fd, check):
        trie = TokenTrie.build(vocabulary.text_tokens())
        here = os.getpid()
        pid = os.fork()
        if pid == 0:
            forkserver_module.compile_child(write_fd, source, trie, vocabulary.size, timeout_s, here)
        self.pids.append(pid)
        return forkserver_module.Child(pid, server=self)

    def wait(self, timeout):  # the server of its children: this process, running
        raise subprocess.TimeoutExpired("pytest", timeout)


@pytest.fixture
def forks_here(monkeypatch):
    """Compiles in children of this process, nothing cached or remembered yet."""
    from collections import OrderedDict

    from processors.structured import compile as structured_compile

    here = ForksHere()
    monkeypatch.setattr(structured_compile, "_forkserver", here)
    monkeypatch.setattr(structured_compile, "_cache", OrderedDict())
    monkeypatch.setattr(structured_compile, "_failures", OrderedDict())
    yield here
    for pid in here.pids:  # each has exited or was killed: reaped here, as the fork server's kernel setting does
        os.waitpid(pid, 0)


@pytest.fixture(params=["lazy", "ahead"])
def compiled(request, monkeypatch):
    """How regular constraints compile: lazily (every byte is a token of the test vocabulary), or ahead,
    in children forked from here with that check patched off. Yields the automaton's class."""
    if request.param == "ahead":
        request.getfixturevalue("forks_here")
        monkeypatch.setattr(build_module, "covers_every_byte", lambda trie: False)
        return TokenAutomaton
    return LazyAutomaton


def sentencepiece_tokenizer():
    """A Llama-style tokenizer: "▁" for spaces and <0xNN> byte fallback, trained on the repo's corpus."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train([str(ROOT / "sidecar/default_model/corpus.txt")],
              trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    # the byte tokens are ordinary entries of the vocabulary, not special tokens, as in Llama's tokenizer
    spec = json.loads(tok.to_str())
    table = spec["model"]["vocab"]
    for byte in range(256):
        table.setdefault(f"<0x{byte:02X}>", len(table))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="</s>",
                                   bos_token="<s>", unk_token="<unk>")


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_the_llguidance_view_made_from_our_bytes_masks_as_llguidances_own_reading(kind, tokenizer):
    """llguidance reads most tokenizers itself (faster); the others get a view made from the engine's token
    bytes, which must mask as llguidance's own reading does where both apply: along random walks of a
    JSON grammar, every mask equal, and so the text llguidance forces."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy as llg

    from processors.structured.llguidance_view import BytesView

    tok = tokenizer if kind == "byte_level" else sentencepiece_tokenizer()
    vocab = Vocabulary.from_tokenizer(tok)
    own = llguidance.hf.from_tokenizer(tok, n_vocab=vocab.size)
    ours = llguidance.LLTokenizer(llguidance.TokenizerWrapper(BytesView(vocab)), n_vocab=vocab.size)
    grammar = llguidance.grammar_from("json_schema", json.dumps(NESTED))
    rng, steps = random.Random(5), 0
    for _ in range(12):
        matchers = [llguidance.LLMatcher(own, grammar), llguidance.LLMatcher(ours, grammar)]
        masks = [llg.allocate_token_bitmask(1, vocab.size) for _ in matchers]
        for _ in range(40):
            for matcher, mask in zip(matchers, masks):
                llg.fill_next_token_bitmask(matcher, mask, 0)
            assert np.array_equal(masks[0], masks[1]), steps
            allowed = np.flatnonzero(np.unpackbits(masks[0].view(np.uint8), bitorder="little")[: vocab.size])
            if matchers[0].is_accepting() or not len(allowed):
                break
            token = int(rng.choice(list(allowed)))
            assert all(matcher.consume_token(token) for matcher in matchers)
            steps += 1
    assert steps > 100


TEXTS = ["Hello world", "  two  spaces", "naïve café — 東京 🙂", "tabs\tand\nnewlines", "Ġ is not a space"]


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_token_bytes_spell_exactly_what_the_tokenizer_encoded(kind, tokenizer):
    tok = tokenizer if kind == "byte_level" else sentencepiece_tokenizer()
    vocab = Vocabulary.from_tokenizer(tok)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        written = b"".join(vocab.token_bytes[i] for i in ids)
        # SentencePiece's normaliser writes a space before the text ("▁Hello"), which its decoder strips
        assert written == (text if kind == "byte_level" else " " + text).encode(), (kind, text, ids)
    assert vocab.token_bytes[tok.eos_token_id] is None
    assert vocab.fingerprint != Vocabulary(vocab.token_bytes[:-1] + (b"x",)).fingerprint


def allowed(bound: AutomatonProcessor, states: torch.Tensor) -> list[set[int]]:
    return [set(row.nonzero().flatten().tolist()) for row in bound.masks.allowed(states)]


def whole_characters(vocab: Vocabulary) -> dict[int, str]:
    """The tokens that write whole characters (the reference below works on text, not bytes)."""
    out = {}
    for token_id, token in enumerate(vocab.token_bytes):
        try:
            out[token_id] = token.decode("utf-8")
        except (AttributeError, UnicodeDecodeError):
            pass
    return out


def reference_allowed(pattern: str, text: str, pieces: dict[int, str]) -> set[int]:
    """Token t may come next iff text + t can still be completed into a full match; EOS iff text is one."""
    out = {EOS} if regex.fullmatch(pattern, text) else set()
    return out | {t for t, piece in pieces.items() if regex.fullmatch(pattern, text + piece, partial=True)}


PATTERNS = [
    r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)",
    r"(0|[1-9][0-9]?|1[0-9]{2}|2[0-4][0-9]|25[0-5])",
    r"(no|none|nonetheless)",  # an earlier alternative is a prefix of a later one
    r"([0-9]|1[0-9]{2})",
    r"(ab)*c?",
    r"[a-z]+( [a-z]+)*",
    r'"[^"]{0,5}"',  # any character, the compiler's sentinel included, inside quotes
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_regex_masks_equal_partial_fullmatch(pattern, vocab, compiled):
    bound = configure(Regex, pattern=pattern).bind(vocab, [EOS])
    assert type(bound.automaton) is compiled
    pieces = whole_characters(vocab)
    for walk in range(3):
        rnd = random.Random(walk)
        text, state = "", torch.tensor([bound.automaton.initial])
        for _ in range(20):
            ours = allowed(bound, state)[0]
            assert ours & (set(pieces) | {EOS}) == reference_allowed(pattern, text, pieces), (pattern, text)
            moves = sorted((ours - {EOS}) & set(pieces))
            if not moves:
                break
            token = rnd.choice(moves)
            text += vocab.token_bytes[token].decode()
            state = bound.automaton.advance(state, torch.tensor([token]))


def test_one_row_and_many_rows_take_the_same_steps(vocab, monkeypatch, compiled):
    """The one-row path (Python ints) and the batched one (tensors) agree on every transition and mask,
    looked up or remembered (a second pass reads the one-row steps from its memo, which is forgotten
    when full)."""
    monkeypatch.setattr(automaton_module, "MAX_MEMO_STEPS", 1000)
    bound = configure(Regex, pattern=r'"[^"]{0,5}"|[0-9]+').bind(vocab, [EOS])
    automaton, masks = bound.automaton, bound.masks
    assert type(automaton) is compiled
    g = torch.Generator().manual_seed(0)
    states = torch.randint(0, automaton.dead + 1, (4000,), generator=g)
    tokens = torch.randint(0, 1024, (4000,), generator=g)
    batched = automaton.advance(states, tokens)
    tables = automaton.nbytes - len(automaton.memo) * automaton_module.MEMO_STEP_BYTES
    for _ in range(2):
        assert batched.tolist() == [automaton.step(s, t) for s, t in zip(states.tolist(), tokens.tolist())]
        assert 0 < len(automaton.memo) <= 1000
        assert automaton.nbytes == tables + len(automaton.memo) * automaton_module.MEMO_STEP_BYTES  # the cache counts it
    assert [automaton.step(s, t) for s, t in zip(states[:900].tolist(), tokens[:900].tolist())] == batched[:900].tolist()
    assert (batched != automaton.dead).sum() > 100  # real transitions, not only dead ends
    if compiled is TokenAutomaton:
        assert torch.equal(automaton.advance_in_torch(states, tokens), batched)  # the path of other devices
    assert all(torch.equal(masks.rows(states[i : i + 1])[0], masks.row(int(states[i]))) for i in range(0, 4000, 37))


def test_a_token_outside_the_vocabulary_leads_to_the_dead_state(vocab, compiled):
    """An id past either end of the vocabulary is no token: its step key, state * vocab + id, is another
    state's step, which must neither be taken for it nor remembered over."""
    automaton = configure(Regex, pattern="[a-z]+").bind(vocab, [EOS]).automaton
    assert type(automaton) is compiled
    a = vocab.token_bytes.index(b"a")
    after = automaton.step(automaton.initial, a)
    expected = automaton.step(after, a)
    automaton.memo.clear()
    tried = 0
    for state, token in ((after - 1, a + vocab.size), (after + 1, a - vocab.size), (after, -1), (after, vocab.size)):
        if 0 <= state <= automaton.dead:
            tried += 1
            assert automaton.step(state, token) == automaton.dead
            assert automaton.advance(torch.tensor([state]), torch.tensor([token])).tolist() == [automaton.dead]
    assert tried >= 3 and automaton.step(after, a) == expected != automaton.dead
    if compiled is TokenAutomaton:
        states, tokens = torch.tensor([after - 1, after, after]), torch.tensor([a + vocab.size, -1, vocab.size])
        assert automaton.advance_in_torch(states, tokens).tolist() == [automaton.dead] * 3


@pytest.mark.parametrize("eos", [[EOS, 1024], [-1], [5000]])
def test_an_end_token_outside_the_vocabulary_is_refused_when_bound(vocab, compiled, eos):
    """Compiled ahead, it failed inside bind with a raw IndexError; lazily, at the first state that may end."""
    with pytest.raises(P.InvalidOption, match=rf"eos_token_ids holds {max(eos) if max(eos) >= 1024 else min(eos)}, "
                                              r"outside the vocabulary of 1024 tokens"):
        configure(Regex, pattern="[a-z]{1,3}").bind(vocab, eos)


def test_lazy_masks_are_made_in_a_process_forked_after_torch_ran_on_its_threads(vocab, forks_here):
    """A child forked from a process whose torch thread pool started (it ran a model) hangs in any
    parallel torch call; the rows of a lazy constraint reached there are made in numpy, as the one-row
    path of a constraint compiled ahead needs nothing made."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 30}, "e": {"enum": ["alpha", "beta"]},
                                               "a": {"type": "array", "items": {"type": "integer"}, "maxItems": 5}}}
    bound = configure(JsonSchema, schema=schema).bind(vocab, [EOS])  # dozens of masks: their table grows, copied
    assert type(bound.automaton) is LazyAutomaton
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(4096, 1024).add_(1.0)  # the pool runs
        pid = os.fork()
        if pid == 0:
            for state in range(bound.automaton.dead + 1):
                bound.masks.row(state)
            os._exit(0)
        deadline = time.monotonic() + 30
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hangs making masks")
            time.sleep(0.05)
    finally:
        torch.set_num_threads(threads)


NESTED = {"type": "object", "properties": {
    "id": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
    "who": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]}},
    "required": ["id", "who"]}


def compiled_both_ways(constraint, vocab, monkeypatch):
    """`constraint` bound to `vocab` lazily and compiled ahead (in children forked from here: use `forks_here`)."""
    lazy = constraint.bind(vocab, [EOS])
    structured_compile._cache.clear()
    with monkeypatch.context() as patched:
        patched.setattr(build_module, "covers_every_byte", lambda trie: False)
        ahead = constraint.bind(vocab, [EOS])
    structured_compile._cache.clear()
    assert type(lazy.automaton) is LazyAutomaton and type(ahead.automaton) is TokenAutomaton
    return lazy, ahead


@pytest.mark.parametrize("constraint", [(Regex, {"pattern": p}) for p in PATTERNS] + [(JsonSchema, {"schema": NESTED})],
                         ids=[*PATTERNS, "json"])
def test_lazy_masks_and_steps_equal_those_compiled_ahead(constraint, vocab, monkeypatch, forks_here):
    """Along seeded walks (a row taking tokens its mask allows), the lazy automaton's masks, one row and
    batched, and its steps, on allowed tokens and on any other, are those of the automaton compiled ahead."""
    lazy, ahead = compiled_both_ways(configure(constraint[0], **constraint[1]), vocab, monkeypatch)
    rnd = random.Random(0)
    pairs = []
    for walk in range(6):
        here, there = lazy.automaton.initial, ahead.automaton.initial
        for _ in range(30):
            pairs.append((here, there))
            assert torch.equal(lazy.masks.row(here), ahead.masks.row(there))
            moves = (lazy.masks.row(here) == 0).nonzero().flatten().tolist()
            other = rnd.randrange(vocab.size)
            assert (lazy.automaton.step(here, other) == lazy.automaton.dead) == \
                (ahead.automaton.step(there, other) == ahead.automaton.dead)
            if moves == [EOS]:
                break
            token = rnd.choice([t for t in moves if t != EOS])
            here, there = lazy.automaton.step(here, token), ahead.automaton.step(there, token)
            assert (here == lazy.automaton.dead) == (there == ahead.automaton.dead) and here != lazy.automaton.dead
    heres, theres = (torch.tensor(states) for states in zip(*pairs))
    assert torch.equal(lazy.masks.rows(heres), ahead.masks.rows(theres))
    tokens = torch.randint(0, vocab.size, (len(pairs),), generator=torch.Generator().manual_seed(1))
    assert torch.equal(lazy.automaton.advance(heres, tokens) == lazy.automaton.dead,
                       ahead.automaton.advance(theres, tokens) == ahead.automaton.dead)
    assert len(set(pairs)) >= 2


def test_a_lazy_constraint_walks_only_the_states_generation_reaches(vocab, tokenizer, forks_here):
    """Compiled, only the initial state has its tokens; each state a generation reaches has them after."""
    chain = Chain([configure(JsonSchema, schema=NESTED)]).bind(vocab, [EOS])
    automaton = chain.processors[0].automaton
    assert type(automaton) is LazyAutomaton
    assert np.flatnonzero(automaton.mask_of >= 0).tolist() == [automaton.initial]
    texts = run_chain(chain, 2, 200, vocab.size)
    reached = {automaton.initial}
    for ids in texts:
        state = automaton.initial
        for token in ids:
            state = automaton.step(state, token)
            reached.add(state)
        json.loads(tokenizer.decode(ids))
    walked = set(np.flatnonzero(automaton.mask_of >= 0).tolist())
    assert reached <= walked <= reached | {automaton.dead}  # where a row goes on after its end of sequence
    assert len(reached) < automaton.dead // 2


def test_lazy_masks_grow_past_one_row_per_state(vocab, forks_here):
    """The table of bias rows holds one per state, and grows past that by a row at a time (a process forked
    while a row was added leaves that row unnamed, and makes it again): rows already there keep theirs."""
    automaton = Chain([configure(Regex, pattern="ab?")]).bind(vocab, [EOS]).processors[0].automaton
    masks = automaton.masks((EOS,), "cpu")
    first = masks.row(automaton.initial).clone()
    extra = []
    for token in range(len(masks.mask_of) + 3):  # more rows than states
        row = np.full(vocab.size, NEG_INF, dtype=np.float32)
        row[token] = 0.0
        extra.append(masks._append(row))
    assert masks.count == 1 + len(extra) > len(masks.mask_of)
    assert torch.equal(masks.row(automaton.initial), first)
    assert [int(masks.bias[index].argmax()) for index in extra] == list(range(len(extra)))
    after = automaton.step(automaton.initial, vocab.token_bytes.index(b"a"))
    assert masks.allowed(torch.tensor([after]))[0].nonzero().squeeze(1).tolist() == sorted(
        {vocab.token_bytes.index(b"b"), EOS})


@pytest.mark.parametrize("constraint", [(Regex, {"pattern": r'"[^"]{0,5}"|[0-9]+'}), (JsonSchema, {"schema": NESTED})],
                         ids=["regex", "json"])
def test_many_rows_masked_in_place_of_their_bias_rows_are_those_rows_added(constraint, vocab, compiled, monkeypatch):
    """The batched CPU step writes the logits of the few tokens a mask allows, or adds the bias row of a
    mask allowing more: either way, exactly the logits plus each row's bias row, -inf where it forbids,
    over every state (masks of both kinds among them), as the chain's step gives them. (Only masks over
    a large vocabulary keep ids: the test's is made to count as one.)"""
    assert not configure(constraint[0], **constraint[1]).bind(vocab, [EOS]).masks.kept  # 1,024 tokens: none
    monkeypatch.setattr(structured_compile, "_cache", OrderedDict())
    monkeypatch.setattr(automaton_module, "KEEP_IDS_FROM_VOCAB", vocab.size)
    bound = configure(constraint[0], **constraint[1]).bind(vocab, [EOS])
    masks = bound.masks
    assert type(bound.automaton) is compiled
    states = torch.randperm(bound.automaton.dead + 1, generator=torch.Generator().manual_seed(0))
    logits = torch.randn(len(states), vocab.size, generator=torch.Generator().manual_seed(1))
    expected = masks.rows(states) + logits
    assert torch.equal(masks.masked(states.numpy(), logits), expected)
    masks.masked(states.numpy(), logits)  # every lazy row made
    kept = {len(tokens) for tokens in masks.kept.values()}
    assert kept and max(kept) <= vocab.size // automaton_module.FEW_TOKENS
    assert len(masks.kept) < len(torch.unique(masks.rows(states), dim=0))  # some masks allow many tokens
    sequence = torch.zeros(8, 2, dtype=torch.long)
    for start in range(0, len(states) - 7, 8):
        rows = slice(start, start + 8)
        _, out = bound.process(states[rows], logits[rows], Context(sequence, 1, 1, vocab.size))
        assert torch.equal(out, expected[rows])


def test_lazy_masks_made_by_threads_at_once_are_those_made_by_one(vocab, monkeypatch, forks_here):
    """Threads reaching the states of one fresh automaton together (one row and batched) get the rows
    that one thread makes for another automaton of the same constraint."""
    import threading

    monkeypatch.setattr(automaton_module, "KEEP_IDS_FROM_VOCAB", vocab.size)  # its masks keep ids
    constraint = configure(JsonSchema, schema=NESTED)
    alone = constraint.bind(vocab, [EOS])
    structured_compile._cache.clear()
    shared = constraint.bind(vocab, [EOS])
    states = torch.arange(alone.automaton.dead + 1)
    expected = alone.masks.rows(states)
    failures = []

    def reach(seed):
        order = torch.randperm(len(states), generator=torch.Generator().manual_seed(seed))
        for chunk in order.split(7):
            if not torch.equal(shared.masks.rows(chunk), expected[chunk]):
                failures.append(seed)
            if not torch.equal(shared.masks.masked(chunk.numpy(), torch.zeros(len(chunk), vocab.size)), expected[chunk]):
                failures.append(seed)
            if not torch.equal(shared.masks.row(int(chunk[0])), expected[chunk[0]]):
                failures.append(seed)

    threads = [threading.Thread(target=reach, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures and shared.masks.count == alone.masks.count and shared.masks.kept


def test_the_compile_cache_weighs_its_automata_again_when_one_is_used(vocab, monkeypatch, forks_here):
    """A lazy automaton grows after it was cached, as generations reach its states: using any cached
    constraint weighs the cache again, and the least recently used go past `cache_bytes()`."""
    grows, other = configure(JsonSchema, schema=NESTED), configure(Regex, pattern="[0-9]+")
    grown = grows.bind(vocab, [EOS])
    other.bind(vocab, [EOS])
    monkeypatch.setattr(structured_compile, "_cache_bytes", structured_compile.cached()[1] + 4096)
    before = grown.automaton.nbytes
    grown.masks.rows(torch.arange(grown.automaton.dead + 1))  # every state reached
    assert grown.automaton.nbytes > before + 8 * 4096 and len(structured_compile._cache) == 2
    other.bind(vocab, [EOS])  # from the cache
    assert [a for a in structured_compile._cache.values()] == [other.bind(vocab, [EOS]).automaton]
    assert len(forks_here.pids) == 2
    assert grows.bind(vocab, [EOS]).automaton is not grown.automaton and len(forks_here.pids) == 3


def test_what_the_compile_cache_holds_is_weighed_again_when_asked(vocab, monkeypatch, forks_here):
    """`cached()` (the server's `stats.constraints`) reported two automata past the cache's size after one grew
    (a generation reaching its states): it weighs the cache first, as a compile or a use does."""
    grows, other = configure(JsonSchema, schema=NESTED), configure(Regex, pattern="[0-9]+")
    grown = grows.bind(vocab, [EOS])
    other.bind(vocab, [EOS])
    monkeypatch.setattr(structured_compile, "_cache_bytes", structured_compile.cached()[1] + 4096)
    grown.masks.rows(torch.arange(grown.automaton.dead + 1))  # every state reached
    count, held = structured_compile.cached()
    assert count == 1 and held <= structured_compile.cache_bytes(), (count, held)


def test_a_compile_cache_of_zero_bytes_keeps_the_last_compiled_only(vocab, monkeypatch, forks_here):
    """`--constraint-cache-bytes 0` (its help: "the last compiled is always kept"): each new constraint
    replaces the one before, which compiles again when asked again; the last stays, so a generation that
    binds its chain twice (a retry, a second sequence) compiles once."""
    monkeypatch.setattr(structured_compile, "_cache_bytes", structured_compile.cache_bytes())
    structured_compile.set_cache_bytes(0)
    first, second = configure(Regex, pattern="[0-9]+"), configure(Regex, pattern="[a-z]+")
    kept = first.bind(vocab, [EOS]).automaton
    assert first.bind(vocab, [EOS]).automaton is kept and len(forks_here.pids) == 1
    assert structured_compile.cached() == (1, kept.nbytes)
    second.bind(vocab, [EOS])
    assert structured_compile.cached()[0] == 1 and len(forks_here.pids) == 2
    assert first.bind(vocab, [EOS]).automaton is not kept and len(forks_here.pids) == 3
    with pytest.raises(ValueError, match="bytes >= 0"):
        structured_compile.set_cache_bytes(-1)


def run_chain(chain: Chain, rows: int, steps: int, vocab_size: int, seed: int = 0, reorder=None, every_row_ends=True):
    """Samples from random logits through `chain`; returns each row's tokens up to EOS (EOS excluded).
    Every row must end with EOS within `steps`, or, if not `every_row_ends`, only the rows that did are
    returned (a random walk through "any JSON value" may not end)."""
    g = torch.Generator().manual_seed(seed)
    sequence = torch.zeros(rows, steps + 1, dtype=torch.long)
    states = chain.init(Context(sequence, 1, 1, vocab_size))
    finished = [None] * rows
    for step in range(steps):
        context = Context(sequence, step + 1, 1, vocab_size)
        states, logits = chain.process(states, torch.randn(rows, vocab_size, generator=g) * 3, context)
        assert not torch.isnan(logits).any() and (logits.amax(dim=1) > NEG_INF).all()
        tokens = torch.multinomial(logits.softmax(-1), 1, generator=g).squeeze(1)
        sequence[:, step + 1] = tokens
        for row, token in enumerate(tokens.tolist()):
            if finished[row] is None and token == EOS:
                finished[row] = step + 1
        if reorder is not None and step == reorder[0]:
            states = chain.reorder(states, reorder[1])
            sequence = sequence.index_select(0, reorder[1])
            finished = [finished[i] for i in reorder[1].tolist()]
        if all(f is not None for f in finished):
            break
    assert None not in finished or not every_row_ends, "a row did not end: give it more steps"
    return [sequence[row, 1:end].tolist() for row, end in enumerate(finished) if end is not None]


def test_sampled_texts_match_and_end_with_eos(vocab, tokenizer):
    cases = [
        (configure(Regex, pattern=r"[a-z]{2,6}@[a-z]{3}\.com"), lambda t: regex.fullmatch(r"[a-z]{2,6}@[a-z]{3}\.com", t)),
        (configure(Choice, options=["no", "none", "nonetheless", "yes"]), lambda t: t in {"no", "none", "nonetheless", "yes"}),
        (configure(JsonSchema, schema={"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
                                       "required": ["a", "b"]}), None),
    ]
    import json

    import jsonschema

    for config, matches in cases:
        chain = Chain([config]).bind(vocab, [EOS])
        for ids in run_chain(chain, rows=16, steps=60, vocab_size=1024):
            text = tokenizer.decode(ids)
            if matches is None:
                jsonschema.validate(json.loads(text), json.loads(config.schema))
            else:
                assert matches(text), (config, text)
    # "no" is a prefix of "none": the longer options are reachable (a leftmost-first automaton never allows them)
    chain = Chain([configure(Choice, options=["no", "none", "nonetheless"])]).bind(vocab, [EOS])
    texts = {tokenizer.decode(ids) for seed in range(8) for ids in run_chain(chain, 8, 20, 1024, seed=seed)}
    assert texts == {"no", "none", "nonetheless"}


def test_json_keys_come_in_the_order_the_schema_declares_them(vocab, tokenizer):
    """Users put "reasoning" before "answer" on purpose: the object is written in the declared order."""
    schema = {"type": "object", "properties": {"zeta": {"enum": ["z"]}, "alpha": {"enum": ["a"]}},
              "required": ["zeta", "alpha"]}
    chain = Chain([configure(JsonSchema, schema=schema)]).bind(vocab, [EOS])
    for ids in run_chain(chain, 4, 60, 1024, seed=2):
        assert list(json.loads(tokenizer.decode(ids))) == ["zeta", "alpha"]


def test_states_follow_beam_reordering(vocab, tokenizer):
    """Rows swapped mid-way keep their own automaton state: every text still matches."""
    pattern = r"(abc|xyz)[0-9]{2}"
    chain = Chain([configure(Regex, pattern=pattern)]).bind(vocab, [EOS])
    for seed in range(6):
        index = torch.tensor([2, 2, 0, 1])  # a duplicated row and a dropped one, as beam search does
        for ids in run_chain(chain, 4, 30, 1024, seed=seed, reorder=(2, index)):
            assert regex.fullmatch(pattern, tokenizer.decode(ids))


def reference_dfa(transitions, initial, accepting, tokens, vocab_size):
    """The plain reading of a user's automaton: the allowed set after each prefix of `tokens`."""
    table = {(s, t): n for s, t, n in transitions}
    state, out = initial, []
    for token in tokens + [None]:
        moves = {t for (s, t) in table if s == state}
        out.append(moves | ({EOS} if state in accepting or not moves else set()))
        if token is not None:
            state = table.get((state, token), -1)
    return out


@pytest.mark.parametrize("order", ["sorted", "shuffled"])  # compiled constraints come sorted: no sort then
def test_dfa_masks_equal_a_plain_walk_of_its_transitions(vocab, order):
    rnd = random.Random(3)
    states = [10, 20, 30, 40, 50]  # any integers, as in Bumblebee's example
    transitions = sorted({(s, rnd.randrange(3, 60), rnd.choice(states)) for s in states[:4] for _ in range(6)})
    transitions = list({(s, t): (s, t, n) for s, t, n in transitions}.values())
    if order == "shuffled":
        rnd.shuffle(transitions)
    config = configure(Dfa, initial_state=10, transitions=transitions, accepting_states=[30])
    chain = Chain([config]).bind(vocab, [EOS])
    bound = chain.processors[0]
    for ids in run_chain(chain, 8, 12, 1024, seed=1):
        expected = reference_dfa(transitions, 10, {30}, ids, 1024)
        state = torch.tensor([bound.automaton.initial])
        for step, token in enumerate(ids + [None]):
            assert allowed(bound, state)[0] == expected[step]
            if token is not None:
                state = bound.automaton.advance(state, torch.tensor([token]))


def test_constraints_run_first_so_sampling_chooses_among_what_they_allow(vocab, tokenizer):
    """TopK(2) given before a regex would keep two tokens the regex forbids: binding puts the regex first."""
    chain = Chain([configure(P.TopK, k=2), configure(Regex, pattern=r"[0-9]{3}")]).bind(vocab, [EOS])
    assert [p.name for p in chain.processors] == ["automaton", "top_k"]
    for ids in run_chain(chain, 8, 10, 1024, seed=4):
        assert regex.fullmatch(r"[0-9]{3}", tokenizer.decode(ids))


def test_a_state_with_no_move_left_gets_eos_only(vocab):
    """A second constraint that allows none of what the first allows: the row ends, it is never all -inf."""
    digits = [i for i, b in enumerate(vocab.token_bytes) if b and b.isdigit()]
    letters = [(0, i, 0) for i, b in enumerate(vocab.token_bytes) if b and b.isalpha()]
    chain = Chain([configure(Regex, pattern=r"[0-9]+"), configure(Dfa, initial_state=0, transitions=letters)]).bind(vocab, [EOS])
    assert digits
    sequence = torch.zeros(2, 4, dtype=torch.long)
    context = Context(sequence, 1, 1, 1024)
    _, logits = chain.process(chain.init(context), torch.randn(2, 1024), context)
    assert torch.equal((logits > NEG_INF).nonzero()[:, 1], torch.tensor([EOS, EOS]))


@pytest.mark.parametrize("transitions", [[[0, EOS, 0]], [[0, EOS, 1], [1, 5, 1]]], ids=["loop on eos", "on to a state"])
def test_a_dfa_state_whose_only_moves_are_on_eos_gets_eos_only(vocab, transitions):
    """Its transitions on end-of-sequence tokens are no text moves: with none left it can go nowhere, and
    it ends; a state that also moves on a text token does not end (not accepting)."""
    chain = Chain([configure(Dfa, initial_state=0, transitions=transitions)]).bind(vocab, [EOS])
    context = Context(torch.zeros(2, 4, dtype=torch.long), 1, 1, 1024)
    _, logits = chain.process(chain.init(context), torch.randn(2, 1024), context)
    assert torch.equal((logits > NEG_INF).nonzero()[:, 1], torch.tensor([EOS, EOS]))
    moving = Chain([configure(Dfa, initial_state=0, transitions=[[0, EOS, 1], [0, 7, 1]])]).bind(vocab, [EOS])
    _, logits = moving.process(moving.init(context), torch.randn(2, 1024), context)
    assert torch.equal((logits > NEG_INF).nonzero()[:, 1], torch.tensor([7, 7]))


def grammar_steps(vocab, grammar: str, tokens: list[int], eos=(EOS,)) -> list[set[int]]:
    """What a grammar allows (one row) at the start and after each of `tokens`."""
    chain = Chain([configure(Grammar, grammar=grammar)]).bind(vocab, list(eos))
    sequence = torch.tensor([[0] + tokens], dtype=torch.long)
    states, allowed = chain.init(Context(sequence, 1, 1, 1024)), []
    for step in range(len(tokens) + 1):
        states, logits = chain.process(states, torch.zeros(1, 1024), Context(sequence, step + 1, 1, 1024))
        allowed.append(set((logits[0] > NEG_INF).nonzero().squeeze(1).tolist()))
    return allowed


def test_a_grammar_that_must_write_an_end_token_before_its_end_is_refused_where_it_must(vocab, tokenizer):
    """A grammar may name an end-of-sequence token as text (`<[2]>`). Writing one ends the generation, so
    where the grammar allows nothing else and is not complete after it, the text would end short of a
    match: that step is refused, typed. Where writing it completes the grammar, it ends there; where the
    grammar allows other tokens too, the end token is masked until the grammar may end; with the id left
    out of eos_token_ids, it is text like any other token."""
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    assert grammar_steps(vocab, 'start: "a" <[2]>', [a]) == [{a}, {EOS}]  # writing it completes the grammar
    assert grammar_steps(vocab, 'start: "a" (<[2]> | "b")', [a, b])[1:] == [{b}, {EOS}]  # "b" goes on: no end yet
    with pytest.raises(P.InvalidInput, match=r"grammar: after 1 tokens of row 0 the grammar allows only 2 of "
                                             r"eos_token_ids, whose writing ends the text short of a match"):
        grammar_steps(vocab, 'start: "a" <[2]> "b"', [a])
    text = grammar_steps(vocab, 'start: "a" <[2]> "b"', [a, EOS, b], eos=(1,))
    assert text[:3] == [{a}, {EOS}, {b}] and 1 in text[3]
    with pytest.raises(P.InvalidInput, match=r"allows only 1, 2 of eos_token_ids"):  # in one bitmask word
        grammar_steps(vocab, 'start: "a" (<[1]> | <[2]>) "b"', [a], eos=(1, EOS))


def balanced(text: str) -> bool:
    depth = 0
    for c in text:
        depth += 1 if c == "(" else -1
        if depth < 0:
            return False
    return depth == 0 and text != ""


def test_grammar_texts_are_balanced_through_reorders(vocab, tokenizer):
    grammar = 'start: "(" inner ")"\ninner: start? start?'  # at most two children: texts stay short
    chain = Chain([configure(Grammar, grammar=grammar)]).bind(vocab, [EOS])
    texts = []
    for seed in range(5):
        index = torch.tensor([1, 1, 3, 0])  # two rows share one parser after this: each gets its own copy
        texts += [tokenizer.decode(ids) for ids in run_chain(chain, 4, 200, 1024, seed=seed, reorder=(3, index))]
    assert all(balanced(t) for t in texts), texts
    assert any(t.count("(") > 1 for t in texts)  # nesting happened: this is not a finite pattern


def rule_chain(limit: int) -> str:
    """`start: a`, `a: b`, `b: c`, ... down to `"e"+`: the most rules (named as shortly as names come) that fit
    in `limit` characters, a chain llguidance walks by recursion."""
    names = (first + "".join(more) for size in range(3) for first in string.ascii_lowercase
             for more in itertools.product(string.ascii_lowercase + string.digits, repeat=size))
    previous, lines, chars = next(names), [], 0
    head, tail = f"start:{previous}\n", '"e"+\n'
    for name in names:
        line = f"{previous}:{name}\n"
        if len(head) + chars + len(line) + len(name) + 1 + len(tail) > limit:
            break
        lines.append(line)
        chars += len(line)
        previous = name
    return head + "".join(lines) + f"{previous}:{tail}"


def test_a_chain_of_rules_as_long_as_the_limit_allows_is_checked_built_and_run(vocab):
    """llguidance checks and builds a grammar by recursion: 12,700 chained rules overflowed a thread's 8 MiB
    of stack and killed the process (a segfault, the sidecar with it). Both now run on a deep stack of their
    own; the steps run here, on this thread's own stack, and allow what the one-rule grammar allows."""
    from processors.structured.constraints import MAX_PATTERN_CHARS

    text = rule_chain(MAX_PATTERN_CHARS)
    assert len(text) <= MAX_PATTERN_CHARS and text.count("\n") > 12_000
    chains = [Chain([configure(Grammar, grammar=g)]).bind(vocab, [EOS]) for g in (text, 'start: "e"+')]
    e = vocab.token_bytes.index(b"e")
    sequence = torch.full((1, 3), e, dtype=torch.long)
    masks = []
    for chain in chains:
        states, allowed = chain.init(Context(sequence, 1, 1, vocab.size)), []
        for length in (1, 2, 3):
            states, logits = chain.process(states, torch.zeros(1, vocab.size), Context(sequence, length, 1, vocab.size))
            allowed.append(logits.isfinite())
        masks.append(torch.cat(allowed))
    assert torch.equal(masks[0], masks[1])
    assert masks[0][0, e] and not masks[0][0, EOS] and masks[0][1, EOS]


PANICKING = "(((é|[é-ü])|(( |.|中)|[é-ü])|\\w)){3,}"  # llguidance's regex simplifier panics on it (derivre 0.3.13)


def test_a_panic_in_llguidance_is_a_typed_error(vocab, monkeypatch):
    """pyo3 raises a Rust panic as a BaseException, which `except Exception` misses: at configure time
    and in a grammar's step (one row's mask, or several rows' on llguidance's threads), it is the
    processor's error."""
    with pytest.raises(P.InvalidOption, match="option 'pattern' cannot be checked: llguidance failed on it") as caught:
        configure(Regex, pattern=PANICKING)
    panic = type(caught.value.__context__)
    assert panic.__module__ == "pyo3_runtime" and not issubclass(panic, Exception)
    chain = Chain([configure(Grammar, grammar='start: "a"+')]).bind(vocab, [EOS])
    context = Context(torch.zeros(1, 4, dtype=torch.long), 1, 1, 1024)
    states = chain.init(context)

    def panicking(*args):
        raise panic("called `Option::unwrap()` on a `None` value")

    import llguidance.numpy

    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask", panicking)
    with pytest.raises(P.InvalidInput, match="grammar: the parser failed: llguidance failed on it"):
        chain.process(states, torch.zeros(1, 1024), context)
    rows = Context(torch.zeros(3, 4, dtype=torch.long), 1, 1, 1024)
    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask_par", panicking)
    with pytest.raises(P.InvalidInput, match="grammar: the parser failed: llguidance failed on it"):
        chain.process(chain.init(rows), torch.zeros(3, 1024), rows)


def test_a_panic_while_a_grammar_is_checked_or_built_on_its_own_thread_is_a_typed_error(vocab, monkeypatch):
    """Checked and built on a thread with a deep stack (`grammar._on_deep_stack`), a panic there still
    reaches the caller as the processor's error."""
    with pytest.raises(P.InvalidOption) as caught:
        configure(Regex, pattern=PANICKING)
    panic = type(caught.value.__context__)

    def panicking(*args):
        raise panic("called `Option::unwrap()` on a `None` value")

    monkeypatch.setattr(grammar_module, "_validate_grammar", panicking)
    with pytest.raises(P.InvalidOption, match="option 'grammar' cannot be checked: llguidance failed on it"):
        configure(Grammar, grammar='start: "a"+')
    monkeypatch.undo()
    config = configure(Grammar, grammar='start: "a"+')
    monkeypatch.setattr(grammar_module, "_matcher", panicking)
    monkeypatch.setattr(grammar_module, "_started", OrderedDict())  # an earlier test bound it
    with pytest.raises(P.InvalidOption, match="the grammar constraint cannot be bound to the vocabulary: llguidance failed on it"):
        config.bind(vocab, [EOS])


def test_a_grammars_start_is_built_once_per_vocabulary(vocab, tokenizer, monkeypatch):
    """llguidance's parser over the vocabulary (up to a second for a schema of max_pattern_chars) is built
    once per grammar and vocabulary, and a grammar the vocabulary cannot begin is refused every time, found
    out once; the least recently bound beyond `STARTED` are forgotten."""
    builds = []
    start = grammar_module._start
    monkeypatch.setattr(grammar_module, "_start", lambda *args: builds.append(args[1]) or start(*args))
    monkeypatch.setattr(grammar_module, "_started", OrderedDict())
    monkeypatch.setattr(grammar_module, "STARTED", 2)
    config = configure(Grammar, grammar='start: "ab" /[0-9]+/')
    first, second = (Chain([config]).bind(vocab, [EOS]).processors[0] for _ in range(2))
    assert len(builds) == 1 and first.start is second.start
    Chain([config]).bind(Vocabulary.from_tokenizer(tokenizer, 1030), [EOS])
    assert len(builds) == 2  # another vocabulary
    impossible = configure(Grammar, grammar="start: /[^\\s\\S]/")  # a class of no character
    for _ in range(2):
        with pytest.raises(P.InvalidOption, match="the vocabulary cannot write any text that the grammar constraint"):
            Chain([impossible]).bind(vocab, [EOS])
    assert len(builds) == 3
    Chain([config]).bind(vocab, [EOS])
    assert len(builds) == 4  # with two kept, it was the least recently bound


# from Python: a schema that holds itself (json.dumps refuses it, but a walk before it never ended), and one
# whose objects are shared so often that written out it doubles 20 times
CYCLE = {"type": "object", "properties": {"a": {"type": "array"}}}
CYCLE["properties"]["a"]["items"] = CYCLE
SHARED_20_TIMES_OVER = {"type": "integer"}
for _ in range(20):
    SHARED_20_TIMES_OVER = {"anyOf": [SHARED_20_TIMES_OVER, SHARED_20_TIMES_OVER]}

DRAFT_3, DRAFT_7 = "http://json-schema.org/draft-03/schema#", "http://json-schema.org/draft-07/schema#"
NESTED_3000_DEEP = {"type": "integer"}
for _ in range(3000):
    NESTED_3000_DEEP = {"anyOf": [NESTED_3000_DEEP]}



@pytest.mark.parametrize("cls, options, message", [
    (Regex, {"pattern": "a(?=b)"}, "look-around"),
    (Regex, {"pattern": "a(b"}, "unclosed group"),
    (Regex, {"pattern": ""}, "non-empty string"),
    (Regex, {"pattern": "a", "compile_timeout_s": 0}, "compile_timeout_s"),
    (Choice, {"options": []}, "non-empty list"),
    (Choice, {"options": ["a", ""]}, "non-empty strings"),
    (JsonSchema, {"schema": "{not json"}, "not valid JSON"),
    (JsonSchema, {"schema": {"type": "no such type"}}, "not a valid JSON schema"),
    (JsonSchema, {"schema": {"const": b"bytes"}}, "is not JSON"),
    (JsonSchema, {"schema": {"const": float("nan")}}, "is not JSON"),
    # msgpack maps may have keys of any type; JSON objects only strings (json.dumps would make 1 into "1")
    (JsonSchema, {"schema": {"type": "object", "properties": {1: {}}}}, "JSON object keys must be strings, got 1 .int. in the map at /properties$"),
    (JsonSchema, {"schema": {"type": "object", "properties": {"1": {}, 1: {}}}}, "keys must be strings"),
    (JsonSchema, {"schema": {"type": "object", None: {}}}, "keys must be strings, got None .NoneType. at the top of the schema"),
    (JsonSchema, {"schema": {"anyOf": [{"const": "x"}, {"const": {"a/b": {2.5: 1}}}]}}, "in the map at /anyOf/1/const/a~1b$"),
    (JsonSchema, {"schema": {"properties": {b"k": {}}}}, "keys must be strings, got b'k' .bytes."),
    (JsonSchema, {"schema": {"enum": []}}, "an empty enum matches no value at all"),  # outlines-core writes ''
    (JsonSchema, {"schema": {"type": "object", "properties": {"a": {"enum": []}}}}, "an empty enum"),
    # what neither backend enforces: llguidance, which runs what outlines-core would not compile exactly, says why
    (JsonSchema, {"schema": {"not": {"type": "string"}}}, r'cannot be enforced: Unimplemented keys: \["not"\] \(it is run '
                                                          r"by llguidance, since outlines-core would not compile it exactly"),
    (JsonSchema, {"schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "uniqueItems"),
    (JsonSchema, {"schema": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}, "oneOf constraints are not supported"),
    (JsonSchema, {"schema": {"type": "string", "format": "no such format"}}, "Unknown format"),
    (JsonSchema, {"schema": {"type": "integer", "const": "1"}}, "cannot be enforced"),
    # llguidance clamped a bound past 2^63 (writing 2^63 - 1 for minimum 2^63), and one near -2^63 crashed the process
    (JsonSchema, {"schema": {"type": "integer", "minimum": -2**63, "maximum": -2**63 + 8}},
     r"minimum -9223372036854775808 is at or beyond \+-2\^53 \(9007199254740992\), past the integers a JSON number"),
    (JsonSchema, {"schema": {"type": "integer", "minimum": 2**63}}, r"beyond \+-2\^53"),
    # llguidance wrote 9007199254740991.9992, which a float reads as 2^53; outlines-core wrote 2^64 + 1 as a float
    (JsonSchema, {"schema": {"type": "number", "exclusiveMaximum": 2**53}}, r"at or beyond \+-2\^53"),
    (JsonSchema, {"schema": {"enum": [1, [{"a": 2**64 + 1}]]}}, r"the enum holds 18446744073709551617, at or beyond"),
    # Rust's regex, both backends', wrote "29" for [[:digit:]]{2}, which JSON Schema reads as literal characters
    (JsonSchema, {"schema": {"properties": {"s": {"type": "string", "pattern": "[[:digit:]]{2}"}}}},
     r"the pattern '\[\[:digit:\]\]\{2\}' has a class holding '\[', '&&', '--' or '~~'"),
    (JsonSchema, {"schema": {"type": "string", "pattern": "[a-z&&b]"}}, "has a class holding"),
    # as a patternProperties name, it let {"n": 1} through a schema of names matching [[:alpha:]] (the outside test)
    (JsonSchema, {"schema": {"type": "object", "patternProperties": {"^[[:alpha:]]$": {"type": "integer"}},
                             "additionalProperties": False}}, r"the pattern '\^\[\[:alpha:\]\]\$' has a class"),
    (JsonSchema, {"schema": {"type": "object", "properties": {"n": {"exclusiveMaximum": -1e300}}}}, "exclusiveMaximum"),
    # neither backend keeps free keys distinct: {"": 0, "x": 1, "": 2} has 2 properties, not 3
    (JsonSchema, {"schema": {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 3}},
     "minProperties 3 asks for 3 keys beyond the required properties"),
    (JsonSchema, {"schema": {"additionalProperties": {"type": "integer"}, "minProperties": 2.0}}, "asks for 2 keys"),
    # a $ref to nowhere beside an enum (checking the enum's values against it raised jsonschema's own error)
    (JsonSchema, {"schema": {"enum": [1], "$ref": "#/nope"}}, "cannot be enforced: Pointer '/nope' does not exist"),
    (JsonSchema, {"schema": {"const": 1, "$ref": "https://example.com/x.json"}}, "cannot be enforced: Resource"),
    (JsonSchema, {"schema": {"enum": [1], "$dynamicRef": "#nope"}}, r'Unimplemented keys: \["\$dynamicRef"\]'),
    (JsonSchema, {"schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]},
                             "then": {"required": ["b"]}}}, "Unimplemented keys"),
    (JsonSchema, {"schema": CYCLE}, "contains itself at /properties/a/items: JSON cannot write a cycle"),
    (JsonSchema, {"schema": SHARED_20_TIMES_OVER}, "more than 100000 characters written as JSON .limit max_pattern_chars"),
    (JsonSchema, {"schema": "[" * 50_000 + "]" * 50_000}, "not valid JSON"),
    # past a double's range: llguidance raised ValueError out of configure, outlines-core failed to parse it
    (JsonSchema, {"schema": '{"minLength": ' + "9" * 400 + "}"}, "an integer of 400 digits at /minLength, past the range"),
    (JsonSchema, {"schema": {"type": "integer", "default": 10**400}}, "an integer of 401 digits at /default"),
    (JsonSchema, {"schema": {"type": "string", "format": "date", "examples": ["", -(10**309)]}}, "at /examples/1"),
    # the largest double itself, which llguidance's parser read as infinity (a ValueError out of configure)
    (JsonSchema, {"schema": {"type": "string", "maxLength": int(sys.float_info.max)}}, "digits at /maxLength"),
    (JsonSchema, {"schema": {"type": "integer", "minimum": 1, "maximum": 2, "examples": [2**1023]}}, "at /examples/0"),
    # a $schema that is no string (jsonschema's lookup of it raised AttributeError, or TypeError for a list)
    (JsonSchema, {"schema": {"$schema": 5, "type": "integer"}}, r"not a valid JSON schema: .* \(at /\$schema\)"),
    (JsonSchema, {"schema": '{"$schema": ["x"], "type": "integer"}'}, r"\(at /\$schema\)"),
    (JsonSchema, {"schema": NESTED_3000_DEEP}, r"nests maps and lists more than 64 deep, at \.\.\..*/anyOf/0/anyOf/0 "
                                               r"\(limit max_schema_depth\)"),  # was a raw RecursionError
    # shapes an older $schema's metaschema leaves unchecked, which the backends read as 2020-12's (TypeError before)
    (JsonSchema, {"schema": {"$schema": DRAFT_3, "type": "object", "properties": {"a": {}}, "required": True}},
     "Expected array for 'required'"),
    (JsonSchema, {"schema": {"$schema": DRAFT_3, "type": [{"type": "string"}, "null"]}}, "type must be a string"),
    (JsonSchema, {"schema": {"$schema": DRAFT_3, "anyOf": 5}}, "anyOf must be an array"),
    (JsonSchema, {"schema": {"$schema": DRAFT_7, "$defs": {"x": {"type": {"x": 1}}}, "$ref": "#/$defs/x"}},
     "type must be a string or array of strings"),
    (JsonSchema, {"schema": {"$schema": DRAFT_7, "type": "array", "prefixItems": 5}}, "prefixItems must be an array"),
    # counts outlines-core wrote as {0,} (2.0 is 2 to JSON Schema), and draft 3 keywords neither backend reads
    (JsonSchema, {"schema": {"type": "string", "minLength": 2.0}}, "Expected positive integer for 'minLength'"),
    (JsonSchema, {"schema": {"type": "string", "maxLength": 2**64}}, "Expected positive integer for 'maxLength'"),
    (JsonSchema, {"schema": {"$schema": DRAFT_3, "type": "string", "disallow": "string"}},
     "disallow .draft 3. is enforced by neither backend"),
    (Dfa, {"initial_state": 0, "transitions": [[0, 1, 1]], "accepting_states": [2**63]}, "accepting_states"),
    (Grammar, {"grammar": "start: undefined_rule"}, "not a valid Lark grammar"),
    (Dfa, {"initial_state": 0, "transitions": [[0, 1]]}, "state, token_id, next_state"),
    (Dfa, {"initial_state": -1, "transitions": [[0, 1, 1]]}, "initial_state"),
    # states no transition names: a typo (every transition unreachable, or a text that could never end there)
    (Dfa, {"initial_state": 1, "transitions": [[0, 1, 1]]}, "option 'initial_state': no transition leaves state 1"),
    (Dfa, {"initial_state": 0, "transitions": [[0, 1, 1]], "accepting_states": [1, 2]},
     "option 'accepting_states': state 2 is in no transition"),
])
def test_bad_constraints_are_refused_at_configure_time(cls, options, message):
    with pytest.raises(P.InvalidOption, match=message):
        configure(cls, **options)


def test_a_schema_over_max_pattern_chars_is_refused_before_it_is_checked(monkeypatch):
    """The length is the first thing read once the schema is written as JSON: jsonschema's check of a
    300 KB schema took 3-4 s before the limit refused it."""
    from processors.structured import json_schema

    def checked(name, text):
        raise AssertionError("the schema was checked before its length")

    monkeypatch.setattr(json_schema, "_check_schema", checked)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string", "format": "date"} for i in range(8000)}}
    with pytest.raises(P.InvalidOption, match="has 374924 characters, more than the limit of 100000 .limit max_pattern_chars"):
        configure(JsonSchema, schema=wide)


def test_a_regex_or_grammar_sent_again_is_not_checked_again():
    """llguidance's check of a pattern or Lark grammar (63-76 ms at max_pattern_chars) is made once per text;
    one refused is refused every time."""
    from processors.structured import constraints

    for cls, options in ((Regex, {"pattern": "[0-9]{3}-x"}), (Grammar, {"grammar": 'start: "a" start | "b"'})):
        configure(cls, **options)
        before = constraints._validate_grammar.cache_info()
        configure(cls, **options)
        after = constraints._validate_grammar.cache_info()
        assert (after.hits, after.misses) == (before.hits + 1, before.misses)
    for _ in range(2):
        with pytest.raises(P.InvalidOption, match="not a valid regular expression"):
            configure(Regex, pattern="a{2,1}")
        with pytest.raises(P.InvalidOption, match="not a valid Lark grammar"):
            configure(Grammar, grammar="start: undefined_rule")


def test_a_schema_sent_again_is_not_checked_again():
    """A client sends its schema with every request: jsonschema's check and llguidance's are made once per
    schema text (up to 2.3 s at max_pattern_chars); a schema refused is refused every time."""
    from processors.structured import constraints, json_schema

    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "date"}, "n": {"type": "integer"}}}
    first = configure(JsonSchema, schema=schema)
    checks, verdicts = json_schema._check_schema.cache_info(), constraints._validate_grammar.cache_info()
    again = configure(JsonSchema, schema=json.dumps(schema))  # the same schema as text
    assert again == first and first.dfa_obstacle == "format, which outlines-core does not enforce"
    assert json_schema._check_schema.cache_info().hits == checks.hits + 1
    assert json_schema._check_schema.cache_info().misses == checks.misses
    assert constraints._validate_grammar.cache_info().hits == verdicts.hits + 1
    for _ in range(2):
        with pytest.raises(P.InvalidOption, match="not a valid JSON schema"):
            configure(JsonSchema, schema={"type": "object", "properties": {"a": {"type": 5}}})
        with pytest.raises(P.InvalidOption, match=r'Unimplemented keys: \["not"\]'):
            configure(JsonSchema, schema={"type": "object", "properties": {"a": {"not": {}}}})


def test_schemas_outlines_core_compiles_exactly_run_as_automata(vocab):
    """A sub-schema shared by two properties (written out twice), an empty enum inside a `default` value (an
    instance, not a schema), a property named "enum" or "default" (a schema by that name), an allOf of one
    schema beside annotations only, a property named "allOf", an enum whose values are all valid beside the
    keywords next to it, properties of a type that allows objects, pydantic's optional field, patterns that
    match only plain string content, number keywords beside a type that is not a number, and keywords that
    assert nothing compile to token automata."""
    integer = {"type": "integer"}
    for schema in ({"type": "object", "properties": {"a": integer, "b": integer}, "required": ["a", "b"]},
                   {"type": "object", "default": {"enum": []}, "properties": {"a": integer}, "required": ["a"]},
                   {"type": "object", "properties": {"enum": integer, "default": {"enum": [1]}},
                    "required": ["enum", "default"]},
                   {"title": "one schema", "allOf": [integer]}, {"type": "object", "properties": {"allOf": integer}},
                   {"type": "string", "enum": ["x", "y"], "maxLength": 1}, {"type": ["object", "null"], "properties": {}},
                   {"anyOf": [integer, {"type": "null"}], "default": None, "title": "what pydantic writes"},
                   {"type": "string", "pattern": "^[0-9]{5}$"}, {"type": "string", "pattern": r"[a-z_]+(-\d)*"},
                   {"type": ["string", "null"], "minimum": 3}, {"type": "array", "items": integer, "uniqueItems": False},
                   {"type": "object", "additionalProperties": integer}, {"type": "string", "minProperties": 3},
                   {"type": "object", "properties": {"a": integer}, "required": ["a"], "propertyNames": True,
                    "unevaluatedProperties": {}, "dependentRequired": {}, "dependentSchemas": {}}):
        constraint = configure(JsonSchema, schema=schema)
        assert constraint.dfa_obstacle is None, schema
        assert isinstance(constraint.bind(vocab, [EOS]), AutomatonProcessor)


# Schemas outlines-core would compile into a wrong automaton, or ignore part of, or take seconds over, each
# with a random walk that ends often enough: llguidance runs them.
RUN_BY_LLGUIDANCE = [
    ({"type": "integer", "minimum": -3, "exclusiveMaximum": 17}, "exclusiveMaximum, minimum, which outlines-core"),
    ({"type": "number", "minimum": 0.5, "maximum": 1}, "maximum, minimum"),
    ({"type": "integer", "multipleOf": 7}, "multipleOf"),
    ({"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, "oneOf, which outlines-core reads as anyOf"),
    ({"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 9}]}, "an allOf of several schemas"),
    ({"type": "string", "anyOf": [{"maxLength": 1}, {"minLength": 3, "maxLength": 4}]}, "type beside anyOf"),
    ({"$defs": {"n": {"type": "integer", "maximum": 5}}, "$ref": "#/$defs/n", "minimum": 3}, r"minimum beside \$ref"),
    ({"type": "string", "pattern": "^[0-9]+$", "maxLength": 3}, "a string pattern beside minLength/maxLength"),
    ({"type": "string", "pattern": "a.b"}, "a string pattern with one anchor, an alternation outside a group, or"),
    ({"type": "string", "pattern": "x|yz"}, "a string pattern with one anchor"),
    ({"type": "string", "pattern": "^ab"}, "a string pattern with one anchor"),
    ({"type": "string", "format": "date"}, "format, which outlines-core does not enforce"),
    ({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a", "z"]},
     "a required property that its properties do not list"),
    ({"type": "object", "properties": {'a"b': {"type": "boolean"}}, "required": ['a"b']}, "a property name holding a quote"),
    ({"type": "object", "properties": {"a": {"type": "boolean"}}, "patternProperties": {"^x[0-9]$": {"type": "null"}},
      "additionalProperties": False}, "^patternProperties beside properties"),
    ({"type": "array", "prefixItems": [{"type": "boolean"}], "items": {"type": "null"}, "maxItems": 2},
     "maxItems beside prefixItems"),
    ({}, "a schema that allows any JSON value"),
    ({"type": "object"}, "an object with no properties and no schema for its members"),
    ({"type": "array", "maxItems": 2}, "an array with no schema for its items"),
    ({"type": "object", "properties": {"a": True}, "required": ["a"]}, "a schema that is true or false"),
    # outlines-core reads min/maxProperties and writes {0,}; llguidance enforces one free key (more: refused)
    ({"type": "object", "additionalProperties": {"type": "boolean"}, "minProperties": 1}, "minProperties, which"),
    # a required recursion outlines-core cut 3 levels down, writing {"c":{"c":{"c":{}}}}
    ({"$defs": {"n": {"type": "object", "properties": {"c": {"anyOf": [{"$ref": "#/$defs/n"}, {"const": 0}]}},
                      "required": ["c"], "additionalProperties": False}}, "$ref": "#/$defs/n"}, "a recursive one"),
    ({"$defs": {"a/b": {"type": "integer"}}, "$ref": "#/$defs/a~1b"}, "a \\$ref to anything but the root or one of its"),
    # found by the second fuzz: a $ref to a schema the checks did not walk, one under a nested $id, a pattern
    # Rust reads as a POSIX class, and an enum value that only searching the pattern finds
    ({"type": "object", "properties": {"a": {"$ref": "#/x-lib/i"}}, "required": ["a"],
      "x-lib": {"i": {"type": "integer", "minimum": 5, "maximum": 9}}}, "a \\$ref to anything but the root"),
    ({"$defs": {"a": {"type": "string", "maxLength": 2}, "inner": {"$id": "http://example.com/inner",
      "$defs": {"a": {"type": "integer", "maximum": 9}}, "type": "object", "properties": {"v": {"$ref": "#/$defs/a"}},
      "required": ["v"]}}, "$ref": "#/$defs/inner"}, "an \\$id inside the schema"),
    ({"enum": ["abc", "a"], "type": "string", "pattern": "^a"}, 'the enum value "abc" is not valid'),
    # keywords that assert nothing, which llguidance refuses whatever their value, are left out of its copy
    ({"type": "array", "items": {"type": "string", "format": "date"}, "maxItems": 2, "uniqueItems": False,
      "unevaluatedItems": True, "additionalItems": {}}, "format, which outlines-core does not enforce"),
    ({"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"],
      "propertyNames": {}, "unevaluatedProperties": True, "dependentRequired": {}, "dependentSchemas": {}},
     "format, which outlines-core does not enforce"),
]


@pytest.mark.parametrize("schema, why", RUN_BY_LLGUIDANCE, ids=[json.dumps(s)[:40] for s, _ in RUN_BY_LLGUIDANCE])
def test_schemas_outlines_core_would_not_enforce_are_run_by_llguidance(schema, why, vocab, tokenizer):
    """Each is run by llguidance, and every text a random walk ends validates with jsonschema (formats
    checked); string patterns are matched whole, as outlines-core matches them."""
    constraint = configure(JsonSchema, schema=schema)
    assert re.search(why, constraint.dfa_obstacle), constraint.dfa_obstacle
    chain = Chain([constraint]).bind(vocab, [EOS])
    assert isinstance(chain.processors[0], GrammarProcessor)
    texts = [tokenizer.decode(ids) for seed in range(2) for ids in run_chain(chain, 16, 100, 1024, seed, every_row_ends=False)]
    assert len(texts) >= 4, texts
    checker = jsonschema.FormatChecker()
    whole = lambda node: {**node, "pattern": f"^(?:{node['pattern']})$"} if "pattern" in node else node
    for text in texts:
        jsonschema.validate(json.loads(text), whole(schema), format_checker=checker)


def test_an_enum_beside_a_pattern_python_cannot_match_whole_goes_to_llguidance():
    """(?i) inside ^(?:...)$ is an error to Python's re (it raised out of configure), not to Rust's regex."""
    for keyword, value in (("enum", ["abc"]), ("const", "abc")):
        constraint = configure(JsonSchema, schema={"type": "string", "pattern": "(?i)abc", keyword: value})
        assert f"a pattern beside the {keyword} that Python's re cannot match whole" in constraint.dfa_obstacle


def test_a_pattern_is_matched_whole_on_either_backend(vocab, tokenizer):
    """JSON Schema finds a pattern anywhere in the string; outlines-core matches it whole, and llguidance is
    made to: "[0-9]{2}" allows "12" and not "a12b", whichever backend runs the schema."""
    for schema in ({"type": "string", "pattern": "[0-9]{2}"}, {"type": "string", "pattern": "[0-9]{2}", "maxLength": 9}):
        bound = configure(JsonSchema, schema=schema).bind(vocab, [EOS])
        for text, whole in (('"12"', True), ('"a12b"', False), ('"123"', False)):
            assert accepts(bound, tokenizer.encode(text, add_special_tokens=False)) == whole, (schema, text)


@pytest.mark.parametrize("pattern, fits", [
    ("^[0-9]{5}$", True), ("[a-z]+(-[a-z]+)*", True), (r"^\d{3}x$", True), ("^(a|b)c$", True), ("^[ !#-~]$", False),
    # Rust's \w takes combining marks; it reads [[:alpha:]] as a POSIX class and && as an intersection
    (r"\w", False), ("[[:alpha:]]", False), ("[a-z&&[b-c]]x", False), ("[a--b]", False),
    ("^--v$", True), (r"[\[]", True), ("[]a]", True),
    ("a|b", False), ("^a|b$", False), ("^ab", False), ("ab$", False), ("a^b", False), (r"a\Z", False),
    ("a.b", False), ("[^a]", False), (r"a\sb", False), ('a"', False), (r"a\\", False), ("[ -~]", False),
    ("(?i)a", False), ("(?=a)a", False), (r"(a)\1", False), (r"\p{L}", False), ("a\x01", False), ("(", False),
])
def test_which_string_patterns_outlines_core_writes_exactly(pattern, fits):
    """Those anchored at both ends or not at all, with no bare alternation, whose texts are plain JSON
    string content (no quote, backslash or control character; `^[ !#-~]$` spans the backslash)."""
    assert schema_fit._pattern_fits(pattern) is fits


def accepts(bound, tokens: list[int]) -> bool:
    """Whether a bound constraint lets `tokens` through and then allows EOS."""
    chain = Chain([bound])
    sequence = torch.tensor([[0] + tokens], dtype=torch.long)
    states = chain.init(Context(sequence, 1, 1, 1024))
    for step in range(len(tokens) + 1):
        states, logits = chain.process(states, torch.zeros(1, 1024), Context(sequence, step + 1, 1, 1024))
        allowed = logits[0] > NEG_INF
        if step == len(tokens):
            return bool(allowed[EOS])
        if not allowed[tokens[step]]:
            return False


def test_json_strings_hold_every_character_json_can_write(vocab, tokenizer):
    """outlines-core's JSON string leaves out `\\uXXXX` escapes, so no control character but the five with
    short escapes could be written, and U+007F-U+009F written as they are. Ours has both, one character each
    as maxLength counts them, as jsonschema reads them."""
    schema = {"type": "object", "properties": {"log": {"type": "string", "maxLength": 4}}, "required": ["log"],
              "additionalProperties": False}
    bound = configure(JsonSchema, schema=schema).bind(vocab, [EOS])
    assert isinstance(bound, AutomatonProcessor)
    validator = jsonschema.Draft202012Validator(schema)
    for value, written in [("\x1b[0m", '"\\u001b[0m"'), ("\x7f\x85\x9f", '"\x7f\x85\x9f"'),
                           ("\x01\x02\u00e9x", '"\\u0001\\u0002\\u00E9x"'), ("\t\"", '"\\t\\""'),
                           ("\x01" * 5, '"' + "\\u0001" * 5 + '"'), ("\x01", '"\x01"'), (None, '"\\u001"')]:
        text = '{"log":' + written + "}"
        try:
            valid = validator.is_valid(json.loads(text)) and json.loads(text)["log"] == value
        except json.JSONDecodeError:
            valid = False
        assert accepts(bound, tokenizer.encode(text, add_special_tokens=False)) == valid, text
        assert valid == (value is not None and len(value) <= 4 and "\x01" not in written), text


def test_refs_outlines_core_would_cut_are_run_by_llguidance(vocab, tokenizer):
    """outlines-core unrolls $refs a few levels and then drops the property that goes deeper, required or
    not: a recursive schema, or refs chained past MAX_REF_DEPTH, run on llguidance, which nests as deep as
    the text goes; refs within the depth stay on the automaton."""
    node = {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}}
    recursive = configure(JsonSchema, schema={"$defs": {"node": node}, "$ref": "#/$defs/node"})
    assert "recursive" in recursive.dfa_obstacle
    bound = recursive.bind(vocab, [EOS])
    six_deep = '{"child":' * 6 + "{}" + "}" * 6
    assert accepts(bound, tokenizer.encode(six_deep, add_special_tokens=False))
    assert not accepts(bound, tokenizer.encode('{"child":{"child":1}}', add_special_tokens=False))
    chain = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/c"}, "c": {"type": "integer"}}, "$ref": "#/$defs/a"}
    assert "nested more than 2 deep" in configure(JsonSchema, schema=chain).dfa_obstacle
    assert isinstance(configure(JsonSchema, schema=chain).bind(vocab, [EOS]), GrammarProcessor)
    # a recursion under a property named like a keyword whose value is not a schema ("enum")
    under_enum = {"type": "object", "properties": {"enum": {"$ref": "#/$defs/a"}},
                  "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}}}}
    assert "recursive" in configure(JsonSchema, schema=under_enum).dfa_obstacle
    within = configure(JsonSchema, schema={**chain, "$ref": "#/$defs/b"})
    assert within.dfa_obstacle is None and isinstance(within.bind(vocab, [EOS]), AutomatonProcessor)


def test_a_schema_llguidance_starts_but_gives_up_on_a_token_in_is_refused_when_bound(vocab, tokenizer):
    """llguidance accepts an object of 700 optional properties and builds its parser, then gives up after
    the "{" ("Current row has 2807 items; max is 2000"): the bind steps a new parser a few tokens in, so
    that it is refused before a generation starts; at 300 its texts run."""
    def wide(count):
        return configure(JsonSchema, schema={"type": "object", "properties": {f"p{i}": {"type": "integer", "minimum": 0}
                                                                              for i in range(count)}})

    with pytest.raises(P.InvalidOption, match=r"the json_schema constraint is too large for llguidance's parser, which "
                                              r"gives up after 1 tokens: Parser Error: Current row has \d+ items; max is 2000"):
        wide(700).bind(vocab, [EOS])
    assert accepts(wide(300).bind(vocab, [EOS]), tokenizer.encode('{"p299": 7}', add_special_tokens=False))


def test_what_only_binding_can_tell_is_refused_when_bound(vocab):
    with pytest.raises(P.InvalidOption, match="not deterministic: state 0 has two transitions on token 5"):
        configure(Dfa, initial_state=0, transitions=[[0, 5, 1], [0, 5, 2]]).bind(vocab, [EOS])
    with pytest.raises(P.InvalidOption, match="eos_token_ids is empty"):
        configure(Regex, pattern="a").bind(vocab, [])
    with pytest.raises(P.InvalidOption, match="the constraint matches no text at all"):
        configure(Regex, pattern=r"[^\x00-\x{10FFFF}]").bind(vocab, [EOS])
    # what outlines-core's regex engine refuses with no word of why (llguidance's check lets these through)
    with pytest.raises(P.InvalidOption, match="option 'pattern' cannot be compiled: its regular expression holds what "
                                              "outlines-core's regex engine refuses: a look-around, a trailing backslash"):
        configure(Regex, pattern="a\\").bind(vocab, [EOS])
    with pytest.raises(P.InvalidOption, match=r"option 'schema' cannot be compiled: its regular expression \(from a "
                                              r"pattern or a count like maxItems or maxLength\)"):
        configure(JsonSchema, schema={"type": "array", "items": {"type": "null"}, "maxItems": 10**18}).bind(vocab, [EOS])
    tiny = Vocabulary((b"a", b"b", None))
    # the refusal names a character the shortest accepted text needs and no token holds, when there is one
    with pytest.raises(P.InvalidOption, match=r"cannot write any text .*: no token holds 'c' \(U\+0063\), which the "
                                              r"shortest text it accepts, 'abc', needs"):
        configure(Regex, pattern="a(b|c)c|cccc+").bind(tiny, [2])
    with pytest.raises(P.InvalidOption, match=r"no token holds 'é' \(U\+00E9\), which the shortest text it accepts, "
                                              r"'aé', needs"):
        configure(Regex, pattern="aé").bind(tiny, [2])
    with pytest.raises(P.InvalidOption, match=r"cannot write any text .*: its tokens cannot spell the shortest text "
                                              r"the constraint accepts, 'ba', nor any other"):
        configure(Regex, pattern="ba").bind(Vocabulary((b"ab", b"b", None)), [2])
    with pytest.raises(P.ProcessorError, match="not bound to a vocabulary"):
        Chain([configure(Regex, pattern="a")]).init(Context(torch.zeros(1, 2, dtype=torch.long), 1, 1, 1024))


def test_what_only_compiling_can_tell_is_refused_when_bound_and_remembered(vocab, monkeypatch):
    """A schema's regex grows 4x per level of nested arrays: it is built in the bounded child, and a
    failure is remembered, so asking again compiles nothing."""
    from processors.structured import compile as structured_compile

    children = []
    in_child = structured_compile._in_child
    monkeypatch.setattr(structured_compile, "_in_child", lambda *a: children.append(a) or in_child(*a))
    nested = '{"type":"array","items":' * 31 + '{"type":"integer"}' + "}" * 31
    for _ in range(2):
        with pytest.raises(P.InvalidOption, match="max_regex_chars|MiB|compile_timeout_s"):
            configure(JsonSchema, schema=nested, compile_timeout_s=20).bind(vocab, [EOS])
    assert len(children) == 1
    with pytest.raises(P.InvalidOption, match="cannot be compiled: maxLength must be greater than or equal to minLength"):
        configure(JsonSchema, schema={"type": "string", "minLength": 5, "maxLength": 2}).bind(vocab, [EOS])


def test_a_constraint_whose_tables_pass_their_limit_is_refused(vocab, monkeypatch, forks_here):
    monkeypatch.setattr(build_module, "MAX_TABLE_BYTES", 8 * 256 * 8)  # 8 rows of a byte table: its 8 states and the dead one are 9
    with pytest.raises(P.InvalidOption, match=r"its 8 states exceed 0 MiB of tables \(limit max_table_bytes\)"):
        configure(Regex, pattern="[a-z]{1,3}").bind(vocab, [EOS])
    structured_compile._failures.clear()
    monkeypatch.setattr(build_module, "covers_every_byte", lambda trie: False)  # compiled ahead
    monkeypatch.setattr(build_module, "MAX_TABLE_BYTES", 16 * 100)
    with pytest.raises(P.InvalidOption, match=r"transitions exceed 0 MiB of tables \(limit max_table_bytes\)"):
        configure(Regex, pattern="[a-z]{1,3}").bind(vocab, [EOS])
    automaton = configure(Regex, pattern="[0-9]").bind(vocab, [EOS]).automaton
    assert 0 < len(automaton.keys) - 1 <= 100
    assert len(forks_here.pids) == 3


def test_a_constraint_whose_masks_pass_their_limit_is_refused(vocab, monkeypatch, forks_here):
    """Compiled ahead (over a vocabulary that does not write every byte), its distinct masks are counted."""
    monkeypatch.setattr(build_module, "covers_every_byte", lambda trie: False)
    monkeypatch.setattr(build_module, "MAX_MASK_BYTES", 2 * vocab.size * 4)  # two distinct masks
    with pytest.raises(P.InvalidOption, match=r"its token masks exceed 0 MiB \(limit max_mask_bytes\)"):
        configure(Regex, pattern="[a-z]{1,3}").bind(vocab, [EOS])
    automaton = configure(Regex, pattern="[0-9]").bind(vocab, [EOS]).automaton  # digits, then nothing
    assert type(automaton) is TokenAutomaton and automaton.forbidden.shape == (2, vocab.size)


def test_a_constraint_whose_masks_would_pass_their_limit_over_every_byte_is_run_by_llguidance(vocab, tokenizer,
                                                                                             monkeypatch, forks_here):
    """Over a vocabulary that writes every byte, a schema or regex whose states would reserve more masks
    than the limit (a schema of some nesting over 128k tokens) is run by llguidance: once found,
    remembered, and the same through the compile thread's path (`compile`, then `bind` with what it
    made); every text a random walk ends validates, or matches. One within the limit is compiled lazily."""
    from outlines_core.json_schema import build_regex_from_schema

    as_regex = configure(Regex, pattern=build_regex_from_schema(json.dumps(NESTED)))  # about as many states
    states = min(len(c.bind(vocab, [EOS]).automaton.moves) for c in (configure(JsonSchema, schema=NESTED), as_regex))
    structured_compile._cache.clear()
    monkeypatch.setattr(build_module, "MAX_MASK_BYTES", (states - 1) * vocab.size * 4)
    constraint = configure(JsonSchema, schema=NESTED)
    assert not constraint.compiled_for(vocab)
    chain = Chain([constraint]).bind(vocab, [EOS])
    assert isinstance(chain.processors[0], GrammarProcessor) and len(forks_here.pids) == 3
    assert constraint.compiled_for(vocab) and isinstance(constraint.bind(vocab, [EOS]), GrammarProcessor)
    compiled = configure(JsonSchema, schema=NESTED).compile(vocab)
    assert isinstance(constraint.bind(vocab, [EOS], compiled=compiled), GrammarProcessor) and len(forks_here.pids) == 3
    texts = [tokenizer.decode(ids) for seed in range(2) for ids in run_chain(chain, 16, 120, 1024, seed, every_row_ends=False)]
    assert len(texts) >= 4, texts
    for text in texts:
        jsonschema.validate(json.loads(text), NESTED)
    assert type(configure(JsonSchema, schema={"type": "integer"}).bind(vocab, [EOS]).automaton) is LazyAutomaton
    chain = Chain([as_regex]).bind(vocab, [EOS])
    assert isinstance(chain.processors[0], GrammarProcessor) and as_regex.compiled_for(vocab)
    texts = [tokenizer.decode(ids) for ids in run_chain(chain, 16, 120, 1024, 0, every_row_ends=False)]
    assert len(texts) >= 2 and all(regex.fullmatch(as_regex.pattern, text) for text in texts), texts


@pytest.mark.parametrize("how", ["raises", "halfway", "stalls"])
def test_a_child_failing_while_it_sends_its_tables_is_a_crash_not_an_automaton(vocab, monkeypatch, forks_here, how):
    """Once the tables' header is out, a child that fails before its last array, or halfway through it,
    must not leave the parent with a half-filled automaton: the compile fails as a crash; and one that
    stops sending halfway (alive) must not hold the parent past its timeout."""
    from processors.structured import compile as structured_compile

    write, writes = forkserver_module.write_all, []
    send = forkserver_module.send_tables

    def cut(sender, made):  # in the child: every array but the last goes out whole
        writes.append(sum(isinstance(value, np.ndarray) for value in made.values()))
        send(sender, made)

    def failing(fd, data):
        writes[0] -= 1
        if writes[0] > 0:
            return write(fd, data)
        if how != "raises":
            write(fd, data[: len(data) // 2])
        if how == "stalls":
            time.sleep(60)  # killed by the parent at its timeout
        raise MemoryError

    monkeypatch.setattr(forkserver_module, "send_tables", cut)
    monkeypatch.setattr(forkserver_module, "write_all", failing)
    started = time.monotonic()
    with pytest.raises(P.InvalidOption, match="limit compile_timeout_s" if how == "stalls" else "or crashed"):
        configure(Regex, pattern="[0-9]{150}", compile_timeout_s=3).bind(vocab, [EOS])
    assert time.monotonic() - started < 30 and not structured_compile._cache
    assert len(forks_here.pids) == 1


def test_the_sentinel_is_written_only_where_the_text_cannot_end_before_it():
    """U+10FFFF marks where a pattern may end (README): where the text could also end right before it,
    it cannot be written; elsewhere it is an ordinary character."""
    byte_vocab = Vocabulary(tuple(bytes([b]) for b in range(256)) + (None,))
    sentinel = list("\U0010FFFF".encode())

    def walk(pattern, ids):
        automaton = configure(Regex, pattern=pattern).bind(byte_vocab, [256]).automaton
        state = automaton.initial
        for token in ids:
            state = automaton.step(state, token)
        return state != automaton.dead and bool(automaton.accepting[state])

    assert walk(r'"[^"]*"', [34, *sentinel, 34]) and walk(r"\x{10FFFF}", sentinel)
    assert not walk(".*", sentinel) and not walk(".*", [*sentinel, 97])
    assert walk(".*", [97, 98])


def test_anchors_mean_what_fullmatch_means_already(vocab, tokenizer):
    for pattern, plain in ((r"^[0-9]{3}$", "[0-9]{3}"), (r"\A[0-9]{3}\z", "[0-9]{3}"), ("^[:a]b$", "[:a]b")):
        chain = Chain([configure(Regex, pattern=pattern)]).bind(vocab, [EOS])
        for ids in run_chain(chain, 4, 10, 1024, seed=1):
            assert regex.fullmatch(plain, tokenizer.decode(ids))


@pytest.mark.parametrize("pattern, unanchored", [
    # each the pattern without the anchors a whole-text match makes redundant: the same language (checked below)
    (r"a\\$", r"a\\"),  # an escaped backslash, then the anchor (was read as an escaped $: "matches no text")
    (r"a\$", r"a\$"), ("a$|b$", "a|b"), ("^a|^b", "a|b"), ("(^ab$)", "(ab)"), ("^^a", "a"), ("(?:^a|b)$", "(?:a|b)"),
    ("(?i)^a$", "(?i)a"), ("(a|^b)c", "(a|b)c"), ("a|(b$)", "a|(b)"), ("(?P<n>^a)b$", "(?P<n>a)b"),
    ("[$^]a", "[$^]a"), (r"[\]^$]x$", r"[\]^$]x"), ("[[:alpha:]^]$", "[[:alpha:]^]"), (r"\x24$", r"\x24"),
    ("(?m)abc", "(?m)abc"),
    ("^[:a]b$", "[:a]b"),  # [: opening a class is no POSIX class (its $ was read into the class: "matches no text")
    ("^[[:^alpha:]a]b$", "[[:^alpha:]a]b"),
])
def test_anchors_that_always_hold_are_dropped(pattern, unanchored):
    assert anchors.unanchored(pattern) == unanchored
    for text in ("a", "b", "ab", "bc", "ac", "a\\", "a$", "$a", "^a", "]x", "$x", "xyz", "A", "$", "aa", "abc", ":b", "1b"):
        assert bool(regex.fullmatch(pattern, text)) == bool(regex.fullmatch(unanchored, text)), text


def test_anchors_inside_groups_nested_as_deep_as_the_limit_allows():
    """The parse walks groups in a loop: 3,000 nested groups made its recursion fail (RecursionError)."""
    deep = "(?:" * 3000 + "^a$" + ")" * 3000
    assert anchors.unanchored(deep) == "(?:" * 3000 + "a" + ")" * 3000
    with pytest.raises(P.InvalidOption, match="an anchor"):
        anchors.unanchored("(?:" * 3000 + "a^a" + ")" * 3000)


@pytest.mark.parametrize("pattern", ["a^b", "a$b", "(^a)*", "(a$)+b", "(?m)^a$", "(?x)a$", "(?m:^a)", "^*a", "a$+"])
def test_an_anchor_that_may_not_hold_is_refused_at_configure_time(pattern):
    with pytest.raises(P.InvalidOption, match=r"an anchor \(\^, \$, \\A, \\z\) is taken only at the start or the end"):
        configure(Regex, pattern=pattern)


def test_an_anchored_alternation_compiles_to_the_automaton_of_the_plain_one(vocab):
    anchored, plain = (configure(Regex, pattern=p).bind(vocab, [EOS]) for p in ("^ab$|^ba$", "ab|ba"))
    for text in ("ab", "ba", "aa", "b"):
        states = [bound.automaton.initial for bound in (anchored, plain)]
        for byte in text.encode():
            token = vocab.token_bytes.index(bytes([byte]))
            states = [bound.automaton.step(state, token) for bound, state in zip((anchored, plain), states)]
        ends = [state != bound.automaton.dead and bool(bound.automaton.accepting[state])
                for bound, state in zip((anchored, plain), states)]
        assert ends[0] == ends[1] == (text in ("ab", "ba"))


def test_a_pathological_pattern_is_stopped_by_its_timeout(vocab):
    """(a|b)*a(a|b){k} needs 2^k states: compiling is killed at compile_timeout_s, not waited for."""
    config = configure(Regex, pattern="(a|b)*a(a|b){40}", compile_timeout_s=0.5)
    started = time.perf_counter()
    with pytest.raises(P.InvalidOption, match="longer than compile_timeout_s = 0.5 s|more than .* MiB"):
        config.bind(vocab, [EOS])
    assert time.perf_counter() - started < 30


def test_a_compile_stopped_through_its_hook_kills_its_child_and_is_not_remembered(vocab, monkeypatch):
    """A caller that stops waiting stops the compile: its child is killed, not left to run out its
    timeout (300 s here), and nothing is cached or remembered, so the next call compiles again."""
    from collections import OrderedDict

    from processors.structured import compile as structured_compile

    monkeypatch.setattr(structured_compile, "_failures", OrderedDict())  # what other tests remembered aside
    monkeypatch.setattr(structured_compile, "_cache", OrderedDict())
    pids = []
    fork = structured_compile._forkserver.fork

    def spied(*args):
        child = fork(*args)
        pids.append(child.pid)
        return child

    monkeypatch.setattr(structured_compile._forkserver, "fork", spied)
    source = ("regex", "(a|b)*a(a|b){40}")
    key = (source, vocab.fingerprint)
    running = []

    def cancelled():  # asked before the child starts too; True from the first poll, the child seen running
        if pids and not running:
            running.append(os.path.exists(f"/proc/{pids[-1]}"))
        return bool(pids)

    with pytest.raises(structured_compile.CompileCancelled, match="cancelled"):
        structured_compile.compile_regex(source, vocab, 300, cancelled)
    assert running == [True]
    assert gone(pids[0])
    assert key not in structured_compile._failures and key not in structured_compile._cache
    assert not structured_compile.is_compiled(source, vocab, 300)

    # asked again, it compiles again (and fails on its own, shorter timeout)
    with pytest.raises(structured_compile.CompileTimedOut, match="compile_timeout_s = 0.5 s"):
        structured_compile.compile_regex(source, vocab, 0.5)
    assert len(pids) == 2 and gone(pids[1])
    # a shorter timeout is answered from that failure, naming its own limit
    with pytest.raises(structured_compile.CompileTimedOut, match="compile_timeout_s = 0.25 s: a compile of it ran 0.5 s"):
        structured_compile.compile_regex(source, vocab, 0.25)
    # and the same timeout from it too, as the same kind of error
    with pytest.raises(structured_compile.CompileTimedOut, match="compile_timeout_s = 0.5 s: a compile of it ran 0.5 s"):
        structured_compile.compile_regex(source, vocab, 0.5)
    assert len(pids) == 2
    # a timeout is no failure for a longer timeout: binding with one still takes a compile
    assert structured_compile.is_compiled(source, vocab, 0.5) and not structured_compile.is_compiled(source, vocab, 1)

    # a hook already set: no child at all
    quick = ("regex", "[0-9]{7}")
    with pytest.raises(structured_compile.CompileCancelled, match="before it started"):
        structured_compile.compile_regex(quick, vocab, 10, lambda: True)
    assert len(pids) == 2
    assert not structured_compile.is_compiled(quick, vocab)


def gone(pid: int, within_s: float = 10) -> bool:
    """Whether process `pid` ends within `within_s` (a killed child is reaped by the fork server's kernel)."""
    deadline = time.monotonic() + within_s
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.01)
    return not os.path.exists(f"/proc/{pid}")


def test_compiled_constraints_are_shared_per_vocabulary(vocab, tokenizer):
    first = configure(Regex, pattern="[0-9]{4}").bind(vocab, [EOS])
    again = configure(Regex, pattern="[0-9]{4}").bind(Vocabulary.from_tokenizer(tokenizer, 1024), [EOS])
    assert again.automaton is first.automaton
    other = configure(Regex, pattern="[0-9]{4}").bind(Vocabulary.from_tokenizer(tokenizer, 1030), [EOS])
    assert other.automaton is not first.automaton


def test_a_constraint_with_its_automaton_binds_it_without_the_cache(vocab, tokenizer, monkeypatch):
    """What the server binds after a compile thread compiled a constraint: that automaton, whatever the
    cache evicted meanwhile; bound to another vocabulary, the constraint compiles for that one."""
    from collections import OrderedDict

    from processors.structured import compile as structured_compile

    config = configure(Regex, pattern="[0-9]{5}")
    compiled = config.automaton(vocab)
    carried = config.with_compiled(vocab, compiled)
    other = Vocabulary.from_tokenizer(tokenizer, 1030)
    elsewhere = config.automaton(other)
    monkeypatch.setattr(structured_compile, "_cache", OrderedDict({(config.source(), other.fingerprint): elsewhere}))
    monkeypatch.setattr(structured_compile, "_in_child", lambda *a: pytest.fail("compiled again"))
    bound = Chain([carried]).bind(vocab, [EOS])
    assert bound.processors[0].automaton is compiled and carried.name == "regex"
    assert carried.bind(other, [EOS]).automaton is elsewhere


class SharedCounter(P.LogitsProcessor):
    """Bumblebee PR #425's example shape: one value for every row, kept as tensor([x])."""

    name = "shared_counter"

    def __init__(self, leading):
        self.leading = leading

    def init(self, context):
        return {"count": torch.tensor([0]) if self.leading else torch.tensor(0)}

    def process(self, state, logits, context):
        return {"count": state["count"] + 1}, logits


def test_state_shared_by_every_row_is_a_0_dim_tensor():
    context = Context(torch.zeros(4, 3, dtype=torch.long), 1, 1, 10)
    with pytest.raises(P.InvalidInput, match=r"processors\[0\] \(shared_counter\): state\['count'\] has shape \(1,\) "
                                             r"but there are 4 rows.*0-dim tensor"):
        Chain([SharedCounter(leading=True)]).init(context)
    chain = Chain([SharedCounter(leading=False)])
    states, _ = chain.process(chain.init(context), torch.zeros(4, 10), context)
    moved = chain.reorder(states, torch.tensor([3, 3, 0, 1]))
    assert moved[0]["count"].item() == 1
    # with one row, tensor([x]) is a per-row state and stays accepted
    Chain([SharedCounter(leading=True)]).init(Context(torch.zeros(1, 3, dtype=torch.long), 1, 1, 10))


class Appending(P.LogitsProcessor):
    """Keeps its per-row state right at `init`, then returns one that no longer leads with the rows."""

    name = "appending"

    def __init__(self, returned):
        self.returned = returned

    def init(self, context):
        return (torch.zeros(context.sequence.shape[0]),)

    def process(self, state, logits, context):
        return self.returned(state), logits


@pytest.mark.parametrize("returned, message", [
    (lambda s: (torch.cat([s[0], s[0][:1]]),), r"its returned state\[0\] has shape \(5,\) but there are 4 rows"),
    (lambda s: (s[0][:1],), r"its returned state\[0\] has shape \(1,\) but there are 4 rows"),
    (lambda s: (3,), r"its returned state\[0\] is of type int; a state is tensors"),
])
def test_a_state_that_stops_leading_with_the_rows_is_refused_at_the_step_that_returns_it(returned, message):
    """A state with one row too many still reorders without error (index_select never reads the extra row),
    so the rows would silently take another row's state; the step that returns it is refused, naming the
    processor by its place in the chain as given."""
    context = Context(torch.zeros(4, 3, dtype=torch.long), 1, 1, 10)
    chain = Chain([configure(P.Temperature, temperature=0.7), Appending(returned)])
    states = chain.init(context)
    with pytest.raises(P.InvalidInput, match=r"processors\[1\] \(appending\): " + message) as raised:
        chain.process(states, torch.zeros(4, 10), context)
    assert raised.value.index == 1


AMBIGUOUS = "start: s\ns: s s | /[a-z]/"  # a text of n letters reads in Catalan(n) ways


def test_a_grammar_step_longer_than_its_limit_stops_the_generation_naming_the_limit(vocab, tokenizer, monkeypatch):
    """An ambiguous grammar's steps take longer at every token: without a limit, 0.2 s a step at token 130
    and 2 s at 290 on the default model's vocabulary, until llguidance's own limit (2,000 items in a row) stopped
    it at 296. A step past `grammar_step_ms` raises, naming the limit, what the step took, and the processor's
    place in the chain as given (binding moves constraints first)."""
    monkeypatch.setattr(grammar_module, "_step_limit_s", 0.005)
    chain = Chain([configure(P.Temperature, temperature=0.7), configure(Grammar, grammar=AMBIGUOUS)]).bind(vocab, [EOS])
    letters = tokenizer.convert_tokens_to_ids(list("abcdefghij"))
    rows, steps = 2, 300
    sequence = torch.zeros(rows, steps + 1, dtype=torch.long)
    states = chain.init(Context(sequence, 1, 1, 1024))
    with pytest.raises(grammar_module.GrammarStepTooSlow) as raised:
        for step in range(steps):
            states, logits = chain.process(states, torch.zeros(rows, 1024), Context(sequence, step + 1, 1, 1024))
            assert (logits[:, letters] == 0).all()  # a letter is always allowed: the text goes on
            sequence[:, step + 1] = letters[step % len(letters)]
    error = raised.value
    assert (error.code, error.limit, error.maximum, error.index) == ("limit_exceeded", "grammar_step_ms", 5.0, 1)
    assert error.value > 5.0 and "for 2 rows, more than the limit of 5 ms (limit grammar_step_ms)" in str(error)
    with pytest.raises(ValueError, match="positive number of seconds"):
        grammar_module.set_step_limit_s(0)


def test_a_garbage_collection_inside_a_grammar_step_is_not_counted_against_its_limit(vocab, monkeypatch):
    """A full collection of a large heap (240-260 ms in the structured benchmark's process, holding several
    vocabularies' structures) that an allocation set off inside a step of llguidance's 0.2 ms failed the
    generation with grammar_step_ms. Here a collection that burns 100 ms of CPU runs inside each mask."""
    import llguidance.numpy as llg

    monkeypatch.setattr(grammar_module, "_step_limit_s", 0.05)

    def burn(phase, info):  # after the step's own callback: inside the collection it times
        if phase == "start":
            started = time.thread_time()
            while time.thread_time() - started < 0.1:
                pass

    def collecting(*args):
        gc.callbacks.append(burn)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(burn)
        return mask(*args)

    mask = llg.fill_next_token_bitmask
    monkeypatch.setattr(llg, "fill_next_token_bitmask", collecting)
    chain = Chain([configure(Grammar, grammar="start: /[a-z]+/")]).bind(vocab, [EOS])
    sequence = torch.zeros(1, 4, dtype=torch.long)
    states = chain.init(Context(sequence, 1, 1, 1024))
    for step in range(2):
        states, logits = chain.process(states, torch.zeros(1, 1024), Context(sequence, step + 1, 1, 1024))
        sequence[0, step + 1] = int(logits[0].isfinite().nonzero()[0])
    assert grammar_module._count_collection not in gc.callbacks  # registered only while a step runs


def test_the_grammars_of_one_generation_count_together_against_the_step_limit(vocab, tokenizer, monkeypatch):
    """Counted per grammar, 63 copies of the ambiguous grammar in one request (a comment apart) held the server
    for 6.4 s a step, each just under the limit (an outside-in helper). The grammars of one chain's step add up:
    the step is refused at the grammar whose time takes the sum past the limit, before any one alone passes it."""
    monkeypatch.setattr(grammar_module, "_step_limit_s", 0.005)
    copies = [configure(Grammar, grammar=f"{AMBIGUOUS}\n// copy {i}") for i in range(4)]
    chain = Chain(copies).bind(vocab, [EOS])
    letters = tokenizer.convert_tokens_to_ids(list("abcdefghij"))
    sequence = torch.zeros(1, 301, dtype=torch.long)
    states = chain.init(Context(sequence, 1, 1, 1024))
    with pytest.raises(grammar_module.GrammarStepTooSlow) as raised:
        for step in range(300):
            states, _ = chain.process(states, torch.zeros(1, 1024), Context(sequence, step + 1, 1, 1024))
            sequence[0, step + 1] = letters[step % len(letters)]
    # the four take about as long each: the sum passes 5 ms while each takes a quarter of it
    assert raised.value.index > 0 and "with the grammars before it in the chain" in str(raised.value)
