"""A pooling request as the engine tracks it: one prompt-only sequence, and its pooled output once computed."""
import time
from typing import TYPE_CHECKING

from nanovllm.core.sequence import Sequence
from nanovllm.outputs import RequestMetrics
from nanovllm.pooling_outputs import PoolingOutput, PoolingRequestOutput

if TYPE_CHECKING:
    import torch


class PoolingRequest:
    """`seq` computes the prompt (never samples); `data` is its output from the pooler (None until the prompt is
    computed, and for an aborted request). `error` is set when a failed step aborted it."""

    def __init__(self, request_id: str, seq: Sequence):
        self.request_id = request_id
        self.seq = seq
        self.data: torch.Tensor | None = None
        self.metrics = RequestMetrics(time.time(), num_prompt_tokens=len(seq))
        self.error: BaseException | None = None
        self.reported = False

    @property
    def seqs(self) -> list[Sequence]:
        return [self.seq]

    @property
    def finished(self) -> bool:
        return self.seq.is_finished

    def output(self, delta: bool = False) -> PoolingRequestOutput:
        if delta:
            self.reported = self.finished
        return PoolingRequestOutput(self.request_id, PoolingOutput(self.data), list(self.seq.token_ids), 0,
                                    self.finished)

    def take_news(self) -> list[PoolingRequestOutput]:
        """Its output once finished, the first time it is asked for (a pooling request has no partial news)."""
        return [self.output(delta=True)] if self.finished and not self.reported else []
