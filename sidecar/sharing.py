"""The prefix cache across sessions: where a generate finds the longest cached prefix of its input.

Real traffic repeats across sessions (every chat of an app starts with its system prompt), and a new,
forked or evicted session would otherwise prefill it again. Before a generate starts, its session looks
for the longest prefix of the input held by its own cache, by a shared entry of the store, or by another
idle session's cache, token by token as vLLM's automatic prefix caching and SGLang's radix tree do. When
another cache holds at least `MIN_SHARED_TOKENS` more than the session's own, the session continues it
in place: an idle session's cache first becomes a shared entry (`KVStore.share`, its buffers change
hands, nothing is copied), so twenty sessions of one system prompt hold one copy of it. Its keys are
exactly those a cold run computes, so results do not change: keys a rolling shift moved (approximate)
are never shared, only what comes before them (`KVCache.exact`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .kv import KVCache

# A shorter lead over the session's own cache is recomputed: continuing a chain costs each decode step a
# few more small operations per layer, which a handful of prefill tokens does not repay.
MIN_SHARED_TOKENS = 32
# Each fork or share of a session that already continues an entry adds a link; a decode step reads each.
MAX_DEPTH = 8


@dataclass(frozen=True)
class Source:
    """Another cache holding the first `tokens` tokens of an input: a shared entry, or an idle session's
    cache that becomes one when it is taken."""

    tokens: int
    entry: KVCache | None = None
    session: object | None = None

    @property
    def cache(self) -> KVCache:
        return self.entry if self.entry is not None else self.session.cache

    def take(self) -> KVCache:
        """The shared entry to continue (an idle session's cache is shared now)."""
        if self.entry is not None:
            return self.entry
        session = self.session
        return session.engine.store.share(session.cache, session.history[: session.cached])


def find(session, input_ids: list[int], own: int) -> Source | None:
    """The cache other than `session`'s that holds the longest prefix of `input_ids` (those to reuse; the
    last input token is always fed again, so the caller leaves it out), if it beats `own` (what the
    session's own cache holds) by `MIN_SHARED_TOKENS`."""
    engine = session.engine
    if not engine.share_prefixes:
        return None
    best = Source(own + MIN_SHARED_TOKENS - 1)
    held = {}  # entry id -> how many leading input tokens it holds
    for entry in engine.store.shared:
        held[id(entry)] = n = common_prefix(entry.tokens, input_ids, end=entry.exact)
        if n > best.tokens and entry.depth < MAX_DEPTH:
            best = Source(n, entry=entry)
    for other in engine.sessions:
        cache = other.cache
        if other is session or cache.length == 0 or cache.pinned or cache.refs or cache.depth >= MAX_DEPTH:
            continue
        start = cache.offset  # its chain is an entry, matched above: only its own tokens are new
        if start and held.get(id(cache.prefix), 0) < start:
            continue
        n = common_prefix(other.history, input_ids, start, cache.exact)
        if n > best.tokens:
            best = Source(n, session=other)
    return best if best.entry is not None or best.session is not None else None


def common_prefix(a: list[int], b: list[int], start: int = 0, end: int | None = None) -> int:
    """How many leading tokens `a[:end]` and `b` have in common, the first `start` known equal."""
    n = min(len(a) if end is None else end, len(b))
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n


def fork(session, twin) -> bool:
    """Makes `twin`'s cache continue all of `session`'s without a copy (sharing it first); False when its
    chain is too deep to grow or the engine does not share prefixes, and the caller copies."""
    cache, store = session.cache, session.engine.store
    if cache.end == 0:
        return True
    if not session.engine.share_prefixes:
        return False
    if cache.length:
        if cache.depth >= MAX_DEPTH:
            return False
        Source(cache.end, session=session).take()
    store.link(twin.cache, cache.prefix, cache.end)
    return True
