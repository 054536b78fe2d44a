import pytest

from protocol import ProtocolError, parse_request
from protocol.matching import mismatch


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


def test_defaults_are_filled_and_fresh():
    one = parse_request({"id": 1, "op": "generate", "session": "s", "prompt": "hi"})
    two = parse_request({"id": 2, "op": "generate", "session": "s", "prompt": "hi"})
    assert one.params["max_new_tokens"] == 16 and one.params["stream"] is False and one.params["token_ids"] is None
    assert one.params["stop"] == [] and one.params["stop"] is not two.params["stop"]


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
