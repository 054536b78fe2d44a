import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import Limits, ProtocolError, pack, parse_request, unpack
from protocol.matching import mismatch
from protocol.schema import DEFAULT_NUM_BEAMS, _all_uint, _is_uint


@pytest.mark.parametrize("message, code, rid", [
    ([1], "invalid_message", None),
    ({"op": "ping"}, "invalid_id", None),
    ({"id": True, "op": "ping"}, "invalid_id", None),
    ({"id": 2**64, "op": "ping"}, "invalid_id", None),
    ({"id": 1}, "invalid_message", 1),
    ({"id": 1, "op": "fly"}, "unknown_op", 1),
    ({"id": 1, "op": "ping", "x": 1}, "invalid_params", 1),
    ({"id": 1, "op": "generate"}, "invalid_params", 1),
    ({"id": 1, "op": "generate", "session": "s", "max_new_tokens": -1}, "invalid_params", 1),
    ({"id": 1, "op": "generate", "session": "s", "token_ids": [1, "2"]}, "invalid_params", 1),
    ({"id": 1, "op": "generate", "session": "s", "stream": 1}, "invalid_params", 1),
])
def test_bad_requests(message, code, rid):
    with pytest.raises(ProtocolError) as caught:
        parse_request(message)
    assert (caught.value.code, caught.value.request_id) == (code, rid)


def test_defaults_are_filled_and_the_models_left_to_the_engine():
    one = parse_request({"id": 1, "op": "generate", "session": "s", "prompt": "hi"})
    assert one.params["stream"] is False and one.params["token_ids"] is None
    # section 5, "Generation defaults": the model's, which the wire layer does not know
    assert [one.params[key] for key in ("strategy", "max_new_tokens", "processors", "stop")] == [None] * 4


def test_nil_for_an_option_with_a_default_is_that_default():
    """Section 5: the options of a strategy may be sent as nil, num_samples among them (found from outside:
    `num_samples: nil` was invalid_params, the other strategies' options were not)."""
    for left in ({}, {"num_samples": None}):
        request = parse_request({"id": 1, "op": "generate", "session": "s", "prompt": "a", "strategy": "sample", **left})
        assert request.params["num_samples"] == 1
    problem = refused({"prompt": "a", "strategy": "sample", "num_samples": -1})
    assert (problem.code, problem.details["param"]) == ("invalid_params", "num_samples")


def test_error_names_the_parameter_and_the_expected_type():
    with pytest.raises(ProtocolError, match=r"tokenize: parameter 'text' must be str, got int 5"):
        parse_request({"id": 1, "op": "tokenize", "text": 5})


@pytest.mark.parametrize("pattern, value", [
    ({"code": "a"}, {"code": "b"}),
    ({"code": "a"}, {}),
    ({"$type": "uint"}, -1),
    ({"$type": "int"}, True),
    ({"$len": 2}, [1]),
    ({"$each": {"$type": "str"}}, ["a", 1]),
    ({"$contains": ["x"]}, ["y"]),
    ([1, 2], [1, 2, 3]),
    (1, 1.0),
    (None, False),
])
def test_matcher_rejects_what_differs(pattern, value):
    assert mismatch(pattern, value) is not None


def test_matcher_accepts_extra_keys():
    assert mismatch({"id": 1, "result": {"$type": "map"}}, {"id": 1, "ok": True, "result": {}}) is None


def refused(message, limits=None):
    with pytest.raises(ProtocolError) as caught:
        parse_request({"id": 1, "op": "generate", "session": "s", **message}, *([limits] if limits else []))
    return caught.value


@pytest.mark.parametrize("beams", [{}, {"num_beams": None}])
def test_a_beam_search_that_leaves_num_beams_out_is_measured_with_its_default(beams):
    """Section 7: a parameter left out is measured with its default; num_beams's is 4 under beam, whatever
    num_return_sequences asks (the request still carries None: num_beams given without beam is refused)."""
    limits = Limits(max_sequences=2)
    problem = refused({"prompt": "a", "strategy": "beam", "num_return_sequences": 2, **beams}, limits)
    assert (problem.code, problem.details) == ("limit_exceeded", {"limit": "max_sequences", "max": 2, "value": 4,
                                                                  "param": "num_beams"})
    assert DEFAULT_NUM_BEAMS == 4  # as PROTOCOL.md says (the engine uses this one)
    for fits in ({"strategy": "beam", "num_beams": 2}, {}, {"strategy": "sample"}, {"strategy": "greedy", **beams}):
        request = parse_request({"id": 1, "op": "generate", "session": "s", "prompt": "a", **fits}, limits)
        assert request.params["num_beams"] == fits.get("num_beams")
    assert parse_request({"id": 1, "op": "generate", "session": "s", "prompt": "a", "strategy": "beam"},
                         Limits(max_sequences=4)).params["num_beams"] is None


@pytest.mark.parametrize("message, param, index", [
    ({"prompt": "a", "processors": [{"name": "top_k", "options": {"k": 1}}, "regex"]}, "processors", 1),
    ({"prompt": "a", "processors": [[], {"name": "top_k", "options": {"k": 1}}]}, "processors", 0),
    ({"token_ids": [1, 2, -3, "x"]}, "token_ids", 2),
    ({"prompt": "a", "stop": ["x", b"y"]}, "stop", 1),
    ({"messages": [{"role": "user", "content": "a"}, None]}, "messages", 1),
    ({"continue": {"append_token_ids": [5, 1.0]}}, "continue.append_token_ids", 1),
])
def test_a_list_element_of_the_wrong_type_is_named_by_its_index(message, param, index):
    problem = refused(message)
    assert (problem.code, problem.details) == ("invalid_params", {"param": param, "index": index})
    assert f"element {index}" in problem.message


ELEMENT_VALUES = st.one_of(st.integers(-2**63, 2**64 - 1), st.booleans(), st.floats(allow_nan=False), st.none(),
                           st.text(max_size=2), st.binary(max_size=2), st.just([1]), st.just({}))


@given(st.lists(ELEMENT_VALUES, max_size=6) | st.lists(st.integers(0, 2**64 - 1), max_size=6))
def test_the_fast_check_of_a_list_of_uints_decides_as_the_element_check(values):
    """`_all_uint` (C-speed, for lists of up to 262,144 token ids) against the element check `_mistyped` names."""
    assert _all_uint(values) == all(map(_is_uint, values))
    decoded = unpack(pack(values), 32)  # what a request carries: msgpack's own types
    assert _all_uint(decoded) == all(map(_is_uint, decoded))


def test_a_list_of_the_wrong_container_has_no_index():
    problem = refused({"token_ids": "abc"})
    assert (problem.code, problem.details) == ("invalid_params", {"param": "token_ids"})


@pytest.mark.parametrize("message, size", [
    ({"continue": {"append": "a" * 100}}, 106),  # "append" is 6 bytes
    ({"continue": {"sequence": 1, "append": "é" * 50}}, 8 + 6 + 100),
    ({"messages": [{"role": "user", "content": "a" * 90}]}, 4 + 4 + 7 + 90),
])
def test_max_prompt_bytes_counts_every_string_of_messages_and_continue_map_keys_included(message, size):
    problem = refused(message, Limits(max_prompt_bytes=size - 1))
    assert (problem.code, problem.details) == ("limit_exceeded", {"limit": "max_prompt_bytes", "max": size - 1,
                                                                  "value": size, "param": next(iter(message))})
    parse_request({"id": 1, "op": "generate", "session": "s", **message}, Limits(max_prompt_bytes=size))
