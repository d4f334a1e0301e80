"""Decode steps in one C++ call (`nanovllm.execution.cpu_decode`): the same hidden states, bit for bit, as the model run
layer by layer, at every decode step of a batch; and only for the models whose layers are the standard one."""
import pytest
import torch
from checkpoints import make_checkpoint, make_gguf

from nanovllm import LLM, SamplingParams
from nanovllm.execution.cpu_decode import cpu_decoder
from nanovllm.kernels.ggml import repack_lanes, unpack
from nanovllm.layers.ggml_weight import GGMLTensor, GGMLWeight

pytest.importorskip("gguf")
Q4_1, F32 = 3, 0
PROMPTS = [[5, 9, 200, 17], list(range(40, 100)), [300] * 3]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> str:
    """A Llama GGUF whose q, k, O and MLP weights are Q4_1 and v float32: its QKV projection is two segments."""
    source = make_checkpoint(str(tmp_path_factory.mktemp("llama")), family="llama", tie_word_embeddings=False, seed=3)
    return make_gguf(str(tmp_path_factory.mktemp("gguf") / "mixed.gguf"), source, "", qtype="Q4_1",
                     quantized=("attn_q", "attn_k", "attn_output", "ffn"))


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> str:
    """Qwen2: biases on q, k and v."""
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen2")), family="qwen2", seed=4)


def run_both_paths(llm: LLM, prompts: list[list[int]] = PROMPTS, lora_request=None) -> list[int]:
    """Generate `prompts` with every step the one-call path takes computed both ways, asserting the logits are bitwise
    equal; the number of rows of each such step."""
    runner = llm.engine.model_runner
    fused, rows = runner.cpu_decoder, []

    def both(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = fused(input_ids, positions)  # both store the same K/V into the same slots
        expected = runner.model(input_ids, positions)
        assert torch.equal(runner.model.compute_logits(hidden_states), runner.model.compute_logits(expected))
        rows.append(input_ids.numel())
        return hidden_states

    runner.cpu_decoder = both
    try:
        llm.generate(prompts, GREEDY, lora_request=lora_request, use_tqdm=False)
    finally:
        runner.cpu_decoder = fused
    return rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_equal_the_layer_by_layer_path_bitwise(mixed_gguf, dtype):
    with LLM(mixed_gguf, device="cpu", dtype=dtype, max_model_len=256, kvcache_block_size=16) as llm:
        model = llm.engine.model_runner.model
        assert model.model.layers[0].self_attn.qkv_proj.weight.qtypes == [Q4_1, F32]
        # O and the MLP repacked for the kernels where their path repacks (a float32 segment keeps QKV as it is)
        assert model.model.layers[0].self_attn.o_proj.weight.lanes == repack_lanes(Q4_1)
        assert model.model.layers[0].self_attn.qkv_proj.weight.lanes == 0
        assert run_both_paths(llm) == [len(PROMPTS)] * (GREEDY.max_tokens - 1)  # every decode step, batched


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_any_number_of_threads_in_the_step_s_team_too(mixed_gguf, threads):
    """The step runs as one team of torch's threads, each kernel split into shares: one thread, two, or three (uneven
    shares), compute the same bits as the layer-by-layer path; so do steps of one row, where every thread computes the
    rows they all read (norms, SiLU, the projections' quantized inputs) into a copy of its own."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with LLM(mixed_gguf, device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=16) as llm:
            assert torch.get_num_threads() == threads
            assert run_both_paths(llm) == [len(PROMPTS)] * (GREEDY.max_tokens - 1)
            assert run_both_paths(llm, [list(range(120, 140))]) == [1] * (GREEDY.max_tokens - 1)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [2, 3])
def test_rows_over_several_chunks_of_keys_too(mixed_gguf, threads):
    """Rows whose cached keys span several of decode attention's chunks (256 keys), the last one short, alone and
    beside a short row: the team splits the work items by their keys there, not by count, with the same bits."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with LLM(mixed_gguf, device="cpu", dtype="float32", max_model_len=700, kvcache_block_size=16) as llm:
            long, longer = [[(7 * i + k) % 300 + 1 for i in range(n)] for k, n in ((1, 300), (2, 600))]
            assert run_both_paths(llm, [long]) == [1] * (GREEDY.max_tokens - 1)
            assert run_both_paths(llm, [longer, PROMPTS[0]]) == [2] * (GREEDY.max_tokens - 1)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_over_an_8bit_kv_cache_too(mixed_gguf, kv_cache_dtype):
    with LLM(mixed_gguf, device="cpu", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_model_len=256,
             kvcache_block_size=16) as llm:
        assert llm.engine.model_runner.cpu_decoder is not None
        assert run_both_paths(llm) == [len(PROMPTS)] * (GREEDY.max_tokens - 1)


def test_with_lora_adapters_too(tmp_path):
    """A batch of the base and two PEFT adapters (on every projection, and on q/v only): the one call adds each row's
    deltas as the layers do, and the adapters change the tokens."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from nanovllm.lora.request import LoRARequest

    source = make_checkpoint(str(tmp_path / "llama"), family="llama", tie_word_embeddings=False, seed=3)
    adapters = []
    for seed, targets in enumerate((["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                    ["q_proj", "v_proj"])):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        peft.get_peft_model(model, config).save_pretrained(str(tmp_path / f"adapter{seed}"))
        adapters.append(LoRARequest(f"adapter{seed}", seed + 1, str(tmp_path / f"adapter{seed}")))
    gguf_file = make_gguf(str(tmp_path / "q4_1.gguf"), source, "", qtype="Q4_1",
                          quantized=("attn_q", "attn_k", "attn_v", "attn_output", "ffn"))
    prompts = PROMPTS * 3
    loras = [None] * len(PROMPTS) + [adapters[0]] * len(PROMPTS) + [adapters[1]] * len(PROMPTS)
    for dtype in ("float32", "bfloat16"):
        with LLM(gguf_file, device="cpu", dtype=dtype, max_model_len=256, enable_lora=True, max_loras=2,
                 max_lora_rank=4) as llm:
            assert llm.engine.model_runner.cpu_decoder is not None
            assert run_both_paths(llm, prompts, loras) == [len(prompts)] * (GREEDY.max_tokens - 1)
            outputs = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
            token_ids = [output.outputs[0].token_ids for output in outputs]
            assert token_ids[:len(PROMPTS)] != token_ids[len(PROMPTS):2 * len(PROMPTS)]


def test_verify_steps_and_short_prompts_too(mixed_gguf):
    """Steps whose every sequence has at most `SHORT_QUERIES` queries take the one call as well, each row attending as
    its token's decode: the short prompts' first step, and n-gram drafts being verified (the prompts repeat, so
    drafts are proposed)."""
    prompts = [[5, 9, 200, 17] * 3, [300] * 3, [7, 8] * 4]
    speculation = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with LLM(mixed_gguf, device="cpu", dtype="float32", max_model_len=256, speculative_config=speculation) as llm:
        rows = run_both_paths(llm, prompts)
        assert rows[0] == sum(map(len, prompts))
        assert any(n > len(prompts) for n in rows[1:]) and llm.stats()["num_draft_tokens"] > 0


def test_biases_and_split_projections_too(qwen2_dir):
    """quantization="int8" on Qwen2 (biased QKV); then layer 0's QKV split into two segments, whose bias is added
    after they are joined."""
    with LLM(qwen2_dir, device="cpu", dtype="bfloat16", max_model_len=256, quantization="int8") as llm:
        runner = llm.engine.model_runner
        qkv = runner.model.model.layers[0].self_attn.qkv_proj
        assert runner.cpu_decoder is not None and qkv.bias is not None
        run_both_paths(llm)
        [whole] = qkv.weight.segments
        rows = unpack(whole.data, whole.qtype, qkv.weight.lanes) if qkv.weight.lanes else whole.data  # file order
        halves = [GGMLTensor(rows[part], whole.qtype, whole.in_features) for part in (slice(0, 40), slice(40, None))]
        qkv.weight = GGMLWeight(halves, qkv.weight.dtype)
        runner.cpu_decoder = cpu_decoder(runner.model)
        assert len(qkv.weight.qtypes) == 2 and runner.cpu_decoder is not None
        run_both_paths(llm)


def test_only_standard_layers_over_ggml_weights_take_it(mixed_gguf, tmp_path):
    """enforce_eager, float weights, and a family with another layer (Qwen3's q/k norms) run layer by layer."""
    with LLM(mixed_gguf, device="cpu", dtype="float32", max_model_len=256, enforce_eager=True) as llm:
        assert llm.engine.model_runner.cpu_decoder is None
    qwen3 = make_checkpoint(str(tmp_path / "qwen3"), family="qwen3", seed=1)
    for settings in ({}, {"quantization": "int8"}):
        with LLM(qwen3, device="cpu", dtype="float32", max_model_len=256, **settings) as llm:
            assert llm.engine.model_runner.cpu_decoder is None
    llama = make_checkpoint(str(tmp_path / "llama"), family="llama", seed=1)
    with LLM(llama, device="cpu", dtype="float32", max_model_len=256) as llm:
        assert llm.engine.model_runner.cpu_decoder is None
    with LLM(llama, device="cpu", dtype="float32", max_model_len=256, quantization="int4") as llm:
        assert llm.engine.model_runner.cpu_decoder is not None
