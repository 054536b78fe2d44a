"""Compiling a regular constraint into a `TokenAutomaton`, bounded in time and memory, and cached.

The compile itself (`build`) is polynomial for sane patterns but exponential for some
(`(a|b)*a(a|b){30}`), and it runs in native code that a thread cannot interrupt, so it runs in a child
forked from a process that holds no model (`forkserver`): the caller waits `timeout_s` at most, then
kills it, and the child's address space is capped so a pathological pattern fails instead of swapping
the machine. The child makes the automaton's tables too, within that cap, and writes them straight into
the caller's arrays: the caller never holds more than the tables themselves. Results, failures included,
are cached by (constraint, vocabulary fingerprint): every generation with the same constraint on the
same model shares one automaton.

A caller that may stop wanting the result passes `cancelled`, a callable the parent asks while it waits
(every `POLL_S`): once it answers True the child is killed and `CompileCancelled` raised. A stopped
compile says nothing about the constraint, so it is neither cached nor remembered as a failure.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import OrderedDict
from typing import Callable

from ..errors import InvalidOption, ProcessorError
from .automaton import TokenAutomaton
from .build import MasksTooLarge
from .forkserver import COMPILE_MEMORY_BYTES, POLL_S, ForkServer, receive_tables
from .lazy import LazyAutomaton
from .locks import ForkSafeLock
from .vocabulary import Vocabulary

DEFAULT_CACHE_BYTES = 512 * 2**20  # compiled automata kept for reuse, least recently used dropped first
MAX_FAILURES = 1024  # constraints remembered as impossible to compile

_cache_bytes = DEFAULT_CACHE_BYTES
_cache: OrderedDict[tuple, TokenAutomaton] = OrderedDict()
_failures: OrderedDict[tuple, tuple[InvalidOption, float]] = OrderedDict()  # (the error, the timeout it had)
_cache_lock = ForkSafeLock()
_forkserver = ForkServer()


class CompileTimedOut(InvalidOption):
    """Compiling took longer than its timeout: a longer one may succeed, so this failure is retried."""


class CompileCancelled(ProcessorError):
    """The caller's `cancelled` hook stopped the compile: nothing is known about the constraint."""


class ServerEnded(ProcessorError):
    """The fork server ended during the compile, and the child with it: nothing is known about the constraint."""

    def __init__(self, message: str, deadline: float = 0.0):
        super().__init__(message)
        self.deadline = deadline  # the compile's, on the monotonic clock


def compile_regex(source: tuple[str, str], vocabulary: Vocabulary, timeout_s: float,
                  cancelled: Callable[[], bool] | None = None) -> TokenAutomaton:
    """The automaton of `source` over `vocabulary`, from the cache or compiled now. `source` is
    ("regex", pattern) or ("json_schema", schema text): a schema becomes its regex in the child too,
    because that regex can grow exponentially with the schema (4x per level of nested arrays).

    Raises `InvalidOption` when the vocabulary cannot write any match, when compiling takes longer than
    `timeout_s` or more memory than `COMPILE_MEMORY_BYTES`. A failure is remembered like a success, so
    asking again costs nothing (unless with a longer timeout, after a timeout). Raises `CompileCancelled`
    (remembering nothing) when `cancelled()` turns True before the compile is done: its child is killed
    within `POLL_S`; and `ServerEnded` or another `ProcessorError` (remembering nothing either) when the
    fork server ended twice during the compile or cannot be started.
    """
    key = (source, vocabulary.fingerprint)
    with _cache_lock:
        found = _cache.get(key)
        if found is not None:  # its tables may have grown since it was stored (lazily made masks), others' too
            _cache.move_to_end(key)
            _within_budget()
        failed = _failures.get(key)
    if found is not None:
        return found
    if failed is not None and not _retried(failed, timeout_s):
        error, tried = failed
        if isinstance(error, CompileTimedOut):  # named with this call's limit, which may be shorter
            raise _timed_out(timeout_s, tried)
        raise type(error)(str(error))  # of its kind: a schema's MasksTooLarge has it run by llguidance
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


def set_cache_bytes(cache_bytes: int) -> None:
    """Sets how much the compile cache of the whole process keeps; 512 MiB unless set."""
    if not isinstance(cache_bytes, int) or isinstance(cache_bytes, bool) or cache_bytes < 0:
        raise ValueError(f"the compile cache's size is a number of bytes >= 0, got {cache_bytes!r}")
    global _cache_bytes
    with _cache_lock:
        _cache_bytes = cache_bytes
        _within_budget()


def cache_bytes() -> int:
    return _cache_bytes


def cached() -> tuple[int, int]:
    """The automata the compile cache keeps, and their bytes (tables, and the masks made so far), weighed
    again first: lazily made masks grow between compiles."""
    with _cache_lock:
        _within_budget()
        return len(_cache), sum(a.nbytes for a in _cache.values())


def is_cached(automaton) -> bool:
    """Whether the cache keeps `automaton` (so that it stays in memory whether or not a generation uses it)."""
    with _cache_lock:
        return any(kept is automaton for kept in _cache.values())


def forget(fingerprint: str) -> None:
    """Drops what was compiled, or found impossible to compile, over the vocabulary of `fingerprint`."""
    with _cache_lock:
        for table in (_cache, _failures):
            for key in [key for key in table if key[1] == fingerprint]:
                del table[key]


def _store(key: tuple, automaton: TokenAutomaton) -> None:
    """Caches an automaton as the most recently used, within `cache_bytes()` (the least recently used go)."""
    with _cache_lock:
        _cache[key] = automaton
        _cache.move_to_end(key)
        _within_budget()


def _within_budget() -> None:
    """Drops the least recently used automata until the rest hold `cache_bytes()` at most (the last used
    stays): at each compile and each use, since a lazily compiled automaton grows as generations reach
    its states. One dropped stays alive while generations use it; later ones compile it again."""
    while sum(a.nbytes for a in _cache.values()) > _cache_bytes and len(_cache) > 1:
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
    """Compiles in a child, which sends the automaton's tables whole; once more, within what is left of
    `timeout_s`, if the fork server ended meanwhile (killed from outside, or by another caller that gave
    up in the middle of a request), which says nothing about the constraint. A second such end, or a
    timeout of the shortened second run, is a `ServerEnded`, never remembered."""
    try:
        return _automaton(_in_child(source, vocabulary, timeout_s, cancelled), vocabulary)
    except ServerEnded as ended:
        deadline = ended.deadline  # the new server's start counts against it too
    try:
        return _automaton(_in_child(source, vocabulary, timeout_s, cancelled, deadline), vocabulary)
    except CompileTimedOut:
        raise ServerEnded(f"the compile server ended during the compile, and the compile run again did not end in "
                          f"what was left of compile_timeout_s = {timeout_s:g} s") from None


def _automaton(made: dict, vocabulary: Vocabulary) -> TokenAutomaton | LazyAutomaton:
    """The automaton over the tables a child made: a byte automaton whose token masks are made as
    generation reaches its states (`build.byte_tables`), or every state's compiled ahead."""
    if "byte_table" in made:
        return LazyAutomaton(vocabulary=vocabulary, **made)
    return TokenAutomaton.from_tables(**made)


def masks_too_large(source: tuple[str, str], vocabulary: Vocabulary) -> bool:
    """Whether compiling `source` over `vocabulary` was found to raise `MasksTooLarge`."""
    with _cache_lock:
        failed = _failures.get((source, vocabulary.fingerprint))
    return failed is not None and isinstance(failed[0], MasksTooLarge)


def is_compiled(source: tuple[str, str], vocabulary: Vocabulary, timeout_s: float | None = None) -> bool:
    """Whether binding `source` to `vocabulary` (with `timeout_s`) takes no compiling: compiled, or known
    to fail (a timeout is not known to fail with a longer timeout: `compile_regex` tries again)."""
    key = (source, vocabulary.fingerprint)
    with _cache_lock:
        if key in _cache:
            return True
        failed = _failures.get(key)
    return failed is not None and not _retried(failed, timeout_s)


def _in_child(source: tuple[str, str], vocabulary: Vocabulary, timeout_s: float, cancelled, deadline: float | None = None):
    """Has the fork server start a compiling child and returns what it sent; waits until `deadline` (on the
    monotonic clock; by default `timeout_s` after the fork) at most, in polls of `POLL_S` between which it
    asks `cancelled`. A child that sent all
    it sends, or ended, exits on its own and the server reaps it; one that did not is killed. Raises
    `ServerEnded` when the child ended because its server did."""
    if cancelled():
        raise CompileCancelled("the compile was cancelled before it started")

    def check():
        if cancelled():
            raise CompileCancelled("the compile was cancelled: no caller waits for it any more")

    receiver, sender = multiprocessing.Pipe(duplex=False)
    try:
        child = _forkserver.fork(source, vocabulary, timeout_s, sender.fileno(), check)
    except BaseException:
        receiver.close()
        raise
    finally:
        sender.close()
    if deadline is None:
        deadline = time.monotonic() + timeout_s
    ended = False  # whether the child was seen closing the pipe
    try:
        while not receiver.poll(max(0.0, min(POLL_S, deadline - time.monotonic()))):  # True at EOF too
            check()
            if time.monotonic() >= deadline:
                raise _timed_out(timeout_s, timeout_s)
        try:
            status, payload = receiver.recv()
            if status == "ok":
                payload = receive_tables(receiver, payload, deadline)
        except TimeoutError:
            raise _timed_out(timeout_s, timeout_s) from None
        except (EOFError, OSError):  # the child ended, or ended mid-message
            ended = True
            if child.server_ended():
                raise ServerEnded("the compile server ended during the compile", deadline) from None
            raise InvalidOption(f"compiling the constraint needed more than {COMPILE_MEMORY_BYTES >> 20} MiB "
                                f"(limit compile_memory) or crashed") from None
        ended = True  # all it sends is out: it exits
    finally:
        if not ended:
            child.kill()
        receiver.close()
    if status == "error":
        raise InvalidOption(payload)
    if status == "masks_too_large":
        raise MasksTooLarge(payload)
    return payload
