"""The process compiling children are forked from: it holds no torch, its children are its own, it is
started again if it dies, and it ends with its caller."""

import os
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest

from processors import Chain, ProcessorError, Temperature, configure
from processors.structured import Regex, Vocabulary
from processors.structured import compile as structured_compile
from processors.structured import forkserver

ROOT = Path(__file__).resolve().parents[2]
EOS = 2
# a vocabulary of its own: no trie of it is in the server before these tests
VOCAB = Vocabulary((None, None, None, *(bytes([b]) for b in b"0123456789abcdef-")))


@pytest.fixture
def nothing_compiled(monkeypatch):
    monkeypatch.setattr(structured_compile, "_cache", OrderedDict())
    monkeypatch.setattr(structured_compile, "_failures", OrderedDict())


@pytest.fixture
def server(nothing_compiled, monkeypatch):
    """A fork server of the test's own, started (its first compile) and killed at the end."""
    own = forkserver.ForkServer()
    monkeypatch.setattr(structured_compile, "_forkserver", own)
    structured_compile.compile_regex(("regex", "[0-9]"), VOCAB, 10)
    yield own
    own._stop()


def compiled_by(server, source, timeout_s=10, cancelled=None):
    """Compiles `source`; returns the pid of the server its child was forked from."""
    parents = []
    fork = server.fork

    def spied(*args):
        child = fork(*args)
        try:  # alive while its parent has not read what it sends, unless the pipe took it all at once
            parents.append(int(status(child.pid)["PPid"]))
        except FileNotFoundError:  # ended and reaped already (seen once, on a busy machine)
            parents.append(child.server.pid)
        return child

    server.fork = spied
    try:
        automaton = structured_compile.compile_regex(source, VOCAB, timeout_s, cancelled)
    finally:
        del server.fork
    assert automaton.step(automaton.initial, 3) != automaton.dead  # "0"
    (parent,) = parents
    return parent


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
    except (FileNotFoundError, ProcessLookupError):  # gone before its status was opened, or while it was read
        return True


def test_children_are_forked_from_a_server_without_torch(nothing_compiled, monkeypatch):
    """The child's parent is the server, not this process (which holds torch and would pass on its
    memory at every fork); the server has no torch library mapped; the child ends on its own."""
    seen = {}
    fork = structured_compile._forkserver.fork

    def spied(*args):
        child = fork(*args)
        seen["child"], seen["parent"] = child.pid, int(status(child.pid)["PPid"])  # alive: its parent reads it after
        return child

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
    child = fork(*args)
    print(structured_compile._forkserver.pid, child.pid, flush=True)
    return child
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


def test_a_stopped_server_is_killed_and_a_compile_waits_for_it_no_longer_than_asked(server, monkeypatch):
    """A server that answers nothing (stopped) is given up after SERVER_ANSWER_S and a new one serves
    the request; a caller that stops waiting meanwhile is answered at once, and the request it left
    unanswered is not read later as another's (the server is killed with it)."""
    monkeypatch.setattr(forkserver, "SERVER_ANSWER_S", 1.0)
    stopped = server.pid
    os.kill(stopped, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(structured_compile.CompileCancelled):
        structured_compile.compile_regex(("regex", "[0-5]{2}"), VOCAB, 10, lambda: time.monotonic() - started > 0.3)
    assert time.monotonic() - started < 0.9 and gone(stopped)
    assert compiled_by(server, ("regex", "[0-5]{2}")) == server.pid != stopped

    again = server.pid
    os.kill(again, signal.SIGSTOP)
    assert compiled_by(server, ("regex", "[0-5]{3}")) == server.pid != again and gone(again)


def test_a_server_ended_mid_compile_is_no_failure_of_the_constraint(server, monkeypatch):
    """Its child dies with it: the compile runs again on a new server, and nothing is remembered as failed."""
    fork, ended = server.fork, []

    def killing(*args):
        child = fork(*args)
        if not ended:
            ended.append(child.server.pid)
            os.kill(child.server.pid, signal.SIGKILL)
        return child

    monkeypatch.setattr(server, "fork", killing)
    # a compile of about half a second: a child that finished before its server was killed ended the
    # compile on the first server (1 run in 16 with [0-9a-f]{6})
    automaton = structured_compile.compile_regex(("regex", "(a|b)*a(a|b){14}"), VOCAB, 30)
    a, zero = VOCAB.token_bytes.index(b"a"), VOCAB.token_bytes.index(b"0")
    assert automaton.step(automaton.initial, a) != automaton.dead == automaton.step(automaton.initial, zero)
    assert gone(ended[0]) and server.pid != ended[0]
    assert not structured_compile._failures


def test_a_forked_caller_compiles_on_a_server_of_its_own_even_if_the_locks_were_held_at_the_fork(server):
    """What a fork inherits (the server's lock and the cache's, held at that moment; the socket) is the
    parent's: the forked process starts its own server, and the parent's serves the parent still."""
    reader, writer = os.pipe()
    server._lock.acquire()
    structured_compile._cache_lock.acquire()
    try:
        pid = os.fork()
        if pid == 0:
            os.close(reader)
            signal.alarm(30)
            try:
                answer = str(compiled_by(structured_compile._forkserver, ("regex", "[0-9]{4}")))
            except BaseException as error:
                answer = repr(error)
            os.write(writer, answer.encode())
            os._exit(0)
    finally:
        structured_compile._cache_lock.release()
        server._lock.release()
    os.close(writer)
    with os.fdopen(reader) as answer:
        theirs = answer.read()
    os.waitpid(pid, 0)
    assert theirs.isdigit() and int(theirs) != server.pid, theirs
    assert gone(int(theirs))  # it ended with the forked process
    assert compiled_by(server, ("regex", "[0-9]{5}")) == server.pid


def test_a_terminals_ctrl_c_is_the_callers_to_handle(server):
    os.kill(server.pid, signal.SIGINT)
    time.sleep(0.3)
    assert not ended(server.pid)
    assert compiled_by(server, ("regex", "[0-9]{2}-")) == server.pid


def test_the_server_imports_what_its_caller_imports_whatever_the_environment_says(tmp_path):
    """A caller in isolated mode ignores PYTHONPATH: so does its server, which would otherwise import
    the outlines_core found there."""
    shadow = tmp_path / "outlines_core"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the shadowing outlines_core was imported')\n")
    script = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from processors.structured import compile as structured_compile, Vocabulary
automaton = structured_compile.compile_regex(("regex", "ab"), Vocabulary((None, b"a", b"b")), 10)
print(automaton.step(automaton.initial, 1) != automaton.dead)
"""
    done = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.stdout.strip() == "True", done.stderr


def test_a_server_that_cannot_start_says_why(nothing_compiled, monkeypatch):
    own = forkserver.ForkServer()
    monkeypatch.setattr(structured_compile, "_forkserver", own)
    monkeypatch.setattr(sys, "path", [])  # what the server is given: not even the standard library's modules
    with pytest.raises(ProcessorError, match="^the compile server could not start: ModuleNotFoundError: No module named"):
        structured_compile.compile_regex(("regex", "[0-9]"), VOCAB, 10)
    assert own.pid is None


def test_a_server_whose_warm_up_fails_says_why(nothing_compiled, monkeypatch, tmp_path, capfd):
    """The server imports, then warms outlines-core up for its children before it answers: an
    outlines-core that imports but fails there (here one found first on the path, whose schema module
    raises) fails the start with the server's own words, as a failed import does, and no traceback."""
    shadow = tmp_path / "outlines_core"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("class Index:\n    pass\n\nclass Vocabulary:\n    pass\n")
    (shadow / "json_schema.py").write_text("def build_regex_from_schema(schema):\n    raise RuntimeError('no schemas here')\n")
    own = forkserver.ForkServer()
    monkeypatch.setattr(structured_compile, "_forkserver", own)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    with pytest.raises(ProcessorError, match="^the compile server could not start: RuntimeError: no schemas here$"):
        structured_compile.compile_regex(("regex", "[0-9]"), VOCAB, 10)
    assert own.pid is None
    assert "Traceback" not in capfd.readouterr().err


def kill_server_during_first_compile(server, monkeypatch, after_s: float) -> list[int]:
    """Has `server` killed `after_s` into the next compile it forks a child for (only that one: the compile
    run again goes to the server started after it). Returns the list its pid goes into once that child is forked."""
    fork, killed = server.fork, []

    def killing(*args):
        child = fork(*args)
        if not killed:
            killed.append(child.server.pid)
            threading.Timer(after_s, os.kill, (child.server.pid, signal.SIGKILL)).start()
        return child

    monkeypatch.setattr(server, "fork", killing)
    return killed


def test_the_run_again_after_the_server_ended_has_what_is_left_of_the_timeout(server, monkeypatch):
    """A compile is bounded by its timeout, however often its server ends: what the second run did not
    end in says nothing about the constraint either, so it is not remembered."""
    killed = kill_server_during_first_compile(server, monkeypatch, after_s=2.0)
    started = time.monotonic()
    with pytest.raises(structured_compile.ServerEnded, match="what was left of compile_timeout_s = 4 s"):
        structured_compile.compile_regex(("regex", "(a|b)*a(a|b){40}"), VOCAB, 4)
    assert 4 <= time.monotonic() - started < 5.5  # the whole timeout again would be 6 s
    assert not structured_compile._failures and gone(killed[0])


def test_a_server_that_ended_is_told_apart_while_another_thread_waits_for_it():
    """How a child's end is read: `Popen.poll` says "running" while another thread waits for the process
    (the stop of a server does), which made a child killed with its server look like a crash."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    assert gone(ended.pid)  # a zombie: not reaped yet
    held = threading.Event()

    def waiting():  # another thread in the middle of its wait for the process
        with ended._waitpid_lock:
            held.set()
            time.sleep(0.3)

    threading.Thread(target=waiting).start()
    held.wait()
    assert forkserver.Child(0, ended).server_ended()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not forkserver.Child(0, running).server_ended()
    finally:
        running.kill()
        running.wait()


def test_a_path_longer_than_a_command_line_may_be(server, monkeypatch):
    """The caller's sys.path reaches the server on its stdin: one argument may hold 128 KiB at most."""
    monkeypatch.setattr(sys, "path", sys.path + [f"/nowhere/{'x' * 90}{n}" for n in range(2000)])
    server._stop()
    assert compiled_by(server, ("regex", "[0-9]{2}")) == server.pid


def test_a_server_whose_interpreter_cannot_be_started_is_an_error_of_its_own(nothing_compiled, monkeypatch):
    """The start fails before any Python runs: a typed error naming the cause, tried twice, nothing
    remembered against the constraint, no socket or process left."""
    own = forkserver.ForkServer()
    monkeypatch.setattr(structured_compile, "_forkserver", own)
    monkeypatch.setattr(sys, "executable", "/nowhere/python")
    descriptors = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ProcessorError, match="^the compile server failed: .*No such file or directory"):
        structured_compile.compile_regex(("regex", "[0-9]"), VOCAB, 10)
    assert own.pid is None and own._socket is None
    assert not structured_compile._failures and not structured_compile._cache
    assert len(os.listdir("/proc/self/fd")) == descriptors


def test_a_server_ended_through_a_chain_keeps_its_kind_and_deadline(server, monkeypatch):
    """A chain names the processor that raised (`ProcessorError.at`) without re-creating the error: a
    `ServerEnded`, whose constructor takes a deadline and no index, comes out as itself, with what it carries."""
    killed = kill_server_during_first_compile(server, monkeypatch, after_s=1.0)
    chain = Chain([configure(Temperature, temperature=0.7),
                   configure(Regex, pattern="(a|b)*a(a|b){40}", compile_timeout_s=2)])
    started = time.monotonic()
    with pytest.raises(structured_compile.ServerEnded) as raised:
        chain.bind(VOCAB, [EOS])
    error = raised.value
    assert error.index == 1 and str(error).startswith("processors[1] (regex): the compile server ended")
    original = error.__cause__  # what the compile raised, chained by the chain's raise
    assert type(original) is structured_compile.ServerEnded and error.deadline == original.deadline
    assert 2 <= time.monotonic() - started < 3.5  # bounded by the timeout, as without a chain
    assert not structured_compile._failures and gone(killed[0])
