"""LoRA adapters as llama.cpp's `convert_lora_to_gguf.py` writes them (`gguf_files.write_gguf_lora`, from adapters PEFT
makes): greedy float32 tokens equal the PEFT directory's and PEFT's own model, Llama's q/k rows un-permuted and
Phi-3's fused projections kept whole, on a safetensors base and on a GGUF base (float or Q8_0 blocks); what cannot run
is refused at submission and the engine serves on."""
import os
import shutil

import numpy as np
import pytest
from checkpoints import make_checkpoint, make_family_checkpoint
from test_lora_engine import GREEDY, PROMPTS, engine, make_adapter, peft_greedy, tokens

from nanovllm.lora.request import LoRARequest

gguf = pytest.importorskip("gguf")
from gguf_files import write_gguf, write_gguf_lora  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapter_pair(base: str, root: str, **settings) -> tuple[str, str]:
    """A PEFT adapter on `base` and its GGUF file, in a directory of its own."""
    peft_dir = make_adapter(base, os.path.join(root, "peft"), 7, **settings)
    os.makedirs(os.path.join(root, "gguf"))
    return peft_dir, write_gguf_lora(os.path.join(root, "gguf", "adapter.gguf"), peft_dir, base)


@pytest.mark.parametrize("family", ["llama", "phi3", "gpt_neox"])
def test_gguf_adapter_equals_its_peft_source(tmp_path, family):
    """Llama (q/k rows permuted by the converter, grouped-query attention) with every projection, ranks from
    `rank_pattern`; Phi-3's fused qkv_proj and gate_up_proj; GPT-NeoX's four projections (its per-head q/k/v
    regrouped by the converter). The file, and the directory holding it, give PEFT's tokens, as the PEFT directory
    does."""
    targets = {"llama": ALL, "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
               "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]}[family]
    settings = dict(r=4, lora_alpha=8, target_modules=targets)
    if family == "llama":
        base = make_checkpoint(str(tmp_path / "base"), family="llama", seed=5, attention_bias=True, mlp_bias=True)
        settings["rank_pattern"] = {"k_proj": 2, "down_proj": 3}
    else:
        base = make_family_checkpoint(str(tmp_path / "base"), family, seed=5)
    peft_dir, gguf_file = adapter_pair(base, str(tmp_path), **settings)
    expected = peft_greedy(base, peft_dir, PROMPTS)
    assert expected != peft_greedy(base, None, PROMPTS)
    with engine(base, max_lora_rank=4) as llm:
        for i, path in enumerate((gguf_file, os.path.dirname(gguf_file), peft_dir)):
            assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest(f"{i}", i + 1, path),
                                       use_tqdm=False)) == expected, path


def test_gguf_adapter_on_a_gguf_base(tmp_path, private_cache):
    """On a float32 GGUF base: PEFT's tokens on the original checkpoint. On Q8_0 blocks with the float adapter: the
    PEFT directory's tokens on the same blocks, which are not the blocks' own."""
    base = make_checkpoint(str(tmp_path / "base"), family="llama", seed=9)
    peft_dir, gguf_file = adapter_pair(base, str(tmp_path), r=4, lora_alpha=16, target_modules=ALL)
    expected = peft_greedy(base, peft_dir, PROMPTS)
    with engine(write_gguf(str(tmp_path / "base-f32.gguf"), base), max_lora_rank=4) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("g", 1, gguf_file),
                                   use_tqdm=False)) == expected
    with engine(write_gguf(str(tmp_path / "base-q8_0.gguf"), base, qtype="Q8_0"), max_lora_rank=4) as llm:
        adapted = tokens(llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("g", 1, gguf_file), use_tqdm=False))
        assert adapted == tokens(llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("p", 2, peft_dir),
                                              use_tqdm=False))
        assert adapted != tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def rewritten(source: str, path: str, architecture: str | None = None, fields: dict | None = None,
              drop: tuple[str, ...] = (), extra: dict | None = None) -> str:
    """A copy of the GGUF adapter `source` with another architecture, string `fields` set (None: left out), tensors
    whose name ends with one of `drop` left out and `extra` tensors added."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(path, architecture or reader.fields["general.architecture"].contents())
    kept = {"general.type": "adapter", "adapter.type": "lora", **(fields or {})}
    for key, value in kept.items():
        if value is not None:
            writer.add_string(key, value)
    writer.add_float32("adapter.lora.alpha", reader.fields["adapter.lora.alpha"].contents())
    for tensor in reader.tensors:
        if not tensor.name.endswith(drop):
            writer.add_tensor(tensor.name, np.array(tensor.data))
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora-gguf-bad")
    base = make_checkpoint(str(root / "base"), family="llama", seed=3)
    other = make_checkpoint(str(root / "other"), family="llama", seed=3, hidden_size=32)
    _, good = adapter_pair(base, str(root / "good"), r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    _, for_other = adapter_pair(other, str(root / "for-other"), r=4, lora_alpha=8, target_modules=["q_proj"])
    two = root / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(good, two / name)
    truncated = root / "truncated.gguf"
    truncated.write_bytes(open(good, "rb").read()[:-100])
    norm = {"blk.0.attn_norm.weight": np.ones(64, dtype=np.float32)}
    return {"base": base, "good": good, "root": root, "paths": {
        "model": write_gguf(str(root / "model.gguf"), base),
        "control": rewritten(good, str(root / "control.gguf"), fields={"adapter.type": "control_vector"}),
        "untyped": rewritten(good, str(root / "untyped.gguf"), fields={"general.type": None}),
        "qwen2": rewritten(good, str(root / "qwen2.gguf"), architecture="qwen2"),
        "other": for_other,
        "half": rewritten(good, str(root / "half.gguf"), drop=("attn_q.weight.lora_b",)),
        "norm": rewritten(good, str(root / "norm.gguf"), extra=norm),
        "embedding": rewritten(good, str(root / "embedding.gguf"), extra={
            "token_embd.weight.lora_a": np.ones((4, 384), dtype=np.float32),
            "token_embd.weight.lora_b": np.ones((64, 4), dtype=np.float32)}),
        "truncated": str(truncated), "two": str(two), "missing": str(root / "nowhere.gguf"),
        "not-gguf": str(root / "base" / "config.json")}}


@pytest.fixture(scope="module")
def llm(bad):
    with engine(bad["base"]) as llm:
        yield llm


@pytest.mark.parametrize("name, error, message", [
    ("model", ValueError, "'model' .*model.gguf' is not a LoRA adapter \\(general.type="),
    ("untyped", ValueError, "'untyped' .*is not a LoRA adapter \\(general.type=None"),
    ("control", ValueError, "'control' .*is a 'control_vector' adapter \\(adapter.type\\); only 'lora'"),
    ("qwen2", ValueError, "'qwen2' .*an adapter for a 'qwen2' model, but the base model is 'llama'"),
    ("other", ValueError, "'other' .*q_proj has lora_A \\(4, 32\\).*trained for another base model"),
    ("half", ValueError, "'half' .*blk.0.attn_q.weight has lora_a but not both lora_a and lora_b"),
    ("norm", ValueError, "'norm' .*blk.0.attn_norm.weight', norm vectors, which llama.cpp skips"),
    ("embedding", ValueError, "'embedding' .*token_embd.weight is not a decoder layer's projection"),
    ("truncated", ValueError, "'truncated' .*truncated"),
    ("two", ValueError, "'two' .*holds several GGUF files \\['a.gguf', 'b.gguf'\\]"),
    ("missing", FileNotFoundError, "'missing' .*no file .*nowhere.gguf"),
    ("not-gguf", ValueError, "'not-gguf' .*is a file but not a .gguf file"),
])
def test_bad_gguf_adapters_are_refused_and_the_engine_serves_on(bad, llm, name, error, message):
    with pytest.raises(error, match=f"LoRA adapter {message}"):
        llm.generate([[1, 2, 3]], GREEDY, lora_request=LoRARequest(name, 1, bad["paths"][name]), use_tqdm=False)
    assert llm.is_finished() and llm.list_loras() == set()
    good = LoRARequest("good", 2, bad["good"])
    assert len(llm.generate([[1, 2, 3]], GREEDY, lora_request=good, use_tqdm=False)[0].outputs[0].token_ids) == 10
    assert llm.remove_lora(2)
