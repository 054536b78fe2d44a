"""Sessions decoding together attend as one group (`kv.DecodeGroup`): against solo runs and `model.generate`,
the keys a cold forward pass computes for what each session holds afterwards, and the memory budget."""

import pytest
import torch
from transformers import DynamicCache

from sidecar import Engine

from .conftest import tokens
from .test_batching import drain, reference_greedy


def cold_keys(engine, token_ids):
    """Each layer's keys and values of `token_ids`, from transformers' own forward and `DynamicCache`."""
    cache = DynamicCache(config=engine.model.config)
    with torch.inference_mode():
        engine.model(torch.tensor([token_ids]), cache=cache, use_cache=True)
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def assert_cache_is_cold(engine, session):
    """The session's cache holds what a cold forward pass over its history computes, the prefix it
    continues included (the group's lane was copied back into its own buffers)."""
    held = session.history[: session.cached]
    for layer, (keys, values) in enumerate(cold_keys(engine, held)):
        own_keys, own_values = session.cache.span(layer)
        torch.testing.assert_close(own_keys[:, : len(held)], keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(own_values[:, : len(held)], values, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_sessions_decoding_together_form_a_group_equal_their_solo_runs_and_keep_their_caches(kind, engine, gpt2_engine,
                                                                                              group_sizes):
    engine = {"llama": engine, "gpt2": gpt2_engine}[kind]
    prompts = [tokens(n, seed=300 + n, high=engine.vocab_size) for n in (4, 13, 27, 40, 66)]
    sessions = [engine.session() for _ in prompts]
    try:
        first = [s.stream(token_ids=p, max_new_tokens=10, eos_token_ids=[]) for s, p in zip(sessions[:3], prompts[:3])]
        for _ in range(3):
            engine.scheduler.tick()
        late = [s.stream(token_ids=p, max_new_tokens=10, eos_token_ids=[]) for s, p in zip(sessions[3:], prompts[3:])]
        early = [[e.token_id for e in g.take_events()] for g in first] + [[] for _ in late]
        generations = first + late
        streamed = [a + b for a, b in zip(early, drain(generations, engine, cancel_after=(generations[1], 5)))]
        assert 3 in group_sizes and 5 in group_sizes  # the three, then all five once the late ones decode
        for i, (g, p, got) in enumerate(zip(generations, prompts, streamed)):
            expected = reference_greedy(engine, p, 10)[: len(got)]
            assert g.result.token_ids == got == expected, f"session {i}"
        assert generations[1].result.finish_reason == "cancelled"
        assert not engine.scheduler.group.members and engine.store.used_bytes == sum(
            c.nbytes for c in engine.store._caches.values())  # dissolved, its memory given back
        for session in sessions:
            assert_cache_is_cold(engine, session)
            held, history = session.cached, session.history + [7]
            follow = session.generate(token_ids=history, max_new_tokens=3, eos_token_ids=[])
            assert follow.stats.reused_tokens == held == len(history) - 2
            assert follow.token_ids == reference_greedy(engine, history, 3)
    finally:
        for s in sessions:
            s.close()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_sessions_continuing_one_system_prompt_decode_as_a_group_reading_it_once(kind, engine, gpt2_engine, group_sizes):
    """Chats of one app continue its system prompt's shared cache (`sharing`): the most of them that
    continue one prefix form the group, which reads that prefix in place; the others (another system
    prompt, none) decode beside it; every one equals its solo run."""
    engine = {"llama": engine, "gpt2": gpt2_engine}[kind]

    def some(n, seed):
        return tokens(n, seed=seed, high=engine.vocab_size)

    system, other = some(48, 370), some(40, 371)
    prompts = [system + some(n, 372 + n) for n in (3, 9, 17, 30)] + [other + some(5, 380), other + some(8, 381), some(12, 382)]
    seen = []

    def watch(logits, context):
        group = engine.scheduler.group
        seen.append((len(group.members), [n for _, n in group.chain]))
        return logits

    hosts = [engine.session() for _ in range(2)]
    sessions = [engine.session() for _ in prompts]
    try:
        for host, prefix in zip(hosts, (system, other)):  # idle sessions whose caches the others continue
            host.generate(token_ids=prefix + [5], max_new_tokens=1, eos_token_ids=[])
        generations = [s.stream(token_ids=p, max_new_tokens=10, eos_token_ids=[], processors=[watch])
                       for s, p in zip(sessions, prompts)]
        streamed = drain(generations, engine)
        assert [s.cache.depth for s in sessions] == [1, 1, 1, 1, 1, 1, 0]
        assert (4, [len(system)]) in seen and 4 in group_sizes  # the system prompt's four, reading it in place
        for i, (g, p, got) in enumerate(zip(generations, prompts, streamed)):
            assert g.result.token_ids == got == reference_greedy(engine, p, 10), f"session {i}"
            assert g.result.stats.shared_tokens == (len(system) if i < 4 else len(other) if i < 6 else 0)
        assert not engine.scheduler.group.members
        for session in sessions:
            assert_cache_is_cold(engine, session)
    finally:
        for s in hosts + sessions:
            s.close()


def test_a_burst_of_other_requests_does_not_break_up_a_group_whose_members_still_decode(engine, group_sizes):
    """Three chats of one system prompt decode as a group; four one-shot requests without it arrive and
    end meanwhile. They outnumber the group, yet it is kept (and copied once), not dissolved for them
    and copied again when they end."""
    system = tokens(48, seed=390)
    chats = [system + tokens(n, seed=391 + n) for n in (4, 7, 11)]
    burst = [tokens(n, seed=400 + n) for n in (5, 6, 8, 9)]
    host, sessions = engine.session(), [engine.session() for _ in chats + burst]
    try:
        host.generate(token_ids=system + [5], max_new_tokens=1, eos_token_ids=[])
        generations = [s.stream(token_ids=p, max_new_tokens=16, eos_token_ids=[]) for s, p in zip(sessions, chats)]
        for _ in range(4):
            engine.scheduler.tick()
        assert group_sizes == [3]
        generations += [s.stream(token_ids=p, max_new_tokens=4, eos_token_ids=[]) for s, p in zip(sessions[3:], burst)]
        streamed = [[e.token_id for e in g.take_events()] for g in generations]
        streamed = [a + b for a, b in zip(streamed, drain(generations, engine))]
        assert group_sizes == [3]
        for g, p, got in zip(generations, chats + burst, streamed):
            assert g.result.token_ids == got == reference_greedy(engine, p, len(got))
    finally:
        for s in [host, *sessions]:
            s.close()


def test_a_member_that_fails_or_whose_session_closes_mid_step_leaves_the_others_exact(engine, group_sizes):
    prompts = [tokens(n, seed=320 + n) for n in (6, 15, 23)]
    sessions = [engine.session() for _ in prompts]

    def explode(logits, context):
        if context.length > context.input_length + 3:
            raise RuntimeError("boom")
        return logits

    def close_the_last(logits, context):
        if context.length == context.input_length + 4:
            sessions[2].close()  # mid-step: its run is cancelled once the step ends, its cache freed now
        return logits

    try:
        failing = sessions[0].stream(token_ids=prompts[0], max_new_tokens=8, eos_token_ids=[], processors=[explode])
        fine = sessions[1].stream(token_ids=prompts[1], max_new_tokens=8, eos_token_ids=[], processors=[close_the_last])
        closed = sessions[2].stream(token_ids=prompts[2], max_new_tokens=8, eos_token_ids=[])
        drain([failing, fine, closed], engine)
        assert 3 in group_sizes
        assert isinstance(failing.error, RuntimeError) and sessions[0].history == [] and sessions[0].cached == 0
        assert closed.result.finish_reason == "cancelled"
        assert fine.result.token_ids == reference_greedy(engine, prompts[1], 8)
        assert_cache_is_cold(engine, sessions[1])
        assert not engine.scheduler.group.members
    finally:
        for s in sessions:
            s.close()


def test_the_group_forms_only_within_the_budget(default_dir, per_token, group_sizes):
    prompts = [tokens(10, seed=340), tokens(14, seed=341)]
    need = sum(len(p) + 8 for p in prompts)  # what the two generations reserve
    # room for the two, not for the group's copy of them (each lane as long as the longer one)
    engine = Engine.load(default_dir, cache_budget_bytes=(need + 2 * (len(prompts[1]) + 8) - 1) * per_token)
    sessions = [engine.session() for _ in prompts]
    generations = [s.stream(token_ids=p, max_new_tokens=8, eos_token_ids=[]) for s, p in zip(sessions, prompts)]
    streamed = drain(generations, engine)
    assert group_sizes == [] and engine.store.peak_bytes <= engine.store.budget_bytes
    for g, p, got in zip(generations, prompts, streamed):
        assert g.result.token_ids == got == reference_greedy(engine, p, 8)


def test_a_generation_waiting_for_memory_is_admitted_as_if_there_were_no_group(default_dir, per_token, group_sizes):
    """The group's copy is given back before admission: a generation that fits beside the others without
    it starts at once."""
    prompts = [tokens(10, seed=350), tokens(12, seed=351), tokens(9, seed=352)]
    two, group, third = len(prompts[0]) + len(prompts[1]) + 24, 2 * (len(prompts[1]) + 12), len(prompts[2]) + 12
    budget = two + group + third - 1  # room for the two and their group, or for the three: not for all of it
    engine = Engine.load(default_dir, cache_budget_bytes=budget * per_token)
    sessions = [engine.session() for _ in prompts]
    generations = [s.stream(token_ids=p, max_new_tokens=12, eos_token_ids=[]) for s, p in zip(sessions[:2], prompts[:2])]
    for _ in range(3):
        engine.scheduler.tick()
    assert engine.scheduler.group.members  # the two decode as a group, whose copy leaves no room for the third
    assert engine.store.used_bytes + (len(prompts[2]) + 12) * per_token > engine.store.budget_bytes
    generations.append(sessions[2].stream(token_ids=prompts[2], max_new_tokens=12, eos_token_ids=[]))
    engine.scheduler.tick()
    assert generations[2]._run.admitted and not engine.scheduler.waiting
    streamed = drain(generations, engine)
    assert engine.store.peak_bytes <= engine.store.budget_bytes
    for g, p, got in zip(generations, prompts, streamed):
        assert g.result.token_ids == got == reference_greedy(engine, p, 12)


@pytest.mark.parametrize("how", ["fork", "restore"])
def test_a_fork_that_needs_room_gets_the_groups_memory_first(default_dir, per_token, group_sizes, how, tmp_path):
    """Anything that makes room (a fork that copies, a restore, whose budget check comes first) is given
    the group's copy back before it is refused or evicts an idle cache."""
    prompts = [tokens(10, seed=360), tokens(12, seed=361)]
    idle_prompt = tokens(16, seed=362)
    two, group, idle = sum(len(p) + 12 for p in prompts), 2 * (len(prompts[1]) + 12), len(idle_prompt)  # idle: held
    # a fork copies what the idle session holds beside it; a restore comes with nothing else left to evict
    kept = idle if how == "fork" else 0
    engine = Engine.load(default_dir, share_prefixes=False, cache_budget_bytes=(two + group + idle + kept - 1) * per_token)
    with engine.session() as resting:
        resting.generate(token_ids=idle_prompt, max_new_tokens=1, eos_token_ids=[])
        if how == "restore":
            resting.save(tmp_path / "resting")
            resting.close()
        sessions = [engine.session() for _ in prompts]
        generations = [s.stream(token_ids=p, max_new_tokens=12, eos_token_ids=[]) for s, p in zip(sessions, prompts)]
        for _ in range(3):
            engine.scheduler.tick()
        assert engine.scheduler.group.members  # the fork needs the group's memory (and evicting nothing)
        evictions = engine.store.evictions
        with (resting.fork() if how == "fork" else engine.restore(tmp_path / "resting")) as twin:
            assert twin.history == resting.history and engine.store.evictions == evictions
            assert not engine.scheduler.group.members
            streamed = drain(generations, engine)
        for g, p, got in zip(generations, prompts, streamed):
            assert g.result.token_ids == got == reference_greedy(engine, p, 12)
        for s in sessions:
            s.close()
