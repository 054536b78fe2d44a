"""Each built-in against its transformers counterpart: identical outputs, bit for bit."""

import warnings

import pytest
import torch
from transformers.generation import logits_process as hf

import processors as P
from processors import sampling

from .conftest import INPUT_LENGTH, LENGTH, make_logits, make_sequence, padded_context


def seq_tail(n):
    """The last n tokens of the test sequence, to build multi-token entries that match."""
    return make_sequence()[0, LENGTH - n :].tolist()


CASES = {
    "temperature": (P.Temperature(0.7), hf.TemperatureLogitsWarper(0.7)),
    "top_h": (P.TopH(0.4), hf.TopHLogitsWarper(0.4)),
    "top_h_one": (P.TopH(1.0), hf.TopHLogitsWarper(1.0)),
    "top_h_tiny": (P.TopH(1e-6), hf.TopHLogitsWarper(1e-6)),
    "top_k": (P.TopK(10), hf.TopKLogitsWarper(10)),
    "top_k_min_keep": (P.TopK(5, min_tokens_to_keep=8), hf.TopKLogitsWarper(5, min_tokens_to_keep=8)),
    "top_p": (P.TopP(0.9), hf.TopPLogitsWarper(0.9)),
    "top_p_small": (P.TopP(0.3, min_tokens_to_keep=3), hf.TopPLogitsWarper(0.3, min_tokens_to_keep=3)),
    "top_p_one": (P.TopP(1.0), hf.TopPLogitsWarper(1.0)),
    "top_p_zero": (P.TopP(0.0, min_tokens_to_keep=2), hf.TopPLogitsWarper(0.0, min_tokens_to_keep=2)),
    "min_p": (P.MinP(0.1), hf.MinPLogitsWarper(0.1)),
    "min_p_min_keep": (P.MinP(0.5, min_tokens_to_keep=3), hf.MinPLogitsWarper(0.5, min_tokens_to_keep=3)),
    "typical_p": (P.TypicalP(0.9), hf.TypicalLogitsWarper(0.9)),
    "typical_p_min_keep": (P.TypicalP(0.2, min_tokens_to_keep=4), hf.TypicalLogitsWarper(0.2, min_tokens_to_keep=4)),
    "epsilon": (P.EpsilonCutoff(0.002), hf.EpsilonLogitsWarper(0.002)),
    "epsilon_everything": (P.EpsilonCutoff(0.9, min_tokens_to_keep=3), hf.EpsilonLogitsWarper(0.9, min_tokens_to_keep=3)),
    "eta": (P.EtaCutoff(0.002), hf.EtaLogitsWarper(0.002)),
    "eta_everything": (P.EtaCutoff(0.9, min_tokens_to_keep=2), hf.EtaLogitsWarper(0.9, min_tokens_to_keep=2)),
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
    "sequence_bias_dict": (  # transformers' dict form, from Python
        P.SequenceBias({(5,): 2.5, tuple(seq_tail(1) + [8]): -3.0, (0, 1, 2): 4.0}),
        hf.SequenceBiasLogitsProcessor({(5,): 2.5, tuple(seq_tail(1) + [8]): -3.0, (0, 1, 2): 4.0}),
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
def test_top_p_large_nucleus(p):
    """Flat logits put most of the vocabulary in the nucleus: the bucketed path and its exact fallbacks run."""
    for scale in (0.05, 0.5, 1.0, 2.0):
        logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(7)) * scale
        context = P.Context(torch.zeros(3, 1, dtype=torch.long), 1, 1, 5000)
        got = P.TopP(p).process((), logits, context)[1]
        assert torch.equal(got, hf.TopPLogitsWarper(p)(None, logits.clone()))


def test_top_p_stress_against_transformers():
    """Many shapes of row: peaked and flat, p up to 1 (whose cut sits in the tiny tail), ties, -inf, min_keep.

    Flat rows with wide nuclei go through the bucketed path; cuts within float32 summation error of
    1 - p are recomputed from sorted values. Every row must come out bit-identical to transformers.
    """
    g = torch.Generator().manual_seed(11)
    for case in range(144):
        vocab = (300, 4000)[case % 2]
        logits = torch.randn(4, vocab, generator=g) * (0.01, 0.3, 1.0, 3.0, 10.0)[case % 5]
        if case % 4 == 1:
            logits = torch.round(logits * 4) / 4
        elif case % 4 == 2:
            logits[torch.rand(4, vocab, generator=g) < 0.5] = float("-inf")
        elif case % 4 == 3:
            logits[:, : vocab // 3] = logits[:, :1]
        p = (0.1, 0.5, 0.9, 0.99, 1.0, 0.0)[(case // 2) % 6]
        keep = (1, 3)[case % 3 == 0]
        got = P.TopP(p, min_tokens_to_keep=keep).transform(logits, None)
        assert torch.equal(got, hf.TopPLogitsWarper(p, min_tokens_to_keep=keep)(None, logits.clone())), (case, p)


@pytest.mark.parametrize("ours, theirs", [(P.TopP(0.5, min_tokens_to_keep=2**63), hf.TopPLogitsWarper),
                                          (P.TypicalP(0.5, min_tokens_to_keep=2**63), hf.TypicalLogitsWarper)],
                         ids=["top_p", "typical_p"])
def test_min_tokens_to_keep_past_the_vocabulary_keeps_every_token_and_warns_nothing(ours, theirs):
    """Found from outside: top_p with min_tokens_to_keep >= 2**63 (its schema's bound is the uint's) was right
    but had torch warn on the server's log that it truncated a slice."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ours.transform(logits.clone(), None)
    assert torch.equal(got, logits) and torch.equal(got, theirs(0.5, min_tokens_to_keep=50)(None, logits.clone()))


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


def same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bit for bit: tells -0.0 from 0.0, and a NaN equals itself."""
    as_int = {torch.float32: torch.int32, torch.float64: torch.int64}[got.dtype]
    return got.dtype == expected.dtype and torch.equal(got.view(as_int), expected.view(as_int))


def wide_and_peaked_rows(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """One batch of every shape of row the paths split on, in turn: flat at three scales, language-model
    peaked, top-k filtered (mostly -inf), half -inf, quantised (ties everywhere)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    for row in range(rows):
        kind = row % 7
        if kind < 3:
            logits[row] *= (0.3, 1.0, 3.0)[kind]
        elif kind == 3:
            favourites = torch.randint(0, vocab, (40,), generator=g)
            logits[row] = (logits[row] * 2).index_add_(0, favourites, torch.full((40,), 9.0))
        elif kind == 4:
            top = logits[row].topk(50).values[-1]
            logits[row] = logits[row].masked_fill(logits[row] < top, float("-inf"))
        elif kind == 5:
            logits[row, torch.rand(vocab, generator=g) < 0.5] = float("-inf")
        else:
            logits[row] = torch.round(logits[row] * 8) / 8
    return logits


class PathSpy:
    """Records how many rows each path of TopP was given, call by call, so a test can show which ran."""

    PATHS = ("_cut_in_slice", "_cut_by_buckets", "_cut_by_sorted_values", "_top_p_sorted")

    def __init__(self, monkeypatch):
        self.calls = {name: [] for name in self.PATHS}
        for name in self.PATHS:
            monkeypatch.setattr(sampling, name, self.recording(name, getattr(sampling, name)))

    def recording(self, name, path):
        def recorded(logits, *args):
            self.calls[name].append(logits.shape[0])
            return path(logits, *args)

        return recorded

    def rows(self, name):
        return sum(self.calls[name])


@pytest.mark.parametrize("p", [1e-9, 0.1, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0])
@pytest.mark.parametrize("min_keep", [1, 5])
def test_top_p_batches_of_every_kind_of_row(p, min_keep):
    """A real vocabulary, rows of every shape in one batch: each row is decided as if it were alone."""
    logits = wide_and_peaked_rows(14, 32000, seed=int(p * 1000) + min_keep)
    got = P.TopP(p, min_tokens_to_keep=min_keep).transform(logits, None)
    assert same_bits(got, hf.TopPLogitsWarper(p, min_tokens_to_keep=min_keep)(None, logits.clone()))


@pytest.mark.parametrize("rows", [1, 16])
def test_top_p_batch_size_does_not_change_a_row(rows):
    logits = wide_and_peaked_rows(rows, 32000, seed=3)
    got = P.TopP(0.9).transform(logits, None)
    assert same_bits(got, hf.TopPLogitsWarper(0.9)(None, logits.clone()))
    alone = torch.cat([P.TopP(0.9).transform(logits[r : r + 1], None) for r in range(rows)])
    assert same_bits(got, alone)


def test_top_p_float64():
    """Also with logits so spread that float64 probabilities stay above 0 past the farthest bucket."""
    spread = torch.randn(2, 20000, generator=torch.Generator().manual_seed(6)) * 40
    logits = torch.cat([wide_and_peaked_rows(14, 20000, seed=5), spread]).double()
    for p in (0.5, 0.9, 0.999, 1.0):
        got = P.TopP(p, min_tokens_to_keep=3).transform(logits, None)
        assert same_bits(got, hf.TopPLogitsWarper(p, min_tokens_to_keep=3)(None, logits.clone()))


def test_top_p_non_contiguous_rows():
    logits = wide_and_peaked_rows(8, 32000, seed=8).t().contiguous().t()
    got = P.TopP(0.9).transform(logits, None)
    assert same_bits(got, hf.TopPLogitsWarper(0.9)(None, logits.clone()))


def test_top_p_flat_rows_skip_the_slice_and_recompute_near_cuts(monkeypatch):
    """Flat rows at p=0.9 put ~14% of their cuts within 1e-5 of 0.1: those are redone from sorted values."""
    spy = PathSpy(monkeypatch)
    logits = torch.randn(64, 32000, generator=torch.Generator().manual_seed(2))
    assert same_bits(P.TopP(0.9).transform(logits, None), hf.TopPLogitsWarper(0.9)(None, logits.clone()))
    assert spy.calls["_cut_in_slice"] == [] and spy.calls["_cut_by_buckets"] == [64]
    assert spy.rows("_cut_by_sorted_values") > 0 and spy.rows("_top_p_sorted") == 0


def test_top_p_peaked_rows_go_on_to_buckets_when_the_cut_is_below_the_slice(monkeypatch):
    spy = PathSpy(monkeypatch)
    logits = wide_and_peaked_rows(70, 32000, seed=9)[[r for r in range(70) if r % 7 in (3, 4)]]
    assert same_bits(P.TopP(0.9).transform(logits, None), hf.TopPLogitsWarper(0.9)(None, logits.clone()))
    assert spy.calls["_cut_in_slice"] == [20] and 0 < spy.rows("_cut_by_buckets") < 20


def test_top_p_quantised_rows_cut_inside_ties(monkeypatch):
    spy = PathSpy(monkeypatch)
    logits = torch.round(torch.randn(64, 32000, generator=torch.Generator().manual_seed(3)) * 4) / 4
    assert same_bits(P.TopP(0.9).transform(logits, None), hf.TopPLogitsWarper(0.9)(None, logits.clone()))
    assert spy.rows("_top_p_sorted") > 0


@pytest.mark.parametrize("where", ["nan", "inf", "all -inf"])
def test_top_p_non_finite_rows(where):
    logits = wide_and_peaked_rows(7, 1000, seed=4)
    logits[2] = float("-inf") if where == "all -inf" else logits[2]
    logits[2, 7] = {"nan": float("nan"), "inf": float("inf"), "all -inf": float("-inf")}[where]
    got = P.TopP(0.9).transform(logits, None)
    assert same_bits(got, hf.TopPLogitsWarper(0.9)(None, logits.clone()))


@pytest.mark.parametrize("min_keep", [999, 1000, 1500])
def test_top_p_min_keep_near_and_past_the_vocabulary(min_keep):
    logits = wide_and_peaked_rows(7, 1000, seed=6)
    for p in (1e-9, 0.9):
        got = P.TopP(p, min_tokens_to_keep=min_keep).transform(logits, None)
        assert same_bits(got, hf.TopPLogitsWarper(p, min_tokens_to_keep=min_keep)(None, logits.clone()))


def test_top_p_signed_zeros_at_the_cut():
    """-0.0 and 0.0 compare equal: a cut between them is a tie, and which stays is the sort's to say."""
    logits = torch.zeros(4, 3000)
    logits[:, ::2] = -0.0
    logits[:, :100] = torch.linspace(1, 3, 100)
    for p in (0.5, 0.9):
        got = P.TopP(p).transform(logits, None)
        assert same_bits(got, hf.TopPLogitsWarper(p)(None, logits.clone()))


@pytest.mark.parametrize("side", ["last kept", "first dropped"])
def test_top_p_a_crowded_bucket_below_the_cut_is_summed_exactly(side):
    """25k equal probabilities share a bucket just below the cut, and the cut is 1e-4 (relative) from
    1 - p: outside the near-tie margin, but inside the 3e-4 that a float32 sum of that bucket strays by."""
    g = torch.Generator().manual_seed(12)
    logits = torch.cat([torch.zeros(1, 25000), torch.randn(1, 7000, generator=g) * 0.5 + 3], dim=1)
    low_mass = logits.sort(dim=-1).values.softmax(dim=-1).cumsum(dim=-1)[0].double()
    first_kept = 25100  # in ascending order: among the distinct logits just above the crowded bucket
    bound = low_mass[first_kept] * (1 - 1e-4) if side == "last kept" else low_mass[first_kept - 1] * (1 + 1e-4)
    got = P.TopP(1 - float(bound)).transform(logits, None)
    expected = hf.TopPLogitsWarper(1 - float(bound))(None, logits.clone())
    assert same_bits(got, expected) and expected.isfinite().sum() == 32000 - first_kept


def test_top_p_nucleus_exactly_the_slice_goes_to_buckets_whole(monkeypatch):
    """64 tokens well above a flat tail, the 64th kept and the 65th dropped: the slice cannot tell the
    65th's value, so the buckets decide, and they need the slice's probabilities back in place."""
    spy = PathSpy(monkeypatch)
    g = torch.Generator().manual_seed(13)
    logits = torch.randn(2, 32000, generator=g) * 0.5
    logits[:, :64] = 8.65 + torch.linspace(0, 0.05, 64)
    expected = hf.TopPLogitsWarper(0.9)(None, logits.clone())
    assert (expected.isfinite().sum(dim=1) == 64).all()
    assert same_bits(P.TopP(0.9).transform(logits, None), expected)
    assert spy.calls["_cut_in_slice"] == [2] and spy.calls["_cut_by_buckets"] == [2]


def crowded_row(nucleus: str, seed: int) -> torch.Tensor:
    """50257 logits, all but a few equal: 10257 spread above the crowd, or 10 high ones. Shuffled, so
    that our unsorted softmax does not add the crowd in a row as the sorted one does."""
    g = torch.Generator().manual_seed(seed)
    crowd = torch.full((1, 50257), float(torch.randn(1, generator=g)) / 2)
    if nucleus == "wide":
        crowd[:, 40000:] = torch.randn(1, 10257, generator=g) + 1
    else:
        crowd[:, :10] = 6 + torch.randn(1, 10, generator=g) * 0.1
    return crowd[:, torch.randperm(50257, generator=g)]


@pytest.mark.parametrize("nucleus", ["wide", "within the slice"])
def test_top_p_a_crowd_of_equal_logits_is_decided_exactly(nucleus, monkeypatch):
    """A crowd of equal logits shifts the sorted softmax's float32 normaliser by more than the near-tie
    margin. With 1 - p on transformers' side of a mass and outside the margin on ours, only the crowd
    check (buckets) or the crowd-widened margin (slice) keeps the answer transformers'."""
    for seed in range(20):  # the shift depends on the values: take the first row where it is large
        logits = crowded_row(nucleus, seed)
        theirs = logits.sort(dim=-1).values.softmax(dim=-1).cumsum(dim=-1)[0].double()
        ours = logits.softmax(dim=-1)[0, logits[0].argsort()].double().cumsum(dim=0)
        at = 45000 if nucleus == "wide" else 50252  # a distinct logit above the crowd
        if abs(ours[at] / theirs[at] - 1) > 1.1 * sampling.NEAR_TIE:
            break
    else:
        pytest.fail("no row with a large enough shift")
    spy = PathSpy(monkeypatch)
    bound = float(theirs[at]) * (1 + 1e-7 if ours[at] > theirs[at] else 1 - 1e-7)
    got = P.TopP(1 - bound).transform(logits, None)
    assert same_bits(got, hf.TopPLogitsWarper(1 - bound)(None, logits.clone()))
    assert spy.calls["_cut_by_sorted_values"] == [1]
