"""Constrained generation through the engine, from the tiny random default model, which never "wants" to
comply: every text must fullmatch its pattern (Python's `re`) or validate against its schema (`jsonschema`),
whatever the strategy, the number of rows, or whether it is streamed."""

import gc
import json
import re

import jsonschema
import pytest

from processors import Choice, Grammar, JsonSchema, Regex, TopK, configure
from sidecar.errors import InvalidProcessor

from .conftest import server_on_a_thread

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                      "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "role", "address"],
}
RANGE = {"type": "integer", "minimum": -40, "maximum": 300}
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
EMAIL = r"[a-z]{1,10}@[a-z]{2,8}\.(com|org|net)"
BYTE = r"(0|[1-9][0-9]?|1[0-9]{2}|2[0-4][0-9]|25[0-5])"  # an integer in [0, 255]
OPTIONS = ["no", "none", "nonetheless", "yes", "yes indeed"]
NESTED = 'start: "(" inner ")"\ninner: start? start?'


def balanced(text, finished=True):
    """Balanced parentheses; a text cut by max_new_tokens must be a prefix of one (never closes too much)."""
    depth = 0
    for c in text:
        depth += {"(": 1, ")": -1}[c]
        if depth < 0:
            return False
    return depth == 0 and bool(text) if finished else text.startswith("(")


def in_range(text):
    return re.fullmatch(BYTE, text) is not None and 0 <= int(text) <= 255


def valid_json(text):
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


CONSTRAINTS = {  # name: (config, check, max_new_tokens)
    "phone": (configure(Regex, pattern=PHONE), lambda t: re.fullmatch(PHONE, t) is not None, 24),
    "email": (configure(Regex, pattern=EMAIL), lambda t: re.fullmatch(EMAIL, t) is not None, 40),
    "choice": (configure(Choice, options=OPTIONS), lambda t: t in OPTIONS, 16),
    "integer range": (configure(Regex, pattern=BYTE), in_range, 8),
    "json": (configure(JsonSchema, schema=SCHEMA), valid_json, 400),
    # run by llguidance: outlines-core would not enforce the bounds
    "json integer range": (configure(JsonSchema, schema=RANGE), lambda t: -40 <= json.loads(t) <= 300, 8),
    "grammar": (configure(Grammar, grammar=NESTED), balanced, 200),
}


@pytest.mark.parametrize("name", ["phone", "email", "choice", "integer range", "json", "json integer range"])
def test_200_seeded_samples_all_comply(name, engine):
    config, check, budget = CONSTRAINTS[name]
    texts = []
    with engine.session() as session:
        for seed in range(25):
            result = session.generate("The answer:", max_new_tokens=budget, strategy="sample", seed=seed,
                                      num_samples=8, processors=[config])
            assert {s.finish_reason for s in result.sequences} == {"eos"}
            texts += [s.text for s in result.sequences]
    assert len(texts) == 200
    bad = [t for t in texts if not check(t)]
    assert not bad, bad[:5]
    assert len(set(texts)) > 1  # seeded sampling explores, it is not stuck on one text


def test_seeded_constrained_sampling_is_reproducible(engine):
    config = CONSTRAINTS["json"][0]
    with engine.session() as a, engine.session() as b:
        first = a.generate("x", max_new_tokens=400, strategy="sample", seed=11, num_samples=3, processors=[config])
        again = b.generate("x", max_new_tokens=400, strategy="sample", seed=11, num_samples=3, processors=[config])
    assert [s.token_ids for s in first.sequences] == [s.token_ids for s in again.sequences]


@pytest.mark.parametrize("name", ["phone", "choice", "json"])
def test_masks_keeping_their_few_tokens_generate_what_bias_rows_do(name, engine, monkeypatch):
    """Over a large vocabulary a mask allowing few tokens keeps their ids, and a step of several rows
    copies those tokens' logits instead of adding the mask's bias row: seeded samples and beams are
    the same token for token (the default model's 1,024 tokens keep none unless told to here)."""
    from collections import OrderedDict

    from processors.structured import automaton, compile as structured_compile

    config, _, budget = CONSTRAINTS[name]
    masked, copied = automaton.masked, []

    def counted(bias, kept, indices, logits):
        copied.append(sum(int(index) in kept for index in indices))
        return masked(bias, kept, indices, logits)

    monkeypatch.setattr(automaton, "masked", counted)

    def generated(kept):
        monkeypatch.setattr(structured_compile, "_cache", OrderedDict())
        monkeypatch.setattr(automaton, "KEEP_IDS_FROM_VOCAB", 0 if kept else 2**62)
        with engine.session() as session:
            sampled = [session.generate("The answer:", max_new_tokens=budget, strategy="sample", seed=seed,
                                        num_samples=8, processors=[config]) for seed in range(3)]
            beams = session.generate("The answer:", max_new_tokens=budget, strategy="beam", num_beams=4,
                                     num_return_sequences=4,
                                     processors=[config])
        return [[s.token_ids for s in r.sequences] for r in [*sampled, beams]], [s.score for s in beams.sequences]

    kept_ids, kept_scores = generated(True)
    assert sum(copied) > 100  # rows whose few tokens were copied
    copied.clear()
    assert generated(False) == (kept_ids, kept_scores) and not copied


def run(engine, session, name, strategy, rows, streamed):
    """One generate of the matrix; returns its texts and, when streamed, the streamed texts per sequence."""
    config, _, budget = (None, None, 12) if name == "free text" else CONSTRAINTS[name]
    options = {"max_new_tokens": budget, "strategy": strategy, "processors": [config] if config else []}
    if strategy == "sample":
        options.update(seed=5, num_samples=rows)
    elif strategy == "beam":
        options.update(num_beams=max(rows, 2), num_return_sequences=rows)
    if not streamed:
        return session.generate("Once", **options), None
    generation = session.stream("Once", **options)
    pieces = {}
    for event in generation:
        pieces[event.sequence] = pieces.get(event.sequence, "") + event.text
    return generation.result, pieces


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("strategy", ["greedy", "sample", "beam"])
@pytest.mark.parametrize("rows", [1, 3], ids=["one row", "three rows"])
@pytest.mark.parametrize("name", ["phone", "choice", "json", "grammar", "free text"])
def test_matrix(name, rows, strategy, streamed, engine):
    """{regex, choice, json, grammar, free text} x {one row, several} x {greedy, sampling, beam} x {streamed, not}.
    Several greedy rows are three sessions generating together, each equal to its solo run."""
    check = (lambda t: True) if name == "free text" else CONSTRAINTS[name][1]
    sessions = [engine.session() for _ in range(3 if strategy == "greedy" and rows > 1 else 1)]
    try:
        if len(sessions) > 1:
            config, _, budget = CONSTRAINTS.get(name, (None, None, 12))
            prompts = ["Once", "Once upon a time there", "A"]
            generations = [s.stream(p, max_new_tokens=budget, processors=[config] if config else [])
                           for s, p in zip(sessions, prompts)]
            while not all(g.done for g in generations):
                for g in generations:
                    next(g, None)
            results = [g.result for g in generations]
            with engine.session() as solo:
                for prompt, result in zip(prompts, results):
                    alone = solo.generate(prompt, max_new_tokens=budget, processors=[config] if config else [])
                    assert alone.token_ids == result.token_ids
            texts = [(r.text, r.finish_reason) for r in results]
        else:
            result, pieces = run(engine, sessions[0], name, strategy, rows, streamed)
            texts = [(s.text, s.finish_reason) for s in result.sequences]
            assert len(texts) == rows
            if pieces is not None and strategy != "beam":  # beam search streams nothing, its result has it all
                assert [pieces.get(i, "") for i in range(rows)] == [t for t, _ in texts]
        if name == "grammar":  # a random model may nest for ever: a text cut short must be a valid beginning
            assert all(balanced(t, finish == "eos") for t, finish in texts), texts
        elif name != "free text":
            assert all(finish == "eos" and check(t) for t, finish in texts), texts
    finally:
        for s in sessions:
            s.close()


def test_a_choice_continues_free_text_reusing_its_cache(engine):
    """outlines #667 / #781: free text, then a Choice that continues it, in one session."""
    with engine.session() as session:
        first = session.generate("Is it raining?", max_new_tokens=10)
        prompt = "Is it raining?" + first.text + " Answer:"
        answer = session.generate(prompt, max_new_tokens=8, processors=[configure(Choice, options=["yes", "no"])])
        assert answer.text in {"yes", "no"}
        prompt_tokens = len(engine.tokenizer.encode("Is it raining?", add_special_tokens=True))
        assert answer.stats.reused_tokens >= prompt_tokens + len(first.token_ids) - 2  # the whole first call, or nearly
        assert answer.stats.prefill_tokens == answer.stats.prompt_tokens - answer.stats.reused_tokens


def test_a_bad_constraint_changes_nothing(engine):
    slow = configure(Regex, pattern="(a|b)*a(a|b){40}", compile_timeout_s=0.3)
    with engine.session() as session:
        before = session.generate("Hello", max_new_tokens=4)
        history = list(session.history)
        with pytest.raises(InvalidProcessor, match="compile_timeout_s|MiB"):
            session.generate("Hello", max_new_tokens=4, processors=[slow])
        assert session.history == history
        assert session.generate("Hello", max_new_tokens=4).token_ids == before.token_ids


def test_a_constraint_on_a_tokenizer_wider_than_the_model_is_refused_typed(engine):
    """A tokenizer with more tokens than the model's logits (a token added, the embeddings not resized):
    the masks were as wide as the tokenizer, and the first step failed with a raw shape mismatch."""
    import copy

    from sidecar import Engine

    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.add_tokens(["<extra_token>"])
    assert len(tokenizer) == engine.vocab_size + 1
    wider = Engine(engine.model, tokenizer)
    with wider.session() as session:
        before = session.generate("Hello", max_new_tokens=4, eos_token_ids=[])
        with pytest.raises(InvalidProcessor, match=r"processors\[1\] \(regex\): the tokenizer has 1025 tokens, more than "
                                                   r"the model's 1024 logits"):
            session.generate("Hello", max_new_tokens=4, processors=[TopK(5), configure(Regex, pattern="[a-z]+")])
        assert session.generate("Hello", max_new_tokens=4, eos_token_ids=[]).token_ids == before.token_ids


def test_a_pattern_of_characters_written_by_several_tokens_runs(engine):
    """Byte-level BPE writes any text: an emoji takes several byte tokens, and the pattern compiles and runs."""
    with engine.session() as session:
        emoji = configure(Regex, pattern="\U0001F600+", compile_timeout_s=5)
        assert session.generate("Hello", max_new_tokens=8, processors=[emoji]).text.startswith("\U0001F600")


def test_a_long_pattern_is_run_by_llguidance_from_the_start(engine):
    """outlines-core's compile is quadratic in a pattern's states: a 30,000-character literal ran past its
    10 s timeout, a `Choice` of thousands of names too (helper-71). Past LONG_PATTERN_CHARS llguidance runs it,
    the same language; at the threshold the automaton still does."""
    from processors.structured.automaton import TokenAutomaton
    from processors.structured.lazy import LazyAutomaton
    from processors.structured.regular import LONG_PATTERN_CHARS

    names = [f"n{i:04d}{'xyz' * (i % 3)}" for i in range(700)]
    choice = configure(Choice, options=names)
    assert len(choice.source()[1]) > LONG_PATTERN_CHARS and choice.long
    assert not isinstance(choice.compile(engine.vocabulary), (TokenAutomaton, LazyAutomaton))
    literal = configure(Regex, pattern="a" * 30_000)
    with engine.session() as session:
        for seed in range(3):
            assert session.generate("Pick", strategy="sample", seed=seed, processors=[choice], max_new_tokens=12).text in names
        assert re.fullmatch("a+", session.generate("Say", processors=[literal], max_new_tokens=6).text)
    short = configure(Regex, pattern="b" * LONG_PATTERN_CHARS)
    assert not short.long and isinstance(short.compile(engine.vocabulary), (TokenAutomaton, LazyAutomaton))


def test_a_sample_row_left_with_nothing_is_invalid_logits_not_a_crash(engine):
    """min_new_tokens bans EOS where the choice can only end: every sample row is empty at once, or only
    some; either way the call fails typed and the session is as it was."""
    from processors import MinNewTokens
    from sidecar.errors import InvalidLogits

    with engine.session() as session:
        for rows in (1, 2, 4, 8):
            with pytest.raises(InvalidLogits, match="a row"):
                session.generate("x", max_new_tokens=10, strategy="sample", seed=3, num_samples=rows,
                                 processors=[configure(Choice, options=["ab"]),
                                             configure(MinNewTokens, min_new_tokens=5, eos_token_ids=[2])])
            assert session.history == []


@pytest.mark.parametrize("transitions", [[[0, 2, 0]], [[0, 2, 1], [1, 5, 1]]], ids=["loop on eos", "on to a state"])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_dfa_state_that_moves_only_on_eos_ends_the_text(engine, transitions, rows):
    """No accepting state, and the initial state's only transitions are on the EOS token: it can go nowhere
    else, so it gets EOS (never an all -inf row, which would be invalid_logits)."""
    from processors import Dfa

    with engine.session() as session:
        result = session.generate("hi", max_new_tokens=4, eos_token_ids=[2], strategy="sample", num_samples=rows, seed=1,
                                  processors=[configure(Dfa, initial_state=0, transitions=transitions)])
        assert [(s.token_ids, s.finish_reason) for s in result.sequences] == [([2], "eos")] * rows


def test_a_grammar_that_would_end_on_an_end_token_written_as_text_fails_typed_and_changes_nothing(engine):
    """`"a" <[2]> "b"`: after "a" only the EOS token may come, which would end the text short of the
    grammar. The call fails typed (it used to end with "a" and finish_reason eos), the session is as it was;
    with token 2 left out of eos_token_ids, the grammar writes it as text."""
    from processors import Grammar

    grammar = configure(Grammar, grammar='start: "a" <[2]> "b"')
    with engine.session() as session:
        for rows in (1, 3):
            with pytest.raises(InvalidProcessor, match="allows only 2 of eos_token_ids, whose writing ends the text short"):
                session.generate("x", max_new_tokens=6, strategy="sample", seed=1, num_samples=rows, processors=[grammar])
            assert session.history == []
        result = session.generate("x", max_new_tokens=6, eos_token_ids=[1], processors=[grammar])
        assert result.token_ids == engine.tokenizer.convert_tokens_to_ids(["a", "</s>", "b", "<s>"])
        assert result.finish_reason == "eos"
        # the request's end token, not llguidance's (the model's 2), ends a complete match
        for constraint in (configure(Grammar, grammar='start: "ab"'),
                           configure(JsonSchema, schema={"type": "integer", "minimum": 3, "maximum": 4})):
            for rows in (1, 2):
                done = session.generate("x", max_new_tokens=8, eos_token_ids=[5], strategy="sample", seed=1,
                                        num_samples=rows, processors=[constraint])
                assert all(s.finish_reason == "eos" and s.token_ids[-1] == 5 and 2 not in s.token_ids
                           for s in done.sequences), done.sequences


def generate_on_a_server(processor: dict, expect: str = "result") -> dict:
    """The `result` (or `error`, as `expect` says) of a server on a thread (`server_on_a_thread`) for a
    generate of 12 tokens constrained by `processor` on the default model."""
    with server_on_a_thread() as (send, messages, _):
        send({"id": 1, "op": "open_session", "model": "default", "session": "s"})
        send({"id": 2, "op": "generate", "session": "s", "prompt": "a", "max_new_tokens": 12, "processors": [processor]})
        replies = [messages.get(timeout=60) for _ in range(2)]
    assert [r["id"] for r in replies] == [1, 2] and expect in replies[1], replies
    return replies[1][expect]


def replies_until(messages, ids) -> list[dict]:
    """The replies (events left out) the server writes until it has answered every id in `ids`."""
    got = []
    while not set(ids) <= {r["id"] for r in got}:
        message = messages.get(timeout=60)
        if "event" not in message:
            got.append(message)
    return got


OPTIONS_600 = {"name": "choice", "options": {"options": [f"option {i}" for i in range(600)]}}  # 6 KB packed


def held_configuring(monkeypatch):
    """Holds the server's configuring thread, until the returned event is set, each time it configures;
    returns the event and the names of the threads that configure, in order."""
    import threading

    from sidecar import server as server_module

    release, threads, build = threading.Event(), [], server_module.build_processors

    def held(specs, rid):
        threads.append(threading.current_thread().name)
        if threads[-1] == "configure":
            assert release.wait(60)
        return build(specs, rid)

    monkeypatch.setattr(server_module, "build_processors", held)
    return release, threads


def test_large_processors_are_configured_off_the_main_thread_which_goes_on_meanwhile(default_dir, monkeypatch):
    """A generate whose processors pack into more than CONFIGURE_INLINE_BYTES is configured on the configuring
    thread (a schema's checks or a dfa's transitions held every stream up to 0.2-0.5 s): while that thread
    is held, a ping and a generate in another session are answered; released, the generate runs, then what
    was queued behind it in its session, in arrival order. Small processors are configured where they were."""
    release, threads = held_configuring(monkeypatch)
    with server_on_a_thread() as (send, messages, _):
        for rid, name in ((1, "a"), (2, "b")):
            send({"id": rid, "op": "open_session", "session": name})
        send({"id": 3, "op": "generate", "session": "a", "prompt": "x", "max_new_tokens": 8, "processors": [OPTIONS_600]})
        send({"id": 4, "op": "session_info", "session": "a"})
        send({"id": 5, "op": "ping"})
        send({"id": 6, "op": "generate", "session": "b", "prompt": "x", "max_new_tokens": 3,
              "processors": [{"name": "top_k", "options": {"k": 5}}]})
        first = replies_until(messages, [1, 2, 5, 6])
        assert sorted(r["id"] for r in first) == [1, 2, 5, 6] and all(r["ok"] for r in first), first
        release.set()
        rest = replies_until(messages, [3, 4])
    assert [r["id"] for r in rest] == [3, 4], rest
    assert rest[0]["result"]["text"] in OPTIONS_600["options"]["options"]
    assert rest[1]["result"]["history_tokens"] > 0  # it ran after the generate
    assert sorted(threads) == ["configure", "serving"], threads


def test_processors_configured_off_the_main_thread_fail_typed_or_are_cancelled_with_one_reply(default_dir, monkeypatch):
    """Refused there, the request gets the refusal configuring gives anywhere, and its session is as it was;
    cancelled while it is configured, it gets its `cancelled` reply at once and nothing more, and what waits
    behind it runs."""
    from sidecar.server import build_processors

    release, threads = held_configuring(monkeypatch)
    release.set()
    bad = {"name": "choice", "options": {**OPTIONS_600["options"], "no_such_option": 1}}
    with pytest.raises(InvalidProcessor) as configured:
        build_processors([bad], 1)
    with server_on_a_thread() as (send, messages, _):
        send({"id": 1, "op": "open_session", "session": "a"})
        send({"id": 2, "op": "generate", "session": "a", "prompt": "x", "max_new_tokens": 2, "processors": [bad]})
        send({"id": 3, "op": "session_info", "session": "a"})
        refused, info = replies_until(messages, [1, 2, 3])[1:]
        assert refused["error"] == {"code": "invalid_processor", "message": configured.value.message, "index": 0}
        assert info["result"]["history_tokens"] == 0
        release.clear()
        send({"id": 4, "op": "generate", "session": "a", "prompt": "x", "max_new_tokens": 8, "processors": [OPTIONS_600]})
        send({"id": 5, "op": "cancel", "target": 4})
        assert sorted((r["id"], r.get("error", {}).get("code")) for r in replies_until(messages, [4, 5])) == [(4, "cancelled"), (5, None)]
        send({"id": 6, "op": "generate", "session": "a", "prompt": "x", "max_new_tokens": 2, "processors": []})
        release.set()
        assert [r["id"] for r in replies_until(messages, [6])] == [6]
        send({"id": 7, "op": "ping"})
        assert [r["id"] for r in replies_until(messages, [7])] == [7]  # nothing more came for 4
    assert sorted(threads) == ["configure", "configure", "serving"], threads  # the refused, the cancelled, the last


def test_the_server_keeps_its_heap_frozen_and_an_unload_frees_the_model_at_once(default_dir):
    """Full collections walked the 356,000 objects of the modules a server imports (190-220 ms, a pause of
    every stream): the server freezes what it starts with (`gc.freeze`). An engine is a web of cycles, so an
    unloaded model came back only at some later full collection (a real model's gigabytes; measured, two
    copies of a 200 MB model held across load and unload cycles): the server collects it at once (the
    startup model, frozen, by giving the heap back to the collector and freezing it again). The collector's
    own runs are off here, so that only the server's can free it.
    A finished generate's request is freed by reference counting alone: nothing of it is left in a cycle,
    nor held by the threads that configured and compiled its processors."""
    import weakref

    from sidecar.server import Server

    started = []
    start_generation = Server._start_generation

    def recording(server, job):
        started.append(weakref.ref(job))
        start_generation(server, job)

    gc.disable()
    try:
        with server_on_a_thread() as (send, messages, server):
            server._start_generation = recording.__get__(server)
            send({"id": 1, "op": "open_session", "model": "default", "session": "s"})
            send({"id": 2, "op": "generate", "session": "s", "prompt": "a", "max_new_tokens": 4,
                  "processors": [OPTIONS_600]})  # configured on the configuring thread, compiled on a compile thread
            send({"id": 3, "op": "ping"})  # answered once the loop is past the frame that delivered the result
            assert all(r["ok"] for r in replies_until(messages, [1, 2, 3]))
            assert len(started) == 1 and started[0]() is None  # the job: no cycle through its generation
            frozen = gc.get_freeze_count()
            assert frozen > 100_000, frozen
            send({"id": 4, "op": "load_model", "name": "later"})  # loaded while serving: not frozen
            assert replies_until(messages, [4])[0]["ok"]
            for name, rid in (("later", 5), ("default", 6)):
                engine = weakref.ref(server.engines[name])
                send({"id": rid, "op": "unload_model", "model": name})
                assert replies_until(messages, [rid])[0]["ok"]
                assert engine() is None, name
                assert gc.get_freeze_count() > 100_000, gc.get_freeze_count()
    finally:
        gc.enable()


def test_an_unloaded_model_that_something_still_holds_is_logged(default_dir, caplog):
    """Its memory stays, so the server says so, rather than walking the heap for nothing in silence."""
    with server_on_a_thread() as (send, messages, server):
        held = server.engines["default"].model  # what a defect of ours would hold
        send({"id": 1, "op": "unload_model", "model": "default"})
        assert replies_until(messages, [1])[0]["ok"] and "default" not in server.engines
    assert "an unloaded model is still referred to" in caplog.text
    del held


def test_an_unload_drops_what_was_compiled_over_a_vocabulary_no_loaded_model_has(default_dir):
    """Compiled automata (up to 512 MiB), llguidance's parsers and its view of a vocabulary are kept per
    vocabulary, which models with one tokenizer share: the last unload of a model with that vocabulary
    drops them, an unload of another one keeps them."""
    from processors.structured import compile as compiled, grammar, vocabulary

    def kept(fingerprint):  # whether each holds anything over it (other tests' constraints too)
        return [any(key[1] == fingerprint for key in compiled._cache), any(key[2] == fingerprint for key in grammar._started),
                fingerprint in vocabulary._LLGUIDANCE]

    constrained = [{"name": "regex", "options": {"pattern": "[a-z]{1,5}"}},
                   {"name": "grammar", "options": {"grammar": 'start: "ab" | "cd"'}}]
    with server_on_a_thread() as (send, messages, server):
        send({"id": 1, "op": "load_model", "name": "twin"})  # the embedded model again
        for model, session, first in (("default", "a", 2), ("twin", "b", 5)):
            send({"id": first, "op": "open_session", "model": model, "session": session})
            for offset, processor in enumerate(constrained, start=1):
                send({"id": first + offset, "op": "generate", "session": session, "prompt": "x", "max_new_tokens": 4,
                      "processors": [processor]})
        assert all(r["ok"] for r in replies_until(messages, range(1, 8)))
        fingerprint = server.engines["default"].vocabulary.fingerprint
        assert fingerprint == server.engines["twin"].vocabulary.fingerprint and kept(fingerprint) == [True] * 3
        send({"id": 8, "op": "unload_model", "model": "default"})
        assert replies_until(messages, [8])[0]["ok"] and kept(fingerprint) == [True] * 3  # the twin has it
        send({"id": 9, "op": "unload_model", "model": "twin"})
        assert replies_until(messages, [9])[0]["ok"] and kept(fingerprint) == [False] * 3


def test_a_compile_that_ends_after_its_models_unload_keeps_nothing(default_dir, monkeypatch):
    """An llguidance parser is built to its end even when nobody waits for it any more: one that ends after
    the unload of the last model with its vocabulary is dropped when its end reaches the main thread, not
    kept (with that vocabulary's view) until some later unload."""
    import threading

    from processors.structured import grammar, vocabulary

    building, release, start = threading.Event(), threading.Event(), grammar._start

    def held(*args):
        building.set()
        assert release.wait(60)
        return start(*args)

    monkeypatch.setattr(grammar, "_start", held)
    with server_on_a_thread() as (send, messages, server):
        ended = []
        compiled = server._compiled
        server._compiled = lambda task: (compiled(task), ended.append(task))
        send({"id": 1, "op": "open_session", "model": "default", "session": "s"})
        send({"id": 2, "op": "generate", "session": "s", "prompt": "x", "max_new_tokens": 4,
              "processors": [{"name": "grammar", "options": {"grammar": 'start: "held" | "back"'}}]})
        assert building.wait(60)
        fingerprint = server.engines["default"].vocabulary.fingerprint
        send({"id": 3, "op": "unload_model", "model": "default"})
        replies = [r for r in replies_until(messages, [1, 2, 3]) if r["id"] != 1]
        assert [r.get("error", {}).get("code") for r in replies] == ["session_closed", None], replies
        release.set()
        for _ in range(600):  # the compile thread ends, then the main thread reads its end
            if ended:
                break
            threading.Event().wait(0.1)
        send({"id": 4, "op": "ping"})
        assert ended and replies_until(messages, [4])[0]["ok"]
        assert not any(key[2] == fingerprint for key in grammar._started) and fingerprint not in vocabulary._LLGUIDANCE


def test_a_large_dfa_is_made_into_tables_on_a_compile_thread(default_dir, monkeypatch):
    """Its tables take about 5 us a transition (0.1 s for the most a request carries): over
    DFA_INLINE_TRANSITIONS, a compile thread makes them, and its tokens are checked against the vocabulary
    all the same."""
    from processors.structured.automaton import TokenAutomaton
    from processors.structured.constraints import DFA_INLINE_TRANSITIONS

    made = threads_calling(monkeypatch, TokenAutomaton, "from_transitions")
    count = DFA_INLINE_TRANSITIONS + 500
    chain = [[state, 5 + state % 50, state + 1] for state in range(count)]
    result = generate_on_a_server({"name": "dfa", "options": {"initial_state": 0, "transitions": chain}})
    assert result["token_ids"] == [5 + state % 50 for state in range(12)]
    assert len(made) == 1 and made[0].startswith("compile-"), made
    outside = generate_on_a_server({"name": "dfa", "options": {"initial_state": 0, "transitions": chain + [[count, 5000, 0]]}},
                                   expect="error")
    assert outside["code"] == "invalid_processor" and "5000" in outside["message"], outside


def threads_calling(monkeypatch, module, name: str) -> list[str]:
    """The names of the threads that call `module.name` from now on, in order (the list fills as they do)."""
    import threading

    threads, function = [], getattr(module, name)

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return function(*args)

    monkeypatch.setattr(module, name, recorded)
    return threads


def test_the_server_binds_what_its_compile_thread_compiled(default_dir, monkeypatch):
    """The server compiles a constraint on a compile thread and its generation binds that automaton, not
    the compile cache's copy: with a cache that keeps nothing (as if another compile evicted it before the
    bind), the constraint is still compiled once, off the thread that runs every generation."""
    from processors.structured import compile as structured_compile

    builds = threads_calling(monkeypatch, structured_compile, "_build")
    monkeypatch.setattr(structured_compile, "_store", lambda key, automaton: None)  # the cache keeps nothing
    result = generate_on_a_server({"name": "regex", "options": {"pattern": "q[0-9]{3}z[a-c]{2}"}})
    assert re.fullmatch("q[0-9]{3}z[a-c]{2}", result["text"])
    assert len(builds) == 1 and builds[0].startswith("compile-"), builds


@pytest.mark.parametrize("processor, check", [
    ({"name": "grammar", "options": {"grammar": 'start: "q" /[0-9]{3}/ "z"'}}, lambda text: re.fullmatch("q[0-9]{3}z", text)),
    ({"name": "json_schema", "options": {"schema": {"type": "integer", "minimum": 3, "maximum": 900}}},
     lambda text: 3 <= json.loads(text) <= 900),
], ids=["grammar", "json_schema run by llguidance"])
def test_the_server_starts_llguidance_on_its_compile_thread(processor, check, default_dir, monkeypatch):
    """llguidance builds a grammar's parser over the vocabulary in up to a second (a schema of
    max_pattern_chars): the server has a compile thread build it, and the generation binds that one, with a
    cache that keeps nothing as above."""
    from processors.structured import grammar

    builds = threads_calling(monkeypatch, grammar, "_start")
    checks = threads_calling(monkeypatch, grammar, "_on_deep_stack")  # llguidance's check and build
    monkeypatch.setattr(grammar, "STARTED", 0)  # the cache keeps nothing
    assert check(generate_on_a_server(processor)["text"])
    assert len(builds) == 1 and builds[0].startswith("compile-"), builds
    assert len(checks) == 2 and all(thread.startswith("compile-") for thread in checks), checks


def test_a_schema_whose_masks_would_pass_their_limit_is_started_by_llguidance_on_the_compile_thread(default_dir,
                                                                                                    monkeypatch):
    """A schema the compile finds too large for its automaton's masks over the model's vocabulary (a
    nested schema over 128k tokens) is run by llguidance, started on the compile thread as above; the
    server binds what that made."""
    from processors.structured import compile as structured_compile
    from processors.structured import grammar
    from processors.structured.build import MasksTooLarge

    def too_large(source, *args):
        raise MasksTooLarge("the schema's states would reserve more masks than the limit (limit max_mask_bytes)")

    monkeypatch.setattr(structured_compile, "_build", too_large)
    builds = threads_calling(monkeypatch, grammar, "_start")
    monkeypatch.setattr(grammar, "STARTED", 0)  # the cache keeps nothing
    schema = {"enum": ["too large", "for masks"]}
    assert json.loads(generate_on_a_server({"name": "json_schema", "options": {"schema": schema}})["text"]) in schema["enum"]
    assert len(builds) == 1 and builds[0].startswith("compile-"), builds


def test_llguidance_refuses_on_the_compile_thread_what_it_refused_when_configured(default_dir, monkeypatch):
    """llguidance's check of a schema it runs (0.42 s for a new one of max_pattern_chars) is made by the
    compile, off the thread that runs every session; its refusal is the one configuring gives."""
    from processors.structured import grammar

    checks = threads_calling(monkeypatch, grammar, "_on_deep_stack")
    schema = {"type": "integer", "minimum": 0, "not": {"const": 3}}
    from sidecar.server import build_processors

    with pytest.raises(InvalidProcessor) as configured:
        build_processors([{"name": "json_schema", "options": {"schema": schema}}], 1)
    reply = generate_on_a_server({"name": "json_schema", "options": {"schema": schema}}, expect="error")
    assert reply == {"code": "invalid_processor", "message": configured.value.message, "index": 0}
    assert checks[0] == "MainThread" and checks[1:] and all(thread.startswith("compile-") for thread in checks[1:]), checks
