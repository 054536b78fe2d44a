"""configure and bad input: typed errors that name the problem, and nothing mutated."""

import dataclasses

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

import processors as P


def test_unknown_option_is_named_with_the_valid_ones():
    with pytest.raises(P.InvalidOption, match=r"unknown option 'kk' for TopK; valid options: k, min_tokens_to_keep"):
        P.configure(P.TopK, kk=3)
    assert issubclass(P.InvalidOption, ValueError)


@pytest.mark.parametrize(
    "cls, options, message",
    [
        (P.TopP, {"p": -0.01}, "'p' must be in"),
        (P.TopP, {"p": 1.01}, "'p' must be in"),
        (P.TopK, {"k": 0}, "'k' must be an integer >= 1"),
        (P.TopK, {"k": True}, "'k' must be an integer"),
        (P.TopK, {"k": 2.5}, "'k' must be an integer"),
        (P.Temperature, {"temperature": 0}, r"'temperature' must be a number in \[1.175e-38, 3.403e\+38\]"),
        (P.Temperature, {"temperature": 1e-300}, "representable in float32"),
        (P.Temperature, {"temperature": float("inf")}, "'temperature'"),
        (P.Temperature, {"temperature": 10**400}, "'temperature'"),
        (P.SuppressTokens, {"token_ids": [2**63]}, r"'token_ids' must be a token id \(an integer in \[0, 2\^63\)\)"),
        (P.SequenceBias, {"sequence_bias": [[[1], float("inf")]]}, r"-inf \(to forbid\) or within float32.s range"),
        (P.Temperature, {"temperature": -1.0}, "'temperature'"),
        (P.Temperature, {"temperature": "hot"}, "'temperature' must be a number"),
        (P.RepetitionPenalty, {"penalty": 0.0}, "'penalty'"),
        (P.FrequencyPenalty, {"penalty": 2.5}, r"'penalty' must be in \[-2.0, 2.0\]"),
        (P.MinP, {"p": -0.1}, "'p'"),
        (P.TypicalP, {"p": 1.0}, "'p'"),
        (P.NoRepeatNGram, {"ngram_size": 0}, "'ngram_size'"),
        (P.SuppressTokens, {"token_ids": []}, "'token_ids'"),
        (P.SuppressTokens, {"token_ids": [-1]}, "'token_ids'"),
        (P.SequenceBias, {"sequence_bias": [[[1], "x"]]}, "'sequence_bias'"),
        (P.NoBadWords, {"bad_words_ids": [[]]}, "'bad_words_ids'"),
        (P.TopK, {}, "TopK requires option 'k'"),
    ],
)
def test_invalid_options_fail_at_configure_time(cls, options, message):
    with pytest.raises(P.InvalidOption, match=message):
        P.configure(cls, **options)


@pytest.mark.parametrize("function", [lambda logits: logits, lambda logits, context, extra: logits, lambda: None])
def test_a_callable_that_cannot_take_logits_and_context_is_refused_in_the_chain(function):
    # it raised a raw TypeError at the first step of a generation
    with pytest.raises(P.InvalidOption, match=r"processors\[1\] is called as f\(logits, context\)") as refused:
        P.Chain([P.TopK(3), function])
    assert refused.value.index == 1


def test_callables_that_take_logits_and_context_are_kept():
    def with_default(logits, context, scale=1.0):
        return logits * scale

    chain = P.Chain([lambda logits, context: logits, lambda *args: args[0], with_default, max])
    assert len(chain) == 4


def test_configure_updates_a_config_without_touching_the_original():
    top_k = P.configure(P.TopK, k=50)
    smaller = P.configure(top_k, k=5)
    assert (top_k.k, smaller.k) == (50, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        top_k.k = 3
    with pytest.raises(P.InvalidOption):
        P.configure(top_k, k=-1)


def test_options_are_normalised():
    assert P.configure(P.Temperature, temperature=2).temperature == 2.0
    assert P.configure(P.SuppressTokens, token_ids=[3, 4]).token_ids == (3, 4)
    assert P.configure(P.MinLength, min_length=3, eos_token_ids=7).eos_token_ids == (7,)


def test_registry_configures_by_name():
    assert P.from_name("top_k", {"k": 3}) == P.TopK(3)
    with pytest.raises(P.InvalidOption, match="unknown processor 'top_z'; known processors: .*top_k"):
        P.from_name("top_z", {})
    catalogue = P.catalogue()
    assert set(catalogue) == set(P.BUILTINS) and len(P.BUILTINS) == 25
    assert {"name": "k", "doc": "how many tokens to keep, >= 1", "required": True, "default": None,
            "schema": {"type": "integer", "minimum": 1}} in catalogue["top_k"]


def _good_step():
    chain = P.Chain([P.RepetitionPenalty(1.5), P.SuppressTokens([9])])
    sequence = torch.tensor([[1, 2, 3], [4, 5, 6]])
    context = P.Context(sequence, 3, 2, 10)
    return chain, context, chain.init(context), torch.randn(2, 10)


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda c, l: (c, l.long()), "floating dtype"),
        (lambda c, l: (c, l[None]), "rank 2"),
        (lambda c, l: (c, l[:1]), "logits have 1 rows but the sequence has 2"),
        (lambda c, l: (P.Context(c.sequence, 3, 2, 9), l[:, :9]), "token id 9, outside the vocabulary of 9"),
        (lambda c, l: (P.Context(c.sequence, 3, 2, 11), l), "vocab_size is 11"),
        (lambda c, l: (P.Context(c.sequence, 5, 2, 10), l), "length"),
    ],
)
def test_bad_input_raises_and_mutates_nothing(bad, message):
    chain, context, states, logits = _good_step()
    context, logits = bad(context, logits)
    before = (context.sequence.clone(), logits.clone(), [s["tally"].clone() for s in states if s])
    with pytest.raises(P.InvalidInput, match=message):
        chain.process(states, logits, context)
    assert torch.equal(before[0], context.sequence) and torch.equal(before[1], logits)
    assert all(torch.equal(a, s["tally"]) for a, s in zip(before[2], [s for s in states if s]))


@pytest.mark.parametrize("context, message", [
    (P.Context(torch.tensor([[1, 2, 30]]), 3, 3, 16), "token id 30, outside the vocabulary of 16"),
    (P.Context(torch.tensor([[1, -2, 3]]), 3, 3, 16), "token id -2, outside the vocabulary of 16"),
    (P.Context(torch.tensor([[True, False]]), 2, 2, 16), r"B x T integer tensor, got \(1, 2\) torch.bool"),
    (P.Context(torch.tensor([[1, 2]]), 2, 2, 16.0), "context.vocab_size must be an integer, got float 16.0"),
    (P.Context(torch.tensor([[1, 2]]), 2.0, 2, 16), "context.length must be an integer"),
    (P.Context(torch.tensor([[1, 2]]), 2, 2, 0), "vocab_size must be at least 1"),
])
def test_a_context_processors_cannot_index_with_is_refused_at_init(context, message):
    """Raw torch errors from deep inside a processor (a scatter out of bounds, a bool sequence) before."""
    chain = P.Chain([P.RepetitionPenalty(1.5), P.NoRepeatNGram(2)])
    with pytest.raises(P.InvalidInput, match=message):
        chain.init(context)


@pytest.mark.parametrize("states", [lambda s: s[:1], lambda s: (), lambda s: None, lambda s: s + s])
def test_states_that_are_not_one_per_processor_are_refused(states):
    """zip would have run only the processors with a state (none, for an empty tuple), silently."""
    chain, context, good, logits = _good_step()
    with pytest.raises(P.InvalidInput, match="the chain has 2 processors and was given"):
        chain.process(states(good), logits, context)
    with pytest.raises(P.InvalidInput, match="the chain has 2 processors and was given"):
        chain.reorder(states(good), torch.tensor([1, 0]))


@pytest.mark.parametrize("index", [torch.tensor([0.0, 1.0]), torch.tensor([True, False]), torch.tensor([[0, 1]]), [0, 1]])
def test_a_reorder_index_that_is_not_1d_integers_is_refused(index):
    """A float or bool index failed deep inside torch (RuntimeError) before."""
    chain, _, states, _ = _good_step()
    with pytest.raises(P.InvalidInput, match="the index of the rows to keep must be a 1-D int64"):
        chain.reorder(states, index)


# One valid set of options per built-in, so that each option can be varied alone.
VALID = {
    "temperature": {"temperature": 0.7}, "top_h": {"h": 0.4}, "top_k": {"k": 5}, "top_p": {"p": 0.9}, "min_p": {"p": 0.1},
    "typical_p": {"p": 0.9}, "epsilon_cutoff": {"epsilon": 0.001}, "eta_cutoff": {"epsilon": 0.001},
    "repetition_penalty": {"penalty": 1.1}, "frequency_penalty": {"penalty": 0.5},
    "presence_penalty": {"penalty": 0.5}, "no_repeat_ngram": {"ngram_size": 2},
    "min_length": {"min_length": 3, "eos_token_ids": [2]}, "min_new_tokens": {"min_new_tokens": 3, "eos_token_ids": 2},
    "suppress_tokens": {"token_ids": [1, 2]}, "suppress_tokens_at_begin": {"token_ids": [1]},
    "forced_bos": {"token_id": 1}, "forced_eos": {"max_length": 5, "eos_token_ids": [2]},
    "sequence_bias": {"sequence_bias": [[[1, 2], -1.5]]}, "no_bad_words": {"bad_words_ids": [[1, 2]]},
    "regex": {"pattern": "[0-9]+"}, "choice": {"options": ["yes", "no"]}, "json_schema": {"schema": {"type": "integer"}},
    "grammar": {"grammar": 'start: "a"+'}, "dfa": {"initial_state": 0, "transitions": [[0, 5, 1]]},
}
# Options whose meaning no JSON Schema can state (a regex's syntax, a grammar, a schema): the published
# schema accepts every value configure accepts, and configure may still refuse some the schema accepts.
SEMANTIC = {("regex", "pattern"), ("grammar", "grammar"), ("json_schema", "schema")}
# Refusals of a value for what another option says (a Dfa's initial and accepting states must be states
# of its transitions): the value itself passed its own option's checks, which is what a schema publishes.
CROSS_OPTION = ("no transition leaves state", "is in no transition")
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**64), max_value=2**64) | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0, 1, 2, -1, 0.5, 1.0, 2**63 - 1, 2**63, 1e-39, 3.5e38]) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=8,
)


# msgpack tells integers from floats, and options typed "integer" take integers only: 2.0 is refused.
STRICT = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda checker, v: isinstance(v, int) and not isinstance(v, bool)),
)


def test_every_builtin_has_a_valid_example():
    assert set(VALID) == set(P.BUILTINS)
    for name, options in VALID.items():
        P.from_name(name, options)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(VALID)), st.data())
def test_the_published_schema_accepts_exactly_what_configure_accepts(name, data):
    """hello publishes each option's JSON Schema; a client validating with it must agree with the server."""
    option = data.draw(st.sampled_from(P.catalogue()[name]))
    value = data.draw(JSON)
    accepted_by_schema = STRICT(option["schema"]).is_valid(value)
    try:
        P.from_name(name, {**VALID[name], option["name"]: value})
        accepted = True
    except P.InvalidOption as error:
        accepted = any(text in str(error) for text in CROSS_OPTION)
    if (name, option["name"]) in SEMANTIC:
        assert accepted_by_schema or not accepted, (option, value)
    else:
        assert accepted == accepted_by_schema, (option, value)
