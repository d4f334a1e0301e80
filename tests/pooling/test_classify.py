"""`*ForSequenceClassification` decoders against transformers' heads and sentence-transformers' `CrossEncoder`
(float32, CPU): classify's probabilities, score's cross-encoder scores, reward's per-token outputs."""
import pytest
import torch
from pooling_checkpoints import TEXTS, hf_logits, make_classifier

from nanovllm import LLM, PoolingParams

CPU = dict(device="cpu", dtype="float32")


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3"])
def test_classify_matches_transformers(tmp_path, model_type):
    path = make_classifier(str(tmp_path / model_type), model_type=model_type, num_labels=3)
    with LLM(path, **CPU, max_num_batched_tokens=16) as llm:
        assert llm.config.runner == "pooling"
        outputs = llm.classify(TEXTS, use_tqdm=False)
        raw = llm.classify(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)
        stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    logits = hf_logits(path, [output.prompt_token_ids for output in outputs])
    for output, plain, want in zip(outputs, raw, logits):
        assert output.outputs.num_classes == 3
        assert torch.allclose(torch.tensor(output.outputs.probs), want.softmax(-1), atol=1e-5)
        assert torch.allclose(torch.tensor(plain.outputs.probs), want, atol=1e-5)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> str:
    return make_classifier(str(tmp_path_factory.mktemp("pool") / "reranker"), num_labels=1)


def test_score_matches_cross_encoder(cross_encoder):
    CrossEncoder = pytest.importorskip("sentence_transformers").CrossEncoder

    query, documents = TEXTS[0], TEXTS[1:]
    want = CrossEncoder(cross_encoder, device="cpu").predict([(query, d) for d in documents])
    with LLM(cross_encoder, **CPU) as llm:
        one_to_n = llm.score(query, documents, use_tqdm=False)
        n_to_n = llm.score([query] * len(documents), documents, use_tqdm=False)
        one = llm.score(query, documents[0], use_tqdm=False)
    tokenizer_ids = llm.get_tokenizer()(query, documents[0])["input_ids"]
    assert one_to_n[0].prompt_token_ids == tokenizer_ids
    for outputs in (one_to_n, n_to_n):
        assert [o.outputs.score for o in outputs] == pytest.approx(list(want), abs=1e-5)
    assert one[0].outputs.score == pytest.approx(float(want[0]), abs=1e-5)


def test_reward_gives_every_token_the_classifier_outputs(cross_encoder):
    with LLM(cross_encoder, **CPU, max_num_batched_tokens=8, kvcache_block_size=4) as llm:
        rewards = llm.reward(TEXTS[:2], use_tqdm=False)
        last = llm.classify(TEXTS[:2], use_tqdm=False)
    for reward, classified in zip(rewards, last):
        assert reward.outputs.data.shape == (len(reward.prompt_token_ids), 1)
        assert reward.outputs.data[-1].tolist() == pytest.approx(classified.outputs.probs, abs=1e-6)


def test_dummy_weights(tmp_path):
    """load_format="dummy" draws the classifier's `score` head too (transformers' classifier names the tensors)."""
    path = make_classifier(str(tmp_path / "cls"), num_labels=2)
    with LLM(path, **CPU, load_format="dummy") as llm:
        probs = llm.classify(TEXTS[:2], use_tqdm=False)[0].outputs.probs
    assert len(probs) == 2 and sum(probs) == pytest.approx(1.0)
