"""A checkpoint that does not match its config, or a damaged weight file, is named precisely before any work starts."""
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from nanovllm import LLM


def _copy_without(model: str, tmp_path, key: str) -> str:
    path = shutil.copytree(model, tmp_path / f"no-{key}")
    config = json.loads((path / "config.json").read_text())
    del config[key]
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("key, message", [
    ("vocab_size", r"'model.embed_tokens.weight' in \S+model.safetensors has shape \(384, 64\), but the model config "
                   r"expects \(151936, 64\): dimension 0 is 384 but the config implies 151936 "
                   r"\(vocab_size=151936, not in config.json: transformers' default\)"),
    ("hidden_size", r"'model.embed_tokens.weight' .* dimension 1 is 64 but the config implies 4096 "
                    r"\(hidden_size=4096, not in config.json"),
    ("num_attention_heads", r"'model.layers.0.self_attn.o_proj.weight' .* dimension 1 is 64 but the config implies 512 "
                            r"\(num_attention_heads=32, not in config.json: transformers' default x head_dim=16\)"),
])
def test_config_keys_missing_from_config_json_are_named(tied_model, tmp_path, key, message):
    with pytest.raises(ValueError, match=message):
        LLM(_copy_without(tied_model, tmp_path, key), device="cpu", dtype="float32", max_model_len=128)


def test_a_tensor_of_the_wrong_shape_is_named_with_its_config_key(untied_model, tmp_path):
    """A sharded checkpoint (several files): the error names the tensor, the file it is in and the config key."""
    path = shutil.copytree(untied_model, tmp_path / "wrong")
    name = "model.layers.1.mlp.up_proj.weight"
    file = next(f for f in sorted(path.glob("*.safetensors")) if name in load_file(f))
    weights = load_file(file)
    weights[name] = weights[name][:-1].contiguous()
    save_file(weights, file)
    with pytest.raises(ValueError, match=rf"'{name}' in {file} has shape \(127, 64\), but the model config expects "
                                         r"\(128, 64\): dimension 0 is 127 but the config implies 128 "
                                         r"\(intermediate_size=128\)"):
        LLM(str(path), device="cpu", dtype="float32", max_model_len=128)


@pytest.mark.parametrize("damage", ["truncate", "garble"])
def test_a_damaged_weight_file_is_named(tied_model, tmp_path, damage):
    path = shutil.copytree(tied_model, tmp_path / damage)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2] if damage == "truncate" else b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(ValueError, match=rf"{file} is not a readable safetensors file .*truncated or corrupt"):
        LLM(str(path), device="cpu", dtype="float32", max_model_len=128)
