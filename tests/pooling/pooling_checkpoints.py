"""Tiny random pooling checkpoints: decoder embedders saved by sentence-transformers itself, and transformers'
`*ForSequenceClassification` heads, with the references they are compared with."""
import json
import os

import torch
from checkpoints import make_tokenizer, randomize_norms_and_biases
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer

TINY = {"vocab_size": 384, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "max_position_embeddings": 256,
        "initializer_range": 0.1, "eos_token_id": 0, "pad_token_id": 0, "tie_word_embeddings": False}

TEXTS = [
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "Hello, my name is Ada.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun, and the dog does not wake up "
    "until the evening comes and the sun goes down behind the hills.",
    "primes: 2, 3, 5, 7",
]


def _randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    randomize_norms_and_biases(model)
    return model.float()


def _tokenizer(path: str, token_types: bool = True) -> None:
    """`make_tokenizer`'s, padding with EOS, giving a text pair's token type ids (as BERT's) or, without
    `token_types`, none (as RoBERTa's)."""
    make_tokenizer(path, 300)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(path)
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["model_input_names"] = ["input_ids", *(["token_type_ids"] if token_types else []), "attention_mask"]
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def _wordpiece_tokenizer(path: str, vocab_size: int) -> None:
    """A BERT WordPiece tokenizer (lowercasing, [CLS] text [SEP]) of `vocab_size` tokens: BERT's special tokens, the
    characters of `TEXTS` alone and as "##" continuations, half of their words whole, then "[unused{i}]" as BERT pads
    its vocabulary; so that words are cut into first pieces and continuations."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = sorted({word for text in TEXTS for word, _ in
                    pre_tokenizers.BertPreTokenizer().pre_tokenize_str(text.lower())})
    chars = sorted({c for word in words for c in word})
    pieces = list(dict.fromkeys(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars),
                                 *words[::2]]))
    vocab = {piece: i for i, piece in enumerate(pieces + [f"[unused{i}]" for i in range(vocab_size - len(pieces))])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    PreTrainedTokenizerFast(tokenizer_object=tok, cls_token="[CLS]", sep_token="[SEP]", unk_token="[UNK]",
                            pad_token="[PAD]", mask_token="[MASK]",
                            model_input_names=["input_ids", "token_type_ids", "attention_mask"]).save_pretrained(path)


def make_st_embedder(path: str, *, model_type: str = "qwen3", pooling_mode: str = "lasttoken", normalize: bool = True,
                     dense: tuple[int, ...] = (), seed: int = 0, config_json: dict | None = None,
                     wordpiece: bool = False, **settings) -> str:
    """A random base decoder (`model_type`'s `*Model`) saved by sentence-transformers with a Pooling module
    (`pooling_mode`), a Dense module per size in `dense` (Tanh), and a Normalize module when `normalize`.
    `config_json` entries are written into config.json (e.g. Matryoshka's `matryoshka_dimensions`); `wordpiece`
    gives it a BERT WordPiece tokenizer instead of the byte-level BPE one."""
    from sentence_transformers import SentenceTransformer
    try:
        from sentence_transformers.sentence_transformer import modules as models
    except ImportError:  # sentence-transformers before 6
        from sentence_transformers import models

    base = f"{path}-base"
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**TINY, **settings})
    _randomized(AutoModel.from_config(config), seed).save_pretrained(base)
    if wordpiece:
        _wordpiece_tokenizer(base, config.vocab_size)
    else:
        _tokenizer(base)
    modules = [models.Transformer(base), models.Pooling(config.hidden_size, pooling_mode=pooling_mode)]
    size = config.hidden_size
    for out in dense:
        modules.append(models.Dense(size, out, activation_function=torch.nn.Tanh()))
        size = out
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(path)
    if config_json:
        config_path = os.path.join(path, "config.json")
        with open(config_path) as f:
            saved = json.load(f)
        saved.update(config_json)
        with open(config_path, "w") as f:
            json.dump(saved, f, indent=2)
    return path


def make_classifier(path: str, *, model_type: str = "qwen2", num_labels: int = 3, seed: int = 0, **settings) -> str:
    """transformers' random `*ForSequenceClassification` of `model_type` with `num_labels` labels."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, num_labels=num_labels, **{**TINY, **settings})
    _randomized(AutoModelForSequenceClassification.from_config(config), seed).save_pretrained(path)
    _tokenizer(path, token_types=getattr(config, "type_vocab_size", 1) > 1)
    return path


def st_embeddings(path: str, texts: list[str]) -> torch.Tensor:
    """sentence-transformers' embeddings of `texts`, one text at a time, float32 on the CPU."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    return torch.stack([torch.as_tensor(model.encode([text], convert_to_tensor=True)[0]) for text in texts])


@torch.inference_mode()
def hf_logits(path: str, token_ids: list[list[int]]) -> list[torch.Tensor]:
    """transformers' classifier outputs (before any activation) for each prompt, one at a time."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    return [model(input_ids=torch.tensor([ids])).logits[0] for ids in token_ids]
