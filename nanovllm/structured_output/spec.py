"""A constraint as the grammar backends take it: one hashable value per distinct grammar text and options, so the
compiled-grammar cache and the submission checks key on it."""
import copy
import json
from dataclasses import dataclass

from nanovllm.sampling_params import StructuredOutputsParams

_OBJECT_SCHEMA = '{"type": "object"}'
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "additionalItems",
               "unevaluatedItems", "not", "if", "then", "else", "items", "prefixItems", "allOf", "anyOf", "oneOf")


@dataclass(frozen=True)
class GrammarSpec:
    """`kind` is "json" (`text`: the schema), "regex", "choice" (`text`: the choices as a JSON list), "grammar"
    (EBNF / GBNF / Lark) or "structural_tag" (vLLM's JSON); `field` is the user's field it came from, for errors."""

    kind: str
    text: str
    field: str
    any_whitespace: bool = True
    whitespace_pattern: str | None = None


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """The spec of `params`; a ValueError naming the field if a JSON schema given as text is not JSON."""
    kind = params.kind
    options = {"any_whitespace": not params.disable_any_whitespace, "whitespace_pattern": params.whitespace_pattern}
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
        if params.disable_additional_properties and isinstance(schema, dict):
            schema = copy.deepcopy(schema)
            _close_objects(schema)
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs.json cannot be written as JSON: {e}") from None
        return GrammarSpec("json", text, kind, **options)
    if kind == "choice":
        return GrammarSpec("choice", json.dumps(list(params.choice), ensure_ascii=False), kind)
    return GrammarSpec(kind, getattr(params, kind), kind, **options)


def _close_objects(schema) -> None:
    """`additionalProperties: false` wherever an object schema names its properties and says nothing of others."""
    if isinstance(schema, list):
        for item in schema:
            _close_objects(item)
        return
    if not isinstance(schema, dict):
        return
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                _close_objects(sub)
    for key in _SUBSCHEMAS:
        if isinstance(schema.get(key), (dict, list)):
            _close_objects(schema[key])
    if "additionalProperties" not in schema and isinstance(schema.get("properties"), dict):
        schema["additionalProperties"] = False


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
