"""Sampling warpers: Temperature, TopK, TopP, MinP, TypicalP, with transformers' semantics.

Removed tokens get -inf. Where transformers breaks ties by an unstable sort, we call the same sort on the
same row so the kept set is identical, but only on the rare rows where a tie straddles the cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from . import checks
from .contract import StatelessProcessor, option

NEG_INF = float("-inf")
MIN_TOKENS_DOC = "always keep at least this many of the most likely tokens, >= 1"


@dataclass(frozen=True)
class Temperature(StatelessProcessor):
    """Divides the logits by `temperature` (< 1 sharpens, > 1 flattens)."""

    name: ClassVar[str] = "temperature"
    temperature: float = option("the divisor, > 0", check=checks.positive_real)

    def transform(self, logits, context):
        return logits / self.temperature


@dataclass(frozen=True)
class TopK(StatelessProcessor):
    """Keeps the `k` largest logits, and every logit tied with the k-th."""

    name: ClassVar[str] = "top_k"
    k: int = option("how many tokens to keep, >= 1", check=checks.int_at_least(1))
    min_tokens_to_keep: int = option(MIN_TOKENS_DOC, default=1, check=checks.int_at_least(1))

    def transform(self, logits, context):
        vocab = logits.shape[-1]
        k = min(max(self.k, self.min_tokens_to_keep), vocab)
        if k == vocab:
            return logits
        top, index = logits.topk(k + 1, dim=-1)
        if bool((top[:, k] == top[:, k - 1]).any()):
            # something outside the top k ties with the k-th: keep every token >= the k-th
            return logits.masked_fill(logits < top[:, k - 1 : k], NEG_INF)
        return torch.full_like(logits, NEG_INF).scatter_(1, index[:, :k], top[:, :k])


@dataclass(frozen=True)
class TopP(StatelessProcessor):
    """Nucleus sampling: keeps the most likely tokens until their mass reaches `p`.

    transformers sorts the whole vocabulary in ascending order and drops every token whose ascending
    cumulative mass is <= 1 - p. The cumulative mass below a token equals the total minus the mass above
    it, so the cut can be found from a small descending top slice, grown only when the nucleus is larger
    than the slice. The float32 comparison is made on the same rounded value transformers compares
    (cumsum accumulates in double on the CPU), so the kept sets agree.
    """

    name: ClassVar[str] = "top_p"
    p: float = option("the probability mass to keep, in (0, 1]", check=checks.real_in(0.0, 1.0, low_open=True))
    min_tokens_to_keep: int = option(MIN_TOKENS_DOC, default=1, check=checks.int_at_least(1))

    FIRST_SLICE: ClassVar[int] = 64
    GROWTH: ClassVar[int] = 8

    def transform(self, logits, context):
        if logits.dtype not in (torch.float32, torch.float64):
            return _top_p_sorted(logits, self.p, self.min_tokens_to_keep)
        return _top_p_sliced(logits, self.p, self.min_tokens_to_keep, self.FIRST_SLICE, self.GROWTH)


def _top_p_sorted(logits: torch.Tensor, p: float, min_keep: int) -> torch.Tensor:
    """The reference computation: sort ascending, drop the low tail of cumulative mass <= 1 - p."""
    ascending, order = logits.sort(dim=-1)
    low_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = low_mass <= 1 - p
    drop[:, -min_keep:] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), NEG_INF)


def _top_p_sliced(logits: torch.Tensor, p: float, min_keep: int, first: int, growth: int) -> torch.Tensor:
    vocab = logits.shape[-1]
    probs = logits.softmax(dim=-1)
    total = probs.double().sum(dim=-1, keepdim=True)
    threshold = torch.tensor(1 - p, dtype=logits.dtype)
    out = torch.full_like(logits, NEG_INF)
    rows = torch.arange(logits.shape[0])
    # the first pass covers every row, so it works on the tensors themselves rather than row copies
    row_logits, row_probs, row_total = logits, probs, total
    width = min(vocab, max(first, min_keep + 1))
    while True:
        top, index = row_logits.topk(width, dim=-1)
        top_probs = row_probs.gather(1, index).double()
        above = top_probs.cumsum(dim=-1)
        # ascending cumulative mass at each slice position = total - mass strictly above it
        low_mass = (row_total - (above - top_probs)).to(logits.dtype)
        drop = low_mass <= threshold
        drop[:, :min_keep] = False
        kept = (~drop).sum(dim=-1)
        done = (kept < width) | (width == vocab)
        _write_nucleus(out, logits, p, min_keep, rows[done], top[done], index[done], drop[done], kept[done])
        if bool(done.all()):
            return out
        pending = ~done
        wider = min(vocab, width * growth)
        # No token outside the slice is likelier than its last one, so a wider slice holds at most this
        # much; where that cannot reach the nucleus, growing is wasted work and the sort is cheaper.
        reachable = above[pending, -1] + (wider - width) * top_probs[pending, -1]
        hopeless = reachable < p * row_total[pending, 0] * (1 - 1e-6)
        rows = rows[pending]
        for r in rows[hopeless].tolist():
            out[r] = _top_p_sorted(logits[r : r + 1], p, min_keep)[0]
        rows = rows[~hopeless]
        if not rows.numel():
            return out
        row_logits, row_probs, row_total, width = logits[rows], probs[rows], total[rows], wider


def _write_nucleus(out, logits, p, min_keep, rows, top, index, drop, kept) -> None:
    """Writes the kept slice entries of finished rows; a cut inside a tie defers to the sort."""
    if not rows.numel():
        return
    out[rows.unsqueeze(1), index] = top.masked_fill(drop, NEG_INF)
    width = top.shape[1]
    cut = kept.clamp(max=width - 1).unsqueeze(1)
    # A cut inside a group of equal logits keeps whichever of them the unstable sort put last.
    straddles = (kept < width) & (top.gather(1, cut - 1) == top.gather(1, cut)).squeeze(1)
    for r in rows[straddles].tolist():
        out[r] = _top_p_sorted(logits[r : r + 1], p, min_keep)[0]


@dataclass(frozen=True)
class MinP(StatelessProcessor):
    """Drops tokens whose probability is below `p` times the top token's probability."""

    name: ClassVar[str] = "min_p"
    p: float = option("the fraction of the top probability a token needs, in [0, 1]", check=checks.real_in(0.0, 1.0))
    min_tokens_to_keep: int = option(MIN_TOKENS_DOC, default=1, check=checks.int_at_least(1))

    def transform(self, logits, context):
        probs = logits.softmax(dim=-1)
        drop = probs < self.p * probs.amax(dim=-1, keepdim=True)
        if self.min_tokens_to_keep > 1:
            keep = probs.topk(min(self.min_tokens_to_keep, probs.shape[-1]), dim=-1).indices
            drop = drop.scatter(1, keep, False)
        return logits.masked_fill(drop, NEG_INF)


@dataclass(frozen=True)
class TypicalP(StatelessProcessor):
    """Locally typical sampling: keeps the tokens whose surprisal is closest to the entropy, up to mass `p`."""

    name: ClassVar[str] = "typical_p"
    p: float = option("the probability mass to keep, in (0, 1)", check=checks.real_in(0.0, 1.0, low_open=True, high_open=True))
    min_tokens_to_keep: int = option(MIN_TOKENS_DOC, default=1, check=checks.int_at_least(1))

    def transform(self, logits, context):
        log_probs = logits.log_softmax(dim=-1)
        entropy = -(log_probs * log_probs.exp()).nansum(dim=-1, keepdim=True)
        distance, order = (-log_probs - entropy).abs().sort(dim=-1)
        mass = logits.gather(1, order).softmax(dim=-1).cumsum(dim=-1)
        last = (mass < self.p).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
        drop = distance > distance.gather(1, last)
        drop[:, : self.min_tokens_to_keep] = False
        return logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), NEG_INF)
