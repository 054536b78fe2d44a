"""The KV store: every key/value cache of one engine, under one memory budget.

A `KVCache` holds the keys and values of `rows` sequences that share one length (a session's single
row, or the beams / samples of one generation), as one tensor per layer and kind shaped
[rows, kv_heads, capacity, head_dim]. The rows of beams and samples continue one prompt: their cache
holds only what they generate, after a `prefix` (the session's cache of the prompt), which all rows
read and nobody copies (when the prompt is long enough for that to pay; a short one is copied).
Capacity is reserved up front for a whole generation, so a decode step writes in place (no
concatenation), cropping to a shorter prefix is setting `length`, and following beam search or
dropping finished rows is one `index_select` on the row dimension.

Sessions share prefixes the same way (`sidecar.sharing`): a session cache can continue a *shared
entry*, a one-row cache no longer written that holds the tokens `tokens` (a system prompt, a forked
conversation). An idle session's cache becomes one without a copy (`share`: its buffers change hands),
and every session continuing it reads those keys in place. Entries continue entries, so a cache reads
a chain: each link is a cache and how many of its tokens are read, then its own tokens.

The store accounts the bytes of every cache's capacity. A reservation that would pass the budget first
evicts the least recently used caches that nothing holds (a running generation `pinned` a cache, and
with it the chain it reads); if that is not enough it fails, and the scheduler decides whether to wait
for running generations or to refuse. A shared entry stays until the budget needs its memory, and
at most `MAX_IDLE_SHARED` entries that no session continues, directly or through other entries, are
kept (the least recently used beyond go first).

Why not transformers' paged cache: docs/design/kv-store-and-attention.md (its API is internal, it
scores every query against every row's keys on CPU, and it shares prefixes by whole pages only).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

# At most this many shared entries that nothing continues stay cached; beyond it the least recently used
# are evicted, as the budget would evict them. The budget alone does not bound them: a client can leave
# thousands of small ones (sessions of distinct prompts, shared then closed), and every admission scans
# every entry (`sharing.find`), about 0.1 us each that the probe turns away, more for one it does not
# (a comparison of what it shares with the input past its chain). Why 256: a scan of that many takes
# 0.03-0.04 ms (1,000: 0.1-0.5 ms), noise next to a forward pass of milliseconds even when many pass
# the probe, while it is more distinct system prompts and forked conversations than an application
# reuses at once (and the entries beyond are what the budget would evict first anyway). Entries a
# session's cache or a running call continues, directly or through other entries, are not counted: they
# go when it does.
MAX_IDLE_SHARED = 256


@dataclass(frozen=True)
class LayerShape:
    kv_heads: int
    head_dim: int  # of the keys
    value_dim: int  # of the values: narrower than the keys' in multi-head latent attention (DeepSeek V2, V3)

    def dim(self, kind: str) -> int:
        """The width of the keys ("keys") or the values ("values")."""
        return self.head_dim if kind == "keys" else self.value_dim


class KVStore:
    def __init__(self, budget_bytes: int, device: torch.device, dtype: torch.dtype):
        self.budget_bytes = budget_bytes
        self.device = device
        self.dtype = dtype
        self.layers: list[LayerShape] = []  # learnt from the model's first forward pass (`learn`)
        self.caches_bytes = 0  # of the caches; `used_bytes` adds the decode group's
        self.peak_bytes = 0
        self.evictions = 0
        self._caches: OrderedDict[int, KVCache] = OrderedDict()  # least recently used first
        self._entries = 0  # of them shared entries: while no more than the cap, none need counting (`trim`)
        self._trimming = False  # `trim` under way, or put off until `make_room` knows what to keep
        self.group = DecodeGroup(self)  # the copy of decoding caches, the first memory given back

    @property
    def used_bytes(self) -> int:
        """KV memory held now. The decode group's part is read from it, never counted: a group formed or let go
        part-way (Ctrl-C in a step) can leave no count behind that differs from what it holds."""
        return self.caches_bytes + self.group.nbytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one row takes over every layer (keys and values)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(shape.kv_heads * (shape.head_dim + shape.value_dim) * size for shape in self.layers)

    def learn(self, layer: int, kv_heads: int, head_dim: int, value_dim: int, dtype: torch.dtype) -> None:
        while len(self.layers) <= layer:
            self.layers.append(None)
        self.layers[layer] = LayerShape(kv_heads, head_dim, value_dim)
        self.dtype = dtype

    def cache(self, rows: int = 1) -> "KVCache":
        cache = KVCache(self, rows)
        self._caches[id(cache)] = cache
        return cache

    def touch(self, cache: "KVCache") -> None:
        """Marks a cache, and the chain it reads, as just used."""
        while cache is not None:
            if id(cache) in self._caches:
                self._caches.move_to_end(id(cache))
            cache = cache.prefix

    def release(self, cache: "KVCache") -> None:
        """Frees a cache's memory and forgets it (forgotten first: the entry it unlinks may be trimmed)."""
        if self._caches.pop(id(cache), None) is not None and cache.tokens is not None:
            self._entries -= 1
        cache.clear()

    @property
    def shared(self) -> list["KVCache"]:
        """The shared entries, least recently used first."""
        return [cache for cache in self._caches.values() if cache.tokens is not None]

    def link(self, cache: "KVCache", prefix: "KVCache | None", length: int) -> None:
        """Makes `cache` continue the first `length` tokens `prefix` reads (its chain, then its own), linking
        to the cache of the chain that holds token `length - 1`; nothing, for `length` 0."""
        while prefix is not None and length <= prefix.offset:
            prefix = prefix.prefix
        if prefix is not None:
            prefix.refs += 1  # before unlinking: the new link may be the old one
        self.unlink(cache)
        if prefix is not None:
            cache.prefix, cache.prefix_length = prefix, length - prefix.offset

    def unlink(self, cache: "KVCache") -> None:
        prefix = cache.prefix
        if prefix is not None:
            cache.prefix, cache.prefix_length = None, 0
            self.unref(prefix)

    def unref(self, cache: "KVCache") -> None:
        """Drops a reference to `cache` (a cache continuing it, or a call holding it). A shared entry that
        loses one may be left unused, with the chain it reads, and one too many (`trim`).

        The cap is enforced here, when an entry loses a reference, rather than when `share` makes it: a
        new entry is continued (it is not unused), entries become unused only here, so checking here keeps
        the count at the cap at every moment; checked at `share`, the sessions closed since the last share
        could leave any number of unused entries for every admission to scan. Any reference, not only the
        last: an entry continued by a session and by another entry is unused once the session lets go."""
        cache.refs -= 1
        if cache.tokens is not None:  # one reference less: it, and the chain it reads, may now be unused
            self.trim()

    def trim(self, keep: tuple["KVCache", ...] = ()) -> None:
        """Evicts the least recently used shared entries that nothing continues, as `make_room` does, until
        at most `MAX_IDLE_SHARED` unused ones (`unused_entries`) are left; never `keep`, or what a pinned
        cache reads. Only an entry nothing continues can go: an unused entry that other unused entries
        continue goes after them."""
        if self._trimming or self._entries <= MAX_IDLE_SHARED:
            # the trim under way counts again (evicting an entry may leave its own prefix idle); and as
            # many entries as the cap are within it, used or not (counted, they took 0.3 ms for 500 caches)
            return
        self._trimming = True
        try:
            held = None
            while True:
                unused = self.unused_entries()
                if len(unused) <= MAX_IDLE_SHARED:
                    return
                held = self._held(keep) if held is None else held
                victim = next((c for c in unused if not c.refs and id(c) not in held), None)
                if victim is None:
                    return
                self._evict(victim)
        finally:
            self._trimming = False

    def share(self, cache: "KVCache", tokens: list[int]) -> "KVCache":
        """Turns what an idle one-row cache holds into a shared entry for `tokens` (its whole chain's tokens),
        without copying: the entry takes the buffers, and `cache`, empty, continues the entry."""
        entry = KVCache(self, 1)
        entry.keys, entry.values, entry.capacity, entry.length = cache.keys, cache.values, cache.capacity, cache.length
        entry.prefix, entry.prefix_length = cache.prefix, cache.prefix_length  # the link changes hands too
        entry.tokens = list(tokens)
        entry.approximate_from, cache.approximate_from = cache.approximate_from, None
        cache.keys, cache.values, cache.capacity, cache.length = [], [], 0, 0
        cache.prefix, cache.prefix_length = None, 0
        self._caches[id(entry)] = entry
        self._entries += 1
        self.link(cache, entry, entry.end)
        return entry

    def make_room(self, extra_bytes: int, keep: tuple["KVCache", ...] = ()) -> bool:
        """Evicts idle caches, least recently used first, until `extra_bytes` more fit; False if they cannot,
        and then nothing is evicted (a refused request leaves the other sessions' caches as they were).
        `keep` (and the chains they read) are not evicted."""
        if self.used_bytes + extra_bytes <= self.budget_bytes:
            return True
        if self.group.members:  # before anything is evicted
            self.group.dissolve()
            if self.used_bytes + extra_bytes <= self.budget_bytes:
                return True
        if not self.could_fit(extra_bytes, keep):
            return False
        held = self._held(keep)
        evicted = True
        # Entries it leaves idle are trimmed at the end, when `keep` (an idle entry that admission is
        # about to continue, say) can be spared: a trim on the way would not know it.
        self._trimming = True
        try:
            while evicted and self.used_bytes + extra_bytes > self.budget_bytes:
                evicted = False  # an entry becomes evictable once the caches continuing it are: pass again
                for cache in list(self._caches.values()):
                    if self.used_bytes + extra_bytes <= self.budget_bytes:
                        break
                    if id(cache) in held or cache.refs or (cache.nbytes == 0 and cache.prefix is None):
                        continue
                    self._evict(cache)
                    evicted = True
        finally:
            self._trimming = False
        self.trim(keep)
        return self.used_bytes + extra_bytes <= self.budget_bytes

    def _evict(self, cache: "KVCache") -> None:
        """Frees an idle cache: a shared entry is forgotten, a session's cache emptied (its history stays)."""
        if cache.tokens is not None:
            self.release(cache)
        else:
            cache.clear()
        self.evictions += 1

    def could_fit(self, extra_bytes: int, keep: tuple["KVCache", ...] = ()) -> bool:
        """Whether `extra_bytes` more fit once every idle cache (but `keep`) is evicted; evicts nothing."""
        return self.unevictable_bytes(keep) + extra_bytes <= self.budget_bytes

    def unevictable_bytes(self, keep: tuple["KVCache", ...] = ()) -> int:
        """The bytes still held once every idle cache but `keep` is evicted (and the decode group's copy
        given back)."""
        held = self._held(keep)
        return self.used_bytes - self.group.nbytes - sum(c.nbytes for c in self._caches.values() if id(c) not in held)

    def alone_bytes(self, keep: tuple["KVCache", ...] = ()) -> int:
        """The bytes still held once every cache but `keep` is evicted, running generations' too: what
        stays however long a generation waits for the others."""
        return sum(c.nbytes for key, c in _chains(keep).items() if key in self._caches)

    def unused_entries(self) -> list["KVCache"]:
        """The shared entries no session's cache continues and no call holds, directly or through other
        entries (a chain of forks outlives the sessions that made it), least recently used first: those
        `MAX_IDLE_SHARED` counts. A call holds an entry by a reference no cache's link accounts for."""
        links: dict[int, int] = {}
        for cache in self._caches.values():
            if cache.prefix is not None:
                links[id(cache.prefix)] = links.get(id(cache.prefix), 0) + 1
        used = _chains(c for c in self._caches.values() if c.tokens is None or c.refs > links.get(id(c), 0))
        return [c for c in self._caches.values() if c.tokens is not None and id(c) not in used]

    def _held(self, keep) -> set[int]:
        """The ids of caches that cannot be evicted: pinned or kept ones, and every cache their chains read
        (an entry some evictable session continues is evicted after that session)."""
        return set(_chains([*keep, *(c for c in self._caches.values() if c.pinned)]))

    def note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)


def _chains(caches) -> dict[int, "KVCache"]:
    """`caches` and every cache their chains read, by id."""
    found = {}
    for cache in caches:
        while cache is not None and id(cache) not in found:
            found[id(cache)] = cache
            cache = cache.prefix
    return found


class KVCache:
    """Keys and values of `rows` sequences of one shared `length`, in buffers of `capacity` tokens."""

    def __init__(self, store: KVStore, rows: int):
        self.store = store
        self.rows = rows
        self.length = 0
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.pinned = False  # held by a running generation: never evicted, nor the chain it reads
        # A one-row cache every row continues, of which it reads `prefix_length` tokens (read-only while
        # linked); `refs` counts the caches continuing this one.
        self.prefix: KVCache | None = None
        self.prefix_length = 0
        self.refs = 0
        self.tokens: list[int] | None = None  # a shared entry's token ids, its chain's included
        # Where its own keys stop being those a cold run computes (a rolling shift moved them): None if never.
        self.approximate_from: int | None = None

    @property
    def offset(self) -> int:
        """The position of this cache's first token: how many tokens its chain holds."""
        return self.prefix.offset + self.prefix_length if self.prefix is not None else 0

    @property
    def end(self) -> int:
        """How many tokens it reads, its chain's and its own."""
        return self.offset + self.length

    @property
    def exact(self) -> int:
        """How many of the tokens it reads have exactly a cold run's keys: those another session may share."""
        bound = self.end if self.approximate_from is None else min(self.end, self.approximate_from)
        if self.prefix is not None and self.prefix.exact < self.offset:
            bound = min(bound, self.prefix.exact)
        return bound

    def chain(self) -> list[tuple["KVCache", int]]:
        """The caches it continues, first to last, each with how many of its tokens are read."""
        links = []
        cache, length = self.prefix, self.prefix_length
        while cache is not None:
            links.append((cache, length))
            cache, length = cache.prefix, cache.prefix_length
        return links[::-1]

    @property
    def depth(self) -> int:
        return len(self.chain())

    @property
    def nbytes(self) -> int:
        return self.rows * self.capacity * self.store.bytes_per_token

    def bytes_for(self, rows: int, capacity: int) -> int:
        return rows * capacity * self.store.bytes_per_token

    def clear(self) -> None:
        """Frees its buffers and its link: it holds nothing."""
        store = self.store
        counted = store.caches_bytes - self.nbytes
        # one statement with no call in it (a signal lands only after calls): held and counted change together
        self.keys, self.values, self.capacity, self.length, store.caches_bytes = [], [], 0, 0, counted
        self.approximate_from = None
        self.store.unlink(self)

    def crop(self, end: int) -> None:
        """Reads only the first `end` tokens (a link shortens when `end` falls inside the chain)."""
        if self.approximate_from is not None and end <= self.approximate_from:
            self.approximate_from = None
        if end >= self.offset:
            self.length = min(self.length, end - self.offset)
        else:
            self.length = 0
            self.store.link(self, self.prefix, end)

    def reserve(self, capacity: int) -> None:
        """Grows (or shrinks, down to `length`) the buffers to `capacity` tokens, keeping the cached prefix.

        The caller has made room in the store (`KVStore.make_room`): this only allocates and accounts.
        """
        capacity = max(capacity, self.length)
        if capacity == self.capacity:
            return
        self._replace(lambda old: old[:, :, : self.length], self.rows, capacity)

    def select(self, index: torch.Tensor, alike: int = 0) -> None:
        """Keeps the rows `index` names, in that order (repeats allowed): beams reordered, rows dropped.
        Only the tokens held are copied, and beams reordered stay in their buffers (beam search does it
        every step: a new buffer of the whole capacity each time cost more than the step's attention),
        from `alike` on: the caller knows every row holds the same first `alike` tokens (a prompt copied
        to each beam), which reordering leaves where they are."""
        length = self.length
        if len(index) != self.rows:
            self._replace(lambda old: old[:, :, :length].index_select(0, index), len(index), self.capacity)
            return
        for buffer in (*self.keys, *self.values):
            moved = buffer[:, :, alike:length]
            moved.copy_(moved.index_select(0, index))

    def _replace(self, kept, rows: int, capacity: int) -> None:
        store, length = self.store, self.length
        keys, values = [], []
        for layer, shape in enumerate(store.layers):
            for old, new_list, dim in ((self.keys, keys, shape.head_dim), (self.values, values, shape.value_dim)):
                buffer = torch.empty(rows, shape.kv_heads, capacity, dim, dtype=store.dtype, device=store.device)
                if old and length:
                    buffer[:, :, :length] = kept(old[layer])[:, :, :length]
                new_list.append(buffer)
        counted = store.caches_bytes + self.bytes_for(rows, capacity) - self.nbytes
        self.keys, self.values, self.rows, self.capacity, store.caches_bytes = keys, values, rows, capacity, counted
        store.note_peak()

    def write(self, layer: int, row: int, start: int, keys: torch.Tensor, values: torch.Tensor, links=()):
        """Writes one row's new keys/values ([heads, n, head_dim]) at `start`; returns the row's keys and
        values up to and including them, those of `links` (its `chain()`) first,
        [1, heads, offset + start + n, head_dim] (views when there is no chain)."""
        end = start + keys.shape[-2]
        self.keys[layer][row, :, start:end] = keys
        self.values[layer][row, :, start:end] = values
        own_keys, own_values = self.keys[layer][row : row + 1, :, :end], self.values[layer][row : row + 1, :, :end]
        if not links:
            return own_keys, own_values
        return (torch.cat([c.keys[layer][:1, :, :n] for c, n in links] + [own_keys], dim=2),
                torch.cat([c.values[layer][:1, :, :n] for c, n in links] + [own_values], dim=2))

    def span(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row 0's keys and values of every token it reads, chain included: [kv_heads, end, head_dim]."""
        parts = [*self.chain(), (self, self.length)]
        return (torch.cat([c.keys[layer][0, :, :n] for c, n in parts if n], dim=1),
                torch.cat([c.values[layer][0, :, :n] for c, n in parts if n], dim=1))

    def write_rows(self, layer: int, row: int, rows: int, position: int, keys: torch.Tensor, values: torch.Tensor):
        """Writes one token ([rows, heads, 1, head_dim]) at `position` for rows `row`..`row + rows`; returns
        those rows' keys and values up to it, as views [rows, heads, position + 1, head_dim]."""
        end = row + rows
        own_keys = self.keys[layer][row:end, :, : position + 1]
        own_values = self.values[layer][row:end, :, : position + 1]
        own_keys.narrow(2, position, 1).copy_(keys)
        own_values.narrow(2, position, 1).copy_(values)
        return own_keys, own_values

    def copy_prefix(self, prefix: "KVCache") -> None:
        """Fills every row with all the one-row `prefix` reads, its chain's tokens included (a prompt
        prefilled once, copied to each beam or sample)."""
        for layer in range(len(self.keys)):
            keys, values = prefix.span(layer)
            self.keys[layer][:, :, : prefix.end] = keys
            self.values[layer][:, :, : prefix.end] = values
        self.length = prefix.end

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


# The one-row caches of sessions decoding together share a `DecodeGroup` while each holds at most this
# many tokens' capacity (beyond, the padding would cost more memory than the group saves time).
GROUP_MAX_TOKENS = 512


class DecodeGroup:
    """The caches of sessions decoding together, copied side by side: one attention call a layer for all.

    On CPU, one session's decode step costs a dozen small operations and a kernel launch a layer, for one
    query over a few hundred keys; gathering the sessions' caches into one tensor every step costs more
    than that saves. Keeping them gathered does not: while a one-row cache is a member, its keys and
    values live in one zero-padded buffer per layer, [members, kv_heads, capacity, head_dim], its decode
    steps are written there only (one indexed write for all members), and its own buffers catch up when
    the group dissolves (`dissolve`): when a member's generation ends or fails, or the set of sessions
    decoding changes. The zeros keep the padding finite, so that a masked key adds exactly nothing.

    Members may continue one shared prefix (every chat of an app continuing its system prompt, `sharing`):
    when they all read the same `chain`, the lanes hold their own tokens only, and each step attends the
    prefix once for all of them, in place, as the rows of beams or samples do.

    The copy is memory the budget counts: a group forms only when the store can hold it without evicting
    anything and no generation waits for memory, and it is the first memory the store gives back
    (`KVStore.make_room`, which anything that needs room calls: admission, a fork, a restore), so it
    never changes what runs, waits, is refused or is evicted.
    """

    def __init__(self, store: KVStore):
        self.store = store
        self.members: list[KVCache] = []
        self.synced: list[int] = []  # tokens each member's own buffers hold (its length when it joined)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0
        self.chain: list[tuple[KVCache, int]] = []  # the prefix every member continues (`KVCache.chain`)
        self.previous: tuple[list[KVCache], list] = ([], [])  # the caches and chain `update` was given the step before

    @property
    def nbytes(self) -> int:
        return len(self.members) * self.capacity * self.store.bytes_per_token

    def update(self, caches: list["KVCache"], chain: list[tuple["KVCache", int]] = ()) -> bool:
        """Makes `caches`, in this order, the members, each continuing `chain` (a new group when they are
        other caches than the members); False, and no group, when they are fewer than two, were not the
        caches of the step before too, or the store has no room for them.

        Forming a group copies every member's cache, about what a few steps of the group save: when the
        sessions decoding change every step (short replies coming and going), a group would not live long
        enough to pay for itself (measured: re-formed at 45 of 54 steps, forming took 16% of the time)."""
        chain = list(chain)
        previous, self.previous = self.previous, (list(caches), chain)
        if _same(caches, self.members) and _same_chain(chain, self.chain):
            return bool(self.members)
        self.dissolve()
        if len(caches) < 2 or not (_same(caches, previous[0]) and _same_chain(chain, previous[1])):
            return False
        store, capacity = self.store, max(cache.capacity for cache in caches)
        if store.used_bytes + len(caches) * capacity * store.bytes_per_token > store.budget_bytes:
            return False
        all_keys, all_values = [], []  # made aside: a copy stopped part-way (Ctrl-C, no memory) leaves no group
        for layer, shape in enumerate(store.layers):
            keys, values = (torch.zeros(len(caches), shape.kv_heads, capacity, dim, dtype=store.dtype,
                                        device=store.device) for dim in (shape.head_dim, shape.value_dim))
            for lane, cache in enumerate(caches):
                keys[lane, :, : cache.length] = cache.keys[layer][0, :, : cache.length]
                values[lane, :, : cache.length] = cache.values[layer][0, :, : cache.length]
            all_keys.append(keys)
            all_values.append(values)
        members, synced = list(caches), [cache.length for cache in caches]
        # one statement, with no call in it for a signal to land after: `nbytes` reads members and capacity
        self.keys, self.values, self.members, self.synced, self.capacity, self.chain = (
            all_keys, all_values, members, synced, capacity, chain)
        store.note_peak()
        return True

    def dissolve(self) -> None:
        """Copies what each member's lane holds beyond its own buffers back into them, and frees the group:
        up to its length, and the position a step under way writes (a step that fails part-way is put
        back by its run, as without the group). A member released meanwhile (its session closed during
        the step) has no buffers to catch up. Called from a step or from anything that needs room (a
        fork: outside inference mode, where the buffers, made in a step, cannot be written otherwise)."""
        if not self.members:
            return
        with torch.inference_mode():
            for lane, (cache, synced) in enumerate(zip(self.members, self.synced)):
                end = min(cache.length + 1, cache.capacity)
                if cache.keys and end > synced:
                    for layer in range(len(self.keys)):
                        cache.keys[layer][0, :, synced:end] = self.keys[layer][lane, :, synced:end]
                        cache.values[layer][0, :, synced:end] = self.values[layer][lane, :, synced:end]
        self.members, self.synced, self.keys, self.values, self.capacity, self.chain = [], [], [], [], 0, []

    def holds(self, cache: "KVCache") -> bool:
        return any(member is cache for member in self.members)


def _same(caches: list[KVCache], others: list[KVCache]) -> bool:
    return len(caches) == len(others) and all(a is b for a, b in zip(caches, others))


def _same_chain(chain: list[tuple[KVCache, int]], other: list[tuple[KVCache, int]]) -> bool:
    return len(chain) == len(other) and all(a is b and n == m for (a, n), (b, m) in zip(chain, other))
