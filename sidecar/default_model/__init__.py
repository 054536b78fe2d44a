"""The embedded default model: a tiny Llama-architecture model with RANDOM weights.

It exists so that the sidecar, its tests and its benchmarks run anywhere without a download. Its text
is gibberish. The weights are built deterministically from `SEED`, the tokenizer is the byte-level BPE
shipped beside this file. `materialise()` writes both once into a cache directory, and they are then
loaded through the same `from_pretrained` path as any user model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SEED = 20261121
CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Turns are delimited by the tokenizer's own BOS and EOS, so a generated EOS ends the assistant's turn
# exactly where the template's next rendering ends it.
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "chat_template": CHAT_TEMPLATE,
    "pad_token": "<pad>",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "model_max_length": CONFIG["max_position_embeddings"],
    "clean_up_tokenization_spaces": False,
}


def cache_root() -> Path:
    return Path(os.environ.get("SIDECAR_CACHE_DIR") or Path.home() / ".cache" / "beam-sidecar")


def fingerprint(config: dict = CONFIG) -> str:
    digest = hashlib.sha256(json.dumps([config, TOKENIZER_CONFIG, SEED], sort_keys=True).encode())
    digest.update((HERE / "tokenizer.json").read_bytes())
    return digest.hexdigest()[:16]


def materialise(root: Path | None = None, config: dict = CONFIG, name: str = "default") -> Path:
    """The directory of the default model, built on first use. Safe when several processes race. With
    `config` (the default's keys updated) and a `name`, another random model built the same way (a
    benchmark's bigger one)."""
    return built_once((root or cache_root()) / f"{name}-{fingerprint(config)}", lambda staging: _build(staging, config))


def built_once(target: Path, build) -> Path:
    """`target`, a model directory that `build(staging)` writes on first use into a staging directory
    beside it, renamed into place whole: a reader never sees half a model, and when several processes
    race, the first rename wins and the others' work is thrown away."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build(staging: Path, config: dict = CONFIG) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    shutil.copy(HERE / "tokenizer.json", staging / "tokenizer.json")
    (staging / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
    vocab_size = len(AutoTokenizer.from_pretrained(staging, local_files_only=True))
    config = LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}, vocab_size=vocab_size)
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config)
    model.save_pretrained(staging)
