"""A call that leaves out strategy, processors or stop takes the model's generation config's, as transformers'
`generate` does (PROTOCOL.md, "Generation defaults"); one that gives them takes exactly those."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import GenerationConfig

from protocol.peer import Peer
from sidecar import Engine, errors

from .conftest import tokens

CONFIG = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.3,
          "no_repeat_ngram_size": 2, "suppress_tokens": [5, 6, 7], "epsilon_cutoff": 0.03, "max_new_tokens": 9,
          "max_length": 50}
NOT_APPLIED = {}  # what transformers is told to leave out as we do (max_new_tokens is given: max_length does nothing)


def copied_with(source, path, changes: dict):
    """A copy of the model at `source` whose generation_config.json has `changes` on top of its own."""
    shutil.copytree(source, path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **changes}))
    return path


@pytest.fixture(scope="module")
def configured_dir(default_dir, tmp_path_factory):
    return copied_with(default_dir, tmp_path_factory.mktemp("defaults") / "model", CONFIG)


@pytest.fixture(scope="module")
def configured(configured_dir):
    return Engine.load(configured_dir)


def test_the_defaults_are_read_from_what_the_file_sets(configured, engine):
    assert configured.generation_defaults.describe() == {
        "strategy": "sample", "max_new_tokens": 9,
        "processors": [{"name": "repetition_penalty", "options": {"penalty": 1.3}},
                       {"name": "no_repeat_ngram", "options": {"ngram_size": 2}},
                       {"name": "suppress_tokens", "options": {"token_ids": [5, 6, 7]}}],
        "sampling_processors": [{"name": "temperature", "options": {"temperature": 0.7}},
                                {"name": "top_k", "options": {"k": 20}}, {"name": "top_p", "options": {"p": 0.8}},
                                {"name": "epsilon_cutoff", "options": {"epsilon": 0.03}}],
        "stop": [], "not_applied": ["max_length"]}
    assert engine.generation_defaults.describe() == {"strategy": "greedy", "max_new_tokens": 16, "processors": [],
                                                      "sampling_processors": [], "stop": [], "not_applied": []}


@pytest.mark.parametrize("seed", [3, 11])
def test_a_call_that_says_nothing_is_transformers_generate_on_the_same_directory(configured, seed):
    prompt = tokens(12, seed=80 + seed)
    with configured.session() as session:
        ours = session.generate(token_ids=prompt, seed=seed, eos_token_ids=[])
    torch.manual_seed(seed)
    with torch.inference_mode():
        theirs = configured.model.generate(torch.tensor([prompt]), eos_token_id=None, pad_token_id=0, **NOT_APPLIED)
    assert ours.token_ids == theirs[0, len(prompt):].tolist() and len(ours.token_ids) == 9


def test_greedy_keeps_the_models_processors_and_given_ones_replace_them(configured, engine):
    prompt = tokens(12, seed=90) * 2  # repeated: the penalty and the n-gram ban bite
    with torch.inference_mode():
        theirs = configured.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=None,
                                           pad_token_id=0, **NOT_APPLIED)
    with configured.session() as session:
        greedy = session.generate(token_ids=prompt, strategy="greedy", max_new_tokens=12, eos_token_ids=[])
        bare = session.generate(token_ids=prompt, strategy="greedy", processors=[], max_new_tokens=12, eos_token_ids=[])
    with engine.session() as plain:  # the same weights, with no generation config
        expected_bare = plain.generate(token_ids=prompt, max_new_tokens=12, eos_token_ids=[]).token_ids
    assert greedy.token_ids == theirs[0, len(prompt):].tolist()
    assert bare.token_ids == expected_bare != greedy.token_ids


GREEDY_CONFIG = {"bad_words_ids": [[464], [7, 8]], "min_length": 20, "begin_suppress_tokens": [562],
                 "sequence_bias": [[[100], 2.0]], "forced_bos_token_id": 9, "suppress_tokens": [],
                 "stop_strings": 5}


@pytest.fixture(scope="module")
def greedy_dir(default_dir, tmp_path_factory):
    return copied_with(default_dir, tmp_path_factory.mktemp("greedy") / "model", GREEDY_CONFIG)


@pytest.fixture(scope="module")
def greedy(greedy_dir):
    return Engine.load(greedy_dir)


@pytest.mark.parametrize("eos", [None, []], ids=["the model's end tokens", "none"])
def test_the_models_token_processors_are_transformers_greedy_with_and_without_end_tokens(greedy, eos):
    """Bad words apply without end tokens as in transformers (they were dropped); min_length and min_new_tokens
    need them. An empty suppress list is no processor and not 'not applied'; stop_strings that are no list are."""
    loaded = greedy
    described = loaded.generation_defaults.describe()
    assert [p["name"] for p in described["processors"]] == ["sequence_bias", "no_bad_words", "min_length", "forced_bos",
                                                             "suppress_tokens_at_begin"]
    assert described["not_applied"] == ["stop_strings"] and described["stop"] == []
    prompt = list(range(10, 22))
    with loaded.session() as session:
        ours = session.generate(token_ids=prompt, max_new_tokens=8, eos_token_ids=eos).token_ids
    told = {} if eos is None else {"eos_token_id": None}
    with torch.inference_mode():
        theirs = loaded.model.generate(torch.tensor([prompt]), max_new_tokens=8, pad_token_id=0, stop_strings=None, **told)
    assert ours == theirs[0, len(prompt):].tolist()
    assert 464 not in ours


def test_after_a_forced_bos_on_a_one_token_prompt_the_beginning_is_suppressed_one_token_later(engine):
    """(helper-90) transformers suppresses `begin_suppress_tokens` one step later when a one-token prompt is followed
    by a forced BOS (its `_get_logits_processor`): at the forced step they were suppressed here, which did nothing
    (or, suppressing the forced token itself, left no token at all)."""
    prompt, forced = [500], 7

    def theirs(**fields):
        with torch.inference_mode():
            out = engine.model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, pad_token_id=0,
                                        eos_token_id=None, forced_bos_token_id=forced, **fields)
        return out[0, 1:].tolist()

    second = theirs()[1]  # what follows the forced token unless suppressed
    for suppressed in ([second], [forced]):
        config = {"forced_bos_token_id": forced, "begin_suppress_tokens": suppressed}
        with engine.session() as session:
            ours = session.generate(token_ids=prompt, max_new_tokens=4, eos_token_ids=[], generation_config=config)
        assert ours.token_ids == theirs(begin_suppress_tokens=suppressed)
        assert ours.token_ids[0] == forced and ours.token_ids[1] not in suppressed
    with engine.session() as session:  # a longer prompt: no token is forced, and the first is suppressed
        two = session.generate(token_ids=prompt * 2, max_new_tokens=2, eos_token_ids=[],
                               generation_config={"forced_bos_token_id": forced, "begin_suppress_tokens": [second]})
    with torch.inference_mode():
        expected = engine.model.generate(torch.tensor([prompt * 2]), max_new_tokens=2, do_sample=False, pad_token_id=0,
                                         eos_token_id=None, forced_bos_token_id=forced, begin_suppress_tokens=[second])
    assert two.token_ids == expected[0, 2:].tolist()


def test_min_new_tokens_replaces_min_length_as_in_transformers():
    from sidecar import generation_defaults

    both = generation_defaults.of(GenerationConfig(min_length=20, min_new_tokens=3), 1024).describe()["processors"]
    assert both == [{"name": "min_new_tokens", "options": {"min_new_tokens": 3}}]


def test_over_the_protocol_the_model_info_shows_them_a_bare_generate_takes_them_and_the_limits_bound_them(
        configured, configured_dir, greedy_dir, tmp_path):
    """A model's max_new_tokens, stop strings or processors past a limit are refused for a call that leaves them
    out, as a client's would be; and an end token that is no id is named as one, not blamed on the model's
    processors."""
    prompt = tokens(12, seed=95)
    with configured.session() as session:
        expected = session.generate(token_ids=prompt, max_new_tokens=8, seed=5, eos_token_ids=[]).token_ids
    stops = copied_with(greedy_dir, tmp_path / "stops", {"stop_strings": ["x" * 100] * 50})
    with Peer([sys.executable, "-m", "sidecar", "--log-level", "ERROR", "--model", str(configured_dir),
               "--max-new-tokens", "8", "--model-root", str(tmp_path)], stderr=subprocess.DEVNULL) as peer:
        info = peer.call("models")["result"]["models"][0]
        assert info["generation_defaults"] == configured.generation_defaults.describe()
        session = peer.call("open_session")["result"]["session"]
        reply = peer.call("generate", session=session, token_ids=prompt, max_new_tokens=8, seed=5, eos_token_ids=[])
        assert reply["result"]["token_ids"] == expected, reply
        over = peer.call("generate", session=session, prompt="x")
        assert over["error"]["code"] == "limit_exceeded" and (over["error"]["limit"], over["error"]["value"]) == (
            "max_new_tokens", 9), over  # the model's 9, over this server's limit
        assert peer.call("load_model", name="stops", path=str(stops))["ok"]
        session = peer.call("open_session", model="stops")["result"]["session"]
        over = peer.call("generate", session=session, prompt="x")
        assert (over["error"]["code"], over["error"]["limit"]) == ("limit_exceeded", "max_stop_bytes"), over
        assert peer.call("generate", session=session, prompt="x", stop=[], max_new_tokens=2)["ok"]
        bad_end = peer.call("generate", session=session, prompt="x", stop=[], eos_token_ids=[2**64 - 1])
        assert bad_end["error"]["code"] == "token_out_of_range", bad_end


def test_values_read_as_vllm_and_transformers_read_them():
    """(helper-74) A max_new_tokens of true was taken as 1 and refused every call; a temperature of 0 with do_sample
    sampled at 1 (vLLM: greedy; transformers refuses it); one id past the vocabulary dropped a whole suppress list,
    where transformers passes over that id."""
    from sidecar import generation_defaults

    read = generation_defaults.of(GenerationConfig(max_new_tokens=True, suppress_tokens=[436, 5000],
                                                   bad_words_ids=[[5], [7, 5000]]), 1024).describe()
    assert read["max_new_tokens"] == 16 and read["not_applied"] == ["max_new_tokens"]
    assert read["processors"] == [{"name": "no_bad_words", "options": {"bad_words_ids": [[5]]}},
                                  {"name": "suppress_tokens", "options": {"token_ids": [436]}}]
    zero = generation_defaults.of(GenerationConfig(do_sample=True, temperature=0.0, top_p=0.9), 1024).describe()
    assert (zero["strategy"], zero["sampling_processors"], zero["not_applied"]) == ("greedy", [], [])


def test_min_new_tokens_of_0_replaces_min_length_too_and_temperature_0_checks_the_sampling_fields(greedy, engine):
    """(helper-77) transformers replaces min_length by any min_new_tokens, 0 included (the prompt's length then
    bounds nothing): 0 kept the model's min_length (40 tokens where transformers gives 1); a min_new_tokens of true,
    refused, hid min_length; a call's temperature 0 (greedy) skipped the checks of its other sampling fields."""
    from sidecar import generation_defaults

    prompt = list(range(10, 22))
    with greedy.session() as session:  # the model's min_length is 20: 8 tokens at least
        ours = session.generate(token_ids=prompt, max_new_tokens=12, generation_config={"min_new_tokens": 0}).token_ids
    with torch.inference_mode():
        theirs = greedy.model.generate(torch.tensor([prompt]), max_new_tokens=12, pad_token_id=0, stop_strings=None,
                                       min_new_tokens=0)
    assert ours == theirs[0, len(prompt):].tolist()
    odd = generation_defaults.of(GenerationConfig(min_length=30, min_new_tokens=True), 1024).describe()
    assert odd["processors"] == [{"name": "min_length", "options": {"min_length": 30}}]
    with engine.session() as session:
        with pytest.raises(errors.InvalidArgument, match="generation_config.top_p"):
            session.generate(prompt="x", generation_config={"temperature": 0, "top_p": 1.5})


def test_sampling_with_a_config_whose_temperature_is_0_is_refused_as_transformers_refuses_it(default_dir, tmp_path):
    """(helper-77) A model's temperature 0 with do_sample is greedy; a call asking for strategy 'sample' sampled at
    temperature 1 among every token, its own top_k dropped with the model's."""
    cold = Engine.load(copied_with(default_dir, tmp_path / "cold", {"do_sample": True, "temperature": 0.0, "top_k": 20}))
    with cold.session() as session:
        assert session.generate(prompt="x", max_new_tokens=2).token_ids == session.generate(
            prompt="x", strategy="greedy", processors=[], max_new_tokens=2).token_ids
        for changes in (None, {"top_k": 5}):
            with pytest.raises(errors.InvalidArgument, match="temperature is 0, which is greedy decoding") as refused:
                session.generate(prompt="x", strategy="sample", generation_config=changes)
            assert refused.value.details["option"] == "strategy"
        sampled = session.generate(prompt="x", strategy="sample", seed=1, max_new_tokens=3,
                                   generation_config={"temperature": 0.8})
        assert len(sampled.token_ids) == 3
        assert session.generate(prompt="x", strategy="sample", processors=[], max_new_tokens=1).finish_reason


def test_the_models_max_new_tokens_stops_where_the_context_ends(engine, monkeypatch):
    """As vLLM's default max_tokens: a model's 4096 new tokens on a 2048-token context refused every call."""
    import dataclasses

    monkeypatch.setattr(engine, "generation_defaults", dataclasses.replace(engine.generation_defaults, max_new_tokens=4096))
    prompt = tokens(engine.max_context - 5, seed=97)
    with engine.session() as session:
        assert len(session.generate(token_ids=prompt, eos_token_ids=[]).token_ids) == 5
        with pytest.raises(errors.ContextOverflow):
            session.generate(token_ids=prompt, max_new_tokens=6)


@pytest.mark.parametrize("changes", [{"temperature": 1.3, "top_p": 0.95}, {"do_sample": False},
                                     {"top_k": 0, "top_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.01},
                                     {"repetition_penalty": 1.0, "top_k": 0, "suppress_tokens": [9], "max_new_tokens": 6},
                                     {"top_h": 0.5, "top_k": 0, "temperature": 1.5}],
                         ids=["sampling", "greedy", "eta", "off and on", "top_h"])
def test_a_call_changes_fields_of_the_models_config_as_transformers_generate_kwargs_do(configured, changes):
    """The fields a call's generation_config names change; the model's others stay (its top_k, penalty, n-gram ban),
    as `model.generate(temperature=1.3)` keeps them; a neutral value (penalty 1.0, top_k 0) turns one off."""
    prompt = tokens(12, seed=101) * 2
    with configured.session() as session:
        ours = session.generate(token_ids=prompt, seed=4, eos_token_ids=[], generation_config=changes).token_ids
    torch.manual_seed(4)
    with torch.inference_mode():
        theirs = configured.model.generate(torch.tensor([prompt]), eos_token_id=None, pad_token_id=0, **NOT_APPLIED,
                                           **changes)
    assert ours == theirs[0, len(prompt):].tolist() and len(ours) == changes.get("max_new_tokens", 9)
    with configured.session() as session:  # a GenerationConfig object sets its fields, the others the model's
        from_object = session.generate(token_ids=prompt, seed=4, eos_token_ids=[],
                                       generation_config=GenerationConfig(**changes)).token_ids
    torch.manual_seed(4)
    with torch.inference_mode():
        theirs = configured.model.generate(torch.tensor([prompt]), eos_token_id=None, pad_token_id=0, **NOT_APPLIED,
                                           generation_config=GenerationConfig(**changes))
    assert from_object == ours == theirs[0, len(prompt):].tolist()
    with configured.session() as session:  # what such objects carry besides (pad and end tokens, use_cache)
        carried = GenerationConfig(**changes, pad_token_id=0, use_cache=True, eos_token_id=[2], num_return_sequences=1)
        assert session.generate(token_ids=prompt, seed=4, eos_token_ids=[], generation_config=carried).token_ids == ours
        bare = session.generate(token_ids=prompt, seed=4, eos_token_ids=[]).token_ids
        assert session.generate(token_ids=prompt, seed=4, eos_token_ids=[],
                                generation_config=configured.model.generation_config).token_ids == bare
    assert configured.generation_defaults.describe()["sampling_processors"][0]["options"]["temperature"] == 0.7


@pytest.mark.parametrize("changes, says", [
    ({"guidance_scale": 1.5}, "no field 'guidance_scale'"), ({"top_k": None}, "generation_config.top_k is nil"),
    ({"top_p": 1.5}, "generation_config.top_p"), ({"suppress_tokens": [5000]}, "generation_config.suppress_tokens"),
    ({"do_sample": 1}, "do_sample must be true or false"), ({"stop_strings": [""]}, "generation_config.stop_strings"),
    ({"max_new_tokens": -1}, "generation_config.max_new_tokens"), ({"min_new_tokens": "3"}, "min_new_tokens"),
    ([("top_k", 5)], "must be a map"), ({"temperature": True}, "temperature is true, which is no number"),
    ({"top_k": False}, "top_k is false"), ({"pad_token_id": 0}, "says nothing about the tokens generated here"),
    ({"num_beams": 3}, "strategy='beam' with num_beams"), ({"eos_token_id": 5}, "as eos_token_ids"),
    (GenerationConfig(max_length=30), "give max_new_tokens"),
])
def test_a_change_the_engine_would_not_apply_is_refused_naming_the_field(configured, changes, says):
    with configured.session() as session:
        session.generate(token_ids=tokens(6, seed=102), max_new_tokens=2)
        history = list(session.history)
        with pytest.raises(errors.InvalidArgument, match=says) as refused:
            session.generate(token_ids=tokens(6, seed=103), generation_config=changes)
        assert refused.value.details["option"] == "generation_config" and session.history == history
        named = refused.value.details.get("field")  # the field, where there is one to name (a map is none)
        fields = changes if isinstance(changes, dict) else {"max_length": 30} if isinstance(changes, GenerationConfig) else {}
        assert named == next((str(field) for field in fields), None), refused.value.details


def test_a_calls_config_refused_with_the_strategy_it_gives_and_its_max_new_tokens_its_own(configured):
    """(helper-75) Temperature 0 with strategy 'sample' sampled at 1 among every token (transformers refuses it);
    a call's stop strings with beams were dropped (its `stop` is refused); a call's max_new_tokens was cut to the
    context as the model's is, where its own option is refused."""
    with configured.session() as session:
        with pytest.raises(errors.InvalidArgument, match="temperature is 0, which is greedy decoding, and strategy is 'sample'"):
            session.generate(prompt="x", strategy="sample", generation_config={"temperature": 0})
        with pytest.raises(errors.InvalidArgument, match="stop_strings do not go with strategy 'beam'"):
            session.generate(prompt="x", strategy="beam", generation_config={"stop_strings": ["ab"]})
        with pytest.raises(errors.ContextOverflow):
            session.generate(token_ids=tokens(configured.max_context - 5, seed=106), generation_config={"max_new_tokens": 6})
        assert session.history == []


def test_a_field_that_makes_a_processor_is_refused_beside_processors_given(configured):
    with configured.session() as session:
        with pytest.raises(errors.InvalidArgument, match=r"changed by generation_config=\{'top_p': \.\.\.\}"):
            session.generate(prompt="x", top_p=0.5)  # as transformers' generate takes it
        with pytest.raises(errors.InvalidArgument, match="generation_config.temperature makes a processor"):
            session.generate(prompt="x", processors=[], generation_config={"temperature": 0.5})
        strategy_only = session.generate(token_ids=tokens(6, seed=104), processors=[], eos_token_ids=[],
                                         generation_config={"do_sample": False, "max_new_tokens": 3, "top_k": 0,
                                                            "repetition_penalty": 1.0})  # (helper-81) neutral: none made
        assert len(strategy_only.token_ids) == 3


def test_over_the_protocol_a_change_is_the_python_call_and_counts_against_the_limits(configured, configured_dir):
    prompt = tokens(12, seed=105)
    changes = {"top_k": 3, "repetition_penalty": 1.6}
    with configured.session() as session:
        expected = session.generate(token_ids=prompt, seed=6, eos_token_ids=[], generation_config=changes).token_ids
        greedy_expected = session.generate(token_ids=prompt, strategy="greedy", eos_token_ids=[]).token_ids
    with Peer([sys.executable, "-m", "sidecar", "--log-level", "ERROR", "--model", str(configured_dir),
               "--max-stop-bytes", "64"], stderr=subprocess.DEVNULL) as peer:
        session = peer.call("open_session")["result"]["session"]
        reply = peer.call("generate", session=session, token_ids=prompt, seed=6, eos_token_ids=[],
                          generation_config=changes)
        assert reply["result"]["token_ids"] == expected, reply
        over = peer.call("generate", session=session, prompt="x", generation_config={"stop_strings": ["x" * 65]})
        assert (over["error"]["code"], over["error"]["limit"]) == ("limit_exceeded", "max_stop_bytes"), over
        both = peer.call("generate", session=session, prompt="x", processors=[], generation_config={"top_k": 2})
        assert (both["error"]["code"], both["error"]["option"]) == ("invalid_argument", "generation_config"), both
        many = peer.call("generate", session=session, prompt="x", generation_config={"suppress_tokens": [1] * 65_537})
        assert (many["error"]["limit"], many["error"]["value"], many["error"]["param"]) == (
            "max_processor_values", 65_537, "generation_config"), many
        unknown = peer.call("generate", session=session, prompt="x", generation_config={7: 1})
        assert unknown["error"]["code"] == "invalid_argument" and "no field '7'" in unknown["error"]["message"], unknown
        assert peer.call("generate", session=session, token_ids=prompt, seed=6, eos_token_ids=[],
                         generation_config=changes)["result"]["token_ids"] == expected
        # (helper-75) temperature 0 is greedy over the protocol too: the engine, given the config less the fields
        # whose processors the server made, read the model's do_sample
        greedy = peer.call("generate", session=session, token_ids=prompt, seed=6, eos_token_ids=[],
                           generation_config={"temperature": 0})
        assert greedy["result"]["token_ids"] == greedy_expected, greedy
