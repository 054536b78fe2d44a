"""Checks any server against the protocol's golden vectors.

    python -m protocol.conformance [--vectors FILE] [--timeout S] -- <command...>
    python -m protocol.conformance [--vectors FILE] [--timeout S] --connect PATH
    python -m protocol.conformance [--vectors FILE] [--timeout S] --fds IN,OUT

The server must have a causal LM loaded as "default", the default limits, and no session directory
(ours: no `--session-dir`; save_session and restore_session are then forbidden). Given a command, the
runner starts it and speaks over its stdin/stdout (for this project:
`.venv/bin/python -m sidecar --model default`). Otherwise it joins a server that is already running:
over a Unix socket (`--connect PATH`), or over two descriptors it inherited, one to read the server's
frames from and one to write frames to (`--fds IN,OUT`; a socket's descriptor as both). A running
server is checked over that one connection: scripts that need a process of their own are skipped,
and where a script expects the server to exit, the connection must close instead (an exit status is
not visible from there). The scripts load and unload models and end with `shutdown`: give the runner
a server of its own, never one in use. Prints one line per script and a last line
`conformance: N passed, N failed[, N skipped]`; exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
from pathlib import Path

from .errors import ProtocolError
from .matching import mismatch
from .peer import Peer

VECTORS = Path(__file__).parent / "vectors" / "conformance.json"


class StepTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise StepTimeout()


def run_script(peer: Peer, script: dict, timeout: float) -> str | None:
    """None when every step held, else what went wrong."""
    for number, step in enumerate(script["steps"], 1):
        where = f"step {number}"
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            peer.send_bytes(bytes.fromhex(step["send_hex"]))
            if step.get("pad_zeros"):
                peer.send_bytes(bytes(step["pad_zeros"]))
            for expected in step["expect"]:
                events, reply = peer.reply_for(expected["id"])
                problem = mismatch(expected["reply"], reply, f"{where} reply") or (
                    mismatch(expected["events"], events, f"{where} events") if "events" in expected else None
                )
                if problem:
                    return problem
            if step.get("in_order"):
                expected = [e["id"] for e in step["expect"]]
                arrived = [rid for rid in peer.replied if rid in expected]
                if arrived[-len(expected):] != expected:
                    return f"{where}: replies arrived in the order {arrived[-len(expected):]}, expected {expected}"
            if "exit_status" in step:
                problem = exited(peer, step["exit_status"])
                if problem:
                    return f"{where}: {problem}"
        except StepTimeout:
            return f"{where}: no answer within {timeout} s"
        except (EOFError, ConnectionError) as gone:
            return f"{where}: the server went away ({gone})"
        except ProtocolError as garbage:  # a frame the server sent that is not msgpack
            return f"{where}: the server sent {garbage.message}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return None


def exited(peer: Peer, statuses: list[int]) -> str | None:
    """None when the server ended as expected: our child with one of `statuses`, a running server by closing."""
    if peer.process is not None:
        status = peer.process.wait()
        return None if status in statuses else f"exit status {status}, expected one of {statuses}"
    try:
        while True:
            peer.read_message()
    except EOFError:
        return None


def connect(args) -> Peer:
    """A peer over the running server that `--connect` or `--fds` names."""
    if args.connect:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(args.connect)
        in_fd = out_fd = sock.detach()
    else:
        in_fd, out_fd = args.fds
    if out_fd == in_fd:  # each stream closes its own descriptor
        out_fd = os.dup(in_fd)
    return Peer.over(os.fdopen(out_fd, "wb", buffering=0), os.fdopen(in_fd, "rb", buffering=0))


def fd_pair(text: str) -> tuple[int, int]:
    try:
        in_fd, out_fd = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("takes two descriptors: IN,OUT") from None
    return in_fd, out_fd


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protocol.conformance", description=__doc__.splitlines()[0])
    parser.add_argument("--vectors", type=Path, default=VECTORS)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds each step may take")
    running = parser.add_mutually_exclusive_group()
    running.add_argument("--connect", metavar="PATH", help="join a running server on this Unix socket")
    running.add_argument("--fds", type=fd_pair, metavar="IN,OUT", help="join a running server over these inherited descriptors")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command that starts a server")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if bool(command) == bool(args.connect or args.fds):
        parser.error("give either a server command after -- or --connect PATH or --fds IN,OUT")
    scripts = json.loads(args.vectors.read_text())["scripts"]
    try:
        shared = None if command else connect(args)
    except OSError as problem:
        parser.exit(2, f"conformance: cannot reach the server: {problem}\n")
    signal.signal(signal.SIGALRM, _alarm)
    passed = failed = skipped = 0
    for script in scripts:
        fresh = script.get("fresh_process", False)
        if not command and fresh:
            print(f"SKIP  {script['name']}: needs a process of its own")
            skipped += 1
            continue
        if fresh or shared is None or (shared.process is not None and shared.process.poll() is not None):
            try:
                peer = Peer(command)
            except OSError as problem:
                parser.exit(2, f"conformance: cannot start the server {command[0]!r}: {problem.strerror or problem}\n")
            if not fresh:
                shared = peer
        else:
            peer = shared
        problem = run_script(peer, script, args.timeout)
        if fresh:
            peer.__exit__(None, None, None)
        print(f"{'PASS' if problem is None else 'FAIL'}  {script['name']}{'' if problem is None else ': ' + problem}")
        passed, failed = passed + (problem is None), failed + (problem is not None)
    if shared is not None:
        shared.__exit__(None, None, None)
    print(f"conformance: {passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
