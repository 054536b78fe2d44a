"""Erlang's `{packet, 4}` framing: a 4-byte big-endian length, then that many bytes. No I/O here."""

from __future__ import annotations

import struct

from .errors import FRAME_TOO_LARGE, ProtocolError

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024


def frame(payload: bytes) -> bytes:
    if len(payload) > 0xFFFFFFFF:
        raise ValueError("a {packet, 4} frame holds at most 4 GiB")
    return HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Splits a byte stream into frames; `feed` returns the frames completed by the new bytes.

    A header that declares more than `max_frame_bytes` raises `frame_too_large` as soon as the header
    is read, before the body is buffered, so a hostile length never allocates anything.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._need: int | None = None  # body length of the frame being read

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        frames = []
        while True:
            if self._need is None:
                if len(self._buffer) < HEADER.size:
                    return frames
                (length,) = HEADER.unpack_from(self._buffer)
                if length > self.max_frame_bytes:
                    raise ProtocolError(
                        FRAME_TOO_LARGE,
                        f"frame declares {length} bytes, above the limit of {self.max_frame_bytes} (max_frame_bytes)",
                        limit=self.max_frame_bytes,
                    )
                del self._buffer[: HEADER.size]
                self._need = length
            if len(self._buffer) < self._need:
                return frames
            frames.append(bytes(self._buffer[: self._need]))
            del self._buffer[: self._need]
            self._need = None

    @property
    def pending(self) -> int:
        """Bytes buffered towards an incomplete frame (0 at a frame boundary)."""
        return len(self._buffer) + (HEADER.size if self._need is not None else 0)
