"""Structured outputs on a GPU (skipped without one): the mask unpacked on the device equals the host's, and a
constrained engine with CUDA graphs gives the tokens of the same engine without graphs, every output valid."""
import pytest
import regex
import torch
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.structured_output.bitmask import TokenBitmask, apply_token_bitmask

pytestmark = pytest.mark.cuda


def test_device_mask_equals_the_host_mask():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=generator)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 32), dtype=torch.int32, generator=generator).pin_memory()
    mask = TokenBitmask([0, 2, 3], bitmask)
    assert torch.equal(apply_token_bitmask(logits.cuda(), mask).cpu(), apply_token_bitmask(logits, mask))


def test_cuda_graphs_keep_constrained_outputs(gpu_model):
    tokenizer = AutoTokenizer.from_pretrained(gpu_model)
    pattern = r"([a-z]{1,6} ){3,8}(cat|dog)\."
    prompts = [tokenizer.encode(s) for s in ["Hello, my name is", "The quick brown fox", "List all primes"]]
    params = [SamplingParams(temperature=t, seed=4, max_tokens=60,
                             structured_outputs=StructuredOutputsParams(regex=pattern)) for t in (0, 1.0, 0)]
    tokens = {}
    for eager in (False, True):
        with LLM(gpu_model, device="cuda", dtype="float32", attention_backend="triton", enforce_eager=eager,
                 kvcache_block_size=16, max_model_len=256) as llm:
            outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert all(c.finish_reason == "stop" and regex.fullmatch(pattern, c.text) for c in outputs)
        tokens[eager] = [c.token_ids for c in outputs]
    assert tokens[False] == tokens[True]
