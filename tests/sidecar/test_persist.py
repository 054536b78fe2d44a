"""Saved, restored and forked sessions against cold runs: what they continue with must be exactly what a
fresh session computing everything gives, and every broken file is refused, changing nothing."""

import json
import os
import subprocess
import sys

import pytest

from sidecar import Engine
from sidecar.errors import CacheBudgetExceeded, InvalidSessionFile, SaveFailed, SessionBusy

from .conftest import tokens, unshared

PROMPT = tokens(200, seed=5)


def cold(engine, token_ids, n=8):
    with unshared(engine).session() as fresh:
        return fresh.generate(token_ids=token_ids, max_new_tokens=n, eos_token_ids=[]).token_ids


@pytest.fixture
def saved(engine, tmp_path):
    with engine.session() as session:
        first = session.generate(token_ids=PROMPT, max_new_tokens=6, eos_token_ids=[])
        session.save(tmp_path / "s.safetensors")
        return tmp_path / "s.safetensors", PROMPT + first.token_ids, session.cached


def test_a_restored_session_continues_like_a_cold_one_reusing_everything(engine, saved):
    path, history, cached = saved
    follow = history + [7, 8]
    with engine.restore(path) as restored:
        assert restored.history == history and restored.cached == cached
        result = restored.generate(token_ids=follow, max_new_tokens=8, eos_token_ids=[])
    assert result.token_ids == cold(engine, follow)
    assert result.stats.reused_tokens == cached and result.stats.prefill_tokens == len(follow) - cached


def test_restored_in_another_process(engine, saved):
    path, history, _ = saved
    follow = history + [9]
    code = ("import sys, json; from sidecar import Engine; e = Engine.load(); s = e.restore(sys.argv[1]); "
            "r = s.generate(token_ids=json.loads(sys.argv[2]), max_new_tokens=8, eos_token_ids=[]); "
            "print(json.dumps([r.token_ids, r.stats.reused_tokens]))")
    out = subprocess.run([sys.executable, "-c", code, str(path), str(follow)], capture_output=True, text=True, check=True)
    import json

    token_ids, reused = json.loads(out.stdout)
    assert token_ids == cold(engine, follow) and reused == saved[2]


def test_a_fork_is_independent_and_recomputes_nothing(engine):
    with engine.session() as session:
        session.generate(token_ids=PROMPT, max_new_tokens=4, eos_token_ids=[])
        twin = session.fork()
        cached = session.cached
        assert twin.cached == cached and twin.history == session.history
        left, right = session.history + [11], session.history + [12, 13]
        a = twin.generate(token_ids=left, max_new_tokens=6, eos_token_ids=[])
        b = session.generate(token_ids=right, max_new_tokens=6, eos_token_ids=[])
        assert a.stats.reused_tokens == b.stats.reused_tokens == cached
        assert a.token_ids == cold(engine, left, 6) and b.token_ids == cold(engine, right, 6)
        assert twin.history[: len(left)] == left and session.history[: len(right)] == right
        twin.close()


def test_a_busy_session_is_neither_saved_nor_forked(engine, tmp_path):
    with engine.session() as session:
        stream = session.stream(token_ids=PROMPT, max_new_tokens=4)
        next(stream)
        with pytest.raises(SessionBusy):
            session.save(tmp_path / "busy.safetensors")
        with pytest.raises(SessionBusy):
            session.fork()
        assert not (tmp_path / "busy.safetensors").exists()
        stream.cancel()


def corrupt(path, offset_from_end, new=b"\x7f"):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= new[0]
    path.write_bytes(bytes(data))


def framed(header: dict) -> bytes:
    """A safetensors file of this header and no tensors."""
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text


def retoken(path):
    """Changes one token of the history in the header, keeping its length: a well-formed, lying file."""
    data = path.read_bytes()
    key = b'\\"history\\": ['  # the metadata is JSON inside safetensors' JSON header: its quotes are escaped
    at = data.index(key) + len(key)
    first = data[at:data.index(b",", at)]
    other = str((int(first) + 1) % 10 ** len(first)).zfill(len(first)).encode()
    path.write_bytes(data[:at] + other + data[at + len(first):])


@pytest.mark.parametrize("damage, message", [
    (retoken, "corrupted"),
    (lambda p: p.write_bytes(p.read_bytes()[:-100]), "is truncated"),
    (lambda p: p.write_bytes(p.read_bytes()[:40]), "is truncated"),
    (lambda p: p.write_bytes(p.read_bytes() + b"\0"), "is too long"),
    (lambda p: p.write_bytes(b"not a safetensors file at all"), "has a header of .* bytes, more than"),
    (lambda p: p.write_bytes(b"\x10\0\0\0\0\0\0\0" + b"[1, 2, 3]       "), "is not a safetensors file"),
    (lambda p: p.write_bytes(b"\x10\0\0\0\0\0\0\0" + b"{not json}      "), "cannot read"),
    # safetensors headers of the wrong shape: refused by name (the first escaped as a KeyError)
    (lambda p: p.write_bytes(framed({"keys.0": {"dtype": "F32"}})), "is not a safetensors file"),
    (lambda p: p.write_bytes(framed({"keys.0": {"data_offsets": [0, "8"]}})), "is not a safetensors file"),
    (lambda p: p.write_bytes(framed({"__metadata__": {"session": 5}})), "is not a safetensors file"),
    (lambda p: corrupt(p, 10), "corrupted"),
])
def test_a_broken_file_is_refused_and_changes_nothing(engine, saved, damage, message):
    path = saved[0]
    damage(path)
    before = engine.stats()
    with pytest.raises(InvalidSessionFile, match=message):
        engine.restore(path)
    assert engine.stats() == before


def test_another_model_or_dtype_is_refused(engine, gpt2_engine, default_dir, saved):
    with pytest.raises(InvalidSessionFile, match="another model"):
        gpt2_engine.restore(saved[0])
    half = Engine.load(default_dir, dtype="bfloat16")
    with pytest.raises(InvalidSessionFile, match="holds a cache in torch.float32, this model runs in torch.bfloat16"):
        half.restore(saved[0])  # the dtype is named (the fingerprint differs too: it covers the weights' dtype)
    # the same model's fingerprint over a cache of another dtype: refused by the dtype itself
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(saved[0]), framework="pt") as file:
        metadata = file.metadata()
    header = json.loads(metadata["session"])
    header["dtype"] = "torch.bfloat16"
    relabelled = saved[0].with_name("relabelled.safetensors")
    save_file(load_file(saved[0]), relabelled, metadata={**metadata, "session": json.dumps(header)})
    with pytest.raises(InvalidSessionFile, match="holds a cache in torch.bfloat16, this model runs in torch.float32"):
        engine.restore(relabelled)
    with pytest.raises(InvalidSessionFile, match="no saved session missing.safetensors"):
        engine.restore(saved[0].with_name("missing.safetensors"))
    with pytest.raises(InvalidSessionFile, match="File name too long"):  # it escaped as an OSError
        engine.restore(saved[0].with_name("x" * 300))


def test_what_is_not_a_regular_file_is_never_read(engine, tmp_path):
    """A FIFO under a saved session's name would block a read for ever; a directory would mislead."""
    import os

    os.mkfifo(tmp_path / "fifo.safetensors")
    (tmp_path / "dir.safetensors").mkdir()
    for name in ("fifo.safetensors", "dir.safetensors"):
        with pytest.raises(InvalidSessionFile, match="not a regular file"):
            engine.restore(tmp_path / name)


def test_a_file_that_lies_about_its_size_is_refused_before_it_is_read(engine, saved, tmp_path):
    """The header's shapes are checked before any tensor is read: a file claiming more tokens than it
    holds, or holding tensors of another shape, is refused from its header."""
    from safetensors.torch import save_file
    import json
    import torch

    path, history, cached = saved
    with __import__("safetensors").safe_open(str(path), "pt") as file:
        metadata = json.loads(file.metadata()["session"])
        tensors = {k: file.get_tensor(k) for k in file.keys()}
    tensors["keys.0"] = torch.zeros(tensors["keys.0"].shape[0], cached + 1, tensors["keys.0"].shape[2])
    save_file(tensors, str(tmp_path / "odd.safetensors"), metadata={"session": json.dumps(metadata)})
    with pytest.raises(InvalidSessionFile, match="cache layout"):
        engine.restore(tmp_path / "odd.safetensors")


def test_a_restore_that_does_not_fit_the_budget_is_refused(default_dir, tmp_path):
    small = Engine.load(default_dir, cache_budget_bytes=300 * 1024)
    with small.session() as session:
        session.generate(token_ids=PROMPT[:20], max_new_tokens=2, eos_token_ids=[])
        session.save(tmp_path / "small.safetensors")
    tiny = Engine.load(default_dir, cache_budget_bytes=1024)
    with pytest.raises(CacheBudgetExceeded, match="it does not fit even with no generation running"):
        tiny.restore(tmp_path / "small.safetensors")
    assert tiny.stats()["sessions"] == 0


def test_a_restore_refused_for_the_running_generations_reservations_says_it_fits_once_they_end(default_dir, tmp_path):
    """A restore does not wait for memory as a generation does: refused at once, its message tells a transient
    refusal (found from outside: the same restore went through once the other session's generation ended)."""
    engine = Engine.load(default_dir, cache_budget_bytes=300 * 4096)
    with engine.session() as session:
        session.generate(token_ids=PROMPT[:20], max_new_tokens=2, eos_token_ids=[])
        session.save(tmp_path / "small.safetensors")
    with engine.session() as busy:
        stream = busy.stream(token_ids=PROMPT[20:40], max_new_tokens=260, eos_token_ids=[])
        next(stream)  # running: 280 tokens reserved
        with pytest.raises(CacheBudgetExceeded, match=r"the running generations hold \d+ of them: it fits once they end") as refused:
            engine.restore(tmp_path / "small.safetensors")
        assert refused.value.details["value"] > refused.value.details["max"] == 300 * 4096
        for _ in stream:
            pass
    with engine.restore(tmp_path / "small.safetensors") as restored:
        assert restored.cached == 21


def test_a_restore_whose_allocation_fails_leaves_no_session_behind(engine, saved, monkeypatch):
    from sidecar import kv

    path, _, _ = saved
    fresh = unshared(engine)

    def no_memory(cache, capacity):
        raise MemoryError("no room for the keys")

    monkeypatch.setattr(kv.KVCache, "reserve", no_memory)
    with pytest.raises(MemoryError):
        fresh.restore(path)
    monkeypatch.undo()
    assert fresh.stats()["sessions"] == 0 and fresh.store.used_bytes == 0


def test_a_save_that_cannot_be_written_leaves_nothing_behind(engine, tmp_path):
    (tmp_path / "taken.safetensors").mkdir()  # a directory where the file should go
    with engine.session() as session:
        session.generate(token_ids=PROMPT[:10], max_new_tokens=2, eos_token_ids=[])
        with pytest.raises(SaveFailed, match="cannot write"):
            session.save(tmp_path / "taken.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.safetensors"]


def test_a_session_without_a_cache_saves_and_restores_its_history(default_dir, tmp_path):
    """Never generated, evicted, or emptied by a failed call: the history comes back, the cache recomputes."""
    import processors as P

    engine = Engine.load(default_dir, cache_budget_bytes=30 * 4096)
    with engine.session() as empty, engine.session() as evicted, engine.session() as failed:
        empty.save(tmp_path / "empty.safetensors")
        evicted.generate(token_ids=PROMPT[:12], max_new_tokens=4, eos_token_ids=[])
        with engine.session() as other:  # takes the budget: `evicted` loses its cache, keeps its history
            other.generate(token_ids=PROMPT[20:40], max_new_tokens=4, eos_token_ids=[])
        assert evicted.cached == 0 and len(evicted.history) == 16
        evicted.save(tmp_path / "evicted.safetensors")
        with pytest.raises(Exception):
            failed.generate(token_ids=PROMPT[:4], processors=[P.configure(P.SuppressTokens, token_ids=list(range(1024)))])
        failed.save(tmp_path / "failed.safetensors")
        history = list(evicted.history)
    for name, expected in (("empty", []), ("evicted", history), ("failed", [])):
        with engine.restore(tmp_path / f"{name}.safetensors") as restored:
            assert restored.history == expected and restored.cached == 0
            follow = expected + [7, 8]
            assert restored.generate(token_ids=follow, max_new_tokens=4, eos_token_ids=[]).token_ids == cold(engine, follow, 4)
    assert engine.stats()["sessions"] == 0


def test_a_refused_fork_or_restore_evicts_nobody(default_dir, tmp_path):
    # Without prefix sharing a fork copies the cache (with it, a fork holds no new memory: test_sharing).
    engine = Engine.load(default_dir, cache_budget_bytes=64 * 4096, share_prefixes=False)
    with engine.session() as big, engine.session() as small:
        big.generate(token_ids=PROMPT[:36], max_new_tokens=4, eos_token_ids=[])
        small.generate(token_ids=PROMPT[40:44], max_new_tokens=2, eos_token_ids=[])
        big.save(tmp_path / "big.safetensors")
        cached = (big.cached, small.cached)
        leaves = 64 * 4096 - big.cache_bytes  # the session forked keeps its cache; the idle other one could go
        with pytest.raises(CacheBudgetExceeded, match=f"more than the cache budget leaves: {leaves} of its {64 * 4096} bytes"):
            big.fork()
        corrupt(tmp_path / "big.safetensors", 10)
        with pytest.raises(InvalidSessionFile, match="corrupted"):
            engine.restore(tmp_path / "big.safetensors")
        assert (big.cached, small.cached) == cached and engine.stats()["evictions"] == 0


def test_headers_that_are_too_deep_or_too_long_are_refused(engine, saved, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    import json

    path = saved[0]
    with safe_open(str(path), "pt") as file:
        metadata = json.loads(file.metadata()["session"])
        tensors = {k: file.get_tensor(k) for k in file.keys()}
    save_file(tensors, str(tmp_path / "deep.safetensors"), metadata={"session": "[" * 100_000 + "]" * 100_000})
    with pytest.raises(InvalidSessionFile, match="cannot read"):
        engine.restore(tmp_path / "deep.safetensors")
    long = {**metadata, "history": [5] * (engine.max_context + 1)}
    save_file(tensors, str(tmp_path / "long.safetensors"), metadata={"session": json.dumps(long)})
    with pytest.raises(InvalidSessionFile, match="more than the model's context"):
        engine.restore(tmp_path / "long.safetensors")


def test_a_save_into_a_missing_directory_is_save_failed(engine, tmp_path):
    with engine.session() as session:
        session.generate(token_ids=PROMPT[:6], max_new_tokens=1, eos_token_ids=[])
        with pytest.raises(SaveFailed, match="cannot write"):
            session.save(tmp_path / "missing" / "x.safetensors")


def test_a_link_is_not_followed_out_of_where_sessions_are_saved(engine, saved, tmp_path):
    """As `save` does not write through a link, `restore` does not read through one (out of a server's
    session directory); a loop of links is a link too."""
    path = saved[0]
    (tmp_path / "link.safetensors").symlink_to(path)
    (tmp_path / "loop.safetensors").symlink_to(tmp_path / "loop.safetensors")
    for name in ("link.safetensors", "loop.safetensors"):
        with pytest.raises(InvalidSessionFile, match="it is a symbolic link"):
            engine.restore(tmp_path / name)


def test_a_file_cut_short_while_it_is_restored_is_refused(engine, saved, monkeypatch):
    """A file rewritten in place (`cp` over it) may shrink between its header and its tensors: read, not
    mapped, it is refused as truncated (mapped, the process died of SIGBUS)."""
    path, history, cached = saved
    could_fit = engine.store.could_fit

    def cut_then_check(extra, keep=()):  # called once the header is read, before the tensors are
        os.truncate(path, 8192)
        return could_fit(extra, keep)

    monkeypatch.setattr(engine.store, "could_fit", cut_then_check)
    before = engine.stats()
    with pytest.raises(InvalidSessionFile, match="is truncated"):
        engine.restore(path)
    assert engine.stats() == before


def test_the_same_model_loaded_through_a_link_or_a_copy_restores_what_it_saved(engine, saved, default_dir, tmp_path):
    """The fingerprint is the model's, not the path's it was loaded from."""
    import shutil

    path, history, cached = saved
    (tmp_path / "link").symlink_to(default_dir, target_is_directory=True)
    shutil.copytree(default_dir, tmp_path / "copy")
    for directory in (tmp_path / "link", tmp_path / "copy"):
        with Engine.load(directory).restore(path) as restored:
            assert restored.history == history and restored.cached == cached
