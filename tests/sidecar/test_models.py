"""Loading: the default model and a GPT-2-style one through from_pretrained, typed errors otherwise."""

import json
import shutil

import pytest
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase, ViTConfig

from sidecar import Engine, errors


def test_default_model_is_a_tiny_llama_loaded_from_a_directory(engine, default_dir):
    assert isinstance(engine.model, LlamaForCausalLM)
    assert isinstance(engine.tokenizer, PreTrainedTokenizerBase)
    assert engine.path == default_dir and (default_dir / "model.safetensors").is_file()
    assert engine.tokenizer.decode(engine.tokenizer.encode("héllo wörld")) == "héllo wörld"


def test_default_model_is_deterministic(engine, tmp_path):
    from sidecar.default_model import materialise

    again = Engine.load(materialise(tmp_path))
    for (name, a), (_, b) in zip(engine.model.state_dict().items(), again.model.state_dict().items()):
        assert a.equal(b), name


def test_gpt2_style_model_loads(gpt2_engine):
    assert gpt2_engine.model.config.model_type == "gpt2" and gpt2_engine.max_context == 256


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_dropped_engine_is_freed_by_a_collection(kind, default_dir, gpt2_dir):
    """What the README promises and `unload_model` relies on: nothing outside the engine keeps it or its
    model (no registry, cache or hook of ours), so once dropped, a collection frees it, with a session
    left open, beams and samples run, and a constraint compiled."""
    import gc
    import weakref

    from processors import Regex, configure

    engine = Engine.load(default_dir if kind == "llama" else gpt2_dir)
    session = engine.session()
    session.generate("hello", max_new_tokens=4, strategy="beam", num_beams=3)
    session.generate("hello", max_new_tokens=4, strategy="sample", num_samples=3, seed=1,
                     processors=[configure(Regex, pattern="[a-z]{1,6}")])
    model, dropped = weakref.ref(engine.model), weakref.ref(engine)
    del engine, session
    gc.collect()
    assert dropped() is None and model() is None


def test_loading_a_model_whose_padding_is_id_0_warns_of_no_padding(engine, monkeypatch):
    """The engine's own passes at load (one token of id 0, then the check's twelve) went without a mask:
    transformers warned on the server's log that the input "may be padded" for every such model."""
    import transformers.modeling_utils
    from transformers import GPT2Config, GPT2LMHeadModel

    warned = []
    monkeypatch.setattr(transformers.modeling_utils.logger, "warning_once", lambda *args, **kwargs: warned.append(args))
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=256, n_embd=64, n_layer=2, n_head=4, pad_token_id=0))
    Engine(model.eval(), engine.tokenizer)
    assert warned == []


def test_dtype_option(default_dir):
    import torch

    assert Engine.load(default_dir, dtype="bfloat16").model.dtype == torch.bfloat16
    with pytest.raises(errors.InvalidArgument, match="unknown dtype 'f8'"):
        Engine.load(default_dir, dtype="f8")


def test_missing_directory(tmp_path):
    with pytest.raises(errors.ModelNotFound, match="no model directory"):
        Engine.load(tmp_path / "nope")


def test_not_a_causal_lm(tmp_path):
    ViTConfig().save_pretrained(tmp_path)
    with pytest.raises(errors.NotCausalLM, match="not a causal language model"):
        Engine.load(tmp_path)


def test_no_tokenizer(default_dir, tmp_path):
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(default_dir / name, tmp_path / name)
    with pytest.raises(errors.NoTokenizer):
        Engine.load(tmp_path)


def test_remote_code_needs_consent(default_dir, tmp_path):
    shutil.copytree(default_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.update(model_type="custom_llama", auto_map={"AutoModelForCausalLM": "modeling_custom.CustomModel"})
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(errors.RemoteCodeRequired, match="trust_remote_code .the CLI's --trust-remote-code"):
        Engine.load(tmp_path / "m")


def test_code_shipped_for_a_model_type_transformers_knows_is_not_needed(engine, default_dir, tmp_path):
    """As Phi-3's repositories ship it: without trust, transformers' own class serves the type, as
    `from_pretrained(trust_remote_code=False)` does, whether or not the code is there."""
    shutil.copytree(default_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    shipped = Engine.load(tmp_path / "m")
    assert type(shipped.model) is LlamaForCausalLM
    with shipped.session() as theirs, engine.session() as ours:
        assert theirs.generate("Once upon", max_new_tokens=6).token_ids == ours.generate("Once upon", max_new_tokens=6).token_ids


def test_a_generation_config_that_is_no_object_is_named(default_dir, tmp_path):
    shutil.copytree(default_dir, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text('["eos"]')
    with pytest.raises(errors.InvalidModel, match="generation_config.json' is not a JSON object"):
        Engine.load(tmp_path / "m")


def test_an_end_token_past_the_vocabulary_is_left_out_of_the_defaults(default_dir, tmp_path, caplog):
    """transformers' generate runs with it (never stopping on it); a constraint, which must be able to end,
    was refused for an eos_token_ids the call never gave."""
    from processors import configure
    from processors.structured import Choice

    shutil.copytree(default_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    config["eos_token_id"] = [2, 128009]
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="sidecar"):
        loaded = Engine.load(tmp_path / "m")
    assert loaded.default_eos_token_ids == {2} and "[128009] are outside its vocabulary" in caplog.text
    with loaded.session() as session:
        result = session.generate("Is it?", processors=[configure(Choice, options=["yes", "no"])], max_new_tokens=8)
    assert result.text in ("yes", "no") and result.token_ids[-1] == 2


def test_yarn_rope_scaling_extends_the_context_and_positions_past_the_config_compute_as_transformers(default_dir, tmp_path):
    """Qwen2.5's 32k with YaRN factor 4 is 128k, as vLLM reads it; the context was the config's length."""
    import torch

    shutil.copytree(default_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.update(max_position_embeddings=64, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                              "original_max_position_embeddings": 64})
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    yarn = Engine.load(tmp_path / "m")
    assert yarn.max_context == 256
    prompt = [5 + (7 * i) % 900 for i in range(90)]  # past the config's 64 positions
    with yarn.session() as session:
        ours = session.generate(token_ids=prompt, max_new_tokens=12, eos_token_ids=[]).token_ids
    with torch.inference_mode():
        theirs = yarn.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=None,
                                     pad_token_id=0)
    assert ours == theirs[0, len(prompt):].tolist()
    with pytest.raises(errors.ContextOverflow):
        yarn.session().generate(token_ids=prompt * 3, max_new_tokens=1)
