"""outlines (structured generation) on nanovllm through its vLLM offline model, `outlines.from_vllm_offline(llm)`, with
`vllm` aliased to nanovllm (`nanovllm.as_vllm()`) and nothing else: JSON schemas, Pydantic models, regexes, choices,
plain text, batches and chat, each equal to what nanovllm gives for the same request through its own
`StructuredOutputsParams`. outlines copies the caller's `SamplingParams` field by field (`__struct_fields__`) to add
its constraint, so the caller's settings must survive the copy."""
import json
import sys
from typing import Literal

import pytest

import nanovllm
from nanovllm import LLM, SamplingParams, StructuredOutputsParams

outlines = pytest.importorskip("outlines")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

PROMPTS = [" Hello, my name is", " The quick brown fox", " Paged attention"]
WHITESPACE = r"[ ]?"  # the random model writes optional whitespace forever where the pattern lets it


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["engineer", "doctor", "teacher"]


SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                                           "ok": {"type": "boolean"}},
          "required": ["id", "tags", "ok"]}


@pytest.fixture(scope="module")
def llm(tied_model):
    alias = nanovllm.as_vllm()
    try:
        with LLM(tied_model, device="cpu", dtype="float32", max_model_len=256) as engine:
            yield engine
    finally:
        alias.remove()


@pytest.fixture(scope="module")
def model(llm):
    return outlines.from_vllm_offline(llm)


def greedy(max_tokens: int = 64, **settings) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **settings)


def nanovllm_text(llm: LLM, prompt: str, params: SamplingParams, **constraint) -> str:
    """What nanovllm writes for the request through its own structured outputs (no constraint: plain generation)."""
    if constraint:
        params = SamplingParams(**{**{f: getattr(params, f) for f in params.__struct_fields__},
                                   "structured_outputs": StructuredOutputsParams(**constraint)})
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


def test_it_is_the_vllm_offline_model(model, llm):
    assert sys.modules["vllm"] is nanovllm
    assert type(model).__name__ == "VLLMOffline" and model.model is llm and model.tokenizer is llm.get_tokenizer()
    assert not model.type_adapter.has_chat_template, "the test model's tokenizer has none"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_json_schema(model, llm, prompt):
    params = greedy(max_tokens=96)
    text = model(prompt, outlines.types.JsonSchema(SCHEMA, whitespace_pattern=WHITESPACE), sampling_params=params,
                 use_tqdm=False)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == nanovllm_text(llm, prompt, params, json=SCHEMA, whitespace_pattern=WHITESPACE)
    assert params.structured_outputs is None, "outlines builds new params: the caller's are left as they were"


def test_pydantic_model(model, llm):
    schema = outlines.types.JsonSchema(Person, whitespace_pattern=WHITESPACE)
    params = greedy(max_tokens=96)
    texts = [model(prompt, schema, sampling_params=params, use_tqdm=False) for prompt in PROMPTS]
    people = [Person.model_validate_json(text) for text in texts]
    assert all(0 <= person.age <= 120 and len(person.name) <= 8 for person in people)
    expected = [nanovllm_text(llm, prompt, params, json=Person.model_json_schema(), whitespace_pattern=WHITESPACE)
                for prompt in PROMPTS]
    assert texts == expected


def test_regex_and_choice(model, llm):
    params = greedy()
    for prompt in PROMPTS:
        digits = model(prompt, outlines.types.Regex(r"[0-9]{3}-[a-z]{2}"), sampling_params=params, use_tqdm=False)
        assert digits == nanovllm_text(llm, prompt, params, regex=r"[0-9]{3}-[a-z]{2}")
        assert len(digits) == 6 and digits[3] == "-"
        choice = model(prompt, Literal["yes", "no", "maybe"], sampling_params=params, use_tqdm=False)
        assert choice == nanovllm_text(llm, prompt, params, choice=["yes", "no", "maybe"])


def test_the_callers_sampling_params_survive_the_copy(model, llm):
    """Seeded sampling, n, stop strings and logprobs go through outlines' field-by-field copy."""
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=7, max_tokens=12, stop=["9"])
    texts = model(PROMPTS[0], outlines.types.Regex(r"[0-9a-z]{1,12}"), sampling_params=params, use_tqdm=False)
    ours = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=7, max_tokens=12, stop=["9"],
                                                   structured_outputs=StructuredOutputsParams(regex=r"[0-9a-z]{1,12}")),
                        use_tqdm=False)[0]
    assert texts == [completion.text for completion in ours.outputs] and len(set(texts)) > 1
    assert not any("9" in text for text in texts)


def test_plain_text_and_batches(model, llm):
    params = greedy(max_tokens=10, ignore_eos=True)
    assert model(PROMPTS[0], sampling_params=params, use_tqdm=False) == nanovllm_text(llm, PROMPTS[0], params)
    batch = model.batch(PROMPTS, outlines.types.Regex(r"[a-z]{2,5}"), sampling_params=params, use_tqdm=False)
    assert batch == [[nanovllm_text(llm, prompt, params, regex=r"[a-z]{2,5}")] for prompt in PROMPTS]


def test_chat(llm):
    """With a chat template, outlines sends a string prompt as one user message through `LLM.chat`."""
    tokenizer = llm.get_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}")
    try:
        model = outlines.from_vllm_offline(llm)
        assert model.type_adapter.has_chat_template
        params = greedy()
        text = model(PROMPTS[0], outlines.types.Regex(r"[a-z ]{4,20}"), sampling_params=params, use_tqdm=False)
        constrained = SamplingParams(temperature=0, max_tokens=64,
                                     structured_outputs=StructuredOutputsParams(regex=r"[a-z ]{4,20}"))
        expected = llm.chat([{"role": "user", "content": PROMPTS[0]}], constrained, use_tqdm=False)[0].outputs[0].text
        assert text == expected and 4 <= len(text) <= 20
        chat = outlines.inputs.Chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
        assert model(chat, sampling_params=greedy(max_tokens=6, ignore_eos=True), use_tqdm=False) == llm.chat(
            chat.messages, greedy(max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    finally:
        tokenizer.chat_template = None
