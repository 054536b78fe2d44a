"""The server as a separate process over pipes, as a BEAM Port would run it."""

import fcntl
import os
import random
import re
import subprocess
import sys
import time

import pytest

import processors as proc
from protocol import FrameDecoder, frame, pack, unpack
from protocol.peer import Peer
from sidecar.sequences import Tokens

from .conftest import shared_server

SERVER = [sys.executable, "-m", "sidecar", "--model", "default", "--log-level", "WARNING"]


def generate(peer, rid, **params):
    peer.send({"id": rid, "op": "generate", **params})


def test_prints_never_reach_the_protocol_stream(tmp_path):
    code = (
        "import os, sys; from sidecar.__main__ import protocol_fds; i, o = protocol_fds(None); "
        "print('stray print'); sys.stdout.flush(); os.write(1, b'raw fd 1'); os.write(o, b'FRAME')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert done.stdout == b"FRAME"
    assert b"stray print" in done.stderr and b"raw fd 1" in done.stderr


def test_serves_on_fds_3_and_4_like_nouse_stdio(default_dir):
    to_server_r, to_server_w = os.pipe()
    from_server_r, from_server_w = os.pipe()

    def as_fds_3_and_4():  # what Erlang's :nouse_stdio hands the child
        os.dup2(to_server_r, 3)
        os.dup2(from_server_w, 4)

    process = subprocess.Popen(
        SERVER + ["--fds", "3,4"], preexec_fn=as_fds_3_and_4, pass_fds=(3, 4),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    os.close(to_server_r)
    os.close(from_server_w)
    os.write(to_server_w, frame(pack({"id": 1, "op": "ping"})))
    decoder, replies = FrameDecoder(), []
    while not replies:
        data = os.read(from_server_r, 4096)
        assert data, "the server closed fd 4 without replying"
        replies = decoder.feed(data)
    assert unpack(replies[0]) == {"id": 1, "ok": True, "result": {}}
    os.close(to_server_w)
    assert process.wait(10) == 0 and process.stdout.read() == b""


def test_a_busy_main_thread_still_exits_soon_after_eof():
    """The reader's watchdog ends the process when the main thread is stuck (say, in a long forward pass)."""
    code = (
        "import os, time; from sidecar.transport import FrameReader, InputClosed; r, w = os.pipe(); os.close(w); "
        "FrameReader(r, 1024, InputClosed()).start(); time.sleep(30)"
    )
    started = time.monotonic()
    assert subprocess.run([sys.executable, "-c", code], timeout=20).returncode == 0
    assert time.monotonic() - started < 10


def test_empty_frames_fill_the_inbox_of_a_main_thread_that_reads_none():
    """Counted by their bytes alone, empty frames never filled it: a client that wrote them and read nothing grew
    the server by 45 MiB a second (found from outside, to 2 GiB). In a process of its own: at EOF the reader
    ends its process."""
    code = (
        "import os, time; from sidecar.transport import FRAME_COST, FrameReader, InputClosed, Inbox\n"
        "r, w = os.pipe(); reader = FrameReader(r, 1024, InputClosed()); reader.inbox = Inbox(100 * FRAME_COST)\n"
        "reader.start(); os.write(w, bytes(4 * 1000)); time.sleep(0.5); print(len(reader.inbox._frames))"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert ran.stdout.split() == ["100"], ran  # the reader waits for room


def test_eof_mid_generation_ends_the_process(peer):
    peer.call("open_session", session="a")
    generate(peer, 9, session="a", token_ids=[5, 6], max_new_tokens=1900, eos_token_ids=[], stream=True)
    for _ in range(3):
        assert peer.next_for(9)["event"] == "token"
    started = time.monotonic()
    peer.process.stdin.close()
    assert peer.process.wait(timeout=10) == 0
    print(f"exited {time.monotonic() - started:.3f} s after EOF")


@shared_server
def test_other_sessions_and_pings_are_not_held_up(peer):
    peer.call("open_session", session="long")
    peer.call("open_session", session="short")
    generate(peer, 100, session="long", token_ids=[5, 6], max_new_tokens=1500, eos_token_ids=[], stream=True)
    assert peer.next_for(100)["event"] == "token"
    # in one write: a test paused between two sends would let 102 end before 103 was even sent
    peer.send_bytes(b"".join(frame(pack(m)) for m in (
        {"id": 101, "op": "ping"},
        {"id": 102, "op": "generate", "session": "short", "token_ids": [7, 8], "max_new_tokens": 4, "eos_token_ids": []},
        {"id": 103, "op": "tokenize", "text": "hi"})))
    order = []
    while len(order) < 3:
        message = peer.read_message()
        if "event" not in message:
            order.append(message["id"])
    assert order == [101, 103, 102]
    peer.send({"id": 104, "op": "cancel", "target": 100})  # still running: the others did not wait for it
    assert peer.reply_for(100)[1]["error"]["code"] == "cancelled"
    assert peer.reply_for(104)[1]["result"] == {"cancelled": True}


@shared_server
def test_requests_for_one_session_run_in_arrival_order(peer):
    peer.call("open_session", session="s")
    generate(peer, 10, session="s", token_ids=[5, 6, 7], max_new_tokens=30, eos_token_ids=[])
    generate(peer, 11, session="s", token_ids=[5, 6, 7, 9], max_new_tokens=2, eos_token_ids=[])
    peer.send({"id": 12, "op": "session_info", "session": "s"})
    order = [peer.read_message() for _ in range(3)]
    assert [m["id"] for m in order] == [10, 11, 12]
    assert order[1]["result"]["stats"]["reused_tokens"] == 3
    assert order[2]["result"]["history_tokens"] == 6


@shared_server
def test_cancel_stops_within_a_step_and_returns_the_tokens_so_far(peer):
    peer.call("open_session", session="c")
    generate(peer, 20, session="c", token_ids=[5, 6], max_new_tokens=1500, eos_token_ids=[], stream=True)
    streamed = [peer.next_for(20)["token_ids"][0] for _ in range(3)]
    peer.send({"id": 21, "op": "cancel", "target": 20})
    events, final = peer.reply_for(20)
    streamed += [e["token_ids"][0] for e in events]
    assert final["error"]["code"] == "cancelled" and final["error"]["token_ids"] == streamed
    assert len(streamed) < 1500
    assert peer.reply_for(21)[1]["result"] == {"cancelled": True}
    assert peer.call("ping")["ok"]
    after = peer.call("generate", session="c", token_ids=[5, 6] + streamed, max_new_tokens=2, eos_token_ids=[])
    assert after["ok"] and after["result"]["stats"]["reused_tokens"] == 2 + len(streamed) - 1


@shared_server
def test_a_str_that_is_not_utf8_is_answered_on_its_request(peer):
    """msgpack that decodes but for one str's bytes still names its request: the client waiting on that id
    gets its reply (it got one with id null, and waited for ever); a request in flight is left alone."""
    import msgpack

    def not_utf8(message):  # bytes packed as msgpack str, as a careless encoder does
        peer.send_bytes(frame(msgpack.packb(message, use_bin_type=False)))

    peer.call("open_session", session="u")
    generate(peer, 30, session="u", token_ids=[5, 6], max_new_tokens=40, eos_token_ids=[], stream=True)
    first = peer.next_for(30)["token_ids"]
    not_utf8({"id": 31, "op": "generate", "session": "u", "prompt": b"caf\xe9"})
    not_utf8({"id": 32, "op": "generate", "session": "u", "prompt": "a", "processors": [
        {"name": "regex", "options": {"pattern": b"a\xc3"}}]})
    not_utf8({"id": 30, "op": "ping", "x": b"\xff"})  # the id of the generation in flight
    not_utf8({"id": -1, "op": "ping", "x": b"\xff"})  # no valid id: not attributable
    error = peer.reply_for(31)[1]["error"]
    assert error["code"] == "invalid_msgpack" and error["message"].startswith("a str at prompt is not valid UTF-8")
    error = peer.reply_for(32)[1]["error"]
    assert error["code"] == "invalid_msgpack" and "a str at processors[0].options.pattern" in error["message"]
    before, duplicate = peer.reply_for(30)
    assert duplicate["error"]["code"] == "duplicate_id"
    assert peer.reply_for(None)[1]["error"]["code"] == "invalid_msgpack"
    after, final = peer.reply_for(30)
    assert final["ok"] and final["result"]["token_ids"] == first + [t for e in before + after for t in e["token_ids"]]
    assert len(final["result"]["token_ids"]) == 40


def test_cancel_of_a_queued_request_and_shutdown_with_work_in_flight(peer):
    peer.call("open_session", session="q")
    generate(peer, 60, session="q", token_ids=[5, 6], max_new_tokens=1500, eos_token_ids=[], stream=True)
    generate(peer, 61, session="q", token_ids=[5, 6], max_new_tokens=3, eos_token_ids=[])
    generate(peer, 62, session="q", token_ids=[5, 6], max_new_tokens=3, eos_token_ids=[])
    peer.send({"id": 63, "op": "cancel", "target": 61})
    zero = {"prompt_tokens": 0, "reused_tokens": 0, "shared_tokens": 0, "shifted_tokens": 0, "prefill_tokens": 0,
            "generated_tokens": 0, "ttft_s": None, "total_s": 0.0}
    assert peer.reply_for(61)[1]["error"] == {"code": "cancelled", "message": "the generation was cancelled before it started",
                                              "token_ids": [], "text": "", "finish_reason": "cancelled", "stats": zero}
    assert peer.reply_for(63)[1]["result"] == {"cancelled": True}
    peer.send({"id": 64, "op": "shutdown"})
    assert peer.reply_for(60)[1]["error"]["code"] == "cancelled"
    assert peer.reply_for(62)[1]["error"]["code"] == "cancelled"
    assert peer.reply_for(64)[1] == {"id": 64, "ok": True, "result": {}}
    assert peer.process.wait(10) == 0


def test_a_generation_waiting_for_kv_memory_has_started_and_ran_nothing(default_dir, per_token):
    """At the head of its session's queue it has started, waiting for the memory of the generation
    before it: cancelled, or its model unloaded, it is `cancelled` with its (empty) sequences, as one
    cancelled before its first token; having run nothing, its session keeps its history and last result."""
    with Peer(SERVER + ["--cache-budget-bytes", str(60 * per_token)], stderr=subprocess.DEVNULL) as peer:
        for name in ("a", "b"):
            peer.call("open_session", session=name)
        assert peer.call("generate", session="b", token_ids=[5, 6, 7], max_new_tokens=1, eos_token_ids=[])["ok"]
        for unload in (False, True):
            running, waiting = peer.next_id(), peer.next_id()
            # 55 of the 60 tokens the budget holds, then 34 more: it waits for the first to end
            generate(peer, running, session="a", token_ids=list(range(5, 15)), max_new_tokens=45, eos_token_ids=[],
                     stream=True)
            assert "event" in peer.next_for(running)  # it has started
            generate(peer, waiting, session="b", token_ids=[5, 6, 7, 8], max_new_tokens=30, eos_token_ids=[])
            if not unload:
                assert peer.call("cancel", target=waiting)["result"] == {"cancelled": True}
                cancelled = peer.reply_for(waiting)[1]["error"]
                assert cancelled["code"] == "cancelled" and cancelled["sequences"] == [
                    {"text": "", "token_ids": [], "finish_reason": "cancelled"}]
                assert cancelled["stats"]["prefill_tokens"] == 0
                assert peer.call("session_info", session="b")["result"]["history_tokens"] == 4
                again = peer.call("generate", session="b", max_new_tokens=1, eos_token_ids=[], **{"continue": {}})
                assert again["result"]["stats"]["prompt_tokens"] == 4  # it continued the call before the cancel
                assert peer.reply_for(running)[1]["ok"]
            else:
                assert peer.call("unload_model", model="default")["ok"]
                assert peer.reply_for(waiting)[1]["error"]["code"] == "cancelled"
                assert peer.reply_for(running)[1]["error"]["code"] == "cancelled"


def test_backpressure_pauses_generation_instead_of_buffering(peer):
    fcntl.fcntl(peer.process.stdout.fileno(), 1031, 4096)  # F_SETPIPE_SZ: a small pipe fills fast
    peer.call("open_session", session="b")
    generate(peer, 30, session="b", token_ids=[5, 6], max_new_tokens=600, eos_token_ids=[], stream=True)
    pause = 1.5
    time.sleep(pause)  # read nothing: the server's writes block once the pipe is full
    events, final = peer.reply_for(30)
    assert len(events) == 600 and final["ok"]
    # it could only finish after we resumed reading, so it spent at least the pause generating
    assert final["result"]["stats"]["total_s"] >= pause


def test_fuzz_leaves_the_server_serving(peer, engine):
    peer.call("open_session", session="keep")
    rng = random.Random(1234)
    seeds = [
        {"id": 1, "op": "ping"}, {"id": 2, "op": "tokenize", "text": "hello"},
        {"id": 3, "op": "generate", "session": "nope", "prompt": "x", "max_new_tokens": 2},
        {"id": 4, "op": "session_info", "session": "keep"}, {"id": 5, "op": "detokenize", "token_ids": [5, 6]},
        {"id": 6, "op": "cancel", "target": 3}, {"id": 7, "op": "open_session", "session": "other"},
        {"id": 8, "op": "stats"},
    ]
    frames = 0
    for n in range(10_000):
        kind = rng.random()
        if kind < 0.3:
            payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40)))
        else:
            payload = bytearray(pack(rng.choice(seeds)))
            for _ in range(rng.randint(1, 4)):
                payload[rng.randrange(len(payload))] = rng.getrandbits(8)
            if rng.random() < 0.2:
                del payload[rng.randrange(len(payload)) :]
            payload = bytes(payload)
        peer.send_bytes(frame(payload))
        frames += 1
        if n % 200 == 199:  # keep the pipes from filling: collect what has been answered so far
            rid = peer.next_id()
            peer.send({"id": 10**12 + rid, "op": "ping"})
            peer.reply_for(10**12 + rid)
    assert frames >= 10_000
    peer.send({"id": 2**63, "op": "ping"})  # replies come in order: after this one, the fuzz is all answered
    assert peer.reply_for(2**63)[1] == {"id": 2**63, "ok": True, "result": {}}
    peer._messages.clear()
    peer._next_id = 2**62  # beyond any id a mutated frame can carry
    assert peer.call("ping")["ok"]
    reply = peer.call("generate", session="keep", token_ids=[5, 6, 7], max_new_tokens=8, eos_token_ids=[])
    assert reply["ok"], reply
    with engine.session() as fresh:
        expected = fresh.generate(token_ids=[5, 6, 7], max_new_tokens=8, eos_token_ids=[])
    assert reply["result"]["token_ids"] == expected.token_ids


def test_serves_both_ways_on_one_socket(default_dir):
    """--fds N,N on a socket: the writer's non-blocking mode is shared with the reader, which must cope."""
    import socket

    ours, theirs = socket.socketpair()
    process = subprocess.Popen(SERVER + ["--fds", f"{theirs.fileno()},{theirs.fileno()}"], pass_fds=[theirs.fileno()],
                               stderr=subprocess.DEVNULL)
    theirs.close()
    ours.sendall(frame(pack({"id": 1, "op": "ping"})))
    decoder, replies = FrameDecoder(), []
    while not replies:
        data = ours.recv(4096)
        assert data, "the server closed the socket without replying"
        replies = decoder.feed(data)
    assert unpack(replies[0]) == {"id": 1, "ok": True, "result": {}}
    ours.shutdown(socket.SHUT_WR)
    assert process.wait(10) == 0


def test_eight_sessions_at_once_through_the_server_equal_their_solo_runs(peer, engine):
    from .conftest import tokens

    prompts = [tokens(n, seed=n) for n in (4, 13, 27, 40, 66, 90, 130, 200)]
    for i in range(8):
        assert peer.call("open_session", session=f"c{i}")["ok"]
    for i, prompt in enumerate(prompts):
        generate(peer, 500 + i, session=f"c{i}", token_ids=prompt, max_new_tokens=10, eos_token_ids=[], stream=i % 2 == 0)
    for i, prompt in enumerate(prompts):
        events, reply = peer.reply_for(500 + i)
        with engine.session() as solo:
            expected = solo.generate(token_ids=prompt, max_new_tokens=10, eos_token_ids=[]).token_ids
        assert reply["result"]["token_ids"] == expected
        assert [e["token_ids"][0] for e in events] == (expected if i % 2 == 0 else [])
    assert peer.call("stats")["result"]["models"]["default"]["cache_peak_bytes"] > 0


@shared_server
def test_sessions_sharing_a_prefix_while_its_owner_closes_equal_cold_runs(peer, engine):
    """Pipelined sessions continue one session's prefix while that session and one of them are closed
    mid-flight; each result equals a fresh session of an engine that shares nothing. no_repeat_ngram
    makes every step depend on the order of the logits, not only on the top one (a random model)."""
    from sidecar import Engine

    from .conftest import tokens

    cold = Engine(engine.model, engine.tokenizer, share_prefixes=False)
    strict = [{"name": "no_repeat_ngram", "options": {"ngram_size": 1}}]
    head = tokens(120, seed=7)
    peer.call("open_session", session="owner")
    peer.call("generate", session="owner", token_ids=head + [7, 8], max_new_tokens=4, eos_token_ids=[],
              processors=strict)
    peer.call("open_session", session="first")  # shares the owner's cache, which becomes a shared entry now
    assert peer.call("generate", session="first", token_ids=head + [9], max_new_tokens=1,
                     eos_token_ids=[])["result"]["stats"]["shared_tokens"] == len(head)
    inputs = {f"s{i}": head + tokens(5 + i, seed=100 + i) for i in range(5)}
    for name in inputs:
        peer.call("open_session", session=name)
    for i, (name, ids) in enumerate(inputs.items()):
        generate(peer, 700 + i, session=name, token_ids=ids, max_new_tokens=8, eos_token_ids=[], stream=True,
                 processors=strict)
    peer.send({"id": 710, "op": "close_session", "session": "owner"})
    peer.send({"id": 711, "op": "close_session", "session": "s0"})
    for i, (name, ids) in enumerate(inputs.items()):
        reply = peer.reply_for(700 + i)[1]["result"]
        with cold.session() as fresh:
            expected = fresh.generate(token_ids=ids, max_new_tokens=8, eos_token_ids=[],
                                      processors=[proc.configure(proc.NoRepeatNGram, ngram_size=1)])
        assert reply["stats"]["shared_tokens"] == len(head) and reply["token_ids"] == expected.token_ids
    assert peer.reply_for(710)[1]["ok"] and peer.reply_for(711)[1]["ok"]
    again = peer.call("generate", session="s3", token_ids=inputs["s3"] + [11, 12], max_new_tokens=4,
                      eos_token_ids=[], processors=strict)["result"]
    with cold.session() as fresh:
        expected = fresh.generate(token_ids=inputs["s3"] + [11, 12], max_new_tokens=4, eos_token_ids=[],
                                  processors=[proc.configure(proc.NoRepeatNGram, ngram_size=1)])
    assert again["token_ids"] == expected.token_ids
    stats = peer.call("stats")["result"]["models"]["default"]
    assert stats["shared_prefixes"] >= 1 and stats["cache_peak_bytes"] <= stats["cache_budget_bytes"]


@shared_server
def test_beams_and_samples_through_the_server_equal_the_python_api(peer, engine):
    from .conftest import tokens

    prompt = tokens(15, seed=3)
    peer.call("open_session", session="b")
    beams = peer.call("generate", session="b", token_ids=prompt, strategy="beam", num_beams=3, num_return_sequences=2,
                      max_new_tokens=6, length_penalty=0.5, early_stopping="never")["result"]
    rid = peer.next_id()
    generate(peer, rid, session="b", token_ids=prompt, strategy="sample", num_samples=3, seed=4, max_new_tokens=5,
             eos_token_ids=[], stream=True)
    events, samples = peer.reply_for(rid)
    with engine.session() as s:
        expected = s.generate(token_ids=prompt, strategy="beam", num_beams=3, num_return_sequences=2, max_new_tokens=6,
                              length_penalty=0.5, early_stopping="never")
        drawn = s.generate(token_ids=prompt, strategy="sample", num_samples=3, seed=4, max_new_tokens=5, eos_token_ids=[])
    assert [q["token_ids"] for q in beams["sequences"]] == [q.token_ids for q in expected.sequences]
    assert [q["score"] for q in beams["sequences"]] == pytest.approx([q.score for q in expected.sequences])
    assert [q["token_ids"] for q in samples["result"]["sequences"]] == [q.token_ids for q in drawn.sequences]
    for index, sequence in enumerate(samples["result"]["sequences"]):
        assert "".join(e["text"] for e in events if e["sequence"] == index) == sequence["text"]


@shared_server
def test_constraints_by_name_through_the_server(peer):
    """Clients cannot send a tokenizer: they name the constraint, and the server binds it to its model."""
    import json
    import re

    peer.call("open_session", session="c")
    phone = peer.call("generate", session="c", prompt="Call", max_new_tokens=24,
                      processors=[{"name": "regex", "options": {"pattern": r"[0-9]{3}-[0-9]{4}"}}])["result"]
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone["text"]) and phone["finish_reason"] == "eos"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    rid = peer.next_id()
    generate(peer, rid, session="c", prompt="JSON", max_new_tokens=40, strategy="sample", seed=2, num_samples=3,
             stream=True, processors=[{"name": "json_schema", "options": {"schema": schema}}])
    events, reply = peer.reply_for(rid)
    for index, sequence in enumerate(reply["result"]["sequences"]):
        assert isinstance(json.loads(sequence["text"])["ok"], bool)
        assert "".join(e["text"] for e in events if e["sequence"] == index) == sequence["text"]
    # a schema llguidance runs (outlines-core would ignore the bounds), and one neither backend enforces
    bounded = {"type": "integer", "minimum": 10, "maximum": 99}
    reply = peer.call("generate", session="c", prompt="N", max_new_tokens=8, strategy="sample", seed=3, num_samples=4,
                      processors=[{"name": "json_schema", "options": {"schema": bounded}}])["result"]
    assert all(10 <= json.loads(s["text"]) <= 99 and s["finish_reason"] == "eos" for s in reply["sequences"]), reply
    bad = peer.call("generate", session="c", prompt="x", processors=[{"name": "regex", "options": {"pattern": "(?<=a)b"}}])
    assert bad["error"]["code"] == "invalid_processor" and bad["error"]["index"] == 0
    assert "look-around" in bad["error"]["message"]
    bad = peer.call("generate", session="c", prompt="x", processors=[{"name": "json_schema", "options": {"schema": {"not": {}}}}])
    assert bad["error"]["code"] == "invalid_processor" and 'Unimplemented keys: ["not"]' in bad["error"]["message"]
    names = set(peer.call("hello")["result"]["capabilities"]["processors"])
    assert {"regex", "choice", "json_schema", "grammar", "dfa"} <= names


def test_a_slow_compile_holds_up_only_its_own_session(peer):
    """Constraints compile on another thread: other sessions stream meanwhile, and the compiling session's
    later requests wait their turn behind it."""
    for name in ("slow", "other"):
        peer.call("open_session", session=name)
    slow, behind, other = peer.next_id(), peer.next_id(), peer.next_id()
    generate(peer, slow, session="slow", prompt="a", max_new_tokens=4,
             processors=[{"name": "regex", "options": {"pattern": "(a|b)*a(a|b){40}", "compile_timeout_s": 3}}])
    generate(peer, behind, session="slow", prompt="a", max_new_tokens=2)
    generate(peer, other, session="other", prompt="a", max_new_tokens=8, stream=True)
    replies = {rid: peer.reply_for(rid)[1] for rid in (slow, behind, other)}
    assert [rid for rid in peer.replied if rid in replies] == [other, slow, behind]
    assert replies[slow]["error"]["code"] == "invalid_processor" and "compile_timeout_s" in replies[slow]["error"]["message"]
    assert replies[behind]["ok"] and replies[other]["ok"]


def children(pid: int) -> set[int]:
    found = set()
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:  # it ended meanwhile
        return found
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children") as listing:
                found.update(int(child) for child in listing.read().split())
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return found


def compiling(pid: int) -> set[int]:
    """The server's compiling processes: the children of its one child, the fork server its compiles are
    forked from (started at its first compile)."""
    return {grandchild for child in children(pid) for grandchild in children(child)}


def one(found: set[int]) -> set[int] | None:
    return found if len(found) == 1 else None


def wait_until(condition):
    """Polls a condition that must turn true by construction (every compile is bounded by its timeout)."""
    while not (value := condition()):
        time.sleep(0.02)
    return value


def test_compiles_run_side_by_side_and_a_cancelled_one_is_killed_and_forgotten(peer):
    """A pathological constraint (60 s of compiling) on one session does not hold up a simple one on
    another: the simple one's reply comes first. Cancelling the generate that waits for the pathological
    one kills its compiling child instead of letting it run out its timeout, and remembers nothing: the
    same request compiles again (had the child been left to time out, that failure would be remembered
    and answer the request at once)."""
    pid = peer.process.pid
    for name in ("a", "b"):
        peer.call("open_session", session=name)
    assert children(pid) == set()  # no compile yet: no fork server either
    slow = [{"name": "regex", "options": {"pattern": "(a|b)*a(a|b){40}", "compile_timeout_s": 60}}]
    stuck, quick = peer.next_id(), peer.next_id()
    generate(peer, stuck, session="a", prompt="x", max_new_tokens=4, processors=slow)
    generate(peer, quick, session="b", prompt="Call", max_new_tokens=8,
             processors=[{"name": "regex", "options": {"pattern": "[0-9]{3}"}}])
    reply = peer.reply_for(quick)[1]
    assert reply["ok"] and re.fullmatch("[0-9]{3}", reply["result"]["text"])
    assert stuck not in peer.replied
    (child,) = wait_until(lambda: one(compiling(pid)))  # the simple compile's child has ended

    assert peer.call("cancel", target=stuck)["result"]["cancelled"]
    assert peer.reply_for(stuck)[1]["error"]["code"] == "cancelled"
    wait_until(lambda: not compiling(pid))
    assert not os.path.exists(f"/proc/{child}")

    again = peer.next_id()
    generate(peer, again, session="a", prompt="x", max_new_tokens=4, processors=slow)
    assert peer.call("ping")["ok"] and again not in peer.replied  # it waits: no failure was remembered
    (other,) = wait_until(lambda: one(compiling(pid)))  # for a compile of its own
    assert other != child
    assert peer.call("cancel", target=again)["result"]["cancelled"]
    assert peer.reply_for(again)[1]["error"]["code"] == "cancelled"
    wait_until(lambda: not compiling(pid))
    assert peer.call("stats")["result"]["in_flight"] == 0


def test_a_compile_two_requests_wait_for_runs_on_when_one_is_cancelled(peer):
    """Two sessions' generates wait for the same constraint, compiled once: cancelling one while it
    compiles (about 2 s here) leaves the compile to the other, which gets its automaton and runs."""
    shared = [{"name": "regex", "options": {"pattern": "(a|b)*a(a|b){15}", "compile_timeout_s": 60}}]
    for name in ("c1", "c2"):
        peer.call("open_session", session=name)
    first, second = peer.next_id(), peer.next_id()
    generate(peer, first, session="c1", prompt="x", max_new_tokens=24, processors=shared)
    generate(peer, second, session="c2", prompt="x", max_new_tokens=24, processors=shared)
    started = wait_until(lambda: compiling(peer.process.pid))  # the one compile has started
    assert peer.call("cancel", target=first)["result"]["cancelled"]
    cancelled = peer.reply_for(first)[1]["error"]
    assert cancelled["code"] == "cancelled" and "before it started" in cancelled["message"]  # while compiling
    assert compiling(peer.process.pid) <= started  # the same child compiles on (or has ended), no other
    reply = peer.reply_for(second)[1]
    assert reply["ok"] and reply["result"]["token_ids"] and re.fullmatch("[ab]*", reply["result"]["text"])
    assert peer.replied.index(first) < peer.replied.index(second)
    wait_until(lambda: not compiling(peer.process.pid))  # it ended once it had sent its tables


def test_fork_save_and_restore_sessions_by_name(default_dir, tmp_path):
    """Saved sessions are files the server names: clients give names, never paths; a restore in another
    server process continues exactly as the saved session would."""
    server = SERVER + ["--session-dir", str(tmp_path / "saved")]
    prompt = list(range(5, 60))
    with Peer(server, stderr=subprocess.DEVNULL) as peer:
        peer.call("open_session", session="a")
        rid = peer.next_id()
        generate(peer, rid, session="a", token_ids=prompt, max_new_tokens=5, eos_token_ids=[])
        saved = peer.call("save_session", session="a", name="chat-1")  # queued behind the generate
        first = peer.reply_for(rid)[1]["result"]
        assert saved["result"]["history_tokens"] == len(prompt) + 5
        fork = peer.call("fork_session", session="a", new="b")["result"]
        assert fork["session"] == "b" and fork["cached_tokens"] == saved["result"]["cached_tokens"]
        follow = prompt + first["token_ids"] + [9]
        in_fork = peer.call("generate", session="b", token_ids=follow, max_new_tokens=6, eos_token_ids=[])["result"]
        assert in_fork["stats"]["reused_tokens"] == fork["cached_tokens"]
        assert peer.call("restore_session", name="chat-1", session="a")["error"]["code"] == "session_exists"
        assert peer.call("restore_session", name="nope")["error"]["code"] == "invalid_session_file"
        empty = peer.call("restore_session", name="chat-1", session="")["error"]  # a saved name, no session name
        assert (empty["code"], empty.get("option")) == ("invalid_argument", "session"), empty
        # a name is 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit: a str of another
        # value is invalid_argument (the shape is right, the value is not), as PROTOCOL.md's guide to codes says
        for bad in ("../a", "a/b", "", ".hidden", "-a", "a b", "é", "x" * 129, "x" * 4096):
            for op, params in (("save_session", {"session": "a"}), ("restore_session", {})):
                error = peer.call(op, name=bad, **params)["error"]
                assert (error["code"], error.get("option")) == ("invalid_argument", "name"), (op, bad, error)
        assert peer.call("save_session", session="a", name="x" * 4097)["error"]["limit"] == "max_name_bytes"
        for good in ("x" * 128, "A.b_c-9", "0"):
            assert peer.call("save_session", session="a", name=good)["ok"], good
    with Peer(server, stderr=subprocess.DEVNULL) as peer:  # another process
        restored = peer.call("restore_session", name="chat-1", session="c")["result"]
        assert restored["history_tokens"] == len(prompt) + 5
        again = peer.call("generate", session="c", token_ids=follow, max_new_tokens=6, eos_token_ids=[])["result"]
        assert again["token_ids"] == in_fork["token_ids"] and again["stats"]["reused_tokens"] == restored["cached_tokens"]
    path = tmp_path / "saved" / "chat-1.safetensors"
    path.write_bytes(path.read_bytes()[:-64])
    with Peer(server, stderr=subprocess.DEVNULL) as peer:
        reply = peer.call("restore_session", name="chat-1")
        assert reply["error"]["code"] == "invalid_session_file" and "is truncated" in reply["error"]["message"]
        assert peer.call("stats")["result"]["sessions"] == 0


def test_requests_pipelined_for_a_fork_wait_for_it(default_dir):
    """A fork's new name is taken when the fork arrives: requests for it sent right behind (the fork
    itself waiting behind a generate of its source) run once the fork has, in order; when the fork
    fails, each of them is answered unknown_session before the fork's own error, and nothing leaks."""
    with Peer(SERVER + ["--max-sessions", "3"], stderr=subprocess.DEVNULL) as peer:
        peer.call("open_session", session="a")
        running, fork, info, follow, taken, over = (peer.next_id() for _ in range(6))
        generate(peer, running, session="a", token_ids=list(range(5, 40)), max_new_tokens=8, eos_token_ids=[])
        peer.send({"id": fork, "op": "fork_session", "session": "a", "new": "b"})
        peer.send({"id": info, "op": "session_info", "session": "b"})
        generate(peer, follow, session="b", token_ids=list(range(5, 40)) + [9], max_new_tokens=3, eos_token_ids=[])
        peer.send({"id": taken, "op": "open_session", "session": "b"})
        peer.send({"id": over, "op": "fork_session", "session": "a", "new": "c"})  # a, b and c: at the limit
        assert peer.reply_for(taken)[1]["error"]["code"] == "session_exists"
        assert peer.call("open_session", session="d")["error"]["limit"] == "max_sessions"  # b and c are claimed
        first = peer.reply_for(running)[1]["result"]
        assert peer.reply_for(fork)[1]["result"]["history_tokens"] == 35 + 8
        assert peer.reply_for(info)[1]["result"]["history_tokens"] == 35 + 8
        assert peer.reply_for(follow)[1]["result"]["stats"]["reused_tokens"] == 35
        assert peer.replied.index(fork) < peer.replied.index(info) < peer.replied.index(follow)
        assert peer.reply_for(over)[1]["ok"]
        assert first["token_ids"]

        # the fork fails: its source is closed before it runs (the close waiting behind a generate)
        assert peer.call("close_session", session="b")["ok"]
        busy, close, doomed, waiting = (peer.next_id() for _ in range(4))
        generate(peer, busy, session="c", token_ids=[5, 6, 7], max_new_tokens=16, eos_token_ids=[])
        peer.send({"id": close, "op": "close_session", "session": "c"})
        peer.send({"id": doomed, "op": "fork_session", "session": "c", "new": "x"})
        generate(peer, waiting, session="x", token_ids=[5, 6, 7], max_new_tokens=2, eos_token_ids=[])
        assert peer.reply_for(doomed)[1]["error"]["code"] == "session_closed"
        error = peer.reply_for(waiting)[1]["error"]
        assert error["code"] == "unknown_session" and error["session"] == "x" and "fork_session" in error["message"]
        assert peer.reply_for(close)[1]["ok"] and peer.reply_for(busy)[1]["ok"]
        assert peer.replied.index(waiting) < peer.replied.index(doomed) < peer.replied.index(close)
        stats = peer.call("stats")["result"]
        assert stats["in_flight"] == 0 and stats["sessions"] == 1
        assert peer.call("open_session", session="x")["ok"]  # the name is free again

        # a fork pending when the input ends: the server exits cleanly
        generate(peer, peer.next_id(), session="a", token_ids=list(range(5, 60)), max_new_tokens=64, eos_token_ids=[])
        peer.send({"id": peer.next_id(), "op": "fork_session", "session": "a", "new": "y"})
        generate(peer, peer.next_id(), session="y", token_ids=[5, 6], max_new_tokens=2, eos_token_ids=[])
        assert peer.close() == 0


def test_saving_is_off_without_a_session_dir(peer):
    peer.call("open_session", session="a")
    assert peer.call("save_session", session="a", name="x")["error"]["code"] == "forbidden"
    assert peer.call("restore_session", name="x")["error"]["code"] == "forbidden"


def test_session_limits_and_requests_overtaken_while_compiling_or_closing(default_dir, tmp_path):
    """What a clumsy client pushes past or leaves behind: max_saved_sessions (replacing a saved name is
    still allowed at the limit), max_sessions through fork and restore, a save queued behind a close, and
    a generate cancelled or closed while its constraint compiles."""
    server = SERVER + ["--session-dir", str(tmp_path), "--max-saved-sessions", "1", "--max-sessions", "2"]
    slow = [{"name": "regex", "options": {"pattern": "(a|b)*a(a|b){40}", "compile_timeout_s": 2}}]
    with Peer(server, stderr=subprocess.DEVNULL) as peer:
        peer.call("open_session", session="a")
        peer.call("generate", session="a", token_ids=[5, 6, 7], max_new_tokens=2, eos_token_ids=[])
        assert peer.call("save_session", session="a", name="one")["ok"]
        full = peer.call("save_session", session="a", name="two")["error"]
        assert full["code"] == "limit_exceeded" and full["limit"] == "max_saved_sessions"
        assert peer.call("save_session", session="a", name="one")["ok"]  # a replacement, not a new one
        assert sorted(p.name for p in tmp_path.iterdir()) == ["one.safetensors"]
        assert peer.call("fork_session", session="a", new="b")["ok"]
        for reply in (peer.call("fork_session", session="a"), peer.call("restore_session", name="one")):
            assert reply["error"]["code"] == "limit_exceeded" and reply["error"]["limit"] == "max_sessions"
        assert peer.call("stats")["result"]["sessions"] == 2

        # a close and a save queued behind a generate: the close runs when the generate is done, and
        # answers the save behind it session_closed before its own reply
        running, close, save = peer.next_id(), peer.next_id(), peer.next_id()
        generate(peer, running, session="b", token_ids=[5, 6, 7], max_new_tokens=64, eos_token_ids=[])
        peer.send({"id": close, "op": "close_session", "session": "b"})
        peer.send({"id": save, "op": "save_session", "session": "b", "name": "one"})
        assert peer.reply_for(save)[1]["error"]["code"] == "session_closed"
        assert peer.reply_for(close)[1]["ok"] and peer.replied.index(save) < peer.replied.index(close)
        assert peer.reply_for(running)[1]["ok"]

        # a generate cancelled while its constraint compiles: cancelled at once; the session goes on
        compiling = peer.next_id()
        generate(peer, compiling, session="a", prompt="x", max_new_tokens=2, processors=slow)
        assert peer.call("cancel", target=compiling)["result"]["cancelled"]
        assert peer.reply_for(compiling)[1]["error"]["code"] == "cancelled"
        plain = peer.call("generate", session="a", token_ids=[5, 6], max_new_tokens=2, eos_token_ids=[])
        assert plain["ok"]

        # a close behind a compiling generate waits its turn (arrival order): the generate gets its
        # compile's error, then the close its reply, and nothing is left in flight
        peer.call("open_session", session="c")
        compiling = peer.next_id()
        generate(peer, compiling, session="c", prompt="x", max_new_tokens=2, processors=slow)
        assert peer.call("close_session", session="c")["ok"]
        assert peer.reply_for(compiling)[1]["error"]["code"] == "invalid_processor"
        stats = peer.call("stats")["result"]
        assert stats["in_flight"] == 0 and stats["sessions"] == 1


@shared_server
def test_huge_length_penalties_reply_with_a_result(peer):
    """length ** 1000.0 overflows a float (transformers raises there); it is taken as inf, the scores are
    their limit, -0.0, and every reply carries finite scores (a peer may refuse non-finite floats)."""
    peer.call("open_session", session="lp")
    for length_penalty in (1000.0, 1e308, -1e308):
        reply = peer.call("generate", session="lp", prompt="The quick brown fox", strategy="beam", num_beams=3,
                          num_return_sequences=2, length_penalty=length_penalty, max_new_tokens=4, eos_token_ids=[])
        assert "result" in reply, (length_penalty, reply)
        scores = [s["score"] for s in reply["result"]["sequences"]]
        assert len(scores) == 2 and all(-1e9 <= score <= 0.0 for score in scores), (length_penalty, scores)
        if length_penalty > 0:
            assert [len(s["token_ids"]) for s in reply["result"]["sequences"]] == [4, 4] and scores == [0.0, 0.0]


@shared_server
@pytest.mark.parametrize("options, count", [
    (dict(strategy="sample", num_samples=4, seed=1), 4),
    (dict(strategy="beam", num_beams=4, num_return_sequences=3), 3),
], ids=["4 samples", "3 of 4 beams"])
def test_max_new_tokens_0_lists_every_sequence_and_continue_names_the_last(peer, engine, options, count):
    peer.call("open_session", session="z")
    result = peer.call("generate", session="z", prompt="hi", max_new_tokens=0, **options)["result"]
    empty = {"text": "", "token_ids": [], "finish_reason": "length", **({"score": 0.0} if options["strategy"] == "beam" else {})}
    assert result["sequences"] == [empty] * count and result["finish_reason"] == "length"
    reply = peer.call("generate", session="z", max_new_tokens=2, eos_token_ids=[], **{"continue": {"sequence": count - 1}})
    assert "result" in reply, reply
    ids = engine.tokenizer.encode("hi")
    with engine.session() as reference:
        assert reply["result"]["token_ids"] == reference.generate(token_ids=ids, max_new_tokens=2, eos_token_ids=[]).token_ids
    assert reply["result"]["stats"]["reused_tokens"] == len(ids) - 1  # the prompt, all but the last token fed again


@shared_server
def test_continue_names_a_sequence_of_the_last_result(peer, engine):
    """`continue` is read when the request reaches the head of its session's queue: pipelined behind a
    generate, it continues that one's result. Bad values are typed errors and change nothing."""
    peer.call("open_session", session="q")
    assert peer.call("generate", session="q", max_new_tokens=2, **{"continue": {}})["error"] == {
        "code": "invalid_argument", "option": "continue", "message": "the session has no result to continue: it has not "
        "generated yet"}
    sampled, continued = peer.next_id(), peer.next_id()
    generate(peer, sampled, session="q", prompt="Once upon a time", strategy="sample", num_samples=3, seed=9,
             max_new_tokens=5, eos_token_ids=[])
    generate(peer, continued, session="q", max_new_tokens=4, eos_token_ids=[],
             **{"continue": {"sequence": 2, "tokens": -1, "append": " and"}})
    samples, reply = peer.reply_for(sampled)[1]["result"], peer.reply_for(continued)[1]["result"]
    prompt = engine.tokenizer.encode("Once upon a time")
    ids = prompt + samples["sequences"][2]["token_ids"][:-1] + engine.tokenizer.encode(" and", add_special_tokens=False)
    with engine.session() as reference:
        assert reply["token_ids"] == reference.generate(token_ids=ids, max_new_tokens=4, eos_token_ids=[]).token_ids
    assert reply["stats"]["reused_tokens"] == len(prompt)  # samples leave the input cached, not sample 2's tokens
    info = peer.call("session_info", session="q")["result"]
    bad = [
        ({"sequence": 1}, {"code": "sample_mismatch", "option": "continue.sequence", "sequences": 1}),
        ({"tokens": len(ids) + 5}, {"code": "invalid_argument", "option": "continue.tokens"}),
        ({"tokens": -(2**63)}, {"code": "invalid_argument", "option": "continue.tokens"}),
        ({"tokens": 0}, {"code": "empty_input"}),
        ({"chars": 10**6}, {"code": "invalid_argument", "option": "continue.chars"}),
        ({"tokens": 2, "chars": 2}, {"code": "invalid_argument", "option": "continue"}),
        ({"append": "a", "append_token_ids": [1]}, {"code": "invalid_argument", "option": "continue"}),
        ({"append_token_ids": [10**6]}, {"code": "token_out_of_range"}),
        ({"append_token_ids": [5] * 3000}, {"code": "context_overflow"}),
        ({"tokens": "2"}, {"code": "invalid_params", "param": "continue.tokens"}),
        ({"sequence": -1}, {"code": "invalid_params", "param": "continue.sequence"}),
        ({"bogus": 1}, {"code": "invalid_params", "param": "continue.bogus"}),
        ({1: 1}, {"code": "invalid_params", "param": "continue.int 1"}),
        ({"append": "x" * (1 << 20)}, {"code": "limit_exceeded", "limit": "max_prompt_bytes", "param": "continue"}),
        ({"append_token_ids": [5] * 262_145},
         {"code": "limit_exceeded", "limit": "max_input_tokens", "param": "continue.append_token_ids", "value": 262_145}),
        ({"append_token_ids": "12"}, {"code": "invalid_params", "param": "continue.append_token_ids"}),
        ([], {"code": "invalid_params", "param": "continue"}),
    ]
    for value, expected in bad:
        error = peer.call("generate", session="q", max_new_tokens=2, **{"continue": value})["error"]
        assert {k: error.get(k) for k in expected} == expected, (value, error)
    for both in ({"prompt": "x"}, {"token_ids": [5]}, {"messages": [{"role": "user", "content": "x"}]}):
        error = peer.call("generate", session="q", **both, **{"continue": {}})["error"]
        assert (error["code"], error["option"]) == ("invalid_argument", "prompt"), both
    assert peer.call("session_info", session="q")["result"] == info
    again = peer.call("generate", session="q", max_new_tokens=3, eos_token_ids=[], **{"continue": {"chars": 9}})["result"]
    cut = Tokens(tuple(ids + reply["token_ids"]), engine.tokenizer).cut(9)  # the last good result's, cut
    with engine.session() as reference:
        assert again["token_ids"] == reference.generate(cut, max_new_tokens=3, eos_token_ids=[]).token_ids
    assert again["stats"]["reused_tokens"] == len(cut) - 1


def test_max_sequences_bounds_the_rows_of_a_generation_above_the_engines_default(default_dir):
    """The rows a generation may decode are the server's max_sequences, also above the engine's default of 64."""
    with Peer(SERVER + ["--max-sequences", "70"], stderr=subprocess.DEVNULL) as peer:
        peer.call("open_session", session="a")
        reply = peer.call("generate", session="a", token_ids=[5, 6, 7], strategy="sample", num_samples=65, seed=1,
                          max_new_tokens=1, eos_token_ids=[])
        assert len(reply["result"]["sequences"]) == 65
        error = peer.call("generate", session="a", token_ids=[5, 6, 7], strategy="sample", num_samples=71,
                          max_new_tokens=1)["error"]
        assert (error["code"], error["limit"], error["value"]) == ("limit_exceeded", "max_sequences", 71)


@pytest.mark.parametrize("ends", ["run", "fail"])
def test_a_chain_of_a_thousand_pipelined_forks_is_answered_whole(default_dir, ends):
    """Each fork of a chain waits for the one before, behind a generate of the first source: when they
    run (or the first fails, its source closed), the chain unwinds without recursion; the server lives on,
    every request is answered and nothing stays reserved."""
    chain = 1010  # over Python's recursion limit
    with Peer(SERVER, stderr=subprocess.DEVNULL) as peer:
        peer.call("open_session", session="a")
        first = peer.next_id()
        generate(peer, first, session="a", token_ids=list(range(5, 40)), max_new_tokens=16, eos_token_ids=[])
        if ends == "fail":
            peer.send({"id": peer.next_id(), "op": "close_session", "session": "a"})
        forks, source = [], "a"
        for i in range(chain):
            forks.append(peer.next_id())
            peer.send({"id": forks[-1], "op": "fork_session", "session": source, "new": f"f{i}"})
            source = f"f{i}"
        assert peer.reply_for(first)[1]["ok"]
        codes = [peer.reply_for(rid)[1].get("error", {}).get("code", "ok") for rid in forks]
        stats = peer.call("stats")["result"]
        if ends == "run":
            assert codes == ["ok"] * chain and stats["sessions"] == chain + 1
        else:
            assert codes == ["session_closed"] + ["unknown_session"] * (chain - 1) and stats["sessions"] == 0
            assert [peer.replied.index(rid) for rid in forks] == sorted((peer.replied.index(rid) for rid in forks), reverse=True)
        assert stats["in_flight"] == 0
        assert peer.call("open_session", session=f"f{chain - 1}")["ok"] == (ends == "fail")


def test_a_large_input_is_tokenized_while_the_other_sessions_go_on(peer, engine):
    """A tokenizer takes about a second for a megabyte (it lets go of the GIL): a tokenize of that much, or a
    generate whose prompt it is, held every session for that second. Both now run on another thread: a
    generation of 10 tokens (tens of milliseconds) sent just before ends first, and what was sent after the
    tokenize is still answered after it."""
    text = "héllo wörld, the quick brown fox " * 29_000  # about 1 MB: 0.6-2 s of the tokenizer here
    expected = engine.tokenizer.encode(text)
    peer.call("open_session", session="short")
    peer.call("open_session", session="long")
    short = {"op": "generate", "session": "short", "token_ids": [5, 6], "max_new_tokens": 10, "eos_token_ids": []}
    peer.send_bytes(b"".join(frame(pack(m)) for m in (
        {"id": 1, **short}, {"id": 2, "op": "tokenize", "text": text}, {"id": 3, "op": "ping"})))
    replies = [peer.read_message() for _ in range(3)]
    assert [m["id"] for m in replies] == [1, 2, 3]
    assert replies[1]["result"]["token_ids"] == expected
    peer.send_bytes(b"".join(frame(pack(m)) for m in (
        {"id": 4, **short}, {"id": 5, "op": "generate", "session": "long", "prompt": text, "max_new_tokens": 1})))
    replies = [peer.read_message() for _ in range(2)]
    assert [m["id"] for m in replies] == [4, 5]
    assert replies[1]["error"]["code"] == "context_overflow" and replies[1]["error"]["value"] == len(expected) + 1


def test_a_generate_of_a_large_frame_makes_its_input_aside_with_the_same_result(peer, engine):
    """Past 16 KiB a generate's input is made on the configuring thread (`continue` reading the last result
    there): here a processor that never applies makes the frame large, and each input gives what it gives
    in a small frame, errors included."""
    never = {"name": "no_bad_words", "options": {"bad_words_ids": [[200] * 9000 + [201]]}}  # 18 KB, no match
    peer.call("open_session", session="small")
    peer.call("open_session", session="large")
    inputs = [{"prompt": "Once upon a time"}, {"messages": [{"role": "user", "content": "Hi there"}]},
              {"continue": {"tokens": -1, "append": " and then"}}, {"token_ids": [5, 6, 7]},
              {"continue": {"sequence": 3}}, {"prompt": ""}, {"prompt": "x", "chat_template": "bogus"},
              {"prompt": "x", "add_generation_prompt": True}, {"prompt": "x", "token_ids": [5]}]
    for given in inputs:
        small, large = (peer.call("generate", session=session, max_new_tokens=6, eos_token_ids=[], **given,
                                  processors=[never] if session == "large" else [])
                        for session in ("small", "large"))
        if small["ok"]:
            assert large["ok"] and large["result"]["token_ids"] == small["result"]["token_ids"], given
        else:
            assert large["error"] == small["error"], given
    assert peer.call("session_info", session="large")["result"]["history_tokens"] == \
        peer.call("session_info", session="small")["result"]["history_tokens"]


def test_an_unload_while_a_large_input_is_made_frees_the_model(default_dir):
    """The thread making a large input held its session, so its engine: an unload_model meanwhile found the
    model still referred to, froze it with the heap, and its memory never came back."""
    peer = Peer(SERVER, stderr=subprocess.PIPE)
    try:
        text = "héllo wörld, the quick brown fox " * 29_000  # about a second of the tokenizer
        peer.send_bytes(b"".join(frame(pack(m)) for m in (
            {"id": 1, "op": "load_model", "name": "second"},
            {"id": 2, "op": "open_session", "model": "second", "session": "s"},
            {"id": 3, "op": "generate", "session": "s", "prompt": text, "max_new_tokens": 1},
            {"id": 4, "op": "unload_model", "model": "second"})))
        replies = {m["id"]: m for m in (peer.read_message() for _ in range(4))}
        assert replies[3]["error"]["code"] == "session_closed" and replies[4]["result"] == {"closed_sessions": ["s"]}
    finally:
        assert peer.close() == 0
    stderr = peer.process.stderr.read().decode()
    assert "still referred to" not in stderr and "Traceback" not in stderr, stderr


def test_a_large_tokenize_or_detokenize_that_fails_is_answered_aside_in_its_turn(peer, engine):
    """Answered on a thread of its own, a refusal is still one typed reply, before what was sent after it."""
    many = [5] * 20_000 + [engine.vocab_size]  # past 16,384 ids, the last outside the vocabulary
    peer.send_bytes(b"".join(frame(pack(m)) for m in (
        {"id": 1, "op": "detokenize", "token_ids": many},
        {"id": 2, "op": "tokenize", "text": "x" * 20_000, "model": "nobody"},
        {"id": 3, "op": "ping"})))
    replies = [peer.read_message() for _ in range(3)]
    assert [m["id"] for m in replies] == [1, 2, 3]
    assert replies[0]["error"]["code"] == "token_out_of_range" and replies[0]["error"]["token_ids"] == [engine.vocab_size]
    assert replies[1]["error"]["code"] == "unknown_model" and replies[2]["ok"]


def test_a_cancel_behind_a_large_input_being_made_answers_it_and_changes_nothing(peer):
    """The cancel arrives while the configuring thread tokenizes (about a second): the generate is answered
    cancelled, with nothing run; the input made after is dropped, and the session serves on as it was."""
    peer.call("open_session", session="c")
    first = peer.call("generate", session="c", token_ids=[5, 6, 7], max_new_tokens=2, eos_token_ids=[])["result"]
    text = "héllo wörld, the quick brown fox " * 29_000
    peer.send_bytes(b"".join(frame(pack(m)) for m in (
        {"id": 10, "op": "generate", "session": "c", "prompt": text, "max_new_tokens": 1},
        {"id": 11, "op": "cancel", "target": 10})))
    replies = {m["id"]: m for m in (peer.read_message() for _ in range(2))}
    assert replies[10]["error"]["code"] == "cancelled" and replies[11]["result"] == {"cancelled": True}
    info = peer.call("session_info", session="c")["result"]
    assert info["history_tokens"] == 3 + len(first["token_ids"])
    again = peer.call("generate", session="c", token_ids=[5, 6, 7], max_new_tokens=2, eos_token_ids=[])["result"]
    assert again["token_ids"] == first["token_ids"] and again["stats"]["reused_tokens"] == 2


def test_a_model_loaded_with_a_smaller_prefill_chunk_lets_the_other_models_stream_between_its_chunks(peer):
    """The loaded models take their ticks in turn, so one tick of a model's prompt held every other model's
    stream (a large model's 512-token chunk: 0.8-1.7 s between another's tokens). A model's own smaller
    `prefill_chunk` splits its prompts into more ticks, with the other models' steps between them; more
    than the server's is refused before anything loads, since it bounds a pass's memory."""
    assert peer.call("load_model", name="chunked", prefill_chunk=8)["result"]["prefill_chunk"] == 8
    assert peer.call("load_model", name="whole")["result"]["prefill_chunk"] == 512  # the server's
    refused = peer.call("load_model", name="over", prefill_chunk=513)["error"]
    assert (refused["code"], refused["limit"], refused["max"], refused["value"]) == ("limit_exceeded", "prefill_chunk", 512, 513)
    refused = peer.call("load_model", name="zero", prefill_chunk=0)["error"]
    assert (refused["code"], refused["option"]) == ("invalid_argument", "prefill_chunk")
    assert [m["name"] for m in peer.call("models")["result"]["models"]] == ["default", "chunked", "whole"]

    peer.call("open_session", session="streaming")
    generate(peer, 100, session="streaming", token_ids=[5, 6], max_new_tokens=2000, eos_token_ids=[], stream=True)
    assert peer.next_for(100)["event"] == "token"
    between = {}
    for rid, model in ((101, "whole"), (102, "chunked")):
        peer.call("open_session", model=model, session=model)
        generate(peer, rid, session=model, token_ids=list(range(5, 205)), max_new_tokens=1, eos_token_ids=[])
        between[model] = 0
        while True:  # the stream's tokens until the 200-token prompt's reply
            message = peer.read_message()
            if message["id"] == rid:
                assert message["ok"] and len(message["result"]["token_ids"]) == 1
                break
            assert message["id"] == 100 and message["event"] == "token"
            between[model] += 1
    assert between["chunked"] >= 24 > between["whole"], between  # its 25 ticks, with the stream's steps between
    peer.send({"id": 103, "op": "cancel", "target": 100})
    assert peer.reply_for(100)[1]["error"]["code"] == "cancelled"


@shared_server
def test_logprobs_over_the_protocol(peer):
    """Each sequence, the top level and each event carry them; refused before any work where the reply could not fit."""
    session = peer.call("open_session")["result"]["session"]
    rid = peer.next_id()
    peer.send({"id": rid, "op": "generate", "session": session, "prompt": "Hello", "max_new_tokens": 4,
               "eos_token_ids": [], "logprobs": 2, "stream": True, "strategy": "sample", "seed": 7, "num_samples": 2})
    events, reply = peer.reply_for(rid)
    body = reply["result"]
    assert (body["logprobs"], body["top_logprobs"]) == (body["sequences"][0]["logprobs"], body["sequences"][0]["top_logprobs"])
    for index, sequence in enumerate(body["sequences"]):
        mine = [e for e in events if e["sequence"] == index]
        assert [e["logprob"] for e in mine] == sequence["logprobs"] and len(sequence["logprobs"]) == 4
        assert [e["top_logprobs"] for e in mine] == sequence["top_logprobs"]
        assert all(len(pairs) == 2 and all(len(p) == 2 for p in pairs) for pairs in sequence["top_logprobs"])
    plain = peer.call("generate", session=session, prompt="Hello", max_new_tokens=2)["result"]
    assert "logprobs" not in plain and "top_logprobs" not in plain["sequences"][0] and "prompt_logprobs" not in plain
    # the prompt's: its ids (the client sent text), and one entry each, nil for the first; the cache not reused
    scored = peer.call("generate", session=session, prompt="Hello there", max_new_tokens=0, prompt_logprobs=3)["result"]
    ids = peer.call("tokenize", text="Hello there")["result"]["token_ids"]
    assert scored["prompt_token_ids"] == ids and scored["stats"]["reused_tokens"] == 0
    assert len(scored["prompt_logprobs"]) == len(scored["prompt_top_logprobs"]) == len(ids) > 1
    assert scored["prompt_logprobs"][0] is None and scored["prompt_top_logprobs"][0] is None
    assert all(lp <= 0 and len(top) == 3 and top[0][1] >= lp for lp, top in
               zip(scored["prompt_logprobs"][1:], scored["prompt_top_logprobs"][1:]))
    refused = peer.call("generate", session=session, prompt="Hello", max_new_tokens=2000, logprobs=20,
                        strategy="sample", num_samples=64)["error"]
    assert (refused["code"], refused["limit"], refused["param"]) == ("limit_exceeded", "max_frame_bytes", "logprobs")
    assert refused["value"] > refused["max"]
    beams = peer.call("generate", session=session, token_ids=[5, 6], max_new_tokens=3, logprobs=1, strategy="beam",
                      num_return_sequences=2, eos_token_ids=[])["result"]
    assert [len(s["logprobs"]) for s in beams["sequences"]] == [3, 3] and beams["logprobs"] == beams["sequences"][0]["logprobs"]
    refused = peer.call("generate", session=session, token_ids=[5, 6], max_new_tokens=2000, logprobs=20,
                        strategy="beam", num_beams=64)["error"]  # each beam counts, however few come back
    assert (refused["code"], refused["param"]) == ("limit_exceeded", "logprobs")
    for huge in (21, 10**6, 2**64 - 1):  # (helper-87) weighed by the frame check first: an internal error past 2^64
        refused = peer.call("generate", session=session, prompt="Hello", max_new_tokens=2000, logprobs=huge)["error"]
        assert (refused["code"], refused["option"]) == ("invalid_argument", "logprobs")
