import pytest
import torch

from processors import Context

VOCAB = 1000
BATCH = 4
LENGTH = 12
INPUT_LENGTH = 6


def make_logits(kind: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH, VOCAB, generator=g) * 3
    if kind == "ties":
        logits = torch.round(logits * 2) / 2
    elif kind == "neg_inf":
        logits[torch.rand(BATCH, VOCAB, generator=g) < 0.3] = float("-inf")
    return logits.to(dtype)


def make_sequence(seed: int = 1, vocab: int = 30) -> torch.Tensor:
    """Tokens from a small alphabet so that repeats and n-gram matches actually happen."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (BATCH, LENGTH), generator=g)


def padded_context(tokens: torch.Tensor, input_length: int = INPUT_LENGTH) -> Context:
    """Our processors get Bumblebee's preallocated layout: junk past `length` must be ignored."""
    junk = torch.full((tokens.shape[0], 5), VOCAB - 1)
    return Context(torch.cat([tokens, junk], dim=1), tokens.shape[1], input_length, VOCAB)


@pytest.fixture(params=[torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def dtype(request):
    return request.param


@pytest.fixture(params=["plain", "ties", "neg_inf"])
def kind(request):
    return request.param
