"""Turning a growing list of token ids into text pieces for streaming.

Two small state machines. `Detokenizer` gives the text each new token completes, and holds a token
back while it ends in an incomplete UTF-8 sequence (decoding shows U+FFFD there). `StopMatcher` finds
stop strings in the generated text, and holds back any tail that could still become one, so streamed
pieces never contain text that a later stop would remove.
"""

from __future__ import annotations

from processors.checks import lone_surrogate

from .errors import InvalidArgument

REPLACEMENT = "\ufffd"
# Tokens held back at most. A character is at most 4 bytes, so only invalid bytes (or tokens that
# decode to nothing) hold text longer; past this they go out as they decode (U+FFFD), which keeps
# each step's re-decoding short instead of growing with every held token.
MAX_HELD = 32


def check_unicode(text: str, option: str, what: str | None = None, **detail) -> str:
    """`text`, refused with `InvalidArgument` naming `option` when it holds a lone surrogate: a Python
    string may, but no UTF-8 can spell it, and the tokenizer would fail on it deep inside."""
    if (at := lone_surrogate(text)) is not None:
        raise InvalidArgument(f"{what or option} is not valid Unicode text: a lone surrogate at index {at}",
                              option=option, **detail)
    return text


class Detokenizer:
    """Incremental decoding with a small window.

    Re-decoding only from the previous token onwards keeps each step O(1). Decoding a few tokens of
    context, not just the new one, keeps the tokenizer's joining rules (spaces, byte merges) right.
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoding window
        self._read = 0  # tokens up to here have been turned into text

    def push(self, token_id: int) -> str:
        """The new text completed by `token_id` ('' while a character is still incomplete)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        held = len(self._ids) - self._read
        if held < MAX_HELD and (after.endswith(REPLACEMENT) or len(after) <= len(before)):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back, at the end of generation (may end in U+FFFD if truly invalid)."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]


class StopMatcher:
    """Finds the first stop string in streamed text; `feed` returns only text that is safe to emit."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self._longest = max((len(s) for s in stops), default=0)
        self._pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self._pending + piece
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            self.stopped = True
            self._pending = ""
            return text[: min(at for at, _ in hits)]
        keep = self._undecided_tail(text)
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        rest, self._pending = self._pending, ""
        return rest

    def feed_last(self, piece: str) -> str:
        """`feed` of the generation's last piece, then what was held back. Its trailing U+FFFD stand for the
        bytes of a character the end cut (`Detokenizer.flush`): written out, never taken for a stop string."""
        whole = piece.rstrip(REPLACEMENT)
        text = self.feed(whole)
        return text if self.stopped else text + self.flush() + piece[len(whole) :]

    def _undecided_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for size in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0
