"""Compiling a regular constraint into a `TokenAutomaton`, bounded in time and memory, and cached.

outlines-core turns a regex and a vocabulary into a token-level automaton. Its regex engine follows
leftmost-first semantics: once an earlier alternative has matched, later ones are dropped, so on its own
`(no|none)` would never let "none" through, and `([0-9]|1[0-9]{2})` would stop after one digit. We
compile `(?:pattern)` followed by a sentinel character instead, so that no match happens inside the
pattern, and read "may end here" as "the sentinel may come next"; then every state from which no
accepting state can be reached is cut (the half-written sentinel among them). The result is the pattern's
language, as Python's `re.fullmatch` defines it.

That work is polynomial for
sane patterns but exponential for some (`(a|b)*a(a|b){30}`), and it runs in native code that a thread
cannot interrupt, so it runs in a forked child: the parent waits `timeout_s` at most, then kills it, and
the child's address space is capped so a pathological pattern fails instead of swapping the machine.
Results are cached by (pattern, vocabulary fingerprint): every generation with the same constraint on the
same model shares one automaton.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import resource
import threading
from collections import OrderedDict

import numpy as np
from outlines_core import Index, Vocabulary as OutlinesVocabulary

from ..errors import InvalidOption
from .automaton import TokenAutomaton, renumber
from .vocabulary import Vocabulary

COMPILE_MEMORY_BYTES = 2 * 2**30  # what the compiling child may allocate beyond what it inherits
CACHE_BYTES = 512 * 2**20  # compiled automata kept for reuse, least recently used dropped first

SENTINEL, SENTINEL_REGEX = "\U0010FFFF", r"\x{10FFFF}"  # a noncharacter: no real text ends with it

_cache: OrderedDict[tuple, TokenAutomaton] = OrderedDict()
_cache_lock = threading.Lock()


def compile_regex(pattern: str, vocabulary: Vocabulary, timeout_s: float) -> TokenAutomaton:
    """The automaton of `pattern` over `vocabulary`, from the cache or compiled now.

    Raises `InvalidOption` when the vocabulary cannot write any match, when compiling takes longer than
    `timeout_s` or more memory than `COMPILE_MEMORY_BYTES`.
    """
    key = (pattern, vocabulary.fingerprint)
    with _cache_lock:
        found = _cache.get(key)
        if found is not None:
            _cache.move_to_end(key)
            return found
    initial, sources, tokens, targets, accepting = _in_child(pattern, vocabulary, timeout_s)
    live = _reaching(accepting, sources, targets)
    if initial not in live:
        raise InvalidOption("the vocabulary cannot write any text that matches the constraint")
    kept = np.isin(targets, np.fromiter(live, dtype=np.int64))
    automaton = TokenAutomaton.from_transitions(initial, sources[kept], tokens[kept], targets[kept], accepting,
                                                vocabulary.size)
    with _cache_lock:
        _cache[key] = automaton
        while sum(a.nbytes for a in _cache.values()) > CACHE_BYTES and len(_cache) > 1:
            _cache.popitem(last=False)
    return automaton


def is_compiled(pattern: str, vocabulary: Vocabulary) -> bool:
    with _cache_lock:
        return (pattern, vocabulary.fingerprint) in _cache


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


def _in_child(pattern: str, vocabulary: Vocabulary, timeout_s: float):
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_compile_child, args=(pattern, vocabulary, timeout_s, sender), daemon=True)
    child.start()
    sender.close()
    try:
        if not receiver.poll(timeout_s):
            raise InvalidOption(f"compiling the constraint took longer than compile_timeout_s = {timeout_s:g} s "
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


def _compile_child(pattern: str, vocabulary: Vocabulary, timeout_s: float, sender) -> None:
    """Runs in the child: outlines-core's index of the pattern and the sentinel, sent back as arrays of the
    text tokens' transitions, and the states where the sentinel may come (where the pattern may end)."""
    try:
        _cap_memory(COMPILE_MEMORY_BYTES)
        # the parent kills it after `timeout_s`; if the parent is gone first, the kernel does
        resource.setrlimit(resource.RLIMIT_CPU, (math.ceil(timeout_s) + 1, math.ceil(timeout_s) + 2))
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


def _cap_memory(extra: int) -> None:
    try:
        with open("/proc/self/statm") as statm:
            current = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: no cap, the timeout still holds
        return
    resource.setrlimit(resource.RLIMIT_AS, (current + extra, current + extra))
