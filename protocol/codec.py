"""msgpack payloads: text as str, raw bytes as bin; tensors as {"dtype", "shape", "data"} maps.

A tensor travels as `{"dtype": "f32", "shape": [2, 3], "data": <bin, little-endian, row-major>}`, which is
what `Nx.from_binary(data, {:f, 32}) |> Nx.reshape(List.to_tuple(shape))` reads on the Elixir side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod

import msgpack

from .errors import INVALID_MSGPACK, INVALID_PARAMS, LIMIT_EXCEEDED, ProtocolError
from .schema import request_id_of

DECODER_DEPTH = 1024  # maps and lists nested one within another that msgpack's decoder reads, at most

# dtype name -> (bytes per element, Nx type)
DTYPES = {
    "f64": (8, "{:f, 64}"), "f32": (4, "{:f, 32}"), "f16": (2, "{:f, 16}"), "bf16": (2, "{:bf, 16}"),
    "s64": (8, "{:s, 64}"), "s32": (4, "{:s, 32}"), "s16": (2, "{:s, 16}"), "s8": (1, "{:s, 8}"),
    "u64": (8, "{:u, 64}"), "u32": (4, "{:u, 32}"), "u16": (2, "{:u, 16}"), "u8": (1, "{:u, 8}"),
}


def pack(message) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(payload: bytes, max_depth: int | None = None, max_values: int | None = None):
    """Decodes one msgpack value that must fill the payload exactly; anything else is `invalid_msgpack`.

    A payload whose only fault is a str that is not UTF-8 is still a request whose id can be read: its
    error carries that id (and says where the str is), so the client waiting on it gets its reply. So is
    one nested deeper than msgpack's decoder reads (`DECODER_DEPTH`): valid msgpack over the limit
    `max_depth`, whose error names that limit. So is a map that holds a key twice: valid msgpack, but
    which of its values was meant cannot be told (msgpack would keep the last), so it is refused once
    nothing else is wrong with the payload. With `max_values`, one that holds more maps, lists and elements
    of them together is `limit_exceeded`, found as it is decoded: a 16 MiB frame of empty maps took 2.7 GB."""
    try:
        return _decode(payload, max_depth, _unique_keys, max_values)
    except _RepeatedKey:
        _decode(payload, max_depth, None, max_values)  # raises the error of any other fault, as for a payload without repeats
        raise _repeated_key(payload) from None


class _TooManyValues(Exception):
    pass


class _Tally:
    """Counts a payload's maps and lists and their elements as msgpack builds them, and stops it past `most`."""

    def __init__(self, most: int, pairs_hook):
        self.most, self.left, self.pairs_hook = most, most, pairs_hook or dict

    def pairs(self, pairs: list):
        self._take(len(pairs))
        return self.pairs_hook(pairs)

    def list(self, items: list) -> list:
        self._take(len(items))
        return items

    def _take(self, count: int) -> None:
        self.left -= count + 1
        if self.left < 0:
            raise _TooManyValues


def _decode(payload: bytes, max_depth: int | None, pairs_hook, max_values: int | None = None):
    counting = {}
    if max_values is not None:  # msgpack's own lengths refuse one long list or map before it is made
        tally = _Tally(max_values, pairs_hook)
        counting = {"object_pairs_hook": tally.pairs, "list_hook": tally.list, "max_array_len": max_values,
                    "max_map_len": max_values}
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True,
                               **{"object_pairs_hook": pairs_hook, **counting})
    except _TooManyValues:
        raise _too_many_values(payload, max_values) from None
    except msgpack.exceptions.StackError as error:
        raise ProtocolError(LIMIT_EXCEEDED, f"the request nests maps and lists more than {DECODER_DEPTH} deep, deeper "
                            f"than the decoder reads (limit max_depth)", peek_request_id(payload), limit="max_depth",
                            **({} if max_depth is None else {"max": max_depth}), value=DECODER_DEPTH + 1) from error
    except UnicodeDecodeError as error:
        raise _not_utf8(payload, error) from error
    except TypeError as error:  # a map or list used as a map key: valid msgpack, but no Python map can hold it
        raise ProtocolError(INVALID_MSGPACK, f"map keys must be strings, numbers, booleans or nil ({error})") from error
    except ValueError as error:  # ExtraData and FormatError among them
        if max_values is not None and re.search(r"exceeds max_(array|map)_len", str(error)):
            raise _too_many_values(payload, max_values) from None
        raise _invalid(error) from error


def _too_many_values(payload: bytes, max_values: int) -> ProtocolError:
    return ProtocolError(LIMIT_EXCEEDED, f"the request holds more than {max_values} maps, lists and elements of them "
                         f"together (limit max_values)", peek_request_id(payload), limit="max_values",
                         max=max_values, value=max_values + 1)


def _invalid(error: Exception) -> ProtocolError:
    return ProtocolError(INVALID_MSGPACK, f"the frame is not one valid msgpack value ({type(error).__name__}: "
                         f"{error or 'malformed data'})")


class _RepeatedKey(Exception):
    pass


def _unique_keys(pairs: list) -> dict:
    mapping = dict(pairs)
    if len(mapping) != len(pairs):
        raise _RepeatedKey
    return mapping


class _Pairs(list):
    """A decoded map kept as its (key, value) pairs, repeated keys included."""


def _repeated_key(payload: bytes) -> ProtocolError:
    """The `invalid_params` error of a payload, valid but for a map holding a key twice: it names the key
    and where the map is, and carries the request's id when the request map holds "id" once."""
    message = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True, object_pairs_hook=_Pairs)
    ids = [value for key, value in message if key == "id"] if isinstance(message, _Pairs) else []
    rid = request_id_of({"id": ids[0]}) if len(ids) == 1 else None
    path, (first, again) = _first_fault(message, lambda value: isinstance(value, _Pairs) and _first_repeated(value))
    what = (f"the key {_key_text(again)} more than once" if _key_text(first) == _key_text(again) else
            f"the keys {_key_text(first)} and {_key_text(again)}, one key to Python")
    return ProtocolError(INVALID_PARAMS, f"the map at {path or 'the top'} holds {what}", rid,
                         param=_path_text(path, again))


def _first_repeated(pairs: _Pairs) -> tuple | None:
    """(the key seen first, the key equal to it seen later) for the first key a map holds twice, else None.
    Every key is hashable here: the payload decoded into dicts."""
    seen = {}
    for key, _ in pairs:
        if key in seen:
            return seen[key], key
        seen[key] = key
    return None


def _first_fault(value, fault) -> tuple[tuple, object] | None:
    """(the path, as nested (parent, key or index) pairs, to the first value in order for which `fault`
    is true, and what it returned), or None. Paths are built as links, and rendered only for the value
    found: rendering each as it was pushed took memory of the items times their depth."""
    pending = [(value, ())]
    while pending:
        value, path = pending.pop()
        found = fault(value)
        if found:
            return path, found
        if isinstance(value, (dict, _Pairs)):
            pairs = list(value.items()) if isinstance(value, dict) else value
            pending += [(item, (path, key)) for key, item in reversed(pairs)]
        elif isinstance(value, list):
            pending += [(item, (path, [index])) for index, item in reversed(list(enumerate(value)))]
    return None


MAX_PATH_CHARS = 512  # a path in an error, at most; a key of it, at most 64 characters


_NO_KEY = object()


def _path_text(path: tuple, last=_NO_KEY) -> str:
    """`processors[0].options.pattern`, from `_first_fault`'s links (and a last key, if given)."""
    parts = [] if last is _NO_KEY else [last]
    while path:
        path, part = path
        parts.append(part)
    text = ""
    for part in reversed(parts):
        text += f"[{part[0]}]" if isinstance(part, list) else f"{'.' if text else ''}{_key_text(part, quoted=False)}"
    return text if len(text) <= MAX_PATH_CHARS else text[:200] + "..." + text[-(MAX_PATH_CHARS - 203):]


def _key_text(key, quoted: bool = True) -> str:
    """A map key as msgpack writes it: true, nil, 1.5, a str (quoted in prose), bin as hex."""
    if isinstance(key, str):
        key = key if len(key) <= 64 else key[:61] + "..."
        return repr(key) if quoted else key
    if key is None or isinstance(key, bool):
        return {None: "nil", True: "true", False: "false"}[key]
    if isinstance(key, bytes):
        return f"bin {key[:32].hex()}{'...' if len(key) > 32 else ''}"
    return str(key)


def _not_utf8(payload: bytes, error: UnicodeDecodeError) -> ProtocolError:
    """The `invalid_msgpack` error of a payload with a str that is not UTF-8, attributed to its request
    when the rest decodes (each undecodable byte read as a lone surrogate, U+DC80-U+DCFF)."""
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True, unicode_errors="surrogateescape")
    except Exception:  # something else is wrong with it too
        message, where = None, ""
    else:
        where = _where_undecodable(message)
    return ProtocolError(INVALID_MSGPACK, f"a str{where} is not valid UTF-8 ({error.reason} at byte {error.start} of it); "
                                          f"text travels as UTF-8, bytes as bin", request_id_of(message))


def _where_undecodable(value) -> str:
    """' at <path>' of the first str (value or map key) holding a byte read as a lone surrogate, or ''."""
    def undecodable(item):
        if isinstance(item, str):
            return "value" if _UNDECODABLE.search(item) else None
        if isinstance(item, dict) and any(isinstance(key, str) and _UNDECODABLE.search(key) for key in item):
            return "key"
        return None

    found = _first_fault(value, undecodable)
    if found is None:
        return ""
    path, where = found
    return f" {'at' if where == 'value' else 'in a map key at'} {_path_text(path) or 'the top'}"


_UNDECODABLE = re.compile("[\udc80-\udcff]")


def peek_request_id(head: bytes) -> int | None:
    """The "id" of a request map from the first bytes of its payload, if it can be read there; else None.

    Used for a frame too large to read: its body is discarded, but the error still reaches the request's
    caller whenever the id comes before any large value (Elixir and most encoders put short keys first).
    """
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(head), 1))
    unpacker.feed(head)
    try:
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "id":
                return request_id_of({"id": unpacker.unpack()})
            unpacker.skip()
    except (msgpack.exceptions.OutOfData, ValueError, TypeError, msgpack.exceptions.StackError):
        pass
    return None


@dataclass(frozen=True)
class Tensor:
    """A tensor on the wire, independent of any array library."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown tensor dtype {self.dtype!r}; valid: {', '.join(DTYPES)}")
        if any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise ValueError(f"tensor shape must be non-negative integers, got {self.shape!r}")
        expected = DTYPES[self.dtype][0] * prod(self.shape)
        if len(self.data) != expected:
            raise ValueError(f"a {self.dtype} tensor of shape {list(self.shape)} needs {expected} bytes, got {len(self.data)}")

    def to_wire(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "data": self.data}

    @classmethod
    def from_wire(cls, value) -> "Tensor":
        if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data"}:
            raise ValueError("a tensor is a map with exactly dtype, shape and data")
        if not isinstance(value["data"], bytes) or not isinstance(value["shape"], list):
            raise ValueError("tensor data must be bin and shape a list")
        return cls(value["dtype"], tuple(value["shape"]), value["data"])
