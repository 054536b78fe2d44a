"""A blocking client for any server that speaks this protocol over a child process's stdin/stdout.

Used by the conformance runner, the tests and the benchmarks. Replies are matched by id; events and
replies for other ids that arrive meanwhile are kept for whoever asks for them.
"""

from __future__ import annotations

import subprocess
from collections import defaultdict, deque

from .codec import pack, unpack
from .framing import HEADER, frame


class Peer:
    def __init__(self, command: list[str], *, env: dict | None = None, stderr=None, cwd=None):
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=cwd, bufsize=0
        )
        self._messages: dict[object, deque] = defaultdict(deque)
        self._next_id = 1
        self.replied: list = []  # ids of final replies, in the order they arrived

    def next_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def send_bytes(self, data: bytes) -> None:
        self.process.stdin.write(data)

    def send(self, message) -> None:
        self.send_bytes(frame(pack(message)))

    def read_message(self):
        header = self._read_exactly(HEADER.size)
        (length,) = HEADER.unpack(header)
        return unpack(self._read_exactly(length))

    def _read_exactly(self, n: int) -> bytes:
        chunks, missing = [], n
        while missing:
            chunk = self.process.stdout.read(missing)
            if not chunk:
                raise EOFError(f"the server closed its output ({n - missing} of {n} bytes read)")
            chunks.append(chunk)
            missing -= len(chunk)
        return b"".join(chunks)

    def next_for(self, request_id):
        """The next message (event or reply) for `request_id`, reading and keeping others meanwhile."""
        while not self._messages[request_id]:
            message = self.read_message()
            rid = message.get("id") if isinstance(message, dict) else None
            if not (isinstance(message, dict) and "event" in message):
                self.replied.append(rid)
            self._messages[rid].append(message)
        return self._messages[request_id].popleft()

    def reply_for(self, request_id) -> tuple[list, dict]:
        """All events for `request_id`, then its final reply."""
        events = []
        while True:
            message = self.next_for(request_id)
            if "event" in message:
                events.append(message)
            else:
                return events, message

    def call(self, op: str, **params) -> dict:
        rid = self.next_id()
        self.send({"id": rid, "op": op, **params})
        return self.reply_for(rid)[1]

    def close(self, timeout: float = 10) -> int:
        if self.process.stdin and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            return self.process.wait(timeout)
        finally:
            if self.process.stdout:
                self.process.stdout.close()

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            try:
                self.close()
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
