"""`PoolingParams`, vLLM's parameters of a pooling request (`LLM.embed`, `classify`, `score`, `reward`, `encode`),
and the pooling tasks."""
from dataclasses import dataclass, replace

POOLING_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")
"""vLLM's pooling tasks: a vector per prompt (`embed`), class probabilities (`classify`), a cross-encoder's score of a
text pair (`score`), or per prompt token (`token_embed`, `token_classify`; `LLM.reward` is `token_classify`)."""
EMBED_TASKS = ("embed", "token_embed")


@dataclass
class PoolingParams:
    """vLLM's fields. `truncate_prompt_tokens`: keep only the prompt's last k tokens (-1: `max_model_len`; None: no
    truncation, a prompt over `max_model_len` is refused). For embeddings, `normalize` (None: the model's default,
    True for the decoder embedders) and `dimensions` (Matryoshka: the first `dimensions` values, normalized again when
    normalizing; only for models whose config says they support it). For classification and scores, `use_activation`
    (None: True; softmax over several labels, sigmoid for one); `activation` is its older name. `task` is set by the
    method called (`embed`, `classify`, ...); giving another is a ValueError."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    use_activation: bool | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < -1 or k == 0):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer, -1 (max_model_len) or None, got "
                             f"{k!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer or None, got {self.dimensions!r}")
        for name in ("normalize", "activation", "use_activation"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be True, False or None, got {getattr(self, name)!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {list(POOLING_TASKS)}, got {self.task!r}")

    def for_task(self, task: str, truncate_prompt_tokens: int | None = None,
                 normalize: bool = True) -> "PoolingParams":
        """A copy for `task` with the defaults filled in (`normalize`: the model's; `use_activation` True unless
        `activation` says otherwise), `truncate_prompt_tokens` replaced when given; a ValueError for a parameter the
        task does not take, or a task other than the one already set."""
        if self.task is not None and self.task != task:
            raise ValueError(f"these PoolingParams are for task {self.task!r}, not {task!r}; pass new PoolingParams")
        embeds = task in EMBED_TASKS
        wrong = [name for name in ("dimensions", "normalize") if not embeds and getattr(self, name) is not None]
        wrong += [name for name in ("activation", "use_activation") if embeds and getattr(self, name) is not None]
        if wrong:
            valid = ["dimensions", "normalize"] if embeds else ["use_activation"]
            raise ValueError(f"Task {task} only supports {valid} parameters, does not support {wrong} parameters")
        activation = self.use_activation if self.use_activation is not None else self.activation
        truncate = self.truncate_prompt_tokens if truncate_prompt_tokens is None else truncate_prompt_tokens
        return replace(self, task=task, truncate_prompt_tokens=truncate,
                       normalize=(normalize if self.normalize is None else self.normalize) if embeds else None,
                       use_activation=None if embeds else activation is not False, activation=None)
