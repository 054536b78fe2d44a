"""The phases of generation, one small function each: prefill, decode_step, sample.

Prefill puts many new tokens into the KV cache in one forward pass per chunk (never token by token);
decode_step feeds one token. Both return float32 logits for the last position only. Both pass the
positions explicitly: the engine knows them, and transformers would otherwise re-derive them from the
cache at every step (about a tenth of a decode step on a small model).
"""

from __future__ import annotations

import torch

from .errors import InvalidLogits


def _forward(model, cache, token_ids: list[int], start: int, logits_to_keep: int = 1) -> torch.Tensor:
    device = model.device
    positions = torch.arange(start, start + len(token_ids), device=device)
    return model(
        input_ids=torch.tensor([token_ids], device=device),
        past_key_values=cache,
        use_cache=True,
        cache_position=positions,
        position_ids=positions.unsqueeze(0),
        logits_to_keep=logits_to_keep,
    ).logits[:, -1, :].float()


def prefill(model, cache, token_ids: list[int], start: int, chunk_size: int) -> torch.Tensor:
    """Feeds `token_ids` at positions `start`... after what `cache` holds, `chunk_size` tokens per pass."""
    logits = None
    for offset in range(0, len(token_ids), chunk_size):
        logits = _forward(model, cache, token_ids[offset : offset + chunk_size], start + offset)
    return logits


def decode_step(model, cache, token_id: int, position: int) -> torch.Tensor:
    return _forward(model, cache, [token_id], position)


def check_logits(logits, chain, shape: torch.Size) -> None:
    """Raises `InvalidLogits` unless the processed logits are a tensor of the model's `shape` with a finite
    maximum to sample or argmax from.

    One reduction per step: the maximum is -inf when every token was removed, and +inf or NaN when any
    logit is (NaN propagates through max).
    """
    if not isinstance(logits, torch.Tensor) or logits.shape != shape or not logits.dtype.is_floating_point:
        got = f"{tuple(logits.shape)} {logits.dtype}" if isinstance(logits, torch.Tensor) else type(logits).__name__
        names = _names(chain)
        raise InvalidLogits(f"the processors ({names}) returned {got}, not logits of shape {tuple(shape)}",
                            processors=names)
    top = float(logits.max())
    if top == float("-inf"):
        problem = "every token was removed (all logits are -inf)"
    elif top != top or top == float("inf"):
        problem = "a logit is +inf or NaN (a scale overflowed float32?)"
    else:
        return
    names = _names(chain)
    raise InvalidLogits(f"nothing to sample from after the processors ({names}): {problem}", processors=names)


def _names(chain) -> str:
    return ", ".join(p.name for p in chain.processors) or "none"


def sample(logits: torch.Tensor, greedy: bool, generator: torch.Generator | None) -> int:
    """Greedy argmax, or one multinomial draw from softmax(logits) with the session's seeded generator."""
    if greedy:
        return int(logits.argmax(dim=-1))
    probs = logits.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
