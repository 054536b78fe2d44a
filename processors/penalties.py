"""Penalties on tokens already in the sequence.

RepetitionPenalty, FrequencyPenalty and PresencePenalty are stateful: they keep a B x V tensor updated
with only the tokens added since the previous step, so a step costs O(V) whatever the sequence length,
instead of re-scanning the whole history as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from . import checks
from .contract import Context, LogitsProcessor, StatelessProcessor, option


class _TokenTally(LogitsProcessor):
    """Shared state of the stateful penalties: a per-row tally of tokens from `first_counted(context)` on.

    State: {"tally": B x V, "counted": 0-dim length up to which the tally is complete}. A bool tally
    records presence, an integer one counts occurrences.
    """

    TALLY_DTYPE: ClassVar[torch.dtype] = torch.int32

    def first_counted(self, context: Context) -> int:
        raise NotImplementedError

    def penalize(self, tally: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _add(self, tally: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if tally.dtype == torch.bool:
            return tally.scatter(1, tokens, True)
        return tally.scatter_add(1, tokens, torch.ones_like(tokens, dtype=tally.dtype))

    def _update(self, tally: torch.Tensor, counted: int, context: Context) -> dict:
        start = max(counted, self.first_counted(context))
        if context.length > start:
            tally = self._add(tally, context.sequence[:, start : context.length])
        return {"tally": tally, "counted": torch.tensor(context.length)}

    def init(self, context):
        empty = torch.zeros(
            context.sequence.shape[0], context.vocab_size, dtype=self.TALLY_DTYPE, device=context.sequence.device
        )
        return self._update(empty, 0, context)

    def process(self, state, logits, context):
        counted = int(state["counted"])
        if context.length > counted:
            state = self._update(state["tally"], counted, context)
        return state, self.penalize(state["tally"], logits)


@dataclass(frozen=True)
class RepetitionPenalty(_TokenTally):
    """Divides positive and multiplies negative logits of every token already present (CTRL's penalty).

    As in transformers, the prompt counts too unless `prompt_ignore_length` skips its first tokens.
    """

    name: ClassVar[str] = "repetition_penalty"
    penalty: float = option("> 1 discourages repetition, < 1 encourages it", check=checks.positive_real)
    prompt_ignore_length: int | None = option(
        "ignore this many leading tokens of the sequence", default=None, check=checks.optional(checks.int_at_least(0))
    )
    TALLY_DTYPE: ClassVar[torch.dtype] = torch.bool

    def first_counted(self, context):
        return self.prompt_ignore_length or 0

    def penalize(self, seen, logits):
        # Only the seen tokens change; a dense select over a random sign mask is ~10x slower on the CPU.
        rows, cols = seen.nonzero(as_tuple=True)
        values = logits[rows, cols]
        return logits.index_put((rows, cols), torch.where(values < 0, values * self.penalty, values / self.penalty))


@dataclass(frozen=True)
class FrequencyPenalty(_TokenTally):
    """OpenAI's frequency penalty: subtracts `penalty` x (times the token was generated so far).

    Only generated tokens count (from `input_length` on), as in OpenAI's API.
    """

    name: ClassVar[str] = "frequency_penalty"
    penalty: float = option("in [-2, 2]; positive discourages repetition", check=checks.real_in(-2.0, 2.0))

    def first_counted(self, context):
        return context.input_length

    def penalize(self, counts, logits):
        return logits - counts.to(logits.dtype) * self.penalty


@dataclass(frozen=True)
class PresencePenalty(_TokenTally):
    """OpenAI's presence penalty: subtracts `penalty` once from every token generated so far."""

    name: ClassVar[str] = "presence_penalty"
    penalty: float = option("in [-2, 2]; positive discourages repetition", check=checks.real_in(-2.0, 2.0))

    def first_counted(self, context):
        return context.input_length

    def penalize(self, counts, logits):
        return logits - (counts > 0).to(logits.dtype) * self.penalty


@dataclass(frozen=True)
class NoRepeatNGram(StatelessProcessor):
    """Bans every token that would complete an n-gram already present in the sequence (prompt included)."""

    name: ClassVar[str] = "no_repeat_ngram"
    ngram_size: int = option("the n of the n-grams that may occur only once, >= 1", check=checks.int_at_least(1))

    def transform(self, logits, context):
        n = self.ngram_size
        tokens = context.tokens
        if tokens.shape[1] < n:
            return logits
        grams = tokens.unfold(1, n, 1)
        tail = tokens[:, tokens.shape[1] - n + 1 :].unsqueeze(1)
        rows, starts = (grams[:, :, : n - 1] == tail).all(dim=-1).nonzero(as_tuple=True)
        if rows.numel() == 0:
            return logits
        return logits.index_put((rows, grams[rows, starts, n - 1]), torch.tensor(float("-inf"), dtype=logits.dtype))
