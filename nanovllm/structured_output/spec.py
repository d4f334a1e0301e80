"""A constraint as the grammar backends take it: one hashable value per distinct grammar text and options, so the
compiled-grammar cache and the submission checks key on it."""
import copy
import json
import re
from dataclasses import dataclass

from nanovllm.sampling_params import StructuredOutputsParams

_OBJECT_SCHEMA = '{"type": "object"}'
# Where a schema holds subschemas: maps of them, and keywords whose value is one or a list. `not` and `if`/`then`/`else`
# are left alone: closing an object inside a negation or a condition would change what the whole lets through.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "items", "prefixItems",
               "additionalItems", "unevaluatedItems", "allOf", "anyOf", "oneOf")
_OBJECT_RULES = ("additionalProperties", "unevaluatedProperties")  # a schema that says what other keys may do
_ARRAY_RULES = ("items", "additionalItems", "unevaluatedItems")  # ... or what items past `prefixItems` may be


@dataclass(frozen=True)
class GrammarSpec:
    """`kind` is "json" (`text`: the schema), "regex", "choice" (`text`: the choices as a JSON list), "grammar"
    (Lark, or EBNF / GBNF: `grammar_syntax`) or "structural_tag" (vLLM's JSON); `field` is the user's field it came
    from, for errors. `strict` (JSON schemas): objects and tuples take only what the schema names unless it says
    otherwise, as xgrammar's strict mode, vLLM's default; False: as JSON Schema reads them (open)."""

    kind: str
    text: str
    field: str
    any_whitespace: bool = True
    whitespace_pattern: str | None = None
    strict: bool = True


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """The spec of `params`; a ValueError naming the field if a JSON schema given as text is not JSON."""
    kind = params.kind
    options = {"any_whitespace": not params.disable_any_whitespace, "whitespace_pattern": params.whitespace_pattern,
               "strict": params.disable_additional_properties is not False}
    if kind == "json_object":
        return GrammarSpec("json", _OBJECT_SCHEMA, kind, **options)
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {params.json!r}")
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs.json cannot be written as JSON: {e}") from None
        return GrammarSpec("json", text, kind, **options)
    if kind == "choice":
        return GrammarSpec("choice", json.dumps(list(params.choice), ensure_ascii=False), kind)
    if kind == "grammar":
        return GrammarSpec(kind, params.grammar, kind)
    return GrammarSpec(kind, getattr(params, kind), kind, **options)


_EBNF_RULE = re.compile(r"^[ \t]*[A-Za-z_][\w.-]*[ \t]*::=", re.MULTILINE)


def grammar_syntax(text: str) -> str:
    """"ebnf" if the grammar defines a rule with `::=` (EBNF / GBNF: `root ::= ...`), else "lark" (as vLLM tells them
    apart: `rule: ...`, `?rule` inlining, `%import common.*`, `/regex/` terminals, `%ignore`, ...)."""
    return "ebnf" if _EBNF_RULE.search(text) else "lark"


def _subschemas(node: dict) -> list[dict]:
    found = []
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            found += node[key].values()
    for key in _SUBSCHEMAS:
        value = node.get(key)
        found += value if isinstance(value, list) else [value]
    return [s for s in found if isinstance(s, dict)]


def _nodes(schema: dict) -> list[dict]:
    """Every schema object in `schema`, once each (outer ones first)."""
    found, todo, seen = [], [schema], set()
    while todo:
        node = todo.pop()
        if id(node) not in seen:
            seen.add(id(node))
            found.append(node)
            todo.extend(reversed(_subschemas(node)))
    return found


def _resolve(root: dict, ref) -> dict | None:
    """The schema a local `$ref` ("#", "#/$defs/Name", any JSON pointer) names; None for another document's."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _parts(root: dict, node: dict) -> tuple[list[dict], list[dict], bool]:
    """The schemas an object matching `node` is evaluated against besides `node`: those it must match too (what its
    `$ref` names, its `allOf` branches, recursively) and those it may match (their `anyOf` / `oneOf` branches, and
    theirs); and whether each `$ref` was found (one to another document is not)."""
    both, maybe, known, todo = [node], [], True, [(node, True)]
    while todo:
        part, must = todo.pop()
        branches = [_resolve(root, part["$ref"])] if "$ref" in part else []
        known = known and None not in branches
        branches = [(b, must) for b in branches if b is not None]
        for key in ("allOf", "anyOf", "oneOf"):
            if isinstance(part.get(key), list):
                branches += [(b, must and key == "allOf") for b in part[key] if isinstance(b, dict)]
        for branch, branch_must in branches:
            if not any(branch is p for p in both + maybe):
                (both if branch_must else maybe).append(branch)
                todo.append((branch, branch_must))
    return both[1:], maybe, known


def _names_keys(schema: dict) -> bool:
    return any(k in schema for k in ("properties", "patternProperties", *_OBJECT_RULES))


def closed_schema(schema):
    """A copy of `schema` that takes what xgrammar's strict mode takes (vLLM's default compilation): every object
    schema that names properties (or property patterns) and says nothing of other keys gets
    `additionalProperties: false`, every `prefixItems` tuple that says nothing of more items gets `items: false`.

    An object whose keys are named in more than one schema it must match (its own, its `$ref`'s, its `allOf`
    branches', or its own and its `anyOf` / `oneOf` branches') is closed once, where they meet, over the union of the
    names (as `unevaluatedProperties: false` would; closing each would leave only `{}`), and those schemas are left
    open at their top level (a `$defs` entry wherever it is used). Where the names cannot all be listed (a `$ref` to
    another document, a part with its own rule for other keys or with property patterns) the whole stays open."""
    if not isinstance(schema, dict):
        return schema
    schema = copy.deepcopy(schema)
    nodes = _nodes(schema)
    leave, merged = set(), []
    for node in nodes:
        both, maybe, known = _parts(schema, node)
        named_both = sum(map(_names_keys, [node, *both])) + (not known)
        if named_both > 1 or named_both and any(map(_names_keys, maybe)):
            leave.update(id(p) for p in both + maybe)
            merged.append((node, both + maybe, known))
    for node, parts, known in merged:
        if id(node) in leave:
            continue
        leave.add(id(node))
        if not known or any(k in node for k in _OBJECT_RULES) or any(
                k in p for p in parts for k in ("patternProperties", *_OBJECT_RULES)):
            continue
        properties = node.setdefault("properties", {})
        for part in parts:
            for name in part["properties"] if isinstance(part.get("properties"), dict) else ():
                properties.setdefault(name, True)
        node["additionalProperties"] = False
    _default_rules(nodes, False, leave)
    return schema


def open_schema(schema):
    """A copy of `schema` that says, wherever it is silent, what JSON Schema assumes (`additionalProperties: true`,
    `items: true` after `prefixItems`): open whatever the compiler's own default."""
    if not isinstance(schema, dict):
        return schema
    schema = copy.deepcopy(schema)
    _default_rules(_nodes(schema), True, set())
    return schema


def _default_rules(nodes: list[dict], value: bool, leave: set[int]) -> None:
    for node in nodes:
        if id(node) in leave:
            continue
        if (isinstance(node.get("properties"), dict) or isinstance(node.get("patternProperties"), dict)) and not any(
                k in node for k in _OBJECT_RULES):
            node["additionalProperties"] = value
        if isinstance(node.get("prefixItems"), list) and not any(k in node for k in _ARRAY_RULES):
            node["items"] = value


def structural_tags(spec: GrammarSpec) -> tuple[list[dict], list[str]]:
    """vLLM's structural tag: its `structures` (each `begin`, `schema`, `end`) and `triggers`."""
    try:
        tag = json.loads(spec.text)
        structures, triggers = tag["structures"], tag["triggers"]
        if not all(isinstance(s, dict) and {"begin", "schema", "end"} <= s.keys() for s in structures):
            raise KeyError("each structure needs 'begin', 'schema' and 'end'")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError("structured_outputs.structural_tag must be JSON with 'structures' (each with 'begin', "
                         f"'schema', 'end') and 'triggers': {e}") from None
    if not structures:
        raise ValueError("structured_outputs.structural_tag has no structures")
    return structures, list(triggers)
