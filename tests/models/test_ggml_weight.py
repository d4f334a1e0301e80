"""GGML weights inside the layers: slicing, fused projections of mixed types, quantized embeddings; and
`quantization="int8" | "int4"` on a safetensors checkpoint against float32."""
import pytest
import torch
import torch.nn.functional as F
from checkpoints import CORPUS, hf_teacher_forced, make_checkpoint, teacher_forced
from torch import nn

import nanovllm.execution.model_loading as model_loading
from nanovllm import LLM, SamplingParams
from nanovllm.kernels.ggml import ggml_linear, repack_lanes
from nanovllm.layers.embed_head import VocabParallelEmbedding
from nanovllm.layers.ggml_weight import GGMLTensor, GGMLWeight, quantize
from nanovllm.layers.linear import QKVParallelLinear
from nanovllm.models.loader import install_ggml_weights

pytest.importorskip("gguf")
Q8_0, Q4_1, Q4_0, F32 = 8, 3, 2, 0


def random_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def test_a_fused_projection_keeps_one_segment_per_run_of_one_type():
    """q in Q8_0, k in Q4_1, v in Q8_0 (as Q4_K_M files mix types): three segments in row order, which compute what
    the dequantized matrix computes; one type throughout joins into one segment."""
    layer = QKVParallelLinear(hidden_size=64, head_size=16, total_num_heads=4, total_num_kv_heads=2)
    shards = {"q": (quantize(random_weight(64, 64, 1), Q8_0)), "k": quantize(random_weight(32, 64, 2), Q4_1),
              "v": quantize(random_weight(32, 64, 3), Q8_0)}
    for shard_id, tensor in shards.items():
        layer.weight_loader(layer.weight, tensor, shard_id)
    install_ggml_weights(layer)
    assert isinstance(layer.weight, GGMLWeight) and layer.weight.qtypes == [Q8_0, Q4_1, Q8_0]
    x = torch.randn(5, 64)
    each = torch.cat([ggml_linear(x, shards[s].data, shards[s].qtype, 64) for s in "qkv"], dim=1)
    torch.testing.assert_close(layer(x), each, rtol=0, atol=0)
    dense = F.linear(x, torch.cat([shards[s].dequantize() for s in "qkv"]))
    torch.testing.assert_close(layer(x), dense, rtol=0, atol=0.02 * dense.abs().max().item())  # x as int8 blocks
    same = QKVParallelLinear(hidden_size=64, head_size=16, total_num_heads=4, total_num_kv_heads=2)
    for shard_id, rows in (("q", 64), ("k", 32), ("v", 32)):
        same.weight_loader(same.weight, quantize(random_weight(rows, 64, rows), Q4_0), shard_id)
    install_ggml_weights(same)
    assert same.weight.qtypes == [Q4_0] and same.weight.segment0.shape == (128, 18 * 2)


def test_float_shards_become_a_plain_parameter():
    layer = QKVParallelLinear(hidden_size=64, head_size=16, total_num_heads=4, total_num_kv_heads=2)
    dense = random_weight(128, 64, 4)
    for shard_id, rows in (("q", slice(0, 64)), ("k", slice(64, 96)), ("v", slice(96, 128))):
        as_f32 = GGMLTensor(dense[rows].contiguous().view(torch.uint8), F32, 64)
        layer.weight_loader(layer.weight, as_f32, shard_id)
    install_ggml_weights(layer)
    assert isinstance(layer.weight, nn.Parameter) and torch.equal(layer.weight, dense)


def test_quantized_embedding_tied_to_its_lm_head():
    """Lookups dequantize the rows they gather; the tied head is the same GGMLWeight."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = VocabParallelEmbedding(100, 64)
            self.head = VocabParallelEmbedding(100, 64)
            self.head.weight = self.embed.weight

    model = Tied()
    table = quantize(random_weight(100, 64, 5), Q8_0)
    model.embed.weight.weight_loader(model.embed.weight, table)
    install_ggml_weights(model)
    assert isinstance(model.embed.weight, GGMLWeight) and model.head.weight is model.embed.weight
    ids = torch.tensor([3, 99, 0, 3])
    assert torch.equal(model.embed(ids), table.dequantize()[ids])


def test_a_repacked_weight_keeps_its_products_rows_and_lookups():
    """`repack` puts Q8_0 and Q4_1 segments in the kernels' tiles: the same products, embedding rows and dequantized
    matrix; rows written over it (across tile edges) land where a plain weight puts them. A segment whose rows do not
    fill whole tiles, or of a type without tiles (F16), leaves the weight as the file has it."""
    lanes = repack_lanes(Q8_0)
    if not lanes:
        pytest.skip("the kernels' path runs GGML weights as the file has them")
    parts = [(0, quantize(random_weight(2 * lanes, 64, 7), Q8_0)),
             (2 * lanes, quantize(random_weight(lanes, 64, 8), Q4_1))]
    plain, tiles = (GGMLWeight.assemble(parts, 3 * lanes, torch.float32) for _ in range(2))
    tiles.repack()
    assert tiles.lanes == lanes and not torch.equal(tiles.segment0, plain.segment0)
    x, ids = torch.randn(3, 64), torch.tensor([0, lanes + 3, 2 * lanes - 1])
    assert torch.equal(tiles.linear(x), plain.linear(x)) and torch.equal(tiles.dequantize(torch.float32),
                                                                         plain.dequantize(torch.float32))
    assert torch.equal(tiles.embedding(ids), plain.embedding(ids))
    rows = quantize(random_weight(lanes, 64, 9), Q8_0)
    for weight in (plain, tiles):
        weight.write_rows(lanes // 2, rows)
    assert torch.equal(tiles.linear(x), plain.linear(x)) and torch.equal(tiles.dequantize(torch.float32),
                                                                         plain.dequantize(torch.float32))
    for odd in ([(0, quantize(random_weight(lanes + 1, 64, 7), Q8_0))],
                [(0, GGMLTensor(torch.zeros(lanes, 512, dtype=torch.uint8), 1, 256))]):
        weight = GGMLWeight.assemble(odd, odd[0][1].size(0), torch.float32)
        weight.repack()
        assert weight.lanes == 0


def test_weights_repacked_at_load_give_the_same_tokens(tiny_dir, monkeypatch):
    """Every linear weight quantized at load is repacked for the CPU kernels; the tokens are those of the same
    weights run as the file has them."""
    if not repack_lanes(Q4_1):
        pytest.skip("the kernels' path runs GGML weights as the file has them")
    prompts, greedy = [[5, 9, 2, 7], list(range(40, 90))], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for repacked in (True, False):
        if not repacked:
            monkeypatch.setattr(model_loading, "repack_ggml_weights", lambda model: None)
        with LLM(tiny_dir, device="cpu", dtype="float32", max_model_len=256, quantization="int4") as llm:
            weights = [m.weight for m in llm.engine.model_runner.model.modules()
                       if isinstance(getattr(m, "weight", None), GGMLWeight)]
            assert weights and all(bool(w.lanes) == repacked for w in weights)
            tokens[repacked] = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert tokens[True] == tokens[False]


def test_column_slices_must_keep_whole_blocks():
    weight = quantize(random_weight(8, 128, 6), Q4_1)
    half = weight.narrow(1, 64, 64)
    assert half.shape == (8, 64) and torch.equal(half.dequantize(), weight.dequantize()[:, 64:])
    with pytest.raises(ValueError, match=r"input columns 48..96 of a Q4_1 weight, whose 32-value blocks cannot be "
                                         "split"):
        weight.narrow(1, 48, 48)
    assert torch.equal(weight.padded(11).dequantize()[8:], torch.zeros(3, 128))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("quantize")), family="qwen3", hidden_size=64, head_dim=32,
                           intermediate_size=128, seed=7)


@pytest.mark.parametrize(("quantization", "qtype", "agreement", "ppl_change"),
                         [("int8", Q8_0, 0.9, 0.01), ("int4", Q4_1, 0.5, 0.05)])
def test_quantization_at_load_against_float32(tiny_dir, quantization, qtype, agreement, ppl_change):
    """`quantization=` stores every linear weight in GGML blocks and stays close to the float32 model, teacher-forced
    on a text: top-1 agreement and perplexity within bounds (int4 looser than int8). A random model's next-token
    distributions are nearly flat, so rounding flips some top-1 choices (measured: int8 152/159, int4 95/159; a
    wrong row order or scale agrees at a few positions and moves the perplexity by far more)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_dir).encode(" ".join(CORPUS[:5]))[:160]
    with LLM(tiny_dir, device="cpu", dtype="float32", max_model_len=256, quantization=quantization) as llm:
        layer = llm.engine.model_runner.model.model.layers[0]
        assert [layer.self_attn.qkv_proj.weight.qtypes, layer.mlp.down_proj.weight.qtypes] == [[qtype], [qtype]]
        assert isinstance(llm.engine.model_runner.model.model.embed_tokens.weight, nn.Parameter)
        ppl, top1 = teacher_forced(llm, ids)
    ref_ppl, ref_top1 = hf_teacher_forced(AutoModelForCausalLM.from_pretrained(tiny_dir).eval(), ids)
    assert abs(ppl / ref_ppl - 1) < ppl_change, (ppl, ref_ppl)
    assert sum(a == b for a, b in zip(top1, ref_top1)) >= agreement * len(top1)


def test_bad_quantization_settings(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match=r"quantization must be one of \[None, 'int8', 'int4'\], got 'fp8'"):
        LLM(tiny_dir, quantization="fp8")
    odd = make_checkpoint(str(tmp_path / "odd"), family="qwen3", hidden_size=48, head_dim=16, intermediate_size=96,
                          tokenizer=False)
    with pytest.raises(ValueError, match="quantization='int4' quantizes rows in blocks of 32 values, but "
                                         "hidden_size = 48 is not a multiple of 32"):
        LLM(odd, quantization="int4")
