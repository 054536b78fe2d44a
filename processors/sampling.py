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
    cumulative mass (the mass at and below it) is <= 1 - p. That mass can be found without sorting
    everything: for a peaked distribution, a small descending top slice plus the sum of the rest; for
    a wide nucleus, by bucketing the row by value and sorting only the bucket the cut falls in. The
    float32 comparison is made on the same rounded value transformers compares (cumsum accumulates in
    double on the CPU). Where the answer hinges on tie order or on rounding, the reference sort decides.
    """

    name: ClassVar[str] = "top_p"
    p: float = option("the probability mass to keep, in (0, 1]", check=checks.real_in(0.0, 1.0, low_open=True))
    min_tokens_to_keep: int = option(MIN_TOKENS_DOC, default=1, check=checks.int_at_least(1))

    FIRST_SLICE: ClassVar[int] = 64

    def transform(self, logits, context):
        if logits.dtype not in (torch.float32, torch.float64):
            return _top_p_sorted(logits, self.p, self.min_tokens_to_keep)
        return _top_p_fast(logits, self.p, self.min_tokens_to_keep, self.FIRST_SLICE)


def _top_p_sorted(logits: torch.Tensor, p: float, min_keep: int) -> torch.Tensor:
    """The reference computation: sort ascending, drop the low tail of cumulative mass <= 1 - p."""
    ascending, order = logits.sort(dim=-1)
    low_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = low_mass <= 1 - p
    drop[:, -min_keep:] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), NEG_INF)


def _top_p_fast(logits: torch.Tensor, p: float, min_keep: int, first: int) -> torch.Tensor:
    vocab = logits.shape[-1]
    probs = logits.softmax(dim=-1)
    threshold = torch.tensor(1 - p, dtype=logits.dtype)
    width = min(vocab, max(first, min_keep + 1))
    top, index = logits.topk(width, dim=-1)
    top_probs = probs.gather(1, index).double()
    # The mass at and below each slice position, summed from the bottom as transformers does: a
    # difference of two sums near 1 would lose the tiny tails that p close to 1 compares against.
    tail = probs.double().scatter_(1, index, 0.0).sum(dim=-1, keepdim=True)
    low_mass = tail + top_probs.flip(1).cumsum(dim=1).flip(1)
    drop = low_mass.to(logits.dtype) <= threshold
    drop[:, :min_keep] = False
    kept = (~drop).sum(dim=-1)
    cut_in_slice = (kept < width) | (width == vocab)
    boundary = torch.stack([kept - 1, kept.clamp(max=width - 1)], dim=1).clamp(min=0)
    # A cut inside a group of equal logits keeps whichever of them the unstable sort put last, and a
    # cut within rounding error of 1 - p depends on transformers' summation order: the sort decides both.
    straddles = (kept < width) & (top.gather(1, boundary[:, :1]) == top.gather(1, boundary[:, 1:])).squeeze(1)
    undecided = straddles | _near_tie(low_mass.gather(1, boundary), 1 - p)
    out = torch.full_like(logits, NEG_INF)
    rows = torch.arange(logits.shape[0])
    sliced = rows[cut_in_slice & ~undecided]
    out[sliced.unsqueeze(1), index[sliced]] = top[sliced].masked_fill(drop[sliced], NEG_INF)
    for r in rows[cut_in_slice & undecided].tolist():
        out[r] = _top_p_sorted(logits[r : r + 1], p, min_keep)[0]
    for r in rows[~cut_in_slice].tolist():
        out[r] = _top_p_wide_row(logits[r], probs[r], threshold, p, min_keep)
    return out


BUCKETS = 1024
# Our probabilities come from a softmax over the unsorted row, transformers' from the sorted one: the
# float32 normaliser is summed in another order, so cumulative masses differ by up to a few 1e-6
# relative on flat rows of 32k tokens (measured). A cut that close to 1 - p is decided by the
# reference computation instead.
NEAR_TIE = 1e-5


def _near_tie(low_mass: torch.Tensor, bound: float) -> torch.Tensor:
    """Rows where any given cumulative mass is within float32 summation error of the bound."""
    return ((low_mass - bound).abs() <= NEAR_TIE * low_mass.clamp(min=bound)).any(dim=-1)


def _top_p_wide_row(logits: torch.Tensor, probs: torch.Tensor, threshold, p, min_keep):
    """One row whose nucleus is wider than the slice: sort only the bucket of values where the cut falls.

    Buckets split [min, max] of the finite logits evenly, bucket 0 holding the largest. The first token
    after bucket b is dropped iff the mass of the buckets below b rounds to <= 1 - p. The first such b,
    with the next non-empty bucket, holds the first dropped token, and only those are sorted. Anything
    that contradicts that premise (rounding at a bucket edge, ties, min_keep) uses the full sort.
    """
    finite = logits.isfinite()
    high = logits.max()
    low = logits.masked_fill(~finite, float("inf")).min()
    if not bool(high > low):
        return _top_p_sorted(logits[None], p, min_keep)[0]
    bucket = ((high - logits) * ((BUCKETS - 1) / (high - low))).floor_().clamp_(0, BUCKETS - 1).long()
    bucket = bucket.masked_fill_(~finite, BUCKETS)  # -inf: a bucket of its own, last
    mass = torch.zeros(BUCKETS + 1, dtype=torch.float64).scatter_add_(0, bucket, probs.double())
    count = torch.bincount(bucket, minlength=BUCKETS + 1)
    below = mass.flip(0).cumsum(0).flip(0) - mass  # mass of the buckets after each one
    after_dropped = (below.to(logits.dtype) <= threshold).nonzero()
    first_cut = int(after_dropped[0])  # the -inf bucket has nothing below it, so one always qualifies
    later = (count[first_cut + 1 :] > 0).nonzero()
    last = first_cut + 1 + int(later[0]) if later.numel() else first_cut
    region = ((bucket >= first_cut) & (bucket <= last)).nonzero().squeeze(1)
    values, order = logits[region].sort(descending=True)
    region_probs = probs[region[order]].double()
    low_mass = below[last] + region_probs.flip(0).cumsum(0).flip(0)
    drop = low_mass.to(logits.dtype) <= threshold
    kept = int((~drop).sum())
    start = int(count[:first_cut].sum())
    straddles = 0 < kept < len(values) and bool(values[kept - 1] == values[kept])
    near = bool(_near_tie(low_mass[max(kept - 1, 0) : kept + 1][None], 1 - p).any())
    if kept == 0 or bool(drop[0]) or start + kept < min_keep or straddles or near:
        return _top_p_sorted(logits[None], p, min_keep)[0]
    return logits.masked_fill(logits < values[kept - 1], NEG_INF)


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
