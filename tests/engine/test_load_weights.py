"""`LLM.load_weights` (weights replaced in place, as RL trainers update vLLM between rollouts) and
`LLM.reset_prefix_cache`: after an update the engine gives exactly a fresh engine's greedy tokens of the new weights
(and transformers'), on one engine, tensor-parallel ranks, data-parallel replicas and quantized weights; bad input
changes nothing."""
import os
import shutil

import pytest
import torch
from checkpoints import hf_greedy, make_checkpoint, make_gguf
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.layers.ggml_weight import GGMLWeight

SETTINGS = dict(device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256)
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SHARED = [(7 * i) % 300 + 5 for i in range(40)]  # two whole 16-token blocks and more
PROMPTS = [SHARED + [11, 12], [3, 4, 5], SHARED + [200]]


def tokens(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def fresh(path: str, **settings) -> list[list[int]]:
    with LLM(path, **{**SETTINGS, **settings}) as llm:
        return tokens(llm)


def hf_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The state dict a trainer holds: transformers' model of `path` (a tied model's lm_head.weight included)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def merged(path: str, base: str, updates: dict[str, torch.Tensor]) -> str:
    """A copy of checkpoint `base` (one safetensors file) with `updates` written over its tensors."""
    shutil.copytree(base, path)
    weights = load_file(os.path.join(base, "model.safetensors"))
    assert set(updates) <= set(weights)
    weights.update({name: tensor.contiguous() for name, tensor in updates.items()})
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def tied_b(tmp_path_factory) -> str:
    """The `tied_model` fixture's config with other weights."""
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen3-tied-b")), tie_word_embeddings=True, seed=10)


@pytest.fixture(scope="module")
def llama_untied_b(tmp_path_factory) -> str:
    """The `llama_untied_model` fixture's config (biases everywhere, untied head) with other weights."""
    return make_checkpoint(str(tmp_path_factory.mktemp("llama-untied-b")), family="llama", tie_word_embeddings=False,
                           seed=11, hub_style=False, attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="module")
def partial(tied_model, tied_b, tmp_path_factory) -> tuple[dict[str, torch.Tensor], str]:
    """A few of B's tensors (a part of the fused q/k/v, of the fused gate/up, the tied embedding, a norm, a whole
    projection), and the checkpoint of A with them."""
    b = load_file(os.path.join(tied_b, "model.safetensors"))
    names = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight",
             "model.layers.1.input_layernorm.weight", "model.layers.0.self_attn.o_proj.weight"]
    updates = {name: b[name] for name in names}
    return updates, merged(str(tmp_path_factory.mktemp("partial") / "merged"), tied_model, updates)


@pytest.mark.parametrize("a, b", [("tied_model", "tied_b"), ("llama_untied_model", "llama_untied_b")])
def test_a_whole_state_dict_gives_a_fresh_engine_of_it(request, a, b):
    a, b = request.getfixturevalue(a), request.getfixturevalue(b)
    expected = hf_greedy(b, PROMPTS, MAX_TOKENS)
    assert fresh(b) == expected
    with LLM(a, **SETTINGS) as llm:
        before = tokens(llm)
        assert before == hf_greedy(a, PROMPTS, MAX_TOKENS) != expected
        assert llm.stats()["num_cached_tokens"] > 0  # PROMPTS[2] hit the blocks PROMPTS[0] computed
        cached = llm.stats()["num_cached_tokens"]
        llm.load_weights(hf_state_dict(b).items())
        assert tokens(llm) == expected  # the same prompts: nothing computed with A's weights was reused
        assert llm.stats()["num_cached_tokens"] == cached + 2 * 16  # only PROMPTS[2] on PROMPTS[0]'s new blocks
        assert tokens(llm) == expected
        llm.load_weights(load_file(os.path.join(a, "model.safetensors")))  # back, as a dict, from the file
        assert tokens(llm) == before


def test_a_partial_update_gives_a_fresh_engine_of_the_merged_weights(tied_model, partial):
    updates, merged_path = partial
    expected = hf_greedy(merged_path, PROMPTS, MAX_TOKENS)
    assert fresh(merged_path) == expected
    with LLM(tied_model, **SETTINGS) as llm:
        assert tokens(llm) != expected
        llm.load_weights(updates.items())
        assert tokens(llm) == expected


def test_bfloat16_weights_of_a_trainer_load_as_float32_would_round_them(tied_model, tied_b, tmp_path):
    """Tensors in another dtype than the engine's are converted by the loaders, as at load."""
    rounded = {name: t.to(torch.bfloat16) for name, t in load_file(os.path.join(tied_b, "model.safetensors")).items()}
    path = merged(str(tmp_path / "rounded"), tied_b, {name: t.float() for name, t in rounded.items()})
    with LLM(tied_model, **SETTINGS) as llm:
        llm.load_weights(rounded.items())
        assert tokens(llm) == fresh(path)


def test_float32_weights_into_a_bfloat16_engine_are_the_weights_a_fresh_one_loads(tied_model, tied_b):
    """float32 tensors written into a bfloat16 engine (packed for oneDNN where the CPU has native bfloat16) are rounded
    as the loaders round them at load: every parameter bitwise a fresh engine's, and the same greedy tokens."""
    def parameters(llm: LLM) -> dict[str, torch.Tensor]:
        model = llm.engine.model_runner.model
        return {name: (p.to_dense() if p.is_mkldnn else p).clone() for name, p in model.named_parameters()}

    with LLM(tied_b, **{**SETTINGS, "dtype": "bfloat16"}) as llm:
        expected, expected_tokens = parameters(llm), tokens(llm)
    with LLM(tied_model, **{**SETTINGS, "dtype": "bfloat16"}) as llm:
        llm.load_weights(hf_state_dict(tied_b).items())
        got = parameters(llm)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[name], expected[name]) for name in got), [
            name for name in got if not torch.equal(got[name], expected[name])]
        assert tokens(llm) == expected_tokens


@pytest.mark.parametrize("family, settings", [("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2,
                                                                 moe_intermediate_size=32, decoder_sparse_step=1))])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_experts_from_transformers_stacked_state_dict(tmp_path, family, settings, quantization):
    """transformers 5 holds a mixture of experts stacked (`mlp.experts.gate_up_proj`), its files per expert: either
    way in, the same model; with int8 the stacked experts are requantized one by one into their Q8_0 blocks."""
    a = make_checkpoint(str(tmp_path / "a"), family=family, tie_word_embeddings=False, seed=12, **settings)
    b = make_checkpoint(str(tmp_path / "b"), family=family, tie_word_embeddings=False, seed=13, **settings)
    state_dict = hf_state_dict(b)
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state_dict)
    expected = fresh(b, quantization=quantization)
    if quantization is None:
        assert expected == hf_greedy(b, PROMPTS, MAX_TOKENS)
    with LLM(a, **SETTINGS, quantization=quantization) as llm:
        experts = llm.engine.model_runner.model.model.layers[0].mlp.experts
        assert isinstance(experts.gate_up_proj[0], GGMLWeight) == (quantization == "int8")
        assert tokens(llm) != expected
        llm.load_weights(state_dict.items())
        assert tokens(llm) == expected


def test_int8_weights_are_requantized_as_a_fresh_int8_engine_quantizes(tied_model, tied_b, partial):
    updates, merged_path = partial
    with LLM(tied_model, **SETTINGS, quantization="int8") as llm:
        qkv = llm.engine.model_runner.model.model.layers[0].self_attn.qkv_proj.weight
        assert isinstance(qkv, GGMLWeight) and qkv.qtypes == [8]  # Q8_0
        segment = qkv.segment0
        llm.load_weights(updates.items())
        assert tokens(llm) == fresh(merged_path, quantization="int8")
        llm.load_weights(hf_state_dict(tied_b).items())
        assert tokens(llm) == fresh(tied_b, quantization="int8")
        model = llm.engine.model_runner.model
        assert model.model.layers[0].self_attn.qkv_proj.weight is qkv and qkv.segment0 is segment  # in place


def test_int8_llama_s_one_call_decoder_reads_the_new_blocks(llama_untied_model, llama_untied_b):
    """Llama's layers quantized decode through the C++ decoder stack, which holds the layers' blocks, norms and
    biases: written in place, it computes with the new weights."""
    with LLM(llama_untied_model, **SETTINGS, quantization="int4") as llm:
        if llm.engine.model_runner.cpu_decoder is None:
            pytest.skip("the compiled CPU kernels are unavailable")
        assert llm.engine.model_runner.model.model.layers[0].mlp.down_proj.weight.qtypes == [3]  # Q4_1
        tokens(llm)
        llm.load_weights(hf_state_dict(llama_untied_b).items())
        assert tokens(llm) == fresh(llama_untied_b, quantization="int4")


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory) -> tuple[str, str, str]:
    """Llama A and B, and A and B as GGUF files with their MLPs in Q8_0 (the rest float32)."""
    root = tmp_path_factory.mktemp("gguf-pair")
    a = make_checkpoint(str(root / "a"), family="llama", tie_word_embeddings=False, seed=14)
    b = make_checkpoint(str(root / "b"), family="llama", tie_word_embeddings=False, seed=15)
    return b, make_gguf(str(root / "a.gguf"), a, ""), make_gguf(str(root / "b.gguf"), b, "")


def test_a_gguf_file_s_quantized_weights_take_new_float_weights_in_their_type(gguf_pair):
    pytest.importorskip("gguf")
    b, a_gguf, b_gguf = gguf_pair
    with LLM(a_gguf, **SETTINGS) as llm:
        gate_up = llm.engine.model_runner.model.model.layers[0].mlp.gate_up_proj.weight
        assert isinstance(gate_up, GGMLWeight) and gate_up.qtypes == [8]
        llm.load_weights(hf_state_dict(b).items())
        assert tokens(llm) == fresh(b_gguf)


def test_a_type_that_cannot_be_requantized_is_refused_and_other_weights_still_load(gguf_pair, tmp_path):
    pytest.importorskip("gguf")
    b, _, _ = gguf_pair
    a_dir = os.path.join(os.path.dirname(gguf_pair[1]), "a")
    q5 = make_gguf(str(tmp_path / "a-q5.gguf"), a_dir, "", qtype="Q5_0")
    b_weights = hf_state_dict(b)
    with LLM(q5, **SETTINGS) as llm:
        before = tokens(llm)
        with pytest.raises(ValueError, match=r"'model\.layers\.\d\.mlp\.(gate|up|down)_proj\.weight'.*Q5_0"):
            llm.load_weights(b_weights.items())
        assert tokens(llm) == before
        attention = {name: t for name, t in b_weights.items() if ".self_attn." in name}
        llm.load_weights(attention.items())  # float32 in the file: replaced
        after = tokens(llm)
        assert after != before
    mixed = merged(str(tmp_path / "mixed"), a_dir, attention)  # A with B's attention: what the engine now holds
    assert after == fresh(make_gguf(str(tmp_path / "mixed-q5.gguf"), mixed, "", qtype="Q5_0"))


def test_bad_input_is_refused_before_anything_changes(tied_model, tied_b):
    b = hf_state_dict(tied_b)
    good = ("model.layers.0.self_attn.q_proj.weight", b["model.layers.0.self_attn.q_proj.weight"])
    with LLM(tied_model, **SETTINGS) as llm:
        before = tokens(llm)
        with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_prj\.weight'"):
            llm.load_weights([good, ("model.layers.0.self_attn.q_prj.weight", good[1])])
        with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.down_proj\.weight' has shape \(64, 64\), but "
                                             r"the model expects \(64, 128\)"):
            llm.load_weights([good, ("model.layers.1.mlp.down_proj.weight", torch.zeros(64, 64))])
        with pytest.raises(ValueError, match="int64"):
            llm.load_weights([good, ("model.norm.weight", torch.ones(64, dtype=torch.int64))])
        with pytest.raises(ValueError, match="pairs"):
            llm.load_weights([good, "model.norm.weight"])
        assert tokens(llm) == before
        assert llm.stats()["num_cached_tokens"] > 0  # a refused update keeps the prefix cache: nothing changed

        request_id = llm.add_request(PROMPTS[0], GREEDY)
        with pytest.raises(RuntimeError, match="1 request is waiting or running"):
            llm.load_weights(b.items())
        finished = {}
        while not llm.is_finished():
            finished.update({o.request_id: o.outputs[0].token_ids for o in llm.step() if o.finished})
        assert finished[request_id] == before[0]
        assert tokens(llm) == before


def test_reset_prefix_cache(tied_model):
    with LLM(tied_model, **SETTINGS) as llm:
        prompt = [SHARED]
        first = tokens(llm, prompt)
        assert llm.stats()["num_cached_tokens"] == 0
        assert tokens(llm, prompt) == first
        hits = llm.stats()["num_cached_tokens"]
        assert hits == 2 * 16
        assert llm.reset_prefix_cache() is True
        assert tokens(llm, prompt) == first
        assert llm.stats()["num_cached_tokens"] == hits  # no hit after the reset
        assert tokens(llm, prompt) == first
        assert llm.stats()["num_cached_tokens"] == 2 * hits  # the blocks computed since are cached again
        request_id = llm.add_request(SHARED, GREEDY)
        llm.step()
        assert llm.reset_prefix_cache() is False  # the running request's blocks keep their names
        llm.abort_request(request_id)
        assert llm.reset_prefix_cache() is True


def test_tensor_parallel_ranks_each_get_their_shard(tied_model, tied_b, partial):
    updates, merged_path = partial
    with LLM(tied_model, tensor_parallel_size=2, **SETTINGS) as llm:
        llm.load_weights(updates.items())
        assert tokens(llm) == hf_greedy(merged_path, PROMPTS, MAX_TOKENS)
        llm.load_weights(hf_state_dict(tied_b).items())
        assert tokens(llm) == hf_greedy(tied_b, PROMPTS, MAX_TOKENS)
        with pytest.raises(ValueError, match="q_prj"):
            llm.load_weights([("model.layers.0.self_attn.q_prj.weight", torch.zeros(64, 64))])
        assert tokens(llm) == hf_greedy(tied_b, PROMPTS, MAX_TOKENS)


def test_data_parallel_replicas_each_get_the_update(tied_model, tied_b, partial):
    updates, merged_path = partial
    prompts = PROMPTS + [[9, 8, 7, 6]]  # a prompt of its own reaches the other replica
    with LLM(tied_model, data_parallel_size=2, **SETTINGS) as llm:
        tokens(llm, prompts)
        assert all(r["num_requests"] > 0 for r in llm.stats()["replicas"])
        llm.load_weights(updates.items())
        assert tokens(llm, prompts) == hf_greedy(merged_path, prompts, MAX_TOKENS)
        llm.load_weights(hf_state_dict(tied_b).items())
        assert tokens(llm, prompts) == hf_greedy(tied_b, prompts, MAX_TOKENS)
        with pytest.raises(ValueError, match=r"has shape \(3, 3\)"):
            llm.load_weights([("model.norm.weight", torch.zeros(3, 3))])
        assert llm.reset_prefix_cache() is True
        cached = llm.stats()["num_cached_tokens"]
        assert tokens(llm, prompts) == hf_greedy(tied_b, prompts, MAX_TOKENS)
        assert llm.stats()["num_cached_tokens"] == cached + 2 * 16  # PROMPTS[2] on PROMPTS[0]'s new blocks only
