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
A server that ended (killed from outside) or answers nothing for `SERVER_ANSWER_S` (stopped) is killed
and started again, and a compile whose child died with its server runs again (`compile._build`); a
process forked from the caller starts a server of its own.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import pickle
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Connection  # here, not in each child: importing it takes 15 ms
from typing import Callable

import numpy as np

from ..errors import ProcessorError
from .build import MasksTooLarge, build_tables, warm
from .trie import TokenTrie

COMPILE_MEMORY_BYTES = 2 * 2**30  # what a compiling child may allocate beyond what it inherits
MAX_VOCABULARIES = 4  # vocabularies whose token trie the server keeps (a sidecar loads at most a few models)
SERVER_ANSWER_S = 20.0  # a server silent this long on one request is stuck (stopped): killed, started again
POLL_S = 0.05  # how often a caller waiting for the lock or an answer asks whether it still waits
SERVER_END_S = 1.0  # how long a child that ended waits to see whether its server did (which killed it)

# The server's entry point, in isolated mode (-I) on the caller's own `sys.path` (read from its stdin: a
# path can be longer than a command line may be): the same numpy and outlines-core, whatever the
# environment says. Every package above this module is an empty stand-in,
# so that importing it runs no package's `__init__` (which imports torch). A terminal's Ctrl-C reaches the
# whole process group: it is the caller's to handle, and the server ends with the caller's socket. It
# warms outlines-core up for its children (`build.warm`) before it answers. A start that fails, in the
# imports or the warm-up, says why on the socket, framed as `_send` frames.
BOOT = """
import json, pickle, signal, socket, struct, sys, traceback, types
signal.signal(signal.SIGINT, signal.SIG_IGN)
setup = json.loads(sys.stdin.buffer.read())
sys.path[:] = setup["path"]
for name, path in setup["packages"]:
    sys.modules[name] = types.ModuleType(name)
    sys.modules[name].__path__ = path
try:
    from importlib import import_module
    server = import_module(setup["module"])
    server.warm()
except BaseException as error:
    body = pickle.dumps(("failed", "".join(traceback.format_exception_only(type(error), error)).strip()))
    socket.socket(fileno=setup["fd"]).sendall(struct.pack("!Q", len(body)) + body)
    raise SystemExit(1)
server.serve(setup["fd"])
"""


@dataclass(frozen=True)
class Child:
    """A compiling child and the server it was forked from."""

    pid: int
    server: subprocess.Popen

    def kill(self) -> None:
        """Kills the child, which the caller does only while it holds its end of the pipe: alive, so its
        pid is still its own (the server reaps it at once once it ends)."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def server_ended(self) -> bool:
        """Whether its server has ended, which ends the child too (so its end says nothing about its
        constraint). Asked when the child has ended: a server that ended first is waited for, not
        polled (`poll` says "running" while another thread waits for it, as `_stop` does)."""
        try:
            self.server.wait(timeout=SERVER_END_S)
        except subprocess.TimeoutExpired:
            return False
        return True


class ForkServer:
    """The caller's side: starts the server on first use, and again when it ended or was stuck."""

    def __init__(self):
        self._lock = threading.Lock()  # one request and its answer at a time on the socket
        self._process: subprocess.Popen | None = None
        self._socket: socket.socket | None = None
        atexit.register(self._stop)
        os.register_at_fork(after_in_child=self._forget)

    def fork(self, source: tuple[str, str], vocabulary, timeout_s: float, write_fd: int,
             check: Callable[[], None]) -> Child:
        """Starts a child compiling `source` over `vocabulary` that writes to `write_fd` (see
        `compile_child`). `check` raises once the caller stops waiting; it is called every `POLL_S` while
        this waits for another thread's request or the server's answer (a server start or a new
        vocabulary's trie takes a few tenths of a second, not counted in `timeout_s`).

        Raises `ProcessorError` if the server cannot be started, or ends or is stuck twice."""
        request = ("compile", source, vocabulary.fingerprint, vocabulary.size, timeout_s)
        while not self._lock.acquire(timeout=POLL_S):
            check()
        try:
            try:
                return self._fork(request, vocabulary, write_fd, check)
            except (OSError, EOFError):  # it ended (killed from outside) or was stuck: started again, once
                self._stop()
            try:
                return self._fork(request, vocabulary, write_fd, check)
            except (OSError, EOFError) as error:
                self._stop()
                raise ProcessorError(f"the compile server failed: {error}") from None
        finally:
            self._lock.release()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def _fork(self, request: tuple, vocabulary, write_fd: int, check) -> Child:
        if self._socket is None:
            self._start(check)
        answer = self._ask(request, [write_fd], check)
        if answer == ("vocabulary",):  # the first compile over it, or the server dropped its trie since
            self._ask(("vocabulary", vocabulary.fingerprint, vocabulary.text_tokens()), [], check)
            answer = self._ask(request, [write_fd], check)
        return Child(answer[1], self._process)

    def _ask(self, message: tuple | None, fds: list[int], check) -> tuple:
        """Sends `message` (None: nothing) and returns the server's answer. A caller that stops waiting
        midway (`check`, or an interrupt) stops the server: the answer it leaves would be read by the
        next request as its own."""
        try:
            if message is not None:
                _send(self._socket, message, fds)
            given_up_at = time.monotonic() + SERVER_ANSWER_S
            while not select.select([self._socket], [], [], POLL_S)[0]:
                check()
                if time.monotonic() > given_up_at:
                    raise TimeoutError(f"the compile server answered nothing in {SERVER_ANSWER_S:g} s")
            answer, _ = _receive(self._socket)
        except (OSError, EOFError):
            raise
        except BaseException:
            self._stop()
            raise
        if answer is None:
            raise EOFError("the compile server ended")
        return answer

    def _start(self, check) -> None:
        ours, theirs = socket.socketpair()
        ours.settimeout(SERVER_ANSWER_S)  # sending a vocabulary to a stuck server, or reading a half-sent answer
        module = __name__.split(".")
        packages = [(name, list(sys.modules[name].__path__)) for name in (".".join(module[:n]) for n in range(1, len(module)))]
        setup = {"path": [entry for entry in sys.path if isinstance(entry, str)], "packages": packages, "module": __name__, "fd": theirs.fileno()}
        try:
            self._process = subprocess.Popen([sys.executable, "-I", "-c", BOOT], pass_fds=[theirs.fileno()],
                                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._socket = ours
        with self._process.stdin as given:
            given.write(json.dumps(setup).encode())
        answer = self._ask(None, [], check)
        if answer[0] != "ready":
            self._stop()
            raise ProcessorError(f"the compile server could not start: {answer[1]}")

    def _stop(self) -> None:
        """Kills the server (its children die with it) and forgets it."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def _forget(self) -> None:
        """In a process forked from the caller: the server, its socket and the lock (which another thread
        may have held at the fork) are the parent's; a compile here starts a server of its own."""
        self._lock = threading.Lock()
        if self._socket is not None:
            self._socket.close()  # this process's copy only: the parent's server lives on
        self._socket = self._process = None


def serve(fd: int) -> None:
    """The server's loop on the socket `fd`, until the caller's end closes."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    channel, server = socket.socket(fileno=fd), os.getpid()
    _send(channel, ("ready",))
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
            _send(channel, ("built",))
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
            compile_child(write_fd, source, trie, vocab_size, timeout_s, server)
        os.close(write_fd)
        _send(channel, ("forked", pid))


def compile_child(fd: int, source: tuple[str, str], trie: TokenTrie, vocab_size: int, timeout_s: float, server: int) -> None:
    """A compiling child: builds the tables of `source` and writes them to `fd` (`send_tables`), or
    ("error", the message); then exits, never returning. It dies with its `server`, and on its own
    after `timeout_s` of CPU time (the caller kills it then; if the caller is gone first, the kernel does)."""
    _die_with(server)
    resource.setrlimit(resource.RLIMIT_CPU, (math.ceil(timeout_s) + 1, math.ceil(timeout_s) + 2))
    sender = Connection(fd, readable=False)
    try:
        _detach(fd)
        _cap_memory(COMPILE_MEMORY_BYTES)
        made = build_tables(source, trie, vocab_size)
    except MemoryError:
        sender.send(("error", f"compiling the constraint needed more than {COMPILE_MEMORY_BYTES >> 20} MiB "
                              f"(limit compile_memory)"))
    except MasksTooLarge as error:  # not a failure of the constraint: another backend runs it
        sender.send(("masks_too_large", str(error)))
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


def receive_tables(receiver, header, deadline: float) -> dict:
    """What `send_tables` sent, each array read straight into its own buffer, whole (a child that ends
    before is an `EOFError` or an `OSError`), by `deadline` (or a `TimeoutError`).

    Not a `Connection` message per array: `recv_bytes_into` reads one in chunks into a growing buffer,
    each allocated at the length still to come, then copies it out. At 32k tokens (39 MB of tables)
    that made the transfer take 37-112 ms, against 20-36 ms read in place (helper's measurement)."""
    plain, shapes = header
    made = dict(plain)
    for name, (dtype, shape) in shapes.items():
        array = made[name] = np.empty(shape, dtype=np.dtype(dtype))
        _read_into(receiver, as_bytes(array), deadline)
    return made


def _read_into(receiver, buffer: memoryview, deadline: float) -> None:
    """Fills `buffer` from the pipe of `receiver`: an `EOFError` if the child ends first, a
    `TimeoutError` if it sends nothing more before `deadline`."""
    done = 0
    while done < len(buffer):
        if not receiver.poll(max(0.0, deadline - time.monotonic())):  # True at the end of the pipe too
            raise TimeoutError("the child sent no more before the deadline")
        count = os.readv(receiver.fileno(), [buffer[done:]])
        if not count:
            raise EOFError("the child ended mid-array")
        done += count


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


def _die_with(server: int) -> None:
    """In the child: die with the server (Linux only), or now if it already ended, before the request took effect."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass
    if os.getppid() != server:
        os._exit(1)


def _detach(keep: int) -> None:
    """In the child: drop every descriptor it inherited but `keep` (its pipe to the caller)."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    os.closerange(3, keep)
    os.closerange(keep + 1, max(os.sysconf("SC_OPEN_MAX"), keep + 1))  # no descriptor lies past the soft limit


def _cap_memory(extra: int) -> None:
    try:
        with open("/proc/self/statm") as statm:
            current = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: no cap, the timeout still holds
        return
    resource.setrlimit(resource.RLIMIT_AS, (current + extra, current + extra))
