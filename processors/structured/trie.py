"""A token-level automaton from a byte-level one: every token walked through the byte automaton at once.

outlines-core can build the token-level index itself, but at 32k tokens it hands it over as two million
Python dict entries (a second of converting, twice its own compile), and its walk is per token. Here the
regex is compiled over single bytes (a small automaton, the same for every vocabulary) and the vocabulary
is a trie of its tokens' bytes, built once per vocabulary: one pass per trie level moves every live
(state, prefix) pair one byte on, for all states together, in numpy. A pair whose byte leads nowhere is
dropped at once, so the walk's work is the live prefixes, not states x tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import chain

import numpy as np

PAIRS_PER_CHUNK = 1 << 22  # (state, trie node) pairs a chunk of states may expand at one level, at most
DENSE_FROM = 16  # one state's walk goes over whole levels once it holds 1 node in this many of a level
PACKED_BITS = 63  # a transition is sorted packed in an int64 when its key and target fit in these bits


@dataclass(frozen=True)
class Level:
    """The trie nodes `depth` bytes deep, in order of their parents, then bytes: the children of node `p`
    of the level above are nodes `child_start[p]` to `child_start[p + 1]`. The tokens ending at node `n`
    are `ends[end_start[n]:end_start[n + 1]]` (several ids may write the same bytes)."""

    byte: np.ndarray  # int64 [nodes]
    child_start: np.ndarray  # int64 [nodes of the level above + 1]
    end_start: np.ndarray  # int64 [nodes + 1]
    ends: np.ndarray  # int64: token ids

    @functools.cached_property
    def parent(self) -> np.ndarray:
        """int64 [nodes]: each node's parent, an index into the level above."""
        return np.repeat(np.arange(len(self.child_start) - 1), np.diff(self.child_start))

    @functools.cached_property
    def end_node(self) -> np.ndarray:
        """int64 [len(ends)]: the node each of `ends` ends at."""
        return np.repeat(np.arange(len(self.byte)), np.diff(self.end_start))


@dataclass(frozen=True)
class TokenTrie:
    levels: tuple[Level, ...]

    @classmethod
    def build(cls, tokens_by_bytes: dict[bytes, list[int]]) -> "TokenTrie":
        """The trie of a vocabulary's text tokens (bytes -> the ids writing them), in numpy from their
        sorted bytes: in sorted order, the tokens under one node of depth d are consecutive, so a token
        opens a node of depth d where it shares fewer than d bytes with the token before it (a shorter
        token before it never shares d). A Python set of each depth's prefixes took 120 ms at 32k tokens.
        Memory and work go with the vocabulary's bytes, not its count times its longest token."""
        strings = sorted(s for s in tokens_by_bytes if s)
        if not strings:
            return cls(())
        count = len(strings)
        data = np.frombuffer(b"".join(strings), dtype=np.uint8)
        lengths = np.fromiter(map(len, strings), dtype=np.int64, count=count)
        starts = np.cumsum(lengths) - lengths
        shared = np.zeros(count, dtype=np.int64)  # bytes in common with the token before
        shared[1:] = _common_prefix(data, starts[:-1], starts[1:], np.minimum(lengths[:-1], lengths[1:]))
        groups = list(map(tokens_by_bytes.__getitem__, strings))
        ids_count = np.fromiter(map(len, groups), dtype=np.int64, count=count)
        ids = np.fromiter(chain.from_iterable(groups), dtype=np.int64, count=int(ids_count.sum()))
        ids_start = np.cumsum(ids_count) - ids_count
        levels, node_above, above = [], np.zeros(count, dtype=np.int64), 1  # each token's node one level up
        rows = np.arange(count)
        for depth in range(1, int(lengths.max()) + 1):
            rows = rows[lengths[rows] >= depth]
            opens = shared[rows] < depth
            firsts = rows[opens]  # each node's first token, the one ending there if any (the shortest sorts first)
            ending = np.where(lengths[firsts] == depth, ids_count[firsts], 0)
            levels.append(Level(
                byte=data[starts[firsts] + depth - 1].astype(np.int64),
                child_start=np.searchsorted(node_above[firsts], np.arange(above + 1)),
                end_start=np.concatenate([[0], np.cumsum(ending)]),
                ends=ids[expand(ids_start[firsts], ids_start[firsts] + ending)[1]],
            ))
            node_above[rows] = np.cumsum(opens) - 1
            above = len(firsts)
        return cls(tuple(levels))


def _common_prefix(data: np.ndarray, first: np.ndarray, second: np.ndarray, most: np.ndarray) -> np.ndarray:
    """How many bytes the strings at `first[i]` and `second[i]` of `data` share, up to `most[i]`: their
    first `most[i]` bytes compared side by side, all pairs at once."""
    pair, at = expand(np.zeros_like(most), most)
    differs = np.flatnonzero(data[first[pair] + at] != data[second[pair] + at])
    shared = most.copy()
    pairs, first_difference = np.unique(pair[differs], return_index=True)  # sorted by pair, then position
    shared[pairs] = at[differs[first_difference]]
    return shared


def expand(starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ranges [starts[i], stops[i]): (i, k) for every k in range i, as two arrays."""
    counts = stops - starts
    owner = np.repeat(np.arange(len(starts)), counts)
    offsets = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, starts[owner] + offsets


def _descend(level: Level, node: np.ndarray, current: np.ndarray, flat: np.ndarray, width: int, dead: int):
    """One level down from the pairs (`node` of the level above, its state `current`): every child whose
    byte leads somewhere, as (the index of the pair it came from, its node in `level`, its state)."""
    pair, child = expand(level.child_start[node], level.child_start[node + 1])
    moved = flat[current[pair] * width + level.byte[child]]
    live = moved != dead
    return pair[live], child[live], moved[live]


def token_transitions(table: np.ndarray, states: np.ndarray, trie: TokenTrie, vocab_size: int):
    """The token-level transitions of `states` through the byte automaton `table` (int64 [S + 1, 256], or
    wider with columns past the bytes', the dead state S last, leading to itself): (sources, tokens, targets) for every token whose bytes all
    lead somewhere, sorted by (source, token), as a searchsorted table wants them.

    States go a chunk at a time (the pairs of a level are bounded). The transitions come out grouped by
    the length of their tokens, and are put in order by one sort of each transition packed into an
    int64, (source * vocab + token) above the target's bits: at 32k tokens that sort took 35 ms where
    laying them out in a dense block of states x tokens and reading it back took ~250 ms."""
    dead, width = table.shape[0] - 1, table.shape[1]
    flat = table.reshape(-1)
    widest = max((len(level.byte) for level in trie.levels), default=1)
    chunk = max(1, PAIRS_PER_CHUNK // widest)
    found = []
    for first in range(0, len(states), chunk):
        source = states[first : first + chunk]
        current, node = source.copy(), np.zeros(len(source), dtype=np.int64)
        for level in trie.levels:
            if not len(node):
                break
            kept, node, current = _descend(level, node, current, flat, width, dead)
            source = source[kept]
            ending, token = expand(level.end_start[node], level.end_start[node + 1])
            found.append((source[ending] * vocab_size + level.ends[token], current[ending]))
    keys = np.concatenate([np.empty(0, dtype=np.int64), *(part[0] for part in found)])
    targets = np.concatenate([np.empty(0, dtype=np.int64), *(part[1] for part in found)])
    bits = max(dead.bit_length(), 1)  # a target is below the dead state
    if len(keys) and bits < PACKED_BITS and int(keys.max()) < 1 << (PACKED_BITS - bits):
        packed = np.sort((keys << bits) | targets)
        keys, targets = packed >> bits, packed & ((1 << bits) - 1)
    else:  # too many states and tokens to pack: sorted by an argsort, four times slower
        order = np.argsort(keys)
        keys, targets = keys[order], targets[order]
    return keys // vocab_size, keys % vocab_size, targets


def tokens_from(table: np.ndarray, state: int, trie: TokenTrie, vocab_size: int) -> np.ndarray:
    """The tokens whose bytes all lead somewhere from `state` through the byte automaton `table` (as in
    `token_transitions`), sorted int32 ids: what one state allows, the first time a generation reaches it
    (`lazy.LazyAutomaton`).

    A level at a time, as `token_transitions` goes, while the walk holds few of a level's nodes. Once it
    holds at least 1 in `DENSE_FROM` of them, it goes over the next levels whole: each node's state is its
    parent's moved by its byte, dead under a dead parent, with no list of pairs to expand. A state inside
    a JSON string allows most tokens: at 32k tokens, its walk took 7 ms pair by pair."""
    dead, width = table.shape[0] - 1, table.shape[1]
    flat = table.reshape(-1)
    allowed = np.zeros(vocab_size, dtype=bool)
    node, current = np.zeros(1, dtype=np.int64), np.array([state], dtype=np.int64)  # pairs: (node, its state), the root first
    states = None  # walking whole levels: the state of every node of the last level, `dead` where it went nowhere
    for level in trie.levels:
        if states is None:
            _, node, current = _descend(level, node, current, flat, width, dead)
            allowed[level.ends[expand(level.end_start[node], level.end_start[node + 1])[1]]] = True
            if not len(node):
                break
            if len(node) * DENSE_FROM >= len(level.byte):
                states = np.full(len(level.byte), dead, dtype=np.int64)
                states[node] = current
        else:
            states = flat[states[level.parent] * width + level.byte]
            live = states != dead
            allowed[level.ends[live[level.end_node]]] = True
            if not live.any():
                break
    return np.flatnonzero(allowed).astype(np.int32)
