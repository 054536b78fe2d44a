"""Erlang's `{packet, 4}` framing: a 4-byte big-endian length, then that many bytes. No I/O here."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .limits import Limits

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME_BYTES = Limits().max_frame_bytes
PEEK_BYTES = 4096  # how much of an oversized frame's body is kept, to find the request's id


def frame(payload: bytes) -> bytes:
    if len(payload) > 0xFFFFFFFF:
        raise ValueError("a {packet, 4} frame holds at most 4 GiB")
    return HEADER.pack(len(payload)) + payload


@dataclass(frozen=True)
class OversizedFrame:
    """A frame over the limit: its declared length and the first bytes of its body (the rest is discarded)."""

    declared: int
    head: bytes


class FrameDecoder:
    """Splits a byte stream into frames; `feed` returns the frames completed by the new bytes.

    A frame that declares more than `max_frame_bytes` is never buffered: the decoder keeps the first
    `PEEK_BYTES` of its body, returns an `OversizedFrame` for them, and drops the rest as it arrives. The
    length in the header says where the next frame starts, so the stream stays in step and the
    connection stays usable.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._need: int | None = None  # body length of the frame being read
        self._skip = 0  # bytes of an oversized body still to drop

    def feed(self, data: bytes) -> list[bytes | OversizedFrame]:
        self._buffer += data
        frames: list[bytes | OversizedFrame] = []
        while True:
            if self._skip:
                dropped = min(self._skip, len(self._buffer))
                del self._buffer[:dropped]
                self._skip -= dropped
                if self._skip:
                    return frames
            if self._need is None:
                if len(self._buffer) < HEADER.size:
                    return frames
                (self._need,) = HEADER.unpack_from(self._buffer)
                del self._buffer[: HEADER.size]
            if self._need > self.max_frame_bytes:
                peek = min(PEEK_BYTES, self._need)
                if len(self._buffer) < peek:
                    return frames
                frames.append(OversizedFrame(self._need, bytes(self._buffer[:peek])))
                self._skip, self._need = self._need, None
                continue
            if len(self._buffer) < self._need:
                return frames
            frames.append(bytes(self._buffer[: self._need]))
            del self._buffer[: self._need]
            self._need = None

    @property
    def pending(self) -> int:
        """Bytes buffered towards an incomplete frame (0 at a frame boundary)."""
        return len(self._buffer) + (HEADER.size if self._need is not None else 0) + self._skip
