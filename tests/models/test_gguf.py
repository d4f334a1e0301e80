"""GGUF import: a tiny GGUF file written here with the gguf package, read through transformers, run by nanovllm."""
import io
import os
import shutil

import pytest
import torch
from checkpoints import GGUF_Q8_0_TENSORS, hf_greedy, make_checkpoint, make_gguf

from nanovllm import LLM, SamplingParams
from nanovllm.cli import main as cli
from nanovllm.gguf_import import _parsed_once, cached_conversion, convert_gguf
from nanovllm.progress import Progress

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 9, 200, 17], list(range(40, 140)), [300] * 3]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("gguf-source")), family="llama", tie_word_embeddings=False,
                           seed=5)


@pytest.fixture(scope="module")
def gguf_file(llama_dir, tmp_path_factory) -> str:
    return make_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"), llama_dir, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def converted(gguf_file, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("converted") / "tiny-llama")
    assert cli(["convert", gguf_file, out]) == 0
    return out


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_converted_weights_are_the_original_ones(llama_dir, converted):
    """q/k rows un-permuted, float32 tensors bit-exact, Q8_0 tensors exactly their dequantized blocks."""
    from safetensors.torch import load_file

    original, result = load_file(os.path.join(llama_dir, "model.safetensors")), load_file(
        os.path.join(converted, "model.safetensors"))
    assert sorted(result) == sorted(original)
    for name, tensor in original.items():
        if any(f"mlp.{q.removeprefix('ffn_')}_proj" in name for q in GGUF_Q8_0_TENSORS):
            quantized = gguf.quants.quantize(tensor.numpy(), gguf.GGMLQuantizationType.Q8_0)
            expected = torch.from_numpy(gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0))
            assert not torch.equal(expected, tensor), name
        else:
            expected = tensor
        assert torch.equal(result[name], expected), name


def test_converted_weights_are_transformers_own_dequantization(gguf_file, converted):
    """Bit for bit what transformers' GGUF loader gives by itself, without the shared parse `_parsed_once` sets up."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file),
                                                 dtype=torch.float32)
    expected, result = model.state_dict(), load_file(os.path.join(converted, "model.safetensors"))
    assert sorted(result) == sorted(expected)
    for name, tensor in result.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor.view(torch.int32),
                                                                    expected[name].view(torch.int32)), name


def test_conversion_reports_its_phases_counts_its_tensors_and_restores_gguf(gguf_file, llama_dir, tmp_path,
                                                                           capsys):
    originals = gguf.GGUFReader, gguf.get_tensor_name_map, gguf.dequantize
    cached_conversion(gguf_file)
    err = capsys.readouterr().err
    phases = ["converting", "reading the GGUF metadata ...", "building the tokenizer ...",
              "loading and dequantizing tensors ...", "MB of weights, the config and the tokenizer ...", "converted in"]
    positions = [err.find(phase) for phase in phases]
    assert -1 not in positions and positions == sorted(positions), err
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, gguf.dequantize) == originals
    ended = []  # each phase as the next one starts: (phase, count, total)

    class Recording(Progress):
        def __call__(self, phase: str, total: int = 0, **kwargs) -> None:
            ended.append((self.phase, self.count, self.total))
            super().__call__(phase, total, **kwargs)

    with Recording("converted", out=io.StringIO()) as progress, _parsed_once(progress):
        convert_gguf(gguf_file, str(tmp_path / "out"), progress)
        tensors = len(gguf.GGUFReader(gguf_file).tensors)
    assert ("loading and dequantizing tensors", tensors, tensors) in ended and tensors > 0
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, gguf.dequantize) == originals
    with pytest.raises(ValueError, match="scales its rope frequencies"):
        convert_gguf(make_gguf(str(tmp_path / "scaled.gguf"), llama_dir, CHAT_TEMPLATE, rope_freqs=True),
                     str(tmp_path / "scaled"))
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, gguf.dequantize) == originals
    assert "converted in" not in capsys.readouterr().err


def test_converted_directory_loads_in_transformers_with_tokenizer(llama_dir, converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(converted)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert not model.config.tie_word_embeddings
    original, tokenizer = AutoTokenizer.from_pretrained(llama_dir), AutoTokenizer.from_pretrained(converted)
    text = "The quick brown fox jumps over the lazy dog."
    assert tokenizer.encode(text) == original.encode(text)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<user>hi<assistant>"


def test_gguf_file_runs_like_transformers_on_the_converted_directory(gguf_file, converted, cache, capsys):
    expected = hf_greedy(converted, PROMPTS, GREEDY.max_tokens)
    with LLM(gguf_file, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256) as llm:
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        assert llm.tokenizer.chat_template == CHAT_TEMPLATE
        cached_dir = llm.config.model
    assert os.path.dirname(cached_dir) == str(cache / "gguf") and "converting" in capsys.readouterr().err
    with LLM(os.path.dirname(gguf_file), device="cpu", dtype="float32", max_model_len=256) as llm:
        assert llm.config.model == cached_dir
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert "converting" not in capsys.readouterr().err


def test_copies_share_one_conversion_and_a_changed_file_replaces_its_own(gguf_file, llama_dir, cache, tmp_path,
                                                                          capsys):
    """The cache is keyed by content: two copies of one file (two virtualenvs, say) convert once; when one copy
    changes, it gets its own conversion, and a conversion no file converts to any more is deleted."""
    first, second = (str(shutil.copy(gguf_file, tmp_path / f"{name}.gguf")) for name in ("one", "two"))
    converted = cached_conversion(first)
    assert "converting" in capsys.readouterr().err
    assert cached_conversion(second) == converted
    assert "converting" not in capsys.readouterr().err
    other = make_gguf(str(tmp_path / "other.gguf"), llama_dir, "{{ messages[0]['content'] }}")
    shutil.copy(other, second)  # a different model under the same path
    changed = cached_conversion(second)
    assert changed != converted and os.path.isdir(converted)  # `first` still converts to it
    shutil.copy(gguf_file, second)
    os.remove(first)
    assert cached_conversion(second) == converted
    assert sorted(os.listdir(cache / "gguf")) == [os.path.basename(converted)]


def test_bad_gguf_inputs(gguf_file, llama_dir, tmp_path, monkeypatch, capsys):
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(gguf_file, two / name)
    with pytest.raises(ValueError, match=r"several GGUF files \['a.gguf', 'b.gguf'\]"):
        LLM(str(two))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="is a file but not a .gguf file"):
        LLM(str(tmp_path / "weights.bin"))
    assert cli(["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "out")]) == 2
    assert "GGUF file not found" in capsys.readouterr().err
    assert cli(["convert", gguf_file, str(two)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    scaled = make_gguf(str(tmp_path / "scaled.gguf"), llama_dir, CHAT_TEMPLATE, rope_freqs=True)
    with pytest.raises(ValueError, match="scales its rope frequencies"):
        LLM(scaled)
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r'needs the gguf package\(s\): pip install "nanovllm\[demo\]"'):
        LLM(gguf_file)
