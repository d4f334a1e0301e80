"""LoRA without merging: a linear layer's output plus, for each token, `scale * B @ (A @ x)` of that token's adapter.

A step's tokens are mapped to adapters once (`set_lora_step`). On the CPU (its kernels built) one call per layer,
`lora_add` (`kernels/csrc/lora_ops.cpp`), gives every row its own adapter's delta, computing no other adapter's
products: the layer keeps each adapter packed for it once (its A, its slices' B transposed in one buffer), and a
step's table of its adapters' slices (a few integers: a step whose adapters differ from the last one's costs no copy
of weights).
Elsewhere on the CPU, whichever costs less:
- small steps (decodes, short chunks: at most `STACKED_ROWS` rows) are stacked: each layer keeps, for the step's
  adapters, their A matrices stacked and their B matrices side by side (zero where a slice does not reach), so one
  shrink matmul over every row, a 0/1 mask keeping each row's own adapter's columns, one expand matmul and each
  row's output scales give every row its delta in the same seven operations however many adapters and slices there
  are (the extra products with other adapters' columns are cheap at these sizes, the Python per operation is not);
- larger steps are grouped: per adapter, one shrink matmul over its rows (gathered by index) and one expand per
  output slice, added into those rows, so no row pays for another adapter's rank.
On CUDA the same packing feeds two Triton kernels (`kernels/triton_lora.py`), copied into buffers of fixed capacity
(`Slots`: `max_loras` adapters of ranks up to `max_lora_rank`) when a step's adapters change, so that a CUDA graph
captured once adds the deltas of whichever adapters a replay's rows have.
Tokens of the base model get nothing. The base linear is untouched, so a float, prepacked or GGML-quantized weight
is the same.
"""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from nanovllm.kernels.cpu import cpu_kernels

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
    rows (None: every row). For the Triton kernels `token_index` may run past the step's rows (a CUDA graph's
    buffer: the kernels read as many as the layer's input has), padded with slots past the step's adapters."""

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


@dataclass
class Packed:
    """A layer's share of a step's adapters as `lora_add` takes them: slot i's A (its ranks' sum x in) and its
    slices' B transposed (rank x size each) one after another, flat (empty where the adapter skips the layer); and a
    row per slice (slot, first A row, rank, output offset, size, where its B starts) with its scale, slot i's rows
    being `slot_slices[i]..slot_slices[i + 1]`."""

    a: list[torch.Tensor]
    bt: list[torch.Tensor]
    slices: torch.Tensor
    scales: torch.Tensor
    slot_slices: torch.Tensor

    def joined(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every slot's A, then every slot's B, one after another, and the slice table's offsets into them."""
        rows = torch.tensor([0] + [a.size(0) for a in self.a[:-1]]).cumsum(0)
        values = torch.tensor([0] + [bt.numel() for bt in self.bt[:-1]]).cumsum(0)
        slices, slot = self.slices.clone(), self.slices[:, 0]
        slices[:, 1] += rows.to(slices.device)[slot]
        slices[:, 5] += values.to(slices.device)[slot]
        return torch.cat(self.a), torch.cat(self.bt), slices


@dataclass
class Slots:
    """A layer's buffers for the Triton kernels, at addresses that never change: a step's `Packed` joined (every
    slot's A, then every B, one buffer each; the slice table, scales and each slot's first slice), for at most
    `slots` adapters of `a_rows` A rows, `max_slices` slices and `b_size` B values each."""

    a: torch.Tensor
    bt: torch.Tensor
    slices: torch.Tensor
    scales: torch.Tensor
    slot_slices: torch.Tensor
    slots: int
    a_rows: int
    max_slices: int
    b_size: int

    def load(self, packed: Packed | None, count: int) -> None:
        """Hold `packed`, the packing of a step's `count` adapters (None: none adapts the layer)."""
        if packed is None:
            self.slot_slices.zero_()
            return
        a, bt, table = packed.joined()
        slices = table.size(0)
        self.a[:a.size(0)].copy_(a)
        self.bt[:bt.numel()].copy_(bt)
        self.slices[:slices].copy_(table)
        self.scales[:slices].copy_(packed.scales)
        self.slot_slices[:count + 1].copy_(packed.slot_slices)
        self.slot_slices[count + 1:] = slices


class LoRALayer:
    """The adapters a linear layer carries (adapter id -> weights), for `LinearBase.forward` to add to its output.
    A plain object, not a module: adapters are no parameters of the model (`load_weights`, sleep mode and the
    state dict never see them)."""

    def __init__(self, in_features: int, out_features: int, kernel: bool = False, slices: int = 1):
        """`kernel`: add the deltas with the CPU kernel `lora_add`; `slices`: the output slices an adapter may adapt
        (q/k/v: 3), for the Triton kernels' capacity (`bind_slots`)."""
        self.in_features = in_features
        self.out_features = out_features
        self.kernel = kernel
        self.slices = slices
        self.slots: Slots | None = None
        self.adapters: dict[int, LoRAWeights] = {}
        self._stacked: tuple[tuple[int, ...], Stacked | Packed | None] | None = None  # the last step's adapters
        self._own: dict[int, _Own] = {}  # each adapter packed for the kernels, on first use

    def bind_slots(self, slots: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        """Add the deltas with the Triton kernels (`nanovllm.kernels.triton_lora`) from `Slots` for `slots` adapters
        of ranks up to `max_rank`, which `load_slots` fills before each step."""
        from nanovllm.kernels.triton_lora import lora_add  # Triton: only where there is a GPU (or its interpreter)

        self._triton_add = lora_add
        a_rows, b_size = self.slices * max_rank, max_rank * self.out_features
        self.slots = Slots(torch.zeros(slots * a_rows, self.in_features, dtype=dtype, device=device),
                           torch.zeros(slots * b_size, dtype=dtype, device=device),
                           torch.zeros(slots * self.slices, 6, dtype=torch.int64, device=device),
                           torch.zeros(slots * self.slices, dtype=torch.float32, device=device),
                           torch.zeros(slots + 1, dtype=torch.int64, device=device), slots, a_rows, self.slices,
                           b_size)
        self._stacked = None

    def overflow(self, weights: LoRAWeights) -> str | None:
        """What of an adapter's `weights` exceeds a slot of `bind_slots` (None: they fit)."""
        s, pieces = self.slots, weights.slices
        for what, have, room in (("slices", len(pieces), s.max_slices), ("A rows", weights.a.size(0), s.a_rows),
                                 ("B values", sum(piece.b.numel() for piece in pieces), s.b_size)):
            if have > room:
                return f"{have} {what} for one projection, more than its {room}"
        return None

    def load_slots(self, adapters: tuple[int, ...]) -> None:
        """Put a step's `adapters` in the `Slots` (copied only when they differ from the last step's)."""
        if self._stacked is None or self._stacked[0] != adapters:
            self.slots.load(self.packed(adapters), len(adapters))

    def add_adapter(self, adapter_id: int, weights: LoRAWeights) -> None:
        self.adapters[adapter_id] = weights
        self._own.pop(adapter_id, None)
        self._stacked = None

    def remove_adapter(self, adapter_id: int) -> None:
        del self.adapters[adapter_id]
        self._own.pop(adapter_id, None)
        self._stacked = None

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base output for input `x`) with each token's adapter delta added, in place."""
        step = _step
        if self.slots is not None:
            if step.token_index is not None:
                s = self.slots
                self._triton_add(y.view(-1, self.out_features), x.reshape(-1, self.in_features), s.a, s.bt, s.slices,
                                 s.scales, step.token_index, s.slot_slices, s.slots, s.a_rows)
            return y
        if self.kernel:
            if step.adapters and (packed := self.packed(step.adapters)) is not None:
                cpu_kernels().lora_add(y, x.reshape(-1, self.in_features), packed.a, packed.bt, packed.slices,
                                       packed.scales, step.token_index, packed.slot_slices)
            return y
        if step.adapters:
            stacked = self._stack(step.adapters)
            if stacked is not None:
                own = step.masks.get(stacked.owner_key)
                if own is None:
                    own = step.masks[stacked.owner_key] = (step.token_index.unsqueeze(1) == stacked.owner).to(x.dtype)
                scales = step.row_scales.get(stacked.scales_key)
                if scales is None:
                    scales = step.row_scales[stacked.scales_key] = stacked.scales.index_select(0, step.token_index)
                y += F.linear(F.linear(x, stacked.a) * own, stacked.b) * scales
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

    def packed(self, adapters: tuple[int, ...]) -> Packed | None:
        """This layer's share of a step's `adapters` packed for the kernels (None when none of them adapts it), kept
        until the step's adapters or this layer's change."""
        if self._stacked is not None and self._stacked[0] == adapters:
            return self._stacked[1]
        slots = []
        for adapter_id in adapters:
            weights = self.adapters.get(adapter_id)
            if weights is not None and adapter_id not in self._own:
                self._own[adapter_id] = _Own.of(weights)
            slots.append(None if weights is None else self._own[adapter_id])
        self._stacked = adapters, _Own.packed(slots)
        return self._stacked[1]

    def _stack(self, adapters: tuple[int, ...]) -> Stacked | None:
        """This layer's weights of `adapters` stacked (None when none of them adapts it), kept until the step's
        adapters or this layer's change."""
        if self._stacked is not None and self._stacked[0] == adapters:
            return self._stacked[1]
        present = [(i, self.adapters[adapter_id]) for i, adapter_id in enumerate(adapters)
                   if adapter_id in self.adapters]
        stacked = _stack(present, len(adapters), self.out_features) if present else None
        self._stacked = adapters, stacked
        return stacked


@dataclass
class _Own:
    """An adapter's part of a layer packed for the kernels: its A, its slices' B transposed one after another, and
    its slices (first A row, rank, output offset, size, where its B starts, scale)."""

    a: torch.Tensor
    bt: torch.Tensor
    slices: list[tuple[int, int, int, int, int, float]]

    @staticmethod
    def of(weights: LoRAWeights) -> "_Own":
        bt, slices, first_b = [], [], 0
        for s in weights.slices:
            rank = s.rank_to - s.rank_from
            slices.append((s.rank_from, rank, s.offset, s.size, first_b, s.scale))
            bt.append(s.b.t().reshape(-1))
            first_b += rank * s.size
        return _Own(weights.a, torch.cat(bt), slices)

    @staticmethod
    def packed(slots: list["_Own | None"]) -> Packed | None:
        """A step's `Packed`, slot i adapted by `slots[i]` (None: not this layer; None when no slot adapts it)."""
        present = [own for own in slots if own is not None]
        if not present:
            return None
        empty, device = present[0].a.new_empty(0), present[0].a.device
        table, scales, slot_slices = [], [], [0]
        for slot, own in enumerate(slots):
            for *row, scale in own.slices if own is not None else ():
                table.append([slot, *row])
                scales.append(scale)
            slot_slices.append(len(table))
        return Packed([empty if own is None else own.a for own in slots],
                      [empty if own is None else own.bt for own in slots],
                      torch.tensor(table, dtype=torch.int64, device=device),
                      torch.tensor(scales, dtype=torch.float32, device=device),
                      torch.tensor(slot_slices, dtype=torch.int64, device=device))


def _stack(present: list[tuple[int, LoRAWeights]], slots: int, out_features: int) -> Stacked:
    """`Stacked` for the adapters `present` (slot, weights) of a step's `slots`."""
    a, b, owner, scale_layout = [], [], [], []
    reference = present[0][1].a
    scales = torch.zeros(slots + 1, out_features, dtype=reference.dtype, device=reference.device)
    for i, weights in present:
        side = torch.zeros(out_features, weights.a.size(0), dtype=reference.dtype, device=reference.device)
        for s in weights.slices:
            side[s.offset:s.offset + s.size, s.rank_from:s.rank_to] = s.b
            scales[i, s.offset:s.offset + s.size] = s.scale
            scale_layout.append((i, s.offset, s.size, s.scale))
        a.append(weights.a)
        b.append(side)
        owner += [i] * weights.a.size(0)
    return Stacked(torch.cat(a), torch.cat(b, dim=1), torch.tensor(owner, device=reference.device), scales,
                   tuple(owner), (out_features, tuple(scale_layout)))


_step = LoRAStep()


def set_lora_step(step: LoRAStep) -> None:
    """The running step's tokens by adapter (see `LoRAStep`)."""
    global _step
    _step = step


def lora_step() -> LoRAStep:
    """The running step's tokens by adapter."""
    return _step


def clear_lora_step() -> None:
    set_lora_step(LoRAStep())
