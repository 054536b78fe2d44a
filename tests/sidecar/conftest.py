import shutil

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from sidecar import Engine
from sidecar.default_model import materialise


@pytest.fixture(scope="session")
def default_dir(isolated_model_cache):
    return materialise()


@pytest.fixture(scope="session")
def engine(default_dir):
    return Engine.load()


@pytest.fixture(scope="session")
def gpt2_dir(default_dir, tmp_path_factory):
    """A GPT-2-style model (absolute positions) with the shipped tokenizer, saved as a local directory."""
    path = tmp_path_factory.mktemp("gpt2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_dir / name, path / name)
    torch.manual_seed(1)
    config = GPT2Config(vocab_size=1024, n_positions=256, n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2)
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def gpt2_engine(gpt2_dir):
    return Engine.load(gpt2_dir)


@pytest.fixture(params=["llama", "gpt2"])
def any_engine(request, engine, gpt2_engine):
    return {"llama": engine, "gpt2": gpt2_engine}[request.param]


def tokens(n: int, seed: int, low: int = 3, high: int = 1000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n,), generator=g).tolist()


_UNSHARED = {}


def unshared(engine: Engine) -> Engine:
    """An engine on `engine`'s model that shares no prefixes across sessions: its fresh sessions compute
    everything, so they are a cold reference even while the sessions under test hold the same prefix."""
    if id(engine) not in _UNSHARED:
        _UNSHARED[id(engine)] = (engine, Engine(engine.model, engine.tokenizer, share_prefixes=False))
    return _UNSHARED[id(engine)][1]
