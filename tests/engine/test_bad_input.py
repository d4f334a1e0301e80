"""Bad input raises a precise error before any work starts, and the engine keeps serving."""
import json
import os
import shutil

import pytest
from checkpoints import hf_greedy

from nanovllm import LLM, SamplingParams

GOOD = [5, 6, 7, 8]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tied_model):
    with LLM(tied_model, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=128) as engine:
        yield engine


@pytest.fixture(scope="module")
def expected(tied_model):
    return hf_greedy(tied_model, [GOOD], 8)[0]


@pytest.mark.parametrize("prompts, params, message", [
    ([GOOD, []], GREEDY, "prompt 1 is empty"),
    ([""], GREEDY, "prompt 0 is empty"),
    ([GOOD, [1] * 129], GREEDY, "longer than the maximum model length of 128"),
    ([[1, 384]], GREEDY, "token id 384 is out of vocabulary"),
    ([[-1, 2]], GREEDY, "token id -1 is out of vocabulary"),
    ([[1, 2.5]], GREEDY, r"must be a string, .* or a list of token ids \(ints\), got a list holding float 2.5"),
    ([{"prompt_token_ids": GOOD, "multi_modal_data": {}}], GREEDY,
     r"got keys \['multi_modal_data', 'prompt_token_ids'\]"),
    ([{}], GREEDY, r"nanovllm takes \{'prompt': text\} or \{'prompt_token_ids': ids\}"),
    ([{"prompt_token_ids": []}], GREEDY, "prompt 0 is empty"),
    ([GOOD, GOOD], [GREEDY], "got 2 prompts but 1 sampling params"),
    (42, GREEDY, "prompts must be a prompt or a list of prompts"),
    ([GOOD], ["greedy"], "sampling_params must be a SamplingParams or a list of them"),
])
def test_bad_requests_are_rejected_and_engine_still_serves(llm, expected, prompts, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.is_finished()
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert llm.generate([GOOD], GREEDY, use_tqdm=False)[0]["token_ids"] == expected


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature must be"),
    ({"temperature": float("nan")}, "temperature must be"),
    ({"temperature": "hot"}, "temperature must be"),
    ({"max_tokens": 0}, "max_tokens must be"),
    ({"max_tokens": 2.5}, "max_tokens must be"),
    ({"ignore_eos": "yes"}, "ignore_eos must be"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_model_without_tokenizer_files_asks_for_token_ids(tied_model, expected, tmp_path):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tied_model, name), tmp_path)
    with LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=128) as llm:
        with pytest.raises(ValueError, match="prompt 0 is text but .* has no tokenizer; pass token ids"):
            llm.generate("Hello", GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="has no tokenizer, hence no chat template; pass token ids to generate"):
            llm.chat([{"role": "user", "content": "Hello"}], GREEDY)
        assert llm.generate([GOOD], GREEDY, use_tqdm=False)[0]["token_ids"] == expected


def test_error_mid_generate_frees_everything(llm, expected, monkeypatch):
    calls = {"n": 0}
    original = llm.engine.model_runner.run

    def failing_run(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return original(*args)

    monkeypatch.setattr(llm.engine.model_runner, "run", failing_run)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate([GOOD, GOOD + [9]], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert llm.is_finished() and llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]
    assert llm.generate([GOOD], GREEDY, use_tqdm=False)[0]["token_ids"] == expected


@pytest.mark.parametrize("kwargs, message", [
    ({"num_kvcache_blocks": 3, "kvcache_block_size": 16, "max_model_len": 128},
     "one max_model_len=128 sequence needs 8"),
    ({"cpu_kvcache_gib": 1e-6, "max_model_len": 128}, "sequence needs"),
    ({"cpu_kvcache_gib": 1e-6}, "the KV cache holds 0 blocks of 16 tokens, but one block takes .*cpu_kvcache_gib"),
    ({"max_num_batched_tokens": 64, "max_model_len": 128, "enable_chunked_prefill": False}, "max_num_batched_tokens"),
    ({"enable_chunked_prefill": "yes"}, "enable_chunked_prefill must be a bool"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy must be 'fcfs' or 'priority'"),
    ({"kvcache_block_size": 0}, "kvcache_block_size must be a positive integer"),
    ({"num_kvcache_blocks": 0}, "num_kvcache_blocks must be -1"),
    ({"tensor_parallel_size": 3}, "tensor_parallel_size=3 must divide"),
    ({"device": "tpu"}, "device must be"),
    ({"dtype": "int8"}, "dtype must be"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"max_num_seqs": 0}, "max_num_seqs must be"),
    ({"load_format": "pickle"}, "load_format"),
    ({"worker_start_timeout_s": 0}, "worker_start_timeout_s must be positive"),
    ({"distributed_timeout_s": -1}, "distributed_timeout_s must be positive"),
    ({"attention_backend": "flash"}, r"attention_backend must be one of \['auto', 'flash-attn', 'flash-attn-4', "
                                     r"'triton', 'torch'\], got 'flash'"),
    ({"no_such_setting": 1}, "unknown engine setting"),
])
def test_bad_engine_settings(tied_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tied_model, **{"device": "cpu", "dtype": "float32", **kwargs})


def test_missing_or_malformed_model_directory(tied_model, tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(str(tmp_path))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(tied_model, "config.json"), no_weights)
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
        LLM(str(no_weights))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid Hugging Face model config"):
        LLM(str(broken))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"architectures \['GPT2LMHeadModel'\]; nanovllm supports "
                                         r"\['GPTNeoXForCausalLM', 'Gemma2ForCausalLM', .*'LlamaForCausalLM', "
                                         r"'MistralForCausalLM', .*'Qwen3MoeForCausalLM', 'StableLmForCausalLM'\]"):
        LLM(str(other))


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "proportional", "factor": 4.0}},
     r"unsupported rope scaling 'proportional' in the model config; nanovllm supports \['default', 'linear', "
     r"'dynamic', 'llama3', 'yarn', 'longrope'\]"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"hidden_act": "relu2"}, r"unsupported hidden_act 'relu2' in the model config; nanovllm supports \['silu', "
                              r"'gelu', 'gelu_pytorch_tanh'\]"),
    ({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "use_sliding_window": True},
     "Qwen2-MoE config sets use_sliding_window=true"),
])
def test_config_a_family_cannot_run(tied_model, tmp_path, change, message):
    path = shutil.copytree(tied_model, tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        LLM(str(path), device="cpu")


def test_checkpoint_missing_weights(tied_model, tmp_path):
    from safetensors.torch import load_file, save_file

    path = shutil.copytree(tied_model, tmp_path / "partial")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weights for: model.layers.1.self_attn.qkv_proj.weight"):
        LLM(str(path), device="cpu")


def test_a_shut_down_engine_says_so(tied_model):
    llm = LLM(tied_model, device="cpu", dtype="float32", max_model_len=128)
    llm.exit()
    with pytest.raises(RuntimeError, match="has been shut down"):
        llm.generate([GOOD], GREEDY, use_tqdm=False)
