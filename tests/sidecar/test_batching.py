"""The batched engine against independent references: solo runs, `model.generate` (greedy, sampling and
beam search), and the memory budget measured by the store itself."""

import threading
import time

import pytest
import torch

import processors as P
from sidecar import Engine
from sidecar.beams import BeamSearch
from sidecar.errors import CacheBudgetExceeded

from .conftest import tokens

LENGTHS = [3, 9, 17, 30, 41, 56, 70, 101]  # eight sessions, eight prompt lengths


def reference_greedy(engine, token_ids, max_new_tokens):
    """`model.generate` alone: transformers' own loop and cache, one row."""
    out = engine.model.generate(torch.tensor([token_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(token_ids):].tolist()


def drain(generations, engine, cancel_after=None):
    """Ticks the engine until every generation is done; returns each one's streamed token ids."""
    seen = {id(g): [] for g in generations}
    while engine.scheduler.busy:
        engine.scheduler.tick()
        for g in generations:
            seen[id(g)] += [e.token_id for e in g.take_events()]
            if cancel_after and g is cancel_after[0] and len(seen[id(g)]) >= cancel_after[1] and not g.done:
                g.cancel()
    return [seen[id(g)] for g in generations]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_eight_sessions_batched_equal_their_solo_runs(kind, engine, gpt2_engine):
    engine = {"llama": engine, "gpt2": gpt2_engine}[kind]
    prompts = [tokens(n, seed=100 + n, high=engine.vocab_size) for n in LENGTHS]
    sessions = [engine.session() for _ in prompts]
    try:
        # four start together; three join while those decode; one is cancelled part-way
        first = [s.stream(token_ids=p, max_new_tokens=12, eos_token_ids=[]) for s, p in zip(sessions[:4], prompts[:4])]
        for _ in range(3):
            engine.scheduler.tick()
        late = [s.stream(token_ids=p, max_new_tokens=12, eos_token_ids=[]) for s, p in zip(sessions[4:], prompts[4:])]
        generations = first + late
        early_events = [[e.token_id for e in g.take_events()] for g in first] + [[] for _ in late]
        streamed = drain(generations, engine, cancel_after=(generations[5], 4))
        streamed = [a + b for a, b in zip(early_events, streamed)]
        for i, (g, p) in enumerate(zip(generations, prompts)):
            expected = reference_greedy(engine, p, 12)
            if i == 5:
                assert g.result.finish_reason == "cancelled" and 4 <= len(g.result.token_ids) < 12
                expected = expected[: len(g.result.token_ids)]
            assert g.result.token_ids == streamed[i] == expected, f"session {i} (prompt of {len(p)})"
    finally:
        for s in sessions:
            s.close()


def test_one_forward_pass_per_tick_serves_every_row(engine):
    calls = []
    hook = engine.model.register_forward_hook(lambda m, a, kw, out: calls.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        sessions = [engine.session() for _ in range(4)]
        generations = [s.stream(token_ids=tokens(5 + i, seed=i), max_new_tokens=6, eos_token_ids=[]) for i, s in enumerate(sessions)]
        drain(generations, engine)
    finally:
        hook.remove()
    # one pass prefills all four prompts together (5+6+7+8 tokens), then 5 passes of four decode rows
    assert calls == [26] + [4] * 5
    for s in sessions:
        s.close()


def test_a_short_request_gets_its_first_token_before_a_long_prompt_is_prefilled(default_dir):
    engine = Engine.load(default_dir, prefill_chunk=256)
    with engine.session() as long_session, engine.session() as short_session:
        long = long_session.stream(token_ids=tokens(1800, seed=1), max_new_tokens=2, eos_token_ids=[])
        engine.scheduler.tick()
        short = short_session.stream(token_ids=tokens(12, seed=2), max_new_tokens=2, eos_token_ids=[])
        first_token_tick = None
        while engine.scheduler.busy:
            engine.scheduler.tick()
            if first_token_tick is None and short.take_events():
                first_token_tick = engine.scheduler.ticks
            if long.take_events():
                long_first = engine.scheduler.ticks
                break
        # the short prompt goes first in the tick after it arrived; the long one needs 1800 / 256 ticks
        assert first_token_tick == 2 and long_first == 8


def test_a_long_prompt_is_prefilled_while_shorter_ones_keep_coming_and_equals_its_solo_run(default_dir):
    """Shortest first alone gave every tick's 8 tokens to the newest short prompt, and the long one waited for as
    long as they kept coming (found from outside, over two minutes). The oldest prompt takes half of each tick's
    budget: 64 tokens in 16 ticks, while the short ones still get theirs."""
    engine = Engine.load(default_dir, prefill_chunk=8)
    long_session = engine.session()
    long = long_session.stream(token_ids=tokens(64, seed=3), max_new_tokens=3, eos_token_ids=[])
    shorts, long_first = [], None
    for tick in range(1, 41):  # a new 8-token prompt every tick, on a session of its own
        session = engine.session()
        shorts.append((session, session.stream(token_ids=tokens(8, seed=100 + tick), max_new_tokens=1, eos_token_ids=[])))
        engine.scheduler.tick()
        if long_first is None and long.take_events():
            long_first = tick
    assert long_first is not None and long_first <= 17
    streamed = drain([long] + [g for _, g in shorts], engine)
    with Engine.load(default_dir).session() as solo:
        alone = solo.generate(token_ids=tokens(64, seed=3), max_new_tokens=3, eos_token_ids=[]).token_ids
    assert long.result.token_ids == alone and all(len(ids) == 1 for ids in streamed[1:])
    for session, _ in shorts:
        session.close()
    long_session.close()


@pytest.mark.parametrize("budget", [1, 2, 7, 8])
def test_every_prompt_being_prefilled_gets_tokens_whatever_the_budget(budget):
    """The oldest takes half the budget (an odd one's middle token every other tick), the shortest the rest:
    over two ticks, even a budget of 1 feeds both the oldest prompt and a short one behind it."""
    from sidecar.scheduler import _prefill_shares

    oldest, short, other = (Prefilling(n) for n in (100, 3, 50))
    fed = {id(oldest): 0, id(short): 0, id(other): 0}
    for tick in (0, 1):
        shares = _prefill_shares([oldest, other, short], budget, tick % 2)
        assert sum(n for _, n in shares) == budget and all(n > 0 for _, n in shares)
        for run, n in shares:
            fed[id(run)] += n
            run.fresh = run.fresh[n:]
    assert fed[id(oldest)] >= budget and fed[id(short)] == min(3, budget)
    alone = Prefilling(5)
    assert _prefill_shares([alone], budget, 0) == [(alone, min(5, budget))]  # alone: all it needs, up to the budget


class Prefilling:
    """A run prefilling `n` tokens, at most `cap` a tick (a run with prompt_logprobs: `Run.feedable`)."""

    def __init__(self, n: int, cap: int | None = None):
        self.fresh, self.cap = [0] * n, cap

    @property
    def feedable(self) -> int:
        return len(self.fresh) if self.cap is None else min(len(self.fresh), self.cap)


def test_budget_a_capped_prompt_cannot_take_goes_to_the_next():
    """(helper-88) A run with prompt_logprobs takes at most its cap; the rest of the budget feeds the next prompt
    rather than going unused."""
    from sidecar.scheduler import _prefill_shares

    oldest, scored, other = Prefilling(2000), Prefilling(300, cap=128), Prefilling(600)
    shares = _prefill_shares([oldest, scored, other], 512, 0)
    assert [(run, n) for run, n in shares] == [(oldest, 256), (scored, 128), (other, 128)]
    capped_oldest = Prefilling(2000, cap=128)
    assert _prefill_shares([capped_oldest, other], 512, 0) == [(capped_oldest, 128), (other, 384)]


def test_cancelling_a_queued_generation_runs_nothing(engine):
    calls = []
    hook = engine.model.register_forward_hook(lambda m, a, kw, out: calls.append(1), with_kwargs=True)
    try:
        with engine.session() as session:
            generation = session.stream(token_ids=tokens(600, seed=3), max_new_tokens=4)
            generation.cancel()
            assert generation.result.finish_reason == "cancelled" and generation.result.stats.prefill_tokens == 0
            assert not engine.scheduler.busy and not session.busy
    finally:
        hook.remove()
    assert calls == []


def test_a_failure_in_one_generation_leaves_the_others_of_its_batch_alone(engine):
    def explode(logits, context):
        if context.length > context.input_length + 2:
            raise RuntimeError("boom")
        return logits

    prompts = [tokens(7, seed=40), tokens(11, seed=41)]
    with engine.session() as bad, engine.session() as good:
        failing = bad.stream(token_ids=prompts[0], max_new_tokens=8, eos_token_ids=[], processors=[explode])
        fine = good.stream(token_ids=prompts[1], max_new_tokens=8, eos_token_ids=[])
        with pytest.raises(RuntimeError, match="boom"):
            list(failing)
        list(fine)
        assert fine.result.token_ids == reference_greedy(engine, prompts[1], 8)
        assert bad.history == [] and bad.cached == 0


# ---- beam search ------------------------------------------------------------------------------------

BEAM_CASES = [
    dict(num_beams=4, max_new_tokens=10),
    dict(num_beams=3, max_new_tokens=8, num_return_sequences=3, length_penalty=0.5),
    dict(num_beams=4, max_new_tokens=9, early_stopping=True, num_return_sequences=2),
    dict(num_beams=2, max_new_tokens=7, early_stopping="never", length_penalty=2.0),
    dict(num_beams=3, max_new_tokens=5, num_return_sequences=2, length_penalty=-1e308),  # length ** it underflows to 0
]
PROCESSORS = {
    "none": ([], {}),
    "repetition 1.3 + no-repeat 2": ([P.RepetitionPenalty(1.3), P.NoRepeatNGram(2)],
                                      {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2}),
}


@pytest.mark.parametrize("case", BEAM_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("chain", list(PROCESSORS), ids=list(PROCESSORS))
def test_beam_search_equals_transformers(any_engine, case, chain):
    engine = any_engine
    ours_chain, theirs = PROCESSORS[chain]
    eos = 2
    prompt = tokens(9, seed=7, high=engine.vocab_size)
    theirs_out = engine.model.generate(
        torch.tensor([prompt]), do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
        eos_token_id=eos, **case, **theirs)
    with engine.session() as session:
        result = session.generate(token_ids=prompt, strategy="beam", eos_token_ids=[eos], processors=ours_chain, **case)
    expected_ids = [row[len(prompt):].tolist() for row in theirs_out.sequences]
    got_ids = [s.token_ids for s in result.sequences]
    # transformers pads shorter beams to the longest one's length
    assert [ids[: len(got)] for ids, got in zip(expected_ids, got_ids)] == got_ids
    assert all(set(ids[len(got):]) <= {0, eos} for ids, got in zip(expected_ids, got_ids))
    assert torch.allclose(torch.tensor([s.score for s in result.sequences]), theirs_out.sequences_scores, atol=1e-4)
    assert result.token_ids == got_ids[0] and result.text == result.sequences[0].text


@pytest.mark.parametrize("length_penalty", [1000.0, 1e308])
@pytest.mark.parametrize("early_stopping", [False, "never"])
def test_a_length_penalty_whose_power_overflows_scores_as_its_limit(engine, length_penalty, early_stopping):
    """`length ** 1000.0` overflows a float from length 3 (Python raises, and so does transformers'
    generate); ours takes it as inf, so a score divided by it is -0.0, the limit. 250.0 already gives that
    through float32 (2 ** 250 is inf there, so is every power of a longer length), and transformers runs
    it: the same search."""
    prompt = tokens(9, seed=7, high=engine.vocab_size)
    case = dict(num_beams=3, max_new_tokens=6, num_return_sequences=3, early_stopping=early_stopping)
    theirs = engine.model.generate(torch.tensor([prompt]), do_sample=False, output_scores=True, return_dict_in_generate=True,
                                   pad_token_id=0, eos_token_id=2, length_penalty=250.0, **case)
    with engine.session() as session:
        result = session.generate(token_ids=prompt, strategy="beam", eos_token_ids=[2], length_penalty=length_penalty, **case)
    got = [s.token_ids for s in result.sequences]
    assert [row[len(prompt):].tolist()[: len(g)] for row, g in zip(theirs.sequences, got)] == got
    assert [s.score for s in result.sequences] == theirs.sequences_scores.tolist()


def test_running_beams_scored_with_an_underflowing_length_penalty_are_finite():
    """length ** -1e308 is 0 from length 2: a running beam's score would be -inf (Python raises
    ZeroDivisionError), which a reply cannot carry; it is -1e9, the floor of the finished set. (The engine
    stops such a search at its second step, so a cancel does not reach it today; the bookkeeping alone does.)"""
    search = BeamSearch(3, 20, [], -1e308, False, 50, "cpu")
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        search.step(torch.randn(3, 50, generator=generator).log_softmax(-1))
    found = search.running_results(3)
    assert [len(ids) for ids, _, _ in found] == [2, 2, 2] and [score for _, score, _ in found] == [-1e9, -1e9, -1e9]


def test_beam_search_where_every_token_ends_keeps_all_there_is(engine):
    """With every token an end token, 2 x num_beams continuations would be asked of a top-k over fewer
    (transformers' own search fails there): each beam ends at its first token, the best first, as the
    log-probs of that first step rank them."""
    prompt = tokens(10, seed=31)
    with engine.session() as session:
        result = session.generate(token_ids=prompt, strategy="beam", num_beams=3, num_return_sequences=3, max_new_tokens=3,
                                  eos_token_ids=list(range(engine.vocab_size)))
    with torch.inference_mode():
        first = engine.model(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
    best = first.topk(3)
    assert [s.token_ids for s in result.sequences] == [[t] for t in best.indices.tolist()]
    assert [s.score for s in result.sequences] == pytest.approx(best.values.tolist(), abs=1e-5)
    assert all(s.finish_reason == "eos" for s in result.sequences)


def test_a_numpy_integer_seed_is_the_same_seed(engine):
    import numpy as np

    prompt = tokens(10, seed=32)
    with engine.session() as session:
        ours = session.generate(token_ids=prompt, strategy="sample", seed=np.int64(5), max_new_tokens=6, eos_token_ids=[])
    with engine.session() as session:
        plain = session.generate(token_ids=prompt, strategy="sample", seed=5, max_new_tokens=6, eos_token_ids=[])
    assert ours.token_ids == plain.token_ids


def test_beam_search_over_a_shared_long_prompt_equals_transformers(any_engine):
    engine = any_engine
    prompt = tokens(200, seed=17, high=engine.vocab_size)  # 3 more beams x 200 tokens: the prompt is shared
    case = dict(num_beams=4, max_new_tokens=8, num_return_sequences=2)
    theirs = engine.model.generate(torch.tensor([prompt]), do_sample=False, output_scores=True, return_dict_in_generate=True,
                                   pad_token_id=0, eos_token_id=2, **case)
    with engine.session() as session:
        result = session.generate(token_ids=prompt, strategy="beam", eos_token_ids=[2], **case)
    got = [s.token_ids for s in result.sequences]
    assert [row[len(prompt):].tolist()[: len(g)] for row, g in zip(theirs.sequences, got)] == got
    assert torch.allclose(torch.tensor([s.score for s in result.sequences]), theirs.sequences_scores, atol=1e-4)


def test_beams_batched_with_other_sessions_equal_beams_alone(engine):
    prompt = tokens(9, seed=8)
    with engine.session() as alone:
        expected = alone.generate(token_ids=prompt, strategy="beam", num_beams=3, max_new_tokens=8, num_return_sequences=3)
    with engine.session() as beam, engine.session() as other:
        beams = beam.stream(token_ids=prompt, strategy="beam", num_beams=3, max_new_tokens=8, num_return_sequences=3)
        greedy = other.stream(token_ids=tokens(30, seed=9), max_new_tokens=12, eos_token_ids=[])
        drain([beams, greedy], engine)
        assert [s.token_ids for s in beams.result.sequences] == [s.token_ids for s in expected.sequences]
        assert [s.score for s in beams.result.sequences] == pytest.approx([s.score for s in expected.sequences], abs=1e-4)
        assert greedy.result.token_ids == reference_greedy(engine, tokens(30, seed=9), 12)


def test_after_beam_search_the_session_holds_the_best_sequence_and_caches_the_prompt(engine):
    prompt = tokens(10, seed=11)
    with engine.session() as session:
        result = session.generate(token_ids=prompt, strategy="beam", num_beams=3, max_new_tokens=6, eos_token_ids=[])
        assert session.history == prompt + result.token_ids and session.cached == len(prompt)
        follow = session.generate(token_ids=session.history + [5], max_new_tokens=3, eos_token_ids=[])
        assert follow.stats.reused_tokens == len(prompt)
        assert follow.token_ids == reference_greedy(engine, session.history[: len(prompt) + 7], 3)


# ---- n samples --------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, count, score", [
    (dict(strategy="sample", num_samples=4, seed=1), 4, None),
    (dict(strategy="beam", num_beams=4, num_return_sequences=3), 3, 0.0),
], ids=["4 samples", "3 of 4 beams"])
def test_max_new_tokens_0_returns_every_sequence_empty_and_each_continues(engine, options, count, score):
    """The spec: `sequences` lists every sample, or the best num_return_sequences beams; with nothing to
    generate they are all empty (an empty beam scores 0.0, the sum of no log-probs), and `continue` may
    name any of them."""
    prompt = tokens(12, seed=30)
    with engine.session() as session:
        result = session.generate(token_ids=prompt, max_new_tokens=0, **options)
        assert [(s.text, s.token_ids, s.finish_reason, s.score) for s in result.sequences] == [("", [], "length", score)] * count
        assert (result.text, result.token_ids, result.finish_reason) == ("", [], "length")
        assert result.stats.generated_tokens == 0 and result.stats.prefill_tokens == len(prompt)
        assert session.history == prompt and session.cached == len(prompt)
        last = session.continuation(sequence=count - 1, append_token_ids=[5])
        assert list(last.ids) == prompt + [5]
        follow = session.generate(last, max_new_tokens=3, eos_token_ids=[])
        assert follow.stats.reused_tokens == len(prompt) and follow.token_ids == reference_greedy(engine, prompt + [5], 3)


@pytest.mark.parametrize("length", [12, 400], ids=["prompt copied to each row", "prompt shared by the rows"])
def test_n_samples_equal_transformers_sampling_with_the_same_seed(engine, length):
    prompt = tokens(length, seed=12)
    torch.manual_seed(5)
    theirs = engine.model.generate(torch.tensor([prompt]), do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                                   num_return_sequences=4, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    with engine.session() as session:
        result = session.generate(token_ids=prompt, strategy="sample", num_samples=4, seed=5, max_new_tokens=10,
                                  eos_token_ids=[])
    assert [s.token_ids for s in result.sequences] == theirs[:, len(prompt):].tolist()
    assert result.stats.prefill_tokens == len(prompt) and result.stats.generated_tokens == 40


@pytest.mark.parametrize("length", [12, 400], ids=["prompt copied to each row", "prompt shared by the rows"])
def test_n_samples_still_equal_transformers_sampling_after_one_of_them_ends(engine, length):
    """transformers goes on drawing for a sample that ended (and drops what it draws): the others draw the
    same numbers as long as ours does too (they drew others once the ended row stopped drawing)."""
    prompt = tokens(length, seed=12)

    def theirs(eos):
        torch.manual_seed(5)
        out = engine.model.generate(torch.tensor([prompt]), do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                                    num_return_sequences=4, max_new_tokens=10, eos_token_id=eos, pad_token_id=0)
        rows = out[:, len(prompt):].tolist()
        return [row[: row.index(eos) + 1] if eos in row else row for row in rows]

    eos = theirs(None)[1][2]  # the second sample ends at its third token
    expected = theirs(eos)
    assert len(expected[1]) == 3 and max(map(len, expected)) == 10  # one ended early, another went on after it
    with engine.session() as session:
        result = session.generate(token_ids=prompt, strategy="sample", num_samples=4, seed=5, max_new_tokens=10,
                                  eos_token_ids=[eos])
    assert [s.token_ids for s in result.sequences] == expected


def test_n_samples_prefill_once_are_reproducible_and_stream_tagged(engine):
    prompt = tokens(40, seed=13)
    calls = []
    hook = engine.model.register_forward_hook(lambda m, a, kw, out: calls.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        with engine.session() as session:
            stream = session.stream(token_ids=prompt, strategy="sample", num_samples=3, seed=9, max_new_tokens=5,
                                    eos_token_ids=[], processors=[P.TopK(20)])
            events = list(stream)
    finally:
        hook.remove()
    assert calls == [40] + [3] * 4  # the prompt once, then three rows per pass
    by_sequence = {i: [e.token_id for e in events if e.sequence == i] for i in range(3)}
    assert [by_sequence[i] for i in range(3)] == [s.token_ids for s in stream.result.sequences]
    with engine.session() as again:
        repeat = again.generate(token_ids=prompt, strategy="sample", num_samples=3, seed=9, max_new_tokens=5,
                                eos_token_ids=[], processors=[P.TopK(20)])
    assert [s.token_ids for s in repeat.sequences] == [s.token_ids for s in stream.result.sequences]


def test_samples_end_on_their_own_and_the_rest_go_on(engine):
    prompt = tokens(8, seed=14)
    with engine.session() as session:
        result = session.generate(token_ids=prompt, strategy="sample", num_samples=6, seed=3, max_new_tokens=30,
                                  eos_token_ids=list(range(3, 200)))  # a fifth of the vocabulary ends a row
    lengths = sorted(len(s.token_ids) for s in result.sequences)
    assert lengths[0] < lengths[-1]
    for s in result.sequences:
        ended = s.token_ids[-1] in range(3, 200)
        assert s.finish_reason == ("eos" if ended else "length") and all(t not in range(3, 200) for t in s.token_ids[:-1])


# ---- the memory budget ------------------------------------------------------------------------------

def test_the_budget_holds_while_ten_generations_run(default_dir, per_token):
    budget = 3 * 60 * per_token  # room for three of the ten at a time
    engine = Engine.load(default_dir, cache_budget_bytes=budget)
    sessions = [engine.session() for _ in range(10)]
    prompts = [tokens(20 + i, seed=60 + i) for i in range(10)]
    generations = [s.stream(token_ids=p, max_new_tokens=20, eos_token_ids=[]) for s, p in zip(sessions, prompts)]
    streamed = drain(generations, engine)
    assert engine.store.peak_bytes <= budget
    for g, p, got in zip(generations, prompts, streamed):
        assert g.result.token_ids == got == reference_greedy(engine, p, 20)
    assert engine.stats()["evictions"] > 0


def test_a_generation_that_cannot_fit_alone_is_refused_and_changes_nothing(default_dir, per_token):
    engine = Engine.load(default_dir, cache_budget_bytes=40 * per_token)
    with engine.session() as session:
        first = session.generate(token_ids=tokens(20, seed=1), max_new_tokens=4, eos_token_ids=[])
        before = (list(session.history), session.cached)
        with pytest.raises(CacheBudgetExceeded) as caught:
            session.generate(token_ids=tokens(30, seed=2), max_new_tokens=20)
        assert caught.value.details["limit"] == "cache_budget_bytes" and caught.value.details["max"] == 40 * per_token
        assert (session.history, session.cached) == before
        again = session.generate(token_ids=tokens(20, seed=1), max_new_tokens=4, eos_token_ids=[])
        assert again.token_ids == first.token_ids and again.stats.reused_tokens == 19


@pytest.mark.parametrize("options", [dict(strategy="beam", num_beams=4), dict(strategy="sample", num_samples=4, seed=1)])
def test_rows_that_fit_only_sharing_the_prompt_share_it(default_dir, per_token, options):
    """Short prompts are copied to each row (faster), but a budget of input + rows x max_new_tokens, what
    the protocol promises, is enough: the rows then share the prompt, with the same results."""
    roomy = Engine.load(default_dir)
    tight = Engine.load(default_dir, cache_budget_bytes=(50 + 4 * 20) * per_token)
    prompt = tokens(50, seed=70)
    with roomy.session() as session:
        expected = session.generate(token_ids=prompt, max_new_tokens=20, eos_token_ids=[], **options)
    with tight.session() as session:
        got = session.generate(token_ids=prompt, max_new_tokens=20, eos_token_ids=[], **options)
    assert [s.token_ids for s in got.sequences] == [s.token_ids for s in expected.sequences]
    assert tight.store.peak_bytes <= tight.cache_budget_bytes


def test_a_generation_that_fits_alone_is_not_refused_for_a_prefix_another_session_holds(default_dir, per_token):
    """Continuing an idle session's cache would keep all of it; computing the shared part again lets it
    be evicted, and the generation fits (it was refused: cache_budget_exceeded)."""
    engine = Engine.load(default_dir, cache_budget_bytes=200 * per_token)
    prompt = tokens(90, seed=71)
    with engine.session() as a, engine.session() as b:
        a.generate(token_ids=prompt[:50], max_new_tokens=149, eos_token_ids=[])
        assert a.cached == 198
        result = b.generate(token_ids=prompt, max_new_tokens=4, eos_token_ids=[])
        assert result.token_ids == reference_greedy(engine, prompt, 4) and result.stats.shared_tokens == 0
        assert a.cached == 0 and engine.store.peak_bytes <= engine.cache_budget_bytes


def test_a_session_holding_a_long_cache_lets_the_cropped_part_go_when_the_budget_needs_it(default_dir, per_token):
    """A call that crops its session's cache keeps the cropped part until it ends (a failure puts it
    back) only where the budget has room; otherwise it lets it go, and a failure leaves the cache cropped,
    the history whole: results never change."""
    engine = Engine.load(default_dir, cache_budget_bytes=200 * per_token)
    prompt = tokens(50, seed=72)
    with engine.session() as session:
        first = session.generate(token_ids=prompt, max_new_tokens=149, eos_token_ids=[])
        assert session.cached == 198
        beams = session.generate(token_ids=prompt, strategy="beam", num_beams=4, max_new_tokens=20, eos_token_ids=[])
        assert beams.stats.reused_tokens == 49 and engine.store.peak_bytes <= engine.cache_budget_bytes
        with Engine.load(default_dir).session() as roomy:
            assert beams.token_ids == roomy.generate(token_ids=prompt, strategy="beam", num_beams=4, max_new_tokens=20,
                                                     eos_token_ids=[]).token_ids
        long = prompt + first.token_ids
        session.generate(token_ids=long, max_new_tokens=1, eos_token_ids=[])
        history = list(session.history)

        def explode(logits, context):
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError):  # crops to 49 tokens, 4 rows x 60 more: lean, then fails
            session.generate(token_ids=prompt, strategy="beam", num_beams=4, max_new_tokens=30, processors=[explode])
        assert session.history == history and session.cached == 49
        again = session.generate(token_ids=long, max_new_tokens=1, eos_token_ids=[])
        assert again.token_ids == reference_greedy(engine, long, 1) and again.stats.reused_tokens == 49


def test_a_session_continuing_a_shared_prefix_computes_from_scratch_when_only_that_fits(default_dir, per_token):
    """A prefix a session continues stays whole while continued: when the budget fits the call only
    without it, the session reuses nothing and the prefix may be evicted (it was refused)."""
    engine = Engine.load(default_dir, cache_budget_bytes=200 * per_token)
    prompt, other = tokens(50, seed=73), tokens(20, seed=74)
    with engine.session() as session:
        session.generate(token_ids=prompt, max_new_tokens=149, eos_token_ids=[])
        session.fork().close()  # its cache is now a shared entry that it alone continues
        assert session.cache.prefix is not None and session.cached == 198
        result = session.generate(token_ids=other, max_new_tokens=20, eos_token_ids=[])
        assert result.token_ids == reference_greedy(engine, other, 20) and result.stats.reused_tokens == 0
        assert engine.store.peak_bytes <= engine.cache_budget_bytes


def test_a_refusal_reports_what_the_generation_needs_with_the_idle_caches_evicted(default_dir, per_token):
    """`value` is the generation's own need (its leanest plan) plus what cannot be evicted, not what other
    sessions' idle caches happen to hold."""
    engine = Engine.load(default_dir, cache_budget_bytes=40 * per_token)
    with engine.session() as idle, engine.session() as session:
        idle.generate(token_ids=tokens(20, seed=75), max_new_tokens=4, eos_token_ids=[])
        with pytest.raises(CacheBudgetExceeded) as caught:
            session.generate(token_ids=tokens(30, seed=76), max_new_tokens=20, eos_token_ids=[])
        assert caught.value.details["value"] == 50 * per_token and idle.cached == 23


# ---- clumsy callers -----------------------------------------------------------------------------------

def test_a_beam_search_cancelled_part_way_returns_its_best_running_beams(engine):
    prompt = tokens(9, seed=21)
    with engine.session() as session:
        search = session.stream(token_ids=prompt, strategy="beam", num_beams=3, num_return_sequences=2,
                                max_new_tokens=20, eos_token_ids=[])
        for _ in range(6):  # six steps, the first with the prefill
            engine.scheduler.tick()
        search.cancel()
        result = search.result
        assert result.finish_reason == "cancelled" and [len(s.token_ids) for s in result.sequences] == [6, 6]
        assert result.sequences[0].score >= result.sequences[1].score
        assert session.history == prompt + result.token_ids and not session.busy
        with engine.session() as fresh:  # without EOS, the best of six steps is what a search of six tokens finds
            full = fresh.generate(token_ids=prompt, strategy="beam", num_beams=3, max_new_tokens=6, eos_token_ids=[])
        assert full.token_ids == result.token_ids


def test_a_generation_waiting_for_memory_can_be_cancelled_and_ran_nothing(default_dir, per_token):
    engine = Engine.load(default_dir, cache_budget_bytes=40 * per_token)
    with engine.session() as first, engine.session() as second:
        running = first.stream(token_ids=tokens(10, seed=1), max_new_tokens=20, eos_token_ids=[])
        waiting = second.stream(token_ids=tokens(10, seed=2), max_new_tokens=20, eos_token_ids=[])
        engine.scheduler.tick()
        assert not waiting._run.admitted and engine.store.used_bytes <= 40 * per_token
        waiting.cancel()
        assert waiting.result.finish_reason == "cancelled" and waiting.result.stats.prefill_tokens == 0
        assert second.history == [] and not second.busy
        list(running)
        assert running.result.token_ids == reference_greedy(engine, tokens(10, seed=1), 20)


def test_a_generation_that_could_not_fit_even_alone_is_refused_at_once_and_holds_back_nobody(default_dir, per_token):
    """Waiting for the running generations to end could not make room for it: it is refused while they
    run, and the generation sent behind it starts at once instead of waiting behind it."""
    engine = Engine.load(default_dir, cache_budget_bytes=60 * per_token)
    with engine.session() as first, engine.session() as second, engine.session() as third:
        running = first.stream(token_ids=tokens(10, seed=1), max_new_tokens=30, eos_token_ids=[])
        engine.scheduler.tick()
        too_large = second.stream(token_ids=tokens(10, seed=2), max_new_tokens=55, eos_token_ids=[])
        behind = third.stream(token_ids=tokens(5, seed=3), max_new_tokens=10, eos_token_ids=[])
        engine.scheduler.tick()
        assert isinstance(too_large.error, CacheBudgetExceeded) and not running.done
        assert too_large.error.details["value"] == 65 * per_token and second.history == []
        assert behind._run.admitted
        list(running)
        list(behind)
        assert running.result.token_ids == reference_greedy(engine, tokens(10, seed=1), 30)
        assert behind.result.token_ids == reference_greedy(engine, tokens(5, seed=3), 10)


def test_closing_a_session_under_n_samples_cancels_them_with_what_they_had(engine):
    session = engine.session()
    drawn = session.stream(token_ids=tokens(6, seed=5), strategy="sample", num_samples=3, seed=2, max_new_tokens=30,
                           eos_token_ids=[])
    for _ in range(4):
        engine.scheduler.tick()
    session.close()
    assert drawn.result.finish_reason == "cancelled" and len(drawn.result.sequences) == 3
    assert all(s.finish_reason == "cancelled" and len(s.token_ids) == 4 for s in drawn.result.sequences)  # a token a tick
    # nothing held but the sessions' caches and the prefixes other tests' sessions left shared
    assert not engine.scheduler.busy and engine.store.used_bytes == sum(
        s.cache.nbytes for s in engine._sessions.values()) + engine.stats()["shared_bytes"]


def test_samples_share_the_prompt_cache_instead_of_copying_it(default_dir):
    engine = Engine.load(default_dir)
    per_token = engine.store.bytes_per_token
    with engine.session() as session:
        result = session.generate(token_ids=tokens(300, seed=31), strategy="sample", num_samples=8, seed=1,
                                  max_new_tokens=10, eos_token_ids=[])
    assert len(result.sequences) == 8
    # the prompt once, and ten tokens for each of eight rows: not eight copies of the prompt
    assert engine.store.peak_bytes == (300 + 8 * 10) * per_token


def test_one_beam_is_greedy_search_as_in_transformers(engine):
    prompt = tokens(10, seed=23)
    with engine.session() as session:
        result = session.generate(token_ids=prompt, strategy="beam", num_beams=1, max_new_tokens=8, eos_token_ids=[])
        assert result.token_ids == reference_greedy(engine, prompt, 8) and session.history == prompt + result.token_ids


def test_two_beam_searches_admitted_together_stay_within_the_budget(default_dir, per_token):
    one = (40 + 4 * (40 + 40)) * per_token  # the prompt, and four beams copying it (too short to share)
    engine = Engine.load(default_dir, cache_budget_bytes=int(one * 1.5))
    with engine.session() as a, engine.session() as b:
        searches = [s.stream(token_ids=tokens(40, seed=i), strategy="beam", num_beams=4, max_new_tokens=40, eos_token_ids=[])
                    for i, s in enumerate((a, b))]
        drain(searches, engine)
        assert all(s.result.finish_reason == "length" for s in searches)
    assert engine.store.peak_bytes <= int(one * 1.5)


def test_a_failure_that_cannot_put_the_cache_back_keeps_the_history_and_empties_the_cache(engine, monkeypatch):
    with engine.session() as session:
        session.generate(token_ids=tokens(20, seed=53), max_new_tokens=4, eos_token_ids=[])
        history = list(session.history)
        monkeypatch.setattr(type(session.cache), "put_tail", lambda *a: (_ for _ in ()).throw(MemoryError("no room")))

        def boom(logits, context):
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            session.generate(token_ids=tokens(5, seed=54), max_new_tokens=4, processors=[boom])
        monkeypatch.undo()
        assert session.history == history and session.cached == 0 and not session.busy
        again = session.generate(token_ids=history + [7], max_new_tokens=3, eos_token_ids=[])
        assert again.token_ids == reference_greedy(engine, history + [7], 3)


def test_sessions_used_from_several_threads_take_turns_and_equal_their_solo_runs(engine):
    """A threaded web server's use: each thread generates on its own session, greedy and seeded, at once;
    the threads take turns step by step (each step serving all of them), and nobody's call is refused."""
    cases = [dict(token_ids=tokens(n, seed=60 + n), max_new_tokens=12, eos_token_ids=[]) for n in (5, 9, 14, 20)]
    cases[1].update(strategy="sample", seed=3)
    cases[3].update(strategy="beam", num_beams=3)
    solo = []
    for case in cases:
        with engine.session() as session:
            solo.append(session.generate(**case).token_ids)
    got, errors = {}, []
    start = threading.Barrier(len(cases))

    def work(index):
        try:
            with engine.session() as session:
                start.wait()
                for _ in range(3):  # each call after the first reuses the session's cache
                    got.setdefault(index, []).append(session.generate(**cases[index]).token_ids)
        except BaseException as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    assert got == {i: [expected] * 3 for i, expected in enumerate(solo)}


def test_a_generation_streaming_in_one_thread_is_cancelled_by_a_close_in_another(engine):
    session = engine.session()
    stream = session.stream(token_ids=tokens(6, seed=70), max_new_tokens=1_000, eos_token_ids=[])
    first = next(stream)
    seen = []
    reader = threading.Thread(target=lambda: seen.extend(stream))
    reader.start()
    while len(seen) < 3 and reader.is_alive():
        time.sleep(0.001)
    session.close()  # waits for the step under way in the reader's thread, if any
    reader.join(60)
    assert not reader.is_alive() and stream.result.finish_reason == "cancelled"
    assert stream.result.token_ids == [first.token_id] + [event.token_id for event in seen]
    assert not engine.scheduler.busy


def test_a_generation_collected_while_another_thread_holds_the_engine_is_marked_not_waited_for(engine):
    """The collector may finalise an unfinished generation in any thread, one that holds the lock or that
    the holder waits for: it never waits for the lock, and the next step cancels the run instead, before
    feeding it (helper-76: it was fed one more token, which went into the history unseen)."""
    prompt = tokens(6, seed=71)
    with engine.session() as session:
        generation = session.stream(token_ids=prompt, max_new_tokens=50, eos_token_ids=[])
        first = next(generation)
        with engine.lock:  # another thread's step or call under way
            finaliser = threading.Thread(target=generation.__del__)
            finaliser.start()
            finaliser.join(10)
            assert not finaliser.is_alive() and not generation.done
        engine.scheduler.tick()
        assert generation.result.finish_reason == "cancelled" and not session.busy
        assert generation.result.token_ids == [first.token_id] and session.history == prompt + [first.token_id]


def test_a_generation_collected_part_way_through_its_prefill_is_ended_and_fed_no_more(engine):
    """Ended by the next step before it plans, a run still has prompt tokens to feed: kept among the running ones,
    the plan fed them into a cache it had let go (a RuntimeError for every generation of the step)."""
    beside = tokens(10, seed=74)
    with engine.session() as fresh:
        expected = fresh.generate(token_ids=beside, max_new_tokens=4, eos_token_ids=[]).token_ids
    with engine.session() as session, engine.session() as other:
        generation = session.stream(token_ids=tokens(engine.prefill_chunk + 40, seed=75), max_new_tokens=4,
                                    eos_token_ids=[])
        engine.scheduler.tick()  # its first chunk of the prompt
        assert generation._run.prefilling
        with engine.lock:
            finaliser = threading.Thread(target=generation.__del__)
            finaliser.start()
            finaliser.join(10)
        assert [event.token_id for event in other.stream(token_ids=beside, max_new_tokens=4, eos_token_ids=[])] == expected
        assert generation.result.finish_reason == "cancelled" and generation.result.token_ids == []


def test_a_stream_dropped_while_another_thread_holds_the_engine_leaves_its_session_free_for_the_next_call(engine):
    """Dropped then, the stream's run is only marked; the session stays busy with it until the next call
    ends it (it said free, and the next call ran beside the old run on the same cache: IndexError)."""
    prompt, follow = tokens(7, seed=72), tokens(9, seed=73)
    with engine.session() as fresh:
        expected = fresh.generate(token_ids=follow, max_new_tokens=8, eos_token_ids=[]).token_ids
    holding, release, released = threading.Event(), threading.Event(), []

    def hold():
        with engine.lock:  # another thread's call under way: stats(), a fork, a save...
            holding.set()
            released.append(release.wait(30))  # False: `busy` below waited for this thread to give up

    with engine.session() as session:
        stream = session.stream(token_ids=prompt, max_new_tokens=20, eos_token_ids=[])
        next(stream), next(stream)
        holder = threading.Thread(target=hold)
        holder.start()
        holding.wait(30)
        del stream  # collected here, while the other thread holds the engine
        assert session.busy
        release.set()
        holder.join(30)
        assert released == [True]  # asking `busy` did not wait for the engine
        assert session.generate(token_ids=follow, max_new_tokens=8, eos_token_ids=[]).token_ids == expected
        assert session.last.finish_reason == "length" and not engine.scheduler.busy


def admitted_without_a_chunk(engine, busy, idle, also):
    """A generation of `idle`'s admitted in a tick whose prefill budget (8 tokens) all went to others: half to
    the oldest, one of `busy`'s, the rest to one of `also`'s, with less left to prefill: it has run nothing
    yet. Returns (it, [the one of `busy`'s, the one of `also`'s])."""
    shorter = busy.stream(token_ids=tokens(40, seed=2, high=engine.vocab_size), max_new_tokens=2, eos_token_ids=[])
    engine.scheduler.tick()  # its first chunk
    middle = also.stream(token_ids=tokens(10, seed=5, high=engine.vocab_size), max_new_tokens=2, eos_token_ids=[])
    longer = idle.stream(token_ids=tokens(100, seed=4, high=engine.vocab_size), max_new_tokens=2, eos_token_ids=[])
    engine.scheduler.tick()  # admits `middle` and `longer`; the budget goes to `shorter` and `middle`
    assert longer._run.admitted and longer._run.stats.prefill_tokens == 0
    return longer, [shorter, middle]


def test_a_generation_cancelled_between_its_admission_and_its_first_chunk_leaves_its_session_as_it_was(
        engine, monkeypatch):
    """Cancelled when it has run nothing, its session keeps its history, cache and last result (PROTOCOL.md,
    generate), and its stats count nothing but its prompt."""
    monkeypatch.setattr(engine, "prefill_chunk", 8)
    busy, idle, also = engine.session(), engine.session(), engine.session()
    try:
        before = idle.generate(token_ids=tokens(6, seed=1, high=engine.vocab_size), strategy="sample", seed=3,
                               num_samples=2, max_new_tokens=2, eos_token_ids=[])
        history, cached = list(idle.history), idle.cached
        longer, others = admitted_without_a_chunk(engine, busy, idle, also)
        longer.cancel()
        assert list(longer) == [] and longer.result.finish_reason == "cancelled"
        stats = longer.result.stats
        assert (stats.prompt_tokens, stats.reused_tokens, stats.prefill_tokens, stats.generated_tokens) == (100, 0, 0, 0)
        assert (idle.history, idle.cached, idle.last) == (history, cached, before)
        assert idle.continuation(sequence=1) == before.sequences[1].tokens
        assert idle.generate(token_ids=history, max_new_tokens=3, eos_token_ids=[]).token_ids == reference_greedy(
            engine, history, 3)
        drain(others, engine)
    finally:
        busy.close()
        idle.close()
        also.close()


def test_a_session_closed_between_its_generations_admission_and_first_chunk_frees_its_memory(engine, monkeypatch):
    """The closed session's cache is gone, nothing to put back into: the generation ends cancelled, the
    other one goes on to its solo result, and no memory is left held once both sessions are closed."""
    monkeypatch.setattr(engine, "prefill_chunk", 8)
    held = (engine.stats()["sessions"], engine.stats()["cache_bytes"])  # other tests' shared prefixes, if any
    busy, idle, also = engine.session(), engine.session(), engine.session()
    try:
        idle.generate(token_ids=tokens(6, seed=1, high=engine.vocab_size), max_new_tokens=2, eos_token_ids=[])
        longer, others = admitted_without_a_chunk(engine, busy, idle, also)
        idle.close()
        assert list(longer) == [] and longer.result.finish_reason == "cancelled"
        streamed = drain(others, engine)
        assert streamed == [reference_greedy(engine, tokens(n, seed=seed, high=engine.vocab_size), 2) for n, seed in ((40, 2), (10, 5))]
    finally:
        busy.close()
        idle.close()
        also.close()
    assert (engine.stats()["sessions"], engine.stats()["cache_bytes"]) == held
