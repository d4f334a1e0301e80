"""GGUF files: tiny ones written here with the gguf package, run by nanovllm as they are (quantized weights stay in
their blocks) against transformers on the same file dequantized to float32; and `python -m nanovllm convert`."""
import io
import json
import logging
import os
import shutil

import pytest
import torch
from checkpoints import (
    CORPUS,
    GGUF_Q8_0_TENSORS,
    hf_greedy,
    hf_teacher_forced,
    make_checkpoint,
    make_gguf,
    teacher_forced,
)

import nanovllm.execution.model_loading as model_loading
import nanovllm.execution.model_runner as model_runner
from nanovllm import LLM, SamplingParams
from nanovllm.cache import cache_dir
from nanovllm.cli import main as cli
from nanovllm.layers.ggml_weight import GGMLWeight
from nanovllm.models.gguf.convert import convert_gguf
from nanovllm.models.gguf.metadata import cached_metadata, parsed_once
from nanovllm.models.gguf.weights import check_table, read_table
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
def cache(private_cache):
    return private_cache


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
    """Bit for bit what transformers' GGUF loader gives by itself, without the shared parse `parsed_once` sets up."""
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
    convert_gguf(gguf_file, str(tmp_path / "first"))
    err = capsys.readouterr().err
    phases = ["reading the GGUF metadata ...", "building the tokenizer ...",
              "loading and dequantizing tensors ...", "MB of weights, the config and the tokenizer ...", "converted in"]
    positions = [err.find(phase) for phase in phases]
    assert -1 not in positions and positions == sorted(positions), err
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, gguf.dequantize) == originals
    ended = []  # each phase as the next one starts: (phase, count, total)

    class Recording(Progress):
        def __call__(self, phase: str, total: int = 0, **kwargs) -> None:
            ended.append((self.phase, self.count, self.total))
            super().__call__(phase, total, **kwargs)

    with Recording("converted", out=io.StringIO()) as progress, parsed_once(progress):
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


def test_gguf_file_runs_quantized_and_reads_only_its_metadata_into_the_cache(gguf_file, cache, capsys):
    """The file's Q8_0 MLP weights stay in their blocks; its float32 tensors become plain parameters; the cache
    holds the config, tokenizer and tensor table only; a directory holding the file is the same model."""
    with LLM(gguf_file, device="cpu", dtype="float32", max_model_len=256) as llm:
        layer = llm.engine.model_runner.model.model.layers[0]
        assert isinstance(layer.mlp.gate_up_proj.weight, GGMLWeight) and layer.mlp.gate_up_proj.weight.qtypes == [8]
        assert isinstance(layer.mlp.down_proj.weight, GGMLWeight)
        assert isinstance(layer.self_attn.qkv_proj.weight, torch.nn.Parameter)
        assert llm.tokenizer.chat_template == CHAT_TEMPLATE and llm.config.model == gguf_file
        assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)[0]["token_ids"]) == GREEDY.max_tokens
    assert "reading the config and tokenizer" in capsys.readouterr().err
    [entry] = os.listdir(cache / "gguf-metadata")
    files = sorted(os.listdir(cache / "gguf-metadata" / entry))
    assert files == ["chat_template.jinja", "config.json", "sources.json", "tensors.json", "tokenizer.json",
                     "tokenizer_config.json"]
    assert sum(os.path.getsize(cache / "gguf-metadata" / entry / f) for f in files) < 100_000
    with LLM(os.path.dirname(gguf_file), device="cpu", dtype="float32", max_model_len=256) as llm:
        assert llm.config.model == gguf_file
    assert "reading the config" not in capsys.readouterr().err


def test_a_tokenizer_given_as_vllm_takes_it(gguf_file, llama_dir, tmp_path):
    with LLM(model=gguf_file, tokenizer=llama_dir, device="cpu", dtype="float32", max_model_len=256) as llm:
        assert llm.config.tokenizer == llama_dir and llm.tokenizer.chat_template is None
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found: .*nowhere"):
        LLM(gguf_file, tokenizer=str(tmp_path / "nowhere"))


def test_without_cpu_kernels_gguf_weights_are_dequantized_at_load_and_match_transformers(
        gguf_file, converted, monkeypatch, caplog):
    monkeypatch.setattr(model_runner, "cpu_kernels", lambda: None)
    monkeypatch.setattr(model_loading, "cpu_kernels", lambda: None)
    expected = hf_greedy(converted, PROMPTS, GREEDY.max_tokens)
    with caplog.at_level(logging.WARNING, "nanovllm"), \
            LLM(gguf_file, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256) as llm:
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        assert not any(isinstance(m, GGMLWeight) for m in llm.engine.model_runner.model.modules())
    said = [r.getMessage() for r in caplog.records if "dequantized to float32 at load" in r.getMessage()]
    assert len(said) == 1 and "CPU kernels are unavailable" in said[0]


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("tied")), family="llama", tie_word_embeddings=True, seed=6)


@pytest.fixture(scope="module")
def text_ids(llama_dir) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_dir).encode(" ".join(CORPUS[:5]))[:160]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantized_gguf_teacher_forced_against_its_float32_dequantization(qtype, tied_llama_dir, text_ids,
                                                                          tmp_path):
    """Every 2-D weight in `qtype`, the LM head tied to the embedding (as in SmolLM2's file): loaded as it is,
    nanovllm's perplexity of a text is within 2% of transformers' on the same file dequantized to float32, and its
    most likely next token is the same at >= 95% of the positions."""
    from transformers import AutoModelForCausalLM

    path = make_gguf(str(tmp_path / f"tiny-{qtype}.gguf"), tied_llama_dir, CHAT_TEMPLATE, qtype=qtype,
                     quantized=("",))
    with LLM(path, device="cpu", dtype="float32", max_model_len=256) as llm:
        model = llm.engine.model_runner.model
        assert isinstance(model.lm_head.weight, GGMLWeight) and model.lm_head.weight is model.model.embed_tokens.weight
        assert model.model.layers[1].self_attn.qkv_proj.weight.qtypes == [llm_qtype(qtype)]
        ppl, top1 = teacher_forced(llm, text_ids)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32).eval()
    ref_ppl, ref_top1 = hf_teacher_forced(reference, text_ids)
    original_ppl, _ = hf_teacher_forced(AutoModelForCausalLM.from_pretrained(tied_llama_dir).eval(), text_ids)
    assert ref_ppl != original_ppl  # the file's weights are not the original ones: the comparison sees quantization
    assert abs(ppl / ref_ppl - 1) < 0.02, (ppl, ref_ppl)
    assert sum(a == b for a, b in zip(top1, ref_top1)) >= 0.95 * len(top1)


def llm_qtype(name: str) -> int:
    return int(gguf.GGMLQuantizationType[name])


def test_metadata_is_shared_by_copies_and_a_changed_file_gets_its_own(gguf_file, llama_dir, cache, tmp_path, capsys):
    """The cache is keyed by content: two copies of one file (two virtualenvs, say) read it once; when one copy
    changes, it gets its own entry, and an entry no file names any more is deleted."""
    first, second = (str(shutil.copy(gguf_file, tmp_path / f"{name}.gguf")) for name in ("one", "two"))
    entry = cached_metadata(first)
    assert "reading the config" in capsys.readouterr().err
    assert cached_metadata(second) == entry
    assert "reading the config" not in capsys.readouterr().err
    other = make_gguf(str(tmp_path / "other.gguf"), llama_dir, "{{ messages[0]['content'] }}")
    shutil.copy(other, second)  # a different model under the same path
    changed = cached_metadata(second)
    assert changed != entry and os.path.isdir(entry)  # `first` still names it
    shutil.copy(gguf_file, second)
    os.remove(first)
    assert cached_metadata(second) == entry
    assert sorted(os.listdir(cache / "gguf-metadata")) == [entry.name]


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
    with pytest.raises(ValueError, match=r"quantization='int8' quantizes unquantized checkpoints.*is a GGUF file"):
        LLM(gguf_file, quantization="int8")
    odd_type = make_gguf(str(tmp_path / "f64.gguf"), llama_dir, CHAT_TEMPLATE,
                         raw_types={"blk.1.ffn_up.weight": int(gguf.GGMLQuantizationType.F64)})
    with pytest.raises(ValueError, match=r"f64.gguf: tensor 'blk.1.ffn_up.weight' has GGML type F64, which nanovllm "
                                         r"does not run; supported types: \['BF16', 'F16', 'F32', 'Q2_K'"):
        LLM(odd_type)
    other_arch = make_gguf(str(tmp_path / "falcon.gguf"), llama_dir, CHAT_TEMPLATE, architecture="falcon")
    with pytest.raises(ValueError, match=r"falcon.gguf: unsupported GGUF architecture 'falcon'; nanovllm runs "
                                         r"\['bert', 'gemma', 'gemma2', 'gemma3', 'gptneox', 'granite', 'llama', "
                                         r"'olmo2', 'phi3', 'qwen2', 'qwen2moe', 'qwen3', 'qwen3moe', 'stablelm'\]"):
        LLM(other_arch)
    truncated = tmp_path / "truncated.gguf"
    for cut in (1000, os.path.getsize(gguf_file) // 2, 100_000):
        truncated.write_bytes(open(gguf_file, "rb").read()[:-cut])
        with pytest.raises(ValueError, match="truncated.gguf (is truncated|is not a readable GGUF file)"):
            LLM(str(truncated))
    import transformers

    def refuse(*args, **kwargs):
        raise ValueError("GGUF model with architecture llama is not supported yet.")  # as transformers 5.17 refuses

    with monkeypatch.context() as patch:
        patch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
        with pytest.raises(ValueError, match=r"transformers \S+ could not build the tokenizer of .*tiny-llama.gguf "
                                             r"\(ValueError: GGUF model .*pip install -U 'transformers>=5.18'"):
            LLM(gguf_file)
    assert not os.path.isdir(cache_dir() / "gguf-metadata") or os.listdir(cache_dir() / "gguf-metadata") == []
    with open(tmp_path / "tensors.json", "w") as f:
        json.dump(read_table(str(cached_metadata(gguf_file))), f)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 splits the 128 inputs of 'blk.0.ffn_down.weight' "
                                         r"into 16 per rank, not whole 32-value Q8_0 blocks"):
        check_table(read_table(str(tmp_path)), gguf_file, 8)
    check_table(read_table(str(tmp_path)), gguf_file, 4)
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r'needs the gguf package\(s\): pip install "nanovllm\[demo\]"'):
        LLM(gguf_file)


def test_tensor_parallel_splits_quantized_rows_and_whole_input_blocks(tied_llama_dir, tmp_path):
    """tensor_parallel_size=2 on a file with every 2-D weight in Q8_0 (the embedding and LM head split by vocabulary,
    q/k/v and gate/up by output rows, o and down by whole input blocks): the same greedy tokens as one rank."""
    path = make_gguf(str(tmp_path / "tp.gguf"), tied_llama_dir, CHAT_TEMPLATE, quantized=("",))
    settings = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=128)
    with LLM(path, **settings) as llm:
        expected = [o["token_ids"] for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
    with LLM(path, tensor_parallel_size=2, **settings) as llm:
        assert [o["token_ids"] for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)] == expected
