"""ModernBERT against sentence-transformers and transformers (float32, CPU): local layers attend only within
±local_attention/2 positions (texts longer than the window, and one inside it, in one batch), each layer type with its
own rope theta, first-token and mean pooling, the classifier head at the first token or the mean
(`classifier_pooling`), and a cross-encoder's scores."""
import pytest
import torch
from pooling_checkpoints import TEXTS, hf_logits, make_classifier, make_st_embedder, st_embeddings

from nanovllm import LLM
from nanovllm.models.modernbert import layer_attention

pytest.importorskip("sentence_transformers")

CPU = dict(device="cpu", dtype="float32")
WINDOW = 8
MODERNBERT = dict(model_type="modernbert", num_hidden_layers=4, global_attn_every_n_layers=2, local_attention=WINDOW,
                  global_rope_theta=160000.0, local_rope_theta=10000.0, bos_token_id=0, cls_token_id=0,
                  sep_token_id=0)
TEXTS_AND_SHORT = [*TEXTS, "Hi."]


@pytest.mark.parametrize("pooling_mode, dense", [("mean", ()), ("cls", (32,))])
def test_embedders_match_sentence_transformers(tmp_path, pooling_mode, dense):
    path = make_st_embedder(str(tmp_path / "modernbert"), pooling_mode=pooling_mode, dense=dense, **MODERNBERT)
    with LLM(path, **CPU) as llm:
        assert llm.config.runner == "pooling" and not llm.config.enable_chunked_prefill
        outputs = llm.embed(TEXTS_AND_SHORT, use_tqdm=False)
        alone = torch.tensor([llm.embed(text, use_tqdm=False)[0].outputs.embedding for text in TEXTS_AND_SHORT])
        stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    lengths = [len(o.prompt_token_ids) for o in outputs]
    assert min(lengths) <= WINDOW // 2 + 1 and sorted(lengths)[1] > WINDOW + 1
    batch = torch.tensor([o.outputs.embedding for o in outputs])
    want = st_embeddings(path, TEXTS_AND_SHORT)
    assert torch.allclose(batch, alone, atol=1e-6)
    assert torch.nn.functional.cosine_similarity(batch, want).min() >= 0.99999
    assert torch.allclose(batch, want, atol=1e-5)


@pytest.mark.parametrize("classifier_pooling, biases", [("cls", False), ("mean", True)])
def test_classifiers_match_transformers(tmp_path, classifier_pooling, biases):
    """Biases in every norm and projection (`norm_bias`, ...) are loaded where a config has them."""
    bias = dict.fromkeys(("norm_bias", "attention_bias", "mlp_bias", "classifier_bias"), biases)
    path = make_classifier(str(tmp_path / "modernbert"), num_labels=3, classifier_pooling=classifier_pooling,
                           **MODERNBERT, **bias)
    with LLM(path, **CPU) as llm:
        outputs = llm.classify(TEXTS_AND_SHORT, use_tqdm=False)
    for output, logits in zip(outputs, hf_logits(path, [o.prompt_token_ids for o in outputs]), strict=True):
        assert torch.allclose(torch.tensor(output.outputs.probs), logits.softmax(-1), atol=1e-5)


def test_cross_encoder_matches_cross_encoder(tmp_path):
    from sentence_transformers import CrossEncoder

    path = make_classifier(str(tmp_path / "reranker"), num_labels=1, classifier_pooling="mean", **MODERNBERT)
    want = CrossEncoder(path, device="cpu").predict([(TEXTS[0], d) for d in TEXTS_AND_SHORT[1:]])
    with LLM(path, **CPU) as llm:
        got = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS_AND_SHORT[1:], use_tqdm=False)]
    assert got == pytest.approx(list(want), abs=1e-5)


def test_unsupported_activation_is_refused_up_front(tmp_path):
    path = make_classifier(str(tmp_path / "relu"), num_labels=2, hidden_activation="relu", **MODERNBERT)
    with pytest.raises(ValueError, match=r"config\.json: unsupported hidden_activation 'relu' in the model config"):
        LLM(path, **CPU)


def test_layer_attention_reads_transformers_4_configs():
    """transformers 4 keeps ModernBERT's layer pattern and thetas in attributes of their own (no `layer_types`, no
    `rope_parameters`): they read as transformers 5 converts them."""
    from transformers import AutoConfig, PretrainedConfig

    settings = dict(num_hidden_layers=4, global_attn_every_n_layers=3, global_rope_theta=160000.0)
    old = PretrainedConfig(**settings, local_rope_theta=10000.0)
    new = AutoConfig.for_model("modernbert", **settings, local_rope_theta=10000.0)
    assert layer_attention(old) == layer_attention(new) == [
        ("full_attention", 160000.0), ("sliding_attention", 10000.0), ("sliding_attention", 10000.0),
        ("full_attention", 160000.0)]
    assert layer_attention(PretrainedConfig(**settings, local_rope_theta=None))[1] == ("sliding_attention", 160000.0)
