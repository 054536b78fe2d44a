"""A call that leaves out strategy, processors or stop takes the model's generation config's, as transformers'
`generate` does (PROTOCOL.md, "Generation defaults"); one that gives them takes exactly those."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from protocol.peer import Peer
from sidecar import Engine

from .conftest import tokens

CONFIG = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.3,
          "no_repeat_ngram_size": 2, "suppress_tokens": [5, 6, 7], "epsilon_cutoff": 0.0003, "max_new_tokens": 9}
NOT_APPLIED = {"epsilon_cutoff": 0.0}  # what transformers is told to leave out as we do


@pytest.fixture(scope="module")
def configured_dir(default_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("defaults") / "model"
    shutil.copytree(default_dir, path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **CONFIG}))
    return path


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
                                {"name": "top_k", "options": {"k": 20}}, {"name": "top_p", "options": {"p": 0.8}}],
        "stop": [], "not_applied": ["epsilon_cutoff"]}
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


def test_over_the_protocol_the_model_info_shows_them_and_a_bare_generate_takes_them(configured, configured_dir):
    prompt = tokens(12, seed=95)
    with configured.session() as session:
        expected = session.generate(token_ids=prompt, max_new_tokens=8, seed=5, eos_token_ids=[]).token_ids
    with Peer([sys.executable, "-m", "sidecar", "--log-level", "ERROR", "--model", str(configured_dir),
               "--max-new-tokens", "8"], stderr=subprocess.DEVNULL) as peer:
        info = peer.call("models")["result"]["models"][0]
        assert info["generation_defaults"] == configured.generation_defaults.describe()
        over = peer.call("generate", session=peer.call("open_session")["result"]["session"], prompt="x")
        assert over["error"]["code"] == "limit_exceeded" and (over["error"]["limit"], over["error"]["value"]) == (
            "max_new_tokens", 9), over  # the model's 9, over this server's limit
        session = peer.call("open_session")["result"]["session"]
        reply = peer.call("generate", session=session, token_ids=prompt, max_new_tokens=8, seed=5, eos_token_ids=[])
        assert reply["result"]["token_ids"] == expected, reply
