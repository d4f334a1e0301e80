"""A model's tokenizer, and the check that two models speak the same vocabulary."""
import os

from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer(model: str) -> PreTrainedTokenizerBase | None:
    """The model directory's tokenizer, or None when it ships none (token-id prompts still work)."""
    if not any(os.path.isfile(os.path.join(model, name)) for name in _TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load the tokenizer in {model!r}: {e}") from e


def _vocabulary(model: str) -> dict[str, int] | None:
    tokenizer = load_tokenizer(model)
    return None if tokenizer is None else tokenizer.get_vocab()


def check_same_vocabulary(target: str, target_cfg: PretrainedConfig, draft: str, draft_cfg: PretrainedConfig) -> None:
    """A ValueError unless the draft's vocabulary is the target's: the same size and, where both directories ship a
    tokenizer, the same token for every id."""
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"the draft model {draft!r} has a vocabulary of {draft_cfg.vocab_size} tokens, the target "
                         f"{target!r} {target_cfg.vocab_size}: a draft model must use the target's tokenizer")
    target_vocab, draft_vocab = _vocabulary(target), _vocabulary(draft)
    if target_vocab is not None and draft_vocab is not None and target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda item: item[1])[:3]
        raise ValueError(f"the draft model {draft!r} and the target {target!r} have different tokenizers (e.g. "
                         f"{differing}): a draft model must use the target's tokenizer")
