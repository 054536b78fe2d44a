"""Streaming, incremental detokenization, stop strings and EOS."""

import contextlib
import gc
import os
import signal
import time
import weakref

import pytest
import torch

import processors as P
from sidecar.errors import InvalidLogits
from sidecar.text import ByteDetokenizer, Detokenizer, StopMatcher, detokenizer

from .conftest import tokens

TRICKY = "héllo wörld, 日本語のテキスト 🎉🎉 ok"


def test_detokenizer_never_splits_a_character(engine):
    ids = engine.tokenizer.encode(TRICKY)
    assert len(ids) > len(TRICKY.split())  # multi-byte characters do span several tokens
    for text in (detokenizer(engine.tokenizer, engine.vocabulary),
                 Detokenizer(engine.tokenizer, engine.vocabulary.token_bytes)):
        pieces = [text.push(t) for t in ids]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) + text.flush() == TRICKY
        assert "" in pieces  # some token completed no character on its own


@pytest.mark.parametrize("stops, chunks", [
    (("END",), ["abc E", "N", "D tail"]),
    (("xyz", "EN"), ["abc E", "N", "D tail"]),
    (("never",), ["abc n", "e", "v", "er"]),
])
def test_stop_matcher_holds_back_possible_stops(stops, chunks):
    matcher = StopMatcher(stops)
    emitted = "".join(matcher.feed(c) for c in chunks) + ("" if matcher.stopped else matcher.flush())
    text = "".join(chunks)
    expected = text[: min(text.find(s) for s in stops if s in text)] if any(s in text for s in stops) else text
    assert emitted == expected and matcher.stopped == (emitted != text)


def test_the_replacement_character_of_a_character_cut_by_the_end_is_no_stop(engine):
    """Ending by length two bytes into an emoji leaves U+FFFD at the end of the text (those bytes). That
    is no text the model wrote: a stop string "\ufffd" does not match it (it used to, giving finish_reason
    "stop" for the very tokens that ended by "length"), nor does one ending with it."""
    emoji = engine.tokenizer.encode("\U0001F600", add_special_tokens=False)
    assert len(emoji) == 4  # one byte token each
    bias = [[emoji[:1], 50.0]] + [[emoji[i : i + 2], 100.0] for i in range(3)]  # the emoji, again and again
    from processors import SequenceBias, configure

    options = dict(max_new_tokens=6, processors=[configure(SequenceBias, sequence_bias=bias)])
    with engine.session() as session:
        plain = session.generate("Hi", **options)
        assert plain.text == "\U0001F600\ufffd" and plain.finish_reason == "length"
        for stop in ("\ufffd", "\U0001F600\ufffd"):
            stopped = session.generate("Hi", stop=[stop], **options)
            assert (stopped.text, stopped.token_ids, stopped.finish_reason) == (plain.text, plain.token_ids, "length")
    matcher = StopMatcher(("b\ufffd",))
    assert matcher.feed("ab\ufffd") == "a" and matcher.stopped  # one the model wrote whole still stops
    matcher = StopMatcher(("b\ufffd",))
    assert matcher.feed("a") + matcher.feed_last("b\ufffd") == "ab\ufffd" and not matcher.stopped


class ByteTokenizer:
    """Tokens that are the bytes given, decoded as a byte-level BPE decodes them (invalid bytes as U+FFFD)."""

    def __init__(self, table: dict[int, bytes | None]):
        self.table = table  # None: a special token, skipped

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return b"".join(self.table[i] or b"" for i in ids).decode("utf-8", "replace")

    def detokenizer(self, kind="window"):
        """The tokenizer's decoding of a window (tokenizers whose texts are not their tokens' bytes joined), or
        the bytes decoded as they come (`texts_join`, which these are): the same text."""
        token_bytes = [self.table[i] for i in range(len(self.table))]
        return Detokenizer(self, token_bytes) if kind == "window" else ByteDetokenizer(token_bytes)


BYTES = ByteTokenizer({0: b"\x80", 1: b"\xe4", 2: b"\xb8", 3: b"\xad", 4: b"x", 5: None, 6: b" ab\xe4\xba", 7: b"\xba",
                       8: b"a", 9: b"\xef\xbf\xbd"})


@pytest.mark.parametrize("before", [[0] * 30, [0] * 31, [5] * 30, [9] * 10, [5] * 29 + [0]])
@pytest.mark.parametrize("kind", ["window", "bytes"])
def test_a_character_after_many_held_tokens_is_not_lost(before, kind):
    """Read from the text alone, tokens were held while it ended in U+FFFD, and let go at MAX_HELD with
    the U+FFFD of 中's first bytes in it: its last byte then decoded to no new text, and 中 was lost (found
    from outside: 30 invalid bytes, real U+FFFD or skipped special tokens, then 中)."""
    ids = before + [1, 2, 3, 4]
    detokenizer = BYTES.detokenizer(kind)
    pieces = [detokenizer.push(t) for t in ids]
    assert "".join(pieces) + detokenizer.flush() == BYTES.decode(ids)
    assert BYTES.decode(ids).endswith("中x")


@pytest.mark.parametrize("kind", ["window", "bytes"])
def test_the_text_a_token_decided_goes_out_with_it_even_when_it_ends_inside_a_character(kind):
    """The token " ab" with the first two bytes of 人: its piece was '' (held whole), so a stop inside it
    was found a token late, and a cancel then dropped text the token had decided."""
    detokenizer = BYTES.detokenizer(kind)
    assert [detokenizer.push(t) for t in (6, 7, 4)] == [" ab", "人", "x"]
    matcher = StopMatcher(("b",))
    assert matcher.feed(BYTES.detokenizer(kind).push(6)) == " a" and matcher.stopped


@pytest.mark.parametrize("kind", ["window", "bytes"])
def test_a_replacement_character_the_model_wrote_is_text_and_stops(kind):
    """U+FFFD written whole (EF BF BD) was held back like the bytes of a character still incomplete, found
    by a stop string a token late, and never at the end, where every trailing U+FFFD was taken for cut bytes."""
    detokenizer = BYTES.detokenizer(kind)
    assert [detokenizer.push(t) for t in (8, 9)] == ["a", "\ufffd"] and not detokenizer.cut()
    assert detokenizer.flush() == ""
    matcher = StopMatcher(("\ufffd",))
    assert matcher.feed("a") + matcher.feed_last("\ufffd", cut=False) == "a" and matcher.stopped
    cut = BYTES.detokenizer(kind)
    assert [cut.push(t) for t in (8, 1)] == ["a", ""] and cut.flush() == "\ufffd" and cut.cut()


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_the_pieces_of_random_token_sequences_add_up_to_their_decoding(engine, kind):
    """Text tokens, special tokens (which write nothing) and, byte-level, tokens that split or break
    characters, at random, after a few input tokens. The engine's detokenizer of these tokenizers (their
    tokens' bytes decoded) gives what the tokens add to the input's decoding; the window of the decoder's
    text (the detokenizer of other tokenizers), the decoding of the tokens alone. With SentencePiece's
    decoder a "▁" first in what is decoded loses its space: a first version of the window let tokens that
    wrote nothing go, and the space after a special token was lost. (SentencePiece's byte-fallback tokens
    are left out: a run of them that is not UTF-8 decodes to one U+FFFD a byte only as a whole, its ASCII
    bytes included, where the engine's text has the bytes decoded as they come: test_tokenizers.)"""
    import random
    import re

    from processors.structured.vocabulary import Vocabulary
    from tests.processors.test_structured import sentencepiece_tokenizer

    tokenizer = engine.tokenizer if kind == "byte-level" else sentencepiece_tokenizer()
    vocabulary = Vocabulary.from_tokenizer(tokenizer)
    token_bytes = vocabulary.token_bytes
    assert vocabulary.texts_join
    specials = sorted(tokenizer.all_special_ids)
    surfaces = tokenizer.convert_ids_to_tokens(list(range(len(token_bytes))))
    text = [i for i, b in enumerate(token_bytes) if b and not re.fullmatch(r"<0x[0-9A-F]{2}>", surfaces[i])]
    for seed in range(200):
        rng = random.Random(seed)
        drawn = [rng.choice(specials) if rng.random() < 0.2 else rng.choice(text) for _ in range(rng.randint(4, 44))]
        given, ids = tokenizer.encode("Once", add_special_tokens=False), drawn[3:]
        window = Detokenizer(tokenizer, token_bytes)
        pieces = [window.push(t) for t in ids]
        assert "".join(pieces) + window.flush() == tokenizer.decode(ids, skip_special_tokens=True), ids
        engines = detokenizer(tokenizer, vocabulary, given)
        pieces = [engines.push(t) for t in ids]
        before = tokenizer.decode(given, skip_special_tokens=True)
        added = tokenizer.decode(given + ids, skip_special_tokens=True)[len(before):]
        assert "".join(pieces) + engines.flush() == added, ids


def test_a_stop_on_a_replacement_character_the_model_wrote_ends_the_generation_there(engine):
    from processors import configure
    from processors.structured import Dfa

    written = engine.tokenizer.encode("a\ufffdb", add_special_tokens=False)
    assert len(written) == 5  # "a", the three bytes of U+FFFD, "b"
    forced = configure(Dfa, initial_state=0, transitions=[(i, t, i + 1) for i, t in enumerate(written)],
                       accepting_states=[len(written)])
    with engine.session() as session:
        for stop, text in (("\ufffd", "a"), ("a\ufffd", "")):
            result = session.generate("Hi", stop=[stop], max_new_tokens=8, processors=[forced])
            # found at the token that completed it, not one later (nor, at the end, never)
            assert (result.text, result.finish_reason, result.token_ids) == (text, "stop", written[:4])


def test_stream_events_add_up_to_the_result(engine):
    with engine.session() as session:
        generation = session.stream(prompt="The processor keeps", max_new_tokens=25, strategy="sample", seed=3)
        events = list(generation)
        result = generation.result
        assert [e.token_id for e in events] == result.token_ids
        assert "".join(e.text for e in events) == result.text
        assert result.text == engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_stop_string_trims_the_output(engine):
    prompt = tokens(10, seed=21)
    with engine.session() as session:
        full = session.generate(token_ids=prompt, max_new_tokens=30, eos_token_ids=[])
        stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
        stopped = session.generate(token_ids=prompt, max_new_tokens=30, eos_token_ids=[], stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.find(stop)]
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)] and len(stopped.token_ids) < 30


def test_eos_ends_generation(engine):
    prompt = tokens(10, seed=22)
    with engine.session() as session:
        full = session.generate(token_ids=prompt, max_new_tokens=20, eos_token_ids=[])
        eos = full.token_ids[5]
        first = full.token_ids.index(eos)
        ended = session.generate(token_ids=prompt, max_new_tokens=20, eos_token_ids=[999, eos])
    assert ended.finish_reason == "eos" and ended.token_ids == full.token_ids[: first + 1]
    assert ended.text == engine.tokenizer.decode(full.token_ids[:first], skip_special_tokens=True)


def test_zero_new_tokens(engine):
    with engine.session() as session:
        result = session.generate(prompt="hello", max_new_tokens=0)
    assert (result.text, result.token_ids, result.finish_reason) == ("", [], "length")


def test_cancel_keeps_the_tokens_so_far(engine):
    with engine.session() as session:
        generation = session.stream(token_ids=tokens(8, seed=23), max_new_tokens=50, eos_token_ids=[])
        events = [next(generation) for _ in range(4)]
        generation.cancel()
        assert generation.result.finish_reason == "cancelled"
        assert generation.result.token_ids == [e.token_id for e in events]
        follow = session.generate(token_ids=tokens(8, seed=23) + generation.result.token_ids, max_new_tokens=2)
        assert follow.stats.reused_tokens == 8 + 4 - 1


def test_a_stream_closes_as_a_generator_does(engine):
    """`contextlib.closing` ends a stream on the way out, as it would a generator: cancelled, tokens kept."""
    with engine.session() as session:
        with contextlib.closing(session.stream(token_ids=tokens(8, seed=24), max_new_tokens=50, eos_token_ids=[])) as stream:
            first = next(stream)
        assert stream.result.finish_reason == "cancelled" and stream.result.token_ids == [first.token_id]
        assert not session.busy


def interrupting(at: int, steps: list):
    """A processor that raises KeyboardInterrupt (as Ctrl-C would) at its `at`-th step, counting its steps in `steps`."""
    def interrupted(logits, context):
        steps.append(context.length)
        if len(steps) == at:
            raise KeyboardInterrupt
        return logits

    return interrupted


def test_ctrl_c_during_generate_cancels_it_and_frees_the_session(engine):
    """A KeyboardInterrupt in the middle of `generate` (here from a processor, at its fourth step) ends the
    call as a cancel does: the session is free, its last result the tokens so far; an interactive shell
    that keeps the traceback (and the generation in it) alive does not keep the generation running."""
    steps = []
    interrupted = interrupting(at=4, steps=steps)
    prompt = tokens(8, seed=25)
    with engine.session() as session:
        with pytest.raises(KeyboardInterrupt) as caught:
            session.generate(token_ids=prompt, max_new_tokens=50, eos_token_ids=[], processors=[interrupted])
        assert not session.busy and session.last.finish_reason == "cancelled" and len(session.last.token_ids) == 3
        # `caught` keeps the exception, its traceback and the generation in it alive from here on
        with engine.session() as other:  # the engine goes on without it
            other.generate(token_ids=prompt, max_new_tokens=5, eos_token_ids=[])
        assert len(steps) == 4 and len(session.last.token_ids) == 3
        again = session.generate(token_ids=prompt, max_new_tokens=4, eos_token_ids=[])
        with engine.session() as fresh:
            assert again.token_ids == fresh.generate(token_ids=prompt, max_new_tokens=4, eos_token_ids=[]).token_ids


def test_ctrl_c_in_one_run_of_a_tick_leaves_the_others_of_that_tick_exact(engine):
    """A KeyboardInterrupt out of the first run of a step leaves the runs after it without their logits:
    planning a step changes nothing, so they run it again at the next step, and every stream still
    gives its solo tokens."""
    steps = []
    interrupted = interrupting(at=3, steps=steps)
    prompts = [tokens(n, seed=40 + n) for n in (6, 9, 13)]
    solo = []
    for prompt in prompts:
        with engine.session() as session:
            solo.append(session.generate(token_ids=prompt, max_new_tokens=6, eos_token_ids=[]).token_ids)
    sessions = [engine.session() for _ in range(4)]
    try:
        victim = sessions[3].stream(token_ids=prompts[0], max_new_tokens=6, eos_token_ids=[], processors=[interrupted])
        streams = [s.stream(token_ids=p, max_new_tokens=6, eos_token_ids=[]) for s, p in zip(sessions, prompts)]
        got = [[next(stream).token_id] for stream in streams]
        assert engine.scheduler.running[0] is victim._run  # admitted first: the others take their logits after it
        with pytest.raises(KeyboardInterrupt):  # out of whichever stream's step it comes
            for _ in range(6):
                for stream, ids in zip(streams, got):
                    ids.append(next(stream).token_id)
        assert len(steps) == 3
        victim.close()
        for stream, ids in zip(streams, got):
            ids += [event.token_id for event in stream]
        assert got == solo
    finally:
        for session in sessions:
            session.close()


def solo_tokens(engine, prompt, max_new_tokens):
    with engine.session() as session:
        return session.generate(token_ids=prompt, max_new_tokens=max_new_tokens, eos_token_ids=[]).token_ids


def equals_a_fresh_session(engine, session, max_new_tokens=4):
    """Whether the session's cache holds its history as computed: a call continuing it equals a fresh one."""
    prompt = session.history + [5]
    got = session.generate(token_ids=prompt, max_new_tokens=max_new_tokens, eos_token_ids=[]).token_ids
    return got == solo_tokens(engine, prompt, max_new_tokens)


def ticking_beside_a_victim(engine, first, second, seeds):
    """Two streams of 10 tokens: `first`'s, and `second`'s whose processor raises KeyboardInterrupt at its fourth
    step; returns their prompts, their solo tokens and the two streams."""
    prompts = [tokens(7, seed=seeds[0]), tokens(11, seed=seeds[1])]
    solo = [solo_tokens(engine, p, 10) for p in prompts]
    ticking = first.stream(token_ids=prompts[0], max_new_tokens=10, eos_token_ids=[])
    victim = second.stream(token_ids=prompts[1], max_new_tokens=10, eos_token_ids=[],
                           processors=[interrupting(at=4, steps=[])])
    return prompts, solo, ticking, victim


def test_ctrl_c_in_another_streams_step_cancels_that_stream_where_it_stood(engine):
    """Ctrl-C lands in whatever the step runs, here another stream's processors: that stream's step is half
    taken (its token fed, the next not chosen), so it is cancelled where it stood; going on, it fed its
    last token a second time, one position on, and every token after was wrong."""
    with engine.session() as first, engine.session() as second:
        prompts, solo, ticking, victim = ticking_beside_a_victim(engine, first, second, seeds=(61, 62))
        got = []
        with pytest.raises(KeyboardInterrupt):  # out of the step `ticking` runs, in the victim's processors
            for _ in range(10):
                got.append(next(ticking).token_id)
        got += [event.token_id for event in ticking]  # the thread's own call goes on, if it wants
        assert got == solo[0]
        assert [event.token_id for event in victim] == solo[1][:3]
        assert victim.result.finish_reason == "cancelled" and victim.result.token_ids == solo[1][:3]
        assert second.history == prompts[1] + solo[1][:3] and not second.busy
        assert equals_a_fresh_session(engine, second) and equals_a_fresh_session(engine, first)


def test_a_second_ctrl_c_while_a_step_is_made_whole_does_not_stop_the_mending(engine):
    """Pressed twice, Ctrl-C landed in `_interrupted` too, here as the stopped stream is cancelled: that
    stream was left half-stepped among the running ones, its session busy, and the next step fed its last
    token again. A real SIGINT, sent to this process from inside the mending, is held off until it ends."""
    signalled = []
    with engine.session() as first, engine.session() as second:
        prompts, solo, ticking, victim = ticking_beside_a_victim(engine, first, second, seeds=(71, 72))
        finish = victim._run.finish

        def finish_with_a_second_ctrl_c(reason):
            if not signalled:
                signalled.append(reason)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler runs in between (or, held off, does nothing)
            return finish(reason)

        victim._run.finish = finish_with_a_second_ctrl_c
        got = []
        with pytest.raises(KeyboardInterrupt):
            for _ in range(10):
                got.append(next(ticking).token_id)
        assert signalled == ["cancelled"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        got += [event.token_id for event in ticking]
        assert got == solo[0]
        assert victim.result.finish_reason == "cancelled" and victim.result.token_ids == solo[1][:3]
        assert not second.busy and equals_a_fresh_session(engine, second) and equals_a_fresh_session(engine, first)


def test_a_ctrl_c_while_a_step_stopped_otherwise_is_mended_is_raised_after(engine, monkeypatch):
    """The mending holds Ctrl-C off; when the step was stopped by something else (here the decode group's copy
    failing to allocate), a Ctrl-C pressed meanwhile is the user's only one: it was dropped, now it is raised
    once the step is whole, and the streams go on exactly."""
    import sidecar.kv

    signalled, dissolve = [], sidecar.kv.DecodeGroup.dissolve

    def out_of_memory(group, caches, chain=()):
        raise MemoryError("the group's copy could not allocate (simulated)")

    def dissolve_with_a_ctrl_c(group):
        if not signalled:
            signalled.append(True)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs in between, held off
        return dissolve(group)

    prompts = [tokens(6, seed=73), tokens(9, seed=74)]
    solo = [solo_tokens(engine, p, 8) for p in prompts]
    with engine.session() as first, engine.session() as second:
        streams = [s.stream(token_ids=p, max_new_tokens=8, eos_token_ids=[]) for s, p in zip((first, second), prompts)]
        got = [[next(stream).token_id] for stream in streams]
        monkeypatch.setattr(sidecar.kv.DecodeGroup, "update", out_of_memory)
        monkeypatch.setattr(sidecar.kv.DecodeGroup, "dissolve", dissolve_with_a_ctrl_c)
        with pytest.raises(KeyboardInterrupt) as caught:
            got[0].append(next(streams[0]).token_id)
        monkeypatch.undo()
        assert signalled and isinstance(caught.value.__context__, MemoryError)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        for stream, ids in zip(streams, got):  # no run was taking its own part of the step: both go on, exact
            ids += [event.token_id for event in stream]
        assert got == solo


def test_ctrl_c_while_sessions_join_the_decode_group_leaves_no_part_of_it(engine, monkeypatch):
    """The group's copy stopped part-way left some layers' buffers behind: the next group had more buffers
    than layers, and every later step of sessions decoding together failed with an IndexError."""
    import sidecar.kv

    made, zeros = [], torch.zeros

    def stopped_after_two_layers(*size, **options):
        if len(size) == 4 and size[0] == 2:  # a group's buffer of a layer: [members, heads, capacity, dim]
            made.append(size)
            if len(made) == 5:
                raise KeyboardInterrupt
        return zeros(*size, **options)

    prompts = [tokens(6, seed=63), tokens(9, seed=64)]
    solo = [solo_tokens(engine, p, 8) for p in prompts]
    with engine.session() as first, engine.session() as second:
        streams = [s.stream(token_ids=p, max_new_tokens=8, eos_token_ids=[]) for s, p in zip((first, second), prompts)]
        got = [[], []]
        monkeypatch.setattr(sidecar.kv.torch, "zeros", stopped_after_two_layers)
        with pytest.raises(KeyboardInterrupt):
            for _ in range(8):
                for stream, ids in zip(streams, got):
                    ids.append(next(stream).token_id)
        monkeypatch.undo()
        assert len(made) == 5 and engine.store.group.keys == [] and engine.store.group.members == []
        for stream, ids in zip(streams, got):  # no run was taking its step: both go on, exact
            ids += [event.token_id for event in stream]
        assert got == solo
    with engine.session() as first, engine.session() as second:  # and sessions still decode together
        streams = [s.stream(token_ids=p, max_new_tokens=8, eos_token_ids=[]) for s, p in zip((first, second), prompts)]
        assert [[event.token_id for event in stream] for stream in streams] == solo


def test_ctrl_c_as_a_prompt_takes_its_first_chunk_cancels_it_alone(engine, monkeypatch):
    """The run a Ctrl-C cancelled in the middle of a step stayed among the running ones until the next step,
    which planned its prompt again into a cache put back to nothing: that step's forward pass failed, and
    with it every other generation of the step."""
    from sidecar.generation import Run

    prompts = [tokens(n, seed=72 + n) for n in (9, 11, 14)]
    solo = [solo_tokens(engine, p, 6) for p in prompts]
    sessions = [engine.session() for _ in prompts]
    try:
        streams = [s.stream(token_ids=p, max_new_tokens=6, eos_token_ids=[]) for s, p in zip(sessions, prompts)]
        accept = Run.accept

        def interrupted_once(run, fed, logits):
            if run is streams[0]._run and not run.stats.prefill_tokens:
                raise KeyboardInterrupt  # as a signal landing as it takes its first chunk's logits
            return accept(run, fed, logits)

        monkeypatch.setattr(Run, "accept", interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            next(streams[0])
        assert [event.token_id for event in streams[1]] == solo[1]
        assert [event.token_id for event in streams[2]] == solo[2]
        assert list(streams[0]) == [] and streams[0].result.finish_reason == "cancelled"
        assert sessions[0].history == [] and not sessions[0].busy  # it ran nothing: as before the call
    finally:
        for session in sessions:
            session.close()


def test_ctrl_c_as_a_cache_grows_leaves_its_bytes_counted_right(engine, monkeypatch):
    """The store counted a cache's new buffers before it took them: a Ctrl-C between the two (where the
    count noted its peak) left the count off by them for good, and the budget with it."""
    from sidecar.kv import KVStore

    store, note_peak, raised = engine.store, KVStore.note_peak, []

    def interrupted_once(self):
        if not raised:
            raised.append(True)
            raise KeyboardInterrupt
        note_peak(self)

    with engine.session() as session:
        monkeypatch.setattr(KVStore, "note_peak", interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            session.generate(token_ids=tokens(12, seed=80), max_new_tokens=4, eos_token_ids=[])
        monkeypatch.undo()
        assert raised and store.used_bytes == sum(c.nbytes for c in store._caches.values()) + store.group.nbytes
        assert equals_a_fresh_session(engine, session)


def test_a_stream_whose_processor_init_raised_ctrl_c_ends_cancelled_on_the_next_call(engine):
    """`next()` again after a KeyboardInterrupt out of a processor's `init` was an AttributeError from a
    run that had started decoding without rows."""
    class Interrupting(P.LogitsProcessor):
        name = "interrupting"

        def init(self, context):
            raise KeyboardInterrupt

        def process(self, state, logits, context):
            return state, logits

    prompt = tokens(8, seed=65)
    with engine.session() as session:
        stream = session.stream(token_ids=prompt, max_new_tokens=5, eos_token_ids=[], processors=[Interrupting()])
        with pytest.raises(KeyboardInterrupt):
            next(stream)
        assert list(stream) == [] and stream.result.finish_reason == "cancelled" and stream.result.token_ids == []
        assert session.history == prompt and not session.busy and equals_a_fresh_session(engine, session)


def test_a_processor_raising_stop_iteration_fails_the_call_instead_of_ending_it(engine):
    """StopIteration out of `next()` would end a stream as if it were done (and `generate` return None):
    it is raised as a RuntimeError, as Python does for a generator (PEP 479), and the session is put back."""
    def stray_next(logits, context):
        if context.length - context.input_length == 2:
            next(iter(()))  # a bug in the processor
        return logits

    prompt = tokens(8, seed=26)
    with engine.session() as session:
        with pytest.raises(RuntimeError, match="a processor raised StopIteration") as caught:
            session.generate(token_ids=prompt, max_new_tokens=8, processors=[stray_next])
        assert isinstance(caught.value.__cause__, StopIteration)
        stream = session.stream(token_ids=prompt, max_new_tokens=8, processors=[stray_next])
        with pytest.raises(RuntimeError):
            list(stream)
        assert isinstance(stream.error, RuntimeError) and stream.result is None
        assert session.history == [] and not session.busy


def test_a_failed_stream_raises_once_and_keeps_its_error(engine):
    def nan_at_the_second_step(logits, context):
        return logits + float("nan") if context.length - context.input_length >= 1 else logits

    with engine.session() as session:
        stream = session.stream(token_ids=tokens(8, seed=25), max_new_tokens=5, processors=[nan_at_the_second_step])
        with pytest.raises(InvalidLogits):
            list(stream)
        assert list(stream) == []  # exhausted, as a generator that raised is
        assert isinstance(stream.error, InvalidLogits)


def test_a_finished_call_is_not_kept_by_its_session(engine):
    """What makes a session busy is found in the scheduler, not kept beside: a finished call's run (its
    processors' states, its sequences) goes with its stream."""
    with engine.session() as session:
        stream = session.stream(token_ids=tokens(6, seed=27), max_new_tokens=3, eos_token_ids=[],
                                processors=[lambda logits, context: logits])
        list(stream)
        run = weakref.ref(stream._run)
        del stream
        gc.collect()
        assert run() is None and not session.busy and len(session.last.token_ids) == 3
