"""Every family from a GGUF file written as llama.cpp's converter writes it (`gguf_files.write_gguf`): in F32, greedy
output token-exact against transformers on the original safetensors checkpoint; quantized, kept in its blocks, the
most likely next token of a text agrees with transformers' on the file dequantized to float32."""
import os
import random

import pytest
import torch
from checkpoints import CORPUS, hf_greedy, hf_teacher_forced, make_checkpoint, make_family_checkpoint, teacher_forced
from gguf_files import write_gguf

from nanovllm import LLM, SamplingParams
from nanovllm.layers.ggml_weight import GGMLWeight
from nanovllm.layers.moe import FusedMoE
from nanovllm.models.gguf.config import Metadata, gguf_config
from nanovllm.models.gguf.metadata import TOKENIZERS_READ_FROM, tokenizer_of

gguf = pytest.importorskip("gguf")

MAX_TOKENS = 12
PROMPTS = [[random.Random(n).randrange(300) for _ in range(n)] for n in (3, 30, 70)]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SETTINGS = dict(device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=16, max_num_batched_tokens=64)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0]}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# name: (general.architecture, how the checkpoint is made). Settings a GGUF file can state: Gemma 2/3's queries
# scaled by head_dim, Gemma 3's local layers every 6 but one and its vocabulary the tokenizer's (the converter drops
# the embedding's other rows), Qwen2-MoE's top-k weights as they are and Qwen3-MoE's
# renormalized (llama.cpp's assumptions), every layer sparse.
CASES = {
    "mistral": ("llama", dict(family="mistral", tie_word_embeddings=False)),
    "mixtral": ("llama", dict(checkpoint="mixtral", num_local_experts=4, num_experts_per_tok=2,
                              tie_word_embeddings=False)),
    "granite": ("granite", dict(family="granite", tie_word_embeddings=True)),
    "gemma": ("gemma", dict(family="gemma", tie_word_embeddings=True)),
    "gemma2": ("gemma2", dict(family="gemma2", tie_word_embeddings=True, query_pre_attn_scalar=16)),
    "gemma3": ("gemma3", dict(family="gemma3", tie_word_embeddings=True, query_pre_attn_scalar=16,
                              sliding_window_pattern=6, num_hidden_layers=7, vocab_size=300, hub_config={
                                  "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                  "rope_scaling": {"rope_type": "linear", "factor": 4.0}})),
    "phi3": ("phi3", dict(family="phi3", tie_word_embeddings=False)),
    "phi3_longrope": ("phi3", dict(family="phi3", max_position_embeddings=256, sliding_window=None, hub_config={
        "original_max_position_embeddings": 32, "rope_scaling": LONGROPE})),
    "olmo2": ("olmo2", dict(family="olmo2")),
    "gpt_neox": ("gptneox", dict(family="gpt_neox")),
    "stablelm": ("stablelm", dict(family="stablelm")),
    "stablelm_qk_norm": ("stablelm", dict(family="stablelm_qk_norm", tie_word_embeddings=True)),
    "qwen2_moe": ("qwen2moe", dict(checkpoint="qwen2_moe", shared_expert_intermediate_size=64, norm_topk_prob=False,
                                   **MOE)),
    "qwen3_moe": ("qwen3moe", dict(checkpoint="qwen3_moe", norm_topk_prob=True, tie_word_embeddings=False, **MOE)),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    paths: dict[str, str] = {}

    def build(name: str) -> str:
        if name not in paths:
            settings = dict(CASES[name][1])
            path = str(tmp_path_factory.mktemp(name))
            if "checkpoint" in settings:
                paths[name] = make_checkpoint(path, family=settings.pop("checkpoint"), seed=3, **settings)
            else:
                paths[name] = make_family_checkpoint(path, settings.pop("family"), seed=3, **settings)
        return paths[name]

    return build


@pytest.fixture(autouse=True)
def cache(private_cache):
    return private_cache


def skip_where_transformers_cannot_read_its_tokenizer(gguf_path: str) -> None:
    """Before transformers 5.18 (`TOKENIZERS_READ_FROM`) some families' GGUF tokenizers are refused (a clear
    ValueError, tested in test_gguf.py); from it, every one must read."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(TOKENIZERS_READ_FROM):
        try:
            tokenizer_of(gguf_path)
        except ValueError as e:
            pytest.skip(str(e))


@pytest.mark.parametrize("name", list(CASES))
def test_f32_gguf_matches_transformers_on_the_original_checkpoint(checkpoint, name, tmp_path):
    path = checkpoint(name)
    gguf_path = write_gguf(str(tmp_path / f"{name}.gguf"), path)
    skip_where_transformers_cannot_read_its_tokenizer(gguf_path)
    assert gguf.GGUFReader(gguf_path).fields["general.architecture"].contents() == CASES[name][0]
    expected = hf_greedy(path, PROMPTS, MAX_TOKENS)
    with LLM(gguf_path, **SETTINGS) as llm:
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def _dequantized_reference(model_dir: str, qtype: str, out: str) -> str:
    """The checkpoint in `model_dir` with the tensors `write_gguf` rounds (matrices but norms and routers) replaced by
    their `qtype` blocks dequantized: the float32 model the quantized file stands for."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    kind = gguf.GGMLQuantizationType[qtype]
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    routers = (".gate.weight", "shared_expert_gate.weight")
    for name, tensor in weights.items():
        if tensor.dim() >= 2 and "norm" not in name and not name.endswith(routers):
            rounded = gguf.quants.dequantize(gguf.quants.quantize(tensor.float().numpy(), kind), kind)
            weights[name] = torch.from_numpy(rounded).reshape(tensor.shape).contiguous()
    save_file(weights, os.path.join(out, "model.safetensors"))
    return out


@pytest.mark.parametrize("name", ["mixtral", "gemma2", "phi3", "gpt_neox", "qwen2_moe", "stablelm_qk_norm"])
def test_q8_0_gguf_runs_in_its_blocks_and_agrees_with_its_dequantized_model(checkpoint, name, tmp_path):
    """Every matrix but norms and routers in Q8_0, experts included: nanovllm keeps them as GGML blocks; over a text,
    its perplexity is within 2% of transformers' on the dequantized weights and its most likely next token the same
    at >= 95% of positions."""
    from transformers import AutoTokenizer

    path = checkpoint(name)
    gguf_path = write_gguf(str(tmp_path / f"{name}-q8_0.gguf"), path, qtype="Q8_0")
    skip_where_transformers_cannot_read_its_tokenizer(gguf_path)
    ids = AutoTokenizer.from_pretrained(path).encode(" ".join(CORPUS[:5]))[:120]
    with LLM(gguf_path, **SETTINGS) as llm:
        model = llm.engine.model_runner.model
        assert isinstance(model.model.layers[0].self_attn.o_proj.weight, GGMLWeight)
        assert all(isinstance(m.gate_up_proj[0], GGMLWeight) and isinstance(m.down_proj[0], GGMLWeight)
                   for m in model.modules() if isinstance(m, FusedMoE))
        ppl, top1 = teacher_forced(llm, ids)
    reference = _dequantized_reference(path, "Q8_0", str(tmp_path / "dequantized"))
    ref_ppl, ref_top1 = hf_teacher_forced(reference, ids)
    original_ppl, _ = hf_teacher_forced(path, ids)
    assert ref_ppl != original_ppl  # the reference is the rounded model, not the original one
    assert abs(ppl / ref_ppl - 1) < 0.02, (ppl, ref_ppl)
    assert sum(a == b for a, b in zip(top1, ref_top1)) >= 0.95 * len(top1)


def test_q8_0_experts_split_over_two_ranks_give_one_ranks_tokens(tmp_path):
    """tensor_parallel_size=2 on a Qwen2-MoE Q8_0 file: every expert's gate/up rows and down inputs (64 wide: one
    32-value block per rank), the shared expert's too, split across the ranks; the same greedy tokens as one rank."""
    path = make_checkpoint(str(tmp_path / "moe"), family="qwen2_moe", seed=4, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=64, shared_expert_intermediate_size=64, norm_topk_prob=False)
    gguf_path = write_gguf(str(tmp_path / "moe-q8_0.gguf"), path, qtype="Q8_0")
    with LLM(gguf_path, **SETTINGS) as llm:
        expected = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with LLM(gguf_path, tensor_parallel_size=2, **SETTINGS) as llm:
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def _metadata(arch: str, **fields) -> Metadata:
    base = {"context_length": 512, "embedding_length": 64, "block_count": 46, "attention.head_count": 4,
            "attention.key_length": 32, "feed_forward_length": 128, "attention.layer_norm_rms_epsilon": 1e-6}
    return Metadata({"general.architecture": arch, **{f"{arch}.{k}": v for k, v in {**base, **fields}.items()}},
                    {"token_embd.weight": [64, 300]}, f"{arch}.gguf")


def test_what_a_file_leaves_out_is_what_llama_cpp_assumes_and_what_it_lacks_is_named():
    gemma2 = gguf_config(_metadata("gemma2"), {})
    assert gemma2["sliding_window"] == 4096 and gemma2["layer_types"][:3] == ["sliding_attention", "full_attention",
                                                                             "sliding_attention"]
    assert gemma2["query_pre_attn_scalar"] == 64 // 4  # 46 layers: the 27B, scaled by hidden / heads
    gemma3 = gguf_config(_metadata("gemma3", block_count=12, **{"attention.sliding_window": 512}), {})
    assert gemma3["query_pre_attn_scalar"] == 32 and gemma3["layer_types"].count("full_attention") == 2
    assert gemma3["layer_types"][5] == gemma3["layer_types"][11] == "full_attention"
    assert gemma3["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert gguf_config(_metadata("qwen3moe", expert_count=8, expert_used_count=2, expert_feed_forward_length=32),
                       {})["norm_topk_prob"] is True
    with pytest.raises(ValueError, match=r"granite.gguf: the GGUF metadata lacks granite.attention.scale, which a "
                                         r"granite model needs"):
        gguf_config(_metadata("granite"), {})
    with pytest.raises(ValueError, match=r"llama.gguf: rope scaling 'yarn' in GGUF files is not supported"):
        gguf_config(_metadata("llama", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}), {})
