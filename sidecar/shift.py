"""Rolling shift: reusing a session's cache after tokens were dropped from the front of its window.

When a window slides (`abc` then `bcd`), no prefix is shared and exact reuse is impossible: under causal
attention the keys and values of `bcd` depend on `a`, which the new input no longer has. A shift reuses
them anyway, as llama.cpp's context shift and StreamingLLM do: the first `keep` tokens stay (attention
sinks, or a system prompt), the `drop` tokens after them are dropped, the cached tokens after those move
left by `drop` positions, and each moved key is re-rotated by `-drop` positions with the model's own
rotary embedding (values carry no position, so they move as they are). A key at position p is
`R(p) k`, so `R(-drop) R(p) k = R(p - drop) k`: in the first layer, where a key depends only on its
token and position, that is exactly what a cold forward computes. In later layers the moved keys
still carry what the dropped tokens contributed, which is why the result is approximate and opt-in.

Only rotary positions can be moved like this: a model with absolute learned positions (GPT-2), or a
rotary embedding whose frequencies depend on the sequence length (dynamic NTK, longrope), is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .errors import InvalidArgument

# Rotary types whose frequencies are fixed at load time, so a rotation by -drop undoes one by +drop.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")

# What one try of `align`'s one-by-one search costs besides the tokens it compares, counted in tokens:
# about what its linear search spends on 16, so the tries its budget (4 tokens a token) allows cost no
# more than that search.
TRY = 64


@dataclass(frozen=True)
class Shift:
    """Keep the first `keep` cached tokens, drop the `drop` after them, move the `count` after those."""

    keep: int
    drop: int
    count: int

    @property
    def reused(self) -> int:
        return self.keep + self.count


def align(cached: list[int], input_ids: list[int], keep: int) -> Shift | None:
    """The shift that reuses the most cached tokens for `input_ids`, or None when no shift reuses any.

    The first `keep` tokens must agree; then the drop d > 0 is the one whose cached tokens after
    `keep + d` share the longest prefix with the input after `keep` (the smallest such d on a tie). As
    with prefix reuse, the last input token is never reused, so there are logits to sample from.

    Drops where the first token agrees are tried in increasing order, each compared at length by numpy,
    and the search stops once a larger drop could not reuse more: a sliding window is found at its first
    candidate or so. Repetitive tokens (one token, or a short period, over and over) make every candidate
    match at length, so trying them all is quadratic, and a client can send exactly that: once the tries
    have compared a few times as many tokens as there are (a try counting as `TRY` more, numpy's cost of
    a call), the prefix lengths of all drops are computed at once in linear time instead.
    """
    limit = len(input_ids) - 1 - keep  # input tokens a shift may reuse after the kept ones
    if keep > len(cached) or limit <= 0 or cached[:keep] != input_ids[:keep]:
        return None
    old, new = cached[keep:], input_ids[keep : keep + limit]
    old_array, new_array = np.asarray(old, dtype=np.int64), np.asarray(new, dtype=np.int64)
    budget = 4 * (len(old) + len(new))  # tokens the tries may compare before the linear search takes over
    best = Shift(keep, 0, 0)
    for drop in (np.flatnonzero(old_array[1:] == new_array[0]) + 1).tolist():
        bound = min(len(old) - drop, limit)
        if bound <= best.count:
            break
        budget -= TRY + bound
        if budget < 0:  # None, equal to no token, ends every match at the end of `new`
            counts = prefix_lengths(new + [None] + old[1:])[limit + 1 :]  # counts[d - 1]: drop d's
            count = max(counts)
            best = Shift(keep, counts.index(count) + 1, count)
            break
        mismatch = np.flatnonzero(old_array[drop : drop + bound] != new_array[:bound])
        count = int(mismatch[0]) if mismatch.size else bound
        if count > best.count:
            best = Shift(keep, drop, count)
    return best if best.count else None


def prefix_lengths(s: list) -> list[int]:
    """z[i]: the length of the longest common prefix of `s` and `s[i:]` (z[0] = 0), the Z-function. In
    linear time, since no item is matched twice: inside the last match found, from `left` up to `right`,
    `s` repeats its own start, so what is known there needs no comparison."""
    z = [0] * len(s)
    left = right = 0
    for i in range(1, len(s)):
        if i < right:
            n = z[i - left]
            if n < right - i:  # ends inside the match: known
                z[i] = n
                continue
            n = right - i
        else:
            n = 0
        while i + n < len(s) and s[n] == s[i + n]:
            n += 1
        z[i] = n
        left, right = i, i + n
    return z


class Rotation:
    """Turns cached keys back by a number of positions with the model's own rotary embedding module, so
    its rope scaling (linear, llama3, yarn) applies exactly as it did when the keys were computed."""

    def __init__(self, rotary: torch.nn.Module):
        self.rotary = rotary
        # yarn scales cos and sin (both queries and keys carry the factor); the keys have it already
        self.scaling = float(getattr(rotary, "attention_scaling", 1.0))

    @classmethod
    def of(cls, model, head_dim: int) -> "Rotation":
        """The model's rotation; raises `InvalidArgument(option="reuse")` saying why a model cannot shift."""
        name = type(model).__name__
        rotary = getattr(model.base_model, "rotary_emb", None)
        if rotary is None:
            raise InvalidArgument(f"reuse 'shift' needs rotary position embeddings, and {name} has none (its "
                                  "positions are absolute, so cached keys cannot be moved)", option="reuse")
        if not hasattr(rotary, "inv_freq") or any(hasattr(module, "inv_freq") for module in model.modules()
                                                  if module is not rotary):  # Gemma 3: one per kind of layer
            raise InvalidArgument(f"reuse 'shift' cannot move {name}'s keys: its layers rotate keys with rotary "
                                  "embeddings of their own", option="reuse")
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise InvalidArgument(f"reuse 'shift' cannot move {name}'s keys exactly: its rotary type {rope_type!r} "
                                  "changes its frequencies with the sequence length (shifts: "
                                  f"{', '.join(STATIC_ROPE_TYPES)})", option="reuse")
        rotation = cls(rotary)
        width = rotation.angles(1, rotary.inv_freq.device)[0].shape[-1]
        if width != head_dim:
            raise InvalidArgument(f"reuse 'shift' needs rotary angles over whole key heads; {name}'s cover {width} "
                                  f"of its {head_dim} dimensions", option="reuse")
        return rotation

    def angles(self, delta: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ([head_dim], float32) of a rotation by `delta` positions, without the attention scaling."""
        position = torch.tensor([[delta]], device=device)
        cos, sin = self.rotary(torch.empty(0, dtype=torch.float32, device=device), position)
        return cos[0, 0] / self.scaling, sin[0, 0] / self.scaling

    def rotate(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """`keys` [..., head_dim] moved by `delta` positions (computed in float32, returned in their dtype)."""
        cos, sin = self.angles(delta, keys.device)
        k = keys.float()
        half = k.shape[-1] // 2
        rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)  # transformers' rotate_half
        return (k * cos + rotated * sin).to(keys.dtype)


def move(cache, rotation: Rotation, shift: Shift, source: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Writes the moved tokens into `cache`'s own buffers after the kept ones and crops it after them (the
    cache continues at most its first `shift.keep` tokens from elsewhere: what it shares is never written).

    `source` holds, per layer, a copy of the keys and values from `shift.keep` on ([1, kv_heads, n,
    head_dim]: the tail a failed call puts back, or what the shared prefix held), so it never overlaps
    what is written.
    """
    start, end = shift.drop, shift.drop + shift.count
    first, last = shift.keep - cache.offset, shift.reused - cache.offset
    for layer, (keys, values) in enumerate(source):
        cache.keys[layer][:, :, first:last] = rotation.rotate(keys[:, :, start:end], -shift.drop)
        cache.values[layer][:, :, first:last] = values[:, :, start:end]
    cache.length = last
