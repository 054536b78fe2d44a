"""The conformance runner joins servers that are already running: over inherited fds, and over a Unix socket."""

import json
import os
import re
import socket
import subprocess
import sys
import threading

import pytest

from protocol import conformance

SERVER = [sys.executable, "-m", "sidecar", "--model", "default", "--log-level", "WARNING"]
RUNNER = [sys.executable, "-m", "protocol.conformance", "--timeout", "60"]  # a step; the first waits for the server to start (12 s under load)


def summary(output: str) -> str:
    return output.strip().splitlines()[-1]


def test_joins_a_server_over_a_pair_of_fds():
    to_server_r, to_server_w = os.pipe()
    from_server_r, from_server_w = os.pipe()
    server = subprocess.Popen(SERVER + ["--fds", f"{to_server_r},{from_server_w}"], pass_fds=(to_server_r, from_server_w),
                              stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(to_server_r)
    os.close(from_server_w)
    runner = subprocess.run(RUNNER + ["--fds", f"{from_server_r},{to_server_w}"], pass_fds=(from_server_r, to_server_w),
                            capture_output=True, text=True, timeout=300)
    os.close(from_server_r)
    os.close(to_server_w)
    assert runner.returncode == 0, runner.stdout + runner.stderr
    assert summary(runner.stdout).endswith(" passed, 0 failed")
    assert server.wait(10) == 0  # the last script's shutdown ended it


def relay(source, write, done) -> None:
    while data := source(1 << 16):
        write(data)
    done()


def test_joins_a_server_on_a_unix_socket(tmp_path):
    """As behind `socat UNIX-LISTEN:PATH EXEC:...`: the test accepts the runner and relays to a server on pipes."""
    path = str(tmp_path / "sidecar.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    runner = subprocess.Popen(RUNNER + ["--connect", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    connection, _ = listener.accept()
    server = subprocess.Popen(SERVER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
    relays = [
        threading.Thread(target=relay, args=(connection.recv, server.stdin.write, server.stdin.close)),
        threading.Thread(target=relay, args=(server.stdout.read, connection.sendall,
                                             lambda: connection.shutdown(socket.SHUT_WR))),
    ]
    for thread in relays:
        thread.start()
    output, _ = runner.communicate(timeout=300)
    for thread in relays:
        thread.join(10)
    connection.close()
    listener.close()
    assert runner.returncode == 0, output
    assert summary(output).endswith(" passed, 0 failed")
    assert server.wait(10) == 0


def test_a_server_that_hangs_up_fails_every_script_without_a_traceback():
    ours, theirs = socket.socketpair()
    theirs.close()
    runner = subprocess.run(RUNNER + ["--fds", f"{ours.fileno()},{ours.fileno()}"], pass_fds=(ours.fileno(),),
                            capture_output=True, text=True, timeout=60)
    ours.close()
    assert runner.returncode == 1 and "Traceback" not in runner.stderr
    assert re.fullmatch(r"conformance: 0 passed, \d+ failed", summary(runner.stdout))
    assert "the server went away" in runner.stdout


@pytest.mark.parametrize("argv", [[], ["--connect", "/x", "--", "server"], ["--connect", "/x", "--fds", "3,4"], ["--fds", "3"]])
def test_takes_exactly_one_way_to_reach_the_server(argv):
    with pytest.raises(SystemExit) as stopped:
        conformance.main(argv)
    assert stopped.value.code == 2


def test_an_unreachable_socket_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        conformance.main(["--connect", str(tmp_path / "nobody")])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.startswith("conformance: cannot reach the server: ")


def test_a_server_command_that_cannot_start_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        conformance.main(["--", str(tmp_path / "no-such-server")])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"conformance: cannot start the server '{tmp_path / 'no-such-server'}': No such file or directory\n"


@pytest.mark.parametrize("frames, says", [
    (b"\x00\x00\x00\x03\xc1\xc1\xc1", "the server sent the frame is not one valid msgpack value"),  # 0xc1: never used
    (b"\x00\x00\x00\x01\x05", "expected a map, got 5"),  # msgpack, but no map
])
def test_a_server_sending_what_is_no_reply_fails_the_script_without_a_traceback(tmp_path, frames, says):
    """A server whose frames are not msgpack, or not maps, fails a script saying so (one whose first step
    expects a reply without an id, which a message that is no map is taken for)."""
    vectors = tmp_path / "one.json"
    scripts = json.loads(conformance.VECTORS.read_text())["scripts"]
    vectors.write_text(json.dumps({"scripts": [next(s for s in scripts if s["name"] == "invalid msgpack")]}))
    garbage = [sys.executable, "-c", f"import sys; sys.stdout.buffer.write({frames * 64!r}); sys.stdout.flush(); sys.stdin.buffer.read()"]
    runner = subprocess.run([*RUNNER[:-1], "5", "--vectors", str(vectors), "--", *garbage], capture_output=True, text=True,
                            timeout=60)
    assert runner.returncode == 1 and "Traceback" not in runner.stderr, runner.stderr
    assert summary(runner.stdout) == "conformance: 0 passed, 1 failed"
    assert says in runner.stdout, runner.stdout
