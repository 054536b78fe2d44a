"""`as_hf_logits_processor` inside `model.generate`: same tokens as transformers' own processors."""

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation import logits_process as hf

import processors as P
from processors.hf import as_hf_logits_processor


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def generate(model, processors, **kwargs):
    prompt = torch.tensor([[1, 5, 9, 5, 9, 40], [1, 7, 7, 7, 3, 11]])
    config = GenerationConfig(max_new_tokens=20, pad_token_id=0, eos_token_id=2, **kwargs)
    with torch.no_grad():
        return model.generate(
            prompt, attention_mask=torch.ones_like(prompt), generation_config=config,
            logits_processor=hf.LogitsProcessorList(processors),
        )


OURS = [P.RepetitionPenalty(2.5), P.NoRepeatNGram(2), P.MinNewTokens(5, 2), P.SuppressTokens([0, 3])]


def theirs():
    return [
        hf.RepetitionPenaltyLogitsProcessor(2.5), hf.NoRepeatNGramLogitsProcessor(2),
        hf.MinNewTokensLengthLogitsProcessor(6, 5, 2), hf.SuppressTokensLogitsProcessor([0, 3]),
    ]


@pytest.mark.parametrize("num_beams", [1, 4])
def test_generate_matches_transformers_processors(model, num_beams):
    expected = generate(model, theirs(), do_sample=False, num_beams=num_beams)
    got = generate(model, [as_hf_logits_processor(OURS)], do_sample=False, num_beams=num_beams)
    plain = generate(model, [], do_sample=False, num_beams=num_beams)
    assert not torch.equal(expected, plain), "the processors must change the output for the test to mean anything"
    assert torch.equal(got, expected)


def test_adapter_restarts_for_a_new_generation(model):
    adapter = as_hf_logits_processor(OURS)
    first = generate(model, [adapter], do_sample=False, num_beams=4)
    second = generate(model, [adapter], do_sample=False, num_beams=4)
    assert torch.equal(first, second)


def test_a_call_that_continues_the_last_ones_output_starts_a_new_generation(model):
    """Its first step's rows extend the last step's by one token: by content alone it was taken for the
    last call's next step, its prompt counted as generated (penalised as such, input_length the old one)."""
    penalised = [P.FrequencyPenalty(2.0), P.MinNewTokens(5, 2)]
    adapter = as_hf_logits_processor(penalised)
    first = generate(model, [adapter], do_sample=False)
    config = GenerationConfig(max_new_tokens=20, pad_token_id=0, eos_token_id=2, do_sample=False)

    def continued(processors):
        with torch.no_grad():
            return model.generate(first, attention_mask=torch.ones_like(first), generation_config=config,
                                  logits_processor=hf.LogitsProcessorList(processors))

    assert torch.equal(continued([adapter]), continued([as_hf_logits_processor(penalised)]))
    reused = as_hf_logits_processor(OURS)
    generate(model, [reused], do_sample=False, num_beams=4)
    theirs_continued = [hf.RepetitionPenaltyLogitsProcessor(2.5), hf.NoRepeatNGramLogitsProcessor(2),
                        hf.MinNewTokensLengthLogitsProcessor(first.shape[1], 5, 2), hf.SuppressTokensLogitsProcessor([0, 3])]
    assert torch.equal(continued([reused]), continued(theirs_continued))
