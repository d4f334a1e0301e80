"""tensor_parallel_size=2 on CPU (gloo) for a decoder embedder: sentence-transformers' vectors, chunked prefill
across ranks included, and every KV block free after."""
import multiprocessing

import pytest
import torch
from pooling_checkpoints import TEXTS, make_st_embedder, st_embeddings

from nanovllm import LLM

pytest.importorskip("sentence_transformers")


def test_tp2_embedder_matches_sentence_transformers(tmp_path):
    path = make_st_embedder(str(tmp_path / "qwen2-mean"), model_type="qwen2", pooling_mode="mean", dense=(32,))
    with LLM(path, device="cpu", dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16,
             kvcache_block_size=4) as llm:
        assert len(multiprocessing.active_children()) == 1
        got = torch.tensor([output.outputs.embedding for output in llm.embed(TEXTS, use_tqdm=False)])
        stats = llm.stats()
        assert stats["num_chunked_steps"] > 0
        assert stats["num_free_blocks"] == stats["num_blocks"]
    want = st_embeddings(path, TEXTS)
    assert torch.nn.functional.cosine_similarity(got, want).min() >= 0.99999
    assert multiprocessing.active_children() == []
