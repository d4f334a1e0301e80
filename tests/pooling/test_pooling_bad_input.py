"""Pooling's bad input: clear ValueErrors before any work, and the engine serves on; the runner's choice and the
methods each runner refuses."""
import pytest
from pooling_checkpoints import TEXTS, make_classifier, make_st_embedder

from nanovllm import LLM, PoolingParams

pytest.importorskip("sentence_transformers")

CPU = dict(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    with LLM(make_st_embedder(str(tmp_path_factory.mktemp("pool") / "emb")), **CPU, max_model_len=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    with LLM(make_classifier(str(tmp_path_factory.mktemp("pool") / "cls")), **CPU) as llm:
        yield llm


def test_bad_input_is_refused_before_any_work(embedder):
    long_text = " ".join(TEXTS * 3)
    cases = [
        (lambda: embedder.embed(["fine", ""], use_tqdm=False), "prompt 1 is empty"),
        (lambda: embedder.embed(long_text, use_tqdm=False), r"longer than the maximum model length of 64"),
        (lambda: embedder.embed("hi", PoolingParams(dimensions=8), use_tqdm=False),
         "does not support matryoshka representation"),
        (lambda: embedder.embed("hi", truncate_prompt_tokens=100, use_tqdm=False),
         r"truncate_prompt_tokens value \(100\) is greater than max_model_len \(64\)"),
        (lambda: embedder.embed("hi", PoolingParams(use_activation=False), use_tqdm=False),
         r"Task embed only supports \['dimensions', 'normalize'\] parameters"),
        (lambda: embedder.classify("hi", use_tqdm=False), "embedding model without a classifier head"),
        (lambda: embedder.generate("hi", use_tqdm=False), "runner='pooling', which does not generate"),
        (lambda: embedder.score(TEXTS[:2], TEXTS[:3], use_tqdm=False), "got 2 and 3 texts"),
        (lambda: embedder.encode("hi", pooling_task="nonsense", use_tqdm=False), "pooling_task must be one of"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
        assert embedder.is_finished()
    stats = embedder.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert len(embedder.embed(long_text, truncate_prompt_tokens=-1, use_tqdm=False)[0].prompt_token_ids) == 64
    assert len(embedder.embed(TEXTS[:2], use_tqdm=False)) == 2


def test_a_classifier_does_not_embed(classifier):
    with pytest.raises(ValueError, match="is a classifier"):
        classifier.embed("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="needs a cross-encoder, a classifier with one label"):
        classifier.score("a", "b", use_tqdm=False)
    with pytest.raises(ValueError, match="does not generate"):
        classifier.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert len(classifier.classify(TEXTS, use_tqdm=False)) == len(TEXTS)


def test_runners(tmp_path, tied_model):
    with pytest.raises(ValueError, match=r"runner must be one of \['auto', 'generate', 'pooling'\]"):
        LLM(tied_model, **CPU, runner="embed")
    classifier = make_classifier(str(tmp_path / "cls"))
    with pytest.raises(ValueError, match="has no LM head and cannot generate: start it with runner='pooling'"):
        LLM(classifier, **CPU, runner="generate")
    with LLM(tied_model, **CPU, num_kvcache_blocks=64) as llm:
        assert llm.config.runner == "generate"
        with pytest.raises(ValueError, match="runner='generate', which has no pooler"):
            llm.embed("hi", use_tqdm=False)
    with LLM(tied_model, **CPU, num_kvcache_blocks=64, runner="pooling") as llm:  # a causal LM as an embedder
        output = llm.embed("hi", use_tqdm=False)[0]
        assert len(output.outputs.embedding) == llm.config.hf_config.hidden_size
