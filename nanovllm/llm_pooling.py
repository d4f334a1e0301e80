"""`LLM`'s pooling methods, as vLLM's: `embed`, `classify`, `score`, `reward` and `encode`, for an engine started with
`runner="pooling"` (chosen by itself for classifiers, base models and sentence-transformers directories)."""
from collections.abc import Sequence

import torch.nn.functional as F

from nanovllm.config import Config
from nanovllm.engine.pooling_prompts import PoolingParamsArg, PoolingPromptChecker
from nanovllm.engine.prompts import Prompt
from nanovllm.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from nanovllm.pooling_params import POOLING_TASKS, PoolingParams

EMBEDDER_TASKS = ("embed", "token_embed", "score")
CLASSIFIER_TASKS = ("classify", "score", "token_classify")


class PoolingMethods:
    """Mixed into `LLM` (`nanovllm.llm`), whose `_run` submits checked prompts and waits for their outputs. Every
    prompt and parameter is checked before any work starts; a bad one is a ValueError and the engine serves on."""

    config: Config
    prompts: PoolingPromptChecker

    def encode(self, prompts: Prompt | list[Prompt], pooling_params: PoolingParamsArg = None,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """One `PoolingRequestOutput` per prompt, in order: its `outputs.data` (a float32 tensor on the CPU) is what
        `pooling_task` asks: "embed" (a vector), "classify" (class probabilities), "token_embed" or
        "token_classify" (one row per prompt token); None: the model's own task ("embed" for an embedding model,
        "classify" for a classifier). Prompts are taken as by `generate`; `pooling_params` is one `PoolingParams` for
        all or one per prompt, and `truncate_prompt_tokens` (keep the last k tokens; -1: `max_model_len`), when
        given, replaces theirs."""
        task = self._pooling_task(pooling_task)
        if task == "score":
            raise ValueError("pooling_task 'score' takes text pairs: use LLM.score(text_1, text_2)")
        return self._run(self.prompts.check_pooling_prompts(prompts, pooling_params, task, truncate_prompt_tokens),
                         use_tqdm)

    def embed(self, prompts: Prompt | list[Prompt], pooling_params: PoolingParamsArg = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (`outputs.embedding`, a list of floats): its hidden states pooled as the model
        says (sentence-transformers' files, else its last token), through its Dense layers, normalized unless
        `PoolingParams(normalize=False)`; `dimensions` keeps the first values (Matryoshka models only)."""
        return [EmbeddingRequestOutput.from_base(output)
                for output in self.encode(prompts, pooling_params, truncate_prompt_tokens, use_tqdm, "embed")]

    def classify(self, prompts: Prompt | list[Prompt], pooling_params: PoolingParamsArg = None,
                 truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (`outputs.probs`) from a `*ForSequenceClassification` model: its
        `score` head at the last token, through softmax (sigmoid for one label, or as its `problem_type` says;
        `PoolingParams(use_activation=False)`: the raw outputs)."""
        return [ClassificationRequestOutput.from_base(output)
                for output in self.encode(prompts, pooling_params, truncate_prompt_tokens, use_tqdm, "classify")]

    def reward(self, prompts: Prompt | list[Prompt], pooling_params: PoolingParamsArg = None,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """A classifier's outputs at every prompt token (`outputs.data`, tokens x labels), as vLLM's `reward`
        (`encode` with "token_classify")."""
        return self.encode(prompts, pooling_params, truncate_prompt_tokens, use_tqdm, "token_classify")

    def score(self, text_1: str | list[str], text_2: str | list[str], /, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """The score of each pair, `text_1` against `text_2`: one text against one (1:1) or against each of a list
        (1:N), or lists of equal length pair by pair (N:N). A cross-encoder (a classifier with one label) reads each
        pair joined as its tokenizer joins a pair, its output through its activation (sigmoid); an embedding model
        gives the cosine of the two texts' embeddings."""
        texts_1, texts_2 = _pairs(text_1, text_2)
        if self.config.pooler.num_labels == 0:
            self._pooling_task("score")
            return self._embedding_scores(texts_1, texts_2, pooling_params, truncate_prompt_tokens, use_tqdm)
        if self.config.pooler.num_labels != 1:
            raise ValueError(f"score needs a cross-encoder, a classifier with one label; {self.config.model!r} has "
                             f"{self.config.pooler.num_labels}: use classify")
        self._pooling_task("score")
        checked = [self.prompts.check_pair(a, b, pooling_params, i, truncate_prompt_tokens)
                   for i, (a, b) in enumerate(zip(texts_1 * len(texts_2) if len(texts_1) == 1 else texts_1, texts_2))]
        return [ScoringRequestOutput.from_base(output) for output in self._run(checked, use_tqdm)]

    def _embedding_scores(self, texts_1: list[str], texts_2: list[str], pooling_params: PoolingParams | None,
                          truncate_prompt_tokens: int | None, use_tqdm: bool) -> list[ScoringRequestOutput]:
        embeddings = self.encode(texts_1 + texts_2, pooling_params, truncate_prompt_tokens, use_tqdm, "embed")
        firsts, seconds = embeddings[:len(texts_1)], embeddings[len(texts_1):]
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        return [ScoringRequestOutput(f"{a.request_id}_{b.request_id}",
                                     ScoringOutput(F.cosine_similarity(a.outputs.data, b.outputs.data, dim=0).item()),
                                     a.prompt_token_ids + b.prompt_token_ids, 0, True)
                for a, b in zip(firsts, seconds)]

    def _pooling_task(self, task: str | None) -> str:
        """`task` (None: the model's own), or a ValueError when this engine or model cannot serve it."""
        if self.config.runner != "pooling":
            raise ValueError(f"{self.config.model!r} runs with runner='generate', which has no pooler: start the LLM "
                             "with runner='pooling' to embed, classify or score")
        classifier = self.config.pooler.num_labels > 0
        task = task if task is not None else "classify" if classifier else "embed"
        if task not in POOLING_TASKS:
            raise ValueError(f"pooling_task must be one of {list(POOLING_TASKS)}, got {task!r}")
        if classifier and task not in CLASSIFIER_TASKS:
            raise ValueError(f"{self.config.model!r} is a classifier (its `score` head has "
                             f"{self.config.pooler.num_labels} outputs), which does not {task}: use classify, score "
                             "or reward")
        if not classifier and task not in EMBEDDER_TASKS:
            raise ValueError(f"{self.config.model!r} is an embedding model without a classifier head, which does not "
                             f"{task}: use embed, or score (the cosine of two embeddings)")
        return task


def _pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> tuple[list[str], list[str]]:
    """`score`'s texts as two lists: one and N, or N and N; a ValueError for anything else."""
    texts_1 = [text_1] if isinstance(text_1, str) else list(text_1)
    texts_2 = [text_2] if isinstance(text_2, str) else list(text_2)
    if not texts_1 or not texts_2:
        raise ValueError("score needs at least one text on each side")
    if len(texts_1) > 1 and len(texts_1) != len(texts_2):
        raise ValueError(f"score pairs text_1 with text_2 one to one (N:N) or one text with each (1:N); got "
                         f"{len(texts_1)} and {len(texts_2)} texts")
    return texts_1, texts_2
