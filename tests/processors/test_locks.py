"""`ForkSafeLock`: a child forked while a thread of its parent holds the lock finds it released."""

import os

from processors.structured.locks import ForkSafeLock


def test_a_child_forked_while_the_lock_is_held_can_take_it():
    lock = ForkSafeLock()
    with lock:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if lock.acquire(timeout=5) else 1)  # a threading.Lock copied held would time out
        _, status = os.waitpid(pid, 0)
        assert not lock.acquire(blocking=False)  # the parent's is still held, by the parent
    assert os.waitstatus_to_exitcode(status) == 0
    assert lock.acquire(blocking=False)
    lock.release()
