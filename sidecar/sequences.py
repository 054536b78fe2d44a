"""Sequences that can be continued: the token ids a generation ended with, cut back or extended.

A session reuses its cache by longest common prefix (`session.py`), and the cache holds the last call's
input and its first (or best) sequence. Continuing a sequence is therefore only a matter of building the
right input ids; `session.generate(sequence)` then reuses what is cached, and `stats.reused_tokens`
says how much, so a recompute is never hidden.

Every result sequence, and a result of one sequence, continues as `Tokens`: all the ids of that
sequence (the call's input, then what it generated) with the tokenizer that wrote them. `[:k]` keeps
the first k ids (negative k as in Python), `cut(chars=n)` the ids of the first n characters of their
text, and `+ "text"` or `+ [ids]` appends. Only prefixes can be taken: a cache is a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from numbers import Integral

from .errors import InvalidArgument, SampleMismatch, TokenizerMismatch
from .text import check_unicode

# `cut` bisects over token counts, since the text grows with them, but for one exception: a character
# spelled by several tokens (at most 4 bytes) decodes as one or more U+FFFD until its last token, and its
# length can shrink there. So the few tokens past the bisection's answer are looked at again.
CUT_SLACK = 4


class Continuable:
    """What can be continued: a subclass gives its `tokens`. Slicing, cutting and appending return `Tokens`."""

    # Not iterable (`list(result)`, `3 in tokens` raise TypeError): without this, Python would iterate
    # through `__getitem__(0)`, which refuses an index that is not a slice, as InvalidArgument.
    __iter__ = None

    def __getitem__(self, index) -> "Tokens":
        return self.tokens[index]

    def __add__(self, more) -> "Tokens":
        return self.tokens + more

    def cut(self, chars: int) -> "Tokens":
        return self.tokens.cut(chars)


@dataclass(frozen=True)
class Tokens(Continuable):
    """Token ids to generate from, and the tokenizer they belong to (an engine refuses another's ids).

    Immutable: every operation returns a new value.
    """

    ids: tuple[int, ...]
    tokenizer: object = field(repr=False, compare=False)

    def __post_init__(self):
        # made by hand, or from a result edited since, it may hold anything: refused before any use
        if not isinstance(self.ids, tuple) or not all(_is_int(t) for t in self.ids):
            raise InvalidArgument(f"a sequence's token ids are a tuple of integers, got {_show(self.ids)}", option="prompt")

    @property
    def tokens(self) -> "Tokens":
        return self

    @property
    def text(self) -> str:
        """What the ids write, special tokens left out: what `cut` counts characters in."""
        return self.tokenizer.decode(list(self.ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index) -> "Tokens":
        """`[:k]`: the first k ids (k < 0: all but the last -k). Other indexes and slices are refused."""
        if not isinstance(index, slice) or index.start is not None or index.step is not None:
            raise InvalidArgument(f"only a prefix [:k] of a sequence can be continued, got [{_show(index)}]",
                                  option="tokens")
        return self if index.stop is None else self._first(index.stop, "tokens")

    def __add__(self, more) -> "Tokens":
        """Appends the tokens of a text (tokenized alone, with no special tokens: at the join they may
        differ from the tokens of the whole text), or a list of token ids."""
        if isinstance(more, str):
            return self._append_text(more, "append")
        return self._append_ids(more, "append")

    def cut(self, chars: int) -> "Tokens":
        """The ids of the first `chars` characters of `text`, rounded down to a token boundary: the most
        tokens whose text is a start of `text` at most `chars` long (never inside a character that
        several tokens spell)."""
        return self._cut(chars, "chars")

    # The operations, with the name of the option that asked for them (the protocol's differ).

    def _first(self, k, option: str) -> "Tokens":
        if not _is_int(k) or not -len(self.ids) <= k <= len(self.ids):
            raise InvalidArgument(f"{option} must be an integer in [-{len(self.ids)}, {len(self.ids)}] "
                                  f"(the sequence's tokens), got {_show(k)}", option=option)
        return Tokens(self.ids[:k], self.tokenizer)

    def _append_text(self, text, option: str) -> "Tokens":
        if not isinstance(text, str):
            raise InvalidArgument(f"{option} must be a string, got {_show(text)}", option=option)
        check_unicode(text, option)
        return Tokens(self.ids + tuple(self.tokenizer.encode(text, add_special_tokens=False)), self.tokenizer)

    def _append_ids(self, ids, option: str) -> "Tokens":
        """Ids past the vocabulary are `TokenOutOfRange` where the sequence meets a model; a negative id is no
        token id anywhere, refused here."""
        if isinstance(ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in ids):
            return Tokens(self.ids + tuple(int(t) for t in ids), self.tokenizer)
        raise InvalidArgument(f"{option}: a sequence is extended by a string or a list of token ids (integers >= 0), "
                              f"got {_show(ids)}", option=option)

    def _cut(self, chars, option: str) -> "Tokens":
        text = self.text
        if not _is_int(chars) or not 0 <= chars <= len(text):
            raise InvalidArgument(f"{option} must be an integer in [0, {len(text)}] (the sequence's characters), "
                                  f"got {_show(chars)}", option=option)

        def start(k: int) -> str:
            return self.tokenizer.decode(list(self.ids[:k]), skip_special_tokens=True, clean_up_tokenization_spaces=False)

        low, high = 0, len(self.ids)
        while low < high:
            middle = (low + high + 1) // 2
            if len(start(middle)) <= chars:
                low = middle
            else:
                high = middle - 1
        for k in range(min(low + CUT_SLACK, len(self.ids)), -1, -1):
            written = start(k)
            if len(written) <= chars and text.startswith(written):
                return Tokens(self.ids[:k], self.tokenizer)
        raise AssertionError("no tokens at all write a start of any text")


def input_ids(tokenizer, value: Continuable) -> list[int]:
    """The ids to generate from, for a sequence given as the input of a session of `tokenizer`'s model."""
    tokens = value.tokens
    if tokens.tokenizer is not tokenizer:
        raise TokenizerMismatch("the sequence was made by another engine, whose token ids may mean other text here; "
                                "to reuse its ids anyway, pass token_ids=list(sequence.tokens.ids)")
    return [int(t) for t in tokens.ids]


def continuation(last, sequence=0, tokens=None, chars=None, append=None, append_token_ids=None) -> Tokens:
    """Sequence `sequence` of the result `last`, cut to `tokens` tokens or `chars` characters, then
    extended by `append` (a text) or `append_token_ids`: the protocol's `generate.continue`, whose
    option names the errors carry."""
    if last is None:
        raise InvalidArgument("the session has no result to continue: it has not generated yet", option="continue")
    if not _is_int(sequence) or not 0 <= sequence < len(last.sequences):
        raise SampleMismatch(f"continue.sequence must be an index of the last result's {len(last.sequences)} "
                             f"sequence(s), got {sequence!r}", option="continue.sequence", sequences=len(last.sequences))
    if tokens is not None and chars is not None:
        raise InvalidArgument("give at most one of continue.tokens and continue.chars", option="continue")
    if append is not None and append_token_ids is not None:
        raise InvalidArgument("give at most one of continue.append and continue.append_token_ids", option="continue")
    result = last.sequences[sequence].tokens
    if tokens is not None:
        result = result._first(tokens, "continue.tokens")
    if chars is not None:
        result = result._cut(chars, "continue.chars")
    if append is not None:
        result = result._append_text(append, "continue.append")
    if append_token_ids is not None:
        result = result._append_ids(append_token_ids, "continue.append_token_ids")
    return result


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
