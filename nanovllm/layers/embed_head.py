"""Vocab-parallel embedding and LM head: each rank owns a contiguous slice of the vocabulary.

A GGML embedding (`GGMLTensor`, e.g. a GGUF file's Q8_0 `token_embd`) stays in blocks: a lookup dequantizes the rows
it gathers, and a tied LM head runs over the same bytes."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.process_group import tp_rank_and_size
from nanovllm.layers.ggml_weight import GGMLTensor, GGMLWeight
from nanovllm.layers.linear import linear


def embedding(ids: torch.Tensor, weight: torch.Tensor | GGMLWeight) -> torch.Tensor:
    return weight.embedding(ids) if isinstance(weight, GGMLWeight) else F.embedding(ids, weight)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.num_embeddings_per_partition = (num_embeddings + self.tp_size - 1) // self.tp_size
        self.vocab_start_idx = self.num_embeddings_per_partition * self.tp_rank
        self.vocab_end_idx = min(self.vocab_start_idx + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.ggml_parts: list[tuple[int, GGMLTensor]] = []

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor | GGMLTensor) -> None:
        shard = loaded_weight[self.vocab_start_idx:self.vocab_end_idx]
        if isinstance(shard, GGMLTensor):
            self.ggml_parts.append((0, shard.padded(self.num_embeddings_per_partition)))
            return
        param.data[:shard.size(0)].copy_(shard)
        param.data[shard.size(0):].zero_()  # the rows past the vocabulary, on the last rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return embedding(x, self.weight)
        mask = (x >= self.vocab_start_idx) & (x < self.vocab_end_idx)
        y = embedding(mask * (x - self.vocab_start_idx), self.weight) * mask.unsqueeze(1)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits (the runner passes only the rows that sample).

    With tensor parallelism the vocab slices are gathered on rank 0, which samples; other ranks
    return None.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.num_embeddings = num_embeddings

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        logits = linear(x, self.weight)
        if self.tp_size == 1:
            return logits
        gathered = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, gathered, 0)
        return torch.cat(gathered, -1)[:, :self.num_embeddings] if self.tp_rank == 0 else None
