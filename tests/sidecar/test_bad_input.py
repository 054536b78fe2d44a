"""A catalogue of bad input, one table per surface: each kind gets its typed error code and changes nothing.

Python API rows are (kind, input, code): the input is the keyword arguments of a `generate` on a primed
session, or a callable of that session for the other entry points. Protocol rows are (kind, input, code,
detail): the input is a request map (sent with a fresh id unless it brings its own), raw payload bytes,
or a scenario run against the servers; `detail` is a key the error must carry. The last test prints the
whole catalogue.
"""

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections import namedtuple
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import processors as P
from protocol import frame, pack
from protocol.peer import Peer
from protocol.schema import request_id_of
from sidecar import Engine
from sidecar.errors import SidecarError
from sidecar.sequences import Tokens

from .conftest import tokens

Ran = namedtuple("Ran", "kind surface code")
CATALOGUE: list[Ran] = []  # every row that passed, in order
MESSAGES: list = []  # every message any server sent during this module

PRIMER = tokens(12, seed=40)
DIVERGING = PRIMER[:6] + [9, 9, 9]  # shares a prefix with the primed history: a run on it crops the cache
VOCAB = 1024
INF, NAN = float("inf"), float("nan")
SUPPRESS_ALL = P.configure(P.SuppressTokens, token_ids=list(range(VOCAB)))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model gains nothing from a second thread, and on a busy machine a team of threads waiting
    for each other's cores costs most of a second per row."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def nan_from_the_third_step(logits, context):
    return logits + NAN if context.length - context.input_length >= 2 else logits


def close(session):
    session.close()


def start_a_stream(session):
    """Returns the stream, which the caller keeps: a stream dropped unfinished would end at once."""
    stream = session.stream(token_ids=PRIMER, max_new_tokens=50, eos_token_ids=[])
    next(stream)
    return stream


def edited_result(session):
    session.last.sequences[0].token_ids[0] = 2.5  # results are plain data: a caller may change them
    return session.generate(session.last)


CHAT = [{"role": "user", "content": "hi"}]
# 5,000 alternatives: llguidance's parser gives up past 2,000 items in a row, at the first token
WIDE_GRAMMAR = P.configure(P.Grammar, grammar="start: " + " | ".join(f'"w{i}"' for i in range(5000)))


def save_over_a_fifo(session):
    """A device or a FIFO under the name is refused, never replaced by a file (a FIFO: harmless to try)."""
    directory = tempfile.mkdtemp()
    path = os.path.join(directory, "fifo")
    os.mkfifo(path)
    try:
        session.save(path)
    finally:
        replaced = not stat.S_ISFIFO(os.stat(path).st_mode)
        shutil.rmtree(directory)
        assert not replaced, "the FIFO was replaced"


def save_through_a_link(session):
    """A link under the name is neither followed (a server's session directory could be left that way)
    nor replaced: what it points to stays as it was."""
    directory = tempfile.mkdtemp()
    outside, link = os.path.join(directory, "outside"), os.path.join(directory, "link")
    os.symlink(outside, link)
    try:
        session.save(link)
    finally:
        kept = os.path.islink(link) and not os.path.exists(outside)
        shutil.rmtree(directory)
        assert kept, "the link was followed or replaced"


@dataclass(frozen=True)
class LogitsOnly(P.LogitsProcessor):
    """Breaks the contract: `process` returns the logits alone, not (state, logits)."""

    name: ClassVar[str] = "logits_only"

    def init(self, context):
        return torch.zeros(context.sequence.shape[0])

    def process(self, state, logits, context):
        return logits


def calls_generate_from_a_processor(session):
    """A processor running another session of its own engine mid-step: refused (the other session stays
    as it was), and the call it ran in fails with that error, put back."""
    other = session.engine.session()

    def reenter(logits, context):
        other.generate("nested", max_new_tokens=2)
        return logits

    try:
        session.generate(token_ids=DIVERGING, processors=[reenter])
    finally:
        assert other.history == [] and other.cached == 0 and not other.busy
        other.close()


def advances_a_stream_from_a_processor(session):
    """`next()` of another stream of the same engine, from a processor, would tick inside the tick: refused,
    and that stream then runs to the very tokens it gives alone. Its prompt takes more than one tick's prefill
    budget, so it has no token yet when the processor asks (one it had would be returned without a tick)."""
    other = session.engine.session()
    prompt = tokens(2 * session.engine.prefill_chunk, seed=41)
    stream = other.stream(token_ids=prompt, max_new_tokens=3, eos_token_ids=[])

    def advance(logits, context):
        next(stream)
        return logits

    try:
        session.generate(token_ids=DIVERGING, processors=[advance])
    finally:
        tokens_after = [event.token_id for event in stream]
        other.close()
        with session.engine.session() as alone:
            expected = alone.generate(token_ids=prompt, max_new_tokens=3, eos_token_ids=[]).token_ids
        assert tokens_after == expected


# ---- the Python API ---------------------------------------------------------------------------------------

API_ROWS = [
    # generate's input
    ("prompt and token_ids both", {"prompt": "a", "token_ids": [5]}, "invalid_argument"),
    ("neither prompt nor token_ids", {"max_new_tokens": 2}, "invalid_argument"),
    ("prompt not a str", {"prompt": 42}, "invalid_argument"),
    ("prompt as bytes", {"prompt": b"abc"}, "invalid_argument"),
    ("prompt with a lone surrogate", {"prompt": "a\udcffb"}, "invalid_argument"),
    ("empty prompt", {"prompt": ""}, "empty_input"),
    ("empty token_ids", {"token_ids": []}, "empty_input"),
    ("token_ids not a list", {"token_ids": "abc"}, "invalid_argument"),
    ("negative token id", {"token_ids": [5, -1]}, "token_out_of_range"),
    ("token id == vocab size", {"token_ids": [5, VOCAB]}, "token_out_of_range"),
    ("token id 2**70", {"token_ids": [5, 2**70]}, "token_out_of_range"),
    ("bool token id", {"token_ids": [5, True]}, "invalid_argument"),
    ("float token id", {"token_ids": [5, 6.0]}, "invalid_argument"),
    # generate's options
    ("negative max_new_tokens", {"prompt": "a", "max_new_tokens": -1}, "invalid_argument"),
    ("float max_new_tokens", {"prompt": "a", "max_new_tokens": 2.0}, "invalid_argument"),
    ("bool max_new_tokens", {"prompt": "a", "max_new_tokens": True}, "invalid_argument"),
    ("input + max_new_tokens over the context", {"token_ids": [5] * 2000, "max_new_tokens": 49}, "context_overflow"),
    ("max_new_tokens 10**30", {"prompt": "a", "max_new_tokens": 10**30}, "context_overflow"),
    ("unknown strategy", {"prompt": "a", "strategy": "beem"}, "unknown_strategy"),
    ("num_beams 0", {"prompt": "a", "strategy": "beam", "num_beams": 0}, "invalid_argument"),
    ("num_beams as float", {"prompt": "a", "strategy": "beam", "num_beams": 2.0}, "invalid_argument"),
    ("num_return_sequences > num_beams", {"prompt": "a", "strategy": "beam", "num_beams": 2, "num_return_sequences": 3},
     "invalid_argument"),
    ("num_samples with greedy", {"prompt": "a", "num_samples": 3}, "invalid_argument"),
    ("beam with num_samples", {"prompt": "a", "strategy": "beam", "num_samples": 3}, "invalid_argument"),
    ("num_samples 0", {"prompt": "a", "strategy": "sample", "num_samples": 0}, "invalid_argument"),
    ("num_beams with sample", {"prompt": "a", "strategy": "sample", "num_beams": 2}, "invalid_argument"),
    ("length_penalty inf", {"prompt": "a", "strategy": "beam", "length_penalty": INF}, "invalid_argument"),
    ("length_penalty an int past float's range", {"prompt": "a", "strategy": "beam", "length_penalty": 10**400},
     "invalid_argument"),
    ("early_stopping 'sometimes'", {"prompt": "a", "strategy": "beam", "early_stopping": "sometimes"}, "invalid_argument"),
    ("stop strings with beam", {"prompt": "a", "strategy": "beam", "stop": ["x"]}, "invalid_argument"),
    ("prompt_logprobs 21", {"prompt": "a", "prompt_logprobs": 21}, "invalid_argument"),
    ("prompt_logprobs as a bool", {"prompt": "a", "prompt_logprobs": True}, "invalid_argument"),
    ("prompt_logprobs with reuse shift", {"prompt": "a", "prompt_logprobs": 1, "reuse": "shift"}, "invalid_argument"),
    ("strategy not a str", {"prompt": "a", "strategy": ["greedy"]}, "unknown_strategy"),
    ("negative seed", {"prompt": "a", "strategy": "sample", "seed": -1}, "invalid_argument"),
    ("float seed", {"prompt": "a", "strategy": "sample", "seed": 1.5}, "invalid_argument"),
    ("stop not a list", {"prompt": "a", "stop": 5}, "invalid_argument"),
    ("empty stop string", {"prompt": "a", "stop": ["x", ""]}, "invalid_argument"),
    ("non-str stop", {"prompt": "a", "stop": ["x", 5]}, "invalid_argument"),
    ("eos id == vocab size", {"prompt": "a", "eos_token_ids": [VOCAB]}, "token_out_of_range"),
    ("negative eos id", {"prompt": "a", "eos_token_ids": [-2]}, "token_out_of_range"),
    ("non-int eos id", {"prompt": "a", "eos_token_ids": ["2"]}, "invalid_argument"),
    ("processor naming a token outside the vocab",
     {"prompt": "a", "processors": [P.configure(P.SuppressTokens, token_ids=[2**63 - 1])]}, "invalid_processor"),
    ("non-processor in processors", {"prompt": "a", "processors": [42]}, "invalid_processor"),
    # a class is callable, but it is no f(logits, context): it was called with the logits as its options
    ("a processor class, not configured", {"prompt": "a", "processors": [P.TopK]}, "invalid_processor"),
    # failures after prefill, while sampling: the session must be put back
    ("every token suppressed", {"token_ids": DIVERGING, "processors": [SUPPRESS_ALL]}, "invalid_logits"),
    ("a bias then a temperature that overflow float32 to +inf",
     {"token_ids": DIVERGING, "processors": [P.from_name("sequence_bias", {"sequence_bias": [[[5], 3e38]]}),
                                             P.from_name("temperature", {"temperature": 0.5})]},
     "invalid_logits"),
    ("NaN logits at the third step",
     {"token_ids": DIVERGING, "max_new_tokens": 8, "eos_token_ids": [], "processors": [nan_from_the_third_step]},
     "invalid_logits"),
    # processors.configure / from_name
    ("processor token id 2**63", lambda s: P.configure(P.SuppressTokens, token_ids=[2**63]), "invalid_option"),
    ("temperature 0", lambda s: P.from_name("temperature", {"temperature": 0}), "invalid_option"),
    ("temperature 1e-300 (not a float32 normal)", lambda s: P.from_name("temperature", {"temperature": 1e-300}), "invalid_option"),
    ("temperature inf", lambda s: P.from_name("temperature", {"temperature": INF}), "invalid_option"),
    ("temperature nan", lambda s: P.from_name("temperature", {"temperature": NAN}), "invalid_option"),
    ("temperature 10**400", lambda s: P.from_name("temperature", {"temperature": 10**400}), "invalid_option"),
    ("temperature as str", lambda s: P.from_name("temperature", {"temperature": "1.0"}), "invalid_option"),
    ("temperature as bool", lambda s: P.from_name("temperature", {"temperature": True}), "invalid_option"),
    ("sequence_bias +inf", lambda s: P.from_name("sequence_bias", {"sequence_bias": [[[5], INF]]}), "invalid_option"),
    ("sequence_bias empty token list", lambda s: P.from_name("sequence_bias", {"sequence_bias": [[[], 1.0]]}), "invalid_option"),
    ("top_k 0", lambda s: P.from_name("top_k", {"k": 0}), "invalid_option"),
    ("top_p negative", lambda s: P.from_name("top_p", {"p": -0.5}), "invalid_option"),
    ("top_p above 1", lambda s: P.from_name("top_p", {"p": 1.5}), "invalid_option"),
    ("typical_p 1", lambda s: P.from_name("typical_p", {"p": 1.0}), "invalid_option"),
    ("min_p nan", lambda s: P.from_name("min_p", {"p": NAN}), "invalid_option"),
    ("frequency_penalty out of [-2, 2]", lambda s: P.from_name("frequency_penalty", {"penalty": 3}), "invalid_option"),
    ("no_repeat_ngram 0", lambda s: P.from_name("no_repeat_ngram", {"ngram_size": 0}), "invalid_option"),
    ("empty token_ids option", lambda s: P.from_name("suppress_tokens", {"token_ids": []}), "invalid_option"),
    ("unknown processor", lambda s: P.from_name("beam_search", {}), "invalid_option"),
    ("unknown option", lambda s: P.from_name("top_k", {"k": 5, "kk": 1}), "invalid_option"),
    ("missing option", lambda s: P.from_name("top_k", {}), "invalid_option"),
    ("configure a non-processor", lambda s: P.configure(dict, k=1), "invalid_option"),
    # the engine
    ("bad dtype in Engine.load", lambda s: Engine.load(dtype="f8"), "invalid_argument"),
    ("missing model directory", lambda s: Engine.load("/nonexistent/model"), "model_not_found"),
    ("prefill_chunk 0", lambda s: Engine(s.engine.model, s.engine.tokenizer, prefill_chunk=0), "invalid_argument"),
    ("negative cache budget", lambda s: Engine(s.engine.model, s.engine.tokenizer, cache_budget_bytes=-1), "invalid_argument"),
    ("a generation that cannot fit the cache budget",
     lambda s: Engine(s.engine.model, s.engine.tokenizer, cache_budget_bytes=1).session().generate(prompt="a"),
     "cache_budget_exceeded"),
    # the session's own state (set up by PREPARE before the snapshot)
    ("closed session", {"prompt": "a"}, "session_closed"),
    ("busy session (stream started, not finished)", {"prompt": "a"}, "session_busy"),
    # once raw exceptions instead of typed errors
    ("eos_token_ids a float", {"prompt": "a", "eos_token_ids": 1.5}, "invalid_argument"),
    ("processors not a list", {"prompt": "a", "processors": 42}, "invalid_processor"),
    ("processors a name", {"prompt": "a", "processors": "top_k"}, "invalid_processor"),  # None: the model's own
    ("seed 2**64", {"prompt": "a", "strategy": "sample", "seed": 2**64}, "invalid_argument"),
    ("from_name with a non-str name", lambda s: P.from_name(42), "invalid_option"),
    ("from_name with options not a map", lambda s: P.from_name("top_k", "k"), "invalid_option"),
    ("dtype not a str", lambda s: Engine.load(dtype=["f8"]), "invalid_argument"),
    # a torch.dtype no model computes in: invalid_model, blaming the directory, once the weights were read
    ("dtype torch.int64", lambda s: Engine.load(dtype=torch.int64), "invalid_argument"),
    ("dtype torch.float8_e4m3fn", lambda s: Engine.load(dtype=torch.float8_e4m3fn), "invalid_argument"),
    ("path not a str", lambda s: Engine.load(42), "invalid_argument"),
    ("unknown device", lambda s: Engine.load(device="nope"), "unknown_device"),
    ("a device this machine lacks", lambda s: Engine.load(device="cuda:7"), "unknown_device"),
    ("sequence bias outside float32's range", lambda s: P.from_name("sequence_bias", {"sequence_bias": [[[5], 1e300]]}),
     "invalid_option"),
    # found by an outside test of the Python API
    ("a hand-made sequence of float ids", lambda s: s.generate(Tokens((1.5, 2.5), s.engine.tokenizer)), "invalid_argument"),
    ("a result's ids edited to a float", edited_result, "invalid_argument"),
    ("unknown generate option", {"prompt": "a", "foo": 1}, "invalid_argument"),
    ("stop with a lone surrogate", {"prompt": "a", "stop": ["\ud800"]}, "invalid_argument"),
    ("a lone surrogate appended", lambda s: s.generate(s.last + "\ud800"), "invalid_argument"),
    ("continue.append_token_ids a string", lambda s: s.continuation(append_token_ids="12"), "invalid_argument"),
    ("continue.append not a string", lambda s: s.continuation(append=[12]), "invalid_argument"),
    ("a mistyped chat_template name", {"messages": CHAT, "chat_template": "defualt"}, "invalid_argument"),
    ("an empty chat_template", {"messages": CHAT, "chat_template": ""}, "invalid_argument"),
    ("a chat_template with a syntax error", {"messages": CHAT, "chat_template": "{% for %}"}, "invalid_argument"),
    ("regex with a lone surrogate", lambda s: P.configure(P.Regex, pattern="a\ud800"), "invalid_option"),
    ("choice with a lone surrogate", lambda s: P.configure(P.Choice, options=["a", "\ud800"]), "invalid_option"),
    ("a boolean JSON schema", lambda s: P.configure(P.JsonSchema, schema=True), "invalid_option"),
    ("max_rows 0", lambda s: Engine(s.engine.model, s.engine.tokenizer, max_rows=0), "invalid_argument"),
    ("max_rows a str", lambda s: Engine(s.engine.model, s.engine.tokenizer, max_rows="8"), "invalid_argument"),
    ("share_prefixes a str", lambda s: Engine(s.engine.model, s.engine.tokenizer, share_prefixes="no"), "invalid_argument"),
    ("an Engine.load option misspelt", lambda s: Engine.load(cache_budget=10), "invalid_argument"),
    ("cache budget True", lambda s: Engine(s.engine.model, s.engine.tokenizer, cache_budget_bytes=True), "invalid_argument"),
    ("save to None", lambda s: s.save(None), "invalid_argument"),
    ("save to a path with NUL", lambda s: s.save("a\0b"), "invalid_argument"),
    ("save over a FIFO", save_over_a_fifo, "save_failed"),
    ("save under a name too long", lambda s: s.save("x" * 300), "save_failed"),
    ("save through a symbolic link", save_through_a_link, "save_failed"),
    ("save to a path ending in a separator", lambda s: s.save(os.path.join(tempfile.mkdtemp(), "new") + "/"),
     "invalid_argument"),
    ("save to a path with a lone surrogate", lambda s: s.save("x\ud800"), "invalid_argument"),
    ("a lone surrogate in a message's role", {"messages": [{"role": "\ud800", "content": "x"}]}, "invalid_argument"),
    ("restore from 5", lambda s: s.engine.restore(5), "invalid_argument"),
    ("a processor returning only the logits", {"token_ids": DIVERGING, "processors": [LogitsOnly()]}, "invalid_processor"),
    ("a grammar the vocabulary cannot begin", {"prompt": "a", "processors": [P.configure(P.Grammar, grammar="start: /[^\\s\\S]/")]},
     "invalid_processor"),
    ("a grammar whose parser gives up", {"token_ids": DIVERGING, "processors": [WIDE_GRAMMAR]}, "invalid_processor"),
    ("generate called from inside a processor", calls_generate_from_a_processor, "invalid_processor"),
    ("another stream advanced from inside a processor", advances_a_stream_from_a_processor, "invalid_processor"),
]

PREPARE = {"closed session": close, "busy session (stream started, not finished)": start_a_stream}


def snapshot(session):
    return (list(session.history), session.cached, session.cache_bytes)


@pytest.fixture(scope="module")
def primed_history(engine):
    """The history of a freshly primed session, and what a fresh session generates after it."""
    with engine.session() as session:
        session.generate(token_ids=PRIMER, max_new_tokens=4, eos_token_ids=[])
        history = list(session.history)
    with engine.session() as fresh:
        follow_up = fresh.generate(token_ids=history, max_new_tokens=4, eos_token_ids=[]).token_ids
    return history, follow_up


def _ids(rows):
    return [row.id if hasattr(row, "id") else row[0] for row in rows]


@pytest.mark.parametrize("kind, given, code", API_ROWS, ids=_ids(API_ROWS))
def test_python_api(engine, primed_history, kind, given, code):
    history, expected_follow_up = primed_history
    with engine.session() as session:
        session.generate(token_ids=PRIMER, max_new_tokens=4, eos_token_ids=[])
        assert session.history == history
        prepare = PREPARE.get(kind)
        kept = prepare(session) if prepare else None  # a started stream must stay referenced until the check
        before = snapshot(session)
        with pytest.raises((SidecarError, P.ProcessorError)) as caught:
            if callable(given):
                given(session)
            else:
                session.generate(**given)
        assert caught.value.code == code, caught.value
        assert snapshot(session) == before
        del kept
        if prepare is None:
            # the session still means what it meant: same tokens as a fresh one, and the same reuse as before
            result = session.generate(token_ids=history, max_new_tokens=4, eos_token_ids=[])
            assert result.token_ids == expected_follow_up
            # `before` holds exactly `history` (asserted above), so all it cached is reusable
            assert result.stats.reused_tokens == min(before[1], len(history) - 1)
    CATALOGUE.append(Ran(kind, "python", code))


# ---- the protocol -----------------------------------------------------------------------------------------

SERVER = [sys.executable, "-m", "sidecar", "--model", "default", "--log-level", "WARNING"]
SMALL = ["--max-sessions", "3", "--max-models", "1", "--max-frame-bytes", "65536", "--max-in-flight", "3",
         "--max-sequences", "2"]
MIB = 1024 * 1024


class RecordingPeer(Peer):
    def read_message(self):
        message = super().read_message()
        MESSAGES.append(message)
        return message


@pytest.fixture(scope="module")
def servers(default_dir, tmp_path_factory):
    """`main` with default limits and a model root, `small` with tiny ones; `main` holds a primed session."""
    root = tmp_path_factory.mktemp("model-root")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as in `one_thread`
    with RecordingPeer(SERVER + ["--model-root", str(root)], env=env, stderr=subprocess.DEVNULL) as main, \
            RecordingPeer(SERVER + SMALL, env=env, stderr=subprocess.DEVNULL) as small:
        assert main.call("open_session", session="kept")["ok"]
        primed = main.call("generate", session="kept", token_ids=PRIMER, max_new_tokens=4, eos_token_ids=[])
        assert primed["ok"], primed
        yield {"main": main, "small": small, "root": root, "primed": primed["result"],
               "kept": session_info(main, "kept")}


def session_info(peer, name):
    result = peer.call("session_info", session=name)["result"]
    return result["history_tokens"], result["cached_tokens"], result["cache_bytes"]


def gen(**params):
    return {"op": "generate", "session": "kept", **params}


def processor(name, **options):
    return {"name": name, "options": options}


def nested(depth):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


def send(peer, message):
    """Sends one request map and returns its reply (an unattributable one is read as id None)."""
    if "id" not in message:
        message = {"id": peer.next_id(), **message}
    peer.send(message)
    return peer.reply_for(request_id_of(message))[1]


def raw(payload, rid=None):
    """A scenario that sends payload bytes no client library would produce; their reply comes with `rid`."""
    def scenario(s):
        s["main"].send_bytes(frame(payload))
        return s["main"].reply_for(rid)[1]
    return scenario


def on(server, message):
    return lambda s: send(s[server], message)


def long_generation(peer, session, rid):
    peer.send({"id": rid, "op": "generate", "session": session, "token_ids": [5, 6], "max_new_tokens": 1500,
               "eos_token_ids": []})


def finish_cancelled(peer, rid):
    peer.send({"id": peer.next_id(), "op": "cancel", "target": rid})
    reply = peer.reply_for(rid)[1]
    assert reply["error"]["code"] == "cancelled", reply


def max_sessions(s):
    small = s["small"]
    names = [f"full{i}" for i in range(3)]
    for name in names:
        assert small.call("open_session", session=name)["ok"]
    try:
        return send(small, {"op": "open_session", "session": "one-too-many"})
    finally:
        for name in names:
            assert small.call("close_session", session=name)["ok"]


def too_many_requests(s):
    small = s["small"]
    assert small.call("open_session", session="queue")["ok"]
    first = small.next_id()
    long_generation(small, "queue", first)
    queued = [small.next_id() for _ in range(2)]
    for rid in queued:
        small.send({"id": rid, "op": "session_info", "session": "queue"})
    reply = send(small, {"op": "session_info", "session": "queue"})
    finish_cancelled(small, first)
    for rid in queued:
        assert small.reply_for(rid)[1]["ok"]
    assert small.call("close_session", session="queue")["ok"]
    return reply


def oversized_frame(id_first):
    def scenario(s):
        small = s["small"]
        rid = small.next_id()
        message = {"id": rid, "op": "tokenize", "text": "x" * 70_000}
        if not id_first:
            message = {"text": message.pop("text"), **message}
        small.send(message)
        reply = small.reply_for(rid if id_first else None)[1]
        assert small.call("ping")["ok"]
        return reply
    return scenario


def duplicate_id(s):
    main = s["main"]
    assert main.call("open_session", session="dup")["ok"]
    rid = main.next_id()
    long_generation(main, "dup", rid)
    reply = send(main, {"id": rid, "op": "ping"})
    finish_cancelled(main, rid)
    assert main.call("close_session", session="dup")["ok"]
    return reply


def queued_behind_close(s):
    main = s["main"]
    assert main.call("open_session", session="closing")["ok"]
    running, closer, generate, info = (main.next_id() for _ in range(4))
    main.send({"id": running, "op": "generate", "session": "closing", "token_ids": [5, 6], "max_new_tokens": 32,
               "eos_token_ids": []})
    main.send({"id": closer, "op": "close_session", "session": "closing"})
    main.send({"id": generate, "op": "generate", "session": "closing", "prompt": "a"})
    main.send({"id": info, "op": "session_info", "session": "closing"})
    assert main.reply_for(running)[1]["ok"]
    assert main.reply_for(info)[1]["error"]["code"] == "session_closed"
    assert main.reply_for(closer)[1]["ok"]
    return main.reply_for(generate)[1]


def cancelled_while_queued(s):
    main = s["main"]
    assert main.call("open_session", session="waiting")["ok"]
    running, queued = main.next_id(), main.next_id()
    long_generation(main, "waiting", running)
    main.send({"id": queued, "op": "generate", "session": "waiting", "prompt": "a"})
    assert main.call("cancel", target=queued)["result"] == {"cancelled": True}
    reply = main.reply_for(queued)[1]
    finish_cancelled(main, running)
    assert main.call("close_session", session="waiting")["ok"]
    return reply


def load(path, **params):
    return {"op": "load_model", "name": "other", "path": path, **params}


def outside_the_root(s):
    return send(s["main"], load(str(s["root"].parent)))


def nul_in_path(s):
    return send(s["main"], load(f"{s['root']}/a\0b"))


def missing_in_root(s):
    return send(s["main"], load(str(s["root"] / "nope")))


def exactly(server, message, saying="", **error):
    """A scenario whose error must carry these details with these values, and a message containing `saying`."""
    def scenario(s):
        reply = send(s[server], message)
        assert reply["ok"] is False and {k: reply["error"].get(k) for k in error} == error, reply
        assert saying in reply["error"]["message"], reply
        return reply
    return scenario


def default_beams_over_max_sequences(s):
    """num_beams left out of a beam search counts as its default, 4, against max_sequences = 2: refused
    when parsed (before the session is even looked up), whatever num_return_sequences is."""
    for beams in ({}, {"num_beams": None}):
        reply = exactly("small", gen(prompt="a", strategy="beam", num_return_sequences=2, max_new_tokens=2, **beams),
                        code="limit_exceeded", limit="max_sequences", param="num_beams", max=2, value=4)(s)
    return reply


def prompt_logprobs_past_the_frame(s):
    """300 prompt tokens at k = 20 under a 64 KiB frame: refused before any work, naming prompt_logprobs; 200 fit."""
    small = s["small"]
    assert small.call("open_session", session="scored")["ok"]
    try:
        fits = small.call("generate", session="scored", token_ids=[5] * 200, max_new_tokens=1, prompt_logprobs=20)
        assert fits["ok"] and len(fits["result"]["prompt_logprobs"]) == 200, fits
        return exactly("small", gen(session="scored", token_ids=[5] * 300, max_new_tokens=1, prompt_logprobs=20),
                       code="limit_exceeded", limit="max_frame_bytes", param="prompt_logprobs", max=65536,
                       saying="prompt_logprobs 20 over a prompt of 300 tokens")(s)
    finally:
        assert small.call("close_session", session="scored")["ok"]


BAD_UTF8 = b"\x82\xa2id\x01\xa2op\xa4p\xffng"  # {"id": 1, "op": <str with an invalid UTF-8 byte>}
ENCODED_SURROGATE = b"\x82\xa2id\x01\xa2op\xa3\xed\xb3\xbf"  # a lone surrogate encoded as if UTF-8

PROTOCOL_ROWS = [
    # limits
    ("prompt over max_prompt_bytes", gen(prompt="a" * (MIB + 1)), "limit_exceeded", "limit"),
    ("tokenize text over max_prompt_bytes", {"op": "tokenize", "text": "é" * (MIB // 2 + 1)}, "limit_exceeded", "limit"),
    ("messages over max_messages", exactly("main", gen(messages=[{"role": "user", "content": ""}] * 2049),
                                            code="limit_exceeded", limit="max_messages", param="messages", max=2048,
                                            value=2049), "limit_exceeded", "limit"),
    ("token_ids over max_input_tokens", gen(token_ids=[5] * 262_145), "limit_exceeded", "limit"),
    ("continue.append_token_ids over max_input_tokens", gen(**{"continue": {"append_token_ids": [5] * 262_145}}),
     "limit_exceeded", "limit"),
    ("max_new_tokens over its limit", gen(prompt="a", max_new_tokens=32_769), "limit_exceeded", "limit"),
    ("stop strings over max_stop_bytes", gen(prompt="a", stop=["x" * 2049, "y" * 2048]), "limit_exceeded", "limit"),
    ("processors over max_processors", gen(prompt="a", processors=[processor("top_k", k=5)] * 65), "limit_exceeded", "limit"),
    ("options over max_processor_values", gen(prompt="a", processors=[processor("suppress_tokens", token_ids=[5] * 65_537)]),
     "limit_exceeded", "limit"),
    ("nesting over max_depth", gen(prompt="a", processors=[processor("top_k", k=nested(40))]), "limit_exceeded", "limit"),
    ("session name over max_name_bytes", {"op": "open_session", "session": "s" * 4097}, "limit_exceeded", "limit"),
    ("model path over max_name_bytes", load("/" + "p" * 4096), "limit_exceeded", "limit"),
    ("chat template name over max_name_bytes", gen(messages=[{"role": "user", "content": "a"}], chat_template="t" * 4097),
     "limit_exceeded", "limit"),
    ("maps of a request over max_values", gen(prompt="a", processors=[processor("dfa", initial_state=0,
                                                                                transitions=[{}] * 600_000)]),
     "limit_exceeded", "limit"),
    ("sessions over max_sessions", max_sessions, "limit_exceeded", "limit"),
    ("models over max_models", on("small", load(None)), "limit_exceeded", "limit"),
    ("requests over max_in_flight", too_many_requests, "too_many_requests", "limit"),
    ("frame over max_frame_bytes, id first", oversized_frame(id_first=True), "frame_too_large", "limit"),
    ("frame over max_frame_bytes, id last", oversized_frame(id_first=False), "frame_too_large", "limit"),
    # names
    ("id already in flight", duplicate_id, "duplicate_id", None),
    ("generate on an unknown session", gen(session="nope", prompt="a"), "unknown_session", "session"),
    ("session_info on an unknown session", {"op": "session_info", "session": "nope"}, "unknown_session", "session"),
    ("session name taken", {"op": "open_session", "session": "kept"}, "session_exists", "session"),
    ("session on an unknown model", {"op": "open_session", "model": "nope"}, "unknown_model", "model"),
    ("tokenize with an unknown model", {"op": "tokenize", "model": "nope", "text": "a"}, "unknown_model", "model"),
    ("unload an unknown model", {"op": "unload_model", "model": "nope"}, "unknown_model", "model"),
    ("model name taken", {"op": "load_model", "name": "default", "path": None}, "model_exists", "model"),
    # the envelope and the parameters
    ("max_new_tokens as a str", gen(prompt="a", max_new_tokens="5"), "invalid_params", "param"),
    ("max_new_tokens as a bool", gen(prompt="a", max_new_tokens=True), "invalid_params", "param"),
    ("max_new_tokens as a float", gen(prompt="a", max_new_tokens=2.0), "invalid_params", "param"),
    ("negative id in token_ids", gen(token_ids=[5, -1]), "invalid_params", "param"),
    ("token_ids as a str", gen(token_ids="abc"), "invalid_params", "param"),
    ("prompt as bin", gen(prompt=b"abc"), "invalid_params", "param"),
    ("negative seed (uint)", gen(prompt="a", seed=-1), "invalid_params", "param"),
    ("unknown param", gen(prompt="a", temperature=0.7), "invalid_params", "param"),
    ("non-str key in the request", {"op": "ping", 1: 2}, "invalid_params", "param"),
    ("missing required param", {"op": "generate", "prompt": "a"}, "invalid_params", "param"),
    ("processors as a map", gen(prompt="a", processors={"name": "top_k"}), "invalid_params", "param"),
    ("processor entry without a name", gen(prompt="a", processors=[{"options": {"k": 5}}]), "invalid_params", "param"),
    ("processor entry with an extra key", gen(prompt="a", processors=[{"name": "top_k", "options": {"k": 5}, "x": 1}]),
     "invalid_params", "param"),
    ("processor options not a map", gen(prompt="a", processors=[{"name": "top_k", "options": [5]}]), "invalid_params", "param"),
    ("non-str option keys", gen(prompt="a", processors=[{"name": "top_k", "options": {1: 5}}]), "invalid_params", "param"),
    ("processor entry not a map", exactly("main", gen(prompt="a", processors=[processor("top_k", k=5), "regex"]),
                                          code="invalid_params", param="processors", index=1), "invalid_params", "index"),
    ("map with a list as a key", raw(b"\x81\x91\x01\x01"), "invalid_msgpack", None),
    # msgpack but for a str's bytes: the reply names the request (its id is readable)
    ("invalid UTF-8 in a str", raw(BAD_UTF8, rid=1), "invalid_msgpack", None),
    ("lone surrogate encoded in a str", raw(ENCODED_SURROGATE, rid=1), "invalid_msgpack", None),
    ("truncated msgpack", raw(pack({"id": 1, "op": "ping"})[:-2]), "invalid_msgpack", None),
    ("lists nested deeper than msgpack's decoder reads",
     raw(b"\x83\xa2id\x07\xa2op\xa8generate\xa4stop" + b"\x91" * 2000 + b"\xa1a", rid=7), "limit_exceeded", "limit"),
    ("two msgpack values in one frame", raw(pack(1) + pack(2)), "invalid_msgpack", None),
    ("request not a map", raw(pack([1, "ping"])), "invalid_message", None),
    ("request without op", {"id": 10**9}, "invalid_message", None),
    ("request without id", {"id": None, "op": "ping"}, "invalid_id", None),
    ("negative request id", {"id": -1, "op": "ping"}, "invalid_id", None),
    ("float request id", {"id": 1.0, "op": "ping"}, "invalid_id", None),
    ("unknown op", {"op": "reboot"}, "unknown_op", "op"),
    # loading
    ("load_model outside the model roots", outside_the_root, "forbidden", "param"),
    ("trust_remote_code without --trust-remote-code", load(None, trust_remote_code=True), "forbidden", "param"),
    ("load_model of a missing directory in the root", missing_in_root, "model_not_found", "path"),
    ("load_model path with a NUL byte", nul_in_path, "invalid_argument", "option"),
    ("load_model with an unknown dtype", load(None, dtype="f8"), "invalid_argument", "option"),
    ("load_model on an unknown device", load(None, device="tpu:9"), "unknown_device", "available"),
    ("load_model on a device this machine lacks", load(None, device="cuda:7"), "unknown_device", "available"),
    # generate's values, checked by the engine
    ("prompt and token_ids both", gen(prompt="a", token_ids=[5]), "invalid_argument", "option"),
    ("empty stop string", gen(prompt="a", stop=[""]), "invalid_argument", "option"),
    ("empty prompt", gen(prompt=""), "empty_input", None),
    ("token id == vocab size", gen(token_ids=[5, VOCAB]), "token_out_of_range", "token_ids"),
    ("eos id == vocab size", gen(prompt="a", eos_token_ids=[VOCAB]), "token_out_of_range", "token_ids"),
    ("detokenize a token id == vocab size", {"op": "detokenize", "token_ids": [5, VOCAB]}, "token_out_of_range", "token_ids"),
    ("input + max_new_tokens over the context", gen(token_ids=[5] * 2000, max_new_tokens=49), "context_overflow", "limit"),
    ("unknown strategy", gen(prompt="a", strategy="beem"), "unknown_strategy", None),
    ("num_beams 0", gen(prompt="a", strategy="beam", num_beams=0), "invalid_argument", "option"),
    ("num_return_sequences > num_beams", gen(prompt="a", strategy="beam", num_beams=2, num_return_sequences=3),
     "invalid_argument", "option"),
    ("num_samples with greedy", gen(prompt="a", num_samples=3), "invalid_argument", "option"),
    ("beam with num_samples", gen(prompt="a", strategy="beam", num_samples=3), "invalid_argument", "option"),
    ("num_beams over max_sequences", gen(prompt="a", strategy="beam", num_beams=65), "limit_exceeded", "limit"),
    ("num_samples over max_sequences", gen(prompt="a", strategy="sample", num_samples=10**6), "limit_exceeded", "limit"),
    ("num_beams left out, its default over max_sequences", default_beams_over_max_sequences, "limit_exceeded", "limit"),
    ("length_penalty as a string", gen(prompt="a", strategy="beam", length_penalty="1"), "invalid_params", "param"),
    ("early_stopping 'sometimes'", gen(prompt="a", strategy="beam", early_stopping="sometimes"), "invalid_argument", "option"),
    ("prompt_logprobs 2^64-1", exactly("main", gen(prompt="a", prompt_logprobs=2**64 - 1), code="invalid_argument",
                                       option="prompt_logprobs"), "invalid_argument", "option"),
    ("prompt_logprobs as a float", gen(prompt="a", prompt_logprobs=1.0), "invalid_params", "param"),
    ("prompt_logprobs over max_frame_bytes", prompt_logprobs_past_the_frame, "limit_exceeded", "limit"),
    ("unknown processor", gen(prompt="a", processors=[processor("beam_search")]), "invalid_processor", "index"),
    ("unknown option", gen(prompt="a", processors=[processor("top_k", k=5, kk=1)]), "invalid_processor", "index"),
    ("missing option", gen(prompt="a", processors=[processor("top_k")]), "invalid_processor", "index"),
    ("temperature 0", gen(prompt="a", processors=[processor("temperature", temperature=0)]), "invalid_processor", "index"),
    ("temperature 1e-300", gen(prompt="a", processors=[processor("temperature", temperature=1e-300)]), "invalid_processor", "index"),
    ("option of the wrong type", gen(prompt="a", processors=[processor("top_k", k="5")]), "invalid_processor", "index"),
    ("processor token id 2**63", gen(prompt="a", processors=[processor("suppress_tokens", token_ids=[2**63])]),
     "invalid_processor", "index"),
    ("processor naming a token outside the vocab", gen(prompt="a", processors=[processor("suppress_tokens", token_ids=[VOCAB])]),
     "invalid_processor", None),
    ("every token suppressed", gen(token_ids=DIVERGING, processors=[processor("suppress_tokens", token_ids=list(range(VOCAB)))]),
     "invalid_logits", "processors"),
    ("a bias then a temperature that overflow float32 to +inf",
     gen(token_ids=DIVERGING, processors=[processor("sequence_bias", sequence_bias=[[[5], 3e38]]),
                                          processor("temperature", temperature=0.5)]),
     "invalid_logits", "processors"),
    ("sequence bias outside float32's range", gen(prompt="a", processors=[processor("sequence_bias", sequence_bias=[[[5], 1e300]])]),
     "invalid_processor", "index"),
    # constraints: refused when configured or compiled, before anything runs
    ("regex with look-around", gen(prompt="a", processors=[processor("regex", pattern="a(?=b)")]), "invalid_processor", "index"),
    ("regex on which llguidance's syntax check panics",  # a Rust panic is a BaseException in Python
     gen(prompt="a", processors=[processor("regex", pattern="(((é|[é-ü])|(( |.|中)|[é-ü])|\\w)){3,}")]),
     "invalid_processor", "index"),
    ("regex that matches no text", gen(prompt="a", processors=[processor("regex", pattern="[^\\x00-\\x{10FFFF}]")]),
     "invalid_processor", "index"),
    ("regex that never compiles in time",
     gen(prompt="a", processors=[processor("regex", pattern="(a|b)*a(a|b){40}", compile_timeout_s=0.3)]),
     "invalid_processor", "index"),
    ("compile_timeout_s over its bound", gen(prompt="a", processors=[processor("regex", pattern="a", compile_timeout_s=1e9)]),
     "invalid_processor", "index"),
    ("json schema that is not JSON", gen(prompt="a", processors=[processor("json_schema", schema="{oops")]),
     "invalid_processor", "index"),
    ("json schema of an unknown type", gen(prompt="a", processors=[processor("json_schema", schema={"type": "nope"})]),
     "invalid_processor", "index"),
    ("json schema with a key that is not a string",
     exactly("main", gen(prompt="a", processors=[processor("top_k", k=5),
                                                 processor("json_schema", schema={"type": "object", "properties": {1: {}}})]),
             code="invalid_processor", index=1, saying="JSON object keys must be strings, got 1 (int) in the map at /properties"),
     "invalid_processor", "index"),
    ("grammar without its rule", gen(prompt="a", processors=[processor("grammar", grammar="start: missing")]),
     "invalid_processor", "index"),
    ("choice of nothing", gen(prompt="a", processors=[processor("choice", options=[])]), "invalid_processor", "index"),
    ("dfa with two moves on one token", gen(prompt="a", processors=[processor("dfa", initial_state=0, transitions=[[0, 5, 1], [0, 5, 2]])]),
     "invalid_processor", "index"),
    ("dfa starting in a state no transition leaves", gen(prompt="a", processors=[processor("dfa", initial_state=3, transitions=[[0, 5, 1]])]),
     "invalid_processor", "index"),
    ("dfa naming a token outside the vocab", gen(prompt="a", processors=[processor("dfa", initial_state=0, transitions=[[0, VOCAB, 1]])]),
     "invalid_processor", "index"),
    ("dfa transitions over max_processor_values",
     gen(prompt="a", processors=[processor("dfa", initial_state=0, transitions=[[0, 5, 1]] * 30_000)]), "limit_exceeded", "limit"),
    ("constraint with no end token", gen(prompt="a", eos_token_ids=[], processors=[processor("regex", pattern="[0-9]+")]),
     "invalid_processor", "index"),
    # requests overtaken by their session's fate
    ("queued behind close_session", queued_behind_close, "session_closed", "session"),
    ("cancelled while queued", cancelled_while_queued, "cancelled", "stats"),
]


@pytest.mark.parametrize("kind, given, code, detail", PROTOCOL_ROWS, ids=_ids(PROTOCOL_ROWS))
def test_protocol(servers, kind, given, code, detail):
    reply = given(servers) if callable(given) else send(servers["main"], given)
    assert reply["ok"] is False, reply
    assert reply["error"]["code"] == code, reply
    if detail is not None:
        assert detail in reply["error"], reply
    assert session_info(servers["main"], "kept") == servers["kept"]
    CATALOGUE.append(Ran(kind, "protocol", code))


def test_a_generate_without_exactly_one_input_names_the_four_inputs(servers):
    for params in ({"max_new_tokens": 2}, {"prompt": "a", "continue": {}}, {"token_ids": [5], "continue": {}}):
        reply = send(servers["main"], gen(**params))
        assert reply["error"]["code"] == "invalid_argument", reply
        assert "prompt, token_ids, messages or continue" in reply["error"]["message"], reply
    assert session_info(servers["main"], "kept") == servers["kept"]


def test_the_catalogue(servers, engine, capsys, request):
    """Runs last: prints every row, checks the coverage, and that nothing was left in flight or internal."""
    main = servers["main"]
    primed = PRIMER + servers["primed"]["token_ids"]
    after = main.call("generate", session="kept", token_ids=primed, max_new_tokens=4, eos_token_ids=[])
    with engine.session() as fresh:
        expected = fresh.generate(token_ids=primed, max_new_tokens=4, eos_token_ids=[]).token_ids
    assert after["result"]["token_ids"] == expected
    assert after["result"]["stats"]["reused_tokens"] == servers["kept"][1]
    for peer in (main, servers["small"]):
        stats = peer.call("stats")["result"]
        assert stats["in_flight"] == 0 and stats["active_generations"] == 0, stats

    surfaces = {"test_python_api": "python", "test_protocol": "protocol"}
    selected = {Ran(item.callspec.params["kind"], surfaces[item.originalname], item.callspec.params["code"])
                for item in request.session.items
                if item.originalname in surfaces}
    assert selected <= set(CATALOGUE), f"rows that failed: {sorted(selected - set(CATALOGUE))}"
    internal = [m for m in MESSAGES if isinstance(m, dict) and m.get("error", {}).get("code") == "internal"]
    assert not internal, internal

    kinds = {ran.kind for ran in CATALOGUE}
    width = max((len(ran.kind) for ran in CATALOGUE), default=4)
    lines = [f"{'kind':<{width}}  {'surface':<8}  code", "-" * (width + 30)]
    lines += [f"{ran.kind:<{width}}  {ran.surface:<8}  {ran.code}" for ran in CATALOGUE]
    lines.append(f"{len(CATALOGUE)} rows, {len(kinds)} distinct kinds, "
                 f"{len({ran.code for ran in CATALOGUE})} distinct codes, {len(MESSAGES)} server messages read")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert len(kinds) >= 45, "fewer kinds of bad input ran than the issue asks for"


@pytest.mark.parametrize("chain, blamed", [([], "the model's own"), ([P.configure(P.TopK, k=5)], "or the model's own")])
def test_logits_the_model_made_nan_are_not_blamed_on_processors_alone(engine, chain, blamed):
    """A half-precision model that overflows gives NaN logits: with no processor, the message named only the
    processors (`none`) and a float32 scale."""
    from sidecar.errors import InvalidLogits

    weight = engine.model.get_output_embeddings().weight
    kept = weight[7, 0].item()
    with engine.session() as session:
        try:
            with torch.no_grad():
                weight[7, 0] = float("nan")
            with pytest.raises(InvalidLogits, match=blamed):
                session.generate(token_ids=tokens(6, seed=70), max_new_tokens=3, processors=chain)
        finally:
            with torch.no_grad():
                weight[7, 0] = kept
        assert session.history == []


def test_the_input_ids_a_result_keeps_are_checked_when_given_back(engine):
    """The ids the engine made of an input were marked as checked, and the mark went into results: appending
    an id past the vocabulary to them and generating from them was an IndexError deep in the model."""
    from sidecar.errors import TokenOutOfRange

    with engine.session() as session:
        result = session.generate(token_ids=tokens(5, seed=71), max_new_tokens=2)
        kept = result.sequences[0].prompt_ids
        kept.append(engine.vocab_size)
        with pytest.raises(TokenOutOfRange):
            session.generate(token_ids=kept, max_new_tokens=2)


def test_token_ids_of_any_integer_type_are_the_same_input(engine):
    """Plain ints are checked in one pass at C speed (a list of 262,144 took 160 ms a Python step per id); numpy's
    integers, mixed in or alone, go the per-id way and mean the same ids, and anything else among them is refused."""
    import numpy as np

    from sidecar.errors import InvalidArgument

    prompt = tokens(6, seed=72)
    with engine.session() as session:
        expected = session.generate(token_ids=prompt, max_new_tokens=3, eos_token_ids=[]).token_ids
        for given in ([np.int64(t) for t in prompt], prompt[:3] + [np.int32(t) for t in prompt[3:]], tuple(prompt)):
            assert session.generate(token_ids=given, max_new_tokens=3, eos_token_ids=[]).token_ids == expected
        for bad in (prompt + [None], prompt + [np.float32(5)], prompt + [np.bool_(True)]):
            with pytest.raises(InvalidArgument):
                session.generate(token_ids=bad, max_new_tokens=3)
