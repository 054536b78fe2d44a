"""The server's limits, declared once: default, meaning, and which request values each one bounds.

Every resource a client can grow has a limit here. The size limits are checked in `parse_request`,
before any element of an oversized value is even looked at, so an oversized request costs nothing
but its frame. The counting limits (sessions, models, requests in flight) are checked by the server
before the work starts. `hello` reports them all, and the CLI makes a flag of each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import LIMIT_EXCEEDED, ProtocolError


def _limit(default: int, doc: str, *, bounds: tuple[tuple[str, str], ...] = (), measure: str = "") -> int:
    """One limit: `bounds` lists the (op, param) values it applies to ("*" for every op; "param.key" for a list
    inside a map parameter), measured as `measure`."""
    return dataclasses.field(default=default, metadata={"doc": doc, "bounds": bounds, "measure": measure})


NAMES = (("*", "session"), ("*", "model"), ("load_model", "name"), ("load_model", "path"), ("fork_session", "new"),
         ("save_session", "name"), ("restore_session", "name"), ("generate", "chat_template"))


@dataclass(frozen=True)
class Limits:
    max_frame_bytes: int = _limit(16 * 1024 * 1024, "largest frame read or written, in bytes")
    max_in_flight: int = _limit(
        1024, "requests queued or running at once (generate, session_info, close_session, fork_session, save_session)")
    max_queued_bytes: int = _limit(
        64 * 1024 * 1024, "frame bytes of the requests in flight together (one that waits is held as its frame)")
    max_depth: int = _limit(32, "nesting depth of maps and lists in one request")
    max_values: int = _limit(
        524_288, "maps and lists in one request and the elements of each, together, counted as the frame is "
        "decoded (a frame of 16 MiB of empty maps took 2.7 GB to decode)")
    max_messages: int = _limit(
        2048, "messages of one generate's conversation: each is rendered by the model's chat template, on the server's "
        "main thread (about 30 us a message with common templates)",
        bounds=(("generate", "messages"),), measure="items")
    max_prompt_bytes: int = _limit(
        1024 * 1024, "UTF-8 bytes of a generate prompt, messages, continue, tools, documents or chat_template_kwargs "
        "(all their strings, map keys included), or a tokenize text, checked before tokenizing",
        bounds=(("generate", "prompt"), ("generate", "messages"), ("generate", "continue"), ("generate", "tools"),
                ("generate", "documents"), ("generate", "chat_template_kwargs"), ("tokenize", "text")),
        measure="bytes")
    max_input_tokens: int = _limit(
        262_144, "token ids in one list: generate's token_ids, eos_token_ids and continue.append_token_ids, "
        "detokenize's token_ids",
        bounds=(("generate", "token_ids"), ("generate", "eos_token_ids"), ("generate", "continue.append_token_ids"),
                ("detokenize", "token_ids")), measure="items")
    max_new_tokens: int = _limit(
        32_768, "max_new_tokens of one generate (the model's context bounds it further)",
        bounds=(("generate", "max_new_tokens"),), measure="value")
    max_stop_bytes: int = _limit(
        4096, "UTF-8 bytes of all stop strings of one generate together",
        bounds=(("generate", "stop"),), measure="bytes")
    max_sequences: int = _limit(
        64, "num_beams (4 when a beam search leaves it out) or num_samples of one generate: rows decoded together",
        bounds=(("generate", "num_beams"), ("generate", "num_samples")), measure="value")
    max_processors: int = _limit(64, "processors in one generate", bounds=(("generate", "processors"),), measure="items")
    max_processor_values: int = _limit(
        65_536, "numbers and strings in the options of one generate's processors together; apart from them, "
        "those in its generation_config", bounds=(("generate", "processors"), ("generate", "generation_config")), measure="option_values")
    max_name_bytes: int = _limit(4096, "UTF-8 bytes of a session, model, saved session or chat template name or a model path",
                                 bounds=NAMES, measure="bytes")
    max_sessions: int = _limit(1024, "open sessions over all models, with the names pending forks reserve")
    max_saved_sessions: int = _limit(256, "sessions saved in the --session-dir (saving again under a name replaces it)")
    max_models: int = _limit(4, "loaded models")

    def __post_init__(self):
        for name, value in self.as_dict().items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"limit {name} must be an integer >= 1, got {value!r}")

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @staticmethod
    def docs() -> dict[str, str]:
        return {f.name: f.metadata["doc"] for f in dataclasses.fields(Limits)}

    def exceeded(self, name: str, value: int, request_id: int | None, **details) -> ProtocolError:
        """The error for `value` over the limit `name`: code `limit_exceeded`, naming the limit and both numbers."""
        limit = getattr(self, name)
        return ProtocolError(LIMIT_EXCEEDED, f"{value} is over the limit {name} = {limit} ({Limits.docs()[name]})",
                             request_id, limit=name, max=limit, value=value, **details)


def _measure(how: str, value) -> int:
    """The size of `value`, exactly: what the error reports. Every walk is bounded by the frame's size."""
    if how == "value":
        return value
    if how == "items":
        return len(value)
    if how == "bytes":
        return sum(len(text.encode("utf-8", "surrogatepass")) for text in _walk(value, keys=True) if isinstance(text, str))
    if how == "option_values":  # processors: the numbers and strings inside each entry's options; a map: its values
        options = (list(value.values()) if isinstance(value, dict)
                   else [entry.get("options") for entry in value if isinstance(entry, dict)])
        return sum(1 for leaf in _walk(options, keys=False) if isinstance(leaf, (int, float, str)) and not isinstance(leaf, bool))
    raise ValueError(f"unknown measure {how!r}")


def _walk(value, *, keys: bool):
    """Every scalar in `value`, however nested (map keys too, if `keys`), without recursing."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if keys:
                stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        else:
            yield item


# (op, param) -> [(limit, measure)], read once from the declarations ("*" for every op)
BOUNDS: dict[tuple[str, str], list[tuple[str, str]]] = {}
# op -> [("param.key", limit, measure)]: lists inside map parameters
NESTED_BOUNDS: dict[str, list[tuple[str, str, str]]] = {}
for _field in dataclasses.fields(Limits):
    for _op, _param in _field.metadata["bounds"]:
        if "." in _param:
            NESTED_BOUNDS.setdefault(_op, []).append((_param, _field.name, _field.metadata["measure"]))
        else:
            BOUNDS.setdefault((_op, _param), []).append((_field.name, _field.metadata["measure"]))


def check_params(op: str, params: dict, limits: Limits, request_id: int) -> None:
    """Raises `limit_exceeded` for the first parameter value over a limit; values are assumed well-typed,
    except inside maps (not typed yet: a nested bound measures only a list)."""
    for param, value in params.items():
        if value is None:
            continue
        for name, measure in BOUNDS.get((op, param), []) + BOUNDS.get(("*", param), []):
            size = _measure(measure, value)
            if size > getattr(limits, name):
                raise limits.exceeded(name, size, request_id, param=param)
    for path, name, measure in NESTED_BOUNDS.get(op, ()):
        outer, key = path.split(".")
        value = params.get(outer)
        value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, list) and (size := _measure(measure, value)) > getattr(limits, name):
            raise limits.exceeded(name, size, request_id, param=path)


def check_depth(value, max_depth: int, request_id: int | None, param: str, *, start: int = 1) -> None:
    """Raises `limit_exceeded` (max_depth) for maps and lists nested deeper than `max_depth`, without recursing;
    its `value` is the deepest level, found by the walk a request within the limit takes anyway.

    `start` is the level of `value` itself inside the request.
    """
    stack, deepest = [(value, start)], 0
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    if deepest > max_depth:
        raise ProtocolError(LIMIT_EXCEEDED, f"the request nests maps and lists {deepest} deep, deeper than max_depth = "
                            f"{max_depth}", request_id, limit="max_depth", max=max_depth, value=deepest, param=param)
