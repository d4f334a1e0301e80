"""LoRA without merging: a linear layer's output plus, for each token, `scale * B @ (A @ x)` of that token's adapter.

A step's tokens are grouped by adapter once (`set_lora_step`: each adapter's row indices, a tensor input of the step;
None for an adapter that has every row), and every adapted layer then runs, per adapter of the step, one shrink
matmul over that adapter's rows (the A matrices of all its slices stacked) and one expand matmul per output slice,
added into the base output at those rows. Tokens of the base model (adapter 0) are left as they are. The base
linear is untouched, so a float, prepacked or GGML-quantized weight is the same.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LoRASlice:
    """One adapted output slice of a layer: its columns `offset..offset+size` get `scale * B @ shrunk` over the
    shrunk columns `rank_from..rank_to` (the slice's A rows in the stacked A)."""

    offset: int
    size: int
    b: torch.Tensor
    rank_from: int
    rank_to: int
    scale: float


@dataclass
class LoRAWeights:
    """An adapter's part of one layer: its slices' A matrices stacked (sum of ranks x in) and the slices."""

    a: torch.Tensor
    slices: list[LoRASlice]


class LoRALayer:
    """The adapters a linear layer carries (adapter id -> weights), for `LinearBase.forward` to add to its output.
    A plain object, not a module: adapters are no parameters of the model (`load_weights`, sleep mode and the
    state dict never see them)."""

    def __init__(self, in_features: int, out_features: int):
        self.in_features = in_features
        self.out_features = out_features
        self.adapters: dict[int, LoRAWeights] = {}

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base output for input `x`) with each token's adapter delta added, in place."""
        for adapter_id, rows in _step_groups:
            weights = self.adapters.get(adapter_id)
            if weights is None:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            shrunk = F.linear(xs, weights.a)
            for s in weights.slices:
                delta = F.linear(shrunk[:, s.rank_from:s.rank_to], s.b) * s.scale
                if rows is None:
                    y[:, s.offset:s.offset + s.size] += delta
                else:
                    y[:, s.offset:s.offset + s.size].index_add_(0, rows, delta)
        return y


_step_groups: list[tuple[int, torch.Tensor | None]] = []


def set_lora_step(groups: list[tuple[int, torch.Tensor | None]]) -> None:
    """The running step's tokens by adapter: (adapter id, its rows, or None for all rows); base rows are in none."""
    global _step_groups
    _step_groups = groups


def clear_lora_step() -> None:
    set_lora_step([])
