"""The real server with the model call stubbed out, for measuring the protocol path alone.

    python bench/stub_server.py [--json-lines] [sidecar options...]

The scheduler's forward passes return fixed logits instantly (the argmax is token 5, every step), and the
context limit is lifted, so a streamed generation exercises only the decode loop's bookkeeping,
the server and the transport. --json-lines swaps the {packet, 4} + msgpack transport for one JSON
object per line: the baseline people write by hand.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import sidecar.__main__ as cli  # noqa: E402
import sidecar.scheduler as scheduler_module  # noqa: E402
import sidecar.server as server_module  # noqa: E402
from sidecar.engine import Engine  # noqa: E402
from sidecar.transport import FrameWriter, Inbox  # noqa: E402

LOGITS = torch.zeros(1, 1024)
LOGITS[0, 5] = 1.0


def stub_forward(model, token_ids, positions, plan, keep):
    """The scheduler's forward pass, without the model: fixed logits for every position asked for."""
    return LOGITS.expand(len(keep), -1).clone()


scheduler_module.forward = stub_forward
_load = Engine.load.__func__


def load_without_context_limit(cls, *args, **kwargs):
    engine = _load(cls, *args, **kwargs)
    engine.max_context = None
    return engine


Engine.load = classmethod(load_without_context_limit)


class JsonLinesReader:
    def __init__(self, fd: int, max_frame_bytes: int, closed):
        self.fd = fd
        self.closed = closed
        self.inbox = Inbox()

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        with os.fdopen(self.fd, "rb", buffering=1 << 16) as stream:
            for line in stream:
                self.inbox.put(line, len(line), lambda: False)
        self.closed.set()
        self.inbox.close()


class JsonLinesWriter(FrameWriter):
    """The same writer, coalescing included; only the encoding differs."""

    def _encode(self, message: dict) -> bytes:
        return (json.dumps(message) + "\n").encode()


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--json-lines" in args:
        args.remove("--json-lines")
        server_module.unpack = json.loads
        import sidecar.transport as transport

        transport.FrameReader, transport.FrameWriter = JsonLinesReader, JsonLinesWriter
    status = cli.main(args)
    sys.stderr.flush()
    os._exit(status)
