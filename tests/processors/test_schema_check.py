"""The check of a JSON schema against its metaschema: jsonschema-rs's, which must say what jsonschema says."""

from __future__ import annotations

import warnings

import jsonschema
import jsonschema_specifications
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from processors import InvalidOption, configure
from processors.structured import json_schema
from processors.structured.json_schema import JsonSchema

DRAFTS = [None, "https://json-schema.org/draft/2020-12/schema", "https://json-schema.org/draft/2019-09/schema",
          "http://json-schema.org/draft-07/schema#", "http://json-schema.org/draft-06/schema#",
          "http://json-schema.org/draft-04/schema#", "https://example.com/no-such-metaschema"]
KEYWORDS = ["type", "enum", "const", "minimum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxItems",
            "pattern", "format", "items", "prefixItems", "additionalItems", "properties", "patternProperties",
            "additionalProperties", "required", "anyOf", "allOf", "oneOf", "not", "$ref", "$defs", "definitions",
            "dependencies", "dependentRequired", "uniqueItems", "$id", "$anchor", "contains", "minContains", "if",
            "then", "propertyNames", "multipleOf", "$dynamicRef", "unevaluatedProperties", "title"]
# values of every JSON type, and the ones metaschemas refuse: bad types, negative counts, fractions, regexes
# Python's re refuses ("(", "[a-"), URI references with spaces
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([2**70, 0.5, 2.0, -1.5, 1e300]),
                   st.sampled_from(["string", "integer", "strin", "(", "[a-", "a+", "(?P<n>x)", "#/$defs/x", "x y", "",
                                    "#a", "http://example.com/s"]))


def metaschema_verdicts(schema: dict) -> tuple[bool, bool]:
    """(jsonschema's check_schema passes, jsonschema-rs's check of the same metaschema passes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        validator = jsonschema.validators.validator_for(schema)
        try:
            validator.check_schema(schema)
            reference = True
        except jsonschema.SchemaError:
            reference = False
        return reference, json_schema._metaschema_validator(validator).is_valid(schema)


schemas = st.recursive(
    st.dictionaries(st.sampled_from(KEYWORDS), VALUES, max_size=3),
    lambda children: st.dictionaries(st.sampled_from(KEYWORDS),
                                     st.one_of(VALUES, children, st.lists(st.one_of(children, VALUES), max_size=3),
                                               st.dictionaries(st.sampled_from(["a", "b", "(", "^x$"]), children,
                                                               max_size=2)),
                                     max_size=4),
    max_leaves=12)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas, draft=st.sampled_from(DRAFTS))
def test_jsonschema_rs_says_what_jsonschema_says_of_a_schema(schema, draft):
    if draft is not None:
        schema = {"$schema": draft, **schema}
    reference, fast = metaschema_verdicts(schema)
    assert fast == reference, schema


@pytest.mark.parametrize("schema, valid", [
    ({"type": "strin"}, False), ({"pattern": "("}, False), ({"patternProperties": {"[a-": {}}}, False),
    ({"pattern": "(?P<a>x)"}, True), ({"minLength": 2.0}, True), ({"minLength": 2.5}, False), ({"minLength": 2**70}, True),
    ({"multipleOf": 0}, False), ({"type": []}, False), ({"$ref": "::"}, True), ({"$id": "x y"}, True),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "exclusiveMinimum": 3}, False),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "exclusiveMinimum": True, "minimum": 1}, True),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "required": []}, False),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": 5}, False),
    ({"$schema": "https://example.com/x", "type": "strin"}, False),
])
def test_the_two_checks_agree_on_what_metaschemas_refuse(schema, valid):
    assert metaschema_verdicts(schema) == (valid, valid)


def test_every_format_a_metaschema_names_is_read_by_jsonschemas_checker():
    """jsonschema-rs checks the formats it knows itself: each one a metaschema names must be handed to
    jsonschema's checker (`METASCHEMA_FORMATS`), which reads `regex` with Python's re and, without the
    optional packages, takes any URI."""
    named, stack = set(), [resource.contents for _, resource in jsonschema_specifications.REGISTRY.items()]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("format"), str):
                named.add(node["format"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    assert named and named <= set(json_schema.METASCHEMA_FORMATS)


def test_draft_3_is_checked_by_jsonschema():
    """jsonschema-rs does not know draft 3: its schemas are checked by jsonschema, as before."""
    draft_3 = jsonschema.validators.Draft3Validator
    assert json_schema._metaschema_validator(draft_3) is None
    with pytest.raises(InvalidOption, match="not a valid JSON schema: .* \\(at /properties/a/type\\)"):
        configure(JsonSchema, schema={"$schema": "http://json-schema.org/draft-03/schema#", "type": "object",
                                      "properties": {"a": {"type": 5}}})


def test_a_refusal_says_where_in_the_schema():
    with pytest.raises(InvalidOption, match="option 'schema' is not a valid JSON schema: \"strin\" is not valid "
                                            "under any of the schemas .* \\(at /properties/a/items/type\\)"):
        configure(JsonSchema, schema={"type": "object", "properties": {"a": {"type": "array", "items": {"type": "strin"}}}})
    with pytest.raises(InvalidOption, match='"\\(" is not a "regex" \\(at /properties/b/pattern\\)'):
        configure(JsonSchema, schema={"type": "object", "properties": {"b": {"type": "string", "pattern": "("}}})


def test_a_large_schema_is_not_checked_by_jsonschema(monkeypatch):
    """jsonschema's check of 4,000 anyOf branches took 1.3-1.4 s; it is not called."""
    def refused(*args, **kwargs):
        raise AssertionError("jsonschema's check_schema was called")

    monkeypatch.setattr(jsonschema.validators.Draft202012Validator, "check_schema", refused)
    configure(JsonSchema, schema={"anyOf": [{"const": f"value {i}"} for i in range(4_000)]})


def test_a_schema_64_deep_is_checked_one_deeper_is_refused():
    def nested(levels):
        schema = {"type": "integer"}
        for _ in range(levels - 1):
            schema = {"type": "array", "items": schema}
        return schema

    configure(JsonSchema, schema=nested(64))
    with pytest.raises(InvalidOption, match="more than 64 deep, at \\.\\.\\..*/items/items \\(limit max_schema_depth\\)"):
        configure(JsonSchema, schema=nested(65))
