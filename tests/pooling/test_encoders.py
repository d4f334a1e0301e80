"""Encoder-only models (BERT, XLM-RoBERTa) against sentence-transformers and transformers (float32, CPU):
bidirectional attention over each prompt of a ragged batch, first-token and mean pooling, classification heads and
a cross-encoder's scores; a prompt is computed in one step, and every KV block is free after."""
import pytest
import torch
from pooling_checkpoints import TEXTS, hf_logits, make_classifier, make_st_embedder, st_embeddings

from nanovllm import LLM

pytest.importorskip("sentence_transformers")

CPU = dict(device="cpu", dtype="float32")


@pytest.mark.parametrize("model_type, pooling_mode, dense", [("bert", "mean", ()), ("xlm-roberta", "cls", (32,))])
def test_embedders_match_sentence_transformers(tmp_path, model_type, pooling_mode, dense):
    path = make_st_embedder(str(tmp_path / model_type), model_type=model_type, pooling_mode=pooling_mode,
                            dense=dense)
    with LLM(path, **CPU, max_num_batched_tokens=128) as llm:
        assert llm.config.runner == "pooling" and not llm.config.enable_chunked_prefill
        batch = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
        alone = torch.tensor([llm.embed(text, use_tqdm=False)[0].outputs.embedding for text in TEXTS])
        stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert torch.allclose(batch, alone, atol=1e-6)
    assert torch.nn.functional.cosine_similarity(batch, st_embeddings(path, TEXTS)).min() >= 0.99999


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
def test_classifiers_match_transformers(tmp_path, model_type):
    path = make_classifier(str(tmp_path / model_type), model_type=model_type, num_labels=3)
    with LLM(path, **CPU) as llm:
        outputs = llm.classify(TEXTS, use_tqdm=False)
    for output, logits in zip(outputs, hf_logits(path, [o.prompt_token_ids for o in outputs])):
        assert torch.allclose(torch.tensor(output.outputs.probs), logits.softmax(-1), atol=1e-5)


def test_xlm_roberta_cross_encoder_matches_cross_encoder(tmp_path):
    from sentence_transformers import CrossEncoder

    path = make_classifier(str(tmp_path / "reranker"), model_type="xlm-roberta", num_labels=1, type_vocab_size=1)
    want = CrossEncoder(path, device="cpu").predict([(TEXTS[0], d) for d in TEXTS[1:]])
    with LLM(path, **CPU) as llm:
        got = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)]
    assert got == pytest.approx(list(want), abs=1e-5)


def test_bert_cross_encoder_reads_the_pair_token_types(tmp_path):
    """BERT's second text has token type 1 (ms-marco cross-encoders), also when a step mixes pairs and texts."""
    from sentence_transformers import CrossEncoder

    path = make_classifier(str(tmp_path / "bert"), model_type="bert", num_labels=1)
    pairs = [(TEXTS[0], d) for d in TEXTS[1:]]
    want = CrossEncoder(path, device="cpu").predict(pairs)
    with LLM(path, **CPU) as llm:
        assert llm.get_tokenizer()(*pairs[0])["token_type_ids"][-1] == 1
        got = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)]
        with pytest.raises(ValueError, match="is an encoder .*tensor_parallel_size=1 only"):
            LLM(path, **CPU, tensor_parallel_size=2)
    assert got == pytest.approx(list(want), abs=1e-5)
