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

Every admission scans every entry and idle session, so that scan is kept cheap: a candidate must agree
with the input at the one token that would make it beat the best so far, which most fail at one
comparison; prefixes are compared a slice at a time, in C; a cache's chain is counted once for all the
caches continuing it. And an entry no session continues (directly or through other entries) stays only
while it is among the `MAX_IDLE_SHARED` (256) most recently used such entries (`sidecar.kv`), or until
the budget needs its memory: a client closing thousands of sessions of distinct prompts (or of forks
of forks) does not leave thousands of entries to scan.
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
    session's own cache holds) by `MIN_SHARED_TOKENS`.

    Every shared entry and idle session is a candidate, but one wins only by holding more than the best
    so far (`best.tokens`, at least `own` + 31): it must agree with the input on the token at index
    `best.tokens`, which one comparison checks first. Most fail there (other conversations, or the same
    system prompt before other questions). One that passes is compared past its chain only: the tokens
    it shares with the entry it continues are that entry's, counted once."""
    engine = session.engine
    if not engine.share_prefixes:
        return None
    size = len(input_ids)
    best = Source(own + MIN_SHARED_TOKENS - 1)
    if size <= best.tokens:
        return None  # a follow-up its own cache holds nearly all of: nobody can hold enough more
    held = {}  # entry id -> how many leading input tokens it holds, counted when first needed

    def holds(entry: KVCache) -> int:
        """`common_prefix(entry.tokens, input_ids, end=entry.exact)`, from the count of the entry it continues
        (its first `offset` tokens are that entry's; if the input leaves those, it leaves this one there)."""
        n = held.get(id(entry))
        if n is None:
            start, exact, prefix = entry.offset, entry.exact, entry.prefix
            if not start or prefix.tokens is None:
                n = common_prefix(entry.tokens, input_ids, end=exact)
            elif (n := holds(prefix)) < start:
                n = min(n, exact)
            else:
                n = common_prefix(entry.tokens, input_ids, start, exact)
            held[id(entry)] = n
        return n

    for entry in engine.store.shared:
        tokens, k = entry.tokens, best.tokens
        if len(tokens) <= k or tokens[k] != input_ids[k]:
            continue
        n = holds(entry)
        if n > k and entry.depth < MAX_DEPTH:
            best = Source(n, entry=entry)
            if n == size:
                return best  # all of it: nobody holds more
    for other in engine.sessions:
        cache, history, k = other.cache, other.history, best.tokens
        if other is session or cache.length == 0 or cache.pinned or cache.refs or len(history) <= k:
            continue
        start = cache.offset  # below it the tokens are its chain's: checked against the entry, not probed
        if (k >= start and history[k] != input_ids[k]) or cache.exact <= k or cache.depth >= MAX_DEPTH:
            continue
        # its chain is an entry, matched above: only its own tokens are new
        if start and (cache.prefix.tokens is None or holds(cache.prefix) < start):
            continue
        n = common_prefix(history, input_ids, start, cache.exact)
        if n > k:
            best = Source(n, session=other)
            if n == size:
                break
    return best if best.entry is not None or best.session is not None else None


def common_prefix(a: list[int], b: list[int], start: int = 0, end: int | None = None) -> int:
    """How many leading tokens `a[:end]` and `b` have in common, the first `start` known equal.

    Compared a slice at a time (list equality runs in C): blocks doubling from 32 tokens, so a prefix of
    n tokens costs about 2n comparisons of ints and a dozen slices, and a mismatch after it at most as
    many again; the block that differs is halved down to 8 tokens, read one by one (30k equal tokens:
    0.71 ms token by token in Python, 0.1 ms so)."""
    n = min(len(a) if end is None else end, len(b))
    i, step = start, 32
    while i < n:
        j = min(i + step, n)
        if a[i:j] != b[i:j]:
            while j - i > 8:  # the first mismatch is in [i, j)
                middle = (i + j) // 2
                if a[i:middle] == b[i:middle]:
                    i = middle
                else:
                    j = middle
            while a[i] == b[i]:
                i += 1
            return i
        i, step = j, 2 * step
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
