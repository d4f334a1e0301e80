"""The pooling runner's layers: how a prompt's hidden states become one vector (its last token's, their mean, its
first token's), sentence-transformers' Dense layers, and the heads' activations and normalization.

A prompt may be computed over several steps (chunked prefill): `Pooler.accumulate` takes one chunk's rows and the
partial result so far (a running sum for mean pooling, the rows for per-token tasks), `Pooler.finish` gives the
pooled hidden states once the last chunk is in, so the result is the one of a single step.
"""
import torch
import torch.nn.functional as F
from torch import nn

DENSE_ACTIVATIONS = ("Identity", "Tanh", "ReLU", "GELU", "Sigmoid", "SiLU")
"""sentence-transformers' Dense `activation_function`s nanovllm runs (torch.nn classes)."""


class DenseLayer(nn.Module):
    """sentence-transformers' `Dense`: a linear layer with bias (or not) and an activation."""

    def __init__(self, in_features: int, out_features: int, bias: bool, activation: str):
        super().__init__()
        if activation not in DENSE_ACTIVATIONS:
            raise ValueError(f"sentence-transformers Dense activation {activation!r} is not supported; nanovllm runs "
                             f"{list(DENSE_ACTIVATIONS)}")
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        self.activation = getattr(nn, activation)()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.linear(x))


def activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """A classifier's outputs through its activation: "softmax" (over the last dimension), "sigmoid" or
    "identity"."""
    if activation == "softmax":
        return logits.softmax(dim=-1)
    if activation == "sigmoid":
        return logits.sigmoid()
    return logits


def normalized(x: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """An embedding (or rows of them) cut to its first `dimensions` values (Matryoshka), then L2-normalized when
    `normalize`."""
    if dimensions is not None:
        x = x[..., :dimensions]
    return F.normalize(x, p=2, dim=-1) if normalize else x


class Pooler(nn.Module):
    """`pooling_type` ("LAST", "MEAN" or "CLS"; "ALL" keeps every row, for per-token tasks) over a prompt's rows, and
    the embedding's Dense layers (`dense`, in order)."""

    def __init__(self, pooling_type: str, dense: list[DenseLayer]):
        super().__init__()
        self.pooling_type = pooling_type
        self.dense = nn.ModuleList(dense)

    @staticmethod
    def accumulate(pooling_type: str, rows: torch.Tensor, first: bool,
                   partial: torch.Tensor | list[torch.Tensor] | None) -> torch.Tensor | list[torch.Tensor] | None:
        """The partial result after one chunk of a prompt (`rows`, its hidden states; `first`: the prompt's first
        chunk): mean pooling's running sum (in float32), the first token's row, every row so far, or nothing (last
        token pooling reads the last chunk only)."""
        if pooling_type == "MEAN":
            total = rows.float().sum(dim=0)
            return total if partial is None else partial + total
        if pooling_type == "CLS":
            return rows[0] if first else partial
        if pooling_type == "ALL":
            return [*(partial or []), rows]
        return None

    @staticmethod
    def finish(pooling_type: str, rows: torch.Tensor, partial, num_tokens: int) -> torch.Tensor:
        """The prompt's pooled hidden states once its last chunk (`rows`) is computed: one vector, or (ALL) one row
        per token; `num_tokens` is the prompt's length."""
        if pooling_type == "MEAN":
            return (partial / num_tokens).to(rows.dtype)
        if pooling_type == "CLS":
            return partial
        if pooling_type == "ALL":
            return torch.cat(partial)
        return rows[-1]

    def embed(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled hidden states through the Dense layers."""
        for layer in self.dense:
            pooled = layer(pooled)
        return pooled
