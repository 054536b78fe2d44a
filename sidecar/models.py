"""Loading a local Hugging Face directory as a causal LM and its tokenizer, with typed errors."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.utils import logging as hf_logging

from . import default_model
from .errors import InvalidArgument, InvalidModel, ModelNotFound, NoTokenizer, NotCausalLM, RemoteCodeRequired, UnknownDevice

DTYPES = {
    "float32": torch.float32, "f32": torch.float32,
    "float16": torch.float16, "f16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}

# An auto_map entry that names code inside the model directory: dotted identifiers, "module.Class". Anything
# else ("repo--module.Class" fetches another repository; a path reaches outside the directory) is refused.
INSIDE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")

# Progress bars would be noise on stderr, where the sidecar's logs go.
hf_logging.disable_progress_bar()


def resolve_dtype(dtype) -> torch.dtype | None:
    """A dtype a model can compute in: one of `DTYPES`, by name or as the torch.dtype itself (another one,
    int64 or float8 say, failed only once the weights were read, blamed on the model's directory)."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in DTYPES.values()):
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise InvalidArgument(f"unknown dtype {dtype!r}; valid: {', '.join(sorted(DTYPES))}", option="dtype")
    return DTYPES[dtype]


def resolve_device(name) -> torch.device:
    """A device torch knows and this machine has; `unknown_device` otherwise, listing what it has."""
    present = available_devices()
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as error:
        raise UnknownDevice(f"unknown device {str(name)[:64]!r}; this machine has: {', '.join(present)}",
                            option="device", available=present) from error
    count = {"cpu": 1, "cuda": torch.cuda.device_count(), "mps": int(torch.backends.mps.is_available())}.get(device.type, 0)
    if count == 0 or (device.index or 0) >= count:
        raise UnknownDevice(f"device {str(device)!r} is not present; this machine has: {', '.join(present)}",
                            option="device", available=present)
    return device


def available_devices() -> list[str]:
    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return devices + (["mps"] if torch.backends.mps.is_available() else [])


def load(path: str | Path | None, *, dtype=None, device: str = "cpu", trust_remote_code: bool = False):
    """Returns (model, tokenizer, path) for a local directory, or for the embedded default when path is None.

    Everything the caller gives is checked before anything is read, and every failure is a typed error.
    Code shipped in a directory (with trust_remote_code) that exits the interpreter is `invalid_model` too:
    one load must not end the process that serves every other session.
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise InvalidArgument(f"path must be a string or a path, got {type(path).__name__}", option="path")
    torch_dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    path = Path(path) if path is not None else default_model.materialise()
    try:
        found = path.is_dir() and (path / "config.json").is_file()
    except OSError as error:  # a name longer than the system takes (pathlib answers False for loops, NUL, ...)
        raise ModelNotFound(f"{error.strerror}: no model directory at {str(path)!r}", path=str(path)) from error
    if not found:
        raise ModelNotFound(f"no model directory with a config.json at {str(path)!r}", path=str(path))
    _check_remote_code(path, trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except ValueError as error:
        raise NotCausalLM(f"{str(path)!r} is not a model transformers can load: {error}", path=str(path)) from error
    except (Exception, SystemExit) as error:  # unreadable or malformed files: OSError, JSON errors, ...
        raise InvalidModel(f"cannot read the config in {str(path)!r}: {_brief(error)}", path=str(path)) from error
    if type(config) not in AutoModelForCausalLM._model_mapping and not _has_remote_causal_lm(config):
        raise NotCausalLM(
            f"{str(path)!r} holds a {type(config).__name__} ({config.model_type}), which is not a causal language model",
            path=str(path),
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except (Exception, SystemExit) as error:  # OSError, ValueError or TypeError depending on what is missing
        if not trust_remote_code and "trust_remote_code" in str(error):  # a tokenizer class only its own code has
            raise _remote_code_required(path, "tokenizer_config.json") from error
        raise NoTokenizer(f"no usable tokenizer in {str(path)!r}: {_brief(error)}", path=str(path)) from error
    if tokenizer is None or not hasattr(tokenizer, "decode") or len(tokenizer) < 2:
        raise NoTokenizer(f"no usable tokenizer in {str(path)!r} (no tokenizer files, or an empty vocabulary)",
                          path=str(path))
    _check_generation_config(path)
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code, dtype=torch_dtype, output_loading_info=True
        )
    except (Exception, SystemExit) as error:  # no weights, truncated or mismatched ones, a pickle refused as unsafe, ...
        raise InvalidModel(f"cannot load the weights in {str(path)!r}: {_brief(error)}", path=str(path)) from error
    if loading["missing_keys"]:  # transformers initialises them at random, and only logs it
        missing = sorted(loading["missing_keys"])
        raise InvalidModel(
            f"the weights in {str(path)!r} do not fit its config ({type(model).__name__}): {len(missing)} of its parameters "
            f"are not in the checkpoint ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}) and would be random",
            path=str(path))
    return model.to(device).eval(), tokenizer, path


def max_context(config) -> int | None:
    """The positions the model takes: `max_position_embeddings`, or for YaRN rope scaling the `factor` times the
    `original_max_position_embeddings` it was trained at, where that is more (Qwen2.5's 32k extended to 128k,
    as vLLM reads it; a config that already says the extended length, as DeepSeek-V3's, keeps it). YaRN's
    frequencies are fixed, so positions past the config's length compute as any other. Dynamic NTK's change
    with the longest row of a batch, and the others' configs say their extended length already."""
    length = getattr(config, "max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(length, int) or not isinstance(rope, dict) or rope.get("rope_type") != "yarn":
        return length
    factor, original = rope.get("factor"), rope.get("original_max_position_embeddings") or length
    if isinstance(factor, (int, float)) and factor > 1 and isinstance(original, int):
        return max(length, int(factor * original))
    return length


def vocab_size(model) -> int:
    """The token ids the model both reads and predicts: its input embeddings' rows, or its output layer's
    width where that is smaller (Moshi embeds 1,025 ids and predicts 1,024: an id past the logits was taken
    in a prompt, and its generation failed naming a processor it did not have)."""
    size = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if not isinstance(size, int):  # MusicGen embeds a list of codebooks
        raise InvalidModel(f"{type(model).__name__} has no single token embedding (its input embeddings are a "
                           f"{type(model.get_input_embeddings()).__name__}): not a text model the engine can run")
    output = model.get_output_embeddings()
    width = getattr(output, "out_features", None)
    return min(size, width) if isinstance(width, int) and width > 0 else size


def _brief(error: BaseException) -> str:
    """An exception as one short line: transformers' messages run to several paragraphs."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= 300 else text[:297] + "..."


def _check_generation_config(path: Path) -> None:
    """A generation_config.json that is JSON but no object failed inside transformers' loading, blamed on the
    weights. One that is not JSON at all (truncated) transformers passes over, logging at INFO, and the model
    ran with its config's defaults instead of the file's: greedy where the file samples (helper-86). Both are
    refused, as a malformed config.json is."""
    file = path / "generation_config.json"
    try:
        parsed = json.loads(file.read_text()) if file.is_file() else {}
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise InvalidModel(f"{str(file)!r} cannot be read as JSON: {_brief(error)}", path=str(path)) from error
    if not isinstance(parsed, dict):
        raise InvalidModel(f"{str(file)!r} is not a JSON object", path=str(path))
    try:  # what transformers' loading refuses in it (a max_new_tokens of 0), named as its own
        GenerationConfig.from_dict(parsed)
    except (ValueError, TypeError) as error:
        raise InvalidModel(f"{str(file)!r} is not a generation config transformers takes: {_brief(error)}",
                           path=str(path)) from error


def _check_remote_code(path: Path, trust_remote_code: bool) -> None:
    """A config or tokenizer config that maps to code needs explicit consent before anything is imported,
    and that code must live inside the directory: an `auto_map` entry naming another repository
    ("repo--module.Class") would be fetched from a hub."""
    for name in ("config.json", "tokenizer_config.json"):
        if name == "config.json" or (path / name).is_file():
            _check_auto_map(path, name, trust_remote_code)


def _check_auto_map(path: Path, name: str, trust_remote_code: bool) -> None:
    try:
        config = json.loads((path / name).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise InvalidModel(f"cannot read {str(path / name)!r}: {_brief(error)}", path=str(path)) from error
    if not isinstance(config, dict):
        raise InvalidModel(f"{str(path / name)!r} is not a JSON object", path=str(path))
    auto_map = config.get("auto_map")
    if not auto_map:
        return
    if not trust_remote_code:
        # transformers' own classes serve a model type it knows, as from_pretrained does without trust (Phi-3's
        # repositories ship code for a type transformers has since taken in); a tokenizer's class is looked up
        # by AutoTokenizer itself, whose refusal `load` reports as this one
        if name == "tokenizer_config.json" or config.get("model_type") in CONFIG_MAPPING:
            return
        raise _remote_code_required(path, name)
    references = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    for reference in references:
        for target in reference if isinstance(reference, list) else [reference]:
            if target is not None and not (isinstance(target, str) and INSIDE.fullmatch(target)):
                raise InvalidModel(f"{str(path)!r}: auto_map entry {str(target)[:100]!r} is not a module of the "
                                   "directory (module.Class); code from anywhere else is never run", path=str(path))
            module = None if target is None else path / (target.rsplit(".", 1)[0].replace(".", "/") + ".py")
            if module is not None and not module.is_file():
                raise InvalidModel(f"{str(path)!r}: {name}'s auto_map names {target!r}, and the directory has no "
                                   f"{module.name}", path=str(path))


def _remote_code_required(path: Path, name: str) -> RemoteCodeRequired:
    unknown = "a tokenizer class" if name == "tokenizer_config.json" else "a model type"
    return RemoteCodeRequired(f"{str(path)!r} ships its own code ({name} has an auto_map, for {unknown} transformers "
                              "does not know): allow it with trust_remote_code (the CLI's --trust-remote-code) to run "
                              "that code", path=str(path))


def _has_remote_causal_lm(config) -> bool:
    return "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
