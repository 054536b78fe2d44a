"""The process compiling children are forked from: it holds no torch, its children are its own, it is
started again if it dies, and it ends with its caller."""

import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import pytest

from processors import configure
from processors.structured import Regex, Vocabulary
from processors.structured import compile as structured_compile

ROOT = Path(__file__).resolve().parents[2]
EOS = 2
# a vocabulary of its own: no trie of it is in the server before these tests
VOCAB = Vocabulary((None, None, None, *(bytes([b]) for b in b"0123456789abcdef-")))


@pytest.fixture
def nothing_compiled(monkeypatch):
    monkeypatch.setattr(structured_compile, "_cache", OrderedDict())
    monkeypatch.setattr(structured_compile, "_failures", OrderedDict())


def status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as file:
        return dict(line.split(":\t", 1) for line in file.read().splitlines() if ":\t" in line)


def gone(pid: int, within_s: float = 10) -> bool:
    """Whether process `pid` ends within `within_s` (a zombie has ended: the server is this process's
    child, reaped when it is next asked for)."""
    deadline = time.monotonic() + within_s
    while not ended(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    return ended(pid)


def ended(pid: int) -> bool:
    try:
        return status(pid)["State"].startswith("Z")
    except FileNotFoundError:
        return True


def test_children_are_forked_from_a_server_without_torch(nothing_compiled, monkeypatch):
    """The child's parent is the server, not this process (which holds torch and would pass on its
    memory at every fork); the server has no torch library mapped; the child ends on its own."""
    seen = {}
    fork = structured_compile._forkserver.fork

    def spied(*args):
        pid = seen["child"] = fork(*args)
        seen["parent"] = int(status(pid)["PPid"])  # alive: it waits for the parent to read its tables
        return pid

    monkeypatch.setattr(structured_compile._forkserver, "fork", spied)
    automaton = configure(Regex, pattern="[0-9a-f]{8}-[0-9a-f]{4}").bind(VOCAB, [EOS]).automaton
    assert automaton.step(automaton.initial, 3) != automaton.dead  # "0"
    server = structured_compile._forkserver.pid
    assert seen["parent"] == server != os.getpid()
    with open(f"/proc/{server}/maps") as maps:
        mapped = maps.read()
    assert "outlines_core" in mapped and "torch" not in mapped
    assert gone(seen["child"])


def test_a_server_that_died_is_started_again(nothing_compiled):
    configure(Regex, pattern="[0-9]{3}").bind(VOCAB, [EOS])
    first = structured_compile._forkserver.pid
    os.kill(first, signal.SIGKILL)
    assert gone(first)
    automaton = configure(Regex, pattern="[a-f]{3}").bind(VOCAB, [EOS]).automaton
    assert automaton.step(automaton.initial, 13) != automaton.dead  # "a"
    assert structured_compile._forkserver.pid not in (None, first)


def test_the_server_and_its_children_end_with_their_caller():
    """A caller that ends (here killed, so no exit handler runs) while a compile is under way leaves
    neither the server nor the compiling child behind."""
    script = f"""
import sys, threading
sys.path.insert(0, {str(ROOT)!r})
from processors.structured import compile as structured_compile, Vocabulary
vocab = Vocabulary((None, b"a", b"b"))
fork = structured_compile._forkserver.fork
def spied(*args):
    pid = fork(*args)
    print(structured_compile._forkserver.pid, pid, flush=True)
    return pid
structured_compile._forkserver.fork = spied
structured_compile.compile_regex(("regex", "(a|b)*a(a|b){{40}}"), vocab, 300)
"""
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        server, child = map(int, caller.stdout.readline().split())
        assert os.path.exists(f"/proc/{server}") and os.path.exists(f"/proc/{child}")
    finally:
        caller.kill()
        caller.wait()
    assert gone(server) and gone(child)
