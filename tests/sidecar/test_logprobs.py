"""`logprobs=k`: each generated token's log-probability under the model and the step's k most likely,
against transformers' `generate(output_logits=True)` and a cold forward pass."""

from __future__ import annotations

import pytest
import torch

from processors import Choice, configure
from sidecar import errors
from sidecar.engine import MAX_LOGPROBS
from sidecar.generation import PROMPT_LOGITS_TOKENS
from tests.sidecar.conftest import tokens

K = 4


def transformers_steps(engine, prompt, **options):
    """(generated ids, each step's log-softmax of the model's raw logits) from transformers' generate."""
    with torch.inference_mode():
        out = engine.model.generate(torch.tensor([prompt]), output_logits=True, return_dict_in_generate=True,
                                    eos_token_id=None, pad_token_id=0, **options)
    return out.sequences[0, len(prompt):].tolist(), [step[0].log_softmax(-1) for step in out.logits]


def assert_matches(token_ids, chosen, top, steps, k=K):
    """Each token's log-probability and each step's top k (ids where their values are apart) as transformers'."""
    assert len(chosen) == len(top) == len(token_ids) == len(steps)
    for token, logprob, pairs, expected in zip(token_ids, chosen, top, steps):
        assert logprob == pytest.approx(float(expected[token]), abs=1e-5)
        values, ids = expected.topk(k)
        assert [v for _, v in pairs] == pytest.approx(values.tolist(), abs=1e-5)
        for i, (token_id, _) in enumerate(pairs):  # a near-tie may come in either order
            if all(abs(values[i] - values[j]) > 1e-5 for j in range(k) if j != i):
                assert token_id == int(ids[i])


def test_greedy_with_processors_reports_the_models_log_probabilities(engine):
    prompt = tokens(12, seed=41)
    with engine.session() as session:
        result = session.generate(token_ids=prompt, max_new_tokens=8, eos_token_ids=[], logprobs=K,
                                  generation_config={"repetition_penalty": 1.4, "no_repeat_ngram_size": 2})
    expected, steps = transformers_steps(engine, prompt, max_new_tokens=8, do_sample=False, repetition_penalty=1.4,
                                         no_repeat_ngram_size=2)
    assert result.token_ids == expected
    assert_matches(result.token_ids, result.logprobs, result.top_logprobs, steps)
    sequence = result.sequences[0]
    assert (sequence.logprobs, sequence.top_logprobs) == (result.logprobs, result.top_logprobs)
    # the penalty changed the choice: a token that is not the model's most likely is reported as the model gave it
    assert any(lp < pairs[0][1] - 1e-6 for lp, pairs in zip(result.logprobs, result.top_logprobs))


def test_seeded_samples_and_their_events(engine):
    prompt = tokens(9, seed=42)
    with engine.session() as session:
        result = session.generate(token_ids=prompt, max_new_tokens=6, eos_token_ids=[], strategy="sample", seed=3,
                                  logprobs=K, generation_config={"temperature": 0.7, "top_k": 5})
        stream = session.stream(token_ids=prompt, max_new_tokens=6, eos_token_ids=[], strategy="sample", seed=5,
                                num_samples=3, logprobs=2)
        events = list(stream)
    torch.manual_seed(3)
    expected, steps = transformers_steps(engine, prompt, max_new_tokens=6, do_sample=True, temperature=0.7, top_k=5)
    assert result.token_ids == expected
    assert_matches(result.token_ids, result.logprobs, result.top_logprobs, steps)
    for index, sequence in enumerate(stream.result.sequences):
        mine = [e for e in events if e.sequence == index]
        assert [e.token_id for e in mine] == sequence.token_ids
        assert [e.logprob for e in mine] == sequence.logprobs
        assert [list(e.top_logprobs) for e in mine] == sequence.top_logprobs
        assert all(len(pairs) == 2 for pairs in sequence.top_logprobs)


def test_a_constrained_token_is_reported_as_the_model_gave_it(engine):
    """A constraint chooses among its tokens; the log-probability is the model's, checked on a cold forward."""
    prompt = tokens(7, seed=43)
    with engine.session() as session:
        result = session.generate(token_ids=prompt, max_new_tokens=8, logprobs=0,
                                  processors=[configure(Choice, options=["yes", "no"])])
    assert result.text in ("yes", "no") and result.top_logprobs == [[]] * len(result.token_ids)
    with torch.inference_mode():
        logits = engine.model(torch.tensor([prompt + result.token_ids])).logits[0, len(prompt) - 1 : -1]
    expected = logits.log_softmax(-1).gather(1, torch.tensor(result.token_ids)[:, None]).squeeze(1)
    assert result.logprobs == pytest.approx(expected.tolist(), abs=1e-5)


def test_stops_cancels_and_empty_generations_keep_one_record_a_token(engine):
    prompt = tokens(10, seed=44)
    with engine.session() as session:
        first = session.generate(token_ids=prompt, max_new_tokens=6, eos_token_ids=[], logprobs=1)
        stop = first.sequences[0].text[2:4] or first.text
        stopped = session.generate(token_ids=prompt, max_new_tokens=6, eos_token_ids=[], logprobs=1, stop=[stop])
        assert stopped.finish_reason == "stop" and len(stopped.logprobs) == len(stopped.token_ids)
        # (the prompt's cache reused: the same sums in another order, ~1e-6 apart)
        assert stopped.logprobs == pytest.approx(first.logprobs[: len(stopped.token_ids)], abs=1e-5)
        stream = session.stream(token_ids=prompt, max_new_tokens=6, eos_token_ids=[], logprobs=1)
        next(stream), next(stream)
        stream.cancel()
        assert stream.result.finish_reason == "cancelled"
        assert stream.result.logprobs == pytest.approx(first.logprobs[: len(stream.result.token_ids)], abs=1e-5)
        empty = session.generate(token_ids=prompt, max_new_tokens=0, logprobs=3, strategy="sample", num_samples=2)
        assert [(s.logprobs, s.top_logprobs) for s in empty.sequences] == [([], [])] * 2
        plain = session.generate(token_ids=prompt, max_new_tokens=2)
        assert plain.logprobs is None and plain.sequences[0].top_logprobs is None


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, True, 2.0, "3"])
def test_bad_logprobs_are_refused_naming_the_option(engine, value):
    with engine.session() as session:
        with pytest.raises(errors.InvalidArgument) as caught:
            session.generate("hi", max_new_tokens=2, logprobs=value)
        assert caught.value.details["option"] == "logprobs"
        assert session.history == []


def test_beams_report_each_tokens_log_probability_along_their_reorderings(engine):
    """Against transformers' raw logits of the beam each token came from (`beam_indices`), with hypotheses
    ending on EOS at different steps (end tokens the greedy run writes early) and early_stopping each way."""
    checked, ended, lengths = 0, 0, set()
    for seed, (num_beams, returned, early_stopping) in enumerate([(4, 2, False), (3, 3, True), (2, 1, "never")]):
        prompt = tokens(8 + seed, seed=50 + seed)
        with engine.session() as session:
            greedy = session.generate(token_ids=prompt, max_new_tokens=8, eos_token_ids=[])
            eos = sorted(set(greedy.token_ids[1:7]))
            result = session.generate(token_ids=prompt, strategy="beam", num_beams=num_beams, max_new_tokens=10,
                                      num_return_sequences=returned, early_stopping=early_stopping, eos_token_ids=eos,
                                      logprobs=K, generation_config={"repetition_penalty": 1.3})
        with torch.inference_mode():
            out = engine.model.generate(torch.tensor([prompt]), num_beams=num_beams, num_return_sequences=returned,
                                        early_stopping=early_stopping, do_sample=False, max_new_tokens=10, eos_token_id=eos,
                                        pad_token_id=0, repetition_penalty=1.3, output_logits=True, return_dict_in_generate=True)
        for i, sequence in enumerate(result.sequences):
            n = len(sequence.token_ids)
            assert sequence.token_ids == out.sequences[i, len(prompt): len(prompt) + n].tolist()
            steps = [out.logits[t][out.beam_indices[i, t]].log_softmax(-1) for t in range(n)]
            assert_matches(sequence.token_ids, sequence.logprobs, sequence.top_logprobs, steps)
            checked, ended = checked + 1, ended + (sequence.finish_reason == "eos")
            lengths.add(n)
    assert (checked, ended, len(lengths) > 1) == (6, 6, True)  # finished hypotheses' records, of several lengths
    steps = []

    def cancel_at_the_fourth_step(logits, context):
        steps.append(context.length)
        if len(steps) == 4:
            stream.cancel()
        return logits

    with engine.session() as session:  # cancelled: the best running beams as they stood, a record a token
        stream = session.stream(token_ids=prompt, strategy="beam", num_beams=3, num_return_sequences=3, max_new_tokens=20,
                                eos_token_ids=[], logprobs=1, processors=[cancel_at_the_fourth_step])
        list(stream)
    assert stream.result.finish_reason == "cancelled"
    for sequence in stream.result.sequences:
        assert len(sequence.logprobs) == len(sequence.top_logprobs) == len(sequence.token_ids) == 4


def test_output_logits_in_generation_config_is_refused_naming_logprobs(engine):
    with engine.session() as session:
        for field in ("output_logits", "output_scores"):
            with pytest.raises(errors.InvalidArgument, match="give logprobs=k") as caught:
                session.generate("hi", max_new_tokens=2, generation_config={field: True})
            assert caught.value.details["field"] == field


def cold_log_probs(engine, prompt):
    with torch.inference_mode():
        return engine.model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def test_prompt_logprobs_against_a_cold_forward(engine):
    """Each prompt token's log-probability given those before it, as one uncached forward pass gives it, over
    prefill chunks of PROMPT_LOGITS_TOKENS; the prompt is computed anew (nothing reused), and what is
    generated after it is what a plain call generates."""
    prompt = tokens(2 * PROMPT_LOGITS_TOKENS + 44, seed=60)
    with engine.session() as session:
        session.generate(token_ids=prompt[:200], max_new_tokens=2)  # a cached prefix it does not reuse
        result = session.generate(token_ids=prompt, max_new_tokens=4, eos_token_ids=[], prompt_logprobs=K)
        assert (result.stats.reused_tokens, result.stats.prefill_tokens) == (0, len(prompt))
        follow = session.generate(token_ids=prompt + result.token_ids + [7], max_new_tokens=1)
        assert follow.stats.reused_tokens == len(prompt) + 3  # cached as any call leaves it (the last token unfed)
        scored = session.generate(token_ids=prompt, max_new_tokens=0, prompt_logprobs=0)  # scoring alone
        single = session.generate(token_ids=prompt[:1], max_new_tokens=1, prompt_logprobs=2)
    with engine.session() as fresh:
        assert result.token_ids == fresh.generate(token_ids=prompt, max_new_tokens=4, eos_token_ids=[]).token_ids
    cold = cold_log_probs(engine, prompt)
    assert result.prompt_token_ids == prompt and result.prompt_logprobs[0] is None and result.prompt_top_logprobs[0] is None
    assert_matches(prompt[1:], result.prompt_logprobs[1:], result.prompt_top_logprobs[1:], list(cold[:-1]))
    assert result.logprobs is None and result.sequences[0].logprobs is None  # generated tokens' only when asked
    assert scored.token_ids == [] and scored.prompt_logprobs[1:] == pytest.approx(result.prompt_logprobs[1:], abs=1e-5)
    assert scored.prompt_top_logprobs[1:] == [[]] * (len(prompt) - 1)
    assert (single.prompt_token_ids, single.prompt_logprobs, single.prompt_top_logprobs) == (prompt[:1], [None], [None])


def test_prompt_logprobs_with_samples_and_beams_and_cancelled_mid_prompt(engine):
    prompt = tokens(PROMPT_LOGITS_TOKENS + 30, seed=61)
    cold = cold_log_probs(engine, prompt)
    expected = cold[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
    with engine.session() as session:
        for options in ({"strategy": "sample", "num_samples": 3, "seed": 1}, {"strategy": "beam", "num_beams": 2}):
            result = session.generate(token_ids=prompt, max_new_tokens=3, prompt_logprobs=1, **options)
            assert result.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-5)
            assert all(len(s.token_ids) == 3 for s in result.sequences)
        queued = session.stream(token_ids=prompt, max_new_tokens=3, prompt_logprobs=1)
        queued.cancel()  # before any tick: nothing computed
        list(queued)
        assert (queued.result.prompt_token_ids, queued.result.prompt_logprobs) == (prompt, [])
        stream = session.stream(token_ids=prompt, max_new_tokens=3, prompt_logprobs=1)
        engine.scheduler.tick()  # its first chunk
        stream.cancel()
        list(stream)
    cancelled = stream.result  # as far as it was computed: the first chunk's tokens predict the next ones
    assert cancelled.finish_reason == "cancelled" and len(cancelled.prompt_logprobs) == PROMPT_LOGITS_TOKENS + 1
    assert cancelled.prompt_logprobs[1:] == pytest.approx(expected[:PROMPT_LOGITS_TOKENS], abs=1e-5)
