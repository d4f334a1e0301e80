"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE): greedy output equals transformers' in float32, token
for token, with mixed-length batches, prefix-cache hits, chunked prefill and tensor parallel 2."""
import json
import random
import shutil

import pytest
import torch
from checkpoints import hf_greedy, make_checkpoint
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32", max_model_len=512, kvcache_block_size=16)
EXPERTS = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3)
# Each a tiny random checkpoint: GQA, untied or tied head, experts small enough that every token's top-k differ.
CHECKPOINTS = {
    "mixtral": dict(family="mixtral", num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    # A shared expert, and layer 1 of 3 dense (mlp_only_layers) with its own intermediate_size.
    "qwen2_moe": dict(family="qwen2_moe", num_layers=3, shared_expert_intermediate_size=48, mlp_only_layers=[1],
                      norm_topk_prob=False, **EXPERTS),
    "qwen3_moe_norm_topk": dict(family="qwen3_moe", norm_topk_prob=True, tie_word_embeddings=False, **EXPERTS),
    # decoder_sparse_step 2: layer 0 dense, layer 1 sparse.
    "qwen3_moe": dict(family="qwen3_moe", norm_topk_prob=False, decoder_sparse_step=2, **EXPERTS),
}


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(384) for _ in range(n)] for n in lengths]


def token_ids(outputs) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    paths: dict[str, str] = {}

    def build(name: str) -> str:
        if name not in paths:
            paths[name] = make_checkpoint(str(tmp_path_factory.mktemp(name)), seed=len(paths), **CHECKPOINTS[name])
        return paths[name]

    return build


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_mixed_batch_and_prefix_cache_match_transformers(checkpoint, name):
    """A batch of mixed lengths (two sharing a 40-token prefix), generated twice: the second time from the prefix
    cache; both equal transformers' greedy continuations."""
    path = checkpoint(name)
    shared = random_prompts([40], seed=1)[0]
    prompts = random_prompts([1, 7, 33, 150], seed=0) + [shared + [5, 6], shared + [9]]
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    with LLM(path, **CPU) as llm:
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        cached = llm.stats()["num_cached_tokens"]
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert llm.stats()["num_cached_tokens"] > cached > 0
        assert_all_blocks_free(llm)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_chunked_prefill_matches_transformers(checkpoint, name):
    path = checkpoint(name)
    prompts = random_prompts([3, 60, 130, 20], seed=2)
    with LLM(path, max_num_batched_tokens=50, **CPU) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.stats()["num_chunked_steps"] > 0
        assert_all_blocks_free(llm)
    assert token_ids(outputs) == hf_greedy(path, prompts, MAX_TOKENS)


def test_tensor_parallel_2_splits_experts_and_shared_expert(checkpoint):
    path = checkpoint("qwen2_moe")
    prompts = random_prompts([5, 40, 12], seed=3)
    with LLM(path, tensor_parallel_size=2, **CPU) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == hf_greedy(path, prompts, MAX_TOKENS)


def test_dummy_weights_load_transformers_stacked_experts(checkpoint):
    """Random weights come in transformers' stacked layout (`experts.gate_up_proj`), which loads as it is."""
    with LLM(checkpoint("mixtral"), load_format="dummy", **CPU) as llm:
        first = token_ids(llm.generate(random_prompts([9], seed=4), GREEDY, use_tqdm=False))[0]
    assert len(first) == MAX_TOKENS


def test_a_missing_expert_is_named(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint("qwen3_moe"), tmp_path / "missing-expert")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weights for: model\.layers\.1\.mlp\.experts\.gate_up_proj$"):
        LLM(str(path), **CPU)


def test_an_expert_of_the_wrong_shape_is_named(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint("mixtral"), tmp_path / "narrow-expert")
    weights = load_file(path / "model.safetensors")
    name = "model.layers.0.block_sparse_moe.experts.2.w3.weight"
    weights[name] = weights[name][:-1].contiguous()
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"expert 2's up projection has shape \(127, 64\), but the model config "
                                         r"implies 4 experts of shape \(128, 64\) .*expert intermediate size 128"):
        LLM(str(path), **CPU)


@pytest.mark.parametrize("rows", [5, 3])
def test_a_router_of_the_wrong_shape_is_named(checkpoint, tmp_path, rows):
    """A router for 5 or 3 experts in a 4-expert Mixtral: a ValueError naming the tensor (3 rows used to load, the
    fourth row left unset)."""
    path = shutil.copytree(checkpoint("mixtral"), tmp_path / f"router-{rows}")
    weights = load_file(path / "model.safetensors")
    weights["model.layers.1.block_sparse_moe.gate.weight"] = torch.zeros(rows, 64)
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"checkpoint tensor 'model.layers.1.mlp.gate.weight' in .*router-{rows}': "
                                         rf"it has shape \({rows}, 64\), but the model config implies \(4, 64\)"):
        LLM(str(path), **CPU)


@pytest.mark.parametrize("name, change, message", [
    ("qwen3_moe", {"num_experts_per_tok": 9}, r"num_experts_per_tok=9 .* between 1 and the number of experts \(8\)"),
])
def test_configs_it_cannot_run_are_refused(checkpoint, tmp_path, name, change, message):
    path = shutil.copytree(checkpoint(name), tmp_path / name)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        LLM(str(path), **CPU)


def test_mixtral_with_a_sliding_window_matches_transformers_and_releases_blocks(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint("mixtral"), tmp_path / "mixtral-window")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": 24}))
    prompts = random_prompts([100, 9], seed=4)
    expected = hf_greedy(str(path), prompts, MAX_TOKENS)
    with LLM(str(path), **CPU, max_num_batched_tokens=64) as llm:
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert llm.stats()["num_released_blocks"] > 0
        assert_all_blocks_free(llm)


@pytest.mark.cuda
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_triton_experts_match_transformers_on_the_gpu(tmp_path, enforce_eager):
    """The Triton experts, eager and under CUDA graphs, float32 against transformers on the same GPU."""
    path = make_checkpoint(str(tmp_path / "qwen2-moe-gpu"), hidden_size=128, head_dim=64, intermediate_size=256,
                           **{**CHECKPOINTS["qwen2_moe"], "moe_intermediate_size": 96})
    prompts = random_prompts([1, 7, 33, 150], seed=5)
    expected = hf_greedy(path, prompts, MAX_TOKENS, device="cuda")
    with LLM(path, device="cuda", dtype="float32", max_model_len=512, enforce_eager=enforce_eager) as llm:
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert_all_blocks_free(llm)
