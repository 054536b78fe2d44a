"""What hostile or vanishing clients cost the server: an oversized prompt, and EOF at awkward moments.

    .venv/bin/python bench/hardening.py [--quick] [--runs 5] [--baseline DIR]    (--quick: one run, under a minute)

Each row runs the real server (`python -m sidecar --model default`) as a child process over pipes.
`--baseline DIR` runs a checkout of another revision side by side, interleaved run by run; its rows
are capped (a server that tokenizes a 60 MB prompt is waited for at most `--cap` seconds).
Peak memory is the server's VmHWM (peak resident set) after the request minus before it.
"""

from __future__ import annotations

import argparse
import array
import fcntl
import os
import statistics
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Target, judged, spread  # noqa: E402
from protocol import FrameDecoder, frame, pack, unpack  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
F_SETPIPE_SZ = 1031


def start(checkout: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    return subprocess.Popen([sys.executable, "-m", "sidecar", "--model", "default", "--log-level", "ERROR"],
                            cwd=checkout, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, bufsize=0)


def call(process, message) -> dict:
    process.stdin.write(frame(pack(message)))
    decoder = FrameDecoder(1 << 30)
    while True:
        for payload in decoder.feed(os.read(process.stdout.fileno(), 1 << 16)):
            reply = unpack(payload)
            if reply.get("id") == message["id"] and "event" not in reply:
                return reply


def peak_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def oversized_prompt(checkout: Path, size: int, cap: float) -> tuple[float, float, str]:
    """Seconds from the first byte sent to the reply, MB of extra peak memory, and the reply's code."""
    process = start(checkout)
    try:
        call(process, {"id": 1, "op": "open_session", "session": "s"})
        call(process, {"id": 2, "op": "generate", "session": "s", "prompt": "warm up", "max_new_tokens": 2})
        before = peak_kib(process.pid)
        data = frame(pack({"id": 3, "op": "generate", "session": "s", "prompt": "x" * size, "max_new_tokens": 1}))
        got: dict = {}

        def read_reply():
            decoder = FrameDecoder(1 << 30)
            while "reply" not in got:
                chunk = os.read(process.stdout.fileno(), 1 << 16)
                if not chunk:
                    return
                for payload in decoder.feed(chunk):
                    message = unpack(payload)
                    if message.get("id") == 3:
                        got["at"], got["reply"] = time.perf_counter(), message

        reader = threading.Thread(target=read_reply, daemon=True)
        reader.start()
        started = time.perf_counter()
        process.stdin.write(data)
        reader.join(cap)
        if "reply" not in got:
            return float("inf"), (peak_kib(process.pid) - before) / 1024, f"no reply in {cap:.0f} s"
        return got["at"] - started, (peak_kib(process.pid) - before) / 1024, got["reply"]["error"]["code"]
    finally:
        process.kill()
        process.wait()


def wait_until_blocked(process) -> None:
    """Returns once the server's output pipe is full and has stayed full: its writes are blocked."""
    pending = array.array("i", [0])
    last, steady_since = -1, time.perf_counter()
    while True:
        fcntl.ioctl(process.stdout.fileno(), termios.FIONREAD, pending)
        if pending[0] != last:
            last, steady_since = pending[0], time.perf_counter()
        elif last > 3000 and time.perf_counter() - steady_since > 0.3:
            return
        time.sleep(0.01)


def eof_to_exit(checkout: Path, blocked: bool) -> float:
    """Seconds from closing the server's input to its exit, mid-generation; `blocked`: we stopped reading."""
    process = start(checkout)
    try:
        call(process, {"id": 1, "op": "open_session", "session": "s"})
        if blocked:
            fcntl.fcntl(process.stdout.fileno(), F_SETPIPE_SZ, 4096)
        process.stdin.write(frame(pack({"id": 2, "op": "generate", "session": "s", "token_ids": [5, 6],
                                        "max_new_tokens": 1900, "eos_token_ids": [], "stream": True})))
        if blocked:
            wait_until_blocked(process)
        else:
            os.read(process.stdout.fileno(), 4096)  # it is generating
        started = time.perf_counter()
        process.stdin.close()
        while process.poll() is None:
            if not blocked:
                os.read(process.stdout.fileno(), 1 << 16)
            time.sleep(0.001)
        return time.perf_counter() - started
    finally:
        process.kill()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run instead of five")
    parser.add_argument("--runs", type=int, help="runs of each row, each on a fresh server (default 5)")
    parser.add_argument("--baseline", type=Path, help="a checkout of another revision, measured side by side")
    parser.add_argument("--cap", type=float, default=10.0, help="seconds to wait for a reply at most")
    args = parser.parse_args()
    runs = args.runs or (1 if args.quick else 5)
    checkouts = {"this": HERE} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    rows = {  # each measure returns seconds, or (seconds, extra peak MB, the reply's code)
        "60 MB prompt: time to reply, extra peak": lambda c: oversized_prompt(c, 60_000_000, args.cap),
        "8 MB prompt: time to reply, extra peak": lambda c: oversized_prompt(c, 8_000_000, args.cap),
        "EOF mid-generation: time to exit": lambda c: eof_to_exit(c, blocked=False),
        "EOF while blocked writing: time to exit": lambda c: eof_to_exit(c, blocked=True),
    }
    targets = {  # row: a target on each measured value in turn (seconds, then extra peak MB)
        "60 MB prompt: time to reply, extra peak": [Target(0.1, unit=" s"), Target(50, unit=" MB")],
        "EOF mid-generation: time to exit": [Target(0.5, unit=" s")],
        "EOF while blocked writing: time to exit": [Target(0.5, unit=" s")],
    }
    results = {(row, name): [] for row in rows for name in checkouts}
    for _ in range(runs):  # interleaved: a noisy moment hits every column alike
        for row, measure in rows.items():
            for name, checkout in checkouts.items():
                measured = measure(checkout)
                results[row, name].append(measured if isinstance(measured, tuple) else (measured,))
    print(f"\nHostile and vanishing clients, default model, median of {runs} run(s) [min-max], each on a fresh server")
    header = f"{'measure':<44}" + "".join(f"{name:>50}" for name in checkouts) + f"  {'target':<18} verdict"
    print(header + "\n" + "-" * len(header))
    for row in rows:
        cells = []
        for name in checkouts:
            runs_here = results[row, name]
            cell = spread([r[0] for r in runs_here], scale=1, unit="s", digits=3)
            if len(runs_here[0]) > 1:
                cell += f" +{statistics.median(r[1] for r in runs_here):.0f} MB, {runs_here[0][2]}"
            cells.append(f"{cell:>50}")
        print(f"{row:<44}" + "".join(cells) + "  " + verdict(results[row, "this"], targets.get(row, [])))


def verdict(runs: list[tuple], targets: list[Target]) -> str:
    """The target and verdict cells of a row, judged on the medians of this checkout's runs; `-` for no target."""
    if not targets:
        return f"{'-':<18} -"
    cells = [judged(statistics.median(r[i] for r in runs), target) for i, target in enumerate(targets)]
    return f"{', '.join(c[0] for c in cells):<18} {'met' if all(c[1] == 'met' for c in cells) else 'MISSED'}"

if __name__ == "__main__":
    main()
