"""The prefix cache across sessions against cold runs: an engine that does not share prefixes, on the same
model, computes every prompt in full; a session continuing another's cache must give exactly its tokens
(beam scores within 1e-4), hold one copy of the shared prefix, and say in its stats what it took."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import processors as proc
from sidecar import Engine, kv
from sidecar.errors import CacheBudgetExceeded
from sidecar.kv import KVStore
from sidecar.sharing import MAX_DEPTH, MIN_SHARED_TOKENS, common_prefix, find

from .conftest import (assert_books_balance, picked, reference_common_prefix, reference_find, tokens, unshared,
                       unused_entries)

SYSTEM = tokens(150, seed=41)  # GPT-2's context here is 256


def question(seed: int, n: int = 12) -> list[int]:
    """A user's question: no two start alike, so only the system prompt is common."""
    return [3 + seed] + tokens(n - 1, seed=seed)


@pytest.fixture
def sharing(any_engine):
    """A fresh engine on the shared model (so no other test's sessions are there to share)."""
    return Engine(any_engine.model, any_engine.tokenizer)


@pytest.fixture
def cold(any_engine):
    return Engine(any_engine.model, any_engine.tokenizer, share_prefixes=False)


def warm(engine, seed: int = 1):
    """An open session that has generated after the system prompt: its cache is there to share."""
    session = engine.session()
    session.generate(token_ids=SYSTEM + question(seed), max_new_tokens=2, eos_token_ids=[])
    return session


def run(engine, token_ids, n=8, **options):
    with engine.session() as session:
        return session.generate(token_ids=token_ids, max_new_tokens=n, eos_token_ids=[], **options)


def test_a_second_session_continues_the_first_ones_system_prompt(sharing, cold):
    first = sharing.session()
    first.generate(token_ids=SYSTEM + question(1), max_new_tokens=4, eos_token_ids=[])
    cached = first.cached
    second = sharing.session()
    prompt = SYSTEM + question(2)
    result = second.generate(token_ids=prompt, max_new_tokens=8, eos_token_ids=[])
    assert result.token_ids == run(cold, prompt).token_ids
    assert result.stats.shared_tokens == result.stats.reused_tokens == len(SYSTEM)
    assert result.stats.prefill_tokens == len(prompt) - len(SYSTEM)
    stats = sharing.stats()
    assert stats["shared_prefixes"] == 1
    # the first session's own follow-up still reuses everything it had, now through the shared entry
    follow = first.history + question(3)
    again = first.generate(token_ids=follow, max_new_tokens=8, eos_token_ids=[])
    assert again.token_ids == run(cold, follow).token_ids
    assert again.stats.reused_tokens == cached and again.stats.shared_tokens == 0


def test_twenty_sessions_hold_one_copy_of_the_system_prompt(sharing, cold):
    sessions = [sharing.session() for _ in range(20)]
    results = [s.generate(token_ids=SYSTEM + question(i), max_new_tokens=4, eos_token_ids=[])
               for i, s in enumerate(sessions)]
    per_token = sharing.store.bytes_per_token
    assert [r.stats.shared_tokens for r in results] == [0] + [len(SYSTEM)] * 19
    # one copy of the system prompt (in the entry the first session's cache became), and each session's own tokens
    own = sum(s.cache.nbytes for s in sessions)
    assert sharing.stats()["shared_bytes"] == (len(SYSTEM) + 12 + 3) * per_token
    assert own == 19 * (12 + 3) * per_token
    assert sharing.store.used_bytes == own + sharing.stats()["shared_bytes"]
    for i in (0, 7, 19):
        assert results[i].token_ids == run(cold, SYSTEM + question(i), n=4).token_ids


def test_a_closed_or_evicted_session_leaves_the_shared_prefix_to_new_ones(sharing, cold):
    a, b = sharing.session(), sharing.session()
    a.generate(token_ids=SYSTEM + question(1), max_new_tokens=2, eos_token_ids=[])
    b.generate(token_ids=SYSTEM + question(2), max_new_tokens=2, eos_token_ids=[])
    a.close()
    b.close()
    assert sharing.stats()["shared_prefixes"] == 1  # no session continues it, and it stays until evicted
    prompt = SYSTEM + question(3)
    result = run(sharing, prompt)
    assert result.stats.shared_tokens == len(SYSTEM) and result.token_ids == run(cold, prompt).token_ids


def test_unreferenced_prefixes_are_evicted_least_recently_used_first(any_engine, cold):
    per_token = Engine(any_engine.model, any_engine.tokenizer).store.bytes_per_token
    engine = Engine(any_engine.model, any_engine.tokenizer, cache_budget_bytes=400 * per_token)
    systems = [tokens(150, seed=100 + i) for i in range(3)]
    for system in systems:  # two sessions each, then closed: one unreferenced entry per system prompt
        pair = [engine.session(), engine.session()]
        for q, s in enumerate(pair):
            s.generate(token_ids=system + question(q), max_new_tokens=2, eos_token_ids=[])
        for s in pair:
            s.close()
    assert engine.store.used_bytes <= engine.cache_budget_bytes and engine.stats()["evictions"] == 1
    assert [entry.tokens[:150] for entry in engine.store.shared] == systems[1:]  # the oldest went first
    prompt = systems[0] + question(5)
    result = run(engine, prompt)
    assert result.stats.shared_tokens == 0 and result.token_ids == run(cold, prompt).token_ids


def test_a_short_common_prefix_is_recomputed(sharing):
    head = SYSTEM[: MIN_SHARED_TOKENS - 1]
    sharing.session().generate(token_ids=head + question(1), max_new_tokens=2, eos_token_ids=[])
    result = run(sharing, head + question(2))
    assert result.stats.reused_tokens == 0 and sharing.stats()["shared_prefixes"] == 0


def test_without_share_prefixes_each_session_computes_its_own(cold):
    warm(cold)
    assert run(cold, SYSTEM + question(2)).stats.reused_tokens == 0


def test_prefill_in_chunks_after_a_shared_prefix(any_engine):
    chunked = Engine(any_engine.model, any_engine.tokenizer, prefill_chunk=7)
    reference = Engine(any_engine.model, any_engine.tokenizer, share_prefixes=False)
    warm(chunked)
    prompt = SYSTEM + question(2, n=40)
    result = run(chunked, prompt)
    assert result.stats.shared_tokens == len(SYSTEM)
    assert result.token_ids == run(reference, prompt).token_ids


def test_sessions_continuing_one_prefix_batched_together(sharing, cold):
    warm(sharing, 0)
    sessions = [sharing.session() for _ in range(4)]
    streams = [s.stream(token_ids=SYSTEM + question(i + 1, n=5 + 3 * i), max_new_tokens=6, eos_token_ids=[])
               for i, s in enumerate(sessions)]
    for stream in streams:
        for _ in stream:
            pass
    for i, stream in enumerate(streams):
        assert stream.result.stats.shared_tokens == len(SYSTEM)
        assert stream.result.token_ids == run(cold, SYSTEM + question(i + 1, n=5 + 3 * i), n=6).token_ids


def test_beams_and_samples_after_a_shared_prefix(sharing, cold):
    warm(sharing)
    prompt = SYSTEM + question(2)
    options = dict(strategy="beam", num_beams=3, num_return_sequences=2, length_penalty=0.7,
                   processors=[proc.configure(proc.RepetitionPenalty, penalty=1.3)])
    shared, reference = run(sharing, prompt, **options), run(cold, prompt, **options)
    assert shared.stats.shared_tokens == len(SYSTEM)
    assert [s.token_ids for s in shared.sequences] == [s.token_ids for s in reference.sequences]
    for a, b in zip(shared.sequences, reference.sequences):
        assert a.score == pytest.approx(b.score, abs=1e-4)
    samples = dict(strategy="sample", num_samples=3, seed=11)
    assert ([s.token_ids for s in run(sharing, SYSTEM + question(3), **samples).sequences]
            == [s.token_ids for s in run(cold, SYSTEM + question(3), **samples).sequences])


def test_a_failed_call_puts_back_the_cache_it_continued(sharing, cold):
    warm(sharing)
    session = sharing.session()
    mine = tokens(80, seed=9)
    session.generate(token_ids=mine, max_new_tokens=3, eos_token_ids=[])
    before = (list(session.history), session.cached, session.cache.prefix, session.cache.nbytes)

    def explode(logits, context):
        raise RuntimeError("boom")

    with pytest.raises(Exception):
        session.generate(token_ids=SYSTEM + question(2), max_new_tokens=3, processors=[explode])
    assert (session.history, session.cached, session.cache.prefix, session.cache.nbytes) == before
    follow = session.history + question(4)
    result = session.generate(token_ids=follow, max_new_tokens=6, eos_token_ids=[])
    assert result.stats.reused_tokens == before[1] and result.token_ids == run(cold, follow, n=6).token_ids


def test_shared_prefixes_fit_where_copies_would_not_and_a_refusal_evicts_nobody(any_engine):
    per_token = Engine(any_engine.model, any_engine.tokenizer).store.bytes_per_token
    engine = Engine(any_engine.model, any_engine.tokenizer, cache_budget_bytes=200 * per_token)
    a, b, c = engine.session(), engine.session(), engine.session()
    a.generate(token_ids=SYSTEM + question(1), max_new_tokens=2, eos_token_ids=[])  # 163 tokens held
    result = b.generate(token_ids=SYSTEM + question(2), max_new_tokens=4, eos_token_ids=[])  # 16 more, not 166
    assert result.stats.shared_tokens == len(SYSTEM) and engine.stats()["evictions"] == 0
    held = (a.cached, b.cached, engine.store.used_bytes)
    with pytest.raises(CacheBudgetExceeded):  # 64 of its own do not fit even with b's own tokens evicted
        c.generate(token_ids=SYSTEM + question(3, n=60), max_new_tokens=4, eos_token_ids=[])
    assert (a.cached, b.cached, engine.store.used_bytes) == held and engine.stats()["evictions"] == 0
    assert c.history == [] and c.cached == 0


def test_a_fork_copies_nothing_and_continues_like_a_cold_run(sharing, cold):
    session = sharing.session()
    session.generate(token_ids=SYSTEM, max_new_tokens=4, eos_token_ids=[])
    used = sharing.store.used_bytes
    twin = session.fork()
    assert sharing.store.used_bytes == used and twin.cached == session.cached
    left, right = session.history + [11], session.history + [12, 13]
    cached = session.cached
    a = twin.generate(token_ids=left, max_new_tokens=6, eos_token_ids=[])
    b = session.generate(token_ids=right, max_new_tokens=6, eos_token_ids=[])
    assert a.token_ids == run(cold, left, n=6).token_ids and b.token_ids == run(cold, right, n=6).token_ids
    assert a.stats.reused_tokens == b.stats.reused_tokens == cached


def test_forks_of_forks_stop_growing_the_chain_and_stay_exact(sharing, cold):
    session = sharing.session()
    history = SYSTEM[:40]
    session.generate(token_ids=history, max_new_tokens=1, eos_token_ids=[])
    depths = []
    for step in range(MAX_DEPTH + 2):
        twin = session.fork()
        depths.append(twin.cache.depth)
        history = twin.history + [20 + step]
        twin.generate(token_ids=history, max_new_tokens=1, eos_token_ids=[])
        session = twin
    assert depths == list(range(1, MAX_DEPTH + 1)) + [0, 1]  # the fork past the limit is a copy
    final, cached = session.history + [5], session.cached
    result = session.generate(token_ids=final, max_new_tokens=6, eos_token_ids=[])
    assert result.stats.reused_tokens == cached and result.token_ids == run(cold, final, n=6).token_ids


def test_a_session_continuing_a_shared_prefix_saves_all_of_it(sharing, cold, tmp_path):
    warm(sharing)
    session = sharing.session()
    session.generate(token_ids=SYSTEM + question(2), max_new_tokens=3, eos_token_ids=[])
    session.save(tmp_path / "s")
    restored = cold.restore(tmp_path / "s")
    follow = session.history + [7]
    result = restored.generate(token_ids=follow, max_new_tokens=6, eos_token_ids=[])
    assert result.stats.reused_tokens == session.cached and result.token_ids == run(cold, follow, n=6).token_ids


def test_keys_a_shift_moved_are_never_shared(engine):
    """A shifted window's keys are approximate: another session shares only what comes before them."""
    sharing = Engine(engine.model, engine.tokenizer)
    cold = Engine(engine.model, engine.tokenizer, share_prefixes=False)
    window = tokens(200, seed=61)
    rolled = SYSTEM[:40] + window
    slider = sharing.session()
    slider.generate(token_ids=SYSTEM[:40] + tokens(60, seed=62) + window, max_new_tokens=1, eos_token_ids=[])
    slid = slider.generate(token_ids=rolled, max_new_tokens=1, eos_token_ids=[], reuse="shift", keep=40)
    assert slid.stats.shifted_tokens == len(window) - 1 and slider.cache.exact == 40
    prompt = rolled + question(1)
    result = run(sharing, prompt)  # the slider holds all of it but the question, exact for 40 tokens
    assert result.stats.shared_tokens == result.stats.reused_tokens == 40
    assert result.token_ids == run(cold, prompt).token_ids


def windowed(engine):
    """A sharing engine, one that shares nothing, and a session of the first continuing the system prompt
    another session left, then holding 30 tokens and an 80-token window of its own."""
    sharing = Engine(engine.model, engine.tokenizer)
    cold = unshared(engine)
    warm(sharing)
    session = sharing.session()
    window = tokens(80, seed=71)
    session.generate(token_ids=SYSTEM + tokens(30, seed=72) + window, max_new_tokens=1, eos_token_ids=[])
    return sharing, cold, session, window


def test_a_session_continuing_a_shared_prefix_shifts_only_its_own_tokens(engine):
    sharing, cold, session, window = windowed(engine)
    assert session.cache.offset == len(SYSTEM)
    entry = session.cache.prefix
    kept = [k.clone() for k in entry.keys]
    slid = session.generate(token_ids=SYSTEM + window, max_new_tokens=4, eos_token_ids=[], reuse="shift",
                            keep=len(SYSTEM))
    assert slid.stats.shifted_tokens == len(window) - 1
    assert all(torch.equal(a, b) for a, b in zip(kept, entry.keys))  # the shared keys are untouched
    assert session.cache.exact == len(SYSTEM)
    prompt = SYSTEM + question(5)
    other = run(sharing, prompt)
    assert other.stats.shared_tokens == len(SYSTEM) and other.token_ids == run(cold, prompt).token_ids


def test_a_saved_shifted_session_stays_unshared_after_restore(engine, tmp_path):
    sharing = Engine(engine.model, engine.tokenizer)
    window = tokens(120, seed=81)
    slider = sharing.session()
    slider.generate(token_ids=SYSTEM[:50] + tokens(60, seed=82) + window, max_new_tokens=1, eos_token_ids=[])
    slider.generate(token_ids=SYSTEM[:50] + window, max_new_tokens=1, eos_token_ids=[], reuse="shift", keep=50)
    slider.save(tmp_path / "slid")
    restored = sharing.restore(tmp_path / "slid")
    assert restored.cache.exact == 50 and restored.cached == slider.cached
    slider.close()
    result = run(sharing, SYSTEM[:50] + window + question(2))
    assert result.stats.shared_tokens == 50 and result.stats.reused_tokens == 50


def test_a_shift_moves_tokens_out_of_the_shared_prefix_as_it_would_its_own(engine):
    """Another session sharing a session's cache must not take its shift away: the moved tokens are read
    from the shared entry and become its own, giving what the same calls give without any sharing."""
    sharing = Engine(engine.model, engine.tokenizer)
    alone = Engine(engine.model, engine.tokenizer, share_prefixes=False)
    head, window = tokens(60, seed=91), tokens(100, seed=92)
    results = []
    for candidate in (sharing, alone):
        slider = candidate.session()
        slider.generate(token_ids=head + window, max_new_tokens=3, eos_token_ids=[])
        candidate.session().generate(token_ids=head + window[:50], max_new_tokens=1, eos_token_ids=[])
        slid = slider.generate(token_ids=window + question(3), max_new_tokens=6, eos_token_ids=[], reuse="shift")
        results.append(slid)
    shared, reference = results
    assert sharing.stats()["shared_prefixes"] == 1 and alone.stats()["shared_prefixes"] == 0
    assert shared.stats.shifted_tokens == reference.stats.shifted_tokens == len(window)
    assert shared.token_ids == reference.token_ids


def test_a_second_shift_keeping_more_does_not_make_the_first_ones_keys_exact(engine):
    """A shift with keep 0 then one with keep 60: the keys after position 0 stay approximate, unshared."""
    sharing = Engine(engine.model, engine.tokenizer)
    cold = unshared(engine)
    text = tokens(200, seed=95)
    slider = sharing.session()
    slider.generate(token_ids=text, max_new_tokens=1, eos_token_ids=[])
    slider.generate(token_ids=text[10:], max_new_tokens=1, eos_token_ids=[], reuse="shift")
    slider.generate(token_ids=slider.history[:60] + slider.history[70:], max_new_tokens=1, eos_token_ids=[],
                    reuse="shift", keep=60)
    assert slider.cache.exact == 0
    prompt = slider.history + question(1)
    result = run(sharing, prompt)
    assert result.stats.shared_tokens == 0 and result.token_ids == run(cold, prompt).token_ids


# ---- the cost of finding a prefix: common_prefix in slices, the probe, the cap on idle entries ------------


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 31, 32, 33, 95, 96, 97, 223, 224, 225, 479, 480, 481, 1000])
def test_common_prefix_finds_a_mismatch_at_every_block_edge(n):
    a = list(range(n + 40))
    b = a[:n] + [-1] + a[n + 1 :]
    assert common_prefix(a, b) == n
    assert common_prefix(a, list(a)) == len(a)
    assert common_prefix(a, a[:n]) == common_prefix(a[:n], a) == n
    for start in (0, n // 2, n):
        assert common_prefix(a, b, start) == n
        assert common_prefix(a, b, start, end=n // 3) == n // 3  # `end` first, when known equal past it


@settings(max_examples=400, deadline=None)
@given(common=st.lists(st.integers(0, 2), max_size=600),
       tails=st.tuples(*[st.lists(st.integers(0, 2), max_size=80)] * 2), data=st.data())
def test_common_prefix_is_a_token_by_token_walk(common, tails, data):
    a, b = common + tails[0], common + tails[1]
    end = data.draw(st.none() | st.integers(0, len(a)), label="end")
    start = data.draw(st.integers(0, reference_common_prefix(a, b)), label="start")  # known equal
    assert common_prefix(a, b, start, end) == reference_common_prefix(a, b, start, end)
    assert common_prefix(b, a, start) == reference_common_prefix(b, a, start)


class _Session:
    """What `find` reads of a session, over a store whose caches hold no tensors (no layers learnt)."""

    def __init__(self, engine, history, cache):
        self.engine, self.history, self.cache = engine, history, cache


class _Engine:
    def __init__(self):
        self.share_prefixes = True
        self.store = KVStore(2**40, torch.device("cpu"), torch.float32)
        self.sessions = []


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_find_picks_what_a_full_scan_token_by_token_picks(seed):
    """Random stores (entries continuing entries, sessions continuing them, shorter links, approximate keys,
    pinned and closed sessions), random inputs that share their heads: the probe and the counts reused
    along chains change nothing `find` picks."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3) for _ in range(rng.randrange(20, 150))] for _ in range(3)]
    engine = _Engine()
    store = engine.store

    def text(n):
        return [rng.randrange(3) for _ in range(n)]

    def open_session(history, prefix=None, link=0):
        cache = store.cache()
        if prefix is not None:
            store.link(cache, prefix, link)
        cache.length = rng.randint(0, len(history) - cache.offset)
        if cache.length and rng.random() < 0.2:  # a shift moved its keys from here on (or, here, any token)
            cache.approximate_from = rng.randint(0, cache.end)
        cache.pinned = rng.random() < 0.1
        engine.sessions.append(_Session(engine, history, cache))

    for _ in range(rng.randint(1, 25)):
        entries = store.shared
        action = rng.random()
        if action < 0.3 or not engine.sessions:
            open_session(rng.choice(heads)[: rng.randint(0, 150)] + text(rng.randint(1, 60)))
        elif action < 0.6 and entries:
            entry = rng.choice(entries)
            link = rng.randint(1, entry.end)
            open_session(entry.tokens[:link] + text(rng.randint(0, 60)), entry, link)
        elif action < 0.75:
            other = rng.choice(engine.sessions)
            if other.cache.length and not other.cache.pinned:
                store.share(other.cache, other.history[: other.cache.end])
        elif action < 0.9:  # used: it and its chain move to the end of the order `find` scans in
            store.touch(rng.choice(engine.sessions).cache)
        else:
            other = engine.sessions.pop(rng.randrange(len(engine.sessions)))
            store.release(other.cache)
    sources = [e.tokens for e in store.shared] + [s.history for s in engine.sessions] + heads
    for _ in range(20):
        input_ids = rng.choice(sources)[: rng.randint(0, 200)] + text(rng.randint(0, 40))
        probe = rng.choice(engine.sessions) if engine.sessions and rng.random() < 0.5 else _Session(engine, [], None)
        own = rng.choice([0, 0, rng.randint(0, len(input_ids))])
        assert picked(find(probe, input_ids, own)) == reference_find(probe, input_ids, own)




def shared_pair(engine, system, close=True):
    """Two sessions after `system`: the second continues the first's cache, which becomes an entry."""
    pair = [engine.session(), engine.session()]
    for q, s in enumerate(pair):
        s.generate(token_ids=system + question(q), max_new_tokens=2, eos_token_ids=[])
    if close:
        for s in pair:
            s.close()
    return pair


def test_idle_prefixes_beyond_the_cap_are_evicted_least_recently_used_first(sharing, monkeypatch):
    monkeypatch.setattr(kv, "MAX_IDLE_SHARED", 3)
    systems = [tokens(40, seed=400 + i) for i in range(5)]
    counts = []
    for i, system in enumerate(systems):
        shared_pair(sharing, system)
        if i == 2:  # a later session continues the first entry: it becomes the most recently used
            assert run(sharing, systems[0] + question(7), n=2).stats.shared_tokens == 40
        counts.append(sharing.stats()["shared_prefixes"])
        assert_books_balance(sharing.store)
    assert counts == [1, 2, 3, 3, 3]
    assert [entry.tokens[:40] for entry in sharing.store.shared] == [systems[0], systems[3], systems[4]]
    stats = sharing.stats()
    assert stats["evictions"] == 2 and sharing.store.used_bytes == stats["shared_bytes"]
    assert stats["shared_bytes"] == sum(entry.nbytes for entry in sharing.store.shared)


def test_the_cap_counts_a_chain_of_forks_that_no_session_continues(any_engine, monkeypatch):
    """Forking a fork makes a chain of entries, each continuing the one before. Once its sessions close, no
    session continues any link: the cap counts them all (it counted only the last, so 256 chains of 4 kept
    1,024), evicting from the end of a chain, which nothing continues, and what is left still serves."""
    monkeypatch.setattr(kv, "MAX_IDLE_SHARED", 3)
    engine, cold = Engine(any_engine.model, any_engine.tokenizer), unshared(any_engine)
    for chain in range(4):
        prompt, sessions = tokens(40, seed=800 + chain), [engine.session()]
        sessions[0].generate(token_ids=prompt, max_new_tokens=0)
        for link in range(3):
            sessions.append(sessions[-1].fork())  # the source's cache becomes an entry both continue
            prompt = prompt + tokens(20, seed=900 + 10 * chain + link)
            sessions[-1].generate(token_ids=prompt, max_new_tokens=0)
        assert len(engine.store.shared) - len(unused_entries(engine)) == 3  # the three links, continued
        for session in sessions:
            session.close()
        assert len(unused_entries(engine)) <= 3
        assert_books_balance(engine.store)
    assert len(engine.store.shared) == 3 and engine.stats()["evictions"] == 9
    last = engine.store.shared[-1]  # the most recently used: the last chain's first link
    follow = last.tokens + question(3)
    result = run(engine, follow, n=6)
    assert result.stats.shared_tokens == len(last.tokens) and result.token_ids == run(cold, follow, n=6).token_ids


def test_the_cap_never_evicts_a_prefix_a_session_continues(any_engine, monkeypatch):
    monkeypatch.setattr(kv, "MAX_IDLE_SHARED", 1)
    engine, cold = Engine(any_engine.model, any_engine.tokenizer), unshared(any_engine)
    _, second = shared_pair(engine, SYSTEM, close=False)  # both continue one entry
    entry = second.cache.prefix
    for i in range(3):
        shared_pair(engine, tokens(40, seed=450 + i))
    assert entry.refs == 2 and any(e is entry for e in engine.store.shared)
    assert len(unused_entries(engine)) == 1 and engine.stats()["evictions"] == 2
    assert_books_balance(engine.store)
    follow, cached = second.history + question(9), second.cached
    result = second.generate(token_ids=follow, max_new_tokens=8, eos_token_ids=[])
    assert result.stats.reused_tokens == cached and result.token_ids == run(cold, follow).token_ids


def test_the_cap_spares_the_idle_prefix_an_admission_is_about_to_continue(any_engine, monkeypatch):
    """Room for a call continuing an idle entry evicts the caches of sessions continuing another, which
    becomes idle too: one past the cap. The cap evicts that one, though the entry the call continues
    was used less recently."""
    monkeypatch.setattr(kv, "MAX_IDLE_SHARED", 1)
    engine, cold = Engine(any_engine.model, any_engine.tokenizer), unshared(any_engine)
    x, y = tokens(40, seed=500), tokens(40, seed=501)
    shared_pair(engine, x)
    continuing_y = shared_pair(engine, y, close=False)
    prompt, n = x + question(5), 8
    needed = (len(prompt) + n - len(x)) * engine.store.bytes_per_token
    engine.store.budget_bytes = engine.store.used_bytes - sum(s.cache.nbytes for s in continuing_y) + needed
    result = run(engine, prompt, n=n)
    assert result.stats.shared_tokens == len(x) and result.token_ids == run(cold, prompt, n=n).token_ids
    assert [entry.tokens[: len(x)] for entry in engine.store.shared] == [x]
    assert engine.stats()["evictions"] == 3 and [s.cached for s in continuing_y] == [0, 0]
    assert_books_balance(engine.store)


def test_under_the_cap_results_equal_an_engine_that_shares_nothing(any_engine, monkeypatch):
    """Sessions of four system prompts, two of each in turn, each closed once the next has run: an entry
    per prompt, two idle ones kept at most. A session continues what is left, or computes what the cap
    evicted, and its greedy tokens are a fresh cold session's."""
    monkeypatch.setattr(kv, "MAX_IDLE_SHARED", 2)
    engine, cold = Engine(any_engine.model, any_engine.tokenizer), unshared(any_engine)
    systems = [tokens(40 + 10 * i, seed=700 + i) for i in range(4)]
    previous, shared = None, []
    for step, which in enumerate([0, 0, 1, 1, 2, 2, 3, 3, 0, 1, 2]):
        prompt = systems[which] + question(step)
        session = engine.session()
        result = session.generate(token_ids=prompt, max_new_tokens=6, eos_token_ids=[])
        assert result.token_ids == run(cold, prompt, n=6).token_ids
        shared.append(result.stats.shared_tokens)
        if previous is not None:
            previous.close()
        previous = session
        assert len(unused_entries(engine)) <= 2
        assert_books_balance(engine.store)
    # the entries of prompts 0 and 1 went when those of 2 and 3 became idle; that of 2 is still there
    assert shared == [0, 40, 0, 50, 0, 60, 0, 70, 0, 0, 60]
    assert engine.stats()["evictions"] == 2


@pytest.mark.parametrize("where", ["continuing a shared prefix", "shifting"])
def test_a_reuse_failing_midway_empties_the_cache_and_leaks_no_reference(engine, monkeypatch, where):
    """A failure inside the reuse itself (memory, the model's rotary module) may leave the cache half
    moved: it is emptied and every link it held let go; the history stays and the next call equals a cold run."""
    from sidecar import kv, shift

    sharing, cold, session, window = windowed(engine)
    entry, history = session.cache.prefix, list(session.history)
    refs = entry.refs
    if where == "shifting":
        monkeypatch.setattr(shift, "move", lambda *a: (_ for _ in ()).throw(MemoryError("no room to move")))
        prompt, options = SYSTEM + window, {"reuse": "shift", "keep": len(SYSTEM)}
    else:  # its own cache is copied aside before it continues the other one, which runs out of memory
        session.generate(token_ids=tokens(40, seed=73), max_new_tokens=1, eos_token_ids=[])  # its own, unshared
        history, refs = list(session.history), entry.refs
        monkeypatch.setattr(kv.KVCache, "tail", lambda *a: (_ for _ in ()).throw(MemoryError("no room to copy")))
        prompt, options = SYSTEM + question(6), {}
    with pytest.raises(MemoryError):
        session.generate(token_ids=prompt, max_new_tokens=4, eos_token_ids=[], **options)
    monkeypatch.undo()
    assert entry.refs == refs - (where == "shifting")  # the link the failed call's session had is gone
    assert_books_balance(sharing.store)
    assert session.history == history and session.cached == 0 and session.cache.prefix is None
    assert run(sharing, prompt, **options).token_ids == run(cold, prompt, **options).token_ids
    again = session.generate(token_ids=prompt, max_new_tokens=8, eos_token_ids=[], **options)
    assert again.token_ids == run(cold, prompt, **options).token_ids
