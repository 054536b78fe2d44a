"""Error codes of the wire protocol, and the exception that carries one.

The codes are stable strings: clients match on them. The engine's own codes (model_not_found,
context_overflow, ...) travel unchanged in the same `error.code` field; see PROTOCOL.md for the full list.
"""

from __future__ import annotations

# Protocol-level codes, raised by this package or by the server's dispatch.
FRAME_TOO_LARGE = "frame_too_large"
INVALID_MSGPACK = "invalid_msgpack"
INVALID_MESSAGE = "invalid_message"
INVALID_ID = "invalid_id"
UNKNOWN_OP = "unknown_op"
INVALID_PARAMS = "invalid_params"
DUPLICATE_ID = "duplicate_id"
UNKNOWN_SESSION = "unknown_session"
SESSION_EXISTS = "session_exists"
UNKNOWN_MODEL = "unknown_model"
MODEL_EXISTS = "model_exists"
CANCELLED = "cancelled"
TOO_MANY_REQUESTS = "too_many_requests"
LIMIT_EXCEEDED = "limit_exceeded"
FORBIDDEN = "forbidden"
INTERNAL = "internal"


class ProtocolError(Exception):
    """A request (or frame) that gets an error reply. `request_id` is None when it cannot be attributed."""

    def __init__(self, code: str, message: str, request_id: int | None = None, **details):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.details = details
