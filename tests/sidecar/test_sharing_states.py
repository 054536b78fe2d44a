"""Random interleavings of what clients do to sessions that share prefixes, under a budget small enough to
evict (and under a cap of two idle shared prefixes, as well as the default one): after every step the KV
store's books must balance (bytes, reference counts, no cache read after it was freed, no more idle
prefixes than the cap), every generate must give what a fresh session of an engine that shares nothing
gives, and the cache `sharing.find` picks for it must be the one a full scan token by token picks.

hypothesis' state machine picks the steps and shrinks a failing run to the shortest one that fails.
"""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import processors as proc
from sidecar import Engine, kv, sharing
from sidecar.errors import CacheBudgetExceeded

from .conftest import assert_books_balance, picked, reference_find, tokens, unshared, unused_entries

PREFIXES = [tokens(n, seed=300 + n) for n in (40, 55, 70)]  # longer than MIN_SHARED_TOKENS: shared
STRICT = [proc.configure(proc.NoRepeatNGram, ngram_size=1)]  # every step depends on the logits' order


@pytest.fixture(scope="module")
def engines(engine):
    per_token = Engine(engine.model, engine.tokenizer).store.bytes_per_token
    return engine, per_token


@pytest.mark.parametrize("cap", [2, kv.MAX_IDLE_SHARED])
def test_sharing_under_random_steps(engines, cap, monkeypatch):
    engine, per_token = engines
    monkeypatch.setattr(kv, "MAX_IDLE_SHARED", cap)

    class Sessions(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.engine = Engine(engine.model, engine.tokenizer, cache_budget_bytes=500 * per_token)
            self.cold = unshared(engine)
            self.sessions = []  # (session, whether a shift made its cache approximate)

        def generate(self, index, token_ids, **options):
            session, approximate = self.sessions[index]
            before = (list(session.history), session.cached)
            own = session.reusable(token_ids)
            assert picked(sharing.find(session, token_ids[:-1], own)) == reference_find(session, token_ids[:-1], own)
            try:
                result = session.generate(token_ids=token_ids, max_new_tokens=2, eos_token_ids=[],
                                          processors=STRICT, **options)
            except CacheBudgetExceeded:
                assert (session.history, session.cached) == before
                return
            approximate = approximate or result.stats.shifted_tokens > 0
            self.sessions[index] = (session, approximate)
            if not approximate:
                with self.cold.session() as fresh:
                    expected = fresh.generate(token_ids=token_ids, max_new_tokens=2, eos_token_ids=[],
                                              processors=STRICT)
                assert result.token_ids == expected.token_ids

        @rule(prefix=st.sampled_from(PREFIXES), seed=st.integers(0, 50), n=st.integers(1, 12))
        def new_session(self, prefix, seed, n):
            self.sessions.append((self.engine.session(), False))
            self.generate(len(self.sessions) - 1, prefix + tokens(n, seed=seed))

        @precondition(lambda self: self.sessions)
        @rule(pick=st.integers(0, 100), seed=st.integers(0, 50), n=st.integers(1, 8), cut=st.integers(0, 30))
        def follow_up(self, pick, seed, n, cut):
            index = pick % len(self.sessions)
            history = self.sessions[index][0].history
            self.generate(index, history[: max(1, len(history) - cut)] + tokens(n, seed=seed))

        @precondition(lambda self: self.sessions)
        @rule(pick=st.integers(0, 100), seed=st.integers(0, 50), n=st.integers(1, 8))
        def replay(self, pick, seed, n):
            """A new session sent another one's conversation (a client that lost its session, say)."""
            history = self.sessions[pick % len(self.sessions)][0].history
            self.sessions.append((self.engine.session(), False))
            self.generate(len(self.sessions) - 1, history + tokens(n, seed=seed))

        @precondition(lambda self: self.sessions)
        @rule(pick=st.integers(0, 100), drop=st.integers(1, 30), n=st.integers(1, 5), keep=st.sampled_from([0, 0, 4, 40]))
        def slide(self, pick, drop, n, keep):
            index = pick % len(self.sessions)
            history = self.sessions[index][0].history
            if len(history) > keep + drop + 2:
                self.generate(index, history[:keep] + history[keep + drop :] + tokens(n, seed=drop), reuse="shift",
                              keep=keep)

        @precondition(lambda self: self.sessions)
        @rule(pick=st.integers(0, 100))
        def fork(self, pick):
            session, approximate = self.sessions[pick % len(self.sessions)]
            try:
                self.sessions.append((session.fork(), approximate))
            except CacheBudgetExceeded:
                pass

        @precondition(lambda self: self.sessions)
        @rule(pick=st.integers(0, 100))
        def close(self, pick):
            session, _ = self.sessions.pop(pick % len(self.sessions))
            session.close()

        @precondition(lambda self: self.sessions)
        @rule(pick=st.integers(0, 100), prefix=st.sampled_from(PREFIXES))
        def fail(self, pick, prefix):
            session, _ = self.sessions[pick % len(self.sessions)]
            before = (list(session.history), session.cached, session.cache.prefix, session.cache.length)

            def explode(logits, context):
                raise RuntimeError("boom")

            with pytest.raises((RuntimeError, CacheBudgetExceeded)) as failed:  # a refusal changes nothing either
                session.generate(token_ids=prefix + [9, 9], max_new_tokens=2, processors=[explode])
            assert isinstance(failed.value, CacheBudgetExceeded) or str(failed.value) == "boom"
            assert (list(session.history), session.cached, session.cache.prefix, session.cache.length) == before

        @invariant()
        def books_balance(self):
            store = self.engine.store
            assert_books_balance(store)
            assert len(unused_entries(self.engine)) <= cap
            for session, _ in self.sessions:
                assert session.cached <= len(session.history)

        def teardown(self):
            for session, _ in self.sessions:
                session.close()

    Sessions.TestCase.settings = settings(max_examples=25, stateful_step_count=20, deadline=None,
                                          suppress_health_check=list(HealthCheck))
    Sessions.TestCase().runTest()
