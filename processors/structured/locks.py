"""A lock that a process forked from this one gets new.

A thread of the parent may hold a lock at the moment another thread forks (the server's compile threads
build tries, tokenizers and parsers under locks): the child inherits the lock held, by a thread it does
not have, and would wait for it for ever. Python's own `threading.Lock` is copied as it is.
"""

from __future__ import annotations

import os
import threading


class ForkSafeLock:
    """A `threading.Lock` (acquire, release, `with`) that a forked child finds released."""

    def __init__(self):
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        self._lock = threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc) -> None:
        self._lock.release()
