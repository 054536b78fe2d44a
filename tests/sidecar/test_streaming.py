"""Streaming, incremental detokenization, stop strings and EOS."""

import contextlib
import gc
import weakref

import pytest

from sidecar.errors import InvalidLogits
from sidecar.text import Detokenizer, StopMatcher

from .conftest import tokens

TRICKY = "héllo wörld, 日本語のテキスト 🎉🎉 ok"


def test_detokenizer_never_splits_a_character(engine):
    ids = engine.tokenizer.encode(TRICKY)
    assert len(ids) > len(TRICKY.split())  # multi-byte characters do span several tokens
    detokenizer = Detokenizer(engine.tokenizer)
    pieces = [detokenizer.push(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detokenizer.flush() == TRICKY
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
