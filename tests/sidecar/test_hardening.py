"""No request can poison a session or the server, and every request is answered exactly once.

Each test replays a failure found from the outside (a fuzz, a client written from PROTOCOL.md alone, a
catalogue of bad inputs) and checks it against an independent reference: a fresh session's tokens, the
session's own state before the failed call, or the request ids that were sent.
"""

import os
import subprocess
import sys
import time

import pytest
import torch

import processors as P
from protocol import frame, pack, unpack
from protocol.peer import Peer
from sidecar import errors

from .conftest import server_on_a_thread, shared_server

SERVER = [sys.executable, "-m", "sidecar", "--model", "default", "--log-level", "ERROR"]
POISON = {"name": "suppress_tokens", "options": {"token_ids": [2**63]}}


def finals(peer, ids) -> dict:
    """The final reply of each id (events skipped)."""
    return {rid: peer.reply_for(rid)[1] for rid in ids}


def replies_in_order(peer, count: int) -> list[dict]:
    """The next `count` final replies, in the order they arrive (events skipped)."""
    replies = []
    while len(replies) < count:
        message = peer.read_message()
        if "event" not in message:
            replies.append(message)
    return replies


def fresh_tokens(engine, **request) -> list[int]:
    with engine.session() as session:
        return session.generate(**request).token_ids


# ---- poisoning -------------------------------------------------------------------------------------

@shared_server
def test_a_bad_processor_option_does_not_poison_the_session(peer, engine):
    peer.call("open_session", session="p")
    bad = peer.call("generate", session="p", token_ids=[5, 6], processors=[POISON])
    assert bad["error"]["code"] == "invalid_processor" and bad["error"]["index"] == 0
    assert "2^63" in bad["error"]["message"]
    request = dict(token_ids=[5, 6, 7], max_new_tokens=4, eos_token_ids=[])
    assert peer.call("generate", session="p", **request)["result"]["token_ids"] == fresh_tokens(engine, **request)
    assert peer.call("session_info", session="p")["ok"]
    assert peer.call("close_session", session="p")["ok"]
    assert peer.call("stats")["result"]["in_flight"] == 0


@shared_server
def test_a_bad_request_queued_behind_a_running_generation_is_answered_and_the_server_lives(peer):
    peer.call("open_session", session="q")
    peer.send({"id": 10, "op": "generate", "session": "q", "token_ids": [5, 6], "max_new_tokens": 20, "eos_token_ids": []})
    peer.send({"id": 11, "op": "generate", "session": "q", "token_ids": [5, 6], "processors": [POISON]})
    deep = bytes([0x91]) * 1000 + b"\x01"  # a list nested 1,000 deep, as option k
    body = pack({"id": 12, "op": "generate", "session": "q", "prompt": "x"})
    body = bytes([body[0] + 1]) + body[1:] + pack("processors") + b"\x91\x82" + pack("name") + pack("top_k") + pack("options") + b"\x81" + pack("k") + deep
    peer.send_bytes(frame(body))
    peer.send({"id": 13, "op": "session_info", "session": "q"})
    got = finals(peer, [10, 11, 12, 13])
    assert got[10]["ok"] and len(got[10]["result"]["token_ids"]) == 20
    assert got[11]["error"]["code"] == "invalid_processor"
    assert got[12]["error"]["code"] == "limit_exceeded" and got[12]["error"]["limit"] == "max_depth"
    assert got[12]["error"]["value"] == 1004  # the request, processors, a processor, options, then k's lists
    assert got[13]["result"]["history_tokens"] == 22
    assert peer.call("ping")["ok"] and peer.process.poll() is None


@shared_server
def test_a_request_of_more_values_than_max_values_is_refused_as_it_is_decoded(peer):
    """A 16 MiB frame of empty maps took 60 s and 2.7 GB before its list was found too long, and one of nils
    was not counted at all (found from outside): both stop at the limit now, with their ids."""
    peer.call("open_session", session="v")
    for rid, items in ((20, [{}] * 600_000), (21, [None] * 600_000)):
        peer.send({"id": rid, "op": "generate", "session": "v", "prompt": "x",
                   "processors": [{"name": "dfa", "options": {"initial_state": 0, "transitions": items}}]})
    got = finals(peer, [20, 21])
    for rid in (20, 21):
        assert got[rid]["error"]["code"] == "limit_exceeded" and got[rid]["error"]["limit"] == "max_values", got[rid]
    assert peer.call("session_info", session="v")["result"]["history_tokens"] == 0


def test_max_values_counts_maps_lists_and_their_elements():
    from protocol import ProtocolError

    body = pack({"id": 1, "op": "x", "a": [[1, 2], {}]})  # the request 1 + 3, a 1 + 2, [1, 2] 1 + 2, {} 1
    assert unpack(body, 32, 11)["a"] == [[1, 2], {}]
    with pytest.raises(ProtocolError) as caught:
        unpack(body, 32, 10)
    assert (caught.value.request_id, caught.value.details) == (1, {"limit": "max_values", "max": 10, "value": 11})


# ---- every request answered ------------------------------------------------------------------------

@shared_server
def test_requests_queued_behind_close_session_are_answered(peer):
    peer.call("open_session", session="c")
    peer.send({"id": 20, "op": "generate", "session": "c", "token_ids": [5, 6], "max_new_tokens": 30, "eos_token_ids": []})
    peer.send({"id": 21, "op": "close_session", "session": "c"})
    peer.send({"id": 22, "op": "session_info", "session": "c"})
    peer.send({"id": 23, "op": "generate", "session": "c", "token_ids": [5], "max_new_tokens": 2})
    replies = replies_in_order(peer, 4)
    order, got = [m["id"] for m in replies], {m["id"]: m for m in replies}
    assert got[20]["ok"] and got[21] == {"id": 21, "ok": True, "result": {}}
    for rid in (22, 23):
        assert got[rid]["error"]["code"] == "session_closed" and got[rid]["error"]["session"] == "c"
    assert order == [20, 22, 23, 21], "requests a close ends are answered before the close itself"
    assert peer.call("stats")["result"]["in_flight"] == 0
    assert peer.call("session_info", session="c")["error"]["code"] == "unknown_session"


def test_unload_model_answers_every_request_of_its_sessions_first(peer):
    assert peer.call("load_model", name="m2", path=None)["ok"]
    peer.call("open_session", model="m2", session="u1")
    peer.call("open_session", model="m2", session="u2")
    peer.send({"id": 30, "op": "generate", "session": "u1", "token_ids": [5, 6], "max_new_tokens": 1500,
               "eos_token_ids": [], "stream": True})
    assert peer.next_for(30)["event"] == "token"
    peer.send({"id": 31, "op": "generate", "session": "u1", "token_ids": [5], "max_new_tokens": 2})
    peer.send({"id": 32, "op": "close_session", "session": "u1"})
    peer.send({"id": 33, "op": "session_info", "session": "u2"})
    peer.send({"id": 34, "op": "unload_model", "model": "m2"})
    replies = replies_in_order(peer, 5)
    got = {m["id"]: m for m in replies}
    assert got[30]["error"]["code"] == "cancelled" and got[30]["error"]["finish_reason"] == "cancelled"
    assert got[31]["error"]["code"] == got[32]["error"]["code"] == "session_closed"
    assert got[33]["ok"]  # session_info on an idle session ran before the unload
    # u1's close_session waited behind its generation: the unload closed both
    assert replies[-1] == {"id": 34, "ok": True, "result": {"closed_sessions": ["u1", "u2"]}}
    stats = peer.call("stats")["result"]
    assert stats["in_flight"] == 0 and stats["sessions"] == 0 and "m2" not in stats["models"]


def test_too_many_requests_is_answered_and_counts_only_queued_work(default_dir):
    with Peer(SERVER + ["--max-in-flight", "2"], stderr=subprocess.DEVNULL) as peer:
        peer.call("open_session", session="t")
        for rid in (40, 41, 42):
            peer.send({"id": rid, "op": "generate", "session": "t", "token_ids": [5], "max_new_tokens": 3, "eos_token_ids": []})
        peer.send({"id": 43, "op": "ping"})
        got = finals(peer, [40, 41, 42, 43])
        assert got[40]["ok"] and got[41]["ok"] and got[43]["ok"]
        assert got[42]["error"]["code"] == "too_many_requests" and got[42]["error"]["limit"] == "max_in_flight"


# ---- a failed call leaves the session exactly as it was -------------------------------------------

def snapshot(session):
    n = session.cached
    tensors = [(k[:, :, :n].clone(), v[:, :, :n].clone()) for k, v in zip(session.cache.keys, session.cache.values)] if n else []
    return list(session.history), n, tensors


def assert_same(before, after):
    assert after[0] == before[0] and after[1] == before[1]
    assert len(after[2]) == len(before[2])
    for (k0, v0), (k1, v1) in zip(before[2], after[2]):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


class FailsAtStep:
    """A processor that raises at a given step: a stand-in for any failure in the middle of a generation."""

    def __init__(self, step):
        self.step, self.calls = step, 0

    def __call__(self, logits, context):
        self.calls += 1
        if self.calls == self.step:
            raise RuntimeError("boom")
        return logits


@pytest.mark.parametrize("failure", ["all suppressed", "raises at step 4"])
@pytest.mark.parametrize("follow_up", ["extends", "diverges"])
def test_a_failed_generation_restores_history_and_cache(any_engine, failure, follow_up):
    history = list(range(10, 40))
    with any_engine.session() as session:
        session.generate(token_ids=history, max_new_tokens=6, eos_token_ids=[])
        before = snapshot(session)
        prompt = before[0] + [7, 8] if follow_up == "extends" else history[:12] + [9, 9, 9]
        if failure == "all suppressed":
            chain, expected = [P.configure(P.SuppressTokens, token_ids=list(range(any_engine.vocab_size)))], errors.InvalidLogits
        else:
            chain, expected = [FailsAtStep(4)], RuntimeError
        with pytest.raises(expected):
            session.generate(token_ids=prompt, max_new_tokens=8, eos_token_ids=[], processors=chain)
        assert_same(before, snapshot(session))
        again = session.generate(token_ids=prompt, max_new_tokens=5, eos_token_ids=[])
    with any_engine.session() as fresh:
        fresh.generate(token_ids=history, max_new_tokens=6, eos_token_ids=[])
        reference = fresh.generate(token_ids=prompt, max_new_tokens=5, eos_token_ids=[])
    assert again.token_ids == reference.token_ids
    assert again.stats.reused_tokens == reference.stats.reused_tokens


def test_invalid_logits_names_the_processors(engine):
    with engine.session() as session:
        with pytest.raises(errors.InvalidLogits, match=r"processors \(temperature, suppress_tokens\): every token was removed"):
            session.generate(token_ids=[5, 6], processors=[
                P.configure(P.Temperature, temperature=0.5), P.configure(P.SuppressTokens, token_ids=list(range(1024)))])
        assert session.history == [] and session.cached == 0


def test_cancel_before_the_first_step_runs_nothing(engine):
    with engine.session() as session:
        session.generate(token_ids=[5, 6, 7], max_new_tokens=2, eos_token_ids=[])
        before = snapshot(session)
        generation = session.stream(token_ids=[9, 9, 9, 9], max_new_tokens=4)
        generation.cancel()
        assert generation.result.finish_reason == "cancelled" and generation.result.stats.prefill_tokens == 0
        assert_same(before, snapshot(session))


def test_max_new_tokens_zero_prefills_the_input_for_the_next_call(engine):
    with engine.session() as session:
        warm = session.generate(token_ids=list(range(10, 50)), max_new_tokens=0)
        assert (warm.token_ids, warm.finish_reason, warm.stats.prefill_tokens) == ([], "length", 40)
        assert session.cached == 40
        follow = session.generate(token_ids=list(range(10, 50)) + [7], max_new_tokens=3, eos_token_ids=[])
        assert follow.stats.reused_tokens == 40
    assert follow.token_ids == fresh_tokens(engine, token_ids=list(range(10, 50)) + [7], max_new_tokens=3, eos_token_ids=[])


def test_a_lone_surrogate_in_a_prompt_is_a_typed_error(engine):
    with engine.session() as session:
        with pytest.raises(errors.InvalidArgument, match="lone surrogate at index 1"):
            session.generate("a\udcffb")


# ---- sizes: nothing over a limit is worked on, no reply over the frame limit ----------------------

def test_an_oversized_prompt_is_refused_by_its_id_and_the_connection_stays_usable(default_dir):
    with Peer(SERVER + ["--max-frame-bytes", "65536"], stderr=subprocess.DEVNULL) as peer:
        peer.send({"id": 50, "op": "generate", "session": "none", "prompt": "x" * 5_000_000})
        error = peer.reply_for(50)[1]["error"]
        assert error["code"] == "frame_too_large" and error["limit"] == "max_frame_bytes"
        assert error["max"] == 65536 and error["value"] > 5_000_000
        assert peer.call("ping")["ok"]


def test_a_reply_over_the_frame_limit_becomes_a_typed_error(default_dir, engine):
    """Any reply; a generate's, finished or cancelled, fails as a whole: its session is as it was, the last
    result that `continue` reads included (the session used to keep what no reply had carried)."""
    with Peer(SERVER + ["--max-frame-bytes", "65536"], stderr=subprocess.DEVNULL) as peer:
        text = "".join(chr(0x4E00 + i) for i in range(21_000))  # CJK: several tokens per character
        reply = peer.call("tokenize", text=text)
        assert reply["error"]["code"] == "limit_exceeded" and reply["error"]["limit"] == "max_frame_bytes"
        assert reply["error"]["value"] > 65536
        assert peer.call("ping")["ok"]

        longest = max(range(3, engine.vocab_size), key=lambda t: len(engine.tokenizer.decode([t])))
        wordy = {"strategy": "sample", "seed": 1, "num_samples": 64, "eos_token_ids": [],
                 "processors": [{"name": "sequence_bias", "options": {"sequence_bias": [[[longest], 1e30]]}}]}
        assert peer.call("open_session", session="s")["ok"]
        assert peer.call("generate", session="s", prompt="Hi", max_new_tokens=2)["ok"]
        before = peer.call("session_info", session="s")["result"]
        too_large = peer.call("generate", session="s", prompt="Hi there", max_new_tokens=60, **wordy)["error"]
        assert too_large["code"] == "limit_exceeded" and too_large["limit"] == "max_frame_bytes", too_large
        assert too_large["value"] > 65536 and too_large["max"] == 65536
        assert peer.call("session_info", session="s")["result"] == before
        continued = peer.call("generate", session="s", max_new_tokens=1, **{"continue": {"sequence": 63}})
        assert continued["error"]["code"] == "sample_mismatch"  # the last result is the one of 1 sequence

        peer.send({"id": 90, "op": "generate", "session": "s", "prompt": "Hi there", "max_new_tokens": 400,
                   "stream": True, **wordy})
        for _ in range(64 * 80):  # 80 tokens a sample: more than a frame holds
            assert peer.next_for(90).get("event") == "token"
        assert peer.call("cancel", target=90)["result"] == {"cancelled": True}
        cancelled = peer.reply_for(90)[1]["error"]
        assert cancelled["code"] == "limit_exceeded" and cancelled["limit"] == "max_frame_bytes", cancelled
        assert peer.call("session_info", session="s")["result"] == before
        assert peer.call("ping")["ok"]


# ---- the client going away ---------------------------------------------------------------------------

def test_eof_while_blocked_writing_to_a_client_that_stopped_reading_ends_the_process(default_dir):
    """The client closes our input but keeps our output open without reading: we must not wait forever."""
    process = subprocess.Popen(SERVER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    import fcntl

    fcntl.fcntl(process.stdout.fileno(), 1031, 4096)  # F_SETPIPE_SZ: fills after a few dozen events
    process.stdin.write(frame(pack({"id": 1, "op": "open_session", "session": "w"})))
    process.stdin.write(frame(pack({"id": 2, "op": "generate", "session": "w", "token_ids": [5, 6],
                                    "max_new_tokens": 1900, "eos_token_ids": [], "stream": True})))
    process.stdin.flush()
    assert pipe_fills(process.stdout.fileno(), [process]), "the server never blocked writing"
    process.stdin.close()
    assert process.wait(timeout=10) == 0
    process.stdout.close()


def pipe_fills(fd: int, running: list, timeout_s: float = 120.0) -> bool:
    """Whether the pipe `fd` reads from comes to hold what it can (its bytes stop growing near its capacity)
    while every process of `running` runs: a server under load takes 12 s and more to start serving, so
    no fixed sleep says it has got there."""
    import fcntl
    import termios

    capacity = fcntl.fcntl(fd, 1032)  # F_GETPIPE_SZ
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and all(p.poll() is None for p in running):
        held = int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, bytes(4)), sys.byteorder)
        if held > capacity - 1024:
            time.sleep(0.2)  # no more comes: the writer is blocked, not between two writes
            if int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, bytes(4)), sys.byteorder) == held:
                return True
        time.sleep(0.05)
    return False


def test_frames_written_after_eof_are_whole(default_dir):
    """A client that half-closes and keeps reading sees only whole frames, then EOF."""
    process = subprocess.Popen(SERVER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    process.stdin.write(frame(pack({"id": 1, "op": "open_session", "session": "h"})))
    process.stdin.write(frame(pack({"id": 2, "op": "generate", "session": "h", "token_ids": [5, 6],
                                    "max_new_tokens": 1900, "eos_token_ids": [], "stream": True})))
    process.stdin.close()
    data = process.stdout.read()
    assert process.wait(timeout=10) == 0
    while data:
        size = int.from_bytes(data[:4], "big")
        assert len(data) >= 4 + size, "a truncated frame"
        unpack(data[4 : 4 + size])
        data = data[4 + size :]


def test_offline_mode_is_set_before_transformers_is_imported():
    code = ("import sys, sidecar; assert 'transformers' not in sys.modules; import sidecar.__main__; "
            "import huggingface_hub.constants as c; print(c.HF_HUB_OFFLINE)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "0"})
    assert done.stdout.strip() == "True", done.stderr


# ---- found by an outside review ---------------------------------------------------------------------

def test_eof_is_noticed_even_when_the_inbox_is_full(default_dir, tmp_path):
    """A client that stops reading, floods the server until everything is full, then dies: the server exits."""
    flood = tmp_path / "flood"
    flood.write_bytes(b"".join(frame(pack({"id": 100 + i, "op": "hello"})) for i in range(40))  # ~5 KB replies
                      + b"".join(frame(pack({"id": 10_000 + i, "op": "tokenize", "text": "x" * 60_000})) for i in range(1500)))
    read_end, write_end = os.pipe()
    server = subprocess.Popen(SERVER, stdin=read_end, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    watch = os.dup(read_end)  # to see how much waits in the server's input; never read
    os.close(read_end)
    import fcntl

    fcntl.fcntl(server.stdout.fileno(), 1031, 4096)  # we never read: the server blocks writing
    client = subprocess.Popen(["cat", str(flood)], stdout=write_end)
    os.close(write_end)
    try:  # the server serves and blocks writing; its inbox fills up, its reader waits for room, the client's writes block
        assert pipe_fills(server.stdout.fileno(), [server, client]), "the server never blocked writing"
        assert pipe_fills(watch, [server, client]), "the server's input never filled"
    finally:
        os.close(watch)
    client.kill()
    client.wait()
    assert server.wait(timeout=10) == 0
    server.stdout.close()


def test_an_oversized_frame_under_an_id_in_flight_is_a_duplicate(default_dir):
    with Peer(SERVER + ["--max-frame-bytes", "65536"], stderr=subprocess.DEVNULL) as peer:
        peer.call("open_session", session="d")
        peer.send({"id": 77, "op": "generate", "session": "d", "token_ids": [5], "max_new_tokens": 200, "eos_token_ids": []})
        peer.send({"id": 77, "op": "tokenize", "text": "x" * 70_000})
        first = peer.next_for(77)
        assert first["error"]["code"] == "duplicate_id"
        assert peer.next_for(77)["ok"]


def test_an_out_of_vocabulary_processor_option_names_its_index_and_option(engine):
    """As the spec asks of every processor refusal: the index and the option (when one option alone holds
    the id; a dfa's state numbered like it would make two)."""
    from processors.structured import Dfa

    with engine.session() as session:
        with pytest.raises(errors.InvalidProcessor) as caught:
            session.generate(token_ids=[5], processors=[P.configure(P.Temperature, temperature=0.5),
                                                        P.configure(P.SuppressTokens, token_ids=[5000])])
        assert caught.value.details["index"] == 1
        assert str(caught.value) == ("processors[1] (suppress_tokens): option 'token_ids' names token id 5000, outside "
                                     "the vocabulary of 1024")
        with pytest.raises(errors.InvalidProcessor, match=r"^processors\[0\] \(no_bad_words\): option 'eos_token_ids' names "
                                                          r"token id 5000"):  # found from outside: it was accepted
            session.generate(token_ids=[5], processors=[P.configure(P.NoBadWords, bad_words_ids=[[7]], eos_token_ids=[5000])])
        with pytest.raises(errors.InvalidProcessor, match=r"^processors\[0\] \(sequence_bias\): option 'sequence_bias' names"):
            session.generate(token_ids=[5], processors=[P.configure(P.SequenceBias, sequence_bias=[[[7, 4000], 1.0]])])
        large = [[state, 5, state + 1] for state in range(1500)] + [[1500, 3000, 0]]  # compiled apart by the server
        with pytest.raises(errors.InvalidProcessor, match=r"^processors\[0\] \(dfa\): option 'transitions' names token id 3000"):
            session.generate(token_ids=[5], processors=[P.configure(Dfa, initial_state=0, transitions=large)
                                                        .with_compiled(engine.vocabulary, None)])
        with pytest.raises(errors.InvalidProcessor, match=r"^processors\[0\] \(dfa\): names token id 3000"):
            session.generate(token_ids=[5], processors=[P.configure(Dfa, initial_state=3000, transitions=[[3000, 3000, 1]])])
        # a chain bound already (its constraint moved first) is named as it was given: it said processors[1]
        bound = P.Chain([P.configure(P.SuppressTokens, token_ids=[5000]), P.configure(Dfa, initial_state=0, transitions=[[0, 5, 0]])])
        bound = bound.bind(engine.vocabulary, engine.default_eos_token_ids)
        assert bound.processors[1].name == "suppress_tokens" and bound.indices == (1, 0)
        with pytest.raises(errors.InvalidProcessor, match=r"^processors\[0\] \(suppress_tokens\): option 'token_ids' names token id 5000"):
            session.generate(token_ids=[5], processors=bound)


def test_only_option_values_count_towards_max_processor_values():
    from protocol import Limits, parse_request

    limits = Limits(max_processor_values=3)
    request = {"id": 1, "op": "generate", "session": "s", "prompt": "x",
               "processors": [{"name": "suppress_tokens", "options": {"token_ids": [1, 2, 3]}}]}
    parse_request(request, limits)
    request["processors"][0]["options"]["token_ids"].append(4)
    with pytest.raises(Exception) as caught:
        parse_request(request, limits)
    assert caught.value.details == {"limit": "max_processor_values", "max": 3, "value": 4, "param": "processors"}


def test_user_processors_may_edit_logits_in_place_and_may_cancel(engine):
    def ban_five(logits, context):
        logits[:, 5] = float("-inf")
        return logits

    with engine.session() as session:
        result = session.generate(token_ids=[5, 6], max_new_tokens=6, eos_token_ids=[], processors=[ban_five])
        assert 5 not in result.token_ids and len(result.token_ids) == 6

        generation = None

        def cancel_at_third_step(logits, context):
            if context.length - context.input_length == 2:
                generation.cancel()
            return logits

        generation = session.stream(token_ids=[5, 6], max_new_tokens=20, eos_token_ids=[], processors=[cancel_at_third_step])
        tokens = [event.token_id for event in generation]
        assert len(tokens) == 3 and generation.result.finish_reason == "cancelled"


@pytest.mark.parametrize("wrong", [lambda logits, c: logits[0], lambda logits, c: logits[:, :-1], lambda logits, c: None,
                                   lambda logits, c: logits.repeat(2, 1),
                                   lambda logits, c: torch.empty_like(logits, device="meta")])  # another device
def test_a_processor_that_returns_the_wrong_shape_is_invalid_logits(engine, wrong):
    with engine.session() as session:
        session.generate(token_ids=[5, 6, 7], max_new_tokens=2)
        before = snapshot(session)
        with pytest.raises(errors.InvalidLogits, match="not logits of shape"):
            session.generate(token_ids=[5, 6, 8], processors=[wrong])
        assert_same(before, snapshot(session))


def test_undecodable_tokens_stream_in_bounded_time(engine):
    """Tokens that never form a character are not held to the end (which made every step re-decode them all)."""
    from sidecar.text import MAX_HELD, Detokenizer

    lone = next(t for t in range(3, engine.vocab_size) if engine.tokenizer.decode([t]) == "\ufffd"
                and engine.tokenizer.decode([t, t, t, t]) == "\ufffd" * 4)
    detokenizer = Detokenizer(engine.tokenizer, engine.vocabulary.token_bytes)  # the window of tokenizers that do not join
    pieces = [detokenizer.push(lone) for _ in range(10 * MAX_HELD)]
    assert sum(1 for p in pieces if p) >= 9, "undecodable text was held back"
    assert "".join(pieces) + detokenizer.flush() == engine.tokenizer.decode([lone] * 10 * MAX_HELD)


def test_the_bytes_of_queued_requests_are_bounded(default_dir):
    """Many large requests queued behind a long generation: memory would grow with each; past the limit, refused."""
    with Peer(SERVER + ["--max-queued-bytes", "14000"], stderr=subprocess.DEVNULL) as peer:
        peer.call("open_session", session="m")
        peer.send({"id": 1, "op": "generate", "session": "m", "token_ids": [5], "max_new_tokens": 300, "eos_token_ids": []})
        big = list(range(300, 1000)) * 2 + list(range(300, 900))  # 2,000 ids, 6 KB on the wire
        for rid in (2, 3, 4):
            peer.send({"id": rid, "op": "generate", "session": "m", "token_ids": big, "max_new_tokens": 0})
        got = finals(peer, [1, 2, 3, 4])
        assert got[1]["ok"] and got[2]["ok"] and got[3]["ok"]
        assert got[4]["error"]["code"] == "limit_exceeded" and got[4]["error"]["limit"] == "max_queued_bytes"
        assert peer.call("stats")["result"]["in_flight"] == 0
        assert peer.call("generate", session="m", token_ids=big, max_new_tokens=0)["ok"], "the bytes were not released"


def test_a_waiting_request_holds_about_its_frame_not_its_decoded_form():
    """max_queued_bytes bounds memory only if a request that waits holds about its frame's bytes: decoded, a
    list of token ids takes 12-14 times them (64 MiB of queued frames held 1.26 GB), a dfa's transitions 20
    times. Python's allocations are counted (tracemalloc) while requests queue behind a long generation; then
    every queued request is answered as the same request sent again when nothing waits."""
    import tracemalloc

    ids = list(range(300, 1000)) * 40  # 28,000 ids, 84 KB on the wire: over the context, refused when it starts
    dfa = {"name": "dfa", "options": {"initial_state": 0, "transitions": [[s, 3 + s % 1000, s + 1] for s in range(6000)]}}
    queued = [{"op": "generate", "session": "m", "token_ids": ids[i:], "max_new_tokens": 1} for i in range(6)]
    queued += [{"op": "generate", "session": "m", "token_ids": ids[i:i + 1900], "max_new_tokens": 2} for i in range(6)]
    queued += [{"op": "generate", "session": "m", "token_ids": [5], "max_new_tokens": 3, "processors": [dfa]}] * 6
    with server_on_a_thread() as (send, replies, _):
        send({"id": 1, "op": "open_session", "session": "m"})
        send({"id": 2, "op": "generate", "session": "m", "token_ids": [5], "max_new_tokens": 400, "eos_token_ids": []})
        assert replies.get(timeout=60)["ok"]
        tracemalloc.start()
        try:
            for rid, request in enumerate(queued, 10):
                send({"id": rid, **request})
            send({"id": 3, "op": "stats"})  # answered at once, so every request before it has been dispatched
            stats = replies.get(timeout=60)
            held = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        frames = sum(len(pack({"id": rid, **request})) for rid, request in enumerate(queued, 10))
        assert stats["id"] == 3 and stats["result"]["in_flight"] == 1 + len(queued), stats
        assert held < 2 * frames, f"{held} bytes held for {frames} bytes of frames"
        got = {reply["id"]: reply for reply in (replies.get(timeout=120) for _ in range(1 + len(queued)))}
        assert sum(reply["ok"] for reply in got.values()) == 1 + 12, got
        for rid, request in enumerate(queued, 10):
            send({"id": 100 + rid, **request})
            again = replies.get(timeout=60)
            assert again["id"] == 100 + rid, again
            if again["ok"]:
                assert got[rid]["result"]["token_ids"] == again["result"]["token_ids"], rid
            else:
                assert got[rid]["error"] == again["error"], rid
                assert again["error"]["message"].startswith(f"{len(request['token_ids'])} input tokens"), again


def cyclic_dfa(offset: int, states: int = 339) -> dict:
    """A dfa that never lets the text end (no accepting state), one mask row per state: 1.76 MB bound."""
    return {"name": "dfa", "options": {"initial_state": 0, "transitions": [
        [i, (i * 7 + offset) % 1000 + 3, (i + 1) % states] for i in range(states)]}}


def test_the_constraints_running_generations_hold_are_bounded(default_dir):
    """A dfa of 339 transitions is 2.5 KB on the wire and 1.76 MB of masks over 1,024 tokens: 40 generates of
    64 of them running together took the server from 0.4 to 4.7 GB. Past the budget a generate is refused,
    changing nothing, and the same request goes through once the generation holding the budget is over."""
    with Peer(SERVER + ["--constraint-budget-bytes", "3000000"], stderr=subprocess.DEVNULL) as peer:
        assert peer.call("hello")["result"]["limits"]["constraint_budget_bytes"] == 3_000_000
        for name in ("a", "b"):
            peer.call("open_session", session=name)
        peer.send({"id": 1, "op": "generate", "session": "a", "token_ids": [5], "max_new_tokens": 400,
                   "processors": [cyclic_dfa(0)]})
        second = {"op": "generate", "session": "b", "token_ids": [5], "max_new_tokens": 3, "processors": [cyclic_dfa(1)]}
        peer.send({"id": 2, **second})
        got = finals(peer, [1, 2])
        assert got[1]["ok"] and len(got[1]["result"]["token_ids"]) == 400
        error = got[2]["error"]
        assert (error["code"], error["limit"], error["max"], error["index"]) == (
            "limit_exceeded", "constraint_budget_bytes", 3_000_000, 0), error
        assert error["value"] > 3_000_000 and "may fit once generations finish" in error["message"]
        assert peer.call("session_info", session="b")["result"]["history_tokens"] == 0
        again = peer.call("generate", session="b", token_ids=[5], max_new_tokens=3, processors=[cyclic_dfa(1)])
        assert again["ok"] and len(again["result"]["token_ids"]) == 3, again
        alone = peer.call("generate", session="b", token_ids=[5], max_new_tokens=3,
                          processors=[cyclic_dfa(1), cyclic_dfa(2)])
        assert alone["error"]["limit"] == "constraint_budget_bytes" and alone["error"]["index"] == 1, alone
        assert "on its own" not in alone["error"]["message"]  # its first dfa is bound: it counts


def test_the_compile_cache_is_bounded_by_its_flag_and_shown_in_stats(default_dir):
    """A server that compiles constraint after constraint keeps them (found from outside: 157 MB more after a
    soak of 550 constrained generates, which nothing reported): within `--constraint-cache-bytes`, in
    `stats.constraints`, with the constraints running generations hold beside them."""
    limit = 400_000
    with Peer(SERVER + ["--constraint-cache-bytes", str(limit)], stderr=subprocess.DEVNULL) as peer:
        assert peer.call("hello")["result"]["limits"]["constraint_cache_bytes"] == limit
        peer.call("open_session", session="s")
        assert peer.call("stats")["result"]["constraints"] == {"compiled": 0, "compiled_bytes": 0, "bound_bytes": 0}
        endless = {"name": "regex", "options": {"pattern": "[a-z]{5000,}"}}  # it cannot end within 300 tokens
        peer.send({"id": 1, "op": "generate", "session": "s", "token_ids": [5], "max_new_tokens": 300,
                   "stream": True, "processors": [endless]})
        assert peer.next_for(1)["event"] == "token"
        running = peer.call("stats")["result"]["constraints"]
        assert running["compiled"] == 1 and running["bound_bytes"] >= running["compiled_bytes"] > 0, running
        peer.send({"id": 2, "op": "cancel", "target": 1})
        assert peer.reply_for(1)[1]["error"]["code"] == "cancelled"
        kept = []
        for n in range(12):
            done = peer.call("generate", session="s", prompt="x", max_new_tokens=4,
                             processors=[{"name": "regex", "options": {"pattern": f"(id|key){n}-[a-f0-9]{{2,9}}"}}])
            assert done["ok"], done
            kept.append(peer.call("stats")["result"]["constraints"])
        assert all(c["compiled_bytes"] <= limit and c["bound_bytes"] == 0 for c in kept), kept
        assert 1 < kept[-1]["compiled"] < 13, kept  # some kept, the least recently used dropped


LONG_TEXT = "hello world " * 1200  # 2,400 tokens, over the default model's 2,048


@pytest.mark.parametrize("request_", [{"op": "tokenize", "text": LONG_TEXT},
                                      {"op": "generate", "prompt": LONG_TEXT},
                                      {"op": "generate", "messages": [{"role": "user", "content": LONG_TEXT}]},
                                      {"op": "generate", "continue": {"append": LONG_TEXT}}],
                         ids=["tokenize", "prompt", "messages", "continue"])
def test_a_text_longer_than_the_context_leaves_stderr_quiet(default_dir, tmp_path, request_):
    """transformers warns once per tokenizer, at WARNING, of a text tokenized past the model's context:
    "Running this sequence through the model will result in indexing errors". The sidecar runs no such
    sequence (tokenize only counts it, a generate is refused with context_overflow first), and an operator
    reading stderr took it for a fault. Once per tokenizer: a server for each way in."""
    log = tmp_path / "stderr"
    with open(log, "wb") as stderr, Peer([sys.executable, "-m", "sidecar", "--model", "default", "--log-level",
                                          "WARNING"], stderr=stderr) as peer:
        peer.call("open_session", session="s")
        assert peer.call("generate", session="s", token_ids=[5], max_new_tokens=1)["ok"]
        params = {k: v for k, v in request_.items() if k != "op"}
        if request_["op"] == "tokenize":
            assert len(peer.call("tokenize", **params)["result"]["token_ids"]) > 2048
        else:
            refused = peer.call("generate", session="s", max_new_tokens=1, **params)
            assert refused["error"]["code"] == "context_overflow", refused
    assert "indexing errors" not in log.read_text(), log.read_text()


# ---- a long prefill does not hold up the rest -----------------------------------------------------------

LONG = [10 + i % 1000 for i in range(1980)]


def test_a_ping_during_a_long_prefill_is_answered_between_chunks(default_dir):
    with Peer(SERVER + ["--prefill-chunk", "16"], stderr=subprocess.DEVNULL) as peer:
        peer.call("open_session", session="l")
        peer.send({"id": 1, "op": "generate", "session": "l", "token_ids": LONG, "max_new_tokens": 1, "stream": True})
        time.sleep(0.05)  # the prefill of 124 chunks is under way
        peer.send({"id": 2, "op": "ping"})
        assert peer.read_message() == {"id": 2, "ok": True, "result": {}}, "the ping waited for the whole prefill"
        events, reply = peer.reply_for(1)
        assert reply["ok"] and len(events) == 1


def test_cancel_stops_a_prefill_between_chunks_and_keeps_what_was_computed(default_dir, engine):
    with Peer(SERVER + ["--prefill-chunk", "16"], stderr=subprocess.DEVNULL) as peer:
        peer.call("open_session", session="c")
        # a server that wakes late reads the cancel with the generate, before any chunk (and keeps nothing):
        # then again, waiting longer before the cancel
        for rid, wait_s in ((1, 0.05), (3, 0.1), (5, 0.2), (7, 0.4)):
            peer.send({"id": rid, "op": "generate", "session": "c", "token_ids": LONG, "max_new_tokens": 4, "stream": True})
            time.sleep(wait_s)
            peer.send({"id": rid + 1, "op": "cancel", "target": rid})
            error = peer.reply_for(rid)[1]["error"]
            assert error["code"] == "cancelled" and error["token_ids"] == []
            done = error["stats"]["prefill_tokens"]
            if done:
                break
        assert 0 < done < len(LONG) - 1 and done % 16 == 0
        after = peer.call("generate", session="c", token_ids=LONG, max_new_tokens=4, eos_token_ids=[])["result"]
    assert after["stats"]["reused_tokens"] == done
    assert after["token_ids"] == fresh_tokens(engine, token_ids=LONG, max_new_tokens=4, eos_token_ids=[])


def test_a_long_prompt_is_prefilled_one_chunk_per_tick(default_dir):
    from sidecar import Engine

    engine = Engine.load(default_dir, prefill_chunk=10)
    with engine.session() as session:
        generation = session.stream(token_ids=list(range(10, 55)), max_new_tokens=2, eos_token_ids=[])
        ticks = [engine.scheduler.ticks for _ in generation]
    assert ticks == [5, 6]  # 45 tokens: four chunks without logits, the fifth gives the first token


def test_a_stream_dropped_unfinished_stands_as_if_cancelled(engine):
    with engine.session() as session:
        seen = []
        for event in session.stream(token_ids=[5, 6, 7], max_new_tokens=20, eos_token_ids=[]):
            seen.append(event.token_id)
            if len(seen) == 3:
                break
        assert not session.busy, "a dropped stream kept the session busy"
        assert session.history == [5, 6, 7] + seen
        follow = session.generate(token_ids=[5, 6, 7] + seen, max_new_tokens=2, eos_token_ids=[])
    assert follow.stats.reused_tokens == 3 + len(seen) - 1
    assert follow.token_ids == fresh_tokens(engine, token_ids=[5, 6, 7] + seen, max_new_tokens=2, eos_token_ids=[])


@pytest.mark.parametrize("rows", [dict(), dict(strategy="sample", num_samples=2, seed=1), dict(strategy="beam", num_beams=2)],
                         ids=["one row", "samples", "beams"])
def test_a_session_closed_by_another_generation_in_the_step_its_prefill_ends_is_cancelled(engine, rows):
    """A processor may close another session; when that session's prefill ends in the same step, its
    generation ends cancelled (found by a fuzz: samples and beams failed with an IndexError, copying the
    prompt's cache that the close had freed)."""
    closing, closed = engine.session(), engine.session()
    prompt = [5, 6, 7, 8]

    def close_it(logits, context):
        if context.length == len(prompt) + 1:  # the step after its own prefill: the other one's prefill
            closed.close()
        return logits

    closer = closing.stream(token_ids=prompt, max_new_tokens=6, eos_token_ids=[], processors=[close_it])
    engine.scheduler.tick()
    victim = closed.stream(token_ids=[9, 10, 11, 12, 13], max_new_tokens=6, eos_token_ids=[], **rows)
    tokens_of = [event.token_id for event in closer]
    assert victim.error is None and victim.result.finish_reason == "cancelled"
    assert closer.result.token_ids == tokens_of == fresh_greedy(engine, prompt, 6)
    assert engine.store.used_bytes == sum(c.nbytes for c in engine.store._caches.values()) and closed.cache.length == 0
    closing.close()


def fresh_greedy(engine, prompt, n):
    with engine.session() as session:
        return session.generate(token_ids=prompt, max_new_tokens=n, eos_token_ids=[]).token_ids


def test_a_defect_while_a_loaded_model_is_put_in_service_is_an_error_on_its_load_alone(monkeypatch):
    """The model loads on its thread; its reply is made on the main thread, where a defect of ours is an
    `internal` error on that load_model and the model is not served, as for any request."""
    import sidecar.server as server_module

    made = server_module.model_info
    monkeypatch.setattr(server_module, "model_info",
                        lambda name, engine: 1 / 0 if name == "broken" else made(name, engine))
    with server_on_a_thread() as (send, replies, _):
        send({"id": 1, "op": "load_model", "name": "broken", "path": None})
        send({"id": 2, "op": "ping"})
        send({"id": 3, "op": "models"})
        got = [replies.get(timeout=120) for _ in range(3)]
    assert [reply["id"] for reply in got] == [1, 2, 3], got
    assert got[0]["error"]["code"] == "internal" and "ZeroDivisionError" in got[0]["error"]["message"], got[0]
    assert got[1]["ok"] and [model["name"] for model in got[2]["result"]["models"]] == ["default"], got


def test_a_session_name_kept_across_a_restart_names_no_session_of_the_next_server():
    """A client that kept a name the server chose (an Elixir app holding it across its supervisor's restart
    of the sidecar) must not reach another client's session in the next server process: `continue` would
    read that session's text."""
    names = []
    for _ in range(2):
        with server_on_a_thread() as (send, replies, _):
            send({"id": 1, "op": "open_session"})
            names.append(replies.get(timeout=60)["result"]["session"])
            send({"id": 2, "op": "generate", "session": names[0], "token_ids": [5, 6], "max_new_tokens": 1})
            answered = replies.get(timeout=60)
    assert names[0] != names[1], names
    assert answered["error"]["code"] == "unknown_session", answered


def test_an_empty_session_name_is_refused_and_opens_nothing():
    with server_on_a_thread() as (send, replies, _):
        send({"id": 1, "op": "open_session", "session": ""})
        send({"id": 2, "op": "open_session", "session": "a"})
        send({"id": 3, "op": "fork_session", "session": "a", "new": ""})
        send({"id": 4, "op": "stats"})
        got = {reply["id"]: reply for reply in (replies.get(timeout=60) for _ in range(4))}
    assert [(got[rid]["error"]["code"], got[rid]["error"]["option"]) for rid in (1, 3)] == [
        ("invalid_argument", "session"), ("invalid_argument", "new")], got
    assert got[2]["ok"] and got[4]["result"]["sessions"] == 1, got


def test_a_grammar_whose_steps_pass_the_limit_stops_its_generation_and_not_the_server(default_dir):
    """A 30-byte ambiguous grammar took 2 s a step by token 290, and one generate of 64 samples of it held
    every other session and ping for 10 s at a time (an outside-in helper). Past `--grammar-step-ms` the
    generation ends with `limit_exceeded` naming the limit and the processor as sent, its session as before."""
    grammar = {"name": "grammar", "options": {"grammar": "start: s\ns: s s | /[a-z]/"}}
    keep_going = {"name": "min_new_tokens", "options": {"min_new_tokens": 300, "eos_token_ids": [2]}}
    with Peer(SERVER + ["--grammar-step-ms", "5"], stderr=subprocess.DEVNULL) as peer:
        limits = peer.call("hello")["result"]["limits"]
        assert (limits["grammar_step_ms"], limits["constraint_budget_bytes"]) == (5, 2**31), limits
        peer.call("open_session", session="s")
        refused = peer.call("generate", session="s", prompt="x", max_new_tokens=300, strategy="sample", seed=0,
                            num_samples=4, processors=[keep_going, grammar])
        error = refused["error"]
        assert (error["code"], error["limit"], error["max"], error["index"]) == (
            "limit_exceeded", "grammar_step_ms", 5, 1), error
        assert error["value"] > 5 and "reads a text in many ways" in error["message"]
        assert peer.call("session_info", session="s")["result"]["history_tokens"] == 0
        assert peer.call("ping")["ok"]
        fine = peer.call("generate", session="s", prompt="x", max_new_tokens=4,
                         processors=[{"name": "grammar", "options": {"grammar": 'start: "ab" | "cd"'}}])
        assert fine["ok"] and fine["result"]["text"] in ("ab", "cd"), fine


def test_the_heap_is_trimmed_when_the_server_goes_idle_after_letting_go_of_memory(monkeypatch):
    """(helper-84) glibc keeps freed pages: 1,024 sessions closed, `cache_bytes` 0, left the server at 1.42 GB. Once
    idle after letting go of more KV memory than TRIM_BYTES since the last trim, or of an unloaded model, the server
    calls malloc_trim; not while it holds what it held; and after a load that failed. The trim comes as the server
    goes idle, which may be after a reply went out: each check waits for it, then lets any further one come."""
    import sidecar.server as server_module

    trims = []

    def waited(condition):
        deadline = time.monotonic() + 60
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)

    def trimmed(count):
        waited(lambda: len(trims) >= count)
        time.sleep(0.1)  # and no more
        return trims

    with server_on_a_thread() as (send, replies, server):
        server._trim_heap = trims.append
        send({"id": 1, "op": "open_session", "session": "big"})
        send({"id": 2, "op": "generate", "session": "big", "token_ids": list(range(5, 45)), "max_new_tokens": 8,
              "eos_token_ids": []})
        assert [replies.get(timeout=60)["ok"] for _ in range(2)] == [True, True]
        send({"id": 3, "op": "stats"})
        held = replies.get(timeout=60)["result"]["models"]["default"]["cache_bytes"]
        assert held > 0
        monkeypatch.setattr(server_module, "TRIM_BYTES", held // 2)
        server._held_peak = 0  # idle: what it held while generating is not the test's
        send({"id": 4, "op": "ping"})
        assert replies.get(timeout=60)["id"] == 4
        waited(lambda: server._held_peak > 0)  # its idle pass after the ping notes the peak
        assert trimmed(0) == []
        send({"id": 5, "op": "close_session", "session": "big"})
        send({"id": 6, "op": "ping"})
        assert [replies.get(timeout=60)["id"] for _ in range(2)] == [5, 6] and trimmed(1) == [0]
        send({"id": 7, "op": "load_model", "name": "other", "path": None})
        assert replies.get(timeout=120)["ok"]
        send({"id": 8, "op": "unload_model", "model": "other"})
        send({"id": 9, "op": "ping"})
        assert [replies.get(timeout=60)["id"] for _ in range(2)] == [8, 9] and trimmed(2) == [0, 0]

        def failing(**arguments):  # a load that read its weights, then failed
            raise errors.InvalidModel("its weights do not fit its config")

        monkeypatch.setattr(server_module.Engine, "load", failing)
        send({"id": 10, "op": "load_model", "name": "broken", "path": None})
        assert replies.get(timeout=60)["error"]["code"] == "invalid_model" and trimmed(3) == [0, 0, 0]
