"""The process every compiling child is forked from: started once, holding no torch and no model.

A compile runs in a child of its own (`compile`): outlines-core's work is native code that a thread
cannot interrupt, so a pathological pattern is killed at its timeout, and the child is capped in memory.
Forking the process that holds the model for that copied its page tables at every compile, ~20 ms per
GiB it held (measured: a 1k-token schema took 132-164 ms to compile beside nothing, 211-231 ms beside
4 GiB), and a fork of a process running torch's threads inherits any lock one of them held then. So the
first compile starts this server: a fresh interpreter that imports numpy, outlines-core and `build`,
never the packages' `__init__` (0.16 s and 28 MB here, against 2.2 s and 224 MB for torch alone). Each
compile is a child forked from it, which writes its tables straight into the caller's pipe.

The caller sends each request with the pipe's write end over a Unix socket; the server forks and answers
the child's pid, and the kernel reaps the child (the caller kills it if it stops waiting, never waits
for it). The server builds each vocabulary's trie once, asking for its tokens the first time. It ends
when the caller's end of the socket closes, however the caller ends, and its children die with it.
"""

from __future__ import annotations

import atexit
import math
import os
import pickle
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections import OrderedDict

import numpy as np

from ..errors import ProcessorError
from .build import build_tables
from .trie import TokenTrie

COMPILE_MEMORY_BYTES = 2 * 2**30  # what a compiling child may allocate beyond what it inherits
MAX_VOCABULARIES = 4  # vocabularies whose token trie the server keeps (a sidecar loads at most a few models)

# The server's entry point: its packages are made empty stand-ins first, so that importing this module
# runs neither package's `__init__` (which imports torch).
BOOT = """
import sys, types
del sys.path[0]  # the working directory: only these packages and installed ones are imported
for name, path in zip(sys.argv[1:5:2], sys.argv[2:5:2]):
    sys.modules[name] = types.ModuleType(name)
    sys.modules[name].__path__ = [path]
from {package}.forkserver import serve
serve(int(sys.argv[5]))
"""


class ForkServer:
    """The caller's side: starts the server on first use (and again, once a call, if it died)."""

    def __init__(self):
        self._lock = threading.Lock()  # one request and its answer at a time on the socket
        self._process: subprocess.Popen | None = None
        self._socket: socket.socket | None = None
        atexit.register(self.stop)

    def fork(self, source: tuple[str, str], vocabulary, timeout_s: float, write_fd: int) -> int:
        """Starts a child compiling `source` over `vocabulary` that writes to `write_fd` (see
        `compile_child`) and returns its pid. Raises `ProcessorError` if the server cannot be started."""
        request = ("compile", source, vocabulary.fingerprint, vocabulary.size, timeout_s)
        with self._lock:
            try:
                return self._fork(request, vocabulary, write_fd)
            except (OSError, EOFError):  # it died (killed from outside): started again, once
                self._stop()
            try:
                return self._fork(request, vocabulary, write_fd)
            except (OSError, EOFError) as error:
                self._stop()
                raise ProcessorError(f"the compile server failed: {error}") from None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def stop(self) -> None:
        with self._lock:
            self._stop()

    def _fork(self, request: tuple, vocabulary, write_fd: int) -> int:
        if self._socket is None:
            self._start()
        answer = self._ask(request, write_fd)
        if answer == ("vocabulary",):  # the first compile over it, or the server dropped its trie since
            _send(self._socket, ("vocabulary", vocabulary.fingerprint, vocabulary.text_tokens()))
            answer = self._ask(request, write_fd)
        return answer[1]

    def _ask(self, request: tuple, write_fd: int) -> tuple:
        _send(self._socket, request, [write_fd])
        answer, _ = _receive(self._socket)
        if answer is None:
            raise EOFError("the compile server ended")
        return answer

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        package = __name__.rpartition(".")[0]
        top = package.partition(".")[0]
        names = [top, sys.modules[top].__path__[0], package, sys.modules[package].__path__[0]]
        try:
            self._process = subprocess.Popen([sys.executable, "-c", BOOT.format(package=package), *names, str(theirs.fileno())],
                                             pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self._socket = ours

    def _stop(self) -> None:
        """Closes the socket, which ends the server, and waits for it (killed if it does not end)."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._process is not None:
            try:
                self._process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None


def serve(fd: int) -> None:
    """The server's loop on the socket `fd`, until the caller's end closes."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    channel = socket.socket(fileno=fd)
    tries: OrderedDict[str, TokenTrie] = OrderedDict()
    while True:
        try:
            message, fds = _receive(channel)
        except (OSError, EOFError):
            return
        if message is None:
            return
        if message[0] == "vocabulary":
            _, fingerprint, tokens = message
            tries[fingerprint] = TokenTrie.build(tokens)
            while len(tries) > MAX_VOCABULARIES:
                tries.popitem(last=False)
            continue
        _, source, fingerprint, vocab_size, timeout_s = message
        (write_fd,) = fds
        trie = tries.get(fingerprint)
        if trie is None:
            os.close(write_fd)
            _send(channel, ("vocabulary",))
            continue
        tries.move_to_end(fingerprint)
        pid = os.fork()
        if pid == 0:
            compile_child(write_fd, source, trie, vocab_size, timeout_s)
        os.close(write_fd)
        _send(channel, ("forked", pid))


def compile_child(fd: int, source: tuple[str, str], trie: TokenTrie, vocab_size: int, timeout_s: float) -> None:
    """A compiling child: builds the tables of `source` and writes them to `fd` (`send_tables`), or
    ("error", the message); then exits, never returning."""
    from multiprocessing.connection import Connection

    sender = Connection(fd, readable=False)
    try:
        _detach(fd)
        _cap_memory(COMPILE_MEMORY_BYTES)
        # the caller kills it after `timeout_s`; if the caller is gone first, the kernel does
        resource.setrlimit(resource.RLIMIT_CPU, (math.ceil(timeout_s) + 1, math.ceil(timeout_s) + 2))
        made = build_tables(source, trie, vocab_size)
    except MemoryError:
        sender.send(("error", f"compiling the constraint needed more than {COMPILE_MEMORY_BYTES >> 20} MiB "
                              f"(limit compile_memory)"))
    except Exception as error:  # InvalidOption names the problem; anything else is reported as it is
        sender.send(("error", str(error)))
    else:  # once its first part is out, nothing else is sent: a failure ends the child, which the caller reads as a crash
        send_tables(sender, made)
    finally:
        sender.close()
        os._exit(0)


def send_tables(sender, made: dict) -> None:
    """The tables as ("ok", their shapes and the plain values), then each array's bytes as they are, in
    that order: no pickled copy on either side (the tables of a large constraint run to hundreds of MiB),
    and no framing, since the shapes say how many bytes each array takes."""
    arrays = {name: value for name, value in made.items() if isinstance(value, np.ndarray)}
    plain = {name: value for name, value in made.items() if name not in arrays}
    sender.send(("ok", (plain, {name: (array.dtype.str, array.shape) for name, array in arrays.items()})))
    for array in arrays.values():
        write_all(sender.fileno(), as_bytes(np.ascontiguousarray(array)))


def write_all(fd: int, data: memoryview) -> None:
    """Writes all of `data` to `fd` (a pipe takes it a buffer at a time)."""
    while data:
        data = data[os.write(fd, data):]


def as_bytes(array: np.ndarray) -> memoryview:
    """A contiguous array's buffer as flat bytes (a partial write or read slices it by its first axis)."""
    return array.reshape(-1).view(np.uint8).data


def _send(channel: socket.socket, message: tuple, fds: list[int] = ()) -> None:
    """A pickled message, its length first; the descriptors `fds` travel with the length."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    socket.send_fds(channel, [struct.pack("!Q", len(body))], list(fds))
    channel.sendall(body)


def _receive(channel: socket.socket) -> tuple[tuple | None, list[int]]:
    """What `_send` sent and the descriptors with it; (None, []) when the other end closed between messages."""
    head, fds, _, _ = socket.recv_fds(channel, 8, 1)
    if not head:
        return None, []
    head += _exactly(channel, 8 - len(head))
    return pickle.loads(_exactly(channel, struct.unpack("!Q", head)[0])), fds


def _exactly(channel: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view, done = memoryview(buffer), 0
    while done < size:
        count = channel.recv_into(view[done:])
        if not count:
            raise EOFError("the other end closed mid-message")
        done += count
    return bytes(buffer)


def _detach(keep: int) -> None:
    """In the child: drop every descriptor it inherited but `keep` (its pipe to the caller), and die with
    the server."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    os.closerange(3, keep)
    os.closerange(keep + 1, max(os.sysconf("SC_OPEN_MAX"), keep + 1))  # no descriptor lies past the soft limit
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: Linux only
    except (OSError, AttributeError):
        pass


def _cap_memory(extra: int) -> None:
    try:
        with open("/proc/self/statm") as statm:
            current = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: no cap, the timeout still holds
        return
    resource.setrlimit(resource.RLIMIT_AS, (current + extra, current + extra))
