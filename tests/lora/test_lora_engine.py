"""LoRA adapters per request, against PEFT itself: adapters PEFT makes (random, non-zero) on tiny random checkpoints,
greedy token for token against `PeftModel` in float32, mixed in one batch beyond `max_loras`, under chunked prefill
and preemption, the prefix cache kept apart by adapter, the LRU of `max_cpu_loras`."""
import pytest
import torch
from checkpoints import hf_greedy, make_checkpoint, make_family_checkpoint

from nanovllm import LLM, SamplingParams
from nanovllm.lora.request import LoRARequest

peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Three adapters that use every field nanovllm reads: names, a regex, layers_to_transform, rank and alpha patterns,
# rsLoRA
ADAPTERS = {
    "a": dict(r=8, lora_alpha=16, target_modules=ALL),
    "b": dict(r=4, lora_alpha=8, target_modules=r".*\.(q_proj|v_proj|down_proj)", use_rslora=True),
    "c": dict(r=6, lora_alpha=4, target_modules=["k_proj", "o_proj", "up_proj"], layers_to_transform=[1],
              rank_pattern={"up_proj": 2}, alpha_pattern={"o_proj": 9}),
}
PROMPTS = [[5, 9, 30, 2, 7, 100, 101, 102, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,
            23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34], [40, 41, 42], [7, 8, 9, 10, 200, 201, 202]]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)  # as hf_greedy, which goes on past EOS


def make_adapter(base: str, path: str, seed: int, **settings) -> str:
    """A PEFT LoRA adapter on `base`, its weights random (`init_lora_weights=False`, so B is not zero)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **settings)).save_pretrained(path)
    return path


def peft_greedy(base: str, adapter: str | None, prompts: list[list[int]], device: str = "cpu") -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter, torch_device="cpu")  # as the model, whatever GPUs
    return hf_greedy(model.to(device).eval(), prompts, MAX_TOKENS, device)


def engine(base: str, **settings) -> LLM:
    return LLM(base, enable_lora=True, device="cpu", dtype="float32", kvcache_block_size=16, **settings)


def tokens(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> dict:
    """A qwen3 base, the three adapters on it, and PEFT's greedy outputs for each (None: the base)."""
    root = tmp_path_factory.mktemp("lora-qwen3")
    base = make_checkpoint(str(root / "base"), family="qwen3", seed=11)
    adapters = {name: make_adapter(base, str(root / name), i, **settings)
                for i, (name, settings) in enumerate(ADAPTERS.items())}
    expected = {name: peft_greedy(base, adapters.get(name), PROMPTS) for name in [None, *adapters]}
    requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}
    return {"base": base, "adapters": adapters, "expected": expected, "requests": requests, "root": root}


def test_each_adapter_alone_equals_peft(qwen3):
    with engine(qwen3["base"], max_loras=1, max_lora_rank=8) as llm:
        for name, request in qwen3["requests"].items():
            outputs = llm.generate(PROMPTS, GREEDY, lora_request=request, use_tqdm=False)
            assert tokens(outputs) == qwen3["expected"][name], name
            assert all(output.lora_request is request for output in outputs)
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == qwen3["expected"][None]
        assert qwen3["expected"]["a"] != qwen3["expected"][None]


@pytest.mark.parametrize("settings", [dict(), dict(max_num_batched_tokens=24, max_num_seqs=4),
                                      dict(num_kvcache_blocks=6, max_num_batched_tokens=32), dict(path="stacked"),
                                      dict(path="grouped")],
                         ids=["one-step", "chunked", "preempted", "stacked", "grouped"])
def test_mixed_batch_beyond_max_loras(qwen3, settings, monkeypatch):
    """Three adapters and the base, each prompt under each, in one call with max_loras=2: every output is its
    adapter's alone (PEFT's), with prompts chunked, or with too few KV blocks for all (preemption); and through
    torch's operators instead of the CPU kernel (as without a compiler), every step's rows stacked, or
    grouped by adapter as steps of more than `STACKED_ROWS` rows are (CUDA's Triton kernels: the test below)."""
    settings = dict(settings)
    path = settings.pop("path", None)
    if path is not None:
        monkeypatch.setattr("nanovllm.lora.manager.cpu_kernels", lambda: None)
    if path == "grouped":
        monkeypatch.setattr("nanovllm.lora.manager.STACKED_ROWS", 0)
    names = [None, "a", "b", "c"]
    prompts = [prompt for _ in names for prompt in PROMPTS]
    loras = [qwen3["requests"].get(name) for name in names for _ in PROMPTS]
    with engine(qwen3["base"], max_loras=2, max_lora_rank=8, **settings) as llm:
        manager, steps = llm.engine.model_runner.loras, []
        assert manager.kernel == (path is None)
        start_step = manager.start_step
        manager.start_step = lambda rows: (steps.append({i for i, _ in rows if i}), start_step(rows))[1]
        outputs = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
        assert max(map(len, steps)) == 2
        if "num_kvcache_blocks" in settings:
            assert llm.stats()["num_preemptions"] > 0
    assert tokens(outputs) == [t for name in names for t in qwen3["expected"][name]]


@pytest.mark.cuda
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_triton_kernels_and_graphs_equal_peft_on_the_gpu(qwen3, enforce_eager):
    """On a GPU in float32, three adapters and the base mixed in one call with max_loras=2, decode steps replayed
    from CUDA graphs (adapters changing between replays) or run eagerly: every output is PEFT's on the same GPU."""
    names = [None, "a", "b", "c"]
    prompts = [prompt for _ in names for prompt in PROMPTS]
    loras = [qwen3["requests"].get(name) for name in names for _ in PROMPTS]
    expected = [t for name in names for t in peft_greedy(qwen3["base"], qwen3["adapters"].get(name), PROMPTS, "cuda")]
    with LLM(qwen3["base"], enable_lora=True, dtype="float32", max_loras=2, max_lora_rank=8, max_num_seqs=8,
             enforce_eager=enforce_eager) as llm:
        runner, replays = llm.engine.model_runner, []
        assert (runner.graphs is None) == enforce_eager
        if not enforce_eager:
            run = runner.graphs.run
            runner.graphs.run = lambda *args: (replays.append(args[0].size(0)), run(*args))[1]
        outputs = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    assert tokens(outputs) == expected
    assert bool(replays) != enforce_eager


def test_prefix_cache_is_kept_apart_by_adapter(qwen3):
    """One 40-token prompt (two full blocks) under A, then B, then the base: each right, no hit across adapters;
    under A again its blocks are hit."""
    prompt, a, b = PROMPTS[:1], qwen3["requests"]["a"], qwen3["requests"]["b"]
    with engine(qwen3["base"], max_loras=2, max_lora_rank=8) as llm:
        for lora, name in ((a, "a"), (b, "b"), (None, None)):
            assert tokens(llm.generate(prompt, GREEDY, lora_request=lora, use_tqdm=False)) == \
                qwen3["expected"][name][:1]
            assert llm.stats()["num_cached_tokens"] == 0
        again = llm.generate(prompt, GREEDY, lora_request=a, use_tqdm=False)
        assert tokens(again) == qwen3["expected"]["a"][:1]
        assert again[0].num_cached_tokens == 32 == llm.stats()["num_cached_tokens"]


def test_lru_eviction_reload_and_pinning(qwen3):
    a, b, c = (qwen3["requests"][name] for name in "abc")
    with engine(qwen3["base"], max_loras=1, max_cpu_loras=2, max_lora_rank=8) as llm:
        manager = llm.engine.model_runner.loras
        for lora in (a, b, c):
            llm.generate(PROMPTS[1:2], GREEDY, lora_request=lora, use_tqdm=False)
        assert llm.list_loras() == {2, 3} and manager.num_loads == 3
        assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=a, use_tqdm=False)) == qwen3["expected"]["a"]
        assert llm.list_loras() == {1, 3} and manager.num_loads == 4
        assert llm.pin_lora(1)
        assert llm.add_lora(b) and not llm.add_lora(b)
        assert llm.list_loras() == {1, 2}
        assert llm.remove_lora(2) and not llm.remove_lora(2)
        assert llm.list_loras() == {1}
        # a request whose adapter was dropped while it waited reads it again when it runs
        request_id = llm.add_request(PROMPTS[2], GREEDY, lora_request=c)
        llm.remove_lora(3)
        while not llm.is_finished():
            done = [output for output in llm.step() if output.finished]
        assert done[0].request_id == request_id and done[0].outputs[0].token_ids == qwen3["expected"]["c"][2]


def test_stream_chat_and_ngram_speculation(qwen3):
    a = qwen3["requests"]["a"]
    with engine(qwen3["base"], max_lora_rank=8,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=a, use_tqdm=False)) == qwen3["expected"]["a"]
        streamed = [delta.outputs[0].token_ids for delta in llm.stream(PROMPTS[1:2], GREEDY, lora_request=[a])]
        assert sum(streamed, []) == qwen3["expected"]["a"][1]


@pytest.mark.parametrize("family, tp", [("llama", 1), ("mistral_full", 1), ("qwen2", 1), ("gemma", 1), ("granite", 1),
                                        ("olmo2", 1), ("stablelm", 1), ("phi3", 1), ("phi3", 2), ("gpt_neox", 1),
                                        ("gpt_neox", 2)])
def test_families_equal_peft(tmp_path, family, tp):
    """Every projection adapted, in each family's own module names (Phi-3's fused qkv_proj and gate_up_proj, and
    GPT-NeoX's query_key_value, its rows per head, are single modules in PEFT and cover their whole fused layer here;
    on two ranks each keeps its q/k/v and gate/up rows)."""
    if family == "llama":
        base = make_checkpoint(str(tmp_path / "base"), family="llama", seed=5, attention_bias=True, mlp_bias=True)
    elif family == "qwen2":
        base = make_checkpoint(str(tmp_path / "base"), family="qwen2", seed=5)
    else:
        base = make_family_checkpoint(str(tmp_path / "base"), family, seed=5)
    targets = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
               "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]}.get(family, ALL)
    adapter = make_adapter(base, str(tmp_path / "adapter"), 7, r=4, lora_alpha=8, target_modules=targets)
    expected = peft_greedy(base, adapter, PROMPTS[1:])
    with engine(base, max_lora_rank=4, tensor_parallel_size=tp) as llm:
        outputs = llm.generate(PROMPTS[1:], GREEDY, lora_request=LoRARequest("x", 1, adapter), use_tqdm=False)
    assert tokens(outputs) == expected


def test_quantized_base_adds_the_delta_after_the_base_linear(qwen3):
    """int8 weights (GGML blocks) with a float adapter: the same as the float path within int8's rounding: here the
    adapter's greedy tokens for most positions, and not the quantized base's own."""
    a = qwen3["requests"]["a"]
    with engine(qwen3["base"], max_lora_rank=8, quantization="int8") as llm:
        adapted = tokens(llm.generate(PROMPTS, GREEDY, lora_request=a, use_tqdm=False))
        plain = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert adapted != plain
    assert adapted[1][:3] == qwen3["expected"]["a"][1][:3]


def test_draft_model_and_structured_outputs(qwen3):
    """A draft model drafts without the adapter and the target verifies with it: the output is the adapter's; a
    structured output's constraint holds under an adapter."""
    from nanovllm import StructuredOutputsParams

    a = qwen3["requests"]["a"]
    with engine(qwen3["base"], max_lora_rank=8,
                speculative_config={"model": qwen3["base"], "num_speculative_tokens": 2}) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=a, use_tqdm=False)) == qwen3["expected"]["a"]
        assert llm.stats()["num_draft_tokens"] > 0
    with engine(qwen3["base"], max_lora_rank=8) as llm:
        params = SamplingParams(temperature=0, max_tokens=8,
                                structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        text = llm.generate(["Is it?"], params, lora_request=a, use_tqdm=False)[0].outputs[0].text
    assert text in ("yes", "no")


def test_moe_attention_and_a_bin_adapter(tmp_path):
    """A mixture of experts (Mixtral) with LoRA on its attention (its routed experts have none), the adapter saved as
    PyTorch's adapter_model.bin."""
    base = make_checkpoint(str(tmp_path / "base"), family="mixtral", seed=6, num_local_experts=4,
                           num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(8)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(init_lora_weights=False, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
    peft.get_peft_model(model, config).save_pretrained(str(tmp_path / "adapter"), safe_serialization=False)
    assert (tmp_path / "adapter" / "adapter_model.bin").exists()
    expected = peft_greedy(base, str(tmp_path / "adapter"), PROMPTS[1:])
    with engine(base, max_lora_rank=4) as llm:
        outputs = llm.generate(PROMPTS[1:], GREEDY, lora_request=LoRARequest("moe", 1, str(tmp_path / "adapter")),
                               use_tqdm=False)
    assert tokens(outputs) == expected


def test_tensor_parallel_two_ranks(qwen3):
    """Each rank keeps its share (B rows of q/k/v and gate/up split as their outputs, A columns of o/down as their
    inputs, summed by the layer's all-reduce): three adapters and the base mixed with max_loras=2, then the LRU, a
    pin and a removal on both ranks."""
    names = [None, "a", "b", "c"]
    prompts = [prompt for _ in names for prompt in PROMPTS]
    loras = [qwen3["requests"].get(name) for name in names for _ in PROMPTS]
    with engine(qwen3["base"], max_loras=2, max_lora_rank=8, tensor_parallel_size=2) as llm:
        assert tokens(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)) == \
            [t for name in names for t in qwen3["expected"][name]]
        assert llm.list_loras() == {2, 3} and llm.pin_lora(2) and llm.remove_lora(3)
        a = qwen3["requests"]["a"]
        assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=a, use_tqdm=False)) == qwen3["expected"]["a"]
        with pytest.raises(FileNotFoundError, match="LoRA adapter 'lost'"):
            llm.add_lora(LoRARequest("lost", 9, str(qwen3["root"] / "nowhere")))
        assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=a, use_tqdm=False)) == qwen3["expected"]["a"]


def test_beam_search_under_an_adapter_is_the_merged_models(qwen3, tmp_path):
    """Beam search under adapter A (its beams forking the adapter's KV blocks) gives the beams of the base with A
    merged into its weights (PEFT's `merge_and_unload`)."""
    from nanovllm import BeamSearchParams

    merged = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qwen3["base"], dtype=torch.float32),
                                            qwen3["adapters"]["a"], torch_device="cpu").merge_and_unload()
    merged.save_pretrained(str(tmp_path / "merged"))
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    a = qwen3["requests"]["a"]
    with engine(qwen3["base"], max_lora_rank=8) as llm:
        adapted = llm.beam_search(PROMPTS, params, lora_request=a)
    with LLM(str(tmp_path / "merged"), device="cpu", dtype="float32", kvcache_block_size=16,
             skip_tokenizer_init=True) as llm:
        reference = llm.beam_search(PROMPTS, params)
    assert [[beam.tokens for beam in out.sequences] for out in adapted] == \
        [[beam.tokens for beam in out.sequences] for out in reference]
    assert adapted[0].sequences[0].lora_request is a


def test_data_parallel_replicas(qwen3):
    """Two replicas, each serving every adapter: a mixed batch equals PEFT's, a bad adapter is refused before any
    request is routed, and the adapter calls reach every replica."""
    names = [None, "a", "b", "c"]
    prompts = [prompt for _ in names for prompt in PROMPTS]
    loras = [qwen3["requests"].get(name) for name in names for _ in PROMPTS]
    with engine(qwen3["base"], max_loras=2, max_cpu_loras=3, max_lora_rank=8, data_parallel_size=2) as llm:
        assert tokens(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)) == \
            [t for name in names for t in qwen3["expected"][name]]
        assert llm.list_loras() == {1, 2, 3}
        with pytest.raises(FileNotFoundError, match="LoRA adapter 'lost'"):
            llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("lost", 9, str(qwen3["root"] / "nowhere")),
                         use_tqdm=False)
        assert llm.pin_lora(1) and llm.remove_lora(2) and llm.list_loras() == {1, 3}
        assert [r["alive"] for r in llm.stats()["replicas"]] == [True, True]
        assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=qwen3["requests"]["b"], use_tqdm=False)) == \
            qwen3["expected"]["b"]
