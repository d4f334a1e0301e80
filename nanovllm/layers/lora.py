"""LoRA without merging: a linear layer's output plus, for each token, `scale * B @ (A @ x)` of that token's adapter.

A step's tokens are mapped to adapters once (`set_lora_step`), in one of two ways, whichever costs less:
- small steps (decodes, short chunks: at most `STACKED_ROWS` rows) are stacked: each layer keeps, for the step's
  adapters, their A matrices stacked and their B matrices side by side (zero where a slice does not reach), so one
  shrink matmul over every row, a 0/1 mask keeping each row's own adapter's columns, one expand matmul and each
  row's output scales give every row its delta in the same seven operations however many adapters and slices there
  are (the extra products with other adapters' columns are cheap at these sizes, the Python per operation is not).
  On the CPU the stacked matrices are prepacked for oneDNN, as the base weights are, and the products run on one
  thread: a parallel region costs more than a product this small (at 32 rows of SmolLM2's q/k/v with 4 rank-16
  adapters on 2 cores, 61 us on two threads against 21 us on one);
- larger steps are grouped: per adapter, one shrink matmul over its rows (gathered by index) and one expand per
  output slice, added into those rows, so no row pays for another adapter's rank.
Tokens of the base model (adapter 0) get nothing. The base linear is untouched, so a float, prepacked or
GGML-quantized weight is the same.
"""
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

STACKED_ROWS = 256


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


@dataclass
class LoRAStep:
    """The running step's tokens by adapter. Stacked (`adapters` set): `adapters` are the step's adapter ids and
    `token_index` each row's position among them (`len(adapters)`: the base). Grouped: `groups` is each adapter's
    rows (None: every row)."""

    adapters: tuple[int, ...] = ()
    token_index: torch.Tensor | None = None
    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)  # by `Stacked.owner_key`: made once a step
    row_scales: dict[tuple, torch.Tensor] = field(default_factory=dict)  # by `Stacked.scales_key`


@dataclass
class Stacked:
    """A layer's adapters side by side, for a stacked step: A stacked (their ranks' sum x in), B side by side (out x
    that sum), each A row's adapter (its position in the step's adapters), each adapter's scale per output column
    (and a last row of zeros, for the base's rows). Layers of the same layout share their keys, so a step makes each
    row mask and each rows' scales once, not once per layer."""

    a: torch.Tensor
    b: torch.Tensor
    owner: torch.Tensor
    scales: torch.Tensor
    owner_key: tuple
    scales_key: tuple


class LoRALayer:
    """The adapters a linear layer carries (adapter id -> weights), for `LinearBase.forward` to add to its output.
    A plain object, not a module: adapters are no parameters of the model (`load_weights`, sleep mode and the
    state dict never see them)."""

    def __init__(self, in_features: int, out_features: int, prepack: bool = False):
        """`prepack`: lay the stacked matrices out for oneDNN (a CPU dtype it runs, see `nanovllm.layers.prepack`)."""
        self.in_features = in_features
        self.out_features = out_features
        self.prepack = prepack
        self.adapters: dict[int, LoRAWeights] = {}
        self._stacked: tuple[tuple[int, ...], Stacked | None] | None = None  # the last step's adapters, stacked

    def add_adapter(self, adapter_id: int, weights: LoRAWeights) -> None:
        self.adapters[adapter_id] = weights
        self._stacked = None

    def remove_adapter(self, adapter_id: int) -> None:
        del self.adapters[adapter_id]
        self._stacked = None

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base output for input `x`) with each token's adapter delta added, in place."""
        step = _step
        if step.adapters:
            stacked = self._stack(step.adapters)
            if stacked is not None:
                with _one_thread(x):
                    own = step.masks.get(stacked.owner_key)
                    if own is None:
                        own = step.masks[stacked.owner_key] = \
                            (step.token_index.unsqueeze(1) == stacked.owner).to(x.dtype)
                    scales = step.row_scales.get(stacked.scales_key)
                    if scales is None:
                        scales = step.row_scales[stacked.scales_key] = \
                            stacked.scales.index_select(0, step.token_index)
                    y += _linear(_linear(x, stacked.a) * own, stacked.b) * scales
            return y
        for adapter_id, rows in step.groups:
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

    def _stack(self, adapters: tuple[int, ...]) -> Stacked | None:
        """This layer's weights of `adapters` stacked (None when none of them adapts it), kept until the step's
        adapters or this layer's change."""
        if self._stacked is not None and self._stacked[0] == adapters:
            return self._stacked[1]
        a, b, owner, scale_layout = [], [], [], []
        present = [(i, self.adapters[adapter_id]) for i, adapter_id in enumerate(adapters)
                   if adapter_id in self.adapters]
        stacked = None
        if present:
            reference = present[0][1].a
            scales = torch.zeros(len(adapters) + 1, self.out_features, dtype=reference.dtype, device=reference.device)
            for i, weights in present:
                side = torch.zeros(self.out_features, weights.a.size(0), dtype=reference.dtype, device=reference.device)
                for s in weights.slices:
                    side[s.offset:s.offset + s.size, s.rank_from:s.rank_to] = s.b
                    scales[i, s.offset:s.offset + s.size] = s.scale
                    scale_layout.append((i, s.offset, s.size, s.scale))
                a.append(weights.a)
                b.append(side)
                owner += [i] * weights.a.size(0)
            a, b = torch.cat(a), torch.cat(b, dim=1)
            if self.prepack:
                a, b = torch.ops.mkldnn._reorder_linear_weight(a), torch.ops.mkldnn._reorder_linear_weight(b)
            stacked = Stacked(a, b, torch.tensor(owner, device=reference.device), scales, tuple(owner),
                              (self.out_features, tuple(scale_layout)))
        self._stacked = adapters, stacked
        return stacked


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


@contextmanager
def _one_thread(x: torch.Tensor):
    """On the CPU, torch on one thread for the block (the thread count as it was after)."""
    threads = torch.get_num_threads() if x.device.type == "cpu" else 1
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


_step = LoRAStep()


def set_lora_step(step: LoRAStep) -> None:
    """The running step's tokens by adapter (see `LoRAStep`)."""
    global _step
    _step = step


def clear_lora_step() -> None:
    set_lora_step(LoRAStep())
