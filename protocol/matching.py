"""The structure language of the golden vectors: what a reply must look like, not byte for byte.

A plain value must be equal; a map matches when each of its keys matches (extra keys are allowed, so
the protocol can grow); a list matches element by element. Special forms:
  {"$type": "int" | "uint" | "str" | "bool" | "map" | "list" | "null" | "number" | "bin"}
  {"$each": M}             a list whose every element matches M
  {"$len": N}, {"$min_len": N}
  {"$contains": [M, ...]}  a list holding, for each M, an element that matches it
  {"$one_of": [v, ...]}    equal to one of the v
  {"$all": [M, ...]}       matches every M
"""

from __future__ import annotations

TYPES = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "uint": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "map": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bin": lambda v: isinstance(v, bytes),
}


def mismatch(pattern, value, path: str = "$") -> str | None:
    """None when `value` matches `pattern`, else a description of the first difference."""
    if isinstance(pattern, dict) and pattern and all(k.startswith("$") for k in pattern):
        for form, arg in pattern.items():
            problem = _special(form, arg, value, path)
            if problem:
                return problem
        return None
    if isinstance(pattern, dict):
        if not isinstance(value, dict):
            return f"{path}: expected a map, got {value!r}"
        for key, sub in pattern.items():
            if key not in value:
                return f"{path}: missing key {key!r}"
            problem = mismatch(sub, value[key], f"{path}.{key}")
            if problem:
                return problem
        return None
    if isinstance(pattern, list):
        if not isinstance(value, list) or len(value) != len(pattern):
            return f"{path}: expected a list of {len(pattern)}, got {value!r}"
        for i, (p, v) in enumerate(zip(pattern, value)):
            problem = mismatch(p, v, f"{path}[{i}]")
            if problem:
                return problem
        return None
    if type(pattern) is not type(value) or pattern != value:
        return f"{path}: expected {pattern!r}, got {value!r}"
    return None


def _special(form: str, arg, value, path: str) -> str | None:
    if form == "$type":
        return None if TYPES[arg](value) else f"{path}: expected {arg}, got {value!r}"
    if form == "$each":
        if not isinstance(value, list):
            return f"{path}: expected a list, got {value!r}"
        return next((p for i, v in enumerate(value) if (p := mismatch(arg, v, f"{path}[{i}]"))), None)
    if form == "$len":
        return None if isinstance(value, (list, str)) and len(value) == arg else f"{path}: expected length {arg}, got {value!r}"
    if form == "$min_len":
        return None if isinstance(value, (list, str)) and len(value) >= arg else f"{path}: expected length >= {arg}, got {value!r}"
    if form == "$contains":
        missing = [m for m in arg if not isinstance(value, list) or all(mismatch(m, v) for v in value)]
        return f"{path}: missing {missing!r}" if missing else None
    if form == "$one_of":
        return None if value in arg else f"{path}: expected one of {arg!r}, got {value!r}"
    if form == "$all":
        return next((p for p in (mismatch(m, value, path) for m in arg) if p), None)
    raise ValueError(f"unknown matcher form {form!r}")
