"""The CPU fast path: prepacked oneDNN weights and copy-free decode attention.

Its token-exactness against transformers is covered by test_engine_parity.py, which runs on this path."""
import torch

from nanovllm import LLM
from nanovllm.backends.torch_backend import TorchBackend, _attend
from nanovllm.utils.context import Context


def test_linear_weights_are_prepacked_on_cpu(tied_model):
    with LLM(tied_model, device="cpu") as llm:
        model = llm.model_runner.model
        assert model.lm_head.weight.is_mkldnn
        assert not model.model.embed_tokens.weight.is_mkldnn
        assert all(layer.mlp.down_proj.weight.is_mkldnn for layer in model.model.layers)


def test_cpu_decode_reads_scattered_blocks_in_place():
    """Blocks out of order and split into runs give the same attention as gathering them first."""
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 10, 4, 2, 8).unbind(0)
    block_tables = torch.tensor([[7, 2, 3, 9], [0, 1, 2, -1], [5, -1, -1, -1]])
    context_lens = torch.tensor([14, 9, 3])
    q = torch.randn(3, 4, 8)
    ctx = Context(block_tables=block_tables, context_lens=context_lens)
    out = TorchBackend.decode(q, k_cache, v_cache, ctx, 0.3)
    for i in range(3):
        length = int(context_lens[i])
        k = k_cache[block_tables[i]].flatten(0, 1)[:length]
        v = v_cache[block_tables[i]].flatten(0, 1)[:length]
        torch.testing.assert_close(out[i:i + 1], _attend(q[i:i + 1], k, v, 0.3))
