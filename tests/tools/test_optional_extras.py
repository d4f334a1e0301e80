"""Without an optional package (an extra's: gguf, accelerate, triton, ray, xgrammar, jsonschema, flash-attn, outlines,
lm-eval, sentence-transformers, peft), the tests that need it are skipped and the rest still run: collection never
stops at a missing import."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPTIONAL = ("gguf", "accelerate", "triton", "ray", "xgrammar", "jsonschema", "flash_attn", "outlines", "lm_eval",
            "sentence_transformers", "peft")

COLLECT = f"""
import sys
for name in {OPTIONAL!r}:
    sys.modules[name] = None  # `import name` raises ImportError, find_spec(name) is None: as if not installed
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"]))
"""


def test_collection_goes_on_without_the_optional_packages():
    result = subprocess.run([sys.executable, "-c", COLLECT], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    assert any(line.startswith("tests/engine/test_engine_parity.py::") for line in collected)
    assert not any(line.startswith(("tests/models/test_gguf_families.py::", "tests/kernels/test_ggml_kernels.py::"))
                   for line in collected), "tests that need gguf were collected without it"
    assert not any(line.startswith(("tests/clients/test_outlines.py::", "tests/clients/test_lm_eval.py::"))
                   for line in collected), "tests of outlines or lm-eval were collected without them"
    assert any(line.startswith("tests/clients/test_vllm_alias.py::") for line in collected)
    assert not any(line.startswith("tests/pooling/test_embed.py::") for line in collected), \
        "tests that need sentence-transformers were collected without it"
    assert not any(line.startswith(("tests/lora/test_lora_engine.py::", "tests/lora/test_lora_bad_input.py::"))
                   for line in collected), "tests that need peft were collected without it"
