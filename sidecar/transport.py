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

from protocol import FrameDecoder, ProtocolError, frame, pack

log = logging.getLogger("sidecar")

EOF_MARK = object()
READ_SIZE = 1 << 16
INBOX_FRAMES = 1024


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
        try:
            while True:
                data = os.read(self.fd, READ_SIZE)
                if not data:
                    break
                for payload in self.decoder.feed(data):
                    self.inbox.put(payload)
        except ProtocolError as fatal:  # the stream cannot be resynchronised after a bad header
            self.inbox.put(fatal)
        except OSError as error:
            log.info("input closed: %s", error)
        self.inbox.put(EOF_MARK)
        # The peer is gone (or the stream is broken): whatever the main thread is doing, stop soon.
        timer = threading.Timer(self.exit_grace_s, lambda: os._exit(0))
        timer.daemon = True
        timer.start()


class FrameWriter:
    """Writes whole frames with blocking writes: a peer that stops reading pauses the server."""

    def __init__(self, fd: int):
        self.fd = fd

    def send(self, message: dict) -> None:
        view = memoryview(frame(pack(message)))
        while view:
            written = os.write(self.fd, view)
            view = view[written:]
