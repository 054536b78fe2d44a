"""Sampling warpers: Temperature, TopH, TopK, TopP, MinP, TypicalP, EpsilonCutoff, EtaCutoff, with transformers' semantics.

Removed tokens get -inf. Where transformers breaks ties by an unstable sort, we call the same sort on the
same row so the kept set is identical, but only on the rare rows where a tie straddles the cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
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
class TopH(StatelessProcessor):
    """Top-H sampling (transformers' `TopHLogitsWarper`, arXiv 2509.02510): among the 100 most likely tokens,
    keeps them in order of probability while the entropy they add up to stays within `h` times the entropy
    of those 100 (renormalised among themselves); the most likely always. Computed as transformers does
    (`torch.distributions.Categorical` over the top 100, its clamp of log-probabilities included), so the
    kept sets are the same."""

    name: ClassVar[str] = "top_h"
    h: float = option("the share of the top tokens' entropy the kept ones may add up to, in (0, 1]",
                      check=checks.real_in(0.0, 1.0, low_open=True))

    CANDIDATES: ClassVar[int] = 100  # transformers' `top_n`

    def transform(self, logits, context):
        top, indices = logits.topk(min(self.CANDIDATES, logits.shape[-1]), dim=-1)
        normalised = top - top.logsumexp(dim=-1, keepdim=True)
        probs = normalised.softmax(dim=-1)
        entropy = -(normalised.clamp(min=torch.finfo(normalised.dtype).min) * probs).sum(dim=-1, keepdim=True)
        kept = (-probs * probs.log()).cumsum(dim=-1) <= entropy * self.h
        kept[:, 0] = True
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, indices, kept)
        return logits.masked_fill(~keep, NEG_INF)


@dataclass(frozen=True)
class TopP(StatelessProcessor):
    """Nucleus sampling: keeps the most likely tokens until their mass reaches `p`.

    transformers sorts the whole vocabulary in ascending order and drops every token whose ascending
    cumulative mass (the mass at and below it) is <= 1 - p. The dropped tokens are a prefix of that order,
    so each row's answer is one cut: its smallest kept logit. We find it without sorting whole rows, for
    the whole batch at once: a peaked row cuts among its few largest tokens, which a top slice and the
    mass below it decide; a wide nucleus is found by bucketing the row by value and sorting only the
    bucket the cut falls in. Masses are compared after the same rounding to the logits' dtype that
    transformers' comparison sees (its cumsum accumulates in double on the CPU). A cut within summation
    error of 1 - p is recomputed exactly from the row's sorted values; a cut inside a group of equal
    logits goes to the reference sort, whose tie order decides which of them stay.
    """

    name: ClassVar[str] = "top_p"
    p: float = option("the probability mass to keep, in [0, 1] (0 keeps min_tokens_to_keep tokens, as in transformers)",
                      check=checks.real_in(0.0, 1.0))
    min_tokens_to_keep: int = option(MIN_TOKENS_DOC, default=1, check=checks.int_at_least(1))

    SLICE: ClassVar[int] = 64

    def transform(self, logits, context):
        if logits.dtype not in (torch.float32, torch.float64):
            return _top_p_sorted(logits, self.p, self.min_tokens_to_keep)
        return _top_p_fast(logits, self.p, self.min_tokens_to_keep, self.SLICE)


def _top_p_sorted(logits: torch.Tensor, p: float, min_keep: int) -> torch.Tensor:
    """The reference computation: sort ascending, drop the low tail of cumulative mass <= 1 - p."""
    ascending, order = logits.sort(dim=-1)
    low_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = low_mass <= 1 - p
    drop[:, -min(min_keep, drop.shape[-1]):] = False  # past 2**63 torch warns on the log that it truncates the slice
    return logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), NEG_INF)


def _top_p_fast(logits: torch.Tensor, p: float, min_keep: int, slice_width: int) -> torch.Tensor:
    """Each row's cut from the top slice or from buckets; the rows neither decides go to the exact paths."""
    vocab = logits.shape[-1]
    probs = logits.softmax(dim=-1)
    largest = probs.amax(dim=1)
    if min_keep >= vocab or not bool(largest.isfinite().all()):
        # Nothing can be dropped, or a row holds NaN or +inf or only -inf, whose softmax is NaN: rare
        # enough to leave whole to the reference.
        return _top_p_sorted(logits, p, min_keep)
    width = min(vocab, max(slice_width, min_keep + 1))
    # The slice cannot hold p when even `width` copies of the largest probability fall short (with a
    # margin far above the ~1e-6 by which the probabilities' sum strays from 1). Flat rows skip it; if
    # any row may cut within it, it runs on the whole batch.
    wide = width * largest < p - SLICE_MARGIN
    if bool(wide.all()):
        cut, near, tie = torch.empty_like(largest), torch.zeros_like(wide), torch.zeros_like(wide)
    else:
        cut, near, tie, below = _cut_in_slice(logits, probs, width, p, min_keep)
        wide |= below
    if bool(wide.any()):
        # These rows keep more than the slice, so min_keep, smaller than the slice, does not bind there.
        rows = wide.nonzero()[:, 0]
        selected = logits if len(rows) == len(logits) else logits[rows]
        cut[rows], near[rows], tie[rows] = _cut_by_buckets(selected, probs, largest[rows], rows, p)
    if bool(near.any()):
        cut[near], tie[near] = _cut_by_sorted_values(logits[near], p, min_keep)
    out = _drop_below(logits, cut, out=probs)  # the probabilities are spent: their memory takes the output
    if bool(tie.any()):
        out[tie] = _top_p_sorted(logits[tie], p, min_keep)
    return out


SLICE_MARGIN = 1e-4

# Our probabilities come from a softmax over the unsorted row, transformers' from the sorted one: the
# float32 normaliser is summed in another order, so cumulative masses differ by up to ~1e-6 relative on
# rows of 32k tokens (measured), and our float32 sum of the mass below the slice strays by up to ~4e-7
# (measured on equal, sorted and lopsided rows). A cut that close to 1 - p is decided from the sorted
# values instead.
NEAR_TIE = 1e-5

# A softmax adds a group of equal logits one after another when they are adjacent, as they are once
# sorted: each float32 lane adds the same value again and again, so rounding errors can pile up instead of
# averaging out. One addition moves a lane's sum by at most half its float32 step, which with 8 lanes or
# more is at most DRIFT of the whole. Measured on rows of 50k tokens, the normaliser strays by 2e-6 with
# 1000 equal logits, 7e-6 with 3000, 1.2e-5 with 10000. A row whose bucket masses allow CROWD tokens in
# one bucket (the fullest bucket of a flat row holds ~200 tokens of 32k, ~1300 of 152k) may hold such a
# group: it is decided from sorted values. A bucket allows its mass over the smallest probability it can
# hold, at its far edge; the lowest bucket, whose float32 probabilities are 0, is left out.
DRIFT = 2.0**-27
CROWD = 2048


def _near_tie(low_mass: torch.Tensor, bound: float, margin=NEAR_TIE) -> torch.Tensor:
    """Rows with a cumulative mass within float32 summation error of the bound: |mass - bound| at most
    `margin` (relative; one for all rows, or one a row) times the larger of the two.

    Masses fall along a row, so any mass that near sits next to the cut: checking all of them is the
    same as checking the last kept and the first dropped.
    """
    return ((low_mass >= bound * (1 - margin)) & (low_mass <= bound / (1 - margin))).any(dim=1)


def _decide(values: torch.Tensor, low_mass: torch.Tensor, kept: torch.Tensor, p: float, margin=NEAR_TIE):
    """(cut, near, tie) for rows whose candidate logits `values` (descending) have cumulative masses
    `low_mass`, and keep the first `kept` of them. Both arrays end with a column standing for the first
    token after the candidates.
    """
    cut = values.gather(1, kept - 1)
    tie = cut == values.gather(1, kept)
    return cut[:, 0], _near_tie(low_mass, 1 - p, margin), tie[:, 0]


def _cut_in_slice(logits, probs, width, p, min_keep):
    """Cuts among the `width` largest logits: their masses are the mass below them plus suffix sums.

    Returns (cut, near, tie, below), `below` marking rows whose cut falls below the slice: their other
    entries mean nothing. The mass below is summed over `probs` with the slice zeroed, then put back.
    """
    top, index = logits.topk(width, dim=1)
    top_probs = probs.gather(1, index)
    rest = probs.scatter_(1, index, 0.0).sum(dim=1, keepdim=True)
    probs.scatter_(1, index, top_probs)
    low_mass = _suffix_sums(torch.cat([top_probs, rest], dim=1).double())
    kept = (low_mass[:, :width].to(probs.dtype) > 1 - p).sum(dim=1, keepdim=True)
    # A crowd of equal logits below the slice (see CROWD) shifts either normaliser by at most its mass, or
    # DRIFT per member. That worst case widens the margin here, where masses step by whole probabilities
    # of the largest tokens, so that it costs next to nothing.
    margin = NEAR_TIE + 2 * rest.double().clamp(max=probs.shape[1] * DRIFT)
    values = torch.nn.functional.pad(top, (0, 1), value=NEG_INF)
    cut, near, tie = _decide(values, low_mass, kept.clamp(min=min_keep), p, margin)
    return cut, near, tie, ((kept == width) & (width < probs.shape[1]))[:, 0]


# Buckets split the distance below a row's largest logit on a log scale, 2**BUCKET_BITS of them per
# octave from 2**-8 to 2**7: a float32's exponent and leading mantissa bits. They are fine near the top,
# and at most 1/256 of the distance wide elsewhere: the bucket a flat row of 32k tokens cuts in holds
# ~200 tokens. Distances from 2**7 on share the lowest bucket: their float32 probabilities are 0.
BUCKET_BITS = 8
NEAREST, FARTHEST = 2.0**-8, 2.0**7
MANTISSA_SHIFT = 23 - BUCKET_BITS


def _float32_bits(distance: float) -> int:
    """The exponent and leading mantissa bits of a float32 distance: its bucket, counted up from 0."""
    return int(torch.tensor(distance, dtype=torch.float32).view(torch.int32)) >> MANTISSA_SHIFT


TOP_BUCKET = _float32_bits(FARTHEST) - _float32_bits(NEAREST)


def _cut_by_buckets(logits, probs, largest, rows, p):
    """Cuts from bucket masses and a sort of the one bucket each cut falls in, for `logits`, the given
    rows of the batch whose probabilities are `probs`, `largest` the largest of each.

    Buckets go up in value. The largest token below bucket b has the mass of all the buckets below b,
    so it is dropped iff that mass rounds to <= 1 - p; the last such b holds the last kept token. A row
    that keeps nothing of that bucket has bucket and token sums rounding apart, so a mass within the
    near-tie margin: its count is clamped to 1 only to keep the gathers in range.
    """
    bucket = _bucket_index(logits)
    mass = _bucket_mass(bucket, probs, rows)
    below = torch.nn.functional.pad(mass.cumsum(dim=1)[:, :-1], (1, 0))
    cut_bucket = (below.to(logits.dtype) <= 1 - p).sum(dim=1, keepdim=True) - 1  # below grows along the row
    values, masses = _sorted_bucket(logits, probs, rows, bucket == cut_bucket.to(bucket.dtype))
    masses[:, -1:] = below.gather(1, cut_bucket)  # the mass below the bucket, in the padding column
    low_mass = _suffix_sums(masses)
    kept = (low_mass.to(logits.dtype) > 1 - p).sum(dim=1, keepdim=True)
    cut, near, tie = _decide(values, low_mass, kept.clamp(min=1), p)
    return cut, near | _crowded(mass, largest), tie


def _bucket_index(logits: torch.Tensor) -> torch.Tensor:
    """Each logit's bucket, in [0, TOP_BUCKET]: the float32 bits of its distance below the row's largest,
    counted down from the farthest.

    Rounding and the bits of a non-negative float both keep order, so a larger logit never lands in a
    lower bucket, and equal logits share one.
    """
    distance = (logits.amax(dim=1, keepdim=True) - logits).to(torch.float32).clamp_(NEAREST, FARTHEST)
    bits = distance.view(torch.int32).bitwise_right_shift_(MANTISSA_SHIFT)
    return bits.neg_().add_(_float32_bits(FARTHEST))


def _bucket_mass(bucket: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Per row and bucket, the mass of the bucket; `bucket` holds the given rows of `probs`.

    Summed in double: a bucket can hold thousands of equal probabilities, whose float32 sum strays by
    1e-4. Row by row: the double copy of one row is memory the allocator reuses, where a copy of the whole
    batch would be fresh memory, and its page faults, on every call.
    """
    weights, per_row = probs.unbind(), zip(bucket.unbind(), rows.tolist())
    return torch.stack([torch.bincount(b, weights[r].double(), minlength=TOP_BUCKET + 1) for b, r in per_row])


def _crowd_masses() -> torch.Tensor:
    """Per bucket, the mass of CROWD of its least likely tokens, relative to the row's largest probability:
    CROWD * exp(-far edge). Infinite for the lowest bucket, which is left out."""
    edge_bits = (_float32_bits(FARTHEST) - torch.arange(TOP_BUCKET + 1, dtype=torch.int32) + 1) << MANTISSA_SHIFT
    masses = CROWD * torch.exp(-edge_bits.view(torch.float32).double())
    return masses.index_fill_(0, torch.tensor([0]), float("inf"))


CROWD_MASSES = _crowd_masses()


def _crowded(mass: torch.Tensor, largest: torch.Tensor) -> torch.Tensor:
    """Rows whose bucket masses allow CROWD or more tokens in one bucket."""
    return (mass >= largest.unsqueeze(1) * CROWD_MASSES.to(mass.device)).any(dim=1)


def _sorted_bucket(logits: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, in_cut: torch.Tensor):
    """The logits of each row's cut bucket in descending order, and their probabilities in double.

    `logits` and `in_cut` hold the given rows of `probs`. Rows are padded with -inf logits of no mass
    to one more than the largest bucket: that last column stands for the first token below the bucket.
    """
    row, column = in_cut.nonzero(as_tuple=True)
    sizes = torch.bincount(row, minlength=in_cut.shape[0])
    position = torch.arange(len(row), device=row.device) - (sizes.cumsum(0) - sizes)[row]
    shape = (in_cut.shape[0], int(sizes.max()) + 1)
    values = logits.new_full(shape, NEG_INF).index_put_((row, position), logits[row, column])
    masses = probs.new_zeros(shape, dtype=torch.float64).index_put_((row, position), probs[rows[row], column].double())
    values, order = values.sort(dim=1, descending=True)
    return values, masses.gather(1, order)


def _suffix_sums(values: torch.Tensor) -> torch.Tensor:
    """Sums from each position to the row's end: summed from the smallest masses up, as transformers does.

    A difference of two sums near 1 would lose the tiny tails that p close to 1 compares against.
    """
    return values.flip(1).cumsum(dim=1).flip(1)


def _cut_by_sorted_values(logits: torch.Tensor, p: float, min_keep: int):
    """The exact cut, and whether it splits equal logits, from each row's ascending values.

    The ascending values are the same whatever order a sort gives equal logits, so softmax and cumsum
    over them reproduce transformers' masses bit for bit (both work row by row). Only tie order needs
    torch.sort's indices, which cost several times a sort of the values alone.
    """
    ascending = _ascending_values(logits)
    low_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
    dropped = (low_mass <= 1 - p).sum(dim=-1, keepdim=True).clamp_(max=logits.shape[-1] - min_keep)
    cut = ascending.gather(1, dropped)
    tie = (dropped > 0) & (ascending.gather(1, (dropped - 1).clamp(min=0)) == cut)
    return cut[:, 0], tie[:, 0]


def _ascending_values(logits: torch.Tensor) -> torch.Tensor:
    """Each row's values in ascending order: on the CPU, numpy's sort of the values alone."""
    if logits.device.type == "cpu":
        return torch.from_numpy(np.sort(logits.numpy(), axis=-1))
    return logits.sort(dim=-1).values


def _drop_below(logits: torch.Tensor, cut: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """-inf for each logit below its row's cut, written to `out`.

    torch.threshold keeps what is above the float just below the cut, without a branch per token; a
    masked_fill with the scattered mask of a wide nucleus costs a mispredicted branch every other token.
    """
    bounds = torch.nextafter(cut, torch.tensor(NEG_INF, dtype=cut.dtype, device=cut.device)).tolist()
    for row, bound, into in zip(logits.unbind(), bounds, out.unbind()):
        torch.threshold(row, bound, NEG_INF, out=into)
    return out


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
        drop[:, : min(self.min_tokens_to_keep, drop.shape[-1])] = False
        return logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), NEG_INF)


def _cut_below(logits: torch.Tensor, probs: torch.Tensor, threshold, min_tokens_to_keep: int) -> torch.Tensor:
    """Drops the tokens whose probability is below `threshold`, but never one at least as likely as the
    `min_tokens_to_keep`-th most likely (a cut that drops everything keeps the top ones)."""
    keep = min(min_tokens_to_keep, logits.shape[-1])
    floor = logits.topk(keep, dim=-1).values[:, -1:]
    return logits.masked_fill((probs < threshold) & (logits < floor), NEG_INF)


def _cutoff():
    return option("the probability a token needs, in (0, 1)", check=checks.real_in(0.0, 1.0, low_open=True, high_open=True))


@dataclass(frozen=True)
class EpsilonCutoff(StatelessProcessor):
    """Epsilon sampling (Hewitt et al., 2022): drops the tokens whose probability is below `epsilon`."""

    name: ClassVar[str] = "epsilon_cutoff"
    epsilon: float = _cutoff()
    min_tokens_to_keep: int = option(MIN_TOKENS_DOC, default=1, check=checks.int_at_least(1))

    def transform(self, logits, context):
        return _cut_below(logits, logits.softmax(dim=-1), self.epsilon, self.min_tokens_to_keep)


@dataclass(frozen=True)
class EtaCutoff(StatelessProcessor):
    """Eta sampling (Hewitt et al., 2022): drops the tokens whose probability is below
    `min(epsilon, sqrt(epsilon) * exp(-entropy))`, a cut that falls as the row's entropy rises."""

    name: ClassVar[str] = "eta_cutoff"
    epsilon: float = _cutoff()
    min_tokens_to_keep: int = option(MIN_TOKENS_DOC, default=1, check=checks.int_at_least(1))

    def transform(self, logits, context):
        # the entropy as torch.distributions.Categorical computes it (transformers' reference): impossible
        # tokens' log-probabilities clamped to the lowest float, so that they add 0, not NaN
        log_probs = logits - logits.logsumexp(dim=-1, keepdim=True)
        probs = log_probs.softmax(dim=-1)
        entropy = -(log_probs.clamp(min=torch.finfo(log_probs.dtype).min) * probs).sum(dim=-1)
        epsilon = torch.tensor(self.epsilon, device=logits.device)
        eta = torch.min(epsilon, epsilon.sqrt() * torch.exp(-entropy))[:, None]
        return _cut_below(logits, logits.softmax(dim=-1), eta, self.min_tokens_to_keep)
