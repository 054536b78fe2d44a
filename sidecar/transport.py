"""The byte-level edges of the server: a reader thread that turns the input fd into frames, and the one
writer of the output fd.

The reader only splits frames; everything else happens on the main thread, which is the single owner
of the output. The inbox between them is bounded in bytes, so a client that keeps writing while it
stops reading cannot grow the server's memory without bound.

End of file on the input means the client is gone, and the process must be gone soon after (PROTOCOL.md:
within 500 ms). The reader notices it even when the inbox is full (by polling for a hang-up); the
main thread notices between steps and drops the frames still waiting; the writer starts no frame
after it and gives up waiting on a client that no longer reads; and a watchdog ends the process if
the main thread is stuck in a long forward pass.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import threading
import time
from collections import deque

from protocol import FrameDecoder, error, frame, pack
from protocol import errors as codes

log = logging.getLogger("sidecar")

EOF_MARK = object()
READ_SIZE = 1 << 16
INBOX_BYTES = 64 * 1024 * 1024  # frames read ahead of the main thread, at most (one larger frame still fits alone)
FRAME_COST = 128  # the memory of a frame beyond its bytes: its bytes object, its place in the inbox (measured 116)
EXIT_GRACE_S = 0.3  # after EOF, how long the main thread has to finish before the watchdog exits
HANGUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)


class Hangup(Exception):
    """The input reached EOF while the writer was about to write or waiting to: the client is gone."""


class OutputFailed(Exception):
    """The output cannot be written (a full disk, an I/O error): no reply can reach the client any more, so
    the server stops as when it is gone, but says why and exits with an error."""


# What stops the server because no reply can reach its client: not the failure of the request being handled.
UNREACHABLE = (ConnectionError, Hangup, OutputFailed)


class InputClosed:
    """Set by the reader at EOF. Its fd becomes readable then, so a writer can wait on both at once."""

    def __init__(self):
        self._read, self._write = os.pipe()
        self.at: float | None = None

    def set(self) -> None:
        self.at = time.monotonic()
        os.write(self._write, b"x")

    def fileno(self) -> int:
        return self._read


class Inbox:
    """What the main thread has yet to handle: frames read, bounded in bytes so that a client that keeps
    writing while it stops reading cannot grow the server's memory, and notices from the server's own
    threads (a compile or a load is over), which never wait for room. Notices come first. Frames can be
    left where they are while a `load_model` runs (`frames=False`), since the protocol answers it before the
    frames sent after it are read. Once closed (the client is gone), `get` returns `EOF_MARK` at once:
    frames still waiting belong to nobody."""

    def __init__(self, max_bytes: int = INBOX_BYTES):
        self._frames: deque = deque()
        self._notices: deque = deque()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._changed = threading.Condition()
        self._closed = False

    def put(self, item, size: int, hung_up) -> bool:
        """Adds a frame; waits for room; gives up (False) if `hung_up()` says the client went away meanwhile."""
        with self._changed:
            while self._frames and self._bytes + size > self._max_bytes:
                if not self._changed.wait(0.05) and hung_up():
                    return False
            self._frames.append((item, size))
            self._bytes += size
            self._changed.notify_all()
        return True

    def notify(self, notice) -> None:
        with self._changed:
            self._notices.append(notice)
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait(self, frames: bool = True) -> None:
        """Returns once `get(frames=frames)` has something to return."""
        with self._changed:
            while not (self._closed or self._notices or (frames and self._frames)):
                self._changed.wait()

    def get(self, frames: bool = True):
        """The next notice, else the next frame (none with `frames=False`), `EOF_MARK` once closed; raises
        `queue.Empty` when there is none."""
        with self._changed:
            if self._closed:
                return EOF_MARK
            if self._notices:
                return self._notices.popleft()
            if not frames or not self._frames:
                raise queue.Empty
            item, size = self._frames.popleft()
            self._bytes -= size
            self._changed.notify_all()
            return item


class FrameReader:
    def __init__(self, fd: int, max_frame_bytes: int, closed: InputClosed):
        self.fd = fd
        self.decoder = FrameDecoder(max_frame_bytes)
        self.inbox = Inbox()
        self.closed = closed
        self.thread = threading.Thread(target=self._run, name="frame-reader", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _hung_up(self) -> bool:
        """Whether the client closed its end, even if frames it sent are still unread."""
        poller = select.poll()
        poller.register(self.fd, HANGUP)
        return any(events & HANGUP for _, events in poller.poll(0))

    def _run(self) -> None:
        try:
            while True:
                try:
                    data = os.read(self.fd, READ_SIZE)
                except BlockingIOError:  # one socket for both ways: the writer made it non-blocking
                    select.select([self.fd], [], [])
                    continue
                if not data:
                    break
                if not all(self.inbox.put(item, _size(item), self._hung_up) for item in self.decoder.feed(data)):
                    break
        except OSError as error:
            log.info("input closed: %s", error)
        self.closed.set()
        self.inbox.close()
        # The peer is gone: whatever the main thread is doing, the process ends soon.
        timer = threading.Timer(EXIT_GRACE_S, lambda: os._exit(0))
        timer.daemon = True
        timer.start()


def _size(item) -> int:
    """What a frame waiting in the inbox holds: its bytes and `FRAME_COST`. Counted by its bytes alone, empty
    frames from a client that never read filled 2 GiB (45 MiB/s) without ever filling the inbox."""
    return FRAME_COST + (len(item) if isinstance(item, bytes) else len(item.head))


class FrameWriter:
    """Writes whole frames: a peer that stops reading pauses the server (backpressure).

    Frames sent with `urgent=False` (token events) may wait up to `coalesce_s` and go out together
    with later ones in one write. Each write wakes the reader, and on a small machine that costs the
    model a few percent of its speed. Order is always kept: an urgent frame flushes everything before it.

    The fd is non-blocking and the writer waits with poll, on it and on `closed`: once the input is
    closed, no new write starts, and one already begun is given until the exit grace to complete.
    A reply larger than `max_frame_bytes` is replaced by a `limit_exceeded` error for the same request.
    Events cannot be that large: a token's piece holds at most a few characters plus a held-back stop
    tail (at most max_stop_bytes), and the frame limit is at least 64 KiB.
    """

    def __init__(self, fd: int, *, max_frame_bytes: int, closed: InputClosed, coalesce_s: float = 0.0):
        self.fd = fd
        self.max_frame_bytes = max_frame_bytes
        self.closed = closed
        self.coalesce_s = coalesce_s
        self._pending: list[bytes] = []
        self._since = 0.0
        os.set_blocking(fd, False)
        self._poll = select.poll()  # the output, and the input's closing
        self._poll.register(fd, select.POLLOUT)
        self._poll.register(closed.fileno(), select.POLLIN)
        self._poll_output = select.poll()  # the output alone, once the input is known to be closed
        self._poll_output.register(fd, select.POLLOUT)

    def send(self, message: dict, *, urgent: bool = True) -> None:
        if not self._pending:
            self._since = time.monotonic()
        self._pending.append(self._encode(message))
        if urgent or time.monotonic() - self._since >= self.coalesce_s:
            self.flush()

    def _encode(self, message: dict) -> bytes:
        payload = pack(message)
        if len(payload) > self.max_frame_bytes and "ok" in message:
            payload = pack(oversized_reply(message, len(payload), self.max_frame_bytes))
        return frame(payload)

    def flush(self) -> None:
        if not self._pending:
            return
        if self.closed.at is not None:
            raise Hangup()
        view = memoryview(b"".join(self._pending))
        self._pending.clear()
        started = False
        while view:
            try:
                written = os.write(self.fd, view)
            except BlockingIOError:
                written = 0
            except ConnectionError:  # a closed pipe, a reset socket: the client is gone
                raise
            except OSError as problem:
                raise OutputFailed(problem.strerror or str(problem)) from None
            view = view[written:]
            started = started or written > 0
            if view:
                self._wait(started)

    def _wait(self, started: bool) -> None:
        """Waits until the fd takes more bytes; raises `Hangup` if the client is gone."""
        while self.closed.at is None:
            if any(fd == self.fd for fd, _ in self._poll.poll()):
                return
        left = self.closed.at + EXIT_GRACE_S - time.monotonic()
        if not started or left <= 0 or not self._poll_output.poll(left * 1000):
            raise Hangup()


def oversized_reply(message: dict, size: int, limit: int) -> dict:
    """What goes out instead of a reply that would not fit in a frame."""
    return error(message.get("id"), codes.LIMIT_EXCEEDED, f"the reply would be {size} bytes, over the limit max_frame_bytes = {limit}",
                 limit="max_frame_bytes", max=limit, value=size)
