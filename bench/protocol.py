"""The protocol path: ping round trips and token-event throughput, {packet, 4}+msgpack vs JSON lines.

    python bench/protocol.py [--quick] [--pings N] [--tokens N]    (--quick: 1,000 pings, 10,000 tokens)

Both transports run the same server with the model stubbed out (bench/stub_server.py), both at once,
measured in alternation: blocks of pings, then streamed generations, one transport after the other.
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

from bench.common import Target, judged, percentile, print_table  # noqa: E402
from protocol.peer import Peer  # noqa: E402

STUB = [sys.executable, str(Path(__file__).parent / "stub_server.py"), "--model", "default", "--log-level", "WARNING",
        "--max-new-tokens", "1000000"]
PING_BLOCK = 100
GENERATIONS = 3


class JsonLinesPeer(Peer):
    """The same client over newline-delimited JSON."""

    def send(self, message) -> None:
        self.send_bytes((json.dumps(message) + "\n").encode())

    def read_message(self):
        line = self.from_server.readline()
        if not line:
            raise EOFError("the server closed its output")
        return json.loads(line)


def ping_times(peer: Peer, count: int) -> list[float]:
    times = []
    for _ in range(count):
        rid = peer.next_id()
        start = time.perf_counter()
        peer.send({"id": rid, "op": "ping"})
        peer.reply_for(rid)
        times.append(time.perf_counter() - start)
    return times


def events_per_second(peer: Peer, tokens: int) -> float:
    rid = peer.next_id()
    start = time.perf_counter()
    peer.send({"id": rid, "op": "generate", "session": "bench", "token_ids": [7], "max_new_tokens": tokens,
               "eos_token_ids": [], "stream": True})
    events, reply = peer.reply_for(rid)
    elapsed = time.perf_counter() - start
    assert reply["ok"] and len(events) == tokens, reply
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="1,000 pings and 10,000-token generations")
    parser.add_argument("--pings", type=int, help="ping round trips per transport (default 5,000)")
    parser.add_argument("--tokens", type=int, help="tokens per streamed generation (default 50,000)")
    args = parser.parse_args()
    pings = args.pings or (1000 if args.quick else 5000)
    tokens = args.tokens or (10_000 if args.quick else 50_000)
    ours, baseline = "{packet, 4} + msgpack", "JSON lines"
    peers = {ours: Peer(STUB, stderr=subprocess.DEVNULL),
             baseline: JsonLinesPeer(STUB + ["--json-lines"], stderr=subprocess.DEVNULL)}
    rtts: dict[str, list[float]] = {name: [] for name in peers}
    rates: dict[str, list[float]] = {name: [] for name in peers}
    try:
        for peer in peers.values():
            ping_times(peer, PING_BLOCK)  # warm-up
            peer.call("open_session", session="bench")
        for _ in range(max(1, pings // PING_BLOCK)):  # alternating blocks: a noisy moment hits both alike
            for name, peer in peers.items():
                rtts[name] += ping_times(peer, PING_BLOCK)
        for _ in range(GENERATIONS):
            for name, peer in peers.items():
                rates[name].append(events_per_second(peer, tokens))
    finally:
        for peer in peers.values():
            peer.__exit__(None, None, None)

    def row(measure: str, value, unit: str, target: Target | None) -> list[str]:
        mine, theirs = value(ours), value(baseline)
        return [measure, f"{mine:,.0f}{unit}", f"{theirs:,.0f}{unit}", f"{mine / theirs:.2f}", *judged(mine, target)]

    print_table(
        f"Protocol path over pipes, model stubbed out; {len(rtts[ours])} pings and {GENERATIONS} streamed "
        f"{tokens:,}-token generations per transport, alternating",
        ["measure", ours, baseline, "ratio", "target", "verdict"],
        [
            row("ping round trip p50", lambda n: statistics.median(rtts[n]) * 1e6, " us", Target(100, unit=" us")),
            row("ping round trip p99", lambda n: percentile(rtts[n], 0.99) * 1e6, " us", None),
            row(f"token events/s (median of {GENERATIONS})", lambda n: statistics.median(rates[n]), "/s",
                Target(50_000, at_least=True, unit="/s")),
        ],
    )
    print("events/s of each generation: " + "; ".join(
        f"{name} {', '.join(f'{r:,.0f}' for r in rates[name])}" for name in peers))


if __name__ == "__main__":
    main()
