"""Compiling a regular constraint into a `TokenAutomaton`, bounded in time and memory, and cached.

outlines-core turns a regex and a vocabulary into a token-level automaton. Its regex engine follows
leftmost-first semantics: once an earlier alternative has matched, later ones are dropped, so on its own
`(no|none)` would never let "none" through, and `([0-9]|1[0-9]{2})` would stop after one digit. We
compile `(?:pattern)` followed by a sentinel character instead, so that no match happens inside the
pattern, and read "may end here" as "the sentinel may come next"; then every state from which no
accepting state can be reached is cut (the half-written sentinel among them). The result is the pattern's
language, as Python's `re.fullmatch` defines it.

That work is polynomial for sane patterns but exponential for some (`(a|b)*a(a|b){30}`), and it runs in
native code that a thread cannot interrupt, so it runs in a forked child: the parent waits `timeout_s`
at most, then kills it, and the child's address space is capped so a pathological pattern fails instead
of swapping the machine. Results, failures included, are cached by (constraint, vocabulary
fingerprint): every generation with the same constraint on the same model shares one automaton.

A caller that may stop wanting the result passes `cancelled`, a callable the parent asks while it waits
(every `POLL_S`): once it answers True the child is killed and `CompileCancelled` raised. A stopped
compile says nothing about the constraint, so it is neither cached nor remembered as a failure.
"""

from __future__ import annotations

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
from .automaton import TokenAutomaton, renumber
from .vocabulary import Vocabulary

COMPILE_MEMORY_BYTES = 2 * 2**30  # what the compiling child may allocate beyond what it inherits
CACHE_BYTES = 512 * 2**20  # compiled automata kept for reuse, least recently used dropped first

SENTINEL, SENTINEL_REGEX = "\U0010FFFF", r"\x{10FFFF}"  # a noncharacter: no real text ends with it

MAX_FAILURES = 1024  # constraints remembered as impossible to compile
MAX_REGEX_CHARS = 4_000_000  # a schema's regex, built in the child
POLL_S = 0.05  # how often a waiting parent asks `cancelled`: a stopped compile's child lives this long at most

_cache: OrderedDict[tuple, TokenAutomaton] = OrderedDict()
_failures: OrderedDict[tuple, tuple[InvalidOption, float]] = OrderedDict()  # (the error, the timeout it had)
_cache_lock = threading.Lock()


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
        raise InvalidOption(str(failed[0]))
    try:
        automaton = _build(source, vocabulary, timeout_s, cancelled or _never)
    except InvalidOption as error:
        with _cache_lock:
            _failures[key] = (error, timeout_s)
            while len(_failures) > MAX_FAILURES:
                _failures.popitem(last=False)
        raise
    with _cache_lock:
        _cache[key] = automaton
        while sum(a.nbytes for a in _cache.values()) > CACHE_BYTES and len(_cache) > 1:
            _cache.popitem(last=False)
    return automaton


def _never() -> bool:
    return False


def _retried(failed: tuple[InvalidOption, float], timeout_s: float | None) -> bool:
    """Whether a remembered failure is tried again: a timeout, asked again with a longer timeout."""
    return isinstance(failed[0], CompileTimedOut) and timeout_s is not None and timeout_s > failed[1]


def _build(source: tuple[str, str], vocabulary: Vocabulary, timeout_s: float, cancelled) -> TokenAutomaton:
    """Compiles in the child, then keeps only the states from which the text can still be ended."""
    initial, sources, tokens, targets, accepting = _in_child(source, vocabulary, timeout_s, cancelled)
    live = _reaching(accepting, sources, targets)
    if initial not in live:
        raise InvalidOption("the vocabulary cannot write any text that matches the constraint")
    kept = np.isin(targets, np.fromiter(live, dtype=np.int64))
    return TokenAutomaton.from_transitions(initial, sources[kept], tokens[kept], targets[kept], accepting,
                                           vocabulary.size)


def is_compiled(source: tuple[str, str], vocabulary: Vocabulary, timeout_s: float | None = None) -> bool:
    """Whether binding `source` to `vocabulary` (with `timeout_s`) takes no compiling: compiled, or known
    to fail (a timeout is not known to fail with a longer timeout: `compile_regex` tries again)."""
    key = (source, vocabulary.fingerprint)
    with _cache_lock:
        if key in _cache:
            return True
        failed = _failures.get(key)
    return failed is not None and not _retried(failed, timeout_s)


def _reaching(accepting, sources: np.ndarray, targets: np.ndarray) -> set[int]:
    """The states from which an accepting state can be reached (on the graph of states, tokens merged)."""
    labels, numbered = renumber(np.concatenate([sources, targets, np.asarray(accepting, dtype=np.int64)]))
    n, count = len(sources), len(labels)
    edges = np.unique(numbered[n : 2 * n] * count + numbered[:n])  # target * count + source, each pair once
    into: dict[int, list[int]] = {}
    for target, source in zip(*np.divmod(edges, count)):
        into.setdefault(int(target), []).append(int(source))
    start = numbered[2 * n :].tolist()
    live, frontier = set(start), list(start)
    while frontier:
        for source in into.get(frontier.pop(), ()):
            if source not in live:
                live.add(source)
                frontier.append(source)
    return set(labels[sorted(live)].tolist())


def _in_child(source: tuple[str, str], vocabulary: Vocabulary, timeout_s: float, cancelled=_never):
    """Runs `_compile_child` in a forked child and returns what it sent; waits `timeout_s` at most, in
    polls of `POLL_S` between which it asks `cancelled`, and kills the child whatever ends the wait."""
    if cancelled():
        raise CompileCancelled("the compile was cancelled before it started")
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_compile_child, args=(source, vocabulary, timeout_s, sender), daemon=True)
    child.start()
    sender.close()
    deadline = time.monotonic() + timeout_s
    try:
        while not receiver.poll(max(0.0, min(POLL_S, deadline - time.monotonic()))):  # True at EOF too
            if cancelled():
                raise CompileCancelled("the compile was cancelled: no caller waits for it any more")
            if time.monotonic() >= deadline:
                raise CompileTimedOut(f"compiling the constraint took longer than compile_timeout_s = {timeout_s:g} s "
                                      f"(limit compile_timeout_s)")
        try:
            status, payload = receiver.recv()
        except EOFError:
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


def _compile_child(source: tuple[str, str], vocabulary: Vocabulary, timeout_s: float, sender) -> None:
    """Runs in the child: outlines-core's index of the pattern and the sentinel, sent back as arrays of the
    text tokens' transitions, and the states where the sentinel may come (where the pattern may end)."""
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
        sentinel, end = vocabulary.size, vocabulary.size + 1  # ids no token has
        tokens_by_bytes = vocabulary.text_tokens()
        tokens_by_bytes.setdefault(SENTINEL.encode(), []).append(sentinel)
        index = Index(f"(?:{pattern}){SENTINEL_REGEX}", OutlinesVocabulary(end, tokens_by_bytes))
        transitions = index.get_transitions()
        sources = np.fromiter((s for s, moves in transitions.items() for _ in moves), dtype=np.int64)
        tokens = np.fromiter((t for moves in transitions.values() for t in moves), dtype=np.int64)
        targets = np.fromiter((n for moves in transitions.values() for n in moves.values()), dtype=np.int64)
        # the sentinel is also an ordinary character where the pattern allows any (inside a JSON string):
        # only its transitions into a final state say "the pattern may end here"
        final = np.isin(targets, np.array(sorted(index.get_final_states()), dtype=np.int64))
        accepting = sorted(set(sources[(tokens == sentinel) & final].tolist()))
        text = (tokens < sentinel) & ~final
        sender.send(("ok", (index.get_initial_state(), sources[text], tokens[text], targets[text], accepting)))
    except MemoryError:
        sender.send(("error", f"compiling the constraint needed more than {COMPILE_MEMORY_BYTES >> 20} MiB "
                              f"(limit compile_memory)"))
    except Exception as error:  # outlines-core reports unusable patterns and vocabularies as plain exceptions
        message = str(error).replace(f"(?:{pattern}){SENTINEL_REGEX}", pattern)
        if "vocabulary provided is incompatible" in message:
            missing = message[message.find("missing tokens"):].split(". This")[0]
            message = f"the vocabulary cannot write any text that matches the constraint ({missing})"
        sender.send(("error", message))
    finally:
        sender.close()
        os._exit(0)


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
