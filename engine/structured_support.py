"""What structured output can enforce: the JSON schema keywords and regex features the grammar
(xgrammar 0.2.9, ``engine.structured_spec``) turns into a constraint, and a check that finds
the first one in a schema or pattern that it cannot. Pure Python (no xgrammar, no torch), so
the HTTP edge refuses such a request with a 400 naming the keyword's path before it reaches a
worker.

What the grammar ignores was found by converting a schema with and without each keyword and
checking outputs that break it against the grammar: ``uniqueItems``, ``not``, ``if``/``then``/
``else``, ``contains``, the ``dependent*`` keywords, the object-size and property-name keywords,
the ``content*`` keywords, the dynamic references, a ``multipleOf`` on numbers (integers' is
enforced), ``allOf`` of more than one schema, and lookaround in a ``pattern``.
"""

from __future__ import annotations

#: JSON schema keywords the grammar enforces (xgrammar 0.2.9's converter), and the annotations
#: that constrain nothing: the README's list. Every other keyword of the JSON schema vocabulary is
#: refused (``REFUSED_KEYWORDS``); a keyword outside the vocabulary is an annotation, as JSON
#: schema says.
SCHEMA_KEYWORDS = frozenset(
    {
        *("type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions"),
        *("properties", "required", "additionalProperties", "unevaluatedProperties"),
        *("items", "prefixItems", "unevaluatedItems", "minItems", "maxItems"),
        *("minLength", "maxLength", "pattern", "format"),
        *("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
        *("title", "description", "default", "examples", "$schema", "$id", "$comment"),
        *("deprecated", "readOnly", "writeOnly"),
    }
)
#: the vocabulary's keywords the grammar would ignore (xgrammar converts a schema with them into
#: a grammar that admits outputs breaking them)
REFUSED_KEYWORDS = frozenset(
    {
        *("not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains"),
        *("minProperties", "maxProperties", "patternProperties", "propertyNames"),
        *("dependentRequired", "dependentSchemas", "dependencies", "additionalItems"),
        *("contentEncoding", "contentMediaType", "contentSchema"),
        *("$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor", "$anchor", "$vocabulary"),
    }
)
#: the string formats the grammar enforces; another ``format`` is refused
SCHEMA_FORMATS = frozenset(
    {
        *("date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"),
        *("uri", "uri-reference", "json-pointer", "relative-json-pointer"),
    }
)
#: keywords whose value is one subschema, a list of subschemas, or a name -> subschema map
_ONE_SCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")


def unsupported_in_schema(schema: object, path: str = "") -> tuple[str, str, object] | None:
    """The first keyword of a JSON schema the grammar cannot enforce, as (its path in the schema,
    e.g. ``properties.xs.uniqueItems``, why, and its value), or None when every keyword is enforced:
    ``REFUSED_KEYWORDS``, a ``format`` outside ``SCHEMA_FORMATS``, a ``pattern`` with a regex
    feature of ``unsupported_in_regex``, ``allOf`` of more than one schema (the grammar keeps one)
    and ``multipleOf`` on a non-integer (only integers' is enforced)."""
    if not isinstance(schema, dict):
        return None
    where = f"{path}." if path else ""
    for key, value in schema.items():
        if key in REFUSED_KEYWORDS:
            return f"{where}{key}", "not supported", value
        if key == "format" and not (isinstance(value, str) and value in SCHEMA_FORMATS):
            return f"{where}{key}", f"not supported (supported: {', '.join(sorted(SCHEMA_FORMATS))})", value
        if key == "pattern" and isinstance(value, str) and (feature := unsupported_in_regex(value)) is not None:
            return f"{where}{key}", f"{feature} not supported", value
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            return f"{where}{key}", "not supported with more than one schema", value
        if key == "multipleOf" and schema.get("type") != "integer":
            return f"{where}{key}", 'not supported but on "type": "integer"', value
    for key in _ONE_SCHEMA:
        if (found := unsupported_in_schema(schema.get(key), f"{where}{key}")) is not None:
            return found
    for key in _SCHEMA_LISTS:
        items = schema.get(key)
        for i, item in enumerate(items if isinstance(items, list) else ()):
            if (found := unsupported_in_schema(item, f"{where}{key}.{i}")) is not None:
                return found
    for key in _SCHEMA_MAPS:
        members = schema.get(key)
        for name, item in members.items() if isinstance(members, dict) else ():
            if (found := unsupported_in_schema(item, f"{where}{key}.{name}")) is not None:
                return found
    return None


def unsupported_in_regex(pattern: str) -> str | None:
    """The first regex feature in ``pattern`` the grammar cannot enforce (a regular language has
    no lookaround or backreferences), named (``lookahead (?=``), or None."""
    i, in_class = 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            following = pattern[i + 1 : i + 2]
            if following.isdigit() and following != "0":
                return f"backreference \\{following}"
            if following == "k" and pattern[i + 2 : i + 3] == "<":
                return "named backreference \\k<...>"
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            i += 1 if pattern[i + 1 : i + 2] != "]" else 2  # a leading ] is a member
            continue
        elif char == "(":
            for opening, name in _LOOKAROUND:
                if pattern.startswith(opening, i):
                    return f"{name} {opening}"
        i += 1
    return None


_LOOKAROUND = (
    ("(?=", "lookahead"),
    ("(?!", "negative lookahead"),
    ("(?<=", "lookbehind"),
    ("(?<!", "negative lookbehind"),
)
