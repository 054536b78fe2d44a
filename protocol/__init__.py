"""The wire layer, with no I/O: {packet, 4} framing, msgpack codec, message schemas, error codes.

The normative description is PROTOCOL.md beside this file.
"""

from .codec import Tensor, pack, unpack
from .errors import ProtocolError
from .framing import DEFAULT_MAX_FRAME_BYTES, FrameDecoder, frame
from .schema import OPS, PROTOCOL_VERSION, Request, error, event, ok, parse_request

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES", "FrameDecoder", "OPS", "PROTOCOL_VERSION", "ProtocolError", "Request", "Tensor",
    "error", "event", "frame", "ok", "pack", "parse_request", "unpack",
]
