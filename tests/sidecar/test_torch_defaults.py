"""A model loading on one thread does not change torch's default dtype under another thread's work."""

import threading
import time

import torch

from sidecar import models
from sidecar.torch_defaults import DEFAULTS, Gate


def test_a_bf16_load_waits_for_the_work_under_way_and_never_shows_its_dtype(default_dir):
    loaded = {}

    def load():
        loaded["model"] = models.load(default_dir, dtype="bfloat16")[0]

    loader = threading.Thread(target=load)
    with DEFAULTS.using():
        loader.start()
        seen = set()
        until = time.monotonic() + 3  # the load alone takes a tenth of that: it waits at building the modules
        while time.monotonic() < until:
            seen.add(torch.get_default_dtype())
            seen.add(torch.full((1,), 0.5).dtype)
        assert loader.is_alive() and "model" not in loaded
        assert seen == {torch.float32}
    loader.join(timeout=120)
    assert loaded["model"].dtype == torch.bfloat16 and torch.get_default_dtype() == torch.float32


def test_a_composite_model_that_builds_its_parts_inside_its_build_loads(default_dir, tmp_path):
    """Gemma 3's conditional-generation model builds its text and vision towers with `from_config`, which
    enters transformers' dtype window inside the outer one: the gate nests on the loading thread."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=dict(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=1000, boi_token_index=1001, eoi_token_index=1002)
    Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((default_dir / name).read_bytes())
    loaded = {}
    loader = threading.Thread(target=lambda: loaded.update(model=models.load(tmp_path, dtype="bfloat16")[0]),
                              daemon=True)
    loader.start()
    loader.join(timeout=120)
    assert not loader.is_alive() and loaded["model"].dtype == torch.bfloat16


def test_uses_share_the_gate_a_change_waits_for_them_and_a_later_use_for_the_change():
    gate, log = Gate(), []
    holding, release = threading.Event(), threading.Event()

    def use(name, hold=False):
        with gate.using():
            log.append(name)
            if hold:
                holding.set()
                release.wait(30)

    def change():
        with gate.changing():
            log.append("change")

    held = threading.Thread(target=use, args=("held use", True))
    held.start()
    assert holding.wait(30)
    with gate.using():  # a use beside another thread's
        log.append("shared use")
    changer = threading.Thread(target=change)
    changer.start()
    while gate._changer is None:  # the change is asked for, and waits for the held use
        time.sleep(0.001)
    later = threading.Thread(target=use, args=("later use",))
    later.start()
    time.sleep(0.2)
    assert log == ["held use", "shared use"]
    release.set()
    for thread in (held, changer, later):
        thread.join(30)
    assert log == ["held use", "shared use", "change", "later use"]


def test_a_thread_may_change_the_defaults_while_it_uses_or_changes_them():
    """A composite model (Gemma 3's) builds its parts with `from_config` inside its own build, which enters
    transformers' window again."""
    gate = Gate()
    with gate.using(), gate.changing(), gate.using(), gate.changing():
        pass
    with gate.changing():  # and the gate is free again
        pass
