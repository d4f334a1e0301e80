"""tensor_parallel_size=2 on CPU (gloo) for a decoder embedder: sentence-transformers' vectors, chunked prefill
across ranks included, and every KV block free after; data_parallel_size=2: one engine's vectors and scores."""
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


def test_dp2_equals_one_engine(tmp_path):
    path = make_st_embedder(str(tmp_path / "qwen3-last"))
    texts = TEXTS * 3
    with LLM(path, device="cpu", dtype="float32") as llm:
        want = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
        want_scores = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS, use_tqdm=False)]
    with LLM(path, device="cpu", dtype="float32", data_parallel_size=2) as llm:
        outputs = llm.embed(texts, use_tqdm=False)
        scores = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS, use_tqdm=False)]
        stats = llm.stats()
        assert all(replica["num_prompt_sequences"] > 0 for replica in stats["replicas"])
        assert stats["num_free_blocks"] == stats["num_blocks"]
    assert [o.request_id for o in outputs] == [str(i) for i in range(len(texts))]
    assert torch.allclose(torch.tensor([o.outputs.embedding for o in outputs]), torch.tensor(want), atol=1e-6)
    assert scores == pytest.approx(want_scores, abs=1e-6)
    assert multiprocessing.active_children() == []
