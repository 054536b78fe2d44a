"""Option checks: each validates one value and returns it normalised, or raises `InvalidOption` naming it.

They run in `__post_init__`, so an out-of-range value fails at configure time and never at step time.
Each check also carries `schema`, the JSON Schema of the values it accepts, which `hello` publishes so
that a client in any language can validate options before sending them.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

from .errors import InvalidOption


def lone_surrogate(text: str) -> int | None:
    """Where a Python string holds a lone surrogate (None: nowhere), which it may, but which no UTF-8 text,
    nor a tokenizer or constraint compiler reading one, can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: logits are float32
FLOAT32_MAX = 3.4028234663852886e38
MAX_TOKEN_ID = 2**63 - 1  # token ids become int64 tensors


def _with_schema(schema: dict):
    def attach(check):
        check.schema = schema
        return check

    return attach


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@_with_schema({"type": "number"})
def real(name, value) -> float:
    if not _is_real(value):
        raise InvalidOption(f"option {name!r} must be a number, got {_shown(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf if value > 0 else -math.inf
    if math.isnan(number):
        raise InvalidOption(f"option {name!r} must be a number, got {_shown(value)}")
    return number


def real_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False):
    """A number in an interval; the bounds are written into the error message."""
    shown = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"

    def check(name, value):
        value = real(name, value)
        too_low = value <= low if low_open else value < low
        too_high = value >= high if high_open else value > high
        if too_low or too_high:
            raise InvalidOption(f"option {name!r} must be in {shown}, got {_shown(value)}")
        return value

    check.schema = {"type": "number", "exclusiveMinimum" if low_open else "minimum": low,
                    "exclusiveMaximum" if high_open else "maximum": high}
    return check


@_with_schema({"type": "number", "minimum": FLOAT32_TINY, "maximum": FLOAT32_MAX})
def positive_real(name, value) -> float:
    """A scale applied to float32 logits: it must be a normal float32, or dividing by it overflows at once."""
    value = real(name, value)
    if not FLOAT32_TINY <= value <= FLOAT32_MAX:
        raise InvalidOption(f"option {name!r} must be a number in [{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}] "
                            f"(positive and representable in float32), got {_shown(value)}")
    return value


def int_at_least(minimum: int):
    def check(name, value):
        if not _is_int(value) or value < minimum:
            raise InvalidOption(f"option {name!r} must be an integer >= {minimum}, got {_shown(value)}")
        return int(value)

    check.schema = {"type": "integer", "minimum": minimum}
    return check


def optional(inner):
    def check(name, value):
        return None if value is None else inner(name, value)

    check.schema = {"anyOf": [inner.schema, {"type": "null"}]}
    return check


TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
TOKEN_LIST = {"type": "array", "items": TOKEN_ID, "minItems": 1}


@_with_schema(TOKEN_ID)
def token_id(name, value) -> int:
    if not _is_int(value) or not 0 <= value <= MAX_TOKEN_ID:
        raise InvalidOption(f"option {name!r} must be a token id (an integer in [0, 2^63)), got {_shown(value)}")
    return int(value)


@_with_schema({"anyOf": [TOKEN_ID, TOKEN_LIST]})
def token_ids(name, value) -> tuple[int, ...]:
    """One id or a non-empty list of ids, normalised to a tuple."""
    if _is_int(value):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not value:
        raise InvalidOption(f"option {name!r} must be a token id or a non-empty list of token ids, got {_shown(value)}")
    return tuple(token_id(name, v) for v in value)


@_with_schema({"type": "array", "items": TOKEN_LIST, "minItems": 1})
def token_sequences(name, value) -> tuple[tuple[int, ...], ...]:
    """A non-empty list of non-empty token-id lists."""
    if not isinstance(value, (list, tuple)) or not value:
        raise InvalidOption(f"option {name!r} must be a non-empty list of token-id lists, got {_shown(value)}")
    out = []
    for seq in value:
        if not isinstance(seq, (list, tuple)) or not seq:
            raise InvalidOption(f"option {name!r}: each entry must be a non-empty list of token ids, got {_shown(seq)}")
        out.append(tuple(token_id(name, v) for v in seq))
    return tuple(out)


@_with_schema({"type": "array", "minItems": 1, "items": {
    "type": "array", "prefixItems": [TOKEN_LIST, {"type": "number", "minimum": -FLOAT32_MAX, "maximum": FLOAT32_MAX}],
    "minItems": 2, "maxItems": 2}})
def sequence_biases(name, value) -> tuple[tuple[tuple[int, ...], float], ...]:
    """A non-empty list of [token_ids, bias] pairs (transformers' list form of `sequence_bias`), or its dict
    form {(token ids...): bias} from Python (a wire map cannot have list keys)."""
    if isinstance(value, dict):
        value = list(value.items())
    if not isinstance(value, (list, tuple)) or not value:
        raise InvalidOption(f"option {name!r} must be a non-empty list of [token_ids, bias] pairs, got {_shown(value)}")
    out = []
    for pair in value:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise InvalidOption(f"option {name!r}: each entry must be a [token_ids, bias] pair, got {_shown(pair)}")
        seq, bias = pair
        bias = real(name, bias)
        if not (abs(bias) <= FLOAT32_MAX or bias == -math.inf):
            raise InvalidOption(f"option {name!r}: a bias must be -inf (to forbid) or within float32's range "
                                f"[{-FLOAT32_MAX:.4g}, {FLOAT32_MAX:.4g}], got {bias!r}")
        out.append((token_sequences(name, [seq])[0], bias))
    return tuple(out)
