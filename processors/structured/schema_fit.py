"""Whether outlines-core compiles a JSON schema exactly, and if not, why: the choice of `JsonSchema`'s backend.

outlines-core turns a schema into one regular expression, hence a token automaton whose masks cost a lookup
per step. But it compiles one keyword of each schema object, the first it holds of `READ_FIRST`, and only
part of JSON Schema: it ignores numeric bounds, `uniqueItems`, `not` and more without a word, reads `oneOf`
as `anyOf`, writes a string `pattern` into the JSON text unescaped, and expands "any value" (`{}`, an object
or array with no schema for its members) into a regex so large that `{}` does not compile in 10 s.
A schema that needs any of these is run by llguidance instead, which parses JSON with a grammar and refuses
what it cannot enforce. `dfa_obstacle` says which: None, or the first reason found.
"""

from __future__ import annotations

import json
import re

from .anchors import alternates_at_top, class_read_differently

INSTANCES = frozenset({"const", "default", "enum", "examples"})  # keywords whose values are JSON values, not schemas
MAX_REF_DEPTH = 2  # $refs within $refs that outlines-core is left to follow
DEFINITIONS = frozenset({"$defs", "definitions"})
# outlines-core reads one of these in a schema object, the first it holds, and compiles it alone.
READ_FIRST = ("properties", "allOf", "anyOf", "oneOf", "prefixItems", "enum", "const", "$ref", "type")
# Keywords whose values map names to schemas.
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# The keywords of JSON Schema (2020-12 and the drafts before it) that say which values are valid; any other
# key (an annotation, or a keyword of no vocabulary) is ignored by validators, and here.
ASSERTIONS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "maxContains",
    "minContains", "contains", "maxProperties", "minProperties", "required", "dependentRequired", "dependencies",
    "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas", "prefixItems", "items",
    "additionalItems", "unevaluatedItems", "properties", "patternProperties", "additionalProperties",
    "propertyNames", "unevaluatedProperties", "$ref", "$dynamicRef", "$recursiveRef",
})
# What outlines-core reads as counts: it writes one that is not a plain integer (2.0, which JSON Schema takes
# as 2) as {0,}, unbounded, and so one at 2^64 or past it (below, it writes the count, which its regex
# engine then refuses when too large for it).
COUNTS = frozenset({"minLength", "maxLength", "minItems", "maxItems"})
MAX_COUNT = 2**64
# What outlines-core enforces of each type, read beside `type` (a keyword of another type is moot there).
_BY_TYPE = {
    "string": {"minLength", "maxLength", "pattern"},
    "number": set(), "integer": set(), "boolean": set(), "null": set(),
    "object": {"additionalProperties"},  # min/maxProperties: read, then written as {0,} (not enforced)
    "array": {"items", "minItems", "maxItems"},
}
_OF_TYPE = {keyword: kind for kind, keywords in _BY_TYPE.items() for keyword in keywords} | {
    "multipleOf": "number", "maximum": "number", "exclusiveMaximum": "number", "minimum": "number",
    "exclusiveMinimum": "number", "format": "string", "uniqueItems": "array", "contains": "array",
    "maxContains": "array", "minContains": "array", "prefixItems": "array", "additionalItems": "array",
    "unevaluatedItems": "array", "required": "object", "dependentRequired": "object", "properties": "object",
    "patternProperties": "object", "propertyNames": "object", "unevaluatedProperties": "object",
    "minProperties": "object", "maxProperties": "object",
}
_OF_TYPE_TOO = {"integer": "number"}  # the number keywords apply to integers too


def dfa_obstacle(schema: dict, validator) -> str | None:
    """Why outlines-core would not compile `schema` exactly (None: it would). `validator` is the schema's
    own, from jsonschema, for the values an enum or a const lists. Walks every schema a compiled one can
    reach through the keywords outlines-core reads, and the `$defs`.

    The walk reads keywords in their 2020-12 shapes, which the schema's own metaschema does not ensure
    under an older `$schema` (draft 3's `required: true`; `$defs` or `prefixItems`, unchecked by draft 7's):
    a keyword of another shape is a reason too, and llguidance, which reads 2020-12 shapes as well, says
    whether it runs the schema."""
    try:
        return _walk(schema, validator)
    except (TypeError, AttributeError, KeyError) as problem:
        return f"a keyword of a shape outlines-core does not read ({type(problem).__name__}: {str(problem)[:80]})"


def _walk(schema: dict, validator) -> str | None:
    if (reason := _refs_obstacle(schema)) is not None:
        return reason
    if any("$id" in node for node in schema_objects(schema) if node is not schema):
        return "an $id inside the schema (a $ref under it resolves against it, which outlines-core does not do)"
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            return "a schema that is true or false, not an object"
        reason, children = _node(node, validator)
        if reason is not None:
            return reason
        stack.extend(children)
    return None


def _node(node: dict, validator) -> tuple[str | None, list]:
    """(why not, None if none; the schemas beneath it to look at next)."""
    children = [child for key in DEFINITIONS if isinstance(node.get(key), dict)
                for child in node[key].values()]
    asserted = {key for key in set(node) & ASSERTIONS if not asserts_nothing(key, node[key])}
    read = next((key for key in READ_FIRST if key in node), None)
    counts = [key for key in COUNTS & set(node) if not _plain_count(node[key])]
    if counts:
        return f"{_listed(set(counts))} not a plain integer below 2^64 (outlines-core writes it unbounded)", []
    if read is None:
        return ("a schema that allows any JSON value (slow to compile)" if not asserted else
                f"{_listed(asserted)} without a type, properties, items or a combinator"), []
    if read in ("enum", "const"):
        return _listed_values(node, read, validator), children
    types = node["type"] if isinstance(node.get("type"), list) else [node.get("type", _OF_TYPE.get(read))]
    if read == "properties":
        properties = node["properties"]
        unread = asserted - {"properties", "type", "required", "additionalProperties"}
        required = node.get("required", [])
        if "object" not in types:
            unread.add("type")
        if unread:
            return _beside(read, unread), []
        if any(key not in properties for key in required):
            return "a required property that its properties do not list", []
        if any(any(c in key for c in '"\\') or any(ord(c) < 32 for c in key) for key in properties):
            return "a property name holding a quote, a backslash or a control character (written unescaped)", []
        return None, children + list(properties.values())
    if read == "prefixItems":
        unread = asserted - {"prefixItems", "type", "items"} | ({"type"} if "array" not in types else set())
        return (_beside(read, unread) if unread else None), children + list(node["prefixItems"])
    if read != "type":  # a combinator or a $ref, compiled alone
        if read == "oneOf":
            return "oneOf, which outlines-core reads as anyOf", []
        if read == "allOf" and len(node["allOf"]) > 1:
            return "an allOf of several schemas (outlines-core writes them one after the other)", []
        unread = asserted - {read}
        return (_beside(read, unread) if unread else None), children + (node[read] if read != "$ref" else [])
    reason = _typed(node, types, asserted)
    if reason is not None:
        return reason, []
    if "object" in types and isinstance(node.get("additionalProperties"), dict):
        children.append(node["additionalProperties"])
    if "array" in types and "items" in node:
        children.append(node["items"])
    return None, children


def _refs_obstacle(schema: dict) -> str | None:
    """outlines-core follows a `$ref` only to a plain local pointer (`#/$defs/a`, not `#/$defs/a~1b`), and
    only `MAX_REF_DEPTH` deep: past that it drops the property that goes deeper, required or not, so a
    recursive schema, or refs chained too deep, made texts that break the schema."""
    refs_under: dict[int, list[str]] = {}  # id of a node: the $refs in it, not counting $defs nor their targets
    fine: set[tuple[str, int]] = set()  # (ref, level) already followed to its end within the depth

    def refs_in(node) -> list[str]:
        if id(node) not in refs_under:
            refs_under[id(node)] = [item["$ref"] for item in schema_objects(node, skip=DEFINITIONS)
                                    if isinstance(item.get("$ref"), str)]
        return refs_under[id(node)]

    def too_deep(refs: list[str], level: int) -> str | None:
        for ref in refs:
            if (ref, level) in fine:
                continue
            target = _local_target(schema, ref)
            if target is None:
                return (f"a $ref to anything but the root or one of its $defs ({ref[:60]}): outlines-core cannot "
                        f"follow it, or these checks do not read it")
            inner = refs_in(target)
            if inner and level == MAX_REF_DEPTH:
                return (f"$refs nested more than {MAX_REF_DEPTH} deep, or a recursive one (outlines-core unrolls them "
                        f"a few levels and then drops what goes deeper)")
            if (reason := too_deep(inner, level + 1)) is not None:
                return reason
            fine.add((ref, level))
        return None

    return too_deep(refs_in(schema), 1)


def schema_objects(schema, skip=frozenset()):
    """Every schema object in `schema`, itself included (depth first, not under a keyword of `skip`): through
    keywords that hold schemas, lists of them, and maps of names to them, never into a JSON value (an enum's)."""
    stack = [(schema, False)]  # (item, whether its keys are names, each of a schema)
    while stack:
        item, named = stack.pop()
        if isinstance(item, dict) and named:
            stack.extend((child, False) for child in item.values())
        elif isinstance(item, dict):
            yield item
            stack.extend((child, key in NAMED_SCHEMAS) for key, child in item.items()
                         if key not in INSTANCES and key not in skip)
        elif isinstance(item, list):
            stack.extend((child, False) for child in item)


def _local_target(schema: dict, ref: str):
    """The schema a `$ref` names if it is the root (`#`) or an entry of the root's `$defs` or `definitions`
    with no escape in its name (outlines-core takes none): the schemas `dfa_obstacle` walks. None otherwise."""
    if ref == "#":
        return schema
    keyword, _, name = ref[2:].partition("/") if ref.startswith("#/") else ("", "", "")
    if keyword not in ("$defs", "definitions") or not name or any(c in name for c in "/~%"):
        return None
    defs = schema.get(keyword)
    return defs.get(name) if isinstance(defs, dict) else None


def _typed(node: dict, types: list, asserted: set) -> str | None:
    """Why a schema object read by its `type` alone is not compiled exactly."""
    enforced = {"type"}.union(*(_BY_TYPE.get(kind, set()) for kind in types))
    moot = {keyword for keyword in asserted if keyword in _OF_TYPE and _OF_TYPE[keyword] not in types
            and not any(_OF_TYPE_TOO.get(kind) == _OF_TYPE[keyword] for kind in types)}
    unread = asserted - enforced - moot
    if unread:
        return f"{_listed(unread)}, which outlines-core does not enforce"
    if "string" in types:
        if "pattern" in node and ({"minLength", "maxLength"} & asserted):
            return "a string pattern beside minLength/maxLength (outlines-core drops the pattern)"
        if "pattern" in node and not _pattern_fits(node["pattern"]):
            return ("a string pattern with one anchor, an alternation outside a group, or that may match a quote, "
                    "a backslash or a control character (outlines-core writes its match unescaped between quotes)")
    if "object" in types and not isinstance(node.get("additionalProperties"), dict):
        return ("an object with no properties and no schema for its members (any object: outlines-core's "
                "expansion of it takes seconds to compile)")
    if "array" in types and not isinstance(node.get("items"), dict):
        return "an array with no schema for its items (any array: slow to compile)"
    return None


def _plain_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_COUNT


def _listed_values(node: dict, read: str, validator) -> str | None:
    """An enum or a const is compiled alone: exact when every value it lists is valid against the object."""
    from jsonschema.exceptions import best_match
    from referencing.exceptions import Unresolvable

    values = node["enum"] if read == "enum" else [node["const"]]
    # each value against the keywords beside the enum and the const (against the enum too, n values took n^2
    # comparisons: 15,000 held the server 80 s), its patterns matched whole as both backends match them
    beside = validator.evolve(schema=read_alike({key: value for key, value in node.items()
                                                 if key not in ("enum", "const")}))
    for value in values if isinstance(values, list) else []:
        try:
            error = best_match(beside.iter_errors(value))
        except Unresolvable as problem:  # a $dynamicRef beside it to nowhere ($refs are followed first)
            return f"a reference beside the {read} that does not resolve ({str(problem)[:80]})"
        except re.error as problem:  # Python's re refuses (?i) inside ^(?:...)$, where Rust's regex takes it
            return f"a pattern beside the {read} that Python's re cannot match whole ({str(problem)[:80]})"
        if error is not None:
            return f"the {read} value {json.dumps(value)[:60]} is not valid against the keywords beside it"
    return None


def _pattern_fits(pattern: str) -> bool:
    """Whether outlines-core writes exactly the strings a `pattern` matches whole (as both backends take it,
    see `json_schema`). It strips a leading ^ with a trailing $ and writes the rest between quotes,
    unescaped. So the pattern fits when it has both those anchors or none (and none elsewhere), no
    alternative left bare (the quotes would go to the alternatives), and every text it matches is plain JSON
    string content: no quote, backslash or control character, read by Python's regex parser, which takes
    the syntax both share. Anything the parser cannot read does not fit."""
    if class_read_differently(pattern):
        return False
    try:
        import re._parser as parser
        import warnings
        from re import _constants as sre

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its FutureWarnings, on the server's stderr
            parsed = parser.parse(pattern)
    except Exception:
        return False
    if parsed.state.flags & ~sre.SRE_FLAG_UNICODE:  # (?i), (?x)...: meant differently by Rust's regex
        return False
    items = list(parsed)
    if pattern.startswith("^") and pattern.endswith("$") and len(items) >= 2 \
            and items[0] == (sre.AT, sre.AT_BEGINNING) and items[-1] == (sre.AT, sre.AT_END):
        items = items[1:-1]
    if alternates_at_top(pattern):
        return False
    plain = {sre.CATEGORY_DIGIT}  # not \w: Rust's takes combining marks and joiners, Python's does not
    stack = items
    while stack:
        op, value = stack.pop()
        if op is sre.LITERAL:
            ok = _plain_char(value)
        elif op is sre.IN:
            ok = all((kind is sre.LITERAL and _plain_char(v)) or (kind is sre.RANGE and _plain_range(*v))
                     or (kind is sre.CATEGORY and v in plain) for kind, v in value)
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
            stack.extend(value[2])
            ok = True
        elif op is sre.SUBPATTERN:
            ok = not value[1] and not value[2]  # no flags set or cleared inside
            stack.extend(value[3])
        elif op is sre.BRANCH:
            stack.extend(item for branch in value[1] for item in branch)
            ok = True
        else:  # ., a negated class or literal, \s, an anchor inside, a look-around, a back-reference
            ok = False
        if not ok:
            return False
    return True


def _plain_char(code: int) -> bool:
    return code >= 0x20 and code not in (0x22, 0x5C)


def _plain_range(low: int, high: int) -> bool:
    return low >= 0x20 and not low <= 0x22 <= high and not low <= 0x5C <= high


def _beside(read: str, unread: set) -> str:
    return f"{_listed(unread)} beside {read}, which outlines-core compiles alone"


def _listed(keywords: set) -> str:
    return ", ".join(sorted(keywords))


def asserts_nothing(keyword: str, value) -> bool:
    """Whether a keyword's value allows every instance: `uniqueItems: false`, `unevaluatedProperties: true`,
    `propertyNames: {}`, `dependentRequired: {}`... Validators ignore it, and so does the choice of backend;
    llguidance refuses these keywords whatever their value ("Unimplemented keys"), so its copy leaves them
    out (`read_alike`)."""
    if keyword == "uniqueItems":
        return value is False
    if keyword in ("unevaluatedProperties", "unevaluatedItems", "propertyNames", "additionalItems"):
        return value is True or value == {}
    return keyword in ("dependentRequired", "dependentSchemas") and value == {}


def read_alike(node, named: bool = False):
    """A copy of a schema that both backends read as validators do. Its string patterns match only whole
    strings: `^(?:pattern)$`. JSON Schema finds a pattern anywhere in the string, which outlines-core does
    not; matched whole, `"[0-9]{5}"` means the same on both backends, and what it allows still validates.
    Keywords that assert nothing (`asserts_nothing`) are left out. (Recursive: the schema passed jsonschema's
    own recursive check, which takes more frames a level.)"""
    if isinstance(node, list):
        return [read_alike(child) for child in node]
    if not isinstance(node, dict):
        return node
    if named:
        return {key: read_alike(child) for key, child in node.items()}
    copy = {key: child if key in INSTANCES else read_alike(child, key in NAMED_SCHEMAS)
            for key, child in node.items() if not asserts_nothing(key, child)}
    if isinstance(copy.get("pattern"), str):
        copy["pattern"] = f"^(?:{copy['pattern']})$"
    return copy
