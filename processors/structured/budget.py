"""The memory of the compiled constraints that bound processors hold, all of them together, bounded.

A constraint's tables and masks take far more than its request: a `dfa` of 339 transitions (2.5 KB on the
wire) binds 339 mask rows of the vocabulary, 1.8 MB over 1,024 tokens and 55 MB over 32,000; one generate
may carry 64 of them, and a client may keep hundreds of generates running. Each compile is bounded
(`build.MAX_MASK_BYTES`, `build.MAX_TABLE_BYTES`), and so are the automata the compile cache keeps, but
not the automata that running generations hold. So binding a constraint counts its automaton (tables and
bound masks, `reserved_bytes`) while the processor bound to it lives, each automaton once however many processors
share it (every generation with the same schema shares one), and refuses the binding that would take the
total past the budget: the caller gets `ConstraintBudgetExceeded` before its generation starts.

The check comes after the automaton is compiled and its masks are bound, since only then are its bytes
known: a refused binding has allocated one automaton (at most the compile's own bounds) and drops it. The
masks of a lazily compiled automaton grow by one row for each new state a generation reaches: they are
counted at what they may grow to, a row for every state (`reserved_bytes`), as the KV budget reserves a
generation's tokens to its end.
"""

from __future__ import annotations

import gc
import weakref
from collections import deque

from ..errors import OverLimit
from .locks import ForkSafeLock

DEFAULT_BUDGET_BYTES = 2 * 2**30

_budget_bytes = DEFAULT_BUDGET_BYTES
# id(automaton) -> [a weak reference to it, the live processors bound to it]. A processor's release is only
# queued (`_released`), and read under the lock by the next call: it runs whenever the processor is freed,
# which may be inside a collection that an allocation here started, with the lock held.
_held: dict[int, list] = {}
_released: deque[int] = deque()
_lock = ForkSafeLock()


class ConstraintBudgetExceeded(OverLimit):
    """Binding a constraint would take the memory of the constraints bound at once past the budget."""

    limit = "constraint_budget_bytes"


def set_budget_bytes(budget_bytes: int) -> None:
    """Sets the budget of the whole process (every engine and model in it); 2 GiB unless set."""
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 0:
        raise ValueError(f"the constraint budget is a number of bytes >= 0, got {budget_bytes!r}")
    global _budget_bytes
    _budget_bytes = budget_bytes


def budget_bytes() -> int:
    return _budget_bytes


def held_bytes() -> int:
    """The bytes of the automata bound processors hold now, each counted once."""
    with _lock:
        _drain()
        return _total()


def hold(processor, automaton, new_bytes: int) -> None:
    """Counts `automaton` while `processor` lives, or raises `ConstraintBudgetExceeded` when binding it made
    `new_bytes` (its tables and masks, or only masks when the compile cache kept it already) and the
    automata held would then pass the budget. Binding that made nothing (a cached automaton, whatever it
    has grown to) is never refused: refusing would free nothing. Processors dropped but not yet collected
    (in a reference cycle) are collected once before refusing."""
    for collected in (False, True):
        if collected:
            gc.collect()
        with _lock:
            _drain()
            entry = _held.get(id(automaton))
            held = _total()
            after = held + (0 if entry is not None else automaton.reserved_bytes)
            if new_bytes <= 0 or after <= _budget_bytes:
                if entry is not None:
                    entry[1] += 1
                else:
                    _held[id(automaton)] = [weakref.ref(automaton), 1]
                break
    else:
        others = (f", and the constraints bound now (running generations', and this chain's before it) hold "
                  f"{held:,}: together more than the budget of {_budget_bytes:,} bytes (constraint_budget_bytes); it "
                  f"may fit once generations finish" if held else
                  f", more than the budget of {_budget_bytes:,} bytes (constraint_budget_bytes) on its own")
        raise ConstraintBudgetExceeded(
            f"binding this constraint needs {after - held:,} bytes of tables and masks{others}", value=after,
            maximum=_budget_bytes)
    weakref.finalize(processor, _released.append, id(automaton))


def _drain() -> None:
    """Takes the queued releases into account (under the lock). A processor's release is queued before the
    automaton it referenced can be freed, so an automaton made since, at the same address, finds none of
    its predecessor's count left."""
    while _released:
        key = _released.popleft()
        entry = _held[key]
        entry[1] -= 1
        if not entry[1]:
            del _held[key]


def _total() -> int:
    return sum(automaton.reserved_bytes for automaton in (ref() for ref, _ in _held.values()) if automaton is not None)
