"""Each sharded layer, run 2-way over two gloo processes, equals the unsharded computation on the same weights."""
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
import torch.nn.functional as F
from torch.testing import assert_close

from nanovllm.config import Config
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.models import build_model
from nanovllm.utils.context import reset_context, set_context
from nanovllm.utils.loader import init_dummy_weights

WORLD = 2


def _check_linear_layers(rank: int) -> None:
    g = torch.Generator().manual_seed(0)  # every rank draws the same full weights and inputs
    x = torch.randn(5, 16, generator=g)

    w, b = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    column = ColumnParallelLinear(16, 8, bias=True)
    column.weight.weight_loader(column.weight, w)
    column.bias.weight_loader(column.bias, b)
    assert_close(column(x), F.linear(x, w, b).chunk(WORLD, -1)[rank], msg="ColumnParallelLinear")

    gate, up = torch.randn(6, 16, generator=g), torch.randn(10, 16, generator=g)
    merged = MergedColumnParallelLinear(16, [6, 10])
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    expected = torch.cat([F.linear(x, gate).chunk(WORLD, -1)[rank], F.linear(x, up).chunk(WORLD, -1)[rank]], -1)
    assert_close(merged(x), expected, msg="MergedColumnParallelLinear")

    head_size, heads, kv_heads = 4, 4, 2
    qkv = QKVParallelLinear(16, head_size, heads, kv_heads, bias=True)
    full = {"q": heads * head_size, "k": kv_heads * head_size, "v": kv_heads * head_size}
    expected = []
    for shard_id, rows in full.items():
        wq, bq = torch.randn(rows, 16, generator=g), torch.randn(rows, generator=g)
        qkv.weight.weight_loader(qkv.weight, wq, shard_id)
        qkv.bias.weight_loader(qkv.bias, bq, shard_id)
        expected.append(F.linear(x, wq, bq).chunk(WORLD, -1)[rank])  # whole heads: rank r owns the r-th chunk
    assert_close(qkv(x), torch.cat(expected, -1), msg="QKVParallelLinear")

    w, b = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    row = RowParallelLinear(16, 8, bias=True)
    row.weight.weight_loader(row.weight, w)
    row.bias.weight_loader(row.bias, b)
    assert_close(row(x.chunk(WORLD, -1)[rank]), F.linear(x, w, b), msg="RowParallelLinear (bias added once)")


def _check_vocab_layers(rank: int) -> None:
    g = torch.Generator().manual_seed(1)
    vocab, dim = 11, 8  # odd vocabulary: the last rank's slice is padded
    table = torch.randn(vocab, dim, generator=g)
    ids = torch.tensor([0, 5, 6, 10, 3, 10])
    embed = VocabParallelEmbedding(vocab, dim)
    embed.weight.weight_loader(embed.weight, table)
    assert_close(embed(ids), F.embedding(ids, table), msg="VocabParallelEmbedding")

    head = ParallelLMHead(vocab, dim)
    head.weight.weight_loader(head.weight, table)
    hidden = torch.randn(3, dim, generator=g)
    logits = head(hidden)
    if rank == 0:
        assert_close(logits, F.linear(hidden, table), msg="ParallelLMHead gathers full logits on rank 0")
    else:
        assert logits is None, "ParallelLMHead returns None off rank 0"


@torch.inference_mode()
def _model_logits(config: Config, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Logits of the last token of one prompt, prefilled without a KV cache, from dummy weights."""
    model = build_model(config.hf_config)
    init_dummy_weights(model, config.hf_config, seed=3)
    n = len(input_ids)
    cu = torch.tensor([0, n], dtype=torch.int32)
    set_context(True, cu, cu, n, n)
    try:
        return model.compute_logits(model(input_ids, torch.arange(n)))
    finally:
        reset_context()


def _worker(rank: int, store_path: str, model_path: str) -> None:
    config = Config(model_path, load_format="dummy")
    input_ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    unsharded = _model_logits(config, input_ids)  # built before the group exists: tensor-parallel size 1
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        _check_linear_layers(rank)
        _check_vocab_layers(rank)
        sharded = _model_logits(config, input_ids)
        if rank == 0:
            assert_close(sharded, unsharded, msg="2-way Qwen3 with dummy weights equals the unsharded model")
    finally:
        dist.destroy_process_group()


def test_sharded_layers_match_unsharded(tmp_path, tied_model):
    tmp.spawn(_worker, args=(str(tmp_path / "store"), tied_model), nprocs=WORLD, join=True)
