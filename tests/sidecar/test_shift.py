"""reuse="shift": a session's cache moved after dropped tokens, checked against cold forwards.

The independent reference is a cold session: in the first layer a key depends only on its token and
its position, so a shifted key must equal the one a cold forward of the shifted sequence computes, and a
one-layer model's whole shifted cache must equal the cold one.
"""

import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from sidecar import Engine
from sidecar.errors import InvalidArgument
from sidecar.shift import Shift, align

from .conftest import tokens, unshared


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny models gain nothing from a second thread (see test_bad_input)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def llama(tmp_path_factory, default_dir, name, layers=2, **config):
    """A tiny random Llama-style model with the shipped tokenizer, saved as a local directory."""
    path = tmp_path_factory.mktemp(name)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_dir / file, path / file)
    torch.manual_seed(3)
    LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 bos_token_id=1, eos_token_id=2, **config)).save_pretrained(path)
    return Engine.load(path)


ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},  # scales cos and sin
}


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory, default_dir):
    return llama(tmp_path_factory, default_dir, "one-layer", layers=1)


@pytest.fixture(scope="module", params=["default", *ROPES])
def rope_engine(request, tmp_path_factory, default_dir, engine):
    if request.param == "default":
        return engine
    return llama(tmp_path_factory, default_dir, request.param,
                 rope_parameters={"rope_theta": 10000.0, **ROPES[request.param]})


def cold(engine, input_ids, **options):
    """A fresh session's result and its cache (keys and values of every layer) for `input_ids`."""
    with unshared(engine).session() as session:
        result = session.generate(token_ids=input_ids, eos_token_ids=[], **options)
        cache = [(k[0, :, : session.cached].clone(), v[0, :, : session.cached].clone())
                 for k, v in zip(session.cache.keys, session.cache.values)]
    return result, cache


def cache_of(session):
    return [(k[0, :, : session.cached].clone(), v[0, :, : session.cached].clone())
            for k, v in zip(session.cache.keys, session.cache.values)]


def slid(t, keep, drop, end):
    """The window t[:end] after dropping `drop` tokens behind the first `keep`."""
    return t[:keep] + t[keep + drop : end]


# ---- the alignment -------------------------------------------------------------------------------

@pytest.mark.parametrize("keep", [0, 3])
def test_align_finds_the_drop_of_a_sliding_window(keep):
    t = tokens(300, 5)
    assert align(t[:200], slid(t, keep, 40, 260), keep) == Shift(keep, 40, 160 - keep)


def test_align_reuses_what_matches_and_prefers_the_most_tokens():
    old = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert align(old, [4, 5, 9, 9], 0) == Shift(0, 3, 2)  # only 4 5 match after dropping three
    assert align(old, [2, 3, 4, 5, 6, 7, 0], 0) == Shift(0, 1, 6)
    assert align([5, 1, 5, 6, 7], [5, 6, 7, 0], 0) == Shift(0, 2, 3)  # the first token recurs: only drop 2 fits
    assert align([1, 9, 5, 1, 5, 6], [1, 5, 6, 0], 1) == Shift(1, 3, 2)


def test_align_needs_the_kept_tokens_and_leaves_the_last_input_token():
    assert align([1, 2, 3, 4], [9, 3, 4, 5], 1) is None  # the first token differs
    assert align([1, 2, 3, 4], [1, 3, 4], 1) == Shift(1, 1, 1)  # 4 is the last input token: fed again
    assert align([1, 2, 3], [1, 2, 3, 4], 5) is None  # more to keep than is cached
    assert align([1, 2, 3], [7, 8], 0) is None


def reference(cached, input_ids, keep):
    """align by its definition: every drop tried, its common prefix with the input counted token by token."""
    limit = len(input_ids) - 1 - keep
    if keep > len(cached) or limit <= 0 or cached[:keep] != input_ids[:keep]:
        return None
    best = Shift(keep, 0, 0)
    for drop in range(1, len(cached) - keep):
        tail = cached[keep + drop :]
        count = 0
        while count < min(limit, len(tail)) and tail[count] == input_ids[keep + count]:
            count += 1
        if count > best.count:
            best = Shift(keep, drop, count)
    return best if best.count else None


few = st.lists(st.integers(0, 2), max_size=40)  # three tokens: repetition everywhere, ties too


@settings(max_examples=1000, deadline=None)
@given(few, st.integers(0, 40), st.integers(0, 40), few, st.integers(0, 3), st.booleans())
def test_align_is_the_drop_that_trying_every_one_finds(cached, start, end, extra, keep, kept):
    """The input continues the cache's kept tokens (or not) with a piece of it and more; small enough that
    both searches run: one try after another, and the linear one once the tries compared too much."""
    input_ids = (cached[:keep] if kept else []) + cached[keep + start : keep + end] + extra
    assert align(cached, input_ids, keep) == reference(cached, input_ids, keep)


class Counted(int):
    """A token that counts how often Python compares it."""

    compared = 0

    def __eq__(self, other):
        Counted.compared += 1
        return int.__eq__(self, other)


N = 32768
PERIOD = ([1, 2, 3] * N)[:N]
REPETITIVE = [  # every candidate drop matches, most of them at length
    pytest.param([5] * N, [5] * (N // 2) + [7] + [5] * (N // 2 - 1), 0, Shift(0, 1, N // 2), id="one token"),
    pytest.param([5] * N, [5] * (N // 2) + [7] + [5] * (N // 2 - 1), 4, Shift(4, 1, N // 2 - 4), id="keep 4"),
    pytest.param([5] * N, [5, 7] + [5] * (N - 2), 0, Shift(0, 1, 1), id="one token, then another"),
    pytest.param(PERIOD, PERIOD[1 : N // 2] + [3] + PERIOD[: N // 2], 0, Shift(0, 1, N // 2 - 1), id="period 3"),
    pytest.param(PERIOD, PERIOD[:4] + PERIOD[5 : N // 2] + [3] + PERIOD[: N // 2], 4, Shift(4, 1, N // 2 - 5),
                 id="period 3, keep 4"),
    pytest.param([5] * N, [5, 7, 0], 0, Shift(0, 1, 1), id="short tries, many"),
    pytest.param([7] * 2048 + [8] * 2048, [7] * 2047 + [8] * 2048 + [9], 0, Shift(0, 1, 4095), id="two runs"),
]


@pytest.mark.parametrize("cached, input_ids, keep, expected", REPETITIVE)
def test_align_of_repetitive_tokens_does_linear_work(monkeypatch, cached, input_ids, keep, expected):
    """Trying every candidate drop compared 400 million tokens at 32k, or made a numpy call for each of
    32k short tries. Counted without a clock: the tokens numpy compares (each comparison is read through
    flatnonzero) and its calls, and the comparisons Python makes of the tokens themselves."""
    numpy = {"calls": 0, "compared": 0}
    flatnonzero = np.flatnonzero

    def counted(a):
        numpy["calls"] += 1
        numpy["compared"] += a.size
        return flatnonzero(a)

    monkeypatch.setattr(np, "flatnonzero", counted)
    Counted.compared = 0
    assert align([Counted(t) for t in cached], [Counted(t) for t in input_ids], keep) == expected
    n = len(cached) + len(input_ids)
    assert numpy["compared"] + Counted.compared <= 8 * n
    assert numpy["calls"] <= n // 16 + 2


# ---- the re-rotation -----------------------------------------------------------------------------

@pytest.mark.parametrize("keep", [0, 4])
def test_shifted_first_layer_keys_equal_a_cold_forward(rope_engine, keep):
    """Layer 0's keys depend on token and position only: moved by -d they are a cold forward's keys."""
    t = tokens(120, 11)
    drop, end = 17, 100
    with rope_engine.session() as session:
        session.generate(token_ids=t[:end], max_new_tokens=0)
        window = slid(t, keep, drop, end + 10)
        result = session.generate(token_ids=window, max_new_tokens=0, reuse="shift", keep=keep)
        assert (result.stats.reused_tokens, result.stats.shifted_tokens) == (end - drop, end - drop - keep)
        shifted = cache_of(session)
    _, reference = cold(rope_engine, window, max_new_tokens=0)
    keys, values = shifted[0]
    assert keys.shape == reference[0][0].shape
    torch.testing.assert_close(keys, reference[0][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(values, reference[0][1], atol=1e-5, rtol=0)  # values carry no position


def test_on_one_layer_a_shift_is_exact(one_layer):
    """With a single layer nothing the dropped tokens contributed survives: the whole call equals a cold run."""
    t = tokens(200, 12)
    with one_layer.session() as session:
        session.generate(token_ids=t[:128], max_new_tokens=8, eos_token_ids=[])
        window = slid(t, 2, 32, 128) + session.history[128:] + [5, 6]
        result = session.generate(token_ids=window, max_new_tokens=8, eos_token_ids=[], reuse="shift", keep=2)
        shifted = cache_of(session)
    expected, reference = cold(one_layer, window, max_new_tokens=8)
    assert result.token_ids == expected.token_ids
    assert result.stats.shifted_tokens == 128 + 7 - 34
    for (k, v), (ref_k, ref_v) in zip(shifted, reference):
        torch.testing.assert_close(k, ref_k, atol=1e-5, rtol=0)
        torch.testing.assert_close(v, ref_v, atol=1e-5, rtol=0)


# ---- generate with reuse="shift" -----------------------------------------------------------------

@pytest.mark.parametrize("keep", [0, 4])
def test_a_window_sliding_by_a_quarter_reuses_the_rest(engine, keep):
    t = tokens(400, 13)
    with engine.session() as session:
        first = session.generate(token_ids=t[:256], max_new_tokens=4, eos_token_ids=[])
        history = session.history  # 256 + 4 tokens, the last not cached
        window = history[:keep] + history[keep + 64 :] + t[300:310]
        result = session.generate(token_ids=window, max_new_tokens=6, eos_token_ids=[], reuse="shift", keep=keep)
        assert first.stats.reused_tokens == 0
        reused = keep + (259 - 64 - keep)  # every cached token after the dropped ones
        assert (result.stats.prompt_tokens, result.stats.reused_tokens, result.stats.shifted_tokens,
                result.stats.prefill_tokens) == (len(window), reused, reused - keep, len(window) - reused)
        assert len(result.token_ids) == 6 and result.finish_reason == "length"
        assert session.history == window + result.token_ids and session.cached == len(window) + 5


def test_prefix_reuse_wins_when_it_reuses_as_much(engine):
    t = tokens(100, 14)
    with engine.session() as session:
        session.generate(token_ids=t[:50], max_new_tokens=0)
        result = session.generate(token_ids=t[:80], max_new_tokens=2, eos_token_ids=[], reuse="shift")
        assert (result.stats.reused_tokens, result.stats.shifted_tokens) == (50, 0)


def test_kept_tokens_that_differ_mean_no_shift(engine):
    t = tokens(100, 15)
    with engine.session() as session:
        session.generate(token_ids=t[:60], max_new_tokens=0)
        window = [999] + t[11:60] + [5]
        result = session.generate(token_ids=window, max_new_tokens=2, eos_token_ids=[], reuse="shift", keep=1)
        assert (result.stats.reused_tokens, result.stats.shifted_tokens) == (0, 0)
        expected, _ = cold(engine, window, max_new_tokens=2)
        assert result.token_ids == expected.token_ids


def test_samples_and_beams_start_from_a_shifted_cache(engine):
    t = tokens(200, 16)
    with engine.session() as session:
        session.generate(token_ids=t[:100], max_new_tokens=0)
        sampled = session.generate(token_ids=t[20:120], max_new_tokens=4, strategy="sample", num_samples=3, seed=1,
                                   eos_token_ids=[], reuse="shift")
        assert sampled.stats.shifted_tokens == 80 and len(sampled.sequences) == 3
        beams = session.generate(token_ids=t[40:140], max_new_tokens=4, strategy="beam", num_beams=3, eos_token_ids=[],
                                 reuse="shift")
        assert beams.stats.shifted_tokens == 80 and len(beams.token_ids) == 4


# ---- refusals ------------------------------------------------------------------------------------

def test_a_model_with_absolute_positions_refuses_shift(gpt2_engine):
    t = tokens(40, 17)
    with gpt2_engine.session() as session:
        session.generate(token_ids=t[:30], max_new_tokens=0)
        with pytest.raises(InvalidArgument, match="rotary") as caught:
            session.generate(token_ids=t[5:35], reuse="shift")
        assert caught.value.details == {"option": "reuse"} and caught.value.code == "invalid_argument"
        assert session.history == t[:30] and session.cached == 30


def test_a_rotary_type_that_depends_on_the_length_refuses_shift(tmp_path_factory, default_dir):
    engine = llama(tmp_path_factory, default_dir, "dynamic",
                   rope_parameters={"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(InvalidArgument, match="dynamic") as caught:
        engine.session().generate(token_ids=[5, 6, 7], reuse="shift")
    assert caught.value.details == {"option": "reuse"}


def test_rotary_embeddings_per_layer_or_over_part_of_a_head_refuse_shift():
    import copy

    from sidecar.shift import Rotation

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    assert isinstance(Rotation.of(model, 16), Rotation)
    with pytest.raises(InvalidArgument, match="cover 16 of its 32 dimensions"):
        Rotation.of(model, 32)
    model.model.layers[0].self_attn.rotary_emb = copy.deepcopy(model.model.rotary_emb)
    with pytest.raises(InvalidArgument, match="of their own"):
        Rotation.of(model, 16)


def test_the_refusals_of_gemma_3_and_gpt_oss_say_why():
    """Gemma 3 rotates each kind of layer with frequencies of its own, GPT-OSS applies half-width angles to
    both halves of a head: they were refused as having no rotary embeddings, and as rotating half a head."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig, GptOssForCausalLM

    from sidecar.shift import Rotation

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=16)
    with pytest.raises(InvalidArgument, match="of their own"):
        Rotation.of(Gemma3ForCausalLM(Gemma3TextConfig(**shape)), 16)
    with pytest.raises(InvalidArgument, match="cover 8 of its 16 dimensions"):
        Rotation.of(GptOssForCausalLM(GptOssConfig(**shape, num_local_experts=2, num_experts_per_tok=1)), 16)


@pytest.mark.parametrize("options, option", [
    ({"reuse": "suffix"}, "reuse"),
    ({"reuse": None}, "reuse"),
    ({"reuse": ["shift"]}, "reuse"),
    ({"keep": 2}, "keep"),  # keep goes with shift
    ({"reuse": "prefix", "keep": 0}, "keep"),
    ({"reuse": "shift", "keep": -1}, "keep"),
    ({"reuse": "shift", "keep": 1.5}, "keep"),
    ({"reuse": "shift", "keep": True}, "keep"),
    ({"reuse": "shift", "keep": "4"}, "keep"),
])
def test_bad_values_are_refused_by_name(engine, options, option):
    with engine.session() as session:
        session.generate(token_ids=[5, 6, 7], max_new_tokens=1)
        before = (list(session.history), session.cached)
        with pytest.raises(InvalidArgument) as caught:
            session.generate(token_ids=[6, 7, 8], **options)
        assert caught.value.details == {"option": option}
        assert (session.history, session.cached) == before


# ---- failures put the session back ---------------------------------------------------------------

def fails_at_the_second_step(logits, context):
    if context.length - context.input_length >= 1:
        raise RuntimeError("a processor of the caller's failed")
    return logits


def test_a_failed_shifted_call_puts_the_session_back_exactly(engine):
    t = tokens(300, 18)
    with engine.session() as session:
        session.generate(token_ids=t[:200], max_new_tokens=3, eos_token_ids=[])
        history, cached, cache = list(session.history), session.cached, cache_of(session)
        with pytest.raises(RuntimeError, match="caller's"):
            session.generate(token_ids=history[:4] + history[54:] + t[250:260], max_new_tokens=5, eos_token_ids=[],
                             reuse="shift", keep=4, processors=[fails_at_the_second_step])
        assert (session.history, session.cached) == (history, cached)
        for (k, v), (old_k, old_v) in zip(cache_of(session), cache):
            assert torch.equal(k, old_k) and torch.equal(v, old_v)
        follow = history + t[260:270]
        after = session.generate(token_ids=follow, max_new_tokens=6, eos_token_ids=[])
    expected, _ = cold(engine, follow, max_new_tokens=6)
    assert after.token_ids == expected.token_ids and after.stats.reused_tokens == cached


def test_a_shifted_call_cancelled_before_it_starts_changes_nothing(engine):
    t = tokens(200, 19)
    with engine.session() as session:
        session.generate(token_ids=t[:100], max_new_tokens=0)
        stream = session.stream(token_ids=t[30:130], max_new_tokens=5, reuse="shift")
        stream.cancel()
        assert list(stream) == [] and stream.result.finish_reason == "cancelled"
        assert (session.history, session.cached) == (t[:100], 100)
        after = session.generate(token_ids=t[:110], max_new_tokens=4, eos_token_ids=[])
    expected, _ = cold(engine, t[:110], max_new_tokens=4)
    assert after.token_ids == expected.token_ids and after.stats.reused_tokens == 100


# ---- the default stays exact ---------------------------------------------------------------------

def test_default_reuse_recomputes_a_sliding_window_exactly(engine):
    t = tokens(300, 20)
    with engine.session() as session:
        session.generate(token_ids=t[:200], max_new_tokens=3, eos_token_ids=[])
        result = session.generate(token_ids=t[50:250], max_new_tokens=6, eos_token_ids=[])
        cache = cache_of(session)
    expected, reference = cold(engine, t[50:250], max_new_tokens=6)
    assert result.token_ids == expected.token_ids
    assert (result.stats.reused_tokens, result.stats.shifted_tokens) == (0, 0)
    for (k, v), (ref_k, ref_v) in zip(cache, reference):
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


# ---- over the protocol ---------------------------------------------------------------------------

def test_shift_through_the_server_equals_the_python_api(default_dir, engine):
    from protocol.peer import Peer

    from .test_server import SERVER

    t = tokens(200, 21)
    window = t[:4] + t[40:150]
    with engine.session() as session:
        session.generate(token_ids=t[:120], max_new_tokens=0)
        expected = session.generate(token_ids=window, max_new_tokens=5, eos_token_ids=[], reuse="shift", keep=4)
    with Peer(SERVER) as peer:
        assert peer.call("open_session", session="s")["ok"]
        assert peer.call("generate", session="s", token_ids=t[:120], max_new_tokens=0)["ok"]
        reply = peer.call("generate", session="s", token_ids=window, max_new_tokens=5, eos_token_ids=[],
                          reuse="shift", keep=4)
        refused = peer.call("generate", session="s", token_ids=window, keep=4)
    assert reply["result"]["token_ids"] == expected.token_ids
    stats = reply["result"]["stats"]
    assert (stats["reused_tokens"], stats["shifted_tokens"], stats["prefill_tokens"]) == (84, 80, 30)
    assert refused["error"]["code"] == "invalid_argument" and refused["error"]["option"] == "keep"
