"""A blocking client for any server that speaks this protocol: a child process over its stdin/stdout,
or a server already running at the other end of a pair of byte streams (`Peer.over`).

Used by the conformance runner, the tests and the benchmarks. Replies are matched by id; events and
replies for other ids that arrive meanwhile are kept for whoever asks for them.
"""

from __future__ import annotations

import subprocess
from collections import defaultdict, deque
from typing import BinaryIO

from .codec import pack, unpack
from .framing import HEADER, frame


class Peer:
    def __init__(self, command: list[str], *, env: dict | None = None, stderr=None, cwd=None):
        self.process: subprocess.Popen | None = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=cwd, bufsize=0
        )
        self._attach(self.process.stdin, self.process.stdout)

    @classmethod
    def over(cls, to_server: BinaryIO, from_server: BinaryIO) -> "Peer":
        """A client of a server that runs elsewhere: there is no process to wait for, only streams to close."""
        peer = cls.__new__(cls)
        peer.process = None
        peer._attach(to_server, from_server)
        return peer

    def _attach(self, to_server: BinaryIO, from_server: BinaryIO) -> None:
        self.to_server, self.from_server = to_server, from_server
        self._messages: dict[object, deque] = defaultdict(deque)
        self._next_id = 1
        self.replied: list = []  # ids of final replies, in the order they arrived

    def next_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def send_bytes(self, data: bytes) -> None:
        self.to_server.write(data)

    def send(self, message) -> None:
        self.send_bytes(frame(pack(message)))

    def read_message(self):
        header = self._read_exactly(HEADER.size)
        (length,) = HEADER.unpack(header)
        return unpack(self._read_exactly(length))

    def _read_exactly(self, n: int) -> bytes:
        chunks, missing = [], n
        while missing:
            chunk = self.from_server.read(missing)
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
        """All events for `request_id`, then its final reply (whatever message is not an event: a broken
        server's may not even be a map)."""
        events = []
        while True:
            message = self.next_for(request_id)
            if isinstance(message, dict) and "event" in message:
                events.append(message)
            else:
                return events, message

    def call(self, op: str, **params) -> dict:
        rid = self.next_id()
        self.send({"id": rid, "op": op, **params})
        return self.reply_for(rid)[1]

    def close(self, timeout: float = 10) -> int | None:
        """Ends the input (EOF) and returns the child's exit status; None for a server that is not our child."""
        if not self.to_server.closed:
            self.to_server.close()
        try:
            return self.process.wait(timeout) if self.process else None
        finally:
            self.from_server.close()

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc) -> None:
        if self.process is None:
            self.close()
        elif self.process.poll() is None:
            try:
                self.close()
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
