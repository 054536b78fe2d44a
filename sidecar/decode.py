"""The model-facing steps of generation, one small function each: forward, check_logits, pick."""

from __future__ import annotations

import torch

from .attention import planned
from .errors import InvalidLogits


def forward(model, token_ids: list[int], positions: list[int], plan, keep: list[int]) -> torch.Tensor:
    """One forward pass over the flattened batch (`[1, T]`); float32 logits at the positions in `keep`.

    The positions are passed explicitly: each row has its own, and transformers would otherwise derive
    them from a cache it does not have here.
    """
    device, n = model.device, len(token_ids)
    with planned(plan):
        return model(
            input_ids=torch.tensor([token_ids], device=device),
            position_ids=torch.tensor([positions], device=device),
            # A 4-D mask is taken as already built, so the model skips building (and checking) its own, which
            # the plan makes useless; this one is a view of one element, never read.
            attention_mask=torch.ones((), dtype=torch.bool, device=device).expand(1, 1, n, n),
            use_cache=False,
            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
        ).logits[0].float()


def check_logits(logits, chain, shape: torch.Size, device: torch.device) -> None:
    """Raises `InvalidLogits` unless the processed logits are a tensor of the model's `shape`, on its
    `device`, with a finite maximum to sample or argmax from.

    One reduction per step, then two over the rows: a row's maximum is -inf when every token of it was
    removed, and +inf or NaN when any logit is (NaN propagates through max).
    """
    if (not isinstance(logits, torch.Tensor) or logits.shape != shape or not logits.dtype.is_floating_point
            or logits.device != device):
        got = (f"{tuple(logits.shape)} {logits.dtype} on {logits.device}" if isinstance(logits, torch.Tensor)
               else type(logits).__name__)
        names = _names(chain)
        raise InvalidLogits(f"the processors ({names}) returned {got}, not logits of shape {tuple(shape)} on {device}",
                            processors=names)
    tops = logits.amax(dim=-1)  # per row: one row with nothing left must not hide behind the others
    top, bottom = float(tops.max()), float(tops.min())
    if top != top or top == float("inf"):
        # the model's own logits are not checked apart (a reduction a step): with no processor, they are to blame
        problem = ("a logit is +inf or NaN: the model's own (its forward pass overflowed: a float16 model past 65504?)"
                   if not chain.processors else "a logit is +inf or NaN (a scale overflowed float32, or the model's own "
                   "logits did: a float16 model past 65504?)")
    elif bottom == float("-inf"):
        problem = "every token was removed (all logits of a row are -inf)"
    else:
        return
    names = _names(chain)
    raise InvalidLogits(f"nothing to sample from after the processors ({names}): {problem}", processors=names)


def _names(chain) -> str:
    return ", ".join(p.name for p in chain.processors) or "none"


def pick(logits: torch.Tensor, greedy: bool, generator: torch.Generator | None, rows: list[int] | None = None,
         width: int = 1) -> torch.Tensor:
    """One token per row: greedy argmax, or a multinomial draw from softmax(logits) with the seeded generator.

    With `rows`, the indices of the fewer than `width` samples of one generation still going, the draw is
    made for all `width` (the ended ones' are dropped): transformers goes on drawing for the samples that
    ended, and a draw takes the same random numbers for each row whatever its row holds, so the samples
    still going draw what they draw there."""
    if greedy:
        return logits.argmax(dim=-1)
    probabilities = logits.softmax(dim=-1)
    if rows is None:
        return torch.multinomial(probabilities, 1, generator=generator).squeeze(1)
    index = torch.tensor(rows, device=logits.device)
    every = probabilities[:1].expand(width, -1).clone()  # an ended row: any distribution, its draw is dropped
    every[index] = probabilities
    return torch.multinomial(every, 1, generator=generator).squeeze(1)[index]
