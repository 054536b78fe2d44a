"""`JsonSchema`: the generated text is JSON valid against a schema, run by whichever backend enforces it.

A schema outlines-core compiles exactly (see `schema_fit`) becomes a token automaton, as a regex does:
masks at the cost of a lookup per step. Any other schema is run by llguidance's JSON grammar, which parses
the text as it grows and refuses, at configure time, what it cannot enforce (`not`, `uniqueItems`, a `oneOf`
whose branches may overlap...). The user names only the schema.
"""

from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass
from typing import ClassVar

from .. import checks
from ..contract import option
from ..errors import InvalidOption
from .anchors import class_read_differently
from .constraints import MAX_PATTERN_CHARS, _compile_timeout, _pattern
from .grammar import RunByLlguidance
from .regular import RegularConstraint
from .schema_fit import dfa_obstacle, read_alike, schema_objects

CHECKED_SCHEMAS = 256  # schema texts remembered as valid: at most 256 x max_pattern_chars (100 KB) held
# Maps and lists nested in a schema, the schema itself level 1. The checks after it recurse a few frames a
# level (jsonschema's own, for an enum's values); real schemas nest under 20 (the protocol's max_depth, 32
# for the whole request, comes first there).
MAX_SCHEMA_DEPTH = 64


@checks._with_schema({"anyOf": [{"type": "object"}, {"type": "string"}]})
def _schema(name, value) -> str:
    """A JSON schema given as a map or as JSON text, kept as JSON text in the order it was declared (the
    order of `properties` is the order the generated object writes its keys in)."""
    if isinstance(value, str):
        _pattern(name, value)
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as error:
            raise InvalidOption(f"option {name!r} is not valid JSON: {str(error)[:200]}") from None
    if not isinstance(value, dict):  # a boolean schema (true: any JSON at all, false: none) has no automaton
        raise InvalidOption(f"option {name!r} must be a JSON schema (an object), got {checks._shown(value)}")
    # before json.dumps, which would turn a key 1 into "1" silently (next to a "1" of its own), never end on
    # a cycle, and write a much-shared object out every time
    _check_writable_as_json(name, value)
    try:  # a map from msgpack may hold what JSON cannot (bytes, NaN)
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InvalidOption(f"option {name!r} is not JSON: {error}") from None
    _pattern(name, text)  # before the checks, which took 3-4 s on a schema of 300 KB
    _check_schema(name, text)
    return text


@functools.lru_cache(maxsize=CHECKED_SCHEMAS)
def _check_schema(name: str, text: str) -> None:
    """Refuses a schema that is not valid against its metaschema, or holds what neither backend enforces
    (`_check_values`). Remembered for schemas found valid (a failure raises, and is not): a client sends
    its schema with every request. The text is the key: equal texts are equal schemas."""
    value = json.loads(text)
    problem = _metaschema_problem(value)
    if problem is not None:
        message, path = problem
        raise InvalidOption(f"option {name!r} is not a valid JSON schema: {message[:300]}{_at(path)}")
    _check_values(name, value)


def _metaschema_problem(schema: dict) -> tuple[str, list] | None:
    """What the schema's metaschema refuses in it first, and where, or None. A `$schema` that is no string
    names no draft (jsonschema's lookup of it raised AttributeError): the latest draft's metaschema refuses it."""
    import jsonschema

    with warnings.catch_warnings():  # Python's re warns of a nested set in a pattern, on the server's stderr
        warnings.simplefilter("ignore", FutureWarning)
        validator = (jsonschema.validators.validator_for(schema) if isinstance(schema.get("$schema", ""), str)
                     else jsonschema.validators.Draft202012Validator)
        fast = _metaschema_validator(validator)
        if fast is not None:
            error = next(fast.iter_errors(schema), None)
            return None if error is None else (error.message, error.instance_path)
        try:
            validator.check_schema(schema)
        except jsonschema.SchemaError as error:
            return error.message, list(error.path)
    return None


# The formats the metaschemas of every draft name (a `pattern` is a regex, a `$ref` a URI reference...).
METASCHEMA_FORMATS = ("regex", "uri", "uri-reference")


@functools.cache
def _metaschema_validator(validator):
    """jsonschema-rs's validator of the metaschema of `validator` (a jsonschema validator class), or None
    for the one draft it does not know (draft 3, which jsonschema checks). jsonschema's `check_schema` is
    pure Python, and walks the metaschema's dynamic references at every node: 1.3-1.4 s on a schema of
    `max_pattern_chars` (4,000 `anyOf` branches, 2,000 properties), held on the server's main thread;
    jsonschema-rs takes 2 ms. The formats the metaschema names are read by jsonschema's own checker of the
    draft, as `check_schema` reads them (a `pattern` is compiled by Python's re), and nothing is fetched:
    the drafts' metaschemas are built into jsonschema-rs."""
    import jsonschema_rs

    checker = validator.FORMAT_CHECKER
    formats = {name: functools.partial(_conforms, checker, name) for name in METASCHEMA_FORMATS}
    try:
        return jsonschema_rs.validator_for(validator.META_SCHEMA, formats=formats, validate_formats=True, offline=True)
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError):
        return None


def _conforms(checker, format_name: str, value) -> bool:
    return checker.conforms(value, format_name)


def _at(path) -> str:
    """Where in the schema a problem is, as a JSON pointer (nothing at the top)."""
    keys = list(path)
    return f" (at {_pointer_of(keys)})" if keys else ""


def _check_writable_as_json(name: str, schema) -> None:
    """Refuses what JSON cannot write, or not within `max_pattern_chars`: a map anywhere in the schema with
    a key that is not a string (msgpack allows them, JSON does not), named by its JSON pointer; and, from
    Python, a schema that contains itself (a cycle) or whose objects are shared so often that, each written
    out every time, it passes the limit. Paths are built only for the key refused: a node holds its
    parent's link, not a copy of its path. Maps and lists nested deeper than `MAX_SCHEMA_DEPTH` are refused
    too, and an integer past a double's range (an annotation's too): Python reads and writes it, the
    backends' JSON parsers refuse it (llguidance raised ValueError, outlines-core "Expected a valid JSON
    string")."""
    stack, inside, nodes = [(schema, None, False, 1)], set(), 0  # inside: the containers on the path walked
    while stack:
        node, link, leaving, depth = stack.pop()
        if leaving:
            inside.discard(id(node))
            continue
        if id(node) in inside:
            raise InvalidOption(f"option {name!r} contains itself at {_pointer(link)}: JSON cannot write a cycle")
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidOption(f"option {name!r} nests maps and lists more than {MAX_SCHEMA_DEPTH} deep, at "
                                f"{_pointer(link)} (limit max_schema_depth)")
        nodes += 1 + len(node)  # each written as one character at least
        if nodes > MAX_PATTERN_CHARS:
            raise InvalidOption(f"option {name!r} is more than {MAX_PATTERN_CHARS} characters written as JSON "
                                f"(limit max_pattern_chars)")
        inside.add(id(node))
        stack.append((node, link, True, depth))
        if isinstance(node, dict):
            for key, child in node.items():
                if not isinstance(key, str):
                    where = f"in the map at {_pointer(link)}" if link is not None else "at the top of the schema"
                    raise InvalidOption(f"option {name!r}: JSON object keys must be strings, got {checks._shown(key)} "
                                        f"({type(key).__name__}) {where}")
                if isinstance(child, (dict, list)):
                    stack.append((child, (link, key), False, depth + 1))
                elif _past_a_double(child):
                    _refuse_number(name, child, (link, key))
        else:
            for index, child in enumerate(node):
                if isinstance(child, (dict, list)):
                    stack.append((child, (link, index), False, depth + 1))
                elif _past_a_double(child):
                    _refuse_number(name, child, (link, index))


def _past_a_double(value) -> bool:
    """An integer from 2^1023 up: a double holds up to 1.8e308, but llguidance's JSON parser read one in the
    last step below that as infinity, and refused it."""
    return isinstance(value, int) and abs(value) >= 2**1023


def _refuse_number(name: str, number: int, link) -> None:
    raise InvalidOption(f"option {name!r} holds an integer of {len(str(abs(number)))} digits at {_pointer(link)}, past "
                        f"the range of a JSON number as the backends read it (a double: integers below 2^1023, 8.9e307)")


def _pointer(link) -> str:
    """The JSON pointer of a node from its chain of (parent link, key)."""
    keys = []
    while link is not None:
        link, key = link
        keys.append(key)
    return _pointer_of(reversed(keys))


def _pointer_of(keys) -> str:
    """The JSON pointer (RFC 6901) of a path of keys, each key cut to 40 characters, the whole to 200."""
    parts = []
    for key in keys:
        text = str(key)
        parts.append((text if len(text) <= 40 else text[:37] + "...").replace("~", "~0").replace("/", "~1"))
    path = "/" + "/".join(parts)
    return path if len(path) <= 200 else "..." + path[-197:]


DRAFT_3_ONLY = frozenset({"disallow", "extends", "divisibleBy"})  # read by jsonschema, by neither backend
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
MAX_BOUND = 2**53


def _check_values(name: str, schema) -> None:
    """Refuses, in any schema object, what neither backend enforces: an empty `enum`, which no value matches
    (outlines-core would write it as the empty text); draft 3's `disallow`, `extends`, `divisibleBy`; a
    `minProperties` asking for 2 or more free keys; a pattern class Rust's regex reads otherwise (in a
    `pattern` or a `patternProperties` name); and numbers at or beyond +-2^53, past the integers a JSON
    number holds exactly. llguidance clamped an integer bound past 2^63 (so `minimum: 2**63` wrote
    2^63 - 1), crashed the process on one near -2^63 while the schema was checked, and wrote
    9007199254740991.9992 under `exclusiveMaximum: 2**53`, which a float reads as 2^53; outlines-core writes
    an enum or const integer there as a float."""
    for node in schema_objects(schema):
        if node.get("enum") == []:
            raise InvalidOption(f"option {name!r}: an empty enum matches no value at all")
        if unread := DRAFT_3_ONLY & set(node):
            raise InvalidOption(f"option {name!r}: {', '.join(sorted(unread))} (draft 3) is enforced by neither backend")
        free = _free_keys_asked(node)
        if free >= 2:
            raise InvalidOption(f"option {name!r}: minProperties {node['minProperties']} asks for {free} keys beyond the "
                                f"required properties, and neither backend keeps such keys distinct (a key written "
                                f"twice counts once): list them as properties")
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += list(node["patternProperties"])
        for pattern in patterns:
            if class_read_differently(pattern):
                raise InvalidOption(f"option {name!r}: the pattern {pattern[:60]!r} has a class holding '[', '&&', '--' "
                                    f"or '~~', which the regex engine of both backends (Rust's) reads otherwise than "
                                    f"JSON Schema's: escape the character")
        for keyword in ("enum", "const"):
            if keyword in node and (big := _huge_integer(node[keyword])) is not None:
                raise InvalidOption(f"option {name!r}: the {keyword} holds {big}, at or beyond +-2^53 ({MAX_BOUND}): "
                                    f"it would be written as the nearest float")
        for keyword in BOUNDS:
            value = node.get(keyword)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) >= MAX_BOUND:
                raise InvalidOption(f"option {name!r}: {keyword} {value} is at or beyond +-2^53 ({MAX_BOUND}), past the "
                                    f"integers a JSON number holds exactly")


def _huge_integer(value) -> int | None:
    """An integer at or beyond +-2^53 anywhere in a JSON value, if there is one."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, int) and not isinstance(item, bool) and abs(item) >= MAX_BOUND:
            return item
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _free_keys_asked(node: dict) -> int:
    """How many keys an object's `minProperties` asks for beyond its listed, required properties (0 where
    the node cannot be an object, whose `minProperties` is then moot)."""
    low, kind = node.get("minProperties"), node.get("type", "object")
    if isinstance(low, float) and low.is_integer():  # 2.0 is an integer to JSON Schema
        low = int(low)
    if not isinstance(low, int) or isinstance(low, bool) or "object" not in (kind if isinstance(kind, list) else [kind]):
        return 0
    listed = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    return low - len(set(required) & set(listed))


@functools.lru_cache(maxsize=64)
def dfa_obstacle_of(schema_text: str) -> str | None:
    """`schema_fit.dfa_obstacle` of a checked schema's text, kept for the schemas last asked for: the server
    asks at every request that names one."""
    import jsonschema

    schema = json.loads(schema_text)
    return dfa_obstacle(schema, jsonschema.validators.validator_for(schema)(schema))


@functools.lru_cache(maxsize=64)
def llguidance_grammar(schema_text: str) -> str:
    """llguidance's grammar of a schema (its own format, which embeds the schema), read as outlines-core
    reads it (`read_alike`: a string `pattern` is matched whole, and keywords that assert nothing, which
    llguidance refuses, are left out), and a space or none is written where JSON allows any
    (llguidance's default, any run of spaces, tabs and newlines, lets a model spend its tokens on them)."""
    import llguidance

    whole = json.dumps(read_alike(json.loads(schema_text)), ensure_ascii=False)
    return llguidance.LLMatcher.grammar_from_json_schema(whole, defaults={"whitespace_pattern": "[ ]?"})


@dataclass(frozen=True)
class JsonSchema(RegularConstraint):
    """The generated text is JSON valid against `schema`. Compiled to a token automaton by outlines-core
    where that is exact (most schemas with typed, listed members), run by llguidance's JSON grammar
    otherwise, and over a vocabulary where the automaton's masks could not be reserved (`regular`: a
    schema of some nesting over Llama 3's 128k tokens); what neither enforces is refused when configured."""

    name: ClassVar[str] = "json_schema"
    option_name: ClassVar[str] = "schema"
    schema: str = option("the JSON schema, as a map or as JSON text", check=_schema)
    compile_timeout_s: float = _compile_timeout()

    def validate(self):
        if self.dfa_obstacle is not None:
            self.check_unless_deferred()

    @property
    def run_by_llguidance_because(self) -> str:
        if self.dfa_obstacle is not None:
            return f"outlines-core would not compile it exactly: {self.dfa_obstacle}"
        return RegularConstraint.run_by_llguidance_because.fget(self)

    @property
    def llguidance_grammar(self) -> str:
        return llguidance_grammar(self.schema)

    @property
    def dfa_obstacle(self) -> str | None:
        """Why outlines-core would not compile the schema exactly (then llguidance runs it), or None."""
        return dfa_obstacle_of(self.schema)

    def source(self):
        return ("json_schema", self.schema)  # its regex is built by the compiling child: it can be huge

    # Each of these is RegularConstraint's (the automaton's, or llguidance's where its masks could not be
    # reserved), or, for a schema outlines-core would not compile exactly, llguidance's.

    def compiled_for(self, vocabulary) -> bool:
        return self._backend.compiled_for(self, vocabulary)

    def compile_key(self):
        return self._backend.compile_key(self)

    def compile(self, vocabulary, cancelled=None):
        return self._backend.compile(self, vocabulary, cancelled)

    def bind(self, vocabulary, eos_token_ids, device="cpu", after_others=True, compiled=None):
        return self._backend.bind(self, vocabulary, eos_token_ids, device, after_others, compiled)

    @property
    def _backend(self) -> type:
        return RegularConstraint if self.dfa_obstacle is None else RunByLlguidance
