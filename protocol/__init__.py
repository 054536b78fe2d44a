"""The wire layer, with no I/O: {packet, 4} framing, msgpack codec, message schemas, limits, error codes.

The normative description is PROTOCOL.md beside this file.
"""

from .codec import Tensor, pack, peek_request_id, unpack
from .errors import ProtocolError
from .framing import DEFAULT_MAX_FRAME_BYTES, FrameDecoder, OversizedFrame, frame
from .limits import Limits
from .schema import OPS, PROTOCOL_VERSION, Request, error, event, ok, parse_request

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES", "FrameDecoder", "Limits", "OPS", "OversizedFrame", "PROTOCOL_VERSION", "ProtocolError",
    "Request", "Tensor", "error", "event", "frame", "ok", "pack", "parse_request", "peek_request_id", "unpack",
]
