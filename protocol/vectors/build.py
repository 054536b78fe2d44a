"""Fills in the exact frame bytes (hex) of every request in the golden vectors.

    python -m protocol.vectors.build

Maps are encoded with their keys sorted, recursively, so that any client can reproduce the bytes
(Elixir iterates small maps in key order). Steps that send raw bytes keep their hand-written hex. An
`oversized` step becomes the start of a frame of `frame_bytes` and a count of zero bytes to send after it.
"""

from __future__ import annotations

import json
from pathlib import Path

from protocol.codec import pack
from protocol.framing import HEADER, frame

HERE = Path(__file__).parent


def canonical(value):
    if isinstance(value, dict):
        return {k: canonical(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [canonical(v) for v in value]
    return value


def from_json(value):
    """Vector values are JSON; {"$bin": hex} stands for msgpack bin, {"$float": x} for a float64."""
    if isinstance(value, dict):
        if set(value) == {"$bin"}:
            return bytes.fromhex(value["$bin"])
        if set(value) == {"$float"}:
            return float(value["$float"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def request_hex(request) -> str:
    return frame(pack(canonical(from_json(request)))).hex()


def value_hex(value) -> str:
    return pack(canonical(from_json(value))).hex()


def oversized_hex(request, frame_bytes: int) -> tuple[str, int]:
    """The start of a frame of `frame_bytes` holding `request` plus a "pad" bin that fills it; and the pad's size.

    Only the header and the map up to the pad's length are spelled out; the runner sends the pad as zeros.
    """
    fields = sorted(from_json(request).items())
    prefix = bytes([0x80 | (len(fields) + 1)]) + b"".join(pack(k) + pack(v) for k, v in fields) + pack("pad") + b"\xc6"
    pad = frame_bytes - len(prefix) - 4
    return (HEADER.pack(frame_bytes) + prefix + pad.to_bytes(4, "big")).hex(), pad


def build() -> None:
    conformance = json.loads((HERE / "conformance.json").read_text())
    for script in conformance["scripts"]:
        for step in script["steps"]:
            if "request" in step:
                step["send_hex"] = request_hex(step["request"])
            if "oversized" in step:
                step["send_hex"], step["pad_zeros"] = oversized_hex(step["oversized"], step["frame_bytes"])
    (HERE / "conformance.json").write_text(json.dumps(conformance, indent=1, ensure_ascii=False) + "\n")
    codec = json.loads((HERE / "codec.json").read_text())
    for vector in codec["vectors"]:
        vector["hex"] = value_hex(vector["value"])
    (HERE / "codec.json").write_text(json.dumps(codec, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    build()
