"""A regular constraint's tables, from its source and a vocabulary's trie: the compile itself.

outlines-core turns a regex into a byte-level automaton (its index over a vocabulary of the 256 single
bytes), and walking every token of the model's vocabulary through it gives the token-level automaton
(`trie.token_transitions`). Its regex engine follows leftmost-first semantics: once an earlier
alternative has matched, later ones are dropped, so on its own `(no|none)` would never let "none"
through, and `([0-9]|1[0-9]{2})` would stop after one digit. We compile `(?:pattern)` followed by a
sentinel character instead, so that no match happens inside the pattern, and read "may end here" as
"the sentinel may come next"; then every state from which no accepting state can be reached is cut (the
half-written sentinel among them). The result is the pattern's language, as Python's `re.fullmatch`
defines it.

Only numpy, outlines-core and the standard library: this is what a compiling child runs, and the
process it is forked from (`forkserver`) never imports torch.
"""

from __future__ import annotations

import functools
import hashlib
from itertools import chain

import numpy as np
from outlines_core import Index, Vocabulary as OutlinesVocabulary

from ..errors import InvalidOption
from .trie import TokenTrie, expand, token_transitions

SENTINEL, SENTINEL_REGEX = "\U0010FFFF", r"\x{10FFFF}"  # a noncharacter: no real text ends with it
SENTINEL_ID = 256  # its token id in the vocabulary of single bytes

MAX_REGEX_CHARS = 4_000_000  # a schema's regex, built in the child
# A character of a JSON string as outlines-core writes it, and as JSON writes it: outlines-core's leaves out
# the `\uXXXX` escapes (so a control character other than the five with short escapes could not be written
# at all) and U+007F-U+009F written as they are, which JSON allows. Each is one character of the string,
# as minLength and maxLength count them, in the group that the lengths repeat.
OUTLINES_STRING_CHARACTER = r'[^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt]'
JSON_STRING_CHARACTER = r'[^"\\\x00-\x1F]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4}'
MAX_MASK_BYTES = 256 * 2**20  # the distinct masks of one compiled constraint, as float32 bias rows x vocabulary
MAX_TABLE_BYTES = 256 * 2**20  # its transitions, 16 bytes each: 16M (the benchmark's JSON schema has 2M over 32k tokens)


class MasksTooLarge(InvalidOption):
    """A constraint whose byte automaton has more states than masks can be reserved for, over a vocabulary
    that writes every byte: llguidance runs it (`regular`)."""


def build_tables(source: tuple[str, str], trie: TokenTrie, vocab_size: int) -> dict:
    """The tables of `source` ("regex", pattern) or ("json_schema", schema text) over the vocabulary of
    `trie`: the keyword arguments of `TokenAutomaton.from_tables`, or of a `LazyAutomaton` (see
    `byte_tables`). A schema becomes its regex here,
    because that regex can grow exponentially with the schema (4x per level of nested arrays).

    Raises `InvalidOption` naming the problem (a schema outlines-core cannot compile, a regex past
    `MAX_REGEX_CHARS`, a pattern it rejects, no text the vocabulary can write, tables past their limits).
    """
    pattern = source[1]
    if source[0] == "json_schema":
        from outlines_core.json_schema import build_regex_from_schema

        try:
            pattern = build_regex_from_schema(source[1]).replace(OUTLINES_STRING_CHARACTER, JSON_STRING_CHARACTER)
        except Exception as error:  # outlines-core names the part of the schema it does not support
            raise InvalidOption(f"option 'schema' cannot be compiled: {error}") from None
        if len(pattern) > MAX_REGEX_CHARS:
            raise InvalidOption(f"the schema's regular expression has {len(pattern):,} characters, more than "
                                f"{MAX_REGEX_CHARS:,} (limit max_regex_chars): nest less deeply")
    wrapped = f"(?:{pattern}){SENTINEL_REGEX}"
    try:
        index = Index(wrapped, _bytes_vocabulary())
    except Exception as error:  # outlines-core reports unusable patterns as plain exceptions
        message = str(error).replace(wrapped, pattern)
        if "vocabulary provided is incompatible" in message:  # over every byte: no text can begin a match
            message = "the constraint matches no text at all"
        elif "building NFA" in message:  # what its regex engine refused, with no word of why
            option, origin = (("schema", " (from a pattern or a count like maxItems or maxLength)")
                              if source[0] == "json_schema" else ("pattern", ""))
            message = (f"option {option!r} cannot be compiled: its regular expression{origin} holds what outlines-core's "
                       f"regex engine refuses: a look-around, a trailing backslash, or a repetition count too large ({message})")
        raise InvalidOption(message) from None
    initial, table, accepting = _byte_automaton(index)
    if covers_every_byte(trie):
        if table.shape[0] * vocab_size * 4 <= MAX_MASK_BYTES:
            return byte_tables(initial, table, accepting, trie)
        raise MasksTooLarge(f"the constraint's {table.shape[0] - 1:,} states would reserve more than {MAX_MASK_BYTES >> 20} "
                            f"MiB of masks over {vocab_size:,} tokens (limit max_mask_bytes)")
    return tables(*_live_transitions(initial, table, accepting, trie, vocab_size), vocab_size)


def covers_every_byte(trie: TokenTrie) -> bool:
    """Whether each of the 256 bytes is a token of its own (byte-level BPE, SentencePiece's byte
    fallback). Then a token-level automaton needs no compile ahead (`lazy.LazyAutomaton`): any text the
    byte automaton can still finish, the tokens can write byte by byte, so a state's tokens are those
    whose bytes lead to such a state, found when the state is first reached."""
    first = trie.levels[0] if trie.levels else None
    return first is not None and len(first.byte) == 256 and bool((np.diff(first.end_start) > 0).all())


def byte_tables(initial: int, table: np.ndarray, accepting: np.ndarray, trie: TokenTrie | None) -> dict:
    """The arrays of a `LazyAutomaton` (the keyword arguments of its constructor): the byte automaton
    with every transition into a state from which it cannot end redirected to the dead state (so that a
    token's walk needs no check after), and where it may end. Its masks are bounded by its states, one
    bias row each at most, which the caller checked against `MAX_MASK_BYTES`, so that no generation can
    pass that limit midway.

    Raises `InvalidOption` when no text matches, or when the table exceeds `MAX_TABLE_BYTES`."""
    if table.nbytes > MAX_TABLE_BYTES:
        raise InvalidOption(f"the constraint is too large: its {table.shape[0] - 1:,} states exceed {MAX_TABLE_BYTES >> 20} "
                            f"MiB of tables (limit max_table_bytes)")
    dead = table.shape[0] - 1
    sources, on = np.nonzero(table[:-1] != dead)  # the byte transitions that lead somewhere
    live = reachable(np.flatnonzero(accepting), table[sources, on], sources, dead + 1)  # backwards: it can still end
    if not live[initial]:
        raise InvalidOption(f"the vocabulary cannot write any text that matches the constraint"
                            f"{_unwritable(initial, table, accepting, trie)}")
    pruned = np.where(live[table], table, dead)
    ends = np.zeros(dead + 1, dtype=bool)
    ends[:-1] = accepting
    return {"initial": initial, "byte_table": pruned, "accepting": ends}


def warm() -> None:
    """Does once, in the fork server, what every compiling child would otherwise do first: its children
    inherit the vocabulary of bytes, the schema module and outlines-core's own first-use set-up."""
    from outlines_core.json_schema import build_regex_from_schema

    index = Index(build_regex_from_schema('{"type": "string"}') + SENTINEL_REGEX, _bytes_vocabulary())
    byte_tables(*_byte_automaton(index), trie=None)  # it reads the trie only to say why a text cannot be written


@functools.cache
def _bytes_vocabulary() -> OutlinesVocabulary:
    """The 256 bytes, each a token of its own id, and the sentinel (id 256): over it, outlines-core's
    index is the pattern's byte-level automaton."""
    tokens = {bytes([byte]): [byte] for byte in range(256)}
    tokens[SENTINEL.encode()] = [SENTINEL_ID]
    return OutlinesVocabulary(SENTINEL_ID + 1, tokens)


def _byte_automaton(index: Index) -> tuple[int, np.ndarray, np.ndarray]:
    """outlines-core's index over `_bytes_vocabulary` as (initial state, the table int64 [S + 1, 256] of
    each state's next state on each byte, the dead state S last, where the pattern may end: bool [S]).

    The sentinel is also an ordinary character where the pattern allows any (inside a JSON string): only
    its transition into a final state says "the pattern may end here", and the bytes that lead into a final
    state (the sentinel's last one) lead nowhere. The index comes as a dict of dicts; each state's is read
    into arrays whole, since a Python loop over its entries (47k for the benchmark's schema) took 16-31 ms."""
    transitions, finals = index.get_transitions(), index.get_final_states()
    moves = list(transitions.values())
    sizes = np.fromiter(map(len, moves), dtype=np.int64, count=len(moves))
    total = int(sizes.sum())
    sources = np.repeat(np.fromiter(transitions, dtype=np.int64, count=len(moves)), sizes)
    on = np.fromiter(chain.from_iterable(moves), dtype=np.int64, count=total)
    into = np.fromiter(chain.from_iterable(map(dict.values, moves)), dtype=np.int64, count=total)
    final_labels = np.fromiter(finals, dtype=np.int64, count=len(finals))
    initial = np.array([index.get_initial_state()], dtype=np.int64)
    labels, numbered = renumber(np.concatenate([initial, final_labels, sources, into]))
    dead = len(labels)
    initial, final_numbers, sources, into = np.split(numbered, np.cumsum([1, len(final_labels), total]))
    final = np.zeros(dead + 1, dtype=bool)
    final[final_numbers] = True
    table = np.full((dead + 1, 256), dead, dtype=np.int64)
    accepting = np.zeros(dead, dtype=bool)
    ends = on == SENTINEL_ID
    accepting[sources[ends & final[into]]] = True
    kept = ~ends & ~final[into]
    table[sources[kept], on[kept]] = into[kept]
    return int(initial[0]), table, accepting


def _live_transitions(initial: int, table: np.ndarray, accepting: np.ndarray, trie: TokenTrie, vocab_size: int):
    """The transitions on text tokens from the states a text can reach from `initial`, between states from
    which the pattern can still be ended, sorted by (state, token), so that the tables need no sort; and
    the states where the pattern may end."""
    states = np.arange(table.shape[0] - 1)
    sources, tokens, targets = token_transitions(table, states, trie, vocab_size)
    count = len(states)
    edges = np.unique(sources * count + targets)  # the graph of states, tokens merged
    froms, tos = edges // count, edges % count
    live = reachable(np.flatnonzero(accepting), tos, froms, count)  # backwards
    if not live[initial]:
        raise InvalidOption(f"the vocabulary cannot write any text that matches the constraint"
                            f"{_unwritable(initial, table, accepting, trie)}")
    # what a state the pattern cannot end from leads to cannot end it either: reachable and live is
    # reachable through live states
    kept = reachable(np.array([initial]), froms, tos, count) & live
    keep = kept[sources] & kept[targets]
    return initial, sources[keep], tokens[keep], targets[keep], sorted(np.flatnonzero(accepting & kept).tolist())
def _unwritable(initial: int, table: np.ndarray, accepting: np.ndarray, trie: TokenTrie) -> str:
    """What the refusal of a constraint no token path can end adds: the shortest text the pattern accepts
    (bytes in ascending order among the shortest), and its first character that no token holds a byte
    of, when there is one (the usual cause: a vocabulary without byte fallback lacks a character)."""
    parent = {initial: None}  # state -> (the state before it, the byte between)
    frontier, end = [initial], None
    while frontier and end is None:
        following = []
        for state in frontier:
            if accepting[state]:
                end = state
                break
            for byte in np.flatnonzero(table[state] != table.shape[0] - 1).tolist():
                target = int(table[state, byte])
                if target not in parent:
                    parent[target] = (state, byte)
                    following.append(target)
        frontier = following
    if end is None:
        return ""
    text = bytearray()
    while end != initial:
        end, byte = parent[end]
        text.append(byte)
    example = bytes(reversed(text)).decode("utf-8", errors="replace")
    held = set(np.unique(np.concatenate([level.byte for level in trie.levels])).tolist()) if trie.levels else set()
    missing = next((c for c in example if not set(c.encode()) <= held), None)
    shown = repr(example) if len(example) <= 40 else repr(example[:40])[:-1] + "...'"
    if missing is None:
        return f": its tokens cannot spell the shortest text the constraint accepts, {shown}, nor any other"
    return f": no token holds {missing!r} (U+{ord(missing):04X}), which the shortest text it accepts, {shown}, needs"


def reachable(start: np.ndarray, sources: np.ndarray, targets: np.ndarray, count: int) -> np.ndarray:
    """bool [count]: the states reachable from `start` (included) along the edges `sources[i] -> targets[i]`,
    a level of them at a time, in numpy: forwards or, edges reversed, backwards, over byte or token edges."""
    order = np.argsort(sources, kind="stable")
    following, starts = targets[order], np.searchsorted(sources[order], np.arange(count + 1))
    seen = np.zeros(count, dtype=bool)
    seen[start] = True
    frontier = np.flatnonzero(seen)
    while len(frontier):
        _, at = expand(starts[frontier], starts[frontier + 1])
        after = np.unique(following[at])
        frontier = after[~seen[after]]
        seen[frontier] = True
    return seen


def tables(initial: int, sources, tokens, targets, accepting, vocab_size: int) -> dict:
    """The arrays of a `TokenAutomaton` (the keyword arguments of `from_tables`), from transition triples
    whose states may be any integers (they are renumbered). Pure numpy, so that a compiling child can
    make them within its memory cap and send them whole.

    Raises `InvalidOption` when two transitions leave one state on one token for different states, or
    when the tables would exceed `MAX_TABLE_BYTES` or the masks `MAX_MASK_BYTES`.
    """
    sources, tokens, targets = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (sources, tokens, targets))
    if len(sources) * 16 > MAX_TABLE_BYTES:
        raise InvalidOption(f"the constraint is too large: its {len(sources):,} transitions exceed {MAX_TABLE_BYTES >> 20} "
                            f"MiB of tables (limit max_table_bytes)")
    accepting = np.asarray(sorted(accepting), dtype=np.int64)
    labels, numbered = renumber(np.concatenate([[initial], sources, targets, accepting]))
    count, n = len(labels), len(sources)
    src, dst = numbered[1 : 1 + n], numbered[1 + n : 1 + 2 * n]
    acc = numbered[1 + 2 * n :]
    keys = src * vocab_size + tokens
    repeated = []
    if not (keys[1:] > keys[:-1]).all():  # a compiled constraint's come sorted, each once: no sort
        order = np.argsort(keys)
        keys, dst = keys[order], dst[order]
        repeated = np.nonzero(keys[1:] == keys[:-1])[0]
    if len(repeated):
        conflict = repeated[dst[repeated] != dst[repeated + 1]]
        if len(conflict):
            at = conflict[0]
            raise InvalidOption(f"the automaton is not deterministic: state {labels[keys[at] // vocab_size]} has two "
                                f"transitions on token {keys[at] % vocab_size}")
        keep = np.ones(len(keys), dtype=bool)
        keep[repeated + 1] = False
        keys, dst = keys[keep], dst[keep]
    mask_of, forbidden = _distinct_masks(keys // vocab_size, keys % vocab_size, count, vocab_size)
    final = np.zeros(count + 1, dtype=bool)
    final[acc] = True
    return {"initial": int(numbered[0]), "vocab_size": vocab_size, "keys": np.append(keys, np.iinfo(np.int64).max),
            "targets": np.append(dst.astype(np.int64), count), "mask_of": mask_of, "forbidden": forbidden,
            "accepting": final}


def renumber(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(labels, return_inverse=True)`, in linear time when the labels are small integers (a
    compiler's state ids are), which is most of a large constraint's compile time saved."""
    top = int(labels.max())
    if top >= 4 * len(labels) + 4096:
        return np.unique(labels, return_inverse=True)
    present = np.zeros(top + 1, dtype=bool)
    present[labels] = True
    return np.flatnonzero(present), (np.cumsum(present) - 1)[labels]


def _distinct_masks(sources: np.ndarray, tokens: np.ndarray, count: int, vocab_size: int):
    """Each state's forbidden tokens, each distinct mask stored once; the dead state (index `count`) allows
    nothing. Masks are told apart by the ids of the tokens they allow, hashed where they lie (a state's
    come sorted, each once), and a dense row is made for each distinct one only: hashing every state's
    dense row took 100 ms at 32k tokens, most of a large constraint's tables."""
    bounds = np.searchsorted(sources, np.arange(count + 2)).tolist()  # sorted: state s owns [bounds[s], bounds[s+1])
    seen: dict[bytes, int] = {}
    firsts: list[int] = []  # the first state of each distinct mask
    mask_of = np.empty(count + 1, dtype=np.int64)
    for state in range(count + 1):
        digest = hashlib.blake2b(tokens[bounds[state] : bounds[state + 1]].tobytes(), digest_size=16).digest()
        index = seen.get(digest)
        if index is None:
            index = seen[digest] = len(firsts)
            firsts.append(state)
            if len(firsts) * vocab_size * 4 > MAX_MASK_BYTES:
                raise InvalidOption(f"the constraint is too large: its token masks exceed {MAX_MASK_BYTES >> 20} MiB "
                                    f"(limit max_mask_bytes)")
        mask_of[state] = index
    forbidden = np.ones((len(firsts), vocab_size), dtype=bool)
    for row, state in enumerate(firsts):
        forbidden[row, tokens[bounds[state] : bounds[state + 1]]] = False
    return mask_of, forbidden
