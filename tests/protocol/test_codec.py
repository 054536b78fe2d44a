import json
from pathlib import Path

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import ProtocolError, Tensor, pack, unpack
from protocol.vectors.build import canonical, from_json, request_hex

VECTORS = Path(__file__).parents[2] / "protocol" / "vectors"
CODEC = json.loads((VECTORS / "codec.json").read_text())["vectors"]
CONFORMANCE = json.loads((VECTORS / "conformance.json").read_text())["scripts"]


@pytest.mark.parametrize("vector", CODEC, ids=[v["name"] for v in CODEC])
def test_golden_codec_vectors_both_ways(vector):
    value = from_json(vector["value"])
    assert unpack(bytes.fromhex(vector["hex"])) == value
    assert pack(canonical(value)).hex() == vector["hex"]


def test_text_is_str_and_bytes_are_bin():
    assert pack("é")[0] == 0xA2 and pack(b"\xe9")[0] == 0xC4
    assert unpack(pack({"t": "é", "b": b"\xe9"})) == {"t": "é", "b": b"\xe9"}


def test_stored_request_bytes_match_their_requests():
    for script in CONFORMANCE:
        for step in script["steps"]:
            if "request" in step:
                assert step["send_hex"] == request_hex(step["request"]), script["name"]


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)


@given(values)
def test_round_trip(value):
    assert unpack(pack(value)) == value


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x92\x01", b"\x01\x02", b"\xa5abc"])
def test_invalid_payloads_are_typed(payload):
    with pytest.raises(ProtocolError) as caught:
        unpack(payload)
    assert caught.value.code == "invalid_msgpack"


def test_tensor_layout_matches_nx_from_binary():
    import struct

    tensor = Tensor("f32", (2, 2), struct.pack("<4f", 1, 2, 3, 4))
    wire = unpack(pack(tensor.to_wire()))
    assert wire == {"dtype": "f32", "shape": [2, 2], "data": bytes.fromhex("0000803f000000400000404000008040")}
    assert Tensor.from_wire(wire) == tensor
    with pytest.raises(ValueError, match="needs 16 bytes, got 15"):
        Tensor("f32", (2, 2), b"x" * 15)
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        Tensor("f8", (1,), b"x")


def test_the_spec_examples_decode_to_what_they_say():
    import re

    from protocol import FrameDecoder

    spec = (Path(__file__).parents[2] / "protocol" / "PROTOCOL.md").read_text()
    rows = re.findall(r"^\| `(\{.*\})` \| `([0-9a-f ]+)` \|$", spec, flags=re.M)
    assert len(rows) == 4
    for message, hex_frame in rows:
        frames = FrameDecoder().feed(bytes.fromhex(hex_frame.replace(" ", "")))
        assert len(frames) == 1 and unpack(frames[0]) == json.loads(message)


def _map(*pairs) -> bytes:
    """A msgpack map written pair by pair, so that it can hold a key twice."""
    return bytes([0x80 | len(pairs)]) + b"".join(pack(key) + value for key, value in pairs)


@pytest.mark.parametrize("payload, request_id, param", [
    (_map(("id", pack(5)), ("op", pack("ping")), ("op", pack("hello"))), 5, "op"),
    (_map(("id", pack(5)), ("id", pack(6)), ("op", pack("ping"))), None, "id"),
    (_map(("op", pack("generate")), ("id", pack(7)), ("processors", b"\x91" + _map(
        ("name", pack("regex")), ("options", _map(("pattern", pack("a")), ("pattern", pack("b"))))))),
     7, "processors[0].options.pattern"),
    (_map(("id", pack(8)), ("x", _map((1, pack(1)), (True, pack(2))))), 8, "x.true"),
])
def test_a_map_holding_a_key_twice_is_refused_with_the_key_and_the_request_id(payload, request_id, param):
    """msgpack allows a key twice and its decoder keeps the last value; a client meant one of them."""
    assert msgpack.unpackb(payload, strict_map_key=False)  # valid msgpack, which the decoder reads last-wins
    with pytest.raises(ProtocolError) as caught:
        unpack(payload)
    assert (caught.value.code, caught.value.request_id, caught.value.details) == ("invalid_params", request_id, {"param": param})


@pytest.mark.parametrize("fault, code, request_id", [
    (("y", b"\xa1\xff"), "invalid_msgpack", 9),  # a str that is not UTF-8
    (("y", b"\x91" * 1100 + b"\x01"), "limit_exceeded", 9),  # deeper than the decoder reads
    (([1], pack(0)), "invalid_msgpack", None),  # a list as a map key
])
def test_a_repeated_key_beside_another_fault_gets_that_faults_error(fault, code, request_id):
    """The other fault's error is what the payload gets without the repeat, whichever comes first."""
    repeat = ("a", _map(("k", pack(1)), ("k", pack(2))))
    for pairs in ([("id", pack(9)), repeat, fault], [("id", pack(9)), fault, repeat]):
        with pytest.raises(ProtocolError) as caught:
            unpack(_map(*pairs))
        assert (caught.value.code, caught.value.request_id) == (code, request_id), pairs


def test_trailing_bytes_after_a_map_with_a_repeated_key_are_invalid_msgpack():
    with pytest.raises(ProtocolError) as caught:
        unpack(_map(("id", pack(9)), ("k", pack(1)), ("k", pack(2))) + b"\x01")
    assert caught.value.code == "invalid_msgpack"


def test_keys_repeated_in_any_msgpack_type_are_named_as_msgpack_writes_them():
    ext = msgpack.packb(msgpack.ExtType(5, b"z"))
    for key, text in [(None, "nil"), (False, "false"), (1.5, "1.5"), (b"\x00\x01", "bin 0001")]:
        with pytest.raises(ProtocolError) as caught:
            unpack(_map(("id", pack(3)), ("m", _map((key, pack(1)), (key, pack(2))))))
        assert (caught.value.code, caught.value.details) == ("invalid_params", {"param": f"m.{text}"})
    with pytest.raises(ProtocolError) as caught:
        unpack(b"\x82" + ext + pack(1) + ext + pack(2))
    assert caught.value.code == "invalid_params"


def test_the_path_of_a_fault_takes_memory_and_text_of_its_own_length_only():
    """Paths rendered as each item was pushed took the items times their depth: 1 GB for 110 KB of payload."""
    import tracemalloc

    key = "k" * 1000
    inner = _map(("d", pack(1)), ("d", pack(2)))
    payload = inner
    for _ in range(10):
        payload = _map((key, pack(list(range(10_000)))), (key + "x", payload))
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as caught:
            unpack(payload)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert caught.value.code == "invalid_params" and len(caught.value.details["param"]) <= 512
    assert peak < 50 * len(payload) + 20_000_000, peak
