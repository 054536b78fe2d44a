"""The protocol path: ping round trips and token-event throughput, {packet, 4}+msgpack vs JSON lines.

    python bench/protocol.py [--pings N] [--tokens N]

Both transports run the same server with the model stubbed out (bench/stub_server.py), in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import percentile, print_table  # noqa: E402
from protocol.peer import Peer  # noqa: E402

STUB = [sys.executable, str(Path(__file__).parent / "stub_server.py"), "--model", "default", "--log-level", "WARNING",
        "--max-new-tokens", "1000000"]


class JsonLinesPeer(Peer):
    """The same client over newline-delimited JSON."""

    def send(self, message) -> None:
        self.send_bytes((json.dumps(message) + "\n").encode())

    def read_message(self):
        line = self.process.stdout.readline()
        if not line:
            raise EOFError("the server closed its output")
        return json.loads(line)


def measure(peer: Peer, pings: int, tokens: int) -> dict:
    peer.call("ping")
    rtts = []
    for i in range(pings):
        start = time.perf_counter()
        peer.send({"id": 10 + i, "op": "ping"})
        peer.reply_for(10 + i)
        rtts.append(time.perf_counter() - start)
    peer.call("open_session", session="bench")
    rates = []
    for attempt in range(3):
        rid = 10**9 + attempt
        start = time.perf_counter()
        peer.send({"id": rid, "op": "generate", "session": "bench", "token_ids": [7], "max_new_tokens": tokens,
                   "eos_token_ids": [], "stream": True})
        events, reply = peer.reply_for(rid)
        elapsed = time.perf_counter() - start
        assert reply["ok"] and len(events) == tokens, reply
        rates.append(tokens / elapsed)
    return {"p50": statistics.median(rtts), "p99": percentile(rtts, 0.99), "events_per_s": statistics.median(rates)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pings", type=int, default=5000)
    parser.add_argument("--tokens", type=int, default=50_000)
    args = parser.parse_args()
    results = {}
    for name, peer_class, command in (
        ("{packet, 4} + msgpack", Peer, STUB),
        ("JSON lines", JsonLinesPeer, STUB + ["--json-lines"]),
    ):
        with peer_class(command, stderr=subprocess.DEVNULL) as peer:
            results[name] = measure(peer, args.pings, args.tokens)
    ours, baseline = results["{packet, 4} + msgpack"], results["JSON lines"]
    print_table(
        f"Protocol path over pipes, model stubbed out; {args.pings} pings, {args.tokens}-token streamed generation (median of 3)",
        ["transport", "ping p50", "ping p99", "token events/s"],
        [[name, f"{r['p50'] * 1e6:.0f} us", f"{r['p99'] * 1e6:.0f} us", f"{r['events_per_s']:,.0f}"] for name, r in results.items()],
    )
    print(f"\ntargets: ping p50 <= 100 us (ours {ours['p50'] * 1e6:.0f} us); events >= 50,000/s (ours {ours['events_per_s']:,.0f}/s); "
          f"msgpack vs JSON lines: ping p50 x{ours['p50'] / baseline['p50']:.2f}, throughput x{ours['events_per_s'] / baseline['events_per_s']:.2f}")


if __name__ == "__main__":
    main()
