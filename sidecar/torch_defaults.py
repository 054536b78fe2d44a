"""Torch's default dtype is one for the whole process, and transformers changes it while it builds a model.

`from_pretrained` builds the model's modules with the default dtype set to the model's own (bf16 for most
real checkpoints, under `local_torch_dtype`), and sets it back after. A model loading on one thread while
another generates therefore gave that other thread's tensors made without a dtype (a beam's scores, a
model's own buffers made in its forward) the loading model's dtype: measured, the generating thread saw
bfloat16 as the default in the middle of its steps while the default model loaded in bf16 beside it.

`DEFAULTS` is the gate between them. Threads that run torch work hold it shared (`using`); that window of
transformers' is made to hold it alone (`changing`), so it waits for the work under way to reach a point
where it lets go, and the work waits for the window, which lasts as long as building the modules on the
meta device (well under a second for real models): the weights are read after it. A thread that changes
the defaults while it holds `using` itself does not wait for itself.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from transformers import modeling_utils


class Gate:
    """Shared use of torch's process-wide defaults, or their change by one thread alone (writers first:
    a change that waits lets no new use begin, so it waits only for the uses under way). Both nest on one
    thread: a composite model builds its parts with `from_config`, which enters transformers' window again."""

    def __init__(self):
        self._changed = threading.Condition()
        self._users: dict[int, int] = {}  # thread id -> uses it holds
        self._changer: int | None = None  # the thread that changes or waits to change the defaults
        self._changes = 0  # how deep its changes nest

    @contextmanager
    def using(self):
        me = threading.get_ident()
        with self._changed:
            while self._changer not in (None, me) and not self._users.get(me):
                self._changed.wait()
            self._users[me] = self._users.get(me, 0) + 1
        try:
            yield
        finally:
            with self._changed:
                self._users[me] -= 1
                if not self._users[me]:
                    del self._users[me]
                self._changed.notify_all()

    @contextmanager
    def changing(self):
        me = threading.get_ident()
        with self._changed:
            while self._changer not in (None, me):
                self._changed.wait()
            self._changer = me
            self._changes += 1
            while any(thread != me for thread in self._users):
                self._changed.wait()
        try:
            yield
        finally:
            with self._changed:
                self._changes -= 1
                if not self._changes:
                    self._changer = None
                self._changed.notify_all()


DEFAULTS = Gate()
_dtype_window = modeling_utils.local_torch_dtype


@contextmanager
def _gated_dtype_window(*args, **kwargs):
    with DEFAULTS.changing(), _dtype_window(*args, **kwargs):
        yield


modeling_utils.local_torch_dtype = _gated_dtype_window
