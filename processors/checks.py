"""Option checks: each validates one value and returns it normalised, or raises `InvalidOption` naming it.

They run in `__post_init__`, so an out-of-range value fails at configure time and never at step time.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

from .errors import InvalidOption


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def real(name, value) -> float:
    if not _is_real(value) or math.isnan(value):
        raise InvalidOption(f"option {name!r} must be a number, got {value!r}")
    return float(value)


def real_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False):
    """A number in an interval; the bounds are written into the error message."""
    shown = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"

    def check(name, value):
        value = real(name, value)
        too_low = value <= low if low_open else value < low
        too_high = value >= high if high_open else value > high
        if too_low or too_high:
            raise InvalidOption(f"option {name!r} must be in {shown}, got {value!r}")
        return value

    return check


def positive_real(name, value) -> float:
    value = real(name, value)
    if not value > 0 or math.isinf(value):
        raise InvalidOption(f"option {name!r} must be a finite number > 0, got {value!r}")
    return value


def int_at_least(minimum: int):
    def check(name, value):
        if not _is_int(value) or value < minimum:
            raise InvalidOption(f"option {name!r} must be an integer >= {minimum}, got {value!r}")
        return int(value)

    return check


def optional(inner):
    def check(name, value):
        return None if value is None else inner(name, value)

    return check


def token_id(name, value) -> int:
    if not _is_int(value) or value < 0:
        raise InvalidOption(f"option {name!r} must be a token id (an integer >= 0), got {value!r}")
    return int(value)


def token_ids(name, value) -> tuple[int, ...]:
    """One id or a non-empty list of ids, normalised to a tuple."""
    if _is_int(value):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not value:
        raise InvalidOption(f"option {name!r} must be a token id or a non-empty list of token ids, got {value!r}")
    return tuple(token_id(name, v) for v in value)


def token_sequences(name, value) -> tuple[tuple[int, ...], ...]:
    """A non-empty list of non-empty token-id lists."""
    if not isinstance(value, (list, tuple)) or not value:
        raise InvalidOption(f"option {name!r} must be a non-empty list of token-id lists, got {value!r}")
    out = []
    for seq in value:
        if not isinstance(seq, (list, tuple)) or not seq:
            raise InvalidOption(f"option {name!r}: each entry must be a non-empty list of token ids, got {seq!r}")
        out.append(tuple(token_id(name, v) for v in seq))
    return tuple(out)


def sequence_biases(name, value) -> tuple[tuple[tuple[int, ...], float], ...]:
    """A non-empty list of [token_ids, bias] pairs (transformers' list form of `sequence_bias`)."""
    if not isinstance(value, (list, tuple)) or not value:
        raise InvalidOption(f"option {name!r} must be a non-empty list of [token_ids, bias] pairs, got {value!r}")
    out = []
    for pair in value:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise InvalidOption(f"option {name!r}: each entry must be a [token_ids, bias] pair, got {pair!r}")
        seq, bias = pair
        out.append((token_sequences(name, [seq])[0], real(name, bias)))
    return tuple(out)
