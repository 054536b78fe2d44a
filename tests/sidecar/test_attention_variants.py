"""Attention that is not plain causal SDPA: sliding windows (Mistral, Qwen2's upper layers, the local layers
of Gemma 2 and GPT-OSS), Gemma 2's soft-capping and GPT-OSS's sinks, on every path of the engine's attention
(prefill chunks, prefixes reused and shared in place, decode rows, decode groups), against transformers' own
attention over the same weights, with its own cache; models whose layers hand their attention fewer keywords
(Nemotron, StableLM) or more (GOT-OCR2) than the engine's; and a model whose attention takes a keyword the engine
does not run, refused at load. Each of these models once gave other tokens than transformers, or (windows)
had its context cut to the window."""

import copy
import re

import pytest
import torch
from transformers import (AfmoeConfig, AfmoeForCausalLM, BlenderbotConfig, BlenderbotForCausalLM, DeepseekV3Config,
                          DeepseekV3ForCausalLM, DiffLlamaConfig, DiffLlamaForCausalLM, GotOcr2Config,
                          GotOcr2ForConditionalGeneration, Gemma2Config, Gemma2ForCausalLM,
                          LlamaConfig, LlamaForCausalLM, MoshiConfig, MusicgenDecoderConfig, MusicgenForCausalLM, NemotronConfig, NemotronForCausalLM, MoshiForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig,
                          GptOssForCausalLM, Llama4ForCausalLM, Llama4TextConfig, MistralConfig, MistralForCausalLM,
                          PhimoeConfig, PhimoeForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, StableLmConfig, StableLmForCausalLM)
from transformers.models.llama.modeling_llama import LlamaAttention

from sidecar import Engine
from sidecar.errors import InvalidModel, TokenOutOfRange
from sidecar.models import max_context

from .conftest import tokens
from .test_batching import drain

SHAPE = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
ALTERNATING = ["sliding_attention", "full_attention"]
MLA = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
           first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MODELS = {  # what transformers loads each with: SDPA, or eager where SDPA cannot run its scores
    "mistral, window 24": (MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=24), "sdpa"),
    "mistral, window 64": (MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=64), "sdpa"),
    "qwen2, window 24 on its upper layer": (Qwen2ForCausalLM, Qwen2Config(**SHAPE, use_sliding_window=True,
                                                                          sliding_window=24, max_window_layers=1), "sdpa"),
    # these two apply their windows through transformers' mask alone, not a keyword of the attention call
    "qwen2-moe, window 24 on its upper layer": (Qwen2MoeForCausalLM, Qwen2MoeConfig(
        **SHAPE, use_sliding_window=True, sliding_window=24, max_window_layers=1, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, num_experts=2, num_experts_per_tok=1), "sdpa"),
    "phimoe, window 24": (PhimoeForCausalLM, PhimoeConfig(**SHAPE, sliding_window=24, num_local_experts=2,
                                                          num_experts_per_tok=1), "sdpa"),
    # soft-capping at 0.5 (Gemma 2's own is 50): nearly every score is capped, so leaving it out shows
    "gemma2, softcap, window 24": (Gemma2ForCausalLM, Gemma2Config(**SHAPE, sliding_window=24, attn_logit_softcapping=0.5,
                                                                   final_logit_softcapping=None, query_pre_attn_scalar=16),
                                   "eager"),
    "gemma3, window 24": (Gemma3ForCausalLM, Gemma3TextConfig(**SHAPE, sliding_window=24, layer_types=ALTERNATING,
                                                              query_pre_attn_scalar=16), "sdpa"),
    "gpt-oss, sinks, window 24": (GptOssForCausalLM, GptOssConfig(**SHAPE, sliding_window=24, num_local_experts=2,
                                                                  num_experts_per_tok=1, layer_types=ALTERNATING), "eager"),
    # multi-head latent attention: keys of 24 dimensions (16 + 8 rotated), values of 16
    "deepseek-v3, values narrower than keys": (DeepseekV3ForCausalLM, DeepseekV3Config(**MLA), "sdpa"),
    # its decoder layer hands the attention only the arguments it names: the plan is not a keyword of the call
    "nemotron, a layer that drops the call's keywords": (NemotronForCausalLM, NemotronConfig(**SHAPE), "sdpa"),
    "stablelm, a layer that drops the call's keywords": (StableLmForCausalLM, StableLmConfig(**SHAPE), "sdpa"),
}


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request, engine):
    """An engine over the model (prefill chunks of 64 tokens), and the same weights in transformers' own
    attention, as the reference."""
    model_class, config, implementation = MODELS[request.param]
    torch.manual_seed(0)
    model = model_class(copy.deepcopy(config)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.mul_(3.0)  # weights less uniform: tokens that vary
        for layer in model.model.layers:
            if hasattr(layer.self_attn, "sinks"):
                layer.self_attn.sinks.normal_(0.0, 2.0)
    reference = model_class._from_config(copy.deepcopy(config), attn_implementation=implementation).eval()
    reference.load_state_dict(model.state_dict())
    varied = Engine(model, engine.tokenizer, prefill_chunk=64)
    assert reference.config._attn_implementation == implementation  # its own config: the engine switched the model's
    assert varied.max_context == max_context(config) >= 1024  # a window no longer cuts the context (gpt-oss: YaRN's)
    return varied, reference


def greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_logits_and_greedy_tokens_equal_transformers_through_prefill_chunks_and_reuse(pair):
    engine, reference = pair
    seen = []
    prompt = tokens(150, seed=1)  # three prefill chunks, each past the window
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


def test_sessions_decoding_together_equal_transformers(pair, group_sizes):
    """Five sessions decode as a group; a sixth joins while they do, its prefill in their passes."""
    engine, reference = pair
    prompts = [tokens(n, seed=10 + n) for n in (3, 11, 20, 40, 90, 100)]  # within the window, past it, far past it
    sessions = [engine.session() for _ in prompts]
    try:
        generations = [s.stream(token_ids=p, max_new_tokens=16, eos_token_ids=[]) for s, p in zip(sessions[:5], prompts)]
        while not group_sizes:
            engine.scheduler.tick()
        generations.append(sessions[5].stream(token_ids=prompts[5], max_new_tokens=16, eos_token_ids=[]))
        streamed = drain(generations, engine)
        assert group_sizes[0] == 5  # one attention call a layer for the five
        assert [g.result.token_ids for g in generations] == [greedy(reference, p, 16) for p in prompts]
        assert all(len(s) == 16 for s in streamed[:5])
    finally:
        for s in sessions:
            s.close()


def test_sessions_continuing_one_system_prompt_equal_transformers(pair, group_sizes):
    """The window of a member starts in the shared prefix, or past it, and (window 64) before it."""
    engine, reference = pair
    system = tokens(40, seed=20)
    prompts = [system + tokens(n, seed=21 + n) for n in (1, 5, 12, 20)]
    host = engine.session()
    sessions = [engine.session() for _ in prompts]
    try:
        host.generate(token_ids=system + [5], max_new_tokens=1, eos_token_ids=[])
        generations = [s.stream(token_ids=p, max_new_tokens=12, eos_token_ids=[]) for s, p in zip(sessions, prompts)]
        streamed = drain(generations, engine)
        assert 4 in group_sizes and all(g.result.stats.shared_tokens == len(system) for g in generations)
        assert streamed == [greedy(reference, p, 12) for p in prompts]
    finally:
        for s in [host, *sessions]:
            s.close()


@pytest.mark.parametrize("length", [9, 400], ids=["prompt copied to each beam", "prompt shared by the beams"])
def test_beam_search_equals_transformers(pair, length):
    engine, reference = pair
    prompt = tokens(length, seed=30)
    case = dict(num_beams=3, max_new_tokens=20, num_return_sequences=3)
    theirs = reference.generate(torch.tensor([prompt]), do_sample=False, output_scores=True, return_dict_in_generate=True,
                                pad_token_id=0, eos_token_id=None, **case)
    with engine.session() as session:
        result = session.generate(token_ids=prompt, strategy="beam", eos_token_ids=[], **case)
    assert [s.token_ids for s in result.sequences] == [row[len(prompt):].tolist() for row in theirs.sequences]
    torch.testing.assert_close(torch.tensor([s.score for s in result.sequences]), theirs.sequences_scores, atol=1e-4, rtol=0)


@pytest.mark.parametrize("length", [12, 400], ids=["prompt copied to each row", "prompt shared by the rows"])
def test_n_samples_equal_transformers_sampling_with_the_same_seed(pair, length):
    engine, reference = pair
    prompt = tokens(length, seed=40)
    torch.manual_seed(5)
    theirs = reference.generate(torch.tensor([prompt]), do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                                num_return_sequences=4, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    with engine.session() as session:
        result = session.generate(token_ids=prompt, strategy="sample", num_samples=4, seed=5, max_new_tokens=20,
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


@pytest.mark.parametrize("model, refusal", [
    (lambda: Gemma3ForCausalLM(Gemma3TextConfig(**SHAPE, use_bidirectional_attention=True)),
     "Gemma3ForCausalLM's attention takes is_causal, which"),
    (lambda: Llama4ForCausalLM(Llama4TextConfig(**SHAPE, attention_chunk_size=16, intermediate_size_mlp=128,
                                                num_local_experts=2)),
     "Llama4ForCausalLM has layers of chunked_attention, which"),
], ids=["bidirectional (an embedding model)", "chunked (Llama 4)"])
def test_a_model_whose_attention_masks_are_not_causal_windows_is_refused_at_load(engine, model, refusal):
    """Their masks are made by transformers and passed in, which the engine's attention does not read. The
    model refused keeps its own attention (it was left on the engine's, which its own calls then took)."""
    model = model().eval()
    before = model.config._attn_implementation
    with pytest.raises(InvalidModel, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        Engine(model, engine.tokenizer)
    assert model.config._attn_implementation == before != "sidecar_rows"


@pytest.mark.parametrize("model, refusal", [
    # its attention is called twice a layer, with two halves of its values: the cache kept the second
    (lambda: DiffLlamaForCausalLM(DiffLlamaConfig(**SHAPE)), "DiffLlamaForCausalLM computes other logits in the batched engine"),
    # its learned positions count from transformers' cache, which the engine does not use
    (lambda: BlenderbotForCausalLM(BlenderbotConfig(vocab_size=1024, d_model=64, decoder_layers=2, decoder_attention_heads=4,
                                                    decoder_ffn_dim=128, max_position_embeddings=1024, pad_token_id=0)),
     "BlenderbotForCausalLM computes other logits in the batched engine"),
    # multi-head latent attention with fewer key/value heads than heads: its keys come expanded to every head,
    # so the repetition of a masked pass doubles them (transformers' own masked SDPA fails alike)
    (lambda: DeepseekV3ForCausalLM(DeepseekV3Config(**{**MLA, "num_key_value_heads": 2})),
     "DeepseekV3ForCausalLM cannot run in the batched engine: its forward pass failed with RuntimeError"),
], ids=["diffllama", "blenderbot", "deepseek-v3 with grouped heads"])
def test_a_model_the_engine_would_compute_otherwise_is_refused_at_load(engine, model, refusal):
    """Found from outside (a sweep of 75 architectures): DiffLlama and Blenderbot loaded and gave other tokens
    than transformers from the first or second on, silently; a DeepSeek model raised an untyped RuntimeError at
    its second prefill chunk. At load the engine's paths are checked against transformers' own forward pass."""
    torch.manual_seed(0)
    model = model().eval()
    model.train()
    with pytest.raises(InvalidModel, match=refusal):
        Engine(model, engine.tokenizer)
    assert model.config._attn_implementation != "sidecar_rows" and model.training  # given back as it came


def _attention_outside_its_layers():
    """A Llama whose second layer's attention has no layer index, as Inkling2's block-attention residual (an
    attention call beside the layers) has none: with the plan a context of the whole pass, that call got it."""
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    del model.model.layers[1].self_attn.layer_idx
    return model


@pytest.mark.parametrize("model, refusal", [
    (_attention_outside_its_layers, "LlamaForCausalLM calls attention outside its layers (LlamaAttention, with no "
                                    "layer index)"),
    (lambda: MusicgenForCausalLM(MusicgenDecoderConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2,
                                                       num_attention_heads=4, ffn_dim=128, num_codebooks=2)),
     "MusicgenForCausalLM has no single token embedding (its input embeddings are a ModuleList)"),
], ids=["attention outside the layers", "codebooks (MusicGen)"])
def test_a_model_the_engine_cannot_place_is_refused_at_load_naming_why(engine, model, refusal):
    """Found from outside (a sweep of 196 types): Inkling2 was refused for an AttributeError its block residual
    led to, MusicGen raised an untyped AttributeError from `Engine(...)`."""
    with pytest.raises(InvalidModel, match=re.escape(refusal)):
        Engine(model().eval(), engine.tokenizer)


def test_a_model_that_views_its_attention_output_runs_batched_as_alone(engine):
    """Afmoe `view`s what its attention returns, which transformers returns contiguous and the engine did not:
    every step of two sessions decoding together raised a RuntimeError."""
    torch.manual_seed(0)
    model = AfmoeForCausalLM(AfmoeConfig(**SHAPE, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                         num_shared_experts=1, num_dense_layers=1, sliding_window=32)).eval()
    for parameter in model.parameters():
        parameter.data.normal_(0.0, 0.2)  # transformers' initialisation leaves some of its weights at zero
    reference = copy.deepcopy(model)
    afmoe = Engine(model, engine.tokenizer, prefill_chunk=16)
    prompts = [tokens(n, seed=80 + n) for n in (5, 23, 40)]
    sessions = [afmoe.session() for _ in prompts]
    generations = [s.stream(token_ids=p, max_new_tokens=8, eos_token_ids=[]) for s, p in zip(sessions, prompts)]
    assert drain(generations, afmoe) == [greedy(reference, p, 8) for p in prompts]


def test_a_model_that_hands_its_attention_the_positions_to_keep_runs_batched_as_alone(engine):
    """GOT-OCR2's language model passes `logits_to_keep` (which positions its output layer keeps) on to its
    attention, which never reads it: it was refused as a keyword the engine does not run."""
    torch.manual_seed(0)
    model = GotOcr2ForConditionalGeneration(GotOcr2Config(
        text_config=dict(model_type="qwen2", **SHAPE), image_token_index=1000,
        vision_config=dict(hidden_size=32, output_channels=16, num_hidden_layers=1, num_attention_heads=2, image_size=64,
                           patch_size=16, mlp_dim=64, global_attn_indexes=[0]))).eval()
    for parameter in model.parameters():
        parameter.data.normal_(0.0, 0.2)  # tokens that vary
    reference = copy.deepcopy(model)
    got = Engine(model, engine.tokenizer, prefill_chunk=16)
    prompts = [tokens(n, seed=90 + n) for n in (5, 23, 40)]
    sessions = [got.session() for _ in prompts]
    generations = [s.stream(token_ids=p, max_new_tokens=8, eos_token_ids=[]) for s, p in zip(sessions, prompts)]
    expected = [greedy(reference, p, 8) for p in prompts]
    assert drain(generations, got) == expected and len({tuple(e) for e in expected}) == 3


@pytest.mark.parametrize("window", [0, -3])
def test_a_sliding_window_that_is_no_number_of_tokens_is_refused_at_load(engine, window):
    """A window of 0 attends nothing: the model loaded and generated from attention over no keys (transformers'
    own masks fail on it)."""
    model = MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=window)).eval()
    with pytest.raises(InvalidModel, match=f"MistralForCausalLM's sliding window {window} is not a number of tokens"):
        Engine(model, engine.tokenizer)


def test_a_correct_model_is_not_refused_for_its_half_precision_rounding(engine):
    """32 layers in bfloat16: its logits differ by path by 11% of the largest (transformers' own differ from
    float32 as much); the check's first measure (0.1 of the largest logit) refused it (helper-61)."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**SHAPE, "num_hidden_layers": 32, "hidden_size": 256, "intermediate_size": 512,
                            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "initializer_range": 0.15})
    deep = Engine(LlamaForCausalLM(config).eval().to(torch.bfloat16), engine.tokenizer)
    with deep.session() as session:
        assert len(session.generate(token_ids=[5, 6, 7], max_new_tokens=3, eos_token_ids=[]).token_ids) == 3


def test_a_model_built_in_training_mode_runs_in_eval_mode(engine):
    """Dropout left on made the check compare two random passes (and generations draw at random): the engine
    runs the model in eval mode, as from_pretrained gives it."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, attention_dropout=0.5)).train()
    trained = Engine(model, engine.tokenizer)
    assert not model.training
    with trained.session() as session:
        assert session.generate(token_ids=[5, 6, 7], max_new_tokens=4, eos_token_ids=[]).token_ids == greedy(model, [5, 6, 7], 4)


def test_a_session_of_a_model_whose_values_are_narrower_than_its_keys_saves_and_restores(engine, tmp_path):
    """The saved layout names each kind's own width: MLA's values (16) are not its keys' (24)."""
    torch.manual_seed(0)
    mla = Engine(DeepseekV3ForCausalLM(DeepseekV3Config(**MLA)).eval(), engine.tokenizer)
    prompt = tokens(40, seed=90)
    with mla.session() as session:
        first = session.generate(token_ids=prompt, max_new_tokens=5, eos_token_ids=[])
        session.save(tmp_path / "mla")
    longer = prompt + first.token_ids + [7]
    restored = mla.restore(tmp_path / "mla")
    again = restored.generate(token_ids=longer, max_new_tokens=5, eos_token_ids=[])
    assert again.stats.reused_tokens == len(prompt) + 4 and again.token_ids == greedy(mla.model, longer, 5)


def test_a_window_the_config_names_and_the_model_never_applies_is_not_applied(engine):
    """Moshi's config carries a sliding window (32 here, 3,000 as published) that its attention is never told
    and its masks never apply: the engine applied it to every layer, and every prompt past it gave other tokens
    (a sweep of the remaining architectures, helper-60). Its embeddings hold one id more than its logits: that
    id was taken in a prompt, and the generation failed naming a processor it did not have."""
    torch.manual_seed(0)
    model = MoshiForCausalLM(MoshiConfig(vocab_size=1024, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32,
                                         max_position_embeddings=1024)).eval()
    moshi = Engine(model, engine.tokenizer)
    assert moshi.windows == (None, None) and moshi.vocab_size == 1024 < model.get_input_embeddings().num_embeddings
    prompt = tokens(100, seed=95)
    with moshi.session() as session:
        expected = list(prompt)  # the uncached argmax: transformers' own cached generate differs from it here
        with torch.no_grad():
            for _ in range(4):
                expected.append(int(model(torch.tensor([expected]), use_cache=False).logits[0, -1].argmax()))
        assert session.generate(token_ids=prompt, max_new_tokens=4, eos_token_ids=[]).token_ids == expected[100:]
        with pytest.raises(TokenOutOfRange):
            session.generate(token_ids=[5, 1024], max_new_tokens=1, eos_token_ids=[])
