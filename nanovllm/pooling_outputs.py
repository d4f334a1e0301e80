"""What the pooling methods return, shaped as vLLM's outputs (`vllm.outputs`): `LLM.encode` and `reward` a
`PoolingRequestOutput` (its `outputs.data` a tensor), `embed` an `EmbeddingRequestOutput`, `classify` a
`ClassificationRequestOutput`, `score` a `ScoringRequestOutput`."""
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    import torch


@dataclass
class PoolingOutput:
    """The pooled hidden states of one prompt (on the CPU): a vector, or one row per prompt token."""

    data: "torch.Tensor"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, self.__class__) and bool((self.data == other.data).all())


_O = TypeVar("_O")


class PoolingRequestOutput(Generic[_O]):
    """One pooling request: its id, output, prompt token ids, prompt tokens served from the prefix cache (always 0:
    pooling requests do not use it) and whether it finished."""

    def __init__(self, request_id: str, outputs: _O, prompt_token_ids: list[int], num_cached_tokens: int,
                 finished: bool):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_cached_tokens = num_cached_tokens
        self.finished = finished
        self.outputs = outputs

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(request_id={self.request_id!r}, outputs={self.outputs!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, num_cached_tokens={self.num_cached_tokens}, "
                f"finished={self.finished})")


@dataclass
class EmbeddingOutput:
    """One prompt's embedding, a list of floats."""

    embedding: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> "EmbeddingOutput":
        if pooling_output.data.ndim != 1:
            raise ValueError("pooled_data should be a 1-D embedding vector")
        return EmbeddingOutput(pooling_output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return EmbeddingRequestOutput(request_output.request_id, EmbeddingOutput.from_base(request_output.outputs),
                                      request_output.prompt_token_ids, request_output.num_cached_tokens,
                                      request_output.finished)


@dataclass
class ClassificationOutput:
    """One prompt's class probabilities (or the classifier's outputs, without activation), a list of floats."""

    probs: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> "ClassificationOutput":
        if pooling_output.data.ndim != 1:
            raise ValueError("pooled_data should be a 1-D probability vector")
        return ClassificationOutput(pooling_output.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return ClassificationRequestOutput(request_output.request_id,
                                           ClassificationOutput.from_base(request_output.outputs),
                                           request_output.prompt_token_ids, request_output.num_cached_tokens,
                                           request_output.finished)


@dataclass
class ScoringOutput:
    """One text pair's score: a cross-encoder's output, or the cosine of the two embeddings."""

    score: float

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> "ScoringOutput":
        data = pooling_output.data.squeeze()
        if data.ndim != 0:
            raise ValueError("pooled_data should be a scalar score")
        return ScoringOutput(data.item())


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> "ScoringRequestOutput":
        return ScoringRequestOutput(request_output.request_id, ScoringOutput.from_base(request_output.outputs),
                                    request_output.prompt_token_ids, request_output.num_cached_tokens,
                                    request_output.finished)
