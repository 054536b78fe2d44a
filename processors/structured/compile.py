"""Compiling a regular constraint into a `TokenAutomaton`, bounded in time and memory, and cached.

outlines-core turns a regex into a byte-level automaton (its index over a vocabulary of the 256 single
bytes), and walking every token of the model's vocabulary through it gives the token-level automaton
(`trie.token_transitions`). Its regex engine follows
leftmost-first semantics: once an earlier alternative has matched, later ones are dropped, so on its own
`(no|none)` would never let "none" through, and `([0-9]|1[0-9]{2})` would stop after one digit. We
compile `(?:pattern)` followed by a sentinel character instead, so that no match happens inside the
pattern, and read "may end here" as "the sentinel may come next"; then every state from which no
accepting state can be reached is cut (the half-written sentinel among them). The result is the pattern's
language, as Python's `re.fullmatch` defines it.

That work is polynomial for sane patterns but exponential for some (`(a|b)*a(a|b){30}`), and it runs in
native code that a thread cannot interrupt, so it runs in a forked child: the parent waits `timeout_s`
at most, then kills it, and the child's address space is capped so a pathological pattern fails instead
of swapping the machine. The child makes the automaton's tables too, within that cap, and sends them
whole: the parent never holds more than the tables themselves. Results, failures included, are cached by (constraint, vocabulary
fingerprint): every generation with the same constraint on the same model shares one automaton.

A caller that may stop wanting the result passes `cancelled`, a callable the parent asks while it waits
(every `POLL_S`): once it answers True the child is killed and `CompileCancelled` raised. A stopped
compile says nothing about the constraint, so it is neither cached nor remembered as a failure.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
import resource
import threading
import time
from collections import OrderedDict
from typing import Callable

import numpy as np
from outlines_core import Index, Vocabulary as OutlinesVocabulary

from ..errors import InvalidOption, ProcessorError
from .automaton import TokenAutomaton, tables
from .trie import TokenTrie, token_transitions
from .vocabulary import Vocabulary

COMPILE_MEMORY_BYTES = 2 * 2**30  # what the compiling child may allocate beyond what it inherits
CACHE_BYTES = 512 * 2**20  # compiled automata kept for reuse, least recently used dropped first

SENTINEL, SENTINEL_REGEX = "\U0010FFFF", r"\x{10FFFF}"  # a noncharacter: no real text ends with it
SENTINEL_ID = 256  # its token id in the vocabulary of single bytes

MAX_FAILURES = 1024  # constraints remembered as impossible to compile
MAX_REGEX_CHARS = 4_000_000  # a schema's regex, built in the child
MAX_VOCABULARIES = 4  # vocabularies whose token trie is kept (a server loads at most a few models)
POLL_S = 0.05  # how often a waiting parent asks `cancelled`: a stopped compile's child lives this long at most

_cache: OrderedDict[tuple, TokenAutomaton] = OrderedDict()
_failures: OrderedDict[tuple, tuple[InvalidOption, float]] = OrderedDict()  # (the error, the timeout it had)
_cache_lock = threading.Lock()
_tries: OrderedDict[str, TokenTrie] = OrderedDict()  # by vocabulary fingerprint


class CompileTimedOut(InvalidOption):
    """Compiling took longer than its timeout: a longer one may succeed, so this failure is retried."""


class CompileCancelled(ProcessorError):
    """The caller's `cancelled` hook stopped the compile: nothing is known about the constraint."""


def compile_regex(source: tuple[str, str], vocabulary: Vocabulary, timeout_s: float,
                  cancelled: Callable[[], bool] | None = None) -> TokenAutomaton:
    """The automaton of `source` over `vocabulary`, from the cache or compiled now. `source` is
    ("regex", pattern) or ("json_schema", schema text): a schema becomes its regex in the child too,
    because that regex can grow exponentially with the schema (4x per level of nested arrays).

    Raises `InvalidOption` when the vocabulary cannot write any match, when compiling takes longer than
    `timeout_s` or more memory than `COMPILE_MEMORY_BYTES`. A failure is remembered like a success, so
    asking again costs nothing (unless with a longer timeout, after a timeout). Raises `CompileCancelled`
    (remembering nothing) when `cancelled()` turns True before the compile is done: its child is killed
    within `POLL_S`.
    """
    key = (source, vocabulary.fingerprint)
    with _cache_lock:
        found = _cache.get(key)
        if found is not None:
            _cache.move_to_end(key)
        failed = _failures.get(key)
    if found is not None:
        return found
    if failed is not None and not _retried(failed, timeout_s):
        error, tried = failed
        if isinstance(error, CompileTimedOut):  # named with this call's limit, which may be shorter
            raise _timed_out(timeout_s, tried)
        raise InvalidOption(str(error))
    try:
        automaton = _build(source, vocabulary, timeout_s, cancelled or _never)
    except InvalidOption as error:
        with _cache_lock:
            _failures[key] = (error, timeout_s)
            while len(_failures) > MAX_FAILURES:
                _failures.popitem(last=False)
        raise
    _store(key, automaton)
    return automaton


def _store(key: tuple, automaton: TokenAutomaton) -> None:
    """Caches an automaton as the most recently used, within `CACHE_BYTES` (the least recently used go)."""
    with _cache_lock:
        _cache[key] = automaton
        _cache.move_to_end(key)
        while sum(a.nbytes for a in _cache.values()) > CACHE_BYTES and len(_cache) > 1:
            _cache.popitem(last=False)


def _timed_out(timeout_s: float, ran_s: float) -> CompileTimedOut:
    """The error of a constraint that does not compile within `timeout_s`: a compile of it ran `ran_s`."""
    return CompileTimedOut(f"compiling the constraint takes longer than compile_timeout_s = {timeout_s:g} s: a "
                           f"compile of it ran {ran_s:g} s without ending (limit compile_timeout_s)")


def _never() -> bool:
    return False


def _retried(failed: tuple[InvalidOption, float], timeout_s: float | None) -> bool:
    """Whether a remembered failure is tried again: a timeout, asked again with a longer timeout."""
    return isinstance(failed[0], CompileTimedOut) and timeout_s is not None and timeout_s > failed[1]


def _build(source: tuple[str, str], vocabulary: Vocabulary, timeout_s: float, cancelled) -> TokenAutomaton:
    """Compiles in the child, which sends the automaton's tables whole."""
    return TokenAutomaton.from_tables(**_in_child(source, vocabulary, timeout_s, cancelled))


def is_compiled(source: tuple[str, str], vocabulary: Vocabulary, timeout_s: float | None = None) -> bool:
    """Whether binding `source` to `vocabulary` (with `timeout_s`) takes no compiling: compiled, or known
    to fail (a timeout is not known to fail with a longer timeout: `compile_regex` tries again)."""
    key = (source, vocabulary.fingerprint)
    with _cache_lock:
        if key in _cache:
            return True
        failed = _failures.get(key)
    return failed is not None and not _retried(failed, timeout_s)


def _token_trie(vocabulary: Vocabulary) -> TokenTrie:
    """The trie of the vocabulary's text tokens, built once per vocabulary, in the parent, so that each
    compiling child inherits it (at 32k tokens building it takes about a tenth of a second)."""
    with _cache_lock:
        found = _tries.get(vocabulary.fingerprint)
    if found is None:
        found = TokenTrie.build(vocabulary.text_tokens())
        with _cache_lock:
            _tries[vocabulary.fingerprint] = found
            while len(_tries) > MAX_VOCABULARIES:
                _tries.popitem(last=False)
    return found


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
    state (the sentinel's last one) lead nowhere."""
    transitions, finals = index.get_transitions(), index.get_final_states()
    labels = sorted({*transitions, *finals, *(t for move in transitions.values() for t in move.values())})
    number = {label: n for n, label in enumerate(labels)}
    dead = len(labels)
    final = np.zeros(dead + 1, dtype=bool)
    final[[number[f] for f in finals]] = True
    table = np.full((dead + 1, 256), dead, dtype=np.int64)
    accepting = np.zeros(dead, dtype=bool)
    for state, move in transitions.items():
        row = number[state]
        for byte, target in move.items():
            target = number[target]
            if byte == SENTINEL_ID:
                accepting[row] |= bool(final[target])
            elif not final[target]:
                table[row, byte] = target
    return number[index.get_initial_state()], table, accepting


def _live_transitions(initial: int, table: np.ndarray, accepting: np.ndarray, trie: TokenTrie, vocab_size: int):
    """The transitions on text tokens from the states a text can reach from `initial`, between states from
    which the pattern can still be ended, sorted by (state, token), so that the tables need no sort; and
    the states where the pattern may end."""
    states = np.arange(table.shape[0] - 1)
    sources, tokens, targets = token_transitions(table, states, trie, vocab_size)
    count = len(states)
    edges = np.unique(sources * count + targets)
    into: dict[int, list[int]] = {}  # the graph of states, tokens merged, both ways
    out: dict[int, list[int]] = {}
    for source, target in zip((edges // count).tolist(), (edges % count).tolist()):
        into.setdefault(target, []).append(source)
        out.setdefault(source, []).append(target)
    live = _closure(np.flatnonzero(accepting).tolist(), into)
    if initial not in live:
        raise ValueError(f"the vocabulary cannot write any text that matches the constraint{_unwritable(initial, table, accepting, trie)}")
    # what a state the pattern cannot end from leads to cannot end it either: reachable and live is
    # reachable through live states
    kept = np.zeros(count, dtype=bool)
    kept[list(_closure([initial], out) & live)] = True
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


def _closure(start: list[int], graph: dict[int, list[int]]) -> set[int]:
    """The states reachable from `start` in `graph` (state -> next states), `start` included."""
    seen, frontier = set(start), list(start)
    while frontier:
        for state in graph.get(frontier.pop(), ()):
            if state not in seen:
                seen.add(state)
                frontier.append(state)
    return seen


def _in_child(source: tuple[str, str], vocabulary: Vocabulary, timeout_s: float, cancelled):
    """Runs `_compile_child` in a forked child and returns what it sent; waits `timeout_s` at most, in
    polls of `POLL_S` between which it asks `cancelled`, and kills the child whatever ends the wait."""
    if cancelled():
        raise CompileCancelled("the compile was cancelled before it started")
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    # made here and handed over: the child takes no lock, which another thread may hold at the fork
    trie, bytes_vocabulary = _token_trie(vocabulary), _bytes_vocabulary()
    child = context.Process(target=_compile_child, args=(source, bytes_vocabulary, trie, vocabulary.size, timeout_s, sender),
                            daemon=True)
    child.start()
    sender.close()
    deadline = time.monotonic() + timeout_s
    try:
        while not receiver.poll(max(0.0, min(POLL_S, deadline - time.monotonic()))):  # True at EOF too
            if cancelled():
                raise CompileCancelled("the compile was cancelled: no caller waits for it any more")
            if time.monotonic() >= deadline:
                raise _timed_out(timeout_s, timeout_s)
        try:
            status, payload = receiver.recv()
            if status == "ok":
                payload = _receive_tables(receiver, payload, deadline)
        except TimeoutError:
            raise _timed_out(timeout_s, timeout_s) from None
        except (EOFError, OSError):  # the child ended, or ended mid-message
            raise InvalidOption(f"compiling the constraint needed more than {COMPILE_MEMORY_BYTES >> 20} MiB "
                                f"(limit compile_memory) or crashed") from None
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receiver.close()
    if status == "error":
        raise InvalidOption(payload)
    return payload


def _compile_child(source: tuple[str, str], bytes_vocabulary: OutlinesVocabulary, trie: TokenTrie, vocab_size: int,
                   timeout_s: float, sender) -> None:
    """Runs in the child: outlines-core's byte-level index of the pattern and the sentinel, walked by every
    token of the trie; sent back as arrays of the text tokens' transitions, and the states where the
    sentinel may come (where the pattern may end)."""
    pattern = source[1]
    try:
        _detach(sender.fileno())
        _cap_memory(COMPILE_MEMORY_BYTES)
        # the parent kills it after `timeout_s`; if the parent is gone first, the kernel does
        resource.setrlimit(resource.RLIMIT_CPU, (math.ceil(timeout_s) + 1, math.ceil(timeout_s) + 2))
        if source[0] == "json_schema":
            from outlines_core.json_schema import build_regex_from_schema

            try:
                pattern = build_regex_from_schema(source[1])
            except Exception as error:  # outlines-core names the part of the schema it does not support
                raise ValueError(f"option 'schema' cannot be compiled: {error}") from None
            if len(pattern) > MAX_REGEX_CHARS:
                raise ValueError(f"the schema's regular expression has {len(pattern):,} characters, more than "
                                 f"{MAX_REGEX_CHARS:,} (limit max_regex_chars): nest less deeply")
        index = Index(f"(?:{pattern}){SENTINEL_REGEX}", bytes_vocabulary)
        made = tables(*_live_transitions(*_byte_automaton(index), trie, vocab_size), vocab_size)
    except MemoryError:
        sender.send(("error", f"compiling the constraint needed more than {COMPILE_MEMORY_BYTES >> 20} MiB "
                              f"(limit compile_memory)"))
    except Exception as error:  # outlines-core reports unusable patterns as plain exceptions
        message = str(error).replace(f"(?:{pattern}){SENTINEL_REGEX}", pattern)
        if "vocabulary provided is incompatible" in message:  # over every byte: no text can begin a match
            message = "the constraint matches no text at all"
        sender.send(("error", message))
    else:  # once its first part is out, nothing else is sent: a failure ends the child, which the parent reads as a crash
        _send_tables(sender, made)
    finally:
        sender.close()
        os._exit(0)


def _send_tables(sender, made: dict) -> None:
    """The tables as ("ok", their shapes and the plain values), then each array's bytes as they are, in
    that order: no pickled copy on either side (the tables of a large constraint run to hundreds of MiB),
    and no framing, since the shapes say how many bytes each array takes."""
    arrays = {name: value for name, value in made.items() if isinstance(value, np.ndarray)}
    plain = {name: value for name, value in made.items() if name not in arrays}
    sender.send(("ok", (plain, {name: (array.dtype.str, array.shape) for name, array in arrays.items()})))
    for array in arrays.values():
        _write_all(sender.fileno(), _as_bytes(np.ascontiguousarray(array)))


def _receive_tables(receiver, header, deadline: float) -> dict:
    """What `_send_tables` sent, each array read straight into its own buffer, whole (a child that ends
    before is an `EOFError` or an `OSError`), by `deadline` (or a `TimeoutError`).

    Not a `Connection` message per array: `recv_bytes_into` reads one in chunks into a growing buffer,
    each allocated at the length still to come, then copies it out. At 32k tokens (39 MB of tables)
    that made the transfer take 37-112 ms, against 20-36 ms read in place (helper's measurement)."""
    plain, shapes = header
    made = dict(plain)
    for name, (dtype, shape) in shapes.items():
        array = made[name] = np.empty(shape, dtype=np.dtype(dtype))
        _read_into(receiver, _as_bytes(array), deadline)
    return made


def _write_all(fd: int, data: memoryview) -> None:
    """Writes all of `data` to `fd` (a pipe takes it a buffer at a time)."""
    while data:
        data = data[os.write(fd, data):]


def _read_into(receiver, buffer: memoryview, deadline: float) -> None:
    """Fills `buffer` from the pipe of `receiver`: an `EOFError` if the child ends first, a
    `TimeoutError` if it sends nothing more before `deadline`."""
    done = 0
    while done < len(buffer):
        if not receiver.poll(max(0.0, deadline - time.monotonic())):  # True at the end of the pipe too
            raise TimeoutError("the child sent no more before the deadline")
        count = os.readv(receiver.fileno(), [buffer[done:]])
        if not count:
            raise EOFError("the child ended mid-array")
        done += count


def _as_bytes(array: np.ndarray) -> memoryview:
    """A contiguous array's buffer as flat bytes (a partial write or read slices it by its first axis)."""
    return array.reshape(-1).view(np.uint8).data


def _detach(keep: int) -> None:
    """In the child: drop every descriptor it inherited but its end of the pipe (the server's protocol
    output among them, or the client would not see EOF while a child lives), and die with its parent."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    os.closerange(3, keep)
    os.closerange(keep + 1, max(os.sysconf("SC_OPEN_MAX"), keep + 1))  # no descriptor lies past the soft limit
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: Linux only
    except (OSError, AttributeError):
        pass


def _cap_memory(extra: int) -> None:
    try:
        with open("/proc/self/statm") as statm:
            current = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: no cap, the timeout still holds
        return
    resource.setrlimit(resource.RLIMIT_AS, (current + extra, current + extra))
