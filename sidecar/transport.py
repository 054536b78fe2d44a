"""The byte-level edges of the server: a reader thread that turns the input fd into frames, and the one
writer of the output fd.

The reader only splits frames; everything else happens on the main thread, which is the single owner
of the output. The inbound queue is bounded, so a client that keeps writing while it stops reading
cannot grow the server's memory without bound.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

from protocol import FrameDecoder, ProtocolError, frame, pack

log = logging.getLogger("sidecar")

EOF_MARK = object()
READ_SIZE = 1 << 16
INBOX_FRAMES = 1024
FATAL_PROTOCOL_STATUS = 3  # exit status after a frame that breaks the stream (PROTOCOL.md)


class FrameReader:
    def __init__(self, fd: int, max_frame_bytes: int, *, exit_grace_s: float = 0.8):
        self.fd = fd
        self.decoder = FrameDecoder(max_frame_bytes)
        self.inbox: queue.Queue = queue.Queue(maxsize=INBOX_FRAMES)
        self.exit_grace_s = exit_grace_s
        self.thread = threading.Thread(target=self._run, name="frame-reader", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        status = 0
        try:
            while True:
                data = os.read(self.fd, READ_SIZE)
                if not data:
                    break
                for payload in self.decoder.feed(data):
                    self.inbox.put(payload)
        except ProtocolError as fatal:  # the stream cannot be resynchronised after a bad header
            self.inbox.put(fatal)
            status = FATAL_PROTOCOL_STATUS
        except OSError as error:
            log.info("input closed: %s", error)
        self.inbox.put(EOF_MARK)
        # The peer is gone (or the stream is broken): whatever the main thread is doing, stop soon,
        # with the status the main thread would have given.
        timer = threading.Timer(self.exit_grace_s, lambda: os._exit(status))
        timer.daemon = True
        timer.start()


class FrameWriter:
    """Writes whole frames with blocking writes: a peer that stops reading pauses the server.

    Frames sent with `urgent=False` (token events) may wait up to `coalesce_s` and go out together
    with later ones in one write. Each write wakes the reader, and on a small machine that costs the
    model a few percent of its speed. Order is always kept: an urgent frame flushes everything before it.
    """

    def __init__(self, fd: int, *, coalesce_s: float = 0.0):
        self.fd = fd
        self.coalesce_s = coalesce_s
        self._pending: list[bytes] = []
        self._since = 0.0

    def send(self, message: dict, *, urgent: bool = True) -> None:
        if not self._pending:
            self._since = time.monotonic()
        self._pending.append(self._encode(message))
        if urgent or time.monotonic() - self._since >= self.coalesce_s:
            self.flush()

    def _encode(self, message: dict) -> bytes:
        return frame(pack(message))

    def flush(self) -> None:
        if not self._pending:
            return
        view = memoryview(b"".join(self._pending))
        self._pending.clear()
        while view:
            view = view[os.write(self.fd, view) :]
