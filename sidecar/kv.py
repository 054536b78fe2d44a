"""The KV store: every key/value cache of one engine, under one memory budget.

A `KVCache` holds the keys and values of `rows` sequences that share one length (a session's single
row, or the beams / samples of one generation), as one tensor per layer and kind shaped
[rows, kv_heads, capacity, head_dim]. The rows of beams and samples continue one prompt: their cache
holds only what they generate, after a `prefix` (the session's cache of the prompt), which all rows
read and nobody copies (when the prompt is long enough for that to pay; a short one is copied).
Capacity is reserved up front for a whole generation, so a decode step writes in place (no
concatenation), cropping to a shorter prefix is setting `length`, and following beam search or
dropping finished rows is one `index_select` on the row dimension.

The store accounts the bytes of every cache's capacity. A reservation that would pass the budget first
evicts the least recently used caches that no generation holds (`pinned`); if that is not enough it
fails, and the scheduler decides whether to wait for running generations or to refuse.

Why not transformers' paged cache: docs/design/kv-store-and-attention.md (its API is internal, it
scores every query against every row's keys on CPU, and it shares prefixes by whole pages only).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerShape:
    kv_heads: int
    head_dim: int


class KVStore:
    def __init__(self, budget_bytes: int, device: torch.device, dtype: torch.dtype):
        self.budget_bytes = budget_bytes
        self.device = device
        self.dtype = dtype
        self.layers: list[LayerShape] = []  # learnt from the model's first forward pass (`learn`)
        self.sliding_window: int | None = None  # the smallest attention window of any layer
        self.used_bytes = 0
        self.peak_bytes = 0
        self.evictions = 0
        self._caches: OrderedDict[int, KVCache] = OrderedDict()  # least recently used first

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one row takes over every layer (keys and values)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(2 * shape.kv_heads * shape.head_dim * size for shape in self.layers)

    def learn(self, layer: int, kv_heads: int, head_dim: int, dtype: torch.dtype, window: int | None = None) -> None:
        while len(self.layers) <= layer:
            self.layers.append(None)
        self.layers[layer] = LayerShape(kv_heads, head_dim)
        self.dtype = dtype
        if window is not None:
            self.sliding_window = min(window, self.sliding_window or window)

    def cache(self, rows: int = 1) -> "KVCache":
        cache = KVCache(self, rows)
        self._caches[id(cache)] = cache
        return cache

    def touch(self, cache: "KVCache") -> None:
        if id(cache) in self._caches:
            self._caches.move_to_end(id(cache))

    def release(self, cache: "KVCache") -> None:
        """Frees a cache's memory and forgets it."""
        cache.clear()
        self._caches.pop(id(cache), None)

    def make_room(self, extra_bytes: int, keep: "KVCache | None" = None) -> bool:
        """Evicts idle caches, least recently used first, until `extra_bytes` more fit; False if they cannot,
        and then nothing is evicted (a refused request leaves the other sessions' caches as they were)."""
        if self.used_bytes + extra_bytes <= self.budget_bytes:
            return True
        if not self.could_fit(extra_bytes, keep):
            return False
        for cache in list(self._caches.values()):
            if self.used_bytes + extra_bytes <= self.budget_bytes:
                break
            if cache is keep or cache.pinned or cache.nbytes == 0:
                continue
            cache.clear()
            self.evictions += 1
        return self.used_bytes + extra_bytes <= self.budget_bytes

    def could_fit(self, extra_bytes: int, keep: "KVCache | None" = None) -> bool:
        """Whether `extra_bytes` more fit once every idle cache (but `keep`) is evicted; evicts nothing."""
        idle = sum(c.nbytes for c in self._caches.values() if c is not keep and not c.pinned)
        return self.used_bytes - idle + extra_bytes <= self.budget_bytes

    def _account(self, delta: int) -> None:
        self.used_bytes += delta
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)


class KVCache:
    """Keys and values of `rows` sequences of one shared `length`, in buffers of `capacity` tokens."""

    def __init__(self, store: KVStore, rows: int):
        self.store = store
        self.rows = rows
        self.length = 0
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.pinned = False  # held by a running generation: never evicted
        self.prefix: KVCache | None = None  # a one-row cache every row continues (read-only while linked)

    @property
    def offset(self) -> int:
        """The position of this cache's first token: the length of its prefix."""
        return self.prefix.length if self.prefix is not None else 0

    @property
    def nbytes(self) -> int:
        return self.rows * self.capacity * self.store.bytes_per_token

    def bytes_for(self, rows: int, capacity: int) -> int:
        return rows * capacity * self.store.bytes_per_token

    def clear(self) -> None:
        self.store._account(-self.nbytes)
        self.keys, self.values, self.capacity, self.length = [], [], 0, 0

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def reserve(self, capacity: int) -> None:
        """Grows (or shrinks, down to `length`) the buffers to `capacity` tokens, keeping the cached prefix.

        The caller has made room in the store (`KVStore.make_room`): this only allocates and accounts.
        """
        capacity = max(capacity, self.length)
        if capacity == self.capacity:
            return
        self._replace(lambda old: old[:, :, : self.length], self.rows, capacity)

    def select(self, index: torch.Tensor) -> None:
        """Keeps the rows `index` names, in that order (repeats allowed): beams reordered, rows dropped."""
        self._replace(lambda old: old.index_select(0, index), len(index), self.capacity)

    def _replace(self, kept, rows: int, capacity: int) -> None:
        store, length = self.store, self.length
        keys, values = [], []
        for layer, shape in enumerate(store.layers):
            for old, new_list in ((self.keys, keys), (self.values, values)):
                buffer = torch.empty(rows, shape.kv_heads, capacity, shape.head_dim, dtype=store.dtype, device=store.device)
                if old and length:
                    buffer[:, :, :length] = kept(old[layer])[:, :, :length]
                new_list.append(buffer)
        store._account(self.bytes_for(rows, capacity) - self.nbytes)
        self.keys, self.values, self.rows, self.capacity = keys, values, rows, capacity

    def write(self, layer: int, row: int, start: int, keys: torch.Tensor, values: torch.Tensor):
        """Writes one row's new keys/values ([heads, n, head_dim]) at `start`; returns the row's keys and
        values up to and including them, as views [1, heads, start + n, head_dim]."""
        end = start + keys.shape[-2]
        self.keys[layer][row, :, start:end] = keys
        self.values[layer][row, :, start:end] = values
        return self.keys[layer][row : row + 1, :, :end], self.values[layer][row : row + 1, :, :end]

    def write_rows(self, layer: int, row: int, rows: int, position: int, keys: torch.Tensor, values: torch.Tensor):
        """Writes one token ([rows, heads, head_dim]) at `position` for rows `row`..`row + rows`; returns those
        rows' keys and values up to it, as views [rows, heads, position + 1, head_dim]."""
        end = row + rows
        self.keys[layer][row:end, :, position] = keys
        self.values[layer][row:end, :, position] = values
        return self.keys[layer][row:end, :, : position + 1], self.values[layer][row:end, :, : position + 1]

    def copy_prefix(self, prefix: "KVCache") -> None:
        """Fills every row with the one-row `prefix` (a prompt prefilled once, copied to each beam or sample)."""
        for mine, theirs in ((self.keys, prefix.keys), (self.values, prefix.values)):
            for layer in range(len(mine)):
                mine[layer][:, :, : prefix.length] = theirs[layer][:, :, : prefix.length]
        self.length = prefix.length

    def tail(self, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of every layer's keys/values from `start` to `length` (what a crop would lose)."""
        return [(k[:, :, start : self.length].clone(), v[:, :, start : self.length].clone())
                for k, v in zip(self.keys, self.values)]

    def put_tail(self, start: int, tail: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes back what `tail` copied, so the cache holds exactly what it held before."""
        for (k, v), (saved_k, saved_v) in zip(zip(self.keys, self.values), tail):
            n = saved_k.shape[2]
            k[:, :, start : start + n] = saved_k
            v[:, :, start : start + n] = saved_v
        if tail:
            self.length = start + tail[0][0].shape[2]
