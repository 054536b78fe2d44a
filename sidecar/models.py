"""Loading a local Hugging Face directory as a causal LM and its tokenizer, with typed errors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from . import default_model
from .errors import InvalidArgument, InvalidModel, ModelNotFound, NoTokenizer, NotCausalLM, RemoteCodeRequired

DTYPES = {
    "float32": torch.float32, "f32": torch.float32,
    "float16": torch.float16, "f16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}

# Progress bars would be noise on stderr, where the sidecar's logs go.
hf_logging.disable_progress_bar()


def resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InvalidArgument(f"unknown dtype {dtype!r}; valid: {', '.join(sorted(DTYPES))}", option="dtype")
    return DTYPES[dtype]


def load(path: str | Path | None, *, dtype=None, device: str = "cpu", trust_remote_code: bool = False):
    """Returns (model, tokenizer, path) for a local directory, or for the embedded default when path is None."""
    path = Path(path) if path is not None else default_model.materialise()
    torch_dtype = resolve_dtype(dtype)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelNotFound(f"no model directory with a config.json at {str(path)!r}", path=str(path))
    _check_remote_code(path, trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except ValueError as error:
        raise NotCausalLM(f"{str(path)!r} is not a model transformers can load: {error}", path=str(path)) from error
    except Exception as error:  # unreadable or malformed files: OSError, JSON errors, ... depending on what is wrong
        raise InvalidModel(f"cannot read the config in {str(path)!r}: {_brief(error)}", path=str(path)) from error
    if type(config) not in AutoModelForCausalLM._model_mapping and not _has_remote_causal_lm(config):
        raise NotCausalLM(
            f"{str(path)!r} holds a {type(config).__name__} ({config.model_type}), which is not a causal language model",
            path=str(path),
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as error:  # transformers raises OSError, ValueError or TypeError depending on what is missing
        raise NoTokenizer(f"no usable tokenizer in {str(path)!r}: {error}", path=str(path)) from error
    if tokenizer is None or not hasattr(tokenizer, "decode"):
        raise NoTokenizer(f"no usable tokenizer in {str(path)!r}", path=str(path))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code, dtype=torch_dtype
        )
    except Exception as error:  # no weights, truncated or mismatched ones, a pickle refused as unsafe, ...
        raise InvalidModel(f"cannot load the weights in {str(path)!r}: {_brief(error)}", path=str(path)) from error
    return model.to(device).eval(), tokenizer, path


def _brief(error: Exception) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 300 else text[:297] + "..."


def _check_remote_code(path: Path, trust_remote_code: bool) -> None:
    """A config that maps to code needs explicit consent before anything is imported, and that code must
    live inside the directory: an `auto_map` entry naming another repository ("repo--module.Class")
    would be fetched from a hub."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise InvalidModel(f"cannot read {str(path / 'config.json')!r}: {_brief(error)}", path=str(path)) from error
    if not isinstance(config, dict):
        raise InvalidModel(f"{str(path / 'config.json')!r} is not a JSON object", path=str(path))
    auto_map = config.get("auto_map")
    if not auto_map:
        return
    if not trust_remote_code:
        raise RemoteCodeRequired(
            f"{str(path)!r} ships its own model code (auto_map); load it with trust_remote_code=True to run that code",
            path=str(path),
        )
    references = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    for reference in references:
        for target in reference if isinstance(reference, list) else [reference]:
            if not isinstance(target, (str, type(None))) or (target and "--" in target):
                raise InvalidModel(f"{str(path)!r}: auto_map entry {str(target)[:100]!r} names code outside the "
                                   "directory, which would be downloaded; only code inside it can be trusted", path=str(path))


def _has_remote_causal_lm(config) -> bool:
    return "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
