"""Adapters that cannot run are refused at submission, naming the adapter and the problem, and the engine serves on;
settings LoRA cannot run beside are refused at `LLM(...)`."""
import json
import os
import shutil

import pytest
import torch
from checkpoints import make_checkpoint, make_family_checkpoint
from safetensors.torch import save_file

from nanovllm import LLM, SamplingParams
from nanovllm.lora.request import LoRARequest

peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=3)
CPU = dict(device="cpu", dtype="float32")


def make_adapter(base: str, path: str, **settings) -> str:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **settings)).save_pretrained(path)
    return path


def edited(adapter: str, path: str, **changes) -> str:
    """A copy of `adapter` with `changes` in its adapter_config.json."""
    os.makedirs(path)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({**config, **changes}, f)
    os.link(os.path.join(adapter, "adapter_model.safetensors"), os.path.join(path, "adapter_model.safetensors"))
    return path


def with_weights(adapter: str, path: str, modules: dict[str, tuple[int, int]]) -> str:
    """A copy of `adapter`'s config with rank-4 LoRA pairs on `modules` (name: its in and out features) instead of its
    weights."""
    os.makedirs(path)
    shutil.copy(os.path.join(adapter, "adapter_config.json"), path)
    save_file({f"base_model.model.{module}.lora_{which}.weight": torch.ones((4, size[0]) if which == "A" else
                                                                             (size[1], 4))
               for module, size in modules.items() for which in "AB"},
              os.path.join(path, "adapter_model.safetensors"))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora-bad")
    base = make_checkpoint(str(root / "base"), family="qwen3", seed=3)
    other = make_checkpoint(str(root / "other"), family="qwen3", seed=3, hidden_size=32, num_layers=3)
    good = make_adapter(base, str(root / "good"), r=4, target_modules=["q_proj", "down_proj"])
    return {"root": root, "base": base, "good": good,
            "wide": make_adapter(base, str(root / "wide"), r=32, target_modules=["q_proj"]),
            "other": make_adapter(other, str(root / "for-other"), r=4, target_modules=["q_proj"]),
            "deep": make_adapter(other, str(root / "deep"), r=4, target_modules=["q_proj"], layers_to_transform=[2]),
            "dora": edited(good, str(root / "dora"), use_dora=True),
            "saved": edited(good, str(root / "saved"), modules_to_save=["lm_head"]),
            "qalora": edited(good, str(root / "qalora"), use_qalora=True),
            "embedding": make_adapter(base, str(root / "embedding"), r=4, target_modules=["embed_tokens"]),
            "experts": with_weights(good, str(root / "experts"), {"model.layers.0.mlp.experts.1.up_proj": (64, 128)}),
            "router": with_weights(good, str(root / "router"), {"model.layers.0.mlp.gate": (64, 4)}),
            "neox": with_weights(good, str(root / "neox"), {"gpt_neox.layers.0.attention.query_key_value": (64, 192)})}


@pytest.mark.parametrize("name, error, message", [
    ("missing", FileNotFoundError, "LoRA adapter 'missing' .*no directory"),
    ("wide", ValueError, "LoRA adapter 'wide' .*has rank 32, above max_lora_rank=16"),
    ("other", ValueError, "LoRA adapter 'other' .*q_proj has lora_A \\(4, 32\\).*trained for another base model"),
    ("deep", ValueError, "LoRA adapter 'deep' .*model.layers.2.q_proj, which this model does not have"),
    ("dora", ValueError, "LoRA adapter 'dora' .*DoRA.*use_dora=True"),
    ("saved", ValueError, "LoRA adapter 'saved' .*modules_to_save"),
    ("qalora", ValueError, "LoRA adapter 'qalora' .*a LoRA variant nanovllm does not compute \\(use_qalora=True\\)"),
    ("embedding", ValueError, "LoRA adapter 'embedding' .*embed_tokens"),
    ("experts", ValueError, "LoRA adapter 'experts' .*model.layers.0.mlp.experts.1.up_proj is part of a mixture of "
                            "experts \\(its router, experts or shared expert\\)"),
    ("router", ValueError, "LoRA adapter 'router' .*model.layers.0.mlp.gate is part of a mixture of experts"),
    ("neox", ValueError, "LoRA adapter 'neox' .*gpt_neox.layers.0.attention.query_key_value is not an attention or "
                         "MLP projection of this model's decoder layers.*trained on this model's family"),
])
def test_bad_adapters_are_refused_and_the_engine_serves_on(setup, name, error, message):
    path = setup.get(name, str(setup["root"] / "nowhere"))
    with LLM(setup["base"], enable_lora=True, **CPU) as llm:
        with pytest.raises(error, match=message):
            llm.generate([[1, 2, 3]], GREEDY, lora_request=LoRARequest(name, 1, path), use_tqdm=False)
        assert llm.is_finished() and llm.list_loras() == set()
        good = LoRARequest("good", 1, setup["good"])
        assert len(llm.generate([[1, 2, 3]], GREEDY, lora_request=good, use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_one_id_for_two_paths_and_other_misuse(setup, tmp_path):
    second = make_adapter(setup["base"], str(tmp_path / "second"), r=2, target_modules=["v_proj"])
    with LLM(setup["base"], enable_lora=True, **CPU) as llm:
        llm.generate([[1, 2]], GREEDY, lora_request=LoRARequest("good", 1, setup["good"]), use_tqdm=False)
        with pytest.raises(ValueError, match="LoRA adapter 'second' .*lora_int_id 1 already names 'good'"):
            llm.generate([[1, 2]], GREEDY, lora_request=LoRARequest("second", 1, second), use_tqdm=False)
        with pytest.raises(ValueError, match="lora_request is a list of 1 but there are 2 prompts"):
            llm.generate([[1, 2], [3, 4]], GREEDY, lora_request=[None], use_tqdm=False)
        with pytest.raises(ValueError, match="lora_request must be a nanovllm.lora.request.LoRARequest"):
            llm.generate([[1, 2]], GREEDY, lora_request="good", use_tqdm=False)
        with pytest.raises(ValueError, match="pin_lora: LoRA adapter 5 is not loaded"):
            llm.pin_lora(5)
        with pytest.raises(FileNotFoundError, match="LoRA adapter 'missing' .*no directory"):
            from nanovllm import BeamSearchParams
            llm.beam_search([[1, 2]], BeamSearchParams(beam_width=2, max_tokens=2),
                            lora_request=LoRARequest("missing", 7, str(tmp_path / "nowhere")))
        assert llm.is_finished()
        assert llm.generate([[1, 2]], GREEDY, lora_request=LoRARequest("second", 2, second), use_tqdm=False)
        assert llm.list_loras() == {2}
    with LLM(setup["base"], **CPU) as llm:
        with pytest.raises(ValueError, match="list_loras: LoRA is off; create the LLM with enable_lora=True"):
            llm.list_loras()


def test_a_weights_file_of_the_wrong_kind(setup, tmp_path):
    path = edited(setup["good"], str(tmp_path / "bias"))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)},
              os.path.join(path, "adapter_model.safetensors.tmp"))
    os.replace(os.path.join(path, "adapter_model.safetensors.tmp"), os.path.join(path, "adapter_model.safetensors"))
    embedding = str(tmp_path / "embedding")
    os.makedirs(embedding)
    shutil.copy(os.path.join(path, "adapter_config.json"), embedding)
    save_file({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 384)},
              os.path.join(embedding, "adapter_model.safetensors"))
    with LLM(setup["base"], enable_lora=True, **CPU) as llm:
        with pytest.raises(ValueError, match="q_proj has lora_A but not both lora_A and lora_B"):
            llm.add_lora(LoRARequest("half", 1, path))
        with pytest.raises(ValueError, match="'base_model.model.model.embed_tokens.lora_embedding_A' is not a LoRA "
                                             "weight of a linear module .*embedding LoRA is not supported"):
            llm.add_lora(LoRARequest("embedding", 2, embedding))


def test_a_gpt_neox_adapter_for_another_width(tmp_path):
    """GPT-NeoX's query_key_value B, whose rows are regrouped per head as the base weight's, does not regroup for a
    base of another width: refused by name, and the engine serves on."""
    base = make_family_checkpoint(str(tmp_path / "base"), "gpt_neox", seed=1)
    narrow = make_family_checkpoint(str(tmp_path / "narrow"), "gpt_neox", seed=1, hidden_size=32)
    adapter = make_adapter(narrow, str(tmp_path / "adapter"), r=4, target_modules=["query_key_value"])
    with LLM(base, enable_lora=True, **CPU) as llm:
        with pytest.raises(ValueError, match="LoRA adapter 'narrow' .*gpt_neox.layers.0.attention.query_key_value has "
                                             "lora_B \\(96, 4\\), whose rows do not split as this model's weight"):
            llm.add_lora(LoRARequest("narrow", 1, adapter))
        assert llm.list_loras() == set()
        assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("settings, message", [
    (dict(runner="pooling"), "enable_lora=True runs with runner='generate' only"),
    (dict(max_loras=0), "max_loras must be a positive integer"),
    (dict(max_loras=3, max_cpu_loras=2), "max_cpu_loras must be an integer >= max_loras \\(3\\)"),
])
def test_settings_lora_cannot_run_beside(setup, settings, message):
    with pytest.raises(ValueError, match=message):
        LLM(setup["base"], enable_lora=True, **CPU, **settings)
