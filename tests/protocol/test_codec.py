import json
from pathlib import Path

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
