"""Turning a growing list of token ids into text pieces for streaming.

Small state machines. `ByteDetokenizer` gives the text each new token decides from the tokens' bytes,
for the tokenizers whose texts are their tokens' bytes joined (`Vocabulary.texts_join`: byte-level BPE,
SentencePiece); `Detokenizer` from the tokenizer's decoding of a small window, for the others. Both hold
back the bytes of a character not yet complete. `StopMatcher` finds stop strings in the generated text,
and holds back any tail that could still become one, so streamed pieces never contain text that a later
stop would remove.

A generation's text is what its tokens add to the text before them, as vLLM gives it: a SentencePiece
token "▁Hello" writes " Hello" (decoding the generated ids alone drops that space, as the start of a
whole text). So the input's text and the generation's join into the sequence's (but where the input
writes no text: that decoder drops the space there), and a constraint, which reads each token as its
bytes, matches the text the caller gets.
"""

from __future__ import annotations

import codecs

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


CONTEXT = 4  # input tokens before a generation that a window decodes with its first tokens


def detokenizer(tokenizer, vocabulary, context=()) -> "ByteDetokenizer | Detokenizer":
    """The detokenizer of a generation's text over `vocabulary` (`processors.structured.Vocabulary`), after
    the input tokens `context` (their last `CONTEXT` are read)."""
    if vocabulary.texts_join:
        return ByteDetokenizer(vocabulary.token_bytes)
    return Detokenizer(tokenizer, vocabulary.token_bytes, context[-CONTEXT:])


def generated_text(tokenizer, vocabulary, token_ids, context=()) -> str:
    """The whole text of generated tokens, as their streamed pieces join into it (stop strings aside)."""
    text = detokenizer(tokenizer, vocabulary, context)
    return "".join(text.push(token) for token in token_ids) + text.flush()


class ByteDetokenizer:
    """The tokens' bytes decoded as UTF-8 as they come: a character goes out once its last byte does, bytes
    that can be no character's go out as U+FFFD at once (a run of SentencePiece byte tokens that is not
    UTF-8 included, which its decoder would turn into one U+FFFD a byte only as a whole, ASCII included),
    and tokens that write no text (special ones) write nothing. Its own state only: no re-decoding."""

    def __init__(self, token_bytes):
        self._bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._cut = False

    def push(self, token_id: int) -> str:
        token = self._bytes[token_id] if token_id < len(self._bytes) else None
        return self._utf8.decode(token) if token else ""

    def flush(self) -> str:
        """The bytes of a character still incomplete at the end, as U+FFFD."""
        self._cut = bool(self._utf8.getstate()[0])
        return self._utf8.decode(b"", final=True)

    def cut(self) -> bool:
        """Whether the tokens pushed end inside a character (what `flush` gave then ends in its U+FFFD)."""
        return self._cut or bool(self._utf8.getstate()[0])


class Detokenizer:
    """Incremental decoding with a small window, for tokenizers whose texts are not their tokens' bytes
    joined (WordPiece's spaces between words): the decoder's text, without transformers' clean-up of
    spaces before punctuation, which would take back spaces already streamed. The window starts with the
    last input tokens (`context`), so that the first piece is what the tokens add to them: a WordPiece
    "##3" joins the word before it, and a word is a space then the word.

    Re-decoding only from the previous token onwards keeps each step O(1). Decoding a few tokens of
    context, not just the new one, keeps the tokenizer's joining rules (spaces, byte merges) right.

    A token is held while the text did not grow (context for the next), and while the held tokens' bytes
    (`token_bytes`, `Vocabulary.token_bytes`: None for a special token) end in an incomplete UTF-8
    sequence, with room for its last bytes past `MAX_HELD`; the text decided before it goes out at once.
    Read from the text instead, a U+FFFD the model wrote was held, and missed by stop strings at the end;
    and tokens held for long were let go at `MAX_HELD` with the U+FFFD of a character still incomplete,
    whose completion then decoded to no new text and was lost.
    """

    def __init__(self, tokenizer, token_bytes, context=()):
        self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        self._bytes = token_bytes
        self._ids: list[int] = list(context)
        self._first = len(self._ids)  # the first generated token
        self._prefix = 0  # start of the decoding window
        self._read = self._first  # tokens up to here have been turned into text
        self._sent = 0  # characters the held tokens decided, gone out already

    def push(self, token_id: int) -> str:
        """The new text `token_id` decided ('' while it only continues a character still incomplete)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        start = len(before) + self._sent
        # a token that wrote nothing stays too, as context: a decoder may strip a space it finds first;
        # and a character's last bytes get room past the tokens that wrote nothing before them
        inside = after.endswith(REPLACEMENT) and self._inside_a_character()  # bytes cut show as U+FFFD
        holding, limit = inside or len(after) <= len(before), MAX_HELD + (4 if inside else 0)
        if holding and len(self._ids) - self._read < limit:
            end = len(after.rstrip(REPLACEMENT))  # what comes before the character still incomplete is decided
            piece = after[start:end] if end > start else ""
            self._sent += len(piece)
            return piece
        self._prefix, self._read, self._sent = self._read, len(self._ids), 0
        return after[start:] if len(after) > start else ""

    def flush(self) -> str:
        """Whatever is still held back, at the end of generation (may end in U+FFFD if truly invalid)."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        start = len(before) + self._sent
        self._prefix = self._read = len(self._ids)
        self._sent = 0
        return after[start:] if len(after) > start else ""

    def cut(self) -> bool:
        """Whether the tokens pushed end inside a character (what `flush` gave then ends in its U+FFFD)."""
        return self._inside_a_character(since=max(self._first, len(self._ids) - MAX_HELD))

    def _inside_a_character(self, since: int | None = None) -> bool:
        """Whether the bytes of the tokens from `since` (the held ones by default) end in an incomplete
        UTF-8 sequence: one that more bytes could still complete."""
        tokens = self._ids[self._read if since is None else since :]
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(b"".join(self._bytes[t] or b"" for t in tokens))
        return bool(decoder.getstate()[0])


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

    def feed_last(self, piece: str, cut: bool = True) -> str:
        """`feed` of the generation's last piece, then what was held back. When the end `cut` a character
        (`Detokenizer.cut`), the U+FFFD that end the piece stand for its bytes: written out, never taken
        for a stop string. One the model wrote whole is text like any other."""
        whole = piece.rstrip(REPLACEMENT) if cut else piece
        text = self.feed(whole)
        return text if self.stopped else text + self.flush() + piece[len(whole) :]

    def _undecided_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for size in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0
