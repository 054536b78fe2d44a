"""Bad input: a typed error with a stable code, and the session exactly as it was."""

import pytest

import processors as P
from sidecar import errors

from .conftest import tokens


def snapshot(session):
    return (list(session.history), session.cached, session.cache_bytes)


@pytest.mark.parametrize(
    "kwargs, error, code, message",
    [
        ({"prompt": "a", "token_ids": [5]}, errors.InvalidArgument, "invalid_argument", "exactly one of prompt, token_ids and messages"),
        ({}, errors.InvalidArgument, "invalid_argument", "exactly one"),
        ({"prompt": ""}, errors.EmptyInput, "empty_input", "empty"),
        ({"token_ids": []}, errors.EmptyInput, "empty_input", "empty"),
        ({"token_ids": [5, 1024]}, errors.TokenOutOfRange, "token_out_of_range", r"\[1024\] are outside the vocabulary \[0, 1024\)"),
        ({"token_ids": [5, -1]}, errors.TokenOutOfRange, "token_out_of_range", "outside"),
        ({"token_ids": [5, "x"]}, errors.InvalidArgument, "invalid_argument", "list of integers"),
        ({"prompt": "a", "max_new_tokens": -1}, errors.InvalidArgument, "invalid_argument", "max_new_tokens must be an integer >= 0"),
        ({"token_ids": [5] * 2000, "max_new_tokens": 49}, errors.ContextOverflow, "context_overflow", "context of 2048 tokens"),
        ({"prompt": "a", "strategy": "beem"}, errors.UnknownStrategy, "unknown_strategy", "unknown strategy 'beem'; valid: greedy, sample, beam"),
        ({"prompt": "a", "strategy": "beam", "num_beams": 0}, errors.InvalidArgument, "invalid_argument", r"num_beams must be an integer in \[1, 64\]"),
        ({"prompt": "a", "strategy": "beam", "num_beams": 2, "num_return_sequences": 3}, errors.InvalidArgument, "invalid_argument", "num_return_sequences"),
        ({"prompt": "a", "num_samples": 2}, errors.InvalidArgument, "invalid_argument", "num_samples goes with strategy 'sample', not 'greedy'"),
        ({"prompt": "a", "strategy": "beam", "num_samples": 2}, errors.InvalidArgument, "invalid_argument", "num_samples goes with strategy 'sample', not 'beam'"),
        ({"prompt": "a", "num_beams": 2}, errors.InvalidArgument, "invalid_argument", "num_beams goes with strategy 'beam'"),
        ({"prompt": "a", "strategy": "sample", "length_penalty": 2.0}, errors.InvalidArgument, "invalid_argument", "length_penalty goes with"),
        ({"prompt": "a", "strategy": "beam", "early_stopping": "sometimes"}, errors.InvalidArgument, "invalid_argument", "early_stopping"),
        ({"prompt": "a", "strategy": "beam", "length_penalty": float("nan")}, errors.InvalidArgument, "invalid_argument", "length_penalty"),
        ({"prompt": "a", "strategy": "beam", "stop": ["x"]}, errors.InvalidArgument, "invalid_argument", "stop strings do not go with strategy 'beam'"),
        ({"prompt": "a", "strategy": "sample", "num_samples": 65}, errors.InvalidArgument, "invalid_argument", "num_samples"),
        ({"prompt": "a", "seed": -3}, errors.InvalidArgument, "invalid_argument", "seed"),
        ({"prompt": "a", "stop": [""]}, errors.InvalidArgument, "invalid_argument", "stop"),
        ({"prompt": "a", "processors": [P.SuppressTokens([5000])]}, errors.InvalidProcessor, "invalid_processor", "token id 5000"),
        ({"prompt": "a", "processors": [42]}, errors.InvalidProcessor, "invalid_processor", "chain holds processors"),
        ({"prompt": "a", "eos_token_ids": [4096]}, errors.TokenOutOfRange, "token_out_of_range", "eos_token_ids"),
    ],
)
def test_bad_generate_calls_change_nothing(engine, kwargs, error, code, message):
    with engine.session() as session:
        session.generate(token_ids=tokens(12, seed=30), max_new_tokens=4)
        before = snapshot(session)
        with pytest.raises(error, match=message) as caught:
            session.generate(**kwargs)
        assert caught.value.code == code
        assert snapshot(session) == before
        assert session.generate(token_ids=tokens(12, seed=30), max_new_tokens=4).stats.reused_tokens == 11


def test_a_closed_session_refuses_work(engine):
    session = engine.session()
    session.close()
    with pytest.raises(errors.SessionClosed) as caught:
        session.generate(prompt="a")
    assert caught.value.code == "session_closed" and session.id not in [s for s in engine._sessions]


def test_one_generation_at_a_time_per_session(engine):
    with engine.session() as session:
        running = session.stream(prompt="a", max_new_tokens=5)
        next(running)
        with pytest.raises(errors.SessionBusy):
            session.generate(prompt="b")
        running.cancel()
        assert session.generate(prompt="b", max_new_tokens=1).finish_reason == "length"


def test_a_failing_processor_leaves_a_usable_session(engine):
    def explode(logits, context):
        if context.length > context.input_length + 1:
            raise RuntimeError("boom")
        return logits

    with engine.session() as session:
        with pytest.raises(RuntimeError, match="boom"):
            session.generate(token_ids=tokens(12, seed=31), max_new_tokens=5, processors=[explode])
        assert session.cached == 0
        with engine.session() as fresh:
            assert (session.generate(token_ids=tokens(12, seed=31), max_new_tokens=5).token_ids
                    == fresh.generate(token_ids=tokens(12, seed=31), max_new_tokens=5).token_ids)
