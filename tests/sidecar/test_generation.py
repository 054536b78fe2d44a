"""Generation against independent references: model.generate, a cold forward pass, fresh sessions."""

import pytest
import torch

import processors as P
from sidecar import Engine

from .conftest import tokens


def cold_logits(engine, ids):
    with torch.no_grad():
        return engine.model(torch.tensor([ids])).logits[0, -1].float()


def test_greedy_equals_model_generate(any_engine):
    prompt = tokens(24, seed=1)
    with torch.no_grad():
        reference = any_engine.model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, 24, dtype=torch.long),
            max_new_tokens=40, do_sample=False, pad_token_id=0,
        )[0, 24:].tolist()
    with any_engine.session() as session:
        result = session.generate(token_ids=prompt, max_new_tokens=40)
    assert result.token_ids == reference
    assert result.finish_reason == ("eos" if reference[-1] == 2 else "length")


def test_logits_after_reuse_equal_a_cold_forward(any_engine):
    recorded = []

    def record(logits, context):
        recorded.append((context.sequence[0, : context.length].tolist(), logits[0].clone()))
        return logits

    with any_engine.session() as session:
        first = session.generate(token_ids=tokens(30, seed=2), max_new_tokens=6, eos_token_ids=[])
        follow_up = tokens(30, seed=2) + first.token_ids + tokens(9, seed=3)
        recorded.clear()
        result = session.generate(token_ids=follow_up, max_new_tokens=5, processors=[record], eos_token_ids=[])
    assert result.stats.reused_tokens == 30 + 6 - 1  # the last generated token was never fed to the model
    assert len(recorded) == 5
    for sequence, logits in recorded:
        assert torch.allclose(logits, cold_logits(any_engine, sequence), atol=1e-4)


@pytest.mark.parametrize(
    "first, second, expected_reuse",
    [
        (lambda a, b, c, d: a, lambda a, b, c, d: a + b, 20),  # prefix: a then ab
        (lambda a, b, c, d: a + b, lambda a, b, c, d: a + c, 20),  # different suffix: ab then ac
        (lambda a, b, c, d: a + b + c, lambda a, b, c, d: b + c + d, 0),  # rolling: abc then bcd
    ],
    ids=["prefix", "different_suffix", "rolling"],
)
def test_petals_cases_mean_the_same_as_a_fresh_session(any_engine, first, second, expected_reuse):
    # each piece starts with its own marker token, so shared prefixes end exactly where the case says
    a, b, c, d = ([marker] + tokens(19, seed=marker, low=7) for marker in (3, 4, 5, 6))
    with any_engine.session() as session:
        earlier = session.generate(token_ids=first(a, b, c, d), max_new_tokens=8, eos_token_ids=[])
        assert earlier.token_ids[0] not in (4, 5), "degenerate setup: the answer would extend the prefix"
        reused = session.generate(token_ids=second(a, b, c, d), max_new_tokens=8, eos_token_ids=[])
    with any_engine.session() as fresh_session:
        fresh = fresh_session.generate(token_ids=second(a, b, c, d), max_new_tokens=8, eos_token_ids=[])
    assert reused.token_ids == fresh.token_ids and reused.text == fresh.text
    assert reused.stats.reused_tokens == expected_reuse
    assert reused.stats.prefill_tokens == len(second(a, b, c, d)) - expected_reuse
    assert fresh.stats.reused_tokens == 0


def test_identical_call_refeeds_only_the_last_input_token(engine):
    prompt = tokens(16, seed=4)
    with engine.session() as session:
        one = session.generate(token_ids=prompt, max_new_tokens=4)
        two = session.generate(token_ids=prompt, max_new_tokens=4)
    assert one.token_ids == two.token_ids
    assert (two.stats.reused_tokens, two.stats.prefill_tokens) == (15, 1)


def test_sampling_is_reproducible_by_seed(engine):
    prompt = tokens(12, seed=5)
    runs = []
    for seed in (7, 7, 8):
        with engine.session() as session:
            runs.append(session.generate(token_ids=prompt, max_new_tokens=30, strategy="sample", seed=seed).token_ids)
    assert runs[0] == runs[1] and runs[0] != runs[2]
    with engine.session() as session:
        session.generate(token_ids=prompt[:6], max_new_tokens=3)
        warm = session.generate(token_ids=prompt, max_new_tokens=30, strategy="sample", seed=7)
    assert warm.stats.reused_tokens == 6 and warm.token_ids == runs[0]


def test_processors_run_in_the_decode_loop(engine):
    prompt = tokens(12, seed=6)
    with engine.session() as session:
        plain = session.generate(token_ids=prompt, max_new_tokens=20, eos_token_ids=[])
        banned = session.generate(
            token_ids=prompt, max_new_tokens=20, eos_token_ids=[],
            processors=[P.SuppressTokens(sorted(set(plain.token_ids))), P.NoRepeatNGram(2)],
        )
    assert not set(banned.token_ids) & set(plain.token_ids)


def test_chunked_prefill_counts_one_forward_per_chunk(default_dir):
    engine = Engine.load(default_dir, prefill_chunk=7)
    calls = []
    hook = engine.model.register_forward_hook(lambda module, args, kwargs, out: calls.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        with engine.session() as session:
            chunked = session.generate(token_ids=tokens(50, seed=8), max_new_tokens=3)
    finally:
        hook.remove()
    # 50 prompt tokens in chunks of 7, then one pass per decode step (the last token is never fed)
    assert calls == [7] * 7 + [1] + [1, 1]
    with Engine.load(default_dir).session() as session:
        whole = session.generate(token_ids=tokens(50, seed=8), max_new_tokens=3)
    assert chunked.token_ids == whole.token_ids


def test_eviction_changes_nothing_but_reuse(default_dir, per_token):
    engine = Engine.load(default_dir, cache_budget_bytes=26 * per_token)  # one generation's cache at a time
    prompt = tokens(20, seed=9)
    first, other = engine.session(), engine.session()
    before = first.generate(token_ids=prompt, max_new_tokens=6)
    other.generate(token_ids=tokens(20, seed=10), max_new_tokens=6)
    stats = engine.stats()
    assert first.cached == 0 and stats["evictions"] >= 1 and stats["sessions"] == 2
    again = first.generate(token_ids=prompt, max_new_tokens=6)
    assert again.token_ids == before.token_ids and again.stats.reused_tokens == 0
    roomy = Engine.load(default_dir)
    s = roomy.session()
    s.generate(token_ids=prompt, max_new_tokens=6)
    assert s.generate(token_ids=prompt, max_new_tokens=6).stats.reused_tokens == 19
    assert roomy.stats()["cache_bytes"] == s.cache_bytes > 0 and roomy.stats()["evictions"] == 0


def test_budget_evicts_least_recently_used_first(default_dir):
    probe = Engine.load(default_dir)
    s = probe.session()
    s.generate(token_ids=tokens(20, seed=1), max_new_tokens=5)
    one_cache = s.cache_bytes
    engine = Engine.load(default_dir, cache_budget_bytes=int(one_cache * 2.5))
    a, b, c = engine.session(), engine.session(), engine.session()
    for i, session in enumerate((a, b, c)):
        session.generate(token_ids=tokens(20, seed=i), max_new_tokens=5)
    assert (a.cached, b.cached > 0, c.cached > 0) == (0, True, True)
    assert engine.stats()["evictions"] == 1


def test_transformers_own_processors_run_as_transformers_runs_them(engine):
    """(helper-79) A transformers LogitsProcessor given as a processor was called as f(logits, context), the other
    way round, and failed at the first step with a raw AttributeError: it is called as transformers calls it, with
    every token so far, greedy, sampled and in beams (whose reordering it reads from the rows)."""
    import transformers as T

    from sidecar import errors

    prompt = tokens(12, seed=40) * 2
    greedy = [T.RepetitionPenaltyLogitsProcessor(1.3), T.NoRepeatNGramLogitsProcessor(2)]
    with engine.session() as session:
        ours = session.generate(token_ids=prompt, max_new_tokens=10, eos_token_ids=[], processors=greedy).token_ids
        listed = session.generate(token_ids=prompt, max_new_tokens=10, eos_token_ids=[],
                                  processors=T.LogitsProcessorList(greedy)).token_ids
        sampled = session.generate(token_ids=prompt, max_new_tokens=10, eos_token_ids=[], strategy="sample", seed=3,
                                   processors=[T.TemperatureLogitsWarper(0.7), T.TopKLogitsWarper(5)]).token_ids
        beams = session.generate(token_ids=prompt, max_new_tokens=8, eos_token_ids=[2], strategy="beam", num_beams=3,
                                 processors=[T.RepetitionPenaltyLogitsProcessor(1.3)]).token_ids
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        expected = engine.model.generate(ids, max_new_tokens=10, do_sample=False, repetition_penalty=1.3,
                                         no_repeat_ngram_size=2, eos_token_id=None, pad_token_id=0)
        torch.manual_seed(3)
        expected_sampled = engine.model.generate(ids, max_new_tokens=10, do_sample=True, temperature=0.7, top_k=5,
                                                 eos_token_id=None, pad_token_id=0)
        expected_beams = engine.model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False,
                                               repetition_penalty=1.3, eos_token_id=2, pad_token_id=0)
    assert ours == listed == expected[0, len(prompt):].tolist()
    with engine.session() as session:  # (helper-80) called the other way round, with raw errors at the first step
        with pytest.raises(errors.InvalidProcessor, match="is a LogitsProcessorList: give its processors"):
            session.generate(token_ids=prompt, processors=[T.LogitsProcessorList(greedy)])
        with pytest.raises(errors.InvalidProcessor, match="is the class RepetitionPenaltyLogitsProcessor, not a processor"):
            session.generate(token_ids=prompt, processors=[T.RepetitionPenaltyLogitsProcessor])
    assert sampled == expected_sampled[0, len(prompt):].tolist()
    assert beams == expected_beams[0, len(prompt):].tolist()[: len(beams)]


def test_token_ids_may_be_a_torch_or_numpy_vector_and_a_matrix_or_a_tensor_prompt_says_what_to_give(engine):
    """(helper-79) transformers users hold their ids as tensors: `token_ids=torch.tensor([...])` was refused as no list."""
    import numpy as np

    from sidecar import errors

    with engine.session() as session:
        listed = session.generate(token_ids=[5, 6, 7], max_new_tokens=3, eos_token_ids=[2]).token_ids
        assert session.generate(token_ids=torch.tensor([5, 6, 7]), max_new_tokens=3,
                                eos_token_ids=torch.tensor([2])).token_ids == listed
        assert session.generate(token_ids=np.array([5, 6, 7]), max_new_tokens=3, eos_token_ids=[2]).token_ids == listed
        with pytest.raises(errors.InvalidArgument, match="give one row"):
            session.generate(token_ids=torch.tensor([[5, 6, 7]]))
        with pytest.raises(errors.InvalidArgument, match=r"token ids go in token_ids="):
            session.generate(torch.tensor([5, 6, 7]))
        assert session.generate(token_ids=[5, 6, 7], max_new_tokens=3, eos_token_ids=torch.tensor(2)).token_ids == listed
        with pytest.raises(errors.InvalidArgument, match="values cannot be read"):  # (helper-80) a raw error before
            session.generate(token_ids=torch.empty(3, dtype=torch.long, device="meta"))
