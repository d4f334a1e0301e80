"""Decoder embedders against sentence-transformers' `encode` (float32, CPU): last-token and mean pooling, Dense layers,
normalization, Matryoshka dimensions; the same vector alone, in a batch and in chunks; every KV block free after."""
import pytest
import torch
from pooling_checkpoints import TEXTS, make_st_embedder, st_embeddings

from nanovllm import LLM, EmbeddingRequestOutput, PoolingParams

pytest.importorskip("sentence_transformers")

CPU = dict(device="cpu", dtype="float32")


def _vectors(outputs: list[EmbeddingRequestOutput]) -> torch.Tensor:
    return torch.tensor([output.outputs.embedding for output in outputs])


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert torch.nn.functional.cosine_similarity(got, want).min() >= 0.99999
    assert torch.allclose(got.norm(dim=-1), want.norm(dim=-1), rtol=1e-4)


@pytest.fixture(scope="module")
def last_token(tmp_path_factory) -> str:
    """Qwen3-Embedding's shape: last token, normalized."""
    return make_st_embedder(str(tmp_path_factory.mktemp("pool") / "qwen3-last"))


@pytest.fixture(scope="module")
def embedder(last_token):
    with LLM(last_token, **CPU) as llm:
        yield llm


@pytest.mark.parametrize("model_type, pooling_mode, normalize, dense", [
    ("qwen2", "mean", False, ()),             # gte-Qwen2's shape (mean pooling), left unnormalized
    ("mistral", "lasttoken", True, (32,)),    # e5-mistral's, with a Dense layer
    ("llama", "cls", True, (48, 24)),         # first-token pooling and two Dense layers
])
def test_matches_sentence_transformers(tmp_path, model_type, pooling_mode, normalize, dense):
    path = make_st_embedder(str(tmp_path / model_type), model_type=model_type, pooling_mode=pooling_mode,
                            normalize=normalize, dense=dense)
    with LLM(path, **CPU) as llm:
        assert llm.config.runner == "pooling"
        got = _vectors(llm.embed(TEXTS, use_tqdm=False))
    _assert_close(got, st_embeddings(path, TEXTS))


def test_last_token_outputs(embedder, last_token):
    outputs = embedder.embed(TEXTS, use_tqdm=False)
    _assert_close(_vectors(outputs), st_embeddings(last_token, TEXTS))
    tokenizer = embedder.get_tokenizer()
    assert [o.prompt_token_ids for o in outputs] == [tokenizer.encode(text) for text in TEXTS]
    assert all(o.finished and isinstance(o.request_id, str) for o in outputs)
    assert len({o.request_id for o in outputs}) == len(TEXTS)
    stats = embedder.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_alone_equals_in_a_mixed_batch(embedder):
    alone = [embedder.embed(text, use_tqdm=False)[0].outputs.embedding for text in TEXTS]
    batch = embedder.embed(TEXTS[::-1] * 2, use_tqdm=False)
    for i, output in enumerate(batch):
        assert torch.allclose(torch.tensor(output.outputs.embedding), torch.tensor(alone[::-1][i % len(TEXTS)]),
                              atol=1e-6)


@pytest.mark.parametrize("pooling_mode", ["lasttoken", "mean"])
def test_chunked_prefill_gives_the_same_vector(tmp_path, pooling_mode):
    path = make_st_embedder(str(tmp_path / "m"), model_type="qwen2", pooling_mode=pooling_mode)
    with LLM(path, **CPU) as llm:
        whole = _vectors(llm.embed(TEXTS, use_tqdm=False))
    with LLM(path, **CPU, max_num_batched_tokens=8, max_num_seqs=2, enable_chunked_prefill=True,
             kvcache_block_size=4) as llm:
        chunked = _vectors(llm.embed(TEXTS, use_tqdm=False))
        stats = llm.stats()
        assert stats["num_chunked_steps"] > 0
        assert stats["num_free_blocks"] == stats["num_blocks"]
    assert torch.allclose(chunked, whole, atol=1e-5)


def test_normalize_and_matryoshka_dimensions(tmp_path):
    path = make_st_embedder(str(tmp_path / "m"), config_json={"matryoshka_dimensions": [16, 32, 64]})
    with LLM(path, **CPU) as llm:
        full = _vectors(llm.embed(TEXTS, use_tqdm=False))
        raw = _vectors(llm.embed(TEXTS, PoolingParams(normalize=False), use_tqdm=False))
        cut = _vectors(llm.embed(TEXTS, PoolingParams(dimensions=16), use_tqdm=False))
        cut_raw = _vectors(llm.embed(TEXTS, PoolingParams(dimensions=32, normalize=False), use_tqdm=False))
        with pytest.raises(ValueError, match=r"only supports \[16, 32, 64\] matryoshka dimensions"):
            llm.embed(TEXTS, PoolingParams(dimensions=8), use_tqdm=False)
    assert torch.allclose(full, torch.nn.functional.normalize(raw, dim=-1), atol=1e-6)
    assert torch.allclose(cut, torch.nn.functional.normalize(raw[:, :16], dim=-1), atol=1e-6)
    assert torch.allclose(cut_raw, raw[:, :32])


def test_truncate_prompt_tokens_keeps_the_last_tokens(embedder):
    tokenizer = embedder.get_tokenizer()
    ids = tokenizer.encode(TEXTS[2])
    truncated = embedder.embed(TEXTS[2], truncate_prompt_tokens=5, use_tqdm=False)[0]
    assert truncated.prompt_token_ids == ids[-5:]
    assert truncated.outputs.embedding == embedder.embed({"prompt_token_ids": ids[-5:]},
                                                         use_tqdm=False)[0].outputs.embedding
    by_params = embedder.embed(TEXTS[2], PoolingParams(truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert by_params.prompt_token_ids == ids[-5:]


def test_score_is_the_cosine_of_the_embeddings(embedder):
    vectors = _vectors(embedder.embed(TEXTS, use_tqdm=False))
    one_to_n = embedder.score(TEXTS[0], TEXTS, use_tqdm=False)
    # to float rounding (rounding both to 5 decimals failed on -0.168345004 against -0.168344989)
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in one_to_n]), vectors @ vectors[0],
                               rtol=0, atol=1e-6)
    n_to_n = embedder.score(TEXTS, TEXTS[::-1], use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in n_to_n]), (vectors * vectors.flip(0)).sum(-1),
                               rtol=0, atol=1e-6)
    tokenizer = embedder.get_tokenizer()
    assert n_to_n[0].prompt_token_ids == tokenizer.encode(TEXTS[0]) + tokenizer.encode(TEXTS[-1])


def test_encode_and_token_embed(embedder):
    pooled = embedder.encode(TEXTS, use_tqdm=False)
    assert torch.allclose(torch.stack([o.outputs.data for o in pooled]),
                          _vectors(embedder.embed(TEXTS, use_tqdm=False)))
    per_token = embedder.encode(TEXTS[1], pooling_task="token_embed", use_tqdm=False)[0]
    assert per_token.outputs.data.shape == (len(per_token.prompt_token_ids), 64)
    assert torch.allclose(per_token.outputs.data[-1], pooled[1].outputs.data, atol=1e-6)
