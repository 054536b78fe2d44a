"""The envelope and every op's parameters, declared once; requests are checked against them.

request : {"id": uint, "op": str, ...params}
event   : {"id": id, "event": str, ...}                    zero or more per request
reply   : {"id": id, "ok": true, "result": {...}}          exactly one per request
        | {"id": id, "ok": false, "error": {"code": str, "message": str, ...}}
A frame that cannot be attributed to a request gets a reply with "id": null.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import INVALID_ID, INVALID_MESSAGE, INVALID_PARAMS, UNKNOWN_OP, ProtocolError
from .limits import Limits, check_depth, check_params

PROTOCOL_VERSION = 1
MAX_ID = 2**64 - 1
DEFAULT_NUM_BEAMS = 4  # generate's num_beams with strategy "beam", whatever num_return_sequences is


@dataclass(frozen=True)
class Param:
    kind: str  # str | int | uint | number | bool | bool|str | map | list[uint] | list[str] | list[map], optionally "|null"
    required: bool = False
    default: Any = None
    doc: str = ""
    # A map's own keys, checked as an op's parameters are (errors name them `param.key`), absent ones filled
    # with their defaults. None: a map of anything.
    fields: dict[str, "Param"] | None = field(default=None, hash=False)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_uint(v) -> bool:
    return _is_int(v) and v >= 0


# Lists are checked in two passes: the container first (so that a size limit can bite before the
# elements are looked at), then the elements.
CONTAINERS = {"list[uint]": list, "list[str]": list, "list[map]": list}
ELEMENTS = {"list[uint]": _is_uint, "list[str]": lambda v: isinstance(v, str), "list[map]": lambda v: isinstance(v, dict)}


def _all_uint(values: list) -> bool:
    """`all(map(_is_uint, values))` at C speed: a list of 262,144 token ids in 9 ms instead of 33, on the main
    thread (msgpack decodes every integer as an int exactly, and `type` tells a bool from one)."""
    return not values or (set(map(type, values)) == {int} and min(values) >= 0)


CHECKS = {
    "str": lambda v: isinstance(v, str),
    "int": _is_int,
    "uint": _is_uint,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "bool|str": lambda v: isinstance(v, (bool, str)),
    "map": lambda v: isinstance(v, dict),
    "list[uint]": lambda v: isinstance(v, list) and _all_uint(v),
    "list[str]": lambda v: isinstance(v, list) and all(map(ELEMENTS["list[str]"], v)),
    "list[map]": lambda v: isinstance(v, list) and all(map(ELEMENTS["list[map]"], v)),
}

SESSION = Param("str", required=True, doc="the session name")
MODEL = Param("str", default="default", doc="the model name")

# generate.continue: which sequence of the session's last result to generate from, and how to change it.
CONTINUE = {
    "sequence": Param("uint", default=0, doc="the index of the sequence in the last result's sequences"),
    "tokens": Param("int|null", doc="keep its first k tokens, of its input and generated ones (negative: all but the last -k)"),
    "chars": Param("uint|null", doc="keep the tokens of its first n characters, rounded down to a token boundary"),
    "append": Param("str|null", doc="then append the tokens of this text, tokenized alone without special tokens"),
    "append_token_ids": Param("list[uint]|null", doc="or append these token ids"),
}

OPS: dict[str, dict[str, Param]] = {
    "hello": {},
    "ping": {},
    "load_model": {
        "name": Param("str", default="default", doc="the name to refer to the model by"),
        "path": Param("str|null", doc="a local Hugging Face directory; null for the embedded default model"),
        "dtype": Param("str|null", doc="f32 | f16 | bf16 (default: as saved)"),
        "device": Param("str|null", doc="cpu | cuda | cuda:N | mps (default: the server's)"),
        "trust_remote_code": Param("bool", default=False, doc="allow code shipped inside the model directory"),
        "prefill_chunk": Param("uint|null", doc="prompt tokens per forward pass for this model, at least 1 "
                               "(default and most: the server's)"),
    },
    "unload_model": {"model": Param("str", required=True, doc="the model name")},
    "models": {},
    "open_session": {
        "model": MODEL,
        "session": Param("str|null", doc="a name chosen by the client; default: chosen by the server"),
    },
    "close_session": {"session": SESSION},
    "session_info": {"session": SESSION},
    "fork_session": {
        "session": SESSION,
        "new": Param("str|null", doc="the fork's name; default: chosen by the server"),
    },
    "save_session": {
        "session": SESSION,
        "name": Param("str", required=True, doc="the saved session's name: 1 to 128 letters, digits, '.', '_' or '-', "
                      "starting with a letter or digit (never a path)"),
    },
    "restore_session": {
        "model": MODEL,
        "name": Param("str", required=True, doc="the saved session's name, as save_session takes it"),
        "session": Param("str|null", doc="the restored session's name; default: chosen by the server"),
    },
    "generate": {
        "session": SESSION,
        "prompt": Param("str|null", doc="text input (exactly one of prompt, token_ids and messages)"),
        "token_ids": Param("list[uint]|null", doc="token-id input"),
        "messages": Param("list[map]|null", doc='chat input: [{"role": str, "content": str}, ...], rendered by the chat template'),
        "chat_template": Param("str|null", doc="with messages: the name of one of the model's chat_templates (default: its default)"),
        "add_generation_prompt": Param("bool|null", doc="with messages: open an assistant turn (default: true unless continuing)"),
        "continue_final_message": Param("bool", default=False, doc="with messages: extend the last message instead"),
        "tools": Param("list[map]|null", doc="with messages: the tools the template offers the model (JSON schemas of "
                       "functions, as apply_chat_template takes them)"),
        "documents": Param("list[map]|null", doc="with messages: documents for a retrieval template"),
        "chat_template_kwargs": Param("map|null", doc="with messages: more variables of the template "
                                      "(Qwen3's enable_thinking)"),
        "max_new_tokens": Param("uint|null", doc="tokens to generate at most (default: the model's "
                                "generation_defaults.max_new_tokens, 16 unless its generation config says)"),
        "strategy": Param("str|null", doc="greedy | sample | beam (default: the model's generation_defaults.strategy)"),
        "seed": Param("uint|null", doc="seed of sampling; the same seed gives the same tokens"),
        "processors": Param("list[map]|null", doc='[{"name": "top_k", "options": {"k": 50}}, ...] (default: the '
                            "model's generation_defaults; [] for none)"),
        "stop": Param("list[str]|null", doc="stop strings, trimmed from the text (default: the model's generation_defaults.stop)"),
        "eos_token_ids": Param("list[uint]|null", doc="default: the model's EOS ids"),
        "generation_config": Param("map|null", doc="fields of the model's generation config this call changes, the "
                                   "others kept (as transformers' generate(temperature=0.7)): see Generation defaults"),
        "stream": Param("bool", default=False, doc="emit a token event per generated token (beam search emits none)"),
        "num_samples": Param("uint|null", default=1, doc="with sample: sequences drawn from one prefill of the prompt"),
        "num_beams": Param("uint|null", doc=f"with beam: beams kept at each step (default {DEFAULT_NUM_BEAMS})"),
        "num_return_sequences": Param("uint|null", doc="with beam: the best finished beams returned (default 1)"),
        "length_penalty": Param("number|null", doc="with beam: scores are divided by length ** this (default 1.0)"),
        "early_stopping": Param("bool|str|null", doc='with beam: true, false or "never", as in transformers (default false)'),
        "logprobs": Param("uint|null", doc="report each generated token's log-probability under the model and the k "
                          "most likely at its step (0-20)"),
        "prompt_logprobs": Param("uint|null", doc="report each prompt token's log-probability given those before it and "
                                 "the k most likely there (0-20); the prompt is computed anew, reusing no cache"),
        "reuse": Param("str", default="prefix", doc="prefix (exact) | shift (approximate: moves the cache after dropped tokens)"),
        "keep": Param("uint|null", doc="with shift: leading tokens that stay in place (default 0)"),
        "continue": Param("map|null", doc="the input is a sequence of the session's last result, cut and extended "
                          "(instead of prompt, token_ids and messages)", fields=CONTINUE),
    },
    "cancel": {"target": Param("uint", required=True, doc="the id of the request to cancel")},
    "tokenize": {
        "model": MODEL,
        "text": Param("str", required=True),
        "add_special_tokens": Param("bool", default=True),
    },
    "detokenize": {
        "model": MODEL,
        "token_ids": Param("list[uint]", required=True),
        "skip_special_tokens": Param("bool", default=True),
    },
    "stats": {},
    "shutdown": {},
}

# Parameters whose default depends on the others: left out (or nil) they stay None in the request, since
# an option given where it does not apply is refused (num_beams without beam), but the limits measure the
# default they stand for (section 7: a parameter left out is measured with its default).
MEASURED_DEFAULTS = {
    ("generate", "num_beams"): lambda params: DEFAULT_NUM_BEAMS if params["strategy"] == "beam" else None,
}


@dataclass(frozen=True)
class Request:
    id: int
    op: str
    params: dict


def request_id_of(message) -> int | None:
    """The id of a message if it has a valid one; used to attribute errors found later."""
    if isinstance(message, dict):
        rid = message.get("id")
        if _is_int(rid) and 0 <= rid <= MAX_ID:
            return rid
    return None


DEFAULT_LIMITS = Limits()


def parse_request(message, limits: Limits = DEFAULT_LIMITS) -> Request:
    """Checks the envelope, the op's parameters and their sizes; fills defaults. Raises ProtocolError.

    Sizes are checked before the elements of a list are typed, and the depth of maps before anything
    recurses into them.
    """
    if not isinstance(message, dict):
        raise ProtocolError(INVALID_MESSAGE, f"a request must be a map, got {type(message).__name__}")
    rid = request_id_of(message)
    if rid is None:
        raise ProtocolError(INVALID_ID, "a request needs an \"id\": an unsigned integer below 2^64")
    op = message.get("op")
    if not isinstance(op, str):
        raise ProtocolError(INVALID_MESSAGE, 'a request needs an "op" string', rid)
    schema = OPS.get(op)
    if schema is None:
        raise ProtocolError(UNKNOWN_OP, f"unknown op {_short(op)!r}; known ops: {', '.join(OPS)}", rid, op=_short(op))
    params = {}
    for key, value in message.items():
        if key in ("id", "op"):
            continue
        param = schema.get(key) if isinstance(key, str) else None
        if param is None:
            shown = _short(key) if isinstance(key, str) else _show(key)
            raise ProtocolError(INVALID_PARAMS, f"{op} has no parameter {shown!r}; valid: {', '.join(schema) or '(none)'}", rid, param=shown)
        kind, nullable = param.kind.removesuffix("|null"), param.kind.endswith("|null")
        shallow = (lambda v: isinstance(v, CONTAINERS[kind])) if kind in CONTAINERS else CHECKS[kind]
        if not (shallow(value) or (nullable and value is None)):
            raise _mistyped(op, key, param, value, rid)
        if value is not None or param.default is None:  # nil for an option with a default: that default
            params[key] = value
    for key, value in params.items():
        if "map" in schema[key].kind:
            check_depth(value, limits.max_depth, rid, key, start=2)  # the request map itself is level 1
    for key, param in schema.items():
        if key not in params:
            if param.required:
                raise ProtocolError(INVALID_PARAMS, f"{op}: missing required parameter {key!r}", rid, param=key)
            params[key] = param.default
    measured = {key: MEASURED_DEFAULTS[op, key](params) if value is None and (op, key) in MEASURED_DEFAULTS else value
                for key, value in params.items()}
    check_params(op, measured, limits, rid)  # defaults included: a limit bounds what the request will do
    for key, value in params.items():
        kind = schema[key].kind.removesuffix("|null")
        if kind in CONTAINERS and value is not None and not CHECKS[kind](value):
            raise _mistyped(op, key, schema[key], value, rid)
        if schema[key].fields is not None and value is not None:
            params[key] = _check_fields(op, key, schema[key].fields, value, rid)
    return Request(rid, op, params)


def _check_fields(op: str, name: str, fields: dict[str, Param], value: dict, rid: int) -> dict:
    """The entries of a map parameter with declared keys, typed and completed with their defaults."""
    checked = {}
    for key, item in value.items():
        param = fields.get(key) if isinstance(key, str) else None
        if param is None:
            shown = _short(key) if isinstance(key, str) else _show(key)
            raise ProtocolError(INVALID_PARAMS, f"{op}: {name} has no key {shown!r}; valid: {', '.join(fields)}", rid,
                                param=f"{name}.{shown}")
        kind, nullable = param.kind.removesuffix("|null"), param.kind.endswith("|null")
        if not (CHECKS[kind](item) or (nullable and item is None)):
            raise _mistyped(op, f"{name}.{key}", param, item, rid)
        checked[key] = item
    for key, param in fields.items():
        if key not in checked:
            if param.required:
                raise ProtocolError(INVALID_PARAMS, f"{op}: {name} needs the key {key!r}", rid, param=f"{name}.{key}")
            checked[key] = param.default
    return checked


def _mistyped(op: str, key: str, param: Param, value, rid: int) -> ProtocolError:
    """The error for a value of the wrong type; for a list of the right container, `index` names its first
    element of the wrong type."""
    kind = param.kind.removesuffix("|null")
    if kind in CONTAINERS and isinstance(value, CONTAINERS[kind]):
        element = ELEMENTS[kind]
        index = next(i for i, item in enumerate(value) if not element(item))
        return ProtocolError(INVALID_PARAMS, f"{op}: parameter {key!r} must be {param.kind}; its element {index} is "
                             f"{_show(value[index])}", rid, param=key, index=index)
    return ProtocolError(INVALID_PARAMS, f"{op}: parameter {key!r} must be {param.kind}, got {_show(value)}", rid, param=key)


def _short(name: str) -> str:
    """A client's name quoted back to it, cut to a size that always fits in a reply."""
    return name if len(name) <= 64 else name[:61] + "..."


def _show(value) -> str:
    """A short description of a value; never the repr of a whole large (or deep) value."""
    if isinstance(value, (list, dict)):
        return f"{type(value).__name__} of {len(value)}"
    text = repr(value[:41] if isinstance(value, (str, bytes)) else value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def ok(request_id: int, result: dict) -> dict:
    return {"id": request_id, "ok": True, "result": result}


def error(request_id: int | None, code: str, message: str, **details) -> dict:
    return {"id": request_id, "ok": False, "error": {"code": code, "message": message, **details}}


def event(request_id: int, name: str, **fields) -> dict:
    return {"id": request_id, "event": name, **fields}
