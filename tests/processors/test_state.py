"""Stateful processors: incremental state equals a recount from scratch, over many steps and reorders."""

import torch
from transformers.generation import logits_process as hf

import processors as P

VOCAB = 50


def recount_reference(tokens, input_length, logits, frequency, presence):
    """OpenAI's formula computed directly from the generated tokens."""
    counts = torch.zeros(tokens.shape[0], VOCAB)
    for row in range(tokens.shape[0]):
        for token in tokens[row, input_length:].tolist():
            counts[row, token] += 1
    return logits - counts * frequency - (counts > 0).float() * presence


def run_steps(chain, steps=15, batch=3, prompt=5, seed=0):
    """A generation loop over a preallocated sequence, as the engine runs it; yields each step's output."""
    g = torch.Generator().manual_seed(seed)
    sequence = torch.zeros(batch, prompt + steps, dtype=torch.long)
    sequence[:, :prompt] = torch.randint(0, 10, (batch, prompt), generator=g)
    context = P.Context(sequence, prompt, prompt, VOCAB)
    states = chain.init(context)
    for step in range(steps):
        length = prompt + step
        context = P.Context(sequence, length, prompt, VOCAB)
        logits = torch.randn(batch, VOCAB, generator=g)
        states, out = chain.process(states, logits, context)
        yield sequence[:, :length].clone(), logits, out
        sequence[:, length] = torch.randint(0, 10, (batch,), generator=g)


def test_frequency_and_presence_equal_the_recount():
    chain = P.Chain([P.FrequencyPenalty(0.6), P.PresencePenalty(-0.4)])
    steps = list(run_steps(chain))
    assert any((out != logits).any() for _, logits, out in steps)
    for tokens, logits, out in steps:
        assert torch.allclose(out, recount_reference(tokens, 5, logits, 0.6, -0.4), atol=1e-6)


def test_repetition_penalty_state_equals_transformers_every_step():
    chain = P.Chain([P.RepetitionPenalty(1.7)])
    theirs = hf.RepetitionPenaltyLogitsProcessor(1.7)
    for tokens, logits, out in run_steps(chain):
        assert torch.equal(out, theirs(tokens, logits.clone()))


def test_state_structure_and_shapes_never_change():
    chain = P.Chain([P.RepetitionPenalty(1.2), P.FrequencyPenalty(0.5), P.TopK(5)])
    sequence = torch.zeros(2, 10, dtype=torch.long)
    context = P.Context(sequence, 3, 3, VOCAB)
    states = chain.init(context)
    shapes = lambda s: [(k, v.shape, v.dtype) for st in s if isinstance(st, dict) for k, v in st.items()]
    first = shapes(states)
    for length in range(3, 9):
        sequence[:, length] = length
        states, _ = chain.process(states, torch.randn(2, VOCAB), P.Context(sequence, length + 1, 3, VOCAB))
        assert shapes(states) == first


def test_reorder_equals_init_on_reordered_rows():
    chain = P.Chain([P.RepetitionPenalty(1.2), P.FrequencyPenalty(0.5), P.Temperature(2.0)])
    g = torch.Generator().manual_seed(3)
    sequence = torch.randint(0, VOCAB, (4, 12), generator=g)
    context = P.Context(sequence, 12, 6, VOCAB)
    index = torch.tensor([2, 2, 0, 3])
    reordered = chain.reorder(chain.init(context), index)
    fresh = chain.init(P.Context(sequence[index], 12, 6, VOCAB))
    for mine, ref in zip(reordered, fresh):
        if isinstance(ref, dict):
            assert all(torch.equal(mine[k], ref[k]) for k in ref)
    assert chain.reorder(chain.init(context), torch.tensor([1]))[0]["tally"].shape == (1, VOCAB)


def test_plain_callables_are_stateless_processors():
    chain = P.Chain([lambda logits, context: logits * 2, P.Temperature(2.0)])
    context = P.Context(torch.zeros(1, 1, dtype=torch.long), 1, 1, 4)
    states = chain.init(context)
    assert states == ((), ())
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert torch.equal(chain.process(states, logits, context)[1], logits)
