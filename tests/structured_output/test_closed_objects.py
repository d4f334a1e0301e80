"""JSON schemas compile as vLLM's default backend compiles them (xgrammar's strict mode), on both backends: an object
that names its properties and says nothing of others takes no other key, a `prefixItems` tuple no more items;
`disable_additional_properties=False` leaves them open, as JSON Schema reads them. At the mask, on whole strings, and
end to end with a tiny random model (which, left open, keeps adding keys of its own)."""
import json
from types import SimpleNamespace

import pytest
import torch
from grammar_backends import GRAMMAR_BACKENDS, needs_xgrammar
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.structured_output import guidance
from nanovllm.structured_output.backends import check_constraint
from nanovllm.structured_output.bitmask import allowed_tokens
from nanovllm.structured_output.manager import StructuredOutputs
from nanovllm.structured_output.spec import closed_schema, open_schema

EOS = 0
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}}, "required": ["name", "age"]}
CLOSED = {"default": {}, "True": {"disable_additional_properties": True}}
OPEN = {"disable_additional_properties": False}


@pytest.fixture(scope="module")
def tokenizer(tied_model):
    return AutoTokenizer.from_pretrained(tied_model)


@pytest.fixture(scope="module", params=GRAMMAR_BACKENDS)
def manager(request, tokenizer):
    return StructuredOutputs(request.param, tokenizer, 384, {EOS}, max_rows=1)


def allowed_after(manager, tokenizer, params: StructuredOutputsParams, text: str) -> set[int] | None:
    """The tokens the constraint allows after `text`; None if it does not accept `text` itself."""
    row = SimpleNamespace(grammar=manager.state(check_constraint(params, manager.backend_name)))
    row.grammar.compiled.result()
    ids = tokenizer.encode(text)
    if row.grammar.valid_prefix(ids) != ids:
        return None
    for token_id in ids:
        row.grammar.accept(token_id)
    mask = manager.bitmask([(row, [])])
    return set(allowed_tokens(mask, 384, torch.device("cpu"))[0].nonzero().flatten().tolist())


def accepts(manager, tokenizer, params: StructuredOutputsParams, text: str) -> bool:
    allowed = allowed_after(manager, tokenizer, params, text)
    return allowed is not None and EOS in allowed


def test_the_default_is_closed_and_false_opens(manager, tokenizer):
    for settings in CLOSED.values():
        assert check_constraint(StructuredOutputsParams(json=PERSON, **settings), manager.backend_name).strict
    assert not check_constraint(StructuredOutputsParams(json=PERSON, **OPEN), manager.backend_name).strict


@pytest.mark.parametrize("settings", CLOSED.values(), ids=CLOSED.keys())
def test_a_key_the_schema_does_not_name_is_masked_after_the_named_keys(manager, tokenizer, settings):
    token = tokenizer.convert_tokens_to_ids
    closed, opened = StructuredOutputsParams(json=PERSON, **settings), StructuredOutputsParams(json=PERSON, **OPEN)
    # a key's first letter: only the one key left ("city") when closed, any when open
    key = '{"name": "Ann", "age": 3, "'
    assert token("c") in allowed_after(manager, tokenizer, closed, key)
    assert not {token("z"), token("q"), token("x")} & allowed_after(manager, tokenizer, closed, key)
    assert {token("z"), token("q"), token("x")} <= allowed_after(manager, tokenizer, opened, key)
    # every named key written: no comma (no key is left to write), only the closing brace
    done = '{"name": "Ann", "age": 3, "city": "Oslo"'
    assert token(",") not in allowed_after(manager, tokenizer, closed, done)
    assert token("}") in allowed_after(manager, tokenizer, closed, done)
    assert token(",") in allowed_after(manager, tokenizer, opened, done)
    extra = '{"name": "Ann", "age": 3, "zip": 1}'
    assert not accepts(manager, tokenizer, closed, extra) and accepts(manager, tokenizer, opened, extra)


@pytest.mark.parametrize("schema, closed_ok, closed_not, open_ok", [
    ({"type": "object", "properties": {"o": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
     ['{"o": {"x": 1}}'], ['{"o": {"x": 1, "y": 2}}', '{"p": 1}'], ['{"o": {"x": 1, "y": 2}}']),
    ({"$defs": {"P": {"type": "object", "properties": {"a": {"type": "integer"}}}}, "type": "array",
      "items": {"$ref": "#/$defs/P"}}, ['[{"a": 1}]'], ['[{"a": 1, "b": 2}]'], ['[{"a": 1, "b": 2}]']),
    ({"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}}},
     ['{"v": 1, "kids": [{"v": 2}]}'], ['{"v": 1, "kids": [{"w": 2}]}'], ['{"v": 1, "kids": [{"w": 2}]}']),
    ({"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
     ['{"a": 1}', '{"b": 2}'], ['{"a": 1, "b": 2}'], ['{"a": 1, "b": 2}']),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
     ['[1, "a"]'], ['[1, "a", 3]'], ['[1, "a", 3]']),
    # what the schema says of other keys, or of more items, rules
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "integer"}},
     ['{"a": 1, "b": 2}'], ['{"a": 1, "b": "x"}'], []),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     ['{"a": 1, "b": "x"}'], [], []),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}},
     ['[1, "a", "b"]'], ['[1, 2]'], []),
    # an object with no properties named is any object, as in xgrammar's strict mode
    ({"type": "object"}, ['{"b": 2}'], [], []),
])
def test_closed_where_the_schema_is_silent_on_both_backends(manager, tokenizer, schema, closed_ok, closed_not,
                                                             open_ok):
    closed, opened = StructuredOutputsParams(json=schema), StructuredOutputsParams(json=schema, **OPEN)
    assert all(accepts(manager, tokenizer, closed, text) for text in closed_ok)
    assert not any(accepts(manager, tokenizer, closed, text) for text in closed_not)
    assert all(accepts(manager, tokenizer, opened, text) for text in closed_ok + open_ok)


@pytest.mark.parametrize("schema, ok, bad", [
    # properties spread over allOf: closed once over their union (closing each would leave only {})
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                {"type": "object", "properties": {"b": {"type": "integer"}}}]},
     ['{"a": 1, "b": 2}', '{"a": 1}', "{}"], ['{"c": 1}', '{"a": "x"}']),
    ({"$defs": {"A": {"type": "object", "properties": {"a": {"type": "integer"}}},
                "B": {"type": "object", "properties": {"b": {"type": "integer"}}}},
      "allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]},
     ['{"a": 1, "b": 2}'], ['{"c": 1}', '{"b": "x"}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "allOf": [{"properties": {"b": {"type": "integer"}}}]},
     ['{"a": 1, "b": 2}'], ['{"c": 1}']),
    ({"type": "object", "properties": {"kind": {"type": "string"}},
      "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                {"properties": {"y": {"type": "integer"}}, "required": ["y"]}]},
     ['{"kind": "k", "x": 1}', '{"y": 1}'], ['{"kind": "k", "z": 1}']),
    # one allOf branch (pydantic's way of describing a $ref): the branch is closed where it is
    ({"$defs": {"A": {"type": "object", "properties": {"a": {"type": "integer"}}}}, "type": "object",
      "properties": {"x": {"allOf": [{"$ref": "#/$defs/A"}], "description": "an A"}}},
     ['{"x": {"a": 1}}'], ['{"x": {"a": 1, "c": 2}}', '{"y": 1}']),
    # a part that says what other keys may do opens the whole
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "allOf": [{"properties": {"b": {"type": "integer"}}, "additionalProperties": True}]},
     ['{"a": 1, "c": 2}'], []),
])
def test_properties_spread_over_several_schemas_close_over_their_union(tokenizer, schema, ok, bad):
    manager = StructuredOutputs("guidance", tokenizer, 384, {EOS}, max_rows=1)  # xgrammar has its own allOf reading
    params = StructuredOutputsParams(json=schema)
    assert all(accepts(manager, tokenizer, params, text) for text in ok)
    assert not any(accepts(manager, tokenizer, params, text) for text in bad)


def test_closing_and_opening_copy_the_schema_and_leave_negations_alone():
    schema = {"type": "object", "properties": {"a": {"not": {"properties": {"b": {}}}}},
              "$defs": {"T": {"prefixItems": [{}]}}}
    before = json.dumps(schema)
    closed = closed_schema(schema)
    assert json.dumps(schema) == before
    assert closed["additionalProperties"] is False and closed["$defs"]["T"]["items"] is False
    assert "additionalProperties" not in closed["properties"]["a"]["not"]
    opened = open_schema(schema)
    assert opened["additionalProperties"] is True and opened["$defs"]["T"]["items"] is True
    assert closed_schema(True) is True


@needs_xgrammar
def test_structural_tags_follow_the_setting_on_both_backends(tokenizer):
    tag = json.dumps({"structures": [{"begin": "<fn=f>", "schema": {"type": "object", "properties": {
        "a": {"type": "integer"}}}, "end": "</fn>"}], "triggers": ["<fn="]})
    closed, opened = StructuredOutputsParams(structural_tag=tag), StructuredOutputsParams(structural_tag=tag, **OPEN)
    manager = StructuredOutputs("xgrammar", tokenizer, 384, {EOS}, max_rows=1)
    extra = 'x <fn=f>{"a": 1, "b": 2}</fn>'
    assert accepts(manager, tokenizer, closed, 'x <fn=f>{"a": 1}</fn>')
    assert not accepts(manager, tokenizer, closed, extra) and accepts(manager, tokenizer, opened, extra)
    # llguidance's structural tags let any text through (a tag's text may also be read as free text), so its grammar
    # is what shows the tag's schema closed or open
    assert '"additionalProperties":false' in guidance.grammar_text(check_constraint(closed, "guidance"))
    assert '"additionalProperties"' not in guidance.grammar_text(check_constraint(opened, "guidance"))


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_a_small_model_writes_only_the_keys_the_schema_names(tied_model, tokenizer, backend):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}}, "required": ["name"]}
    prompts = [tokenizer.encode(text) for text in ["Hello, my name is", "The quick brown fox", "List all primes",
                                                   "Paged attention stores", "The cat sleeps", "Continuous batching"]]
    settings = {"temperature": 1.0, "max_tokens": 96}
    closed = [SamplingParams(seed=i, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True), **settings) for i in range(len(prompts))]
    opened = [SamplingParams(seed=i, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True, **OPEN), **settings) for i in range(len(prompts))]
    with LLM(tied_model, device="cpu", dtype="float32", max_model_len=256,
             structured_outputs_config={"backend": backend}) as llm:
        outputs = llm.generate(prompts + prompts, closed + opened, use_tqdm=False)
    for output in outputs[:len(prompts)]:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        # strict=False: xgrammar lets a string hold raw control characters
        assert set(json.loads(completion.text, strict=False)) <= set(schema["properties"]), completion.text
    # left open, the same random model goes on with keys of its own
    assert any(o.outputs[0].finish_reason == "length" or set(json.loads(o.outputs[0].text, strict=False)) - set(
        schema["properties"]) for o in outputs[len(prompts):])
