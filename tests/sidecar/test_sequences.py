"""Sequences that can be continued (outlines #781), against a reference: a fresh session given the same
token ids. The continued session must give the same tokens, and its stats must say exactly what it reused."""

import pytest

from processors import Choice, Regex, SuppressTokens, configure
from sidecar.errors import (
    ContextOverflow, EmptyInput, InvalidArgument, InvalidLogits, SampleMismatch, TokenizerMismatch, UnknownStrategy,
)
from sidecar.sequences import Tokens

from .conftest import unshared

PROMPT = "Once upon a time"
FREE = dict(max_new_tokens=8, eos_token_ids=[])


def fresh(engine, ids, **options):
    with unshared(engine).session() as reference:
        return reference.generate(token_ids=list(ids), **options)


def same(result, expected) -> None:
    assert [s.token_ids for s in result.sequences] == [s.token_ids for s in expected.sequences]
    assert [s.text for s in result.sequences] == [s.text for s in expected.sequences]


def test_a_sequence_continues_from_all_its_ids_and_reuses_its_cache(engine):
    with engine.session() as session:
        first = session.generate(PROMPT, **FREE)
        prompt_ids = engine.tokenizer.encode(PROMPT)
        assert first.sequences[0].prompt_ids == prompt_ids
        assert first.sequences[0].all_ids == prompt_ids + first.token_ids == session.history
        assert first.tokens.ids == tuple(session.history)
        whole = session.generate(first, **FREE)
        same(whole, fresh(engine, session.history[: len(prompt_ids) + 8], **FREE))
        # the cache held everything but the last generated token, which had never been fed
        assert whole.stats.reused_tokens == len(prompt_ids) + 8 - 1
        assert whole.stats.prefill_tokens == 1


@pytest.mark.parametrize("k", [1, 3, 7, 12, -1, -5])
def test_a_prefix_of_k_tokens_reuses_k_minus_one(engine, k):
    """The last input token is always fed again: it gives the logits of the first new token."""
    with engine.session() as session:
        first = session.generate(PROMPT, **FREE)
        ids = first.tokens.ids
        cut = first[:k]
        assert cut.ids == ids[:k] and isinstance(cut, Tokens)
        result = session.generate(cut, **FREE)
        same(result, fresh(engine, ids[:k], **FREE))
        assert result.stats.reused_tokens == len(ids[:k]) - 1
        assert result.stats.prefill_tokens == 1


def test_seeded_sampling_continues_as_a_fresh_session_would(engine):
    options = dict(strategy="sample", seed=11, max_new_tokens=6, eos_token_ids=[])
    with engine.session() as session:
        first = session.generate(PROMPT, **options)
        continued = session.generate(first[:-2] + " and", **options)
        ids = first.tokens.ids[:-2] + tuple(engine.tokenizer.encode(" and", add_special_tokens=False))
        same(continued, fresh(engine, ids, **options))
        assert continued.stats.reused_tokens == len(first.tokens.ids) - 2


def test_appending_text_appends_its_own_tokens_and_ids_append_as_they_are(engine):
    with engine.session() as session:
        first = session.generate(PROMPT, **FREE)
    text = " — héllo 😀"
    encode = lambda text: tuple(engine.tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    assert (first + text).ids == first.tokens.ids + encode(text)
    assert (first + [5, 6]).ids == first.tokens.ids + (5, 6)
    assert (first[:3] + "x" + (9,)).ids == first.tokens.ids[:3] + encode("x") + (9,)
    assert first + "" == first.tokens


def test_a_character_cut_rounds_down_to_a_token_boundary_never_inside_a_character(engine):
    """Byte-level tokens spell 😀 and ö in several tokens: a cut between them goes back to before the character."""
    with engine.session() as session:
        first = session.generate("héllo 😀 wörld", max_new_tokens=6, eos_token_ids=[])
    tokens, decode = first.tokens, lambda ids: engine.tokenizer.decode(list(ids), skip_special_tokens=True)
    text = tokens.text
    assert text == decode(tokens.ids)
    for n in range(len(text) + 1):
        cut = tokens.cut(n)
        k = len(cut)
        assert cut.ids == tokens.ids[:k]
        assert len(decode(cut.ids)) <= n and text.startswith(decode(cut.ids))
        # the largest such k: every longer prefix is too long or ends inside a character
        assert all(len(decode(tokens.ids[:j])) > n or not text.startswith(decode(tokens.ids[:j]))
                   for j in range(k + 1, len(tokens) + 1))
    assert decode(tokens.cut(6).ids) == "héllo " and len(tokens.cut(6)) == 6
    assert decode(tokens.cut(7).ids) == "héllo 😀" and len(tokens.cut(7)) == 10  # all 4 of the emoji's tokens, or none
    assert first.cut(len(text)) == tokens


def test_free_text_then_a_choice_then_beams_continue_one_sequence(engine):
    """outlines #781: generators of different kinds continue the same sequence, each reusing the cache."""
    with engine.session() as session:
        story = session.generate(PROMPT, **FREE)
        asked = story + " Is it good? Answer:"
        choice = configure(Choice, options=["yes", "no"])
        answer = session.generate(asked, max_new_tokens=4, processors=[choice])
        assert answer.text in {"yes", "no"}
        same(answer, fresh(engine, asked.ids, max_new_tokens=4, processors=[choice]))
        assert answer.stats.reused_tokens == len(story.tokens) - 1
        more = answer + " Because"
        beams = session.generate(more, strategy="beam", num_beams=3, num_return_sequences=2, max_new_tokens=5)
        same(beams, fresh(engine, more.ids, strategy="beam", num_beams=3, num_return_sequences=2, max_new_tokens=5))
        assert beams.stats.reused_tokens == len(answer.tokens) - 1
        assert beams.sequences[1].all_ids == list(more.ids) + beams.sequences[1].token_ids
        digits = configure(Regex, pattern="[0-9]{3}")
        then = session.generate(beams.sequences[1] + " n=", max_new_tokens=6, processors=[digits])
        assert then.text.isdigit() and len(then.text) == 3
        # beams leave the input cached (not the beams): the second beam reuses all of the input
        assert then.stats.reused_tokens == len(more)


def test_another_sample_reuses_only_the_input_and_stats_say_so(engine):
    options = dict(strategy="sample", seed=5, num_samples=3, max_new_tokens=6, eos_token_ids=[])
    with engine.session() as session:
        samples = session.generate(PROMPT, **options)
        prompt = len(samples.sequences[0].prompt_ids)
        assert len({tuple(s.token_ids) for s in samples.sequences}) > 1
        with session.fork() as twin:  # the first sample too: several sequences leave only the input cached
            first = twin.generate(samples.sequences[0], **FREE)
            same(first, fresh(engine, samples.sequences[0].all_ids, **FREE))
            assert first.stats.reused_tokens == prompt
            assert first.stats.prefill_tokens == len(samples.sequences[0].token_ids)
        third = samples.sequences[2]
        continued = session.generate(third, **FREE)
        same(continued, fresh(engine, third.all_ids, **FREE))
        assert continued.stats.reused_tokens == prompt
        assert continued.stats.prefill_tokens == len(third.token_ids)


def test_a_result_of_several_sequences_is_continued_one_sequence_at_a_time(engine):
    with engine.session() as session:
        samples = session.generate(PROMPT, strategy="sample", seed=5, num_samples=3, max_new_tokens=4)
        history, cached = list(session.history), session.cached
        for attempt in (lambda: session.generate(samples), lambda: samples[:3], lambda: samples + "x",
                        lambda: samples.cut(2)):
            with pytest.raises(SampleMismatch) as caught:
                attempt()
            assert caught.value.details == {"sequences": 3}
        beams = session.generate(PROMPT, strategy="beam", num_beams=2, num_return_sequences=2, max_new_tokens=3)
        history, cached = list(session.history), session.cached
        with pytest.raises(SampleMismatch):
            session.generate(beams, max_new_tokens=2)
        assert (session.history, session.cached, session.last) == (history, cached, beams)


def test_a_sequence_of_another_engine_is_refused(engine, gpt2_engine):
    with gpt2_engine.session() as other:
        theirs = other.generate(PROMPT, max_new_tokens=3)
    with engine.session() as session:
        with pytest.raises(TokenizerMismatch):
            session.generate(theirs, max_new_tokens=3)
        with pytest.raises(TokenizerMismatch):
            session.generate(theirs.sequences[0][:2], max_new_tokens=3)
        assert session.history == [] and session.last is None
        assert session.generate(token_ids=list(theirs.tokens.ids), max_new_tokens=3).stats.prompt_tokens == len(theirs.tokens)


@pytest.mark.parametrize("attempt, option", [
    (lambda r: r[1:3], "tokens"), (lambda r: r[3], "tokens"), (lambda r: r[::2], "tokens"), (lambda r: r[:"2"], "tokens"),
    (lambda r: r[: 10**20], "tokens"), (lambda r: r[: -(10**20)], "tokens"), (lambda r: r[:True], "tokens"),
    (lambda r: r.cut(-1), "chars"), (lambda r: r.cut(10**9), "chars"), (lambda r: r.cut(1.5), "chars"),
    (lambda r: r + 3, "append"), (lambda r: r + [1.5], "append"), (lambda r: r + None, "append"),
])
def test_only_prefixes_and_whole_characters_can_be_taken(engine, attempt, option):
    with engine.session() as session:
        first = session.generate(PROMPT, max_new_tokens=3)
    with pytest.raises(InvalidArgument) as caught:
        attempt(first)
    assert caught.value.details == {"option": option}


def test_continuation_names_the_last_result_as_the_protocol_does(engine):
    with engine.session() as session:
        with pytest.raises(InvalidArgument) as caught:
            session.continuation()
        assert caught.value.details == {"option": "continue"}
        samples = session.generate(PROMPT, strategy="sample", seed=3, num_samples=2, max_new_tokens=4)
        assert session.continuation(sequence=1) == samples.sequences[1].tokens
        assert session.continuation(sequence=1, tokens=-2, append=" x") == samples.sequences[1][:-2] + " x"
        assert session.continuation(chars=4, append_token_ids=[7]) == samples.sequences[0].cut(4) + [7]
        for options, error, option in [
            (dict(sequence=2), SampleMismatch, "continue.sequence"),
            (dict(sequence=-1), SampleMismatch, "continue.sequence"),
            (dict(tokens=1, chars=1), InvalidArgument, "continue"),
            (dict(append="a", append_token_ids=[1]), InvalidArgument, "continue"),
            (dict(tokens=99), InvalidArgument, "continue.tokens"),
            (dict(chars=10**6), InvalidArgument, "continue.chars"),
            (dict(append=5), InvalidArgument, "continue.append"),
            (dict(append_token_ids=["a"]), InvalidArgument, "continue.append_token_ids"),
            (dict(append_token_ids=[7, -1]), InvalidArgument, "continue.append_token_ids"),
        ]:
            with pytest.raises(error) as caught:
                session.continuation(**options)
            assert caught.value.details["option"] == option, options
        with pytest.raises(EmptyInput):
            session.generate(session.continuation(tokens=0))


def test_a_failed_generate_changes_nothing_a_cancelled_one_is_the_last_result(engine):
    with engine.session() as session:
        first = session.generate(PROMPT, **FREE)
        for bad, error in [(dict(max_new_tokens=10**6), ContextOverflow), (dict(strategy="beem"), UnknownStrategy),
                           (dict(processors=[configure(SuppressTokens, token_ids=list(range(engine.vocab_size)))]),
                            InvalidLogits)]:  # the last fails at its first step, once the cache was cropped
            with pytest.raises(error):
                session.generate(first[:-3] + " x", **bad)
            assert session.last is first and session.history == first.sequences[0].all_ids
            assert session.cached == len(session.history) - 1
        stream = session.stream(first, max_new_tokens=50, eos_token_ids=[])
        next(stream), next(stream)
        stream.cancel()
        for _ in stream:
            pass
        assert stream.result.finish_reason == "cancelled" and session.last is stream.result
        assert session.history == session.last.sequences[0].all_ids
        twin = session.fork()
        assert twin.last is session.last
        resumed = twin.generate(twin.continuation(), **FREE)
        assert resumed.stats.reused_tokens == len(session.history) - 1
        same(resumed, fresh(engine, session.history, **FREE))
        twin.close()


def test_results_and_tokens_are_not_iterable(engine):
    """list(result) and `3 in result.tokens` fell through to __getitem__(0), which refuses an index that is
    not a slice: an InvalidArgument about a prompt, for a plain Python question."""
    with engine.session() as session:
        result = session.generate(token_ids=[5, 6, 7], max_new_tokens=2, eos_token_ids=[])
    for value in (result, result.tokens, result.sequences[0]):
        with pytest.raises(TypeError, match="not iterable"):
            list(value)
        with pytest.raises(TypeError, match="not iterable"):
            3 in value  # noqa: B015
    assert len(result.tokens) == 5 and result.tokens[:2].ids == (5, 6)
