import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import FrameDecoder, ProtocolError, frame


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


def test_oversized_header_is_rejected_before_the_body_arrives():
    decoder = FrameDecoder(max_frame_bytes=1024)
    assert decoder.feed(frame(b"x" * 1024)) == [b"x" * 1024]
    with pytest.raises(ProtocolError) as caught:
        decoder.feed(b"\xff\xff\xff\xff")  # 4 GiB declared, nothing allocated for it
    assert caught.value.code == "frame_too_large" and "1024" in caught.value.message
    assert decoder.pending <= 4
