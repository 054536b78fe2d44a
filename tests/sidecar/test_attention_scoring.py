"""Models whose attention scores are not SDPA's: Gemma 2's soft-capping and GPT-OSS's sinks, on every path of
the engine's attention, against transformers' own eager attention over the same weights (the attention they
load with); and a model whose attention takes a keyword the engine does not run, refused at load. Both
models once loaded and ran with the capping or the sinks left out, and gave other tokens than transformers."""

import copy

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention

from sidecar import Engine
from sidecar.errors import InvalidModel

from .conftest import tokens
from .test_batching import drain

SHAPE = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=1024, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)


def gemma2():
    """Soft-capping at 0.5 (Gemma 2's own is 50): nearly every score is capped, so leaving it out shows."""
    return Gemma2ForCausalLM, Gemma2Config(**SHAPE, attn_logit_softcapping=0.5, final_logit_softcapping=None,
                                           query_pre_attn_scalar=16)


def gpt_oss():
    return GptOssForCausalLM, GptOssConfig(**SHAPE, num_local_experts=2, num_experts_per_tok=1,
                                           layer_types=["sliding_attention", "full_attention"])


@pytest.fixture(scope="module", params=[gemma2, gpt_oss], ids=["gemma2 softcap", "gpt-oss sinks"])
def pair(request, engine):
    """An engine over the model, and the same weights with transformers' eager attention, as the reference."""
    model_class, config = request.param()
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.mul_(3.0)  # weights less uniform: tokens that vary
        for layer in model.model.layers:
            if hasattr(layer.self_attn, "sinks"):
                layer.self_attn.sinks.normal_(0.0, 2.0)
    reference = model_class._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    reference.load_state_dict(model.state_dict())
    scored = Engine(model, engine.tokenizer)
    assert reference.config._attn_implementation == "eager"  # its own config: the engine switched the model's only
    return scored, reference


def greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_logits_and_greedy_tokens_equal_eager_attention_through_prefill_chunks_and_reuse(pair):
    engine, reference = pair
    seen = []
    prompt = tokens(300, seed=1)  # longer than a prefill chunk
    with engine.session() as session:
        first = session.generate(token_ids=prompt, max_new_tokens=6, eos_token_ids=[],
                                 processors=[lambda logits, context: (seen.append(logits.clone()), logits)[1]])
        longer = session.history + tokens(7, seed=2)
        second = session.generate(token_ids=longer, max_new_tokens=6, eos_token_ids=[])  # prefilled after what it holds
        assert second.stats.reused_tokens == len(prompt) + 5
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(seen[0][0], expected, atol=1e-4, rtol=1e-4)
    assert first.token_ids == greedy(reference, prompt, 6)
    assert second.token_ids == greedy(reference, longer, 6)
    assert greedy(engine.model, prompt, 6) == first.token_ids  # the model's own calls, without a plan


def test_sessions_decoding_together_equal_eager_attention(pair, group_sizes):
    engine, reference = pair
    prompts = [tokens(n, seed=10 + n) for n in (3, 11, 40, 90)]
    sessions = [engine.session() for _ in prompts]
    try:
        generations = [s.stream(token_ids=p, max_new_tokens=8, eos_token_ids=[]) for s, p in zip(sessions, prompts)]
        streamed = drain(generations, engine)
        assert 4 in group_sizes  # one attention call a layer for the four
        assert streamed == [greedy(reference, p, 8) for p in prompts]
    finally:
        for s in sessions:
            s.close()


def test_sessions_continuing_one_system_prompt_equal_eager_attention(pair, group_sizes):
    engine, reference = pair
    system = tokens(48, seed=20)
    prompts = [system + tokens(n, seed=21 + n) for n in (2, 5, 9)]
    host = engine.session()
    sessions = [engine.session() for _ in prompts]
    try:
        host.generate(token_ids=system + [5], max_new_tokens=1, eos_token_ids=[])
        generations = [s.stream(token_ids=p, max_new_tokens=8, eos_token_ids=[]) for s, p in zip(sessions, prompts)]
        streamed = drain(generations, engine)
        assert 3 in group_sizes and all(g.result.stats.shared_tokens == len(system) for g in generations)
        assert streamed == [greedy(reference, p, 8) for p in prompts]
    finally:
        for s in [host, *sessions]:
            s.close()


@pytest.mark.parametrize("length", [9, 400], ids=["prompt copied to each beam", "prompt shared by the beams"])
def test_beam_search_equals_eager_attention(pair, length):
    engine, reference = pair
    prompt = tokens(length, seed=30)
    case = dict(num_beams=3, max_new_tokens=6, num_return_sequences=3)
    theirs = reference.generate(torch.tensor([prompt]), do_sample=False, output_scores=True, return_dict_in_generate=True,
                                pad_token_id=0, eos_token_id=None, **case)
    with engine.session() as session:
        result = session.generate(token_ids=prompt, strategy="beam", eos_token_ids=[], **case)
    assert [s.token_ids for s in result.sequences] == [row[len(prompt):].tolist() for row in theirs.sequences]
    torch.testing.assert_close(torch.tensor([s.score for s in result.sequences]), theirs.sequences_scores, atol=1e-4, rtol=0)


@pytest.mark.parametrize("length", [12, 400], ids=["prompt copied to each row", "prompt shared by the rows"])
def test_n_samples_equal_eager_attention_sampling_with_the_same_seed(pair, length):
    engine, reference = pair
    prompt = tokens(length, seed=40)
    torch.manual_seed(5)
    theirs = reference.generate(torch.tensor([prompt]), do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                                num_return_sequences=4, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    with engine.session() as session:
        result = session.generate(token_ids=prompt, strategy="sample", num_samples=4, seed=5, max_new_tokens=8,
                                  eos_token_ids=[])
    assert [s.token_ids for s in result.sequences] == theirs[:, len(prompt):].tolist()


def test_a_model_whose_attention_takes_a_keyword_the_engine_does_not_run_is_refused_at_load(engine, monkeypatch):
    """DeepSeek V3.2's sparse attention passes the keys each query reads (`indices`), T5's a position bias:
    left out, the model would load and give other tokens, so it is refused, naming the keyword."""
    forward = LlamaAttention.forward

    def with_indices(self, *args, **kwargs):
        return forward(self, *args, indices=torch.zeros(1, dtype=torch.long), **kwargs)

    monkeypatch.setattr(LlamaAttention, "forward", with_indices)
    with pytest.raises(InvalidModel, match="LlamaForCausalLM's attention takes indices, which the batched engine's "
                                           "attention does not run"):
        Engine(engine.model, engine.tokenizer)
    monkeypatch.undo()
    with engine.session() as session:  # the model itself is as it was
        assert session.generate(token_ids=[5, 6, 7], max_new_tokens=3, eos_token_ids=[]).token_ids == greedy(
            engine.model, [5, 6, 7], 3)
