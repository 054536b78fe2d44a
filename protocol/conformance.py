"""Checks any executable against the protocol's golden vectors.

    python -m protocol.conformance [--vectors FILE] [--timeout S] -- <command...>

The command must serve the protocol on its stdin/stdout with a causal LM loaded as "default"
(for this project: `python -m sidecar --model default`). Prints one line per script and a last line
`conformance: N passed, N failed`; exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

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
                status = peer.process.wait()
                if status not in step["exit_status"]:
                    return f"{where}: exit status {status}, expected one of {step['exit_status']}"
        except StepTimeout:
            return f"{where}: no answer within {timeout} s"
        except (EOFError, BrokenPipeError) as gone:
            return f"{where}: the server went away ({gone})"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protocol.conformance", description=__doc__.splitlines()[0])
    parser.add_argument("--vectors", type=Path, default=VECTORS)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds each step may take")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the server command after --")
    signal.signal(signal.SIGALRM, _alarm)
    scripts = json.loads(args.vectors.read_text())["scripts"]
    passed = failed = 0
    shared: Peer | None = None
    for script in scripts:
        fresh = script.get("fresh_process", False)
        if fresh or shared is None or shared.process.poll() is not None:
            peer = Peer(command)
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
    print(f"conformance: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
