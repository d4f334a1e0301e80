"""vLLM's structured-outputs API: the params, their checks and the engine setting, without a model."""
import pytest
from grammar_backends import GRAMMAR_BACKENDS, needs_xgrammar

import nanovllm
from nanovllm import SamplingParams, StructuredOutputsParams
from nanovllm.config import Config
from nanovllm.sampling_params import StructuredOutputsParams as FromModule
from nanovllm.structured_output.backends import check_constraint


def test_importable_from_both_places_with_vllms_fields_and_defaults():
    assert nanovllm.StructuredOutputsParams is FromModule
    params = StructuredOutputsParams(regex="a+")
    assert (params.json, params.choice, params.grammar, params.json_object, params.structural_tag) == (None,) * 5
    # disable_additional_properties: None, vLLM's default compilation (closed objects); False opens them
    assert (params.disable_any_whitespace, params.disable_additional_properties, params.whitespace_pattern) == (
        False, None, None)
    assert params.kind == "regex"
    assert SamplingParams(structured_outputs=params).structured_outputs is params
    assert SamplingParams().structured_outputs is None


def test_exactly_one_kind_as_vllm():
    with pytest.raises(ValueError, match="You must use one kind of structured outputs constraint but none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="You can only use one kind of structured outputs constraint but multiple"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="multiple"):
        StructuredOutputsParams(choice=["a"], json_object=True)


@pytest.mark.parametrize("kwargs, message", [
    ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"choice": ["a", 1]}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"regex": 5}, "structured_outputs.regex must be a string"),
    ({"json": 5}, "structured_outputs.json must be a JSON schema"),
    ({"json_object": False}, "structured_outputs.json_object must be True"),
    ({"regex": "a", "disable_any_whitespace": "yes"}, "structured_outputs.disable_any_whitespace must be True or"),
    ({"json": {}, "disable_additional_properties": 0}, r"structured_outputs.disable_additional_properties must be "
                                                       r"True, False or None, got 0"),
])
def test_malformed_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_takes_only_structured_outputs_params():
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
@pytest.mark.parametrize("kwargs, message", [
    ({"json": '{"type": "object",'}, "structured_outputs.json is not valid JSON"),
    ({"json": {"type": "frobnicate"}}, "(?s)structured_outputs.json is not a valid JSON schema: .*frobnicate"),
    ({"regex": "a(b"}, r"(?s)structured_outputs.regex is not a valid regular expression: .*(unclosed|not closed)"),
    ({"grammar": 'root ::= "a" | b'}, r"(?s)structured_outputs.grammar is not a valid grammar .*\bb\b"),
])
def test_invalid_constraints_name_the_field_and_the_backends_message(backend, kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_constraint(StructuredOutputsParams(**kwargs), backend)


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_valid_constraints_pass(backend):
    for kwargs in [{"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}, {"json_object": True},
                   {"regex": "[a-z]+"}, {"choice": ["yes", 'a "quoted" no']}, {"grammar": 'root ::= "a" | "b"'}]:
        spec = check_constraint(StructuredOutputsParams(**kwargs), backend)
        assert spec.field == next(iter(kwargs))


@pytest.mark.parametrize("options, message", [
    ({"backend": "outlines"}, "backend must be one of"),
    ({"backend": "auto", "disable_fallback": True}, "must be a dict with the keys 'backend'"),
    ({"jump_forward": "yes"}, r"\['jump_forward'\] must be True or False"),
    ("guidance", "must be a dict"),
])
def test_backend_setting_is_checked(options, message):
    with pytest.raises(ValueError, match=message):
        Config("unused", structured_outputs_config=options)
    assert Config("unused").jump_forward and not Config("unused", structured_outputs_config={
        "jump_forward": False}).jump_forward


@needs_xgrammar
def test_a_named_backend_is_taken():
    assert Config("unused", structured_outputs_config={"backend": "xgrammar"}).structured_outputs_backend == "xgrammar"
