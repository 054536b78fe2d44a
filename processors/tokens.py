"""Processors that force, forbid or bias specific tokens, with transformers' semantics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from . import checks
from .contract import StatelessProcessor, option

NEG_INF = float("-inf")


def _ban(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logits.index_fill(1, ids.to(logits.device), NEG_INF)


def _force(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Every token but `ids` becomes impossible; `ids` get logit 0."""
    return torch.full_like(logits, NEG_INF).index_fill_(1, ids.to(logits.device), 0.0)


class _NamesTokens(StatelessProcessor):
    """A processor configured with token ids: keeps them as a tensor, built once at configure time."""

    def named_ids(self) -> tuple[int, ...]:
        raise NotImplementedError

    def validate(self):
        object.__setattr__(self, "_ids", torch.tensor(self.named_ids(), dtype=torch.long))

    def max_token_id(self):
        return max(self.named_ids(), default=-1)


@dataclass(frozen=True)
class MinLength(_NamesTokens):
    """Forbids EOS while the whole sequence (prompt included) is shorter than `min_length`."""

    name: ClassVar[str] = "min_length"
    min_length: int = option("the minimum total length, >= 0", check=checks.int_at_least(0))
    eos_token_ids: tuple[int, ...] = option("the EOS token id or ids", check=checks.token_ids)

    def named_ids(self):
        return self.eos_token_ids

    def transform(self, logits, context):
        return _ban(logits, self._ids) if context.length < self.min_length else logits


@dataclass(frozen=True)
class MinNewTokens(_NamesTokens):
    """Forbids EOS until `min_new_tokens` tokens have been generated after the prompt."""

    name: ClassVar[str] = "min_new_tokens"
    min_new_tokens: int = option("the minimum number of generated tokens, >= 0", check=checks.int_at_least(0))
    eos_token_ids: tuple[int, ...] = option("the EOS token id or ids", check=checks.token_ids)

    def named_ids(self):
        return self.eos_token_ids

    def transform(self, logits, context):
        return _ban(logits, self._ids) if context.length - context.input_length < self.min_new_tokens else logits


@dataclass(frozen=True)
class SuppressTokens(_NamesTokens):
    """Forbids the given tokens at every step."""

    name: ClassVar[str] = "suppress_tokens"
    token_ids: tuple[int, ...] = option("the token ids never to generate", check=checks.token_ids)

    def named_ids(self):
        return self.token_ids

    def transform(self, logits, context):
        return _ban(logits, self._ids)


@dataclass(frozen=True)
class SuppressTokensAtBegin(_NamesTokens):
    """Forbids the given tokens at the step where the sequence length equals `begin_index`."""

    name: ClassVar[str] = "suppress_tokens_at_begin"
    token_ids: tuple[int, ...] = option("the token ids not to generate first", check=checks.token_ids)
    begin_index: int | None = option(
        "the length at which to suppress; default: the prompt length (the first generated token)",
        default=None,
        check=checks.optional(checks.int_at_least(0)),
    )

    def named_ids(self):
        return self.token_ids

    def transform(self, logits, context):
        begin = context.input_length if self.begin_index is None else self.begin_index
        return _ban(logits, self._ids) if context.length == begin else logits


@dataclass(frozen=True)
class ForcedBOS(_NamesTokens):
    """Forces `token_id` when the sequence has length 1 (the first decoder step of encoder-decoders)."""

    name: ClassVar[str] = "forced_bos"
    token_id: int = option("the token to force", check=checks.token_id)

    def named_ids(self):
        return (self.token_id,)

    def transform(self, logits, context):
        return _force(logits, self._ids) if context.length == 1 else logits


@dataclass(frozen=True)
class ForcedEOS(_NamesTokens):
    """Forces EOS at the last position allowed, when the length is `max_length` - 1."""

    name: ClassVar[str] = "forced_eos"
    max_length: int = option("the total length the sequence must not exceed, >= 1", check=checks.int_at_least(1))
    eos_token_ids: tuple[int, ...] = option("the EOS token id or ids", check=checks.token_ids)

    def named_ids(self):
        return self.eos_token_ids

    def transform(self, logits, context):
        return _force(logits, self._ids) if context.length == self.max_length - 1 else logits


class _BiasTable:
    """Token-sequence biases compiled once into tensors, grouped by prefix length."""

    def __init__(self, entries: dict[tuple[int, ...], float]):
        single = {seq[0]: bias for seq, bias in entries.items() if len(seq) == 1}
        self.single_ids = torch.tensor(list(single), dtype=torch.long)
        self.single_bias = torch.tensor(list(single.values()), dtype=torch.float32)
        by_prefix_length: dict[int, list] = {}
        for seq, bias in entries.items():
            if len(seq) > 1:
                by_prefix_length.setdefault(len(seq) - 1, []).append((seq, bias))
        self.groups = tuple(
            (
                torch.tensor([seq[:-1] for seq, _ in group]),
                torch.tensor([seq[-1] for seq, _ in group]),
                torch.tensor([bias for _, bias in group], dtype=torch.float32),
            )
            for group in by_prefix_length.values()
        )

    def apply(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        bias = torch.zeros_like(logits)
        if self.single_ids.numel():
            bias[:, self.single_ids] = self.single_bias.to(logits.dtype)
        for prefixes, last, values in self.groups:
            width = prefixes.shape[1]
            if width > tokens.shape[1]:
                continue
            matches = (tokens[:, None, tokens.shape[1] - width :] == prefixes).all(dim=-1)
            bias.index_add_(1, last, torch.where(matches, values, 0.0).to(logits.dtype))
        return logits + bias


@dataclass(frozen=True)
class SequenceBias(StatelessProcessor):
    """Adds a bias to a token when the tokens before it end the sequence as listed.

    A one-token entry biases that token always. A longer entry biases its last token when the sequence
    ends with the entry's other tokens. A later entry for the same token sequence replaces an earlier one.
    """

    name: ClassVar[str] = "sequence_bias"
    sequence_bias: tuple = option("a non-empty list of [token_ids, bias] pairs (from Python, also a dict {(token ids...): bias})",
                                 check=checks.sequence_biases)

    def validate(self):
        object.__setattr__(self, "_table", _BiasTable(dict(self.sequence_bias)))

    def max_token_id(self):
        return max(t for seq, _ in self.sequence_bias for t in seq)

    def transform(self, logits, context):
        return self._table.apply(logits, context.tokens)


@dataclass(frozen=True)
class NoBadWords(StatelessProcessor):
    """Forbids token sequences: the last token of each listed sequence once the others have been produced.

    Sequences that are a single EOS id are ignored, so EOS stays possible.
    """

    name: ClassVar[str] = "no_bad_words"
    bad_words_ids: tuple = option("a non-empty list of token-id lists to forbid", check=checks.token_sequences)
    eos_token_ids: tuple[int, ...] | None = option(
        "EOS id or ids that stay allowed", default=None, check=checks.optional(checks.token_ids)
    )

    def validate(self):
        eos = set(self.eos_token_ids or ())
        banned = {seq: NEG_INF for seq in self.bad_words_ids if not (len(seq) == 1 and seq[0] in eos)}
        object.__setattr__(self, "_table", _BiasTable(banned))

    def max_token_id(self):  # an EOS id exempts only what it names, but it is a token id like the others
        return max(t for ids in (*self.bad_words_ids, self.eos_token_ids or ()) for t in ids)

    def transform(self, logits, context):
        return self._table.apply(logits, context.tokens)
