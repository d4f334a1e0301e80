"""GGUF embedding files as llama.cpp's converter writes them (`{arch}.pooling_type` from the sentence-transformers
Pooling module, `gguf_files.write_gguf`) against sentence-transformers on the original checkpoint (float32, CPU):
decoders (last-token and mean pooling) and BERT (mean and first-token pooling, its WordPiece vocabulary read back),
pooled as the file says and normalized by default (llama.cpp's `--embd-normalize 2`); in Q8_0, kept in blocks, a
close vector. Generation from a decoder embedding file, and the files nanovllm refuses."""
import os
import re

import pytest
import torch
from gguf_files import write_gguf
from pooling_checkpoints import TEXTS, make_st_embedder, st_embeddings
from transformers import AutoTokenizer

from nanovllm import LLM, PoolingParams, SamplingParams
from nanovllm.cli import main as cli
from nanovllm.layers.ggml_weight import GGMLWeight
from nanovllm.models.gguf import metadata

pytest.importorskip("sentence_transformers")

CPU = dict(device="cpu", dtype="float32")


@pytest.fixture(autouse=True)
def cache(private_cache):
    return private_cache


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Sentence-transformers embedders by name, made once: Qwen3-Embedding's shape (last token, normalized),
    gte-Qwen2's (mean, unnormalized), BERT's with mean and with first-token pooling."""
    made: dict[str, str] = {}
    settings = {"qwen3-last": dict(), "qwen2-mean": dict(model_type="qwen2", pooling_mode="mean", normalize=False),
                "bert-mean": dict(model_type="bert", pooling_mode="mean", wordpiece=True),
                "bert-cls": dict(model_type="bert", pooling_mode="cls", wordpiece=True, seed=1)}

    def make(name: str) -> str:
        if name not in made:
            made[name] = make_st_embedder(str(tmp_path_factory.mktemp("st") / name), **settings[name])
        return made[name]

    return make


def _vectors(outputs) -> torch.Tensor:
    return torch.tensor([output.outputs.embedding for output in outputs])


def _cosines(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    assert got.shape == want.shape
    return torch.nn.functional.cosine_similarity(got, want)


@pytest.mark.parametrize("name, pooling", [("qwen3-last", "LAST"), ("qwen2-mean", "MEAN")])
def test_decoder_file_pools_as_its_metadata_says(models, tmp_path, name, pooling):
    """The file's pooling, normalized by default (gte-Qwen2's sentence-transformers model is not: its raw vectors
    with normalize=False). Prompts are the original tokenizer's ids: the test writer's byte-level vocabulary has no
    pre-tokenizer name, so digits may split otherwise."""
    path = models(name)
    ids = [AutoTokenizer.from_pretrained(path).encode(text) for text in TEXTS]
    want = st_embeddings(path, TEXTS)
    with LLM(write_gguf(str(tmp_path / f"{name}.gguf"), path), **CPU) as llm:
        assert llm.config.runner == "pooling" and llm.config.pooler.pooling_type == pooling
        prompts = [{"prompt_token_ids": p} for p in ids]
        got = _vectors(llm.embed(prompts, use_tqdm=False))
        raw = _vectors(llm.embed(prompts, PoolingParams(normalize=False), use_tqdm=False))
    assert _cosines(got, want).min() >= 0.99999
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
    if name == "qwen2-mean":
        assert torch.allclose(raw, want, atol=1e-4)


@pytest.mark.parametrize("name, pooling", [("bert-mean", "MEAN"), ("bert-cls", "CLS")])
def test_bert_file_matches_sentence_transformers(models, tmp_path, name, pooling):
    """BERT's tensors (token types, positions, post-norms) and its WordPiece vocabulary, as the converter spells it
    ("\u2581" word starts), read back: the same token ids and pair token types as the original tokenizer."""
    path = models(name)
    reference = AutoTokenizer.from_pretrained(path)
    with LLM(write_gguf(str(tmp_path / f"{name}.gguf"), path), **CPU) as llm:
        assert llm.config.runner == "pooling" and llm.config.pooler.pooling_type == pooling
        tokenizer = llm.get_tokenizer()
        assert [tokenizer.encode(t) for t in TEXTS] == [reference.encode(t) for t in TEXTS]
        assert tokenizer(TEXTS[0], TEXTS[1])["token_type_ids"] == reference(TEXTS[0], TEXTS[1])["token_type_ids"]
        assert tokenizer.decode(tokenizer.encode(TEXTS[1]), skip_special_tokens=True) == TEXTS[1].lower()
        got = _vectors(llm.embed(TEXTS, use_tqdm=False))
    assert _cosines(got, st_embeddings(path, TEXTS)).min() >= 0.99999


@pytest.mark.parametrize("name", ["qwen3-last", "bert-mean"])
def test_q8_0_file_runs_in_its_blocks_and_gives_a_close_vector(models, tmp_path, name):
    """Every matrix in Q8_0, kept in its blocks: cosine to the original float32 model's vectors >= 0.995 (measured:
    0.9976 at the lowest for the decoder's last token, 0.9999 for BERT's mean)."""
    path = models(name)
    ids = [AutoTokenizer.from_pretrained(path).encode(text) for text in TEXTS]
    with LLM(write_gguf(str(tmp_path / f"{name}.gguf"), path, qtype="Q8_0"), **CPU) as llm:
        model = llm.engine.model_runner.model
        layer = model.model.layers[0]
        weight = layer.self_attn.o_proj.weight if name.startswith("qwen") else layer.attention.self.query.weight
        assert isinstance(weight, GGMLWeight)
        got = _vectors(llm.embed([{"prompt_token_ids": p} for p in ids], use_tqdm=False))
    cosines = _cosines(got, st_embeddings(path, TEXTS))
    assert 0.995 <= cosines.min() and cosines.max() < 0.999999  # close, and the rounding is seen


def test_decoder_embedding_file_still_generates(models, tmp_path):
    """runner="generate" on it, as llama.cpp generates from any decoder file: the LM head tied to the embedding (the
    file has no `output.weight`), greedy token for token transformers' causal LM on the same weights."""
    from checkpoints import hf_greedy
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    path = models("qwen3-last")
    causal = str(tmp_path / "causal")
    config = AutoConfig.from_pretrained(path)
    config.architectures, config.tie_word_embeddings = ["Qwen3ForCausalLM"], True
    config.save_pretrained(causal)
    save_file({f"model.{n}": t for n, t in load_file(os.path.join(path, "model.safetensors")).items()},
              os.path.join(causal, "model.safetensors"))
    prompts = [AutoTokenizer.from_pretrained(path).encode(text) for text in TEXTS[:2]]
    with LLM(write_gguf(str(tmp_path / "e.gguf"), path), runner="generate", **CPU) as llm:
        got = [o["token_ids"] for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6,
                                                                             ignore_eos=True), use_tqdm=False)]
    assert got == hf_greedy(causal, prompts, 6)


def test_files_nanovllm_refuses(models, tmp_path):
    qwen3, bert = models("qwen3-last"), models("bert-mean")
    with pytest.raises(ValueError, match=r"is a reranker \(pooling_type 4, rank.*ForSequenceClassification"):
        LLM(write_gguf(str(tmp_path / "rank.gguf"), qwen3, pooling_type=4), **CPU)
    with pytest.raises(ValueError, match=r"unknown qwen3.pooling_type 9"):
        LLM(write_gguf(str(tmp_path / "nine.gguf"), qwen3, pooling_type=9), **CPU)
    with pytest.raises(ValueError, match=r"BERT file that states no pooling \(pooling_type 0"):
        LLM(write_gguf(str(tmp_path / "bert-none.gguf"), bert, pooling_type=0), **CPU)
    with pytest.raises(ValueError, match=r"is a BertModel, which has no LM head and cannot generate"):
        LLM(write_gguf(str(tmp_path / "bert.gguf"), bert), runner="generate", **CPU)
    with LLM(write_gguf(str(tmp_path / "none.gguf"), qwen3, pooling_type=0), **CPU) as llm:
        assert llm.config.runner == "generate"  # "none" is llama.cpp's default for a generating model


def test_an_entry_of_an_older_format_is_not_read(models, tmp_path, monkeypatch):
    """Entries made before a file's pooling was kept lack it: a new format reads the file again into a new entry, and
    the old one is deleted."""
    path = write_gguf(str(tmp_path / "e.gguf"), models("qwen3-last"))
    current = metadata.FORMAT
    monkeypatch.setattr(metadata, "FORMAT", current - 1)
    old = metadata.cached_metadata(path)
    monkeypatch.setattr(metadata, "FORMAT", current)
    new = metadata.cached_metadata(path)
    assert new != old and not old.exists() and (new / "modules.json").is_file()


@pytest.mark.parametrize("name, pooling", [("bert-mean", "MEAN"), ("qwen3-last", "LAST")])
def test_convert_writes_an_embedding_model(models, tmp_path, name, pooling):
    """`python -m nanovllm convert` on an embedding file (BERT's, which transformers' GGUF reader does not read, or a
    decoder's): a directory the pooling runner runs as it runs the file, to the same vectors; BERT's, which
    sentence-transformers reads as the original model (its tokenizer and pooling from the file's metadata; the test
    writer's byte-level vocabulary has no padding token, which sentence-transformers needs)."""
    original, converted = models(name), str(tmp_path / "converted")
    gguf_file = write_gguf(str(tmp_path / f"{name}.gguf"), original)
    assert cli(["convert", gguf_file, converted]) == 0
    prompts = [{"prompt_token_ids": AutoTokenizer.from_pretrained(original).encode(text)} for text in TEXTS]
    with LLM(gguf_file, **CPU) as llm:
        want = _vectors(llm.embed(prompts, use_tqdm=False))
    with LLM(converted, **CPU) as llm:
        assert llm.config.runner == "pooling" and llm.config.pooler.pooling_type == pooling
        got = _vectors(llm.embed(prompts, use_tqdm=False))
    assert torch.allclose(got, want, atol=1e-5)
    if name.startswith("bert"):
        assert _cosines(st_embeddings(converted, TEXTS), st_embeddings(original, TEXTS)).min() >= 0.99999


def test_convert_refuses_the_embedding_files_it_does_not_write(models, tmp_path, capsys):
    """A GPT-NeoX embedding file (its fused q/k/v are not transformers' layout here), a reranker and a file cut
    short: an error that says what runs instead, or what is wrong, and no directory."""
    from checkpoints import make_family_checkpoint

    neox = write_gguf(str(tmp_path / "neox.gguf"), make_family_checkpoint(str(tmp_path / "neox"), "gpt_neox"),
                      pooling_type=1)
    rank = write_gguf(str(tmp_path / "rank.gguf"), models("qwen3-last"), pooling_type=4)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(rank, "rb").read()[:200])
    for path, message in ((neox, "is a 'gptneox' embedding file, which convert does not write .*LLM\\("),
                          (rank, "is a reranker .*LLM.score"), (str(cut), "is not a readable GGUF file")):
        assert cli(["convert", path, str(tmp_path / "out")]) == 2
        assert re.search(message, capsys.readouterr().err)
        assert not os.path.exists(tmp_path / "out")
