"""Each built-in against its transformers counterpart: identical outputs, bit for bit."""

import pytest
import torch
from transformers.generation import logits_process as hf

import processors as P

from .conftest import INPUT_LENGTH, LENGTH, make_logits, make_sequence, padded_context


def seq_tail(n):
    """The last n tokens of the test sequence, to build multi-token entries that match."""
    return make_sequence()[0, LENGTH - n :].tolist()


CASES = {
    "temperature": (P.Temperature(0.7), hf.TemperatureLogitsWarper(0.7)),
    "top_k": (P.TopK(10), hf.TopKLogitsWarper(10)),
    "top_k_min_keep": (P.TopK(5, min_tokens_to_keep=8), hf.TopKLogitsWarper(5, min_tokens_to_keep=8)),
    "top_p": (P.TopP(0.9), hf.TopPLogitsWarper(0.9)),
    "top_p_small": (P.TopP(0.3, min_tokens_to_keep=3), hf.TopPLogitsWarper(0.3, min_tokens_to_keep=3)),
    "top_p_one": (P.TopP(1.0), hf.TopPLogitsWarper(1.0)),
    "min_p": (P.MinP(0.1), hf.MinPLogitsWarper(0.1)),
    "min_p_min_keep": (P.MinP(0.5, min_tokens_to_keep=3), hf.MinPLogitsWarper(0.5, min_tokens_to_keep=3)),
    "typical_p": (P.TypicalP(0.9), hf.TypicalLogitsWarper(0.9)),
    "typical_p_min_keep": (P.TypicalP(0.2, min_tokens_to_keep=4), hf.TypicalLogitsWarper(0.2, min_tokens_to_keep=4)),
    "repetition": (P.RepetitionPenalty(1.3), hf.RepetitionPenaltyLogitsProcessor(1.3)),
    "repetition_encourage": (P.RepetitionPenalty(0.7), hf.RepetitionPenaltyLogitsProcessor(0.7)),
    "repetition_ignore_prompt": (
        P.RepetitionPenalty(1.3, prompt_ignore_length=4),
        hf.RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=4),
    ),
    "no_repeat_2": (P.NoRepeatNGram(2), hf.NoRepeatNGramLogitsProcessor(2)),
    "no_repeat_1": (P.NoRepeatNGram(1), hf.NoRepeatNGramLogitsProcessor(1)),
    "no_repeat_long": (P.NoRepeatNGram(20), hf.NoRepeatNGramLogitsProcessor(20)),
    "min_length_active": (P.MinLength(20, [3, 5]), hf.MinLengthLogitsProcessor(20, [3, 5])),
    "min_length_done": (P.MinLength(5, 3), hf.MinLengthLogitsProcessor(5, 3)),
    "min_new_tokens": (P.MinNewTokens(10, 3), hf.MinNewTokensLengthLogitsProcessor(INPUT_LENGTH, 10, 3)),
    "min_new_tokens_done": (P.MinNewTokens(2, [3, 4]), hf.MinNewTokensLengthLogitsProcessor(INPUT_LENGTH, 2, [3, 4])),
    "suppress": (P.SuppressTokens([1, 2, 7]), hf.SuppressTokensLogitsProcessor([1, 2, 7])),
    "suppress_at_begin": (
        P.SuppressTokensAtBegin([1, 2], begin_index=LENGTH),
        hf.SuppressTokensAtBeginLogitsProcessor([1, 2], LENGTH),
    ),
    "suppress_at_begin_later": (
        P.SuppressTokensAtBegin([1, 2], begin_index=LENGTH + 1),
        hf.SuppressTokensAtBeginLogitsProcessor([1, 2], LENGTH + 1),
    ),
    "forced_eos": (P.ForcedEOS(LENGTH + 1, [3, 9]), hf.ForcedEOSTokenLogitsProcessor(LENGTH + 1, [3, 9])),
    "forced_eos_not_yet": (P.ForcedEOS(LENGTH + 5, 3), hf.ForcedEOSTokenLogitsProcessor(LENGTH + 5, 3)),
    "sequence_bias": (
        P.SequenceBias([[[5], 2.5], [seq_tail(1) + [8], -3.0], [seq_tail(2) + [9], 1.5], [[0, 1, 2], 4.0], [[5], -1.0]]),
        hf.SequenceBiasLogitsProcessor(
            [[[5], 2.5], [seq_tail(1) + [8], -3.0], [seq_tail(2) + [9], 1.5], [[0, 1, 2], 4.0], [[5], -1.0]]
        ),
    ),
    "no_bad_words": (
        P.NoBadWords([[5], seq_tail(2) + [11], [3], [1, 2, 3, 4]], eos_token_ids=3),
        hf.NoBadWordsLogitsProcessor([[5], seq_tail(2) + [11], [3], [1, 2, 3, 4]], eos_token_id=3),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers(case, dtype, kind):
    ours, theirs = CASES[case]
    logits = make_logits(kind, dtype)
    tokens = make_sequence()
    context = padded_context(tokens)
    chain = P.Chain([ours])
    _, got = chain.process(chain.init(context), logits.clone(), context)
    expected = theirs(tokens.clone(), logits.clone())
    assert got.dtype == logits.dtype
    assert torch.equal(got, expected), f"{case}: {(got != expected).sum().item()} entries differ"


def test_forced_bos_at_length_one(dtype):
    logits = make_logits("plain", dtype)
    tokens = make_sequence()[:, :1]
    context = padded_context(tokens, input_length=1)
    chain = P.Chain([P.ForcedBOS(4)])
    _, got = chain.process(chain.init(context), logits, context)
    assert torch.equal(got, hf.ForcedBOSTokenLogitsProcessor(4)(tokens, logits.clone()))
    longer = padded_context(make_sequence())
    assert torch.equal(chain.process(chain.init(longer), logits, longer)[1], logits)


@pytest.mark.parametrize("p", [0.5, 0.9, 0.99])
def test_top_p_large_nucleus_grows_the_slice(p):
    """Flat logits put most of the vocabulary in the nucleus: every growth step and the sort fallback run."""
    for scale in (0.05, 0.5, 1.0, 2.0):
        logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(7)) * scale
        context = P.Context(torch.zeros(3, 1, dtype=torch.long), 1, 1, 5000)
        got = P.TopP(p).process((), logits, context)[1]
        assert torch.equal(got, hf.TopPLogitsWarper(p)(None, logits.clone()))


def test_top_p_stress_against_transformers():
    """Many shapes of row: peaked and flat, p up to 1 (whose cut sits in the tiny tail), ties, -inf, min_keep.

    Flat rows with wide nuclei go through the bucketed path; cuts within float32 summation error of
    1 - p go to the reference sort. Every row must come out bit-identical to transformers.
    """
    g = torch.Generator().manual_seed(11)
    for case in range(120):
        vocab = (300, 4000)[case % 2]
        logits = torch.randn(4, vocab, generator=g) * (0.01, 0.3, 1.0, 3.0, 10.0)[case % 5]
        if case % 4 == 1:
            logits = torch.round(logits * 4) / 4
        elif case % 4 == 2:
            logits[torch.rand(4, vocab, generator=g) < 0.5] = float("-inf")
        elif case % 4 == 3:
            logits[:, : vocab // 3] = logits[:, :1]
        p = (0.1, 0.5, 0.9, 0.99, 1.0)[(case // 2) % 5]
        keep = (1, 3)[case % 3 == 0]
        got = P.TopP(p, min_tokens_to_keep=keep).transform(logits, None)
        assert torch.equal(got, hf.TopPLogitsWarper(p, min_tokens_to_keep=keep)(None, logits.clone())), (case, p)


def test_top_p_ties_straddling_the_cut_follow_the_sort():
    """The cut falls inside a group of equal logits: which of them stay is decided by transformers' sort."""
    logits = torch.zeros(3, 1000)
    logits[1, 100:110] = 5.0  # ten tied favourites hold ~94% of the mass: p=0.5 keeps some of them
    logits[2, ::7] = 3.0
    context = P.Context(torch.zeros(3, 1, dtype=torch.long), 1, 1, 1000)
    got = P.TopP(0.5).process((), logits, context)[1]
    expected = hf.TopPLogitsWarper(0.5)(None, logits.clone())
    assert 0 < got[1].isfinite().sum() < 10
    assert torch.equal(got, expected)


def test_processors_in_a_chain_match_transformers_list(dtype):
    ours = P.Chain([P.RepetitionPenalty(1.1), P.Temperature(0.7), P.TopK(50), P.TopP(0.9)])
    theirs = hf.LogitsProcessorList(
        [hf.RepetitionPenaltyLogitsProcessor(1.1), hf.TemperatureLogitsWarper(0.7), hf.TopKLogitsWarper(50), hf.TopPLogitsWarper(0.9)]
    )
    logits, tokens = make_logits("plain", dtype), make_sequence()
    context = padded_context(tokens)
    assert torch.equal(ours.process(ours.init(context), logits, context)[1], theirs(tokens, logits.clone()))
