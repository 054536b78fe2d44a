"""Well-formed requests carrying hostile values, in every parameter of every op and every processor option.

The random-bytes fuzz in test_server.py mostly exercises the decoder. Here the frames are mostly valid
requests (a good envelope, a known op) whose values come from a pool of hostile ones: wrong types,
null, extreme integers and floats, odd Unicode, very long strings, nesting 40 deep, maps with
non-string keys, token ids outside the vocabulary, and valid values too, so that many requests get
past validation into real generation. The requests are generated from `protocol.OPS` and from
`processors.catalogue()`, so a parameter or option added later is fuzzed without touching this file.
First a sweep puts every hostile value in every parameter and every option once; then random steps
interleave hostile requests with valid generations, continuations of a session's last result,
processor chains that leave nothing to sample, cancels (of queued, running and unknown ids), duplicate
ids in flight, `session_info` and `close_session` queued behind generations, session churn,
`load_model` / `unload_model`, a burst past `max_in_flight`, undecodable payloads and oversized frames. The frames depend on the seed alone.

The server runs with small limits so that hostile work stays cheap and the limits themselves are hit:
`--max-new-tokens 8`, `--max-sessions 16`, `--max-in-flight 64`, `--max-frame-bytes 262144` (every
frame sent stays under 200 KB, except two deliberately oversized ones) and `--cache-budget-bytes 131072`
(the KV cache of 32 tokens, so caches get evicted); and with one torch thread (OMP_NUM_THREADS=1).

Checked: no reply is `internal`; every request with a valid id gets exactly one final reply, with its
events before it (and they add up to it), and every other frame one reply with id null; outcomes known
in advance (`invalid_logits`, `duplicate_id`, `session_closed`, cancels) are what they must be; nothing
is left in flight and no session or model leaks; greedy canaries on a session the fuzz keeps using match
a fresh in-process session all along, and so do that session and a new one at the end; the server
answers `ping` and exits 0 on EOF; no generation makes more than --max-new-tokens tokens.
"""

from __future__ import annotations

import math
import os
import random
import sys
import threading
import time
from collections import Counter, defaultdict, deque

import msgpack
import torch

import processors
from protocol import OPS, frame, pack
from protocol.peer import Peer

SEED = 20240611
RANDOM_STEPS = 1500
VOCAB = 1024  # the default model's
KEEP = "keep"  # opened first, used by the fuzz, never closed by it; checked against a fresh session at the end
MAX_NEW_TOKENS = 8
# The KV of 128 tokens of the default model (4 KiB each): idle caches get evicted, and an input of
# 2040 tokens cannot fit at all (cache_budget_exceeded).
BUDGET_TOKENS = 128
LIMITS = ["--max-new-tokens", str(MAX_NEW_TOKENS), "--max-sessions", "16", "--max-in-flight", "64",
          "--max-frame-bytes", "262144", "--cache-budget-bytes", str(BUDGET_TOKENS * 4096)]
SERVER = [sys.executable, "-m", "sidecar", "--model", "default", "--log-level", "ERROR", *LIMITS]
# One torch thread: on a busy 2-core machine, torch's spinning worker threads compete with this test's own
# threads and every decode step gets several times slower.
SERVER_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
MAX_FRAME = 200_000  # every fuzz frame stays under this
OUTSTANDING = 48  # replies the sender lets the server owe before it waits
NULL_CODES = {"invalid_msgpack", "invalid_message", "invalid_id", "frame_too_large", "limit_exceeded"}
CATALOGUE = processors.catalogue()
CONSTRAINTS = {"regex", "choice", "json_schema", "grammar", "dfa"}
ID_BASE = 2**40  # the sender's own ids; hostile ids that happen to be valid are far below


# ---- hostile values ---------------------------------------------------------------------------------

def nested(depth: int, leaf, as_map: bool):
    value = leaf
    for _ in range(depth - 1):
        value = {"k": value} if as_map else [value]
    return value


HOSTILE = [
    None, True, False,
    0, 1, -1, -(2**63), 2**31, 2**63 - 1, 2**63, 2**64 - 1, VOCAB, 2048, 10**6,
    math.nan, math.inf, -math.inf, 5e-324, 1e308, -1e308, -0.0, 1.2e-38, 3.5e38,
    "", " ", "\x00", "a\x00b", "\u202eevil\u202c\u200f", "\U0001f469\u200d\U0001f469\u200d\U0001f467", "e\u0301" * 60,
    "\ufeff\uffff\U0010ffff", "default", "s1", "../../etc/passwd", "top_k", "x" * 4097, "x" * 100_000, "\U0001f600" * 20_000,
    b"", b"\xff\xfe\x00", msgpack.ExtType(42, b"x"), msgpack.Timestamp(0, 0),
    [], [None], [1, "a", None, 1.5, [], {}, True, b"x"], [VOCAB], [2**64 - 1], [-1], [5, 6, VOCAB + 5],
    [3] * 2040, [0] * 3000, list(range(1030)), [[1, 2], [3]], ["a", 1], ["\x00"], [""], ["x" * 5000],
    nested(40, 1, as_map=False), nested(31, 1, as_map=False),
    {}, {1: 2}, {None: None}, {1.5: "x", True: b""}, {b"k": 1}, {"": {}}, {-1: [1]},
    nested(40, 1, as_map=True), nested(30, 1, as_map=True), {"name": "top_k", "options": {"k": 1}},
    [{"name": "top_k", "options": {"k": 1}}] * 65,
]
HOSTILE_KEYS = ["bogus", "", "\x00", "ID", 1, -1, None, 1.5, True, b"op", msgpack.ExtType(1, b"")]
# Payloads that are not one msgpack value a map can hold: each gets invalid_msgpack with id null (limit_exceeded,
# max_depth, for the one nested past the decoder's stack).
UNDECODABLE = [
    b"", b"\xc1", b"\x92\x01", b"\xa3ab", b"\x81\xa2id\x01\x00",  # truncated, reserved byte, trailing bytes
    b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01",  # 2^32 items
    b"\x91" * 2000 + b"\x01",  # nested past the decoder's stack
    # a str that is not UTF-8, in a map with no valid id (with one, the reply carries it: test_server)
    b"\xa3\xed\xb3\xbf", b"\x82\xa2id\xff\xa2op\xa2\xff\xfe", b"\x81\xa2\xff\xfe\x01",
    b"\xc7\x03\xff\x00\x00\x00", b"\xd7\xff\xff\xff\xff\xff\x00\x00\x00\x00",  # malformed timestamps
    b"\x81\x91\x01\x01", b"\x81\x81\x01\x01\x01",  # a list or a map as a map key
]


def random_text(rng: random.Random, n: int) -> str:
    """Text from every plane, with controls and direction marks, never a lone surrogate (msgpack refuses it)."""
    out = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.5:
            out.append(chr(rng.randrange(0x20, 0x7F)))
        elif roll < 0.75:
            out.append(chr(rng.randrange(0x80, 0xD800)))
        elif roll < 0.9:
            out.append(chr(rng.randrange(0xE000, 0x110000)))
        else:
            out.append(rng.choice("\x00\u200f\u202e\ufeff\r\n\t\U0001f600"))
    return "".join(out)


def too_big(token_ids: list[int], max_new_tokens: int) -> set:
    """{"cache_budget_exceeded"} for a one-row generation that cannot fit in the budget, else nothing."""
    return {"cache_budget_exceeded"} if len(token_ids) + max_new_tokens > BUDGET_TOKENS else set()


def hostile(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if roll < 0.7 or depth > 2:
        return rng.choice(HOSTILE)
    if roll < 0.8:
        return random_text(rng, rng.randrange(1, 200))
    if roll < 0.9:
        return [hostile(rng, depth + 1) for _ in range(rng.randrange(1, 5))]
    return {rng.choice(HOSTILE_KEYS): hostile(rng, depth + 1) for _ in range(rng.randrange(1, 4))}


# ---- valid values -----------------------------------------------------------------------------------

def from_schema(schema: dict, rng: random.Random, edge: float = 0.1):
    """A value the JSON Schema accepts (as `hello` publishes it); with probability `edge`, one at its edges."""
    if "anyOf" in schema:
        return from_schema(rng.choice(schema["anyOf"]), rng, edge)
    kind = schema.get("type")
    if kind == "null":
        return None
    if kind == "integer":
        low, high = schema.get("minimum", 0), schema.get("maximum")
        if rng.random() < edge:
            return rng.choice([low, high if high is not None else rng.choice([2**63, 2**64 - 1])])
        return rng.randrange(low, low + VOCAB) if high is not None else low + rng.randrange(8)
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        if "exclusiveMinimum" in schema:
            low = math.nextafter(low, math.inf)
        if "exclusiveMaximum" in schema:
            high = math.nextafter(high, -math.inf)
        if rng.random() < edge:
            return rng.choice([v for v in (low, high, -math.inf, 1e308, 5e-324) if v is not None])
        low, high = max(low if low is not None else -5.0, -5.0), min(high if high is not None else 5.0, 5.0)
        return rng.uniform(low, max(low, high))
    if kind == "array":
        prefix = schema.get("prefixItems")
        if prefix:
            return [from_schema(s, rng, edge) for s in prefix]
        low = schema.get("minItems", 0)
        return [from_schema(schema.get("items", {"type": "integer"}), rng, edge) for _ in range(low + rng.randrange(3))]
    if kind == "string":  # a regex, a grammar, a schema as text: mostly invalid ones, all small
        return random_text(rng, rng.randrange(1, 12))
    if kind == "object":  # a JSON schema: the empty one accepts any JSON value
        return rng.choice([{}, {"type": rng.choice(["integer", "string", "boolean", "nope"])}])
    return hostile(rng)  # an untyped schema accepts anything


def processor_spec(rng: random.Random, hostility: float) -> dict:
    """One `generate.processors` entry from the catalogue; `hostility` is the chance of each kind of damage."""
    roll = rng.random()
    if roll < hostility * 0.1:  # malformed entries
        name = rng.choice(sorted(CATALOGUE))
        return rng.choice([
            {"name": hostile(rng)}, {"name": name, "options": hostile(rng)}, {"name": name, "options": {1: 2}},
            {"name": name, "options": {}, "extra": 1}, {}, {"options": {}},
        ])
    if roll < hostility * 0.2:
        unknown = rng.choice(["", "top_q", "TOP_K", "function", "x" * 5000, "\x00", random_text(rng, 8)])
        return {"name": unknown, "options": {}}
    name = rng.choice(sorted(CATALOGUE))
    options = {}
    for option in CATALOGUE[name]:
        roll = rng.random()
        if roll < hostility * 0.3:
            continue  # missing: required ones must be named in the error
        if roll < hostility:
            options[option["name"]] = hostile(rng)
        elif option["required"] or rng.random() < 0.5:
            options[option["name"]] = from_schema(option["schema"], rng, edge=0.3 if hostility else 0.0)
    if rng.random() < hostility * 0.2:
        options[rng.choice(["bogus", "", "K", "\x00"])] = hostile(rng)
    return {"name": name, "options": options}


# Chains that pass validation but leave nothing to sample from: `invalid_logits`, never `internal`.
# Each removes every token whatever came before it, so a probe puts random valid processors first.
IMPOSSIBLE = [
    [{"name": "suppress_tokens", "options": {"token_ids": list(range(VOCAB))}}],
    [{"name": "sequence_bias", "options": {"sequence_bias": [[[t], -math.inf] for t in range(VOCAB)]}}],
    [{"name": "no_bad_words", "options": {"bad_words_ids": [[t] for t in range(VOCAB)]}}],
    [{"name": "min_length", "options": {"min_length": 10**6, "eos_token_ids": list(range(VOCAB))}}],
    [{"name": "min_new_tokens", "options": {"min_new_tokens": 100, "eos_token_ids": list(range(VOCAB))}}],
]
FLOAT32_MAX = 3.4028234663852886e38
# These overflow to +inf; a processor before them could remove the tokens that overflow, so none goes first.
OVERFLOW = [
    [{"name": "sequence_bias", "options": {"sequence_bias": [[[t], FLOAT32_MAX] for t in (3, 4, 5)]}},
     {"name": "temperature", "options": {"temperature": 0.5}}],
    [{"name": "sequence_bias", "options": {"sequence_bias": [[[t], FLOAT32_MAX] for t in range(VOCAB)]}},
     {"name": "repetition_penalty", "options": {"penalty": 1.2e-38}}],
]
# These overflow float32 only if a logit is large enough: `invalid_logits` or a result, never `internal`.
MAYBE_IMPOSSIBLE = [
    [{"name": "temperature", "options": {"temperature": 1.2e-38}}],
    [{"name": "repetition_penalty", "options": {"penalty": 1.2e-38}}],
    [{"name": "repetition_penalty", "options": {"penalty": FLOAT32_MAX}}],
    [{"name": "frequency_penalty", "options": {"penalty": -2.0}},
     {"name": "temperature", "options": {"temperature": 1.2e-38}}],
    [{"name": "sequence_bias", "options": {"sequence_bias": [[[t], -FLOAT32_MAX] for t in range(VOCAB)]}}],
]


def brief(value, size: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= size else text[: size - 3] + "..."


def attributed_id(message):
    """The id the reply to `message` must carry: its id if that is an unsigned integer below 2^64, else None."""
    if isinstance(message, dict):
        rid = message.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 2**64:
            return rid
    return None


# ---- the client side --------------------------------------------------------------------------------

class Recorder:
    """Reads everything the server writes, on a thread of its own, so the sender never blocks on a full pipe."""

    def __init__(self, peer: Peer):
        self.peer = peer
        self.by_id: dict = defaultdict(list)  # id -> [(arrival index, message)]
        self.received = 0
        self.finals = 0
        self.failure: Exception | None = None
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="recorder", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                message = self.peer.read_message()
                if not (isinstance(message, dict) and "id" in message and ("ok" in message or "event" in message)):
                    raise AssertionError(f"neither a reply nor an event: {brief(message)}")
                with self.cond:
                    self.by_id[message["id"]].append((self.received, message))
                    self.received += 1
                    self.finals += "ok" in message
                    self.cond.notify_all()
        except EOFError:
            pass
        except Exception as problem:  # a frame we cannot read: fail the test with it, not a hang
            self.failure = problem
        with self.cond:
            self.cond.notify_all()

    def wait(self, done, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not done():
                left = deadline - time.monotonic()
                if left <= 0 or not self.thread.is_alive():
                    return done()
                self.cond.wait(left)
            return True

    def finals_of(self, rid) -> list[dict]:
        with self.cond:
            return [m for _, m in self.by_id.get(rid, []) if "ok" in m]


class Fuzz:
    """Sends the fuzz, and keeps what the checks need: the replies owed, the outcomes known in advance, and what
    it believes is open (sessions, models) so that valid requests name them."""

    def __init__(self, peer: Peer, recorder: Recorder, rng: random.Random, log):
        self.peer, self.recorder, self.rng, self.log = peer, recorder, rng, log
        self.sent: Counter = Counter()  # id -> frames sent with it
        self.requests: dict = {}  # id -> brief of the last frame sent with it
        self.ops: dict = {}  # id -> op of the last frame sent with it
        self.null_expected = 0
        self.frames = 0
        self.streaming: set = set()  # ids sent in a generate with stream true
        self.generates: deque = deque(maxlen=16)  # recent generate ids: cancel targets
        self.expect: dict = {}  # id -> codes its replies may have ("ok" for success)
        self.duplicates: set = set()  # ids of a generation sent again while in flight: one reply must refuse
        self.canaries: list = []  # (id, request) of greedy generations on KEEP checked against a fresh session
        self.cancels: list = []  # (cancel id, target id)
        self.sessions: list[str] = []  # believed open, besides KEEP
        self.session_names: set = set()  # every name open_session or fork_session was given: closed at the end
        self.models: list[str] = []  # believed loaded, besides "default"
        self.model_names: set = set()
        self.last_id = ID_BASE

    def run(self) -> None:
        assert self.call("open_session", session=KEEP)["ok"]
        self.sweep()
        self.oversized()
        for n in range(RANDOM_STEPS):
            self.step()
            if n == RANDOM_STEPS // 2:
                self.burst()
                self.oversized()

    # sending

    def new_id(self) -> int:
        self.last_id += 1
        return self.last_id

    def send(self, *messages, raw: bytes | None = None, null: int = 0) -> None:
        """Sends the messages in one write; each is checked, and counted as a reply the server owes."""
        data = b""
        for message in messages:
            message = self.protect(message)
            payload = pack(message)
            assert len(payload) < MAX_FRAME or attributed_id(message) in self.expect, f"a fuzz frame of {len(payload)} bytes"
            data += frame(payload)
            self.count(message)
        if raw is not None:
            data += frame(raw)
            self.frames += 1
            self.null_expected += null
        try:
            self.peer.send_bytes(data)
        except BrokenPipeError:
            status = self.peer.process.wait(10)
            raise AssertionError(f"the server is gone (exit status {status}) after {self.frames} frames, the last "
                                 f"{brief(messages)}; its log:\n{self.log.read_text()[-4000:]}") from None
        self.pace()

    def count(self, message) -> None:
        """One more reply owed: under the message's id, or under null when it has no valid one."""
        self.frames += 1
        rid = attributed_id(message)
        if rid is None:
            self.null_expected += 1
            return
        self.sent[rid] += 1
        self.requests[rid] = brief(message)
        op = self.ops[rid] = message.get("op")
        if op == "generate":
            if message.get("stream") is True:
                self.streaming.add(rid)
            if rid >= ID_BASE and rid not in self.expect and rid not in self.duplicates:  # not left to random cancels
                self.generates.append(rid)
        self.believe(op, message)

    def believe(self, op, message: dict) -> None:
        """Follows what is open from the requests alone (the frames sent must not depend on timing)."""
        if op == "open_session":
            name = message.get("session")
            if isinstance(name, str):
                self.session_names.add(name)
            if (isinstance(name, str) and len(name.encode()) <= 4096 and set(message) <= {"id", "op", "session", "model"}
                    and message.get("model", "default") in ["default", *self.models] and name not in self.sessions):
                self.sessions.append(name)  # believed open: it is a clean request (it may still meet max_sessions)
        if op == "fork_session":  # a fork of a session that may or may not exist by then: closed at the end anyway
            name = message.get("new")
            if isinstance(name, str):
                self.session_names.add(name)
        if op == "close_session" and message.get("session") in self.sessions:
            self.sessions.remove(message["session"])
        if op == "load_model" and isinstance(message.get("name"), str):
            self.model_names.add(message["name"])
            if set(message) <= {"id", "op", "name", "path", "dtype"} and message["name"] not in ["default", *self.models]:
                self.models.append(message["name"])
        if op == "unload_model" and message.get("model") in self.models:
            self.models.remove(message["model"])

    def protect(self, message):
        """The fuzz never closes KEEP, never unloads the default model and never shuts the server down."""
        if not isinstance(message, dict):
            return message
        op = message.get("op")
        if op == "close_session" and message.get("session") == KEEP:
            return {**message, "op": "session_info"}
        if op == "unload_model" and message.get("model") == "default":
            return {**message, "op": "models"}
        if op == "shutdown":
            return {**message, "bogus": None}  # an unknown parameter: invalid_params, and the server stays
        return message

    def owed(self) -> int:
        return sum(self.sent.values()) + self.null_expected - self.recorder.finals

    def pace(self) -> None:
        """Lets the server catch up now and then, so that cancels meet running generations, not only queued ones."""
        if self.owed() > OUTSTANDING:
            assert self.recorder.wait(lambda: self.owed() <= OUTSTANDING // 2, 60), (
                f"the server stopped answering: it owes {self.owed()} replies\n{self.missing_report()}")

    def call(self, op: str, **params) -> dict:
        rid = self.new_id()
        self.send({"id": rid, "op": op, **params})
        assert self.recorder.wait(lambda: self.recorder.finals_of(rid), 60), f"no reply to {op} {params}"
        return self.recorder.finals_of(rid)[0]

    # values

    def session(self) -> str:
        return self.rng.choice([KEEP, *self.sessions])

    def tokens(self) -> list[int]:
        n = 2040 if self.rng.random() < 0.01 else self.rng.randrange(1, 24)
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def valid(self, op: str, name: str, kind: str):
        """A value that passes validation, by parameter name; by kind for a parameter this file does not know."""
        rng = self.rng
        by_name = {
            "session": lambda: self.session() if op != "open_session" else rng.choice([f"f{self.new_id()}", None, KEEP]),
            "model": lambda: rng.choice(["default", "default", *self.models]),
            "name": lambda: f"m{self.new_id()}",
            "path": lambda: None,
            "dtype": lambda: rng.choice([None, "f32", "f16", "bf16"]),
            "trust_remote_code": lambda: False,
            "prompt": lambda: rng.choice(["hello world", "héllo \U0001f600", "a\x00b", random_text(rng, 12)]),
            "text": lambda: rng.choice(["hello world", "", random_text(rng, 40)]),
            "token_ids": self.tokens,
            "max_new_tokens": lambda: rng.randrange(9),
            "strategy": lambda: rng.choice(["greedy", "sample", "beam"]),
            "num_samples": lambda: rng.choice([1, 1, 2, 3]),
            "num_beams": lambda: rng.choice([None, 1, 2, 3]),
            "num_return_sequences": lambda: rng.choice([None, 1, 2]),
            "length_penalty": lambda: rng.choice([None, 1.0, -0.5, 2]),
            "early_stopping": lambda: rng.choice([None, True, False, "never"]),
            "logprobs": lambda: rng.choice([None, None, 0, 3, 20, 21]),
            "prompt_logprobs": lambda: rng.choice([None, None, None, 0, 2, 20, 21]),
            "reuse": lambda: rng.choice(["prefix", "prefix", "shift"]),
            "keep": lambda: rng.choice([None, None, 0, 4]),
            "device": lambda: rng.choice([None, "cpu"]),
            "seed": lambda: rng.choice([None, 0, 7, 2**63, 2**64 - 1]),
            "processors": lambda: [processor_spec(rng, rng.choice([0.0, 0.0, 0.3, 1.0])) for _ in range(rng.randrange(4))],
            "stop": lambda: rng.choice([[], ["e"], ["\n", "the"], [random_text(rng, 3)]]),
            "eos_token_ids": lambda: rng.choice([None, [], [2], [rng.randrange(VOCAB)]]),
            "target": lambda: rng.choice([*self.generates, 0, 2**64 - 1]) if self.generates else 0,
            "continue": self.continuation,
        }
        if name in by_name:
            return by_name[name]()
        base = kind.removesuffix("|null")
        if base != kind and rng.random() < 0.3:
            return None
        by_kind = {"str": lambda: "x", "uint": lambda: rng.randrange(16), "bool": lambda: rng.random() < 0.5,
                   "number": lambda: rng.uniform(-2, 2), "bool|str": lambda: rng.random() < 0.5,
                   "map": dict, "list[uint]": self.tokens, "list[str]": lambda: ["x"], "list[map]": lambda: [{}]}
        return by_kind[base]()

    def continuation(self):
        """Mostly none; else a `continue` of the session's last result, cut and extended at random, at times
        past its ends (huge, negative), of a sequence it may not have, or with both of two exclusive keys."""
        rng = self.rng
        if rng.random() < 0.7:
            return None
        numbers = [0, 1, 3, 7, 20, -1, -4, 2**63 - 1, -(2**63), 10**6]
        choices = {"sequence": lambda: rng.choice([0, 0, 1, 2, 64, 2**64 - 1]), "tokens": lambda: rng.choice(numbers),
                   "chars": lambda: abs(rng.choice(numbers)), "append": lambda: rng.choice(["", " and", random_text(rng, 6)]),
                   "append_token_ids": lambda: rng.choice([[], [5], [VOCAB], self.tokens()])}
        return {key: draw() for key, draw in choices.items() if rng.random() < 0.35}

    def request(self, op: str, hostile_param: str | None = None, value=None, hostility: float = 0.0) -> dict:
        """A request for `op` with every parameter drawn: `hostile_param` gets `value`, the others are hostile
        with probability `hostility`, else valid or left to their default; drawn again while its frame would
        pass `MAX_FRAME` (values at their edges add up: three options of 100,000 characters)."""
        while True:
            message = self._drawn(op, hostile_param, value, hostility)
            if len(pack(message)) < MAX_FRAME:
                return message

    def _drawn(self, op: str, hostile_param: str | None, value, hostility: float) -> dict:
        rng = self.rng
        params = {}
        for name, param in OPS[op].items():
            roll = rng.random()
            if name == hostile_param:
                params[name] = value
            elif roll < hostility:
                params[name] = hostile(rng)
            elif param.required or roll < 0.7:
                params[name] = self.valid(op, name, param.kind)
        inputs = [name for name in ("prompt", "token_ids", "continue") if params.get(name) is not None]
        if op == "generate" and len(inputs) > 1:  # exactly one of them
            kept = hostile_param if hostile_param in inputs else rng.choice(inputs)
            for name in inputs:
                if name != kept:
                    del params[name]
        if rng.random() < hostility * 0.1:
            params[rng.choice(HOSTILE_KEYS)] = hostile(rng)
        return {"id": self.new_id(), "op": op, **params}

    # actions

    def sweep(self) -> None:
        """Every hostile value, and a hostile key, in every parameter of every op, the others valid."""
        for op, schema in OPS.items():
            for name in schema:
                for value in HOSTILE:
                    message = self.request(op, name, value)
                    self.send(message)
                    if op == "load_model" and isinstance(message.get("name"), str):
                        # free the slot again, or max_models would answer every later load before its values are checked
                        self.send({"id": self.new_id(), "op": "unload_model", "model": message["name"]})
            for key in HOSTILE_KEYS:
                self.send({**self.request(op), key: self.rng.choice(HOSTILE)})
        for payload in UNDECODABLE:
            self.send(raw=payload, null=1)
        for name, options in CATALOGUE.items():  # every hostile value in every processor option
            for option in options:
                for value in HOSTILE:
                    spec = {"name": name, "options": {o["name"]: from_schema(o["schema"], self.rng, 0.0)
                                                      for o in options if o["required"]} | {option["name"]: value}}
                    self.send(self.request("generate", "processors", [spec]) | {"session": self.session()})

    def step(self) -> None:
        actions = {"fuzz": 50, "generate": 14, "continue": 4, "probe": 4, "cancel": 5, "cancel_running": 2, "queued": 3, "duplicate": 3,
                   "churn": 6, "model": 1, "misc": 6, "envelope": 6}
        action = self.rng.choices(list(actions), weights=list(actions.values()))[0]
        getattr(self, f"do_{action}")()

    def do_fuzz(self) -> None:
        op = self.rng.choice(list(OPS))
        for _ in range(5):
            message = self.request(op, hostility=self.rng.choice([0.1, 0.3, 0.6, 1.0]))
            if len(pack(message)) < MAX_FRAME:
                return self.send(message)

    def do_generate(self) -> None:
        message = self.request("generate") | {"session": self.session(), "max_new_tokens": self.rng.randrange(1, 9)}
        if not any(name in message for name in ("prompt", "token_ids", "continue")):
            message["token_ids"] = self.tokens()
        self.send(message)

    def do_continue(self) -> None:
        """A generation that continues its session's last result (it may have none, or fewer sequences)."""
        self.send({"id": self.new_id(), "op": "generate", "session": self.session(), "continue": self.continuation() or {},
                   "max_new_tokens": self.rng.randrange(1, 9), "eos_token_ids": [],
                   "strategy": self.rng.choice(["greedy", "sample", "beam"])})

    def do_probe(self) -> None:
        """On KEEP: a generation, then one whose processors leave nothing to sample (it crops KEEP's cache, then
        fails), then a canary that reuses what the first one cached: it must match a fresh session."""
        kind = self.rng.choice(["impossible", "impossible", "overflow", "maybe"])
        chain = self.rng.choice({"impossible": IMPOSSIBLE, "overflow": OVERFLOW, "maybe": MAYBE_IMPOSSIBLE}[kind])
        first = [] if kind == "overflow" else [processor_spec(self.rng, 0.0) for _ in range(self.rng.randrange(3))]
        first = [p for p in first if p["name"] not in CONSTRAINTS]  # they need an end token, and probes have none
        tokens = self.tokens()[:20]
        before = self.canary(tokens, send=False)
        probe = {"id": self.new_id(), "op": "generate", "session": KEEP,
                 "token_ids": tokens[: self.rng.randrange(len(tokens) + 1)] + [7],  # shares a prefix with `before`
                 "max_new_tokens": self.rng.randrange(1, 9), "strategy": self.rng.choice(["greedy", "sample"]),
                 "seed": 3, "stream": self.rng.random() < 0.5, "eos_token_ids": [], "processors": first + chain}
        self.expect[probe["id"]] = {"invalid_logits", "too_many_requests"} | ({"ok"} if kind == "maybe" else set())
        self.send(before, probe, self.canary(tokens + [9], send=False))

    def canary(self, token_ids: list[int], send: bool = True) -> dict:
        """A greedy generation on KEEP whose tokens are checked against a fresh in-process session at the end."""
        request = {"token_ids": token_ids, "max_new_tokens": 4, "eos_token_ids": []}
        message = {"id": self.new_id(), "op": "generate", "session": KEEP, **request}
        self.expect[message["id"]] = {"ok", "too_many_requests"} | too_big(token_ids, 4)
        self.canaries.append((message["id"], request))
        if send:
            self.send(message)
        return message

    def do_cancel(self) -> None:
        """A cancel of a recent generation (queued, running or done), of any id sent, or of one never sent."""
        roll = self.rng.random()
        if roll < 0.7 and self.generates:
            target = self.rng.choice(self.generates)
        elif roll < 0.85:
            target = self.rng.choice(list(self.sent))
        else:
            target = self.rng.choice([0, 2**64 - 1, self.last_id + 1])
        rid = self.new_id()
        self.cancels.append((rid, target))
        if target in self.expect:  # a canary or a probe cancelled by chance: that is an answer too
            self.expect[target] = self.expect[target] | {"cancelled"}
        self.send({"id": rid, "op": "cancel", "target": target})

    def do_cancel_running(self) -> None:
        """A cancel sent once the generation has streamed its first token, so that it stops it mid-way."""
        rid, session, tokens = self.new_id(), self.session(), self.tokens()
        self.expect[rid] = {"ok", "cancelled", "unknown_session", "session_closed", "too_many_requests"} | too_big(tokens, 8)
        self.send({"id": rid, "op": "generate", "session": session, "token_ids": tokens, "max_new_tokens": 8,
                   "eos_token_ids": [], "stream": True, "strategy": self.rng.choice(["greedy", "sample"])})
        assert self.recorder.wait(lambda: rid in self.recorder.by_id, 30), f"nothing for generate {rid} after 30 s"
        cancel = self.new_id()
        self.cancels.append((cancel, rid))
        self.send({"id": cancel, "op": "cancel", "target": rid})
        if session == KEEP:
            self.canary(tokens + [9])

    def do_queued(self) -> None:
        """Work on one session, then its info, its close, and work behind the close, in one write."""
        name = f"q{self.new_id()}"
        opened = {"id": self.new_id(), "op": "open_session", "session": name}
        work = {"id": self.new_id(), "op": "generate", "session": name, "token_ids": self.tokens(),
                "max_new_tokens": 8, "eos_token_ids": [], "stream": True}
        info, close = ({"id": self.new_id(), "op": op, "session": name} for op in ("session_info", "close_session"))
        after = [{"id": self.new_id(), "op": "generate", "session": name, "prompt": "x", "max_new_tokens": 2},
                 {"id": self.new_id(), "op": "session_info", "session": name}]
        gone = {"unknown_session", "too_many_requests"}  # the open may fail: max_sessions
        self.expect[opened["id"]] = {"ok", "limit_exceeded"}
        self.expect[work["id"]] = {"ok"} | gone | too_big(work["token_ids"], 8)  # 1 in 100 is 2040 tokens
        self.expect[info["id"]] = {"ok"} | gone
        self.expect[close["id"]] = {"ok"} | gone
        for message in after:
            self.expect[message["id"]] = {"session_closed"} | gone
        self.send(opened, work, info, close, *after)

    def do_duplicate(self) -> None:
        """A second request, valid or not, under the id of a generation in flight (it is until its 8 steps are
        done, and both go in one write): it must be refused as duplicate_id."""
        rid = self.new_id()
        work = {"id": rid, "op": "generate", "session": KEEP, "token_ids": self.tokens()[:16], "max_new_tokens": 8,
                "eos_token_ids": []}
        again = self.rng.choice([
            {"op": "ping"}, {"op": "session_info", "session": KEEP}, {k: v for k, v in work.items() if k != "id"},
            {"op": "no_such_op"}, {"op": "ping", "bogus": 1}, {"op": "cancel"}, {"op": "generate", "session": 7},
        ])
        self.duplicates.add(rid)
        self.send(work, {"id": rid, **again})

    def do_churn(self) -> None:
        if len(self.sessions) < 8 and self.rng.random() < 0.6:
            self.send({"id": self.new_id(), "op": "open_session", "session": self.valid("open_session", "session", "str"),
                       "model": self.valid("open_session", "model", "str")})
        elif self.sessions:
            self.send({"id": self.new_id(), "op": "close_session", "session": self.rng.choice(self.sessions)})

    def do_model(self) -> None:
        if len(self.models) < 3 and self.rng.random() < 0.6:
            self.send({"id": self.new_id(), "op": "load_model", "name": f"m{self.new_id()}", "path": None,
                       "dtype": self.valid("load_model", "dtype", "str|null")})
        elif self.models:
            self.send({"id": self.new_id(), "op": "unload_model", "model": self.rng.choice(self.models)})

    def do_misc(self) -> None:
        op = self.rng.choice(["stats", "ping", "hello", "models", "tokenize", "detokenize", "session_info"])
        self.send(self.request(op))

    def do_envelope(self) -> None:
        """Hostile ids and ops; the reply carries the id when it is valid, else null."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.15:
            return self.send(raw=rng.choice(UNDECODABLE), null=1)
        if roll < 0.3:
            return self.send(rng.choice([[], [1, "ping"], "ping", 1, None, b"\x00", {}]))
        message = self.request(rng.choice(list(OPS)))
        if roll < 0.6:
            message["id"] = rng.choice(HOSTILE)
        elif roll < 0.8:
            message["op"] = rng.choice(HOSTILE + ["PING", "ping ", "op_ping", "_close", "__init__"])
        else:
            del message[rng.choice(["id", "op"])]
        if len(pack(message)) < MAX_FRAME:
            self.send(message)

    def burst(self) -> None:
        """More session requests than max_in_flight behind one generation: the excess is refused, all answered."""
        work = {"id": self.new_id(), "op": "generate", "session": KEEP, "token_ids": [5, 6], "max_new_tokens": 8,
                "eos_token_ids": []}
        infos = [{"id": self.new_id(), "op": "session_info", "session": KEEP} for _ in range(80)]
        for message in [work, *infos]:
            self.expect[message["id"]] = {"ok", "too_many_requests"}
        self.send(work, *infos)

    def oversized(self) -> None:
        """Frames over max_frame_bytes are skipped and answered, by their id when it comes before the large value
        (else with id null); the stream stays usable."""
        rid = self.new_id()
        self.expect[rid] = {"frame_too_large"}
        self.send({"id": rid, "op": "tokenize", "text": "x" * 300_000})
        self.send(raw=pack({"text": "x" * 300_000, "id": self.new_id(), "op": "tokenize"}), null=1)

    # the checks

    def missing_report(self) -> str:
        replies = {rid: len(self.recorder.finals_of(rid)) for rid in self.sent}
        missing = [rid for rid, n in self.sent.items() if replies[rid] != n]
        return "\n".join(f"id {rid}: sent {self.sent[rid]}, final replies {replies[rid]}: {self.requests[rid]}"
                         for rid in missing[:20])


def test_hostile_values_in_well_formed_requests_leave_the_server_serving(engine, tmp_path):
    started = time.monotonic()
    log = tmp_path / "server.log"
    with open(log, "wb") as stderr, Peer(SERVER, stderr=stderr, env=SERVER_ENV) as peer:
        recorder = Recorder(peer)
        fuzz = Fuzz(peer, recorder, random.Random(SEED), log)
        fuzz.run()
        answered = recorder.wait(lambda: fuzz.owed() <= 0, 60)
        assert recorder.failure is None, f"a frame from the server could not be read: {recorder.failure!r}"
        with recorder.cond:
            by_id = {rid: [m for _, m in entries] for rid, entries in recorder.by_id.items()}
            arrival = {rid: [i for i, _ in entries] for rid, entries in recorder.by_id.items()}
        print_report(fuzz, by_id, time.monotonic() - started)

        check_no_internal_reply(fuzz, by_id, log)  # (1)
        assert answered, f"replies missing after 60 s (owed {fuzz.owed()}):\n{fuzz.missing_report()}"
        check_one_final_reply_per_request(fuzz, by_id)  # (2)
        check_known_outcomes(fuzz, by_id, arrival)
        check_canaries(fuzz, by_id, engine)  # (4), all along the fuzz
        check_nothing_left_over(fuzz, by_id)  # (3)
        check_sessions_match_a_fresh_one(fuzz, engine)  # (4), at the end
        assert fuzz.call("ping") == {"id": fuzz.last_id, "ok": True, "result": {}}  # (5)
        assert peer.close() == 0, f"exit status on EOF; server log:\n{log.read_text()[-4000:]}"
    print(f"total {time.monotonic() - started:.1f} s")
    check_protocol_rules(fuzz, by_id)


def finals_of(messages: list) -> list[dict]:
    return [m for m in messages if "ok" in m]


def code_of(reply: dict) -> str:
    return "ok" if reply["ok"] else reply["error"]["code"]


def print_report(fuzz, by_id, seconds: float) -> None:
    finals = [m for messages in by_id.values() for m in finals_of(messages)]
    codes = Counter(code_of(m) for m in finals)
    ran = [m for rid, messages in by_id.items() if fuzz.ops.get(rid) == "generate" and fuzz.sent[rid] == 1
           for m in finals_of(messages) if "token_ids" in m.get("result", m.get("error", {}))]
    print(f"\nhostile fuzz: {fuzz.frames} frames sent, {len(finals)} replies in {seconds:.1f} s")
    for code, count in codes.most_common():
        print(f"  {code:<22} {count:>6}")
    print(f"generations that ran: {sum(m['ok'] for m in ran)} finished, {sum(not m['ok'] for m in ran)} cancelled; "
          f"{len(fuzz.streaming)} asked to stream; {len(fuzz.canaries)} canaries")
    print(f"internal replies: {codes['internal']}")


def check_no_internal_reply(fuzz, by_id, log) -> None:
    internal = [(m, fuzz.requests.get(rid, "?")) for rid, messages in by_id.items() for m in finals_of(messages)
                if code_of(m) == "internal"]
    shown = "\n".join(f"{brief(m['error'])}\n  for {request}" for m, request in internal[:10])
    assert not internal, f"{len(internal)} internal replies:\n{shown}\nserver log:\n{log.read_text()[-4000:]}"


def check_one_final_reply_per_request(fuzz, by_id) -> None:
    """Every frame with a valid id got one final reply under that id (a reused id one per frame), its events
    before it; every other frame one reply with id null."""
    assert fuzz.missing_report() == "", f"wrong number of final replies:\n{fuzz.missing_report()}"
    strangers = {rid: messages for rid, messages in by_id.items() if rid is not None and rid not in fuzz.sent}
    assert not strangers, f"messages for ids never sent: {brief(strangers, 1000)}"
    nulls = by_id.get(None, [])
    assert len(nulls) == fuzz.null_expected and all(code_of(m) in NULL_CODES for m in nulls), (
        f"{len(nulls)} replies with id null for {fuzz.null_expected} frames without a valid id: "
        f"{Counter(map(brief, nulls))}")
    for rid, messages in by_id.items():
        if rid is None:
            continue
        events = [m for m in messages if "event" in m]
        if not events:
            continue
        assert rid in fuzz.streaming, f"events for id {rid}, which asked for no stream: {fuzz.requests[rid]}"
        assert all(m["event"] == "token" for m in events), f"unknown events for id {rid}: {brief(events)}"
        assert "ok" in messages[-1], f"an event after the last reply of id {rid}: {brief(messages)}"
        if fuzz.sent[rid] == 1:
            assert len(finals_of(messages)) == 1, f"id {rid}: an event after its reply: {brief(messages)}"
            check_stream(rid, messages)


def check_stream(rid, messages) -> None:
    """The token events of a generation add up to its reply (or to the partial result of a cancelled one)."""
    events, final = messages[:-1], messages[-1]
    body = final["result"] if final["ok"] else final["error"]
    if "token_ids" not in body:  # a generation that failed at a later step: the error carries no partial result
        assert not final["ok"], f"id {rid}: {brief(final)}"
        return
    assert [t for e in events for t in e["token_ids"]] == body["token_ids"], f"id {rid}: events and reply disagree"
    assert "".join(e["text"] for e in events) == body["text"], f"id {rid}: event texts and reply text disagree"


def check_known_outcomes(fuzz, by_id, arrival) -> None:
    wrong = []
    for rid, allowed in fuzz.expect.items():
        got = Counter(code_of(m) for m in finals_of(by_id.get(rid, [])))
        if not set(got) <= allowed:
            wrong.append(f"id {rid}: got {dict(got)}, expected codes in {sorted(allowed)}: {fuzz.requests[rid]}")
    assert not wrong, "unexpected outcomes:\n" + "\n".join(wrong[:20])
    for rid, target in fuzz.cancels:
        (reply,) = finals_of(by_id[rid])
        assert reply["ok"] and isinstance(reply["result"]["cancelled"], bool), f"cancel of {target}: {reply}"
        if reply["result"]["cancelled"] and fuzz.sent[target] == 1:
            (target_reply,) = finals_of(by_id[target])
            assert code_of(target_reply) == "cancelled", f"cancel {rid} said yes, but {target} got {brief(target_reply)}"
            assert arrival[target][-1] < arrival[rid][-1], f"the reply to cancel {rid} came before its target's"


def check_canaries(fuzz, by_id, engine) -> None:
    for rid, request in fuzz.canaries:
        (reply,) = finals_of(by_id[rid])
        if reply["ok"]:
            expected = fresh_tokens(engine, request)
            before = [fuzz.requests[r] for r in sorted(fuzz.sent)
                      if r < rid and f"'session': '{KEEP}'" in fuzz.requests[r]][-3:]
            assert reply["result"]["token_ids"] == expected, (
                f"KEEP gave {reply['result']['token_ids']} for {request}, a fresh session {expected}; KEEP's requests "
                f"before it:\n" + "\n".join(before))


def check_nothing_left_over(fuzz, by_id) -> None:
    """Nothing in flight; once the fuzz's own sessions and models are closed, only KEEP and the default model."""
    # and every name the server chose (a reply naming a session: an id sent again may carry another op since)
    chosen = {reply["result"]["session"] for messages in by_id.values() for reply in finals_of(messages)
              if reply["ok"] and isinstance(reply["result"].get("session"), str)}
    for name in (fuzz.session_names | chosen) - {KEEP}:
        fuzz.call("close_session", session=name)
    for name in fuzz.model_names - {"default"}:
        fuzz.call("unload_model", model=name)
    stats = fuzz.call("stats")["result"]
    print(f"evictions: {stats['models']['default']['evictions']}")
    assert (stats["in_flight"], stats["active_generations"]) == (0, 0), stats
    assert stats["sessions"] == 1 and set(stats["models"]) == {"default"}, stats
    assert stats["models"]["default"]["sessions"] == 1, stats


def check_sessions_match_a_fresh_one(fuzz, engine) -> None:
    """KEEP, after everything the fuzz did to it, and a new session give a fresh in-process session's tokens."""
    assert fuzz.call("open_session", session="fresh")["ok"]
    requests = [dict(token_ids=[5, 6, 7], max_new_tokens=8, eos_token_ids=[]),
                dict(prompt="hello world", max_new_tokens=8),
                dict(token_ids=[5, 6, 7, 9, 11], max_new_tokens=8, strategy="sample", seed=7, eos_token_ids=[]),
                dict(token_ids=[5, 6, 7, 9, 11, 13], max_new_tokens=6, eos_token_ids=[],
                     processors=[{"name": "top_k", "options": {"k": 5}},
                                 {"name": "repetition_penalty", "options": {"penalty": 1.3}}])]
    for request in requests:
        expected = fresh_tokens(engine, request)
        for name in (KEEP, "fresh"):
            reply = fuzz.call("generate", session=name, **request)
            assert reply["ok"] and reply["result"]["token_ids"] == expected, (
                f"session {name!r} after the fuzz: {brief(reply)}; a fresh session gives {expected} for {request}")


def check_protocol_rules(fuzz, by_id) -> None:
    """Rules every reply can be held to: --max-new-tokens bounds every generation, those that leave max_new_tokens
    to its default included; a request under the id of one in flight is refused as duplicate_id, whatever it carries."""
    broken = defaultdict(list)
    for rid, messages in by_id.items():
        for reply in finals_of(messages):
            made = reply.get("result", reply.get("error", {})).get("token_ids", []) if fuzz.ops.get(rid) == "generate" else []
            if len(made) > MAX_NEW_TOKENS:
                broken["max_new_tokens"].append(f"{len(made)} tokens, over --max-new-tokens {MAX_NEW_TOKENS}, for "
                                                f"{fuzz.requests[rid]}")
    for rid in sorted(fuzz.duplicates):
        codes = [code_of(m) for m in finals_of(by_id[rid])]
        if "too_many_requests" not in codes and sorted(codes) != ["duplicate_id", "ok"]:
            broken["duplicate_id"].append(f"a generation, and a second request under its id while it ran, got {codes}, "
                                          f"not ok and duplicate_id; the second: {fuzz.requests[rid]}")
    assert not broken, "replies that break the protocol:\n" + "\n".join(
        f"{len(cases)} x {rule}, e.g. {cases[0]}" for rule, cases in broken.items())


def fresh_tokens(engine, request: dict) -> list[int]:
    """What a fresh in-process session generates for a wire request (one torch thread: the server is still running)."""
    chain = [processors.from_name(p["name"], p["options"]) for p in request.get("processors", [])]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with engine.session() as reference:
            return reference.generate(**request | {"processors": chain}).token_ids
    finally:
        torch.set_num_threads(threads)
