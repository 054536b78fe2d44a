import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import FrameDecoder, OversizedFrame, frame, pack, peek_request_id
from protocol.framing import PEEK_BYTES


def test_header_is_four_bytes_big_endian():
    assert frame(b"abc") == b"\x00\x00\x00\x03abc"
    assert frame(b"") == b"\x00\x00\x00\x00"


@given(st.lists(st.binary(max_size=300), max_size=20), st.integers(min_value=1, max_value=64))
def test_any_split_of_the_stream_gives_back_the_frames(payloads, chunk):
    stream = b"".join(frame(p) for p in payloads)
    decoder = FrameDecoder()
    got = []
    for start in range(0, len(stream), chunk):
        got += decoder.feed(stream[start : start + chunk])
    assert got == payloads and decoder.pending == 0


def test_an_oversized_frame_is_reported_and_skipped_without_being_buffered():
    decoder = FrameDecoder(max_frame_bytes=1024)
    big = pack({"id": 7, "op": "tokenize", "text": "x" * 100_000})
    stream = frame(b"y" * 1024) + frame(big) + frame(b"after")
    got, buffered = [], 0
    for start in range(0, len(stream), 5000):
        got += decoder.feed(stream[start : start + 5000])
        buffered = max(buffered, len(decoder._buffer))
    assert got[0] == b"y" * 1024 and got[2] == b"after" and len(got) == 3
    assert got[1] == OversizedFrame(len(big), big[:PEEK_BYTES])
    assert buffered <= PEEK_BYTES + 5000, "the oversized body was buffered"
    assert decoder.pending == 0


def test_a_hostile_length_allocates_nothing():
    decoder = FrameDecoder(max_frame_bytes=1024)
    assert decoder.feed(b"\xff\xff\xff\xff" + b"z" * 10) == []
    assert len(decoder._buffer) == 10


@pytest.mark.parametrize("message, rid", [
    ({"id": 9, "op": "generate", "prompt": "x" * 10_000}, 9),
    ({"eos_token_ids": [1, 2], "id": 10, "prompt": "x" * 10_000}, 10),  # sorted keys, as Elixir sends them
    ({"prompt": "x" * 10_000, "id": 11}, None),  # the id comes after the large value: not readable
    ({"id": -1, "op": "x"}, None),
    ([1, 2, 3], None),
])
def test_the_id_of_an_oversized_request_is_read_from_its_head(message, rid):
    assert peek_request_id(pack(message)[:PEEK_BYTES]) == rid


@given(st.binary(max_size=200))
def test_peeking_any_bytes_never_raises(head):
    peek_request_id(head)
