"""New weights into a loaded model, in place (`LLM.load_weights`): transformers' names mapped through the model's
renames onto the parameters `load_weights` recorded (`LoadRecord`), every check made before anything is written, then
each parameter written in place with the loader it was built with, so CUDA graphs and the one-call CPU decode keep
reading the same memory: float parameters copied into, oneDNN-packed ones repacked into their tensors, GGML blocks
requantized into their types.
"""
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.kernels.ggml import type_name
from nanovllm.layers.ggml_weight import REQUANTIZABLE, GGMLWeight, requantize
from nanovllm.layers.linear import LinearBase
from nanovllm.layers.moe import FusedMoE
from nanovllm.models.loader import LoadRecord, WeightSlot, as_loaded, reference_shapes, resolve_name, shard_args


@dataclass
class _Update:
    """One checkpoint tensor of a reload, under the model's own name, and the parameter (slot) and shard it fills."""

    name: str
    slot: str
    shard: object
    tensor: torch.Tensor


def _checkpoint_shapes(record: LoadRecord, hf_config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """transformers' names and full shapes of this model's checkpoint (built once per model, on the meta device);
    empty where transformers cannot build the config."""
    if record.checkpoint_shapes is None:
        try:
            record.checkpoint_shapes = reference_shapes(hf_config)
        except Exception:  # noqa: BLE001 (the loaders' own checks remain)
            record.checkpoint_shapes = {}
    return record.checkpoint_shapes


def weight_pairs(weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """`weights` as a list of (name, detached floating-point tensor) pairs (a dict: its items); a ValueError names
    an item that is not one."""
    pairs = list(weights.items() if isinstance(weights, dict) else weights)
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise ValueError(f"weights must be (name, tensor) pairs, such as a state dict's items(); item {i} is "
                             f"{type(pair).__name__}" + (f" ({type(pair[0]).__name__}, {type(pair[1]).__name__})"
                                                         if isinstance(pair, tuple) and len(pair) == 2 else ""))
        if not pair[1].is_floating_point():
            raise ValueError(f"weight {pair[0]!r} is a {pair[1].dtype} tensor; weights are floating point")
    return [(name, tensor.detach()) for name, tensor in pairs]


def _plan(model: nn.Module, pairs: list[tuple[str, torch.Tensor]], hf_config: PretrainedConfig) -> list[_Update]:
    """Each tensor of `pairs` (transformers' names) mapped through the model's renames onto its parameter and shard,
    every check made: a ValueError names the first problem, and nothing has changed."""
    record: LoadRecord | None = getattr(model, "load_record", None)
    if record is None:
        raise RuntimeError("this model was not loaded through nanovllm.models.loader.load_weights")
    shapes = _checkpoint_shapes(record, hf_config)
    for name, tensor in pairs:
        if name in shapes and tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, but the model expects "
                             f"{shapes[name]}")
    renamed = pairs
    if (rename := getattr(model, "checkpoint_weights", None)) is not None:
        try:
            renamed = list(rename(pairs))
        except Exception as e:  # noqa: BLE001 (a family's rename meeting a tensor it cannot split)
            raise ValueError(f"the weights could not be mapped onto the model's own names: {e!r}") from None
    packed = getattr(model, "packed_modules_mapping", {})
    experts = getattr(model, "expert_modules_mapping", {})
    given = {name for name, _ in renamed}
    updates, unknown = [], []
    for name, tensor in renamed:
        slot, shard = resolve_name(name, packed, experts)
        if slot in record.aliases:  # a tied parameter's other name (a tied lm_head.weight)
            slot = record.aliases[slot][0]
            if slot in given:
                continue
        if slot not in record.slots:
            unknown.append(name)
            continue
        updates.append(_Update(name, slot, shard, tensor))
    if unknown:
        shown = ", ".join(map(repr, unknown[:5])) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise ValueError(f"no parameter of this {type(model).__name__} takes the weights named {shown}; names are "
                         "the model's Hugging Face checkpoint names, e.g. 'model.layers.0.self_attn.q_proj.weight'")
    for update in updates:  # the loaders, run on the meta device: their own checks, nothing written
        slot = record.slots[update.slot]
        stand_in = torch.empty(slot.shape, dtype=slot.dtype, device="meta")
        try:
            slot.loader(stand_in, torch.empty(update.tensor.shape, dtype=update.tensor.dtype, device="meta"),
                        *shard_args(update.shard))
        except Exception as e:  # noqa: BLE001 (a shape the loader cannot take, whatever it raised)
            raise ValueError(f"weight {update.name!r} of shape {tuple(update.tensor.shape)} does not fit parameter "
                             f"{update.slot!r} (shape {tuple(slot.shape)} on this rank): {e}") from None
        if _is_ggml(slot.value):
            for shard, _ in _ggml_pieces(slot, update):
                qtype = record.ggml_types.get((update.slot, shard))
                if qtype not in REQUANTIZABLE:
                    kind = "of unknown type" if qtype is None else f"in GGML type {type_name(qtype)}"
                    raise ValueError(f"weight {update.name!r} goes to {update.slot!r}, which is kept quantized "
                                     f"{kind}; nanovllm requantizes only into Q8_0, Q4_0, Q4_1, F32, F16 and BF16, so "
                                     "it cannot take new weights (load the model dequantized, e.g. from a float "
                                     "checkpoint, or with quantization='int8'/'int4')")
    return updates


def _is_ggml(value) -> bool:
    return isinstance(value, GGMLWeight) or isinstance(value, nn.ModuleList) and isinstance(value[0], GGMLWeight)


def _ggml_pieces(slot: WeightSlot, update: _Update) -> list[tuple[object, torch.Tensor]]:
    """The (shard, tensor) pieces a weight kept in GGML blocks takes the update in: a whole stacked experts tensor
    split per expert (and gate/up), as per-expert checkpoints give them; anything else as it is."""
    if update.shard is not None or not isinstance(slot.module, FusedMoE):
        return [(update.shard, update.tensor)]
    tensor = update.tensor
    if slot.attr == "gate_up_proj":
        halves = tensor.reshape(tensor.size(0), 2, -1, tensor.size(-1))
        return [((e, half), halves[e, half]) for e in range(tensor.size(0)) for half in range(2)]
    return [((e, 0), tensor[e]) for e in range(tensor.size(0))]


def check_reload(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 hf_config: PretrainedConfig) -> list[tuple[str, torch.Tensor]]:
    """`reload_weights`' checks alone (names, shapes, GGML types), changing nothing; the weights as a list."""
    pairs = weight_pairs(weights)
    _plan(model, pairs, hf_config)
    return pairs


@torch.no_grad()
def reload_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], hf_config: PretrainedConfig,
                   dequantized: str | None = None) -> set[str]:
    """Replace some or all of a loaded model's weights, given as (transformers' name, full tensor) pairs, in place.

    The tensors go through the first load's path: the family's renames, packed and expert parameters, each
    parameter's `weight_loader` (this tensor-parallel rank's slice). Every check comes first (`_plan`): an unknown
    name, a wrong shape (both named) or a weight kept in a GGML type nanovllm cannot quantize into is a ValueError
    before anything changes. Then every parameter is written where it is, never replaced: a float parameter by its
    loader; a oneDNN-packed one (CPU) through a dense copy of it, packed again (only the parameters given, and only
    the experts given); a weight kept in GGML blocks gets the new tensor quantized into the type it was loaded in
    (`requantize`), its rows overwritten; a tied LM head with its own packed copy is packed again from the embedding.
    `dequantized`: the `quantization=` of a model whose weights were quantized at load and dequantized (CUDA), whose
    new weights get the same rounding. Returns the names of the parameters written.
    """
    pairs = weight_pairs(weights)
    updates = _plan(model, pairs, hf_config)
    if dequantized:
        updates = _plan(model, list(as_loaded(pairs, dequantized, keep_ggml=False)), hf_config)
    record: LoadRecord = model.load_record
    by_slot: dict[str, list[_Update]] = {}
    for update in updates:
        by_slot.setdefault(update.slot, []).append(update)
    staging = _Staging()
    for name, group in by_slot.items():
        slot = record.slots[name]
        value = slot.value
        if _is_ggml(value):
            _write_ggml(slot, value, group, record)
        elif isinstance(value, nn.ParameterList):
            _write_packed_experts(slot, value, group)
        elif value.is_mkldnn:
            _write_packed(slot, value, group, staging)
        else:
            for update in group:
                slot.loader(value, update.tensor, *shard_args(update.shard))
    for alias, (first, module, attr) in record.aliases.items():
        tied, value = getattr(module, attr), record.slots[first].value
        if first in by_slot and tied is not value:  # the tied LM head's own packed copy (CPU)
            if not (tied.is_mkldnn and isinstance(value, torch.Tensor) and not value.is_mkldnn):
                raise RuntimeError(f"{alias!r} is tied to {first!r} but holds another kind of weight")
            _pack_into(tied, value.detach())
    return set(by_slot)


def _covers(slot: WeightSlot, group: list[_Update]) -> bool:
    """Whether `group` writes all of the parameter (so its old values need not be read)."""
    shards = {update.shard for update in group}
    return None in shards or slot.shards <= shards


def _pack_into(packed: torch.Tensor, dense: torch.Tensor) -> None:
    """Write `dense` into the oneDNN-packed `packed` in place: as a plain-layout oneDNN tensor, which `copy_`
    reorders into `packed`'s layout (for SmolLM2's linear weights 2.4x faster than `_reorder_linear_weight` into a
    new tensor, whose reorder alone took 8x a memory copy). float32 values become that tensor in `packed`'s dtype in
    one pass (oneDNN rounds to nearest even, as `Tensor.to` does): 1.6x faster than converting first."""
    dense = dense.to(device="cpu").contiguous()
    if dense.dtype == torch.float32:
        packed.copy_(dense.to_mkldnn(packed.dtype))
    else:
        packed.copy_(dense.to(packed.dtype).to_mkldnn())


class _Staging:
    """Dense buffers the loaders write packed parameters' new values into, one per shape and dtype, reused from one
    parameter to the next (most layers have the same shapes)."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}

    def dense(self, slot: WeightSlot) -> torch.Tensor:
        key = (tuple(slot.shape), slot.dtype)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(slot.shape, dtype=slot.dtype)
        return self.buffers[key]


def _write_packed(slot: WeightSlot, packed: nn.Parameter, group: list[_Update], staging: _Staging) -> None:
    """A oneDNN-packed parameter: the loaders write a dense copy (of the old values, unless they write all of it),
    which is packed into it."""
    if len(group) == 1 and group[0].shard is None and slot.loader == getattr(slot.module, "weight_loader", None) \
            and isinstance(slot.module, LinearBase) and slot.module.tp_size == 1:
        _pack_into(packed, group[0].tensor)  # a whole unsharded linear weight: packed as it is (shape checked)
        return
    if _covers(slot, group):
        dense = staging.dense(slot)
    else:
        dense = packed.to_dense()
    for update in group:
        slot.loader(dense, update.tensor, *shard_args(update.shard))
    _pack_into(packed, dense)


def _write_packed_experts(slot: WeightSlot, experts: nn.ParameterList, group: list[_Update]) -> None:
    """Experts packed one by one (CPU): a dense stack of them (of the old values, unless the update writes all of
    them), the loaders write into it, and the experts updated are packed again."""
    if _covers(slot, group):
        dense, changed = torch.empty(slot.shape, dtype=slot.dtype), range(len(experts))
    else:
        dense = torch.stack([expert.to_dense() for expert in experts])
        changed = sorted({update.shard[0] for update in group})
    for update in group:
        slot.loader(dense, update.tensor, *shard_args(update.shard))
    for e in changed:
        _pack_into(experts[e], dense[e])


def _write_ggml(slot: WeightSlot, value: GGMLWeight | nn.ModuleList, group: list[_Update],
                record: LoadRecord) -> None:
    """Each update quantized into the type its rows were loaded in and given to the loader, which slices it and keeps
    its rows aside (`ggml_parts`, as at load); the rows are then written over the weight's own."""
    stand_in = torch.empty(slot.shape, dtype=slot.dtype, device="meta")
    parts = slot.module.ggml_parts
    try:
        for update in group:
            for shard, piece in _ggml_pieces(slot, update):
                qtype = record.ggml_types[update.slot, shard]
                slot.loader(stand_in, requantize(piece, qtype), *shard_args(shard))
        if isinstance(value, GGMLWeight):
            for start, rows in parts:
                value.write_rows(start, rows)
        else:  # experts, one GGMLWeight each
            for expert, expert_parts in zip(value, parts[slot.attr]):
                for start, rows in expert_parts:
                    expert.write_rows(start, rows)
    finally:
        for kept in parts[slot.attr] if isinstance(parts, dict) else [parts]:
            kept.clear()


# -- sleep mode: weights given back and taken again (`LLM.sleep`, `LLM.wake_up`) --


def model_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's weights (its parameters, oneDNN-packed ones included, and the blocks of its GGML weights) and its
    other buffers (rotary tables, computed from the config), each by its name, each tensor once."""
    weights = dict(model.named_parameters())
    buffers = {}
    for name, buffer in model.named_buffers():
        module = model.get_submodule(name.rpartition(".")[0])
        (weights if isinstance(module, GGMLWeight) else buffers)[name] = buffer
    return weights, buffers


def _empty(tensor: torch.Tensor) -> None:
    """Give `tensor`'s memory back: its storage becomes an empty one (the object itself stays wherever the model
    holds it, so ties and lists of parameters keep pointing at it)."""
    empty = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    tensor.data = empty.to_mkldnn() if tensor.is_mkldnn else empty


def release_weights(model: nn.Module) -> None:
    """Every weight of `model` emptied (its buffers kept)."""
    for tensor in model_tensors(model)[0].values():
        _empty(tensor)


@dataclass
class _Stowed:
    """One tensor of the model while the engine sleeps: its values in host memory (`host`), or dropped (None)."""

    tensor: torch.Tensor
    shape: torch.Size
    packed: bool
    host: torch.Tensor | None


class StowedWeights:
    """A model's memory while the engine sleeps. Weights are kept in host memory (`keep`: sleep level 1 on CUDA) or
    dropped (level 2); buffers are kept, in host memory when the model is on a GPU, as vLLM keeps them. Each tensor
    is emptied where it is (`_empty`), so every reference the model holds stays valid; `wake` fills the same
    objects again: kept values copied back to the device, dropped weights zero-filled in their layout (a
    oneDNN-packed one packed), for `reload_weights` (`LLM.load_weights`) or `adopt_weights` to write."""

    def __init__(self, model: nn.Module, keep: bool, offload: bool | None = None):
        """`offload`: whether kept tensors move to host memory (default: those not on the CPU); those that do not move
        stay as they are (oneDNN-packed weights never move: they exist only on the CPU)."""
        weights, buffers = model_tensors(model)
        stowed = [self._stow(t, keep, offload) for t in weights.values()]
        stowed += [self._stow(t, True, offload) for t in buffers.values()]
        self.stowed = [s for s in stowed if s is not None]

    @staticmethod
    def _stow(tensor: torch.Tensor, keep: bool, offload: bool | None) -> _Stowed | None:
        if offload is None:
            offload = tensor.device.type != "cpu"
        if keep and (not offload or tensor.is_mkldnn):
            return None  # stays where it is
        host = None
        if keep:
            host = torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda)
            host.copy_(tensor)
        stowed = _Stowed(tensor, tensor.shape, tensor.is_mkldnn, host)
        _empty(tensor)
        return stowed

    @torch.no_grad()
    def wake(self, weights: bool = True) -> None:
        """Every stowed tensor filled again (with `weights=False`, the buffers only: the weights stay empty, for
        `adopt_weights`)."""
        for stowed in self.stowed:
            tensor, host = stowed.tensor, stowed.host
            if host is not None:
                tensor.data = torch.empty_like(host, device=tensor.device).copy_(host)
            elif weights:
                dense = torch.zeros(stowed.shape, dtype=tensor.dtype, device=tensor.device)
                tensor.data = torch.ops.mkldnn._reorder_linear_weight(dense) if stowed.packed else dense
        self.stowed = []


def adopt_weights(model: nn.Module, fresh: nn.Module) -> None:
    """`model`'s weights take the memory of `fresh`'s, a model built and loaded as `model` was (the checkpoint read
    again after a level-2 sleep): each tensor object of `model` stays, its storage becomes `fresh`'s (no copy: a GGUF
    file's blocks stay views of the file)."""
    weights, fresh_weights = model_tensors(model)[0], model_tensors(fresh)[0]
    if weights.keys() != fresh_weights.keys():
        differ = sorted(weights.keys() ^ fresh_weights.keys())
        raise RuntimeError(f"the reloaded model's weights are not the model's: {differ[:5]}")
    for name, tensor in weights.items():
        new = fresh_weights[name]
        if new.dtype != tensor.dtype or new.is_mkldnn != tensor.is_mkldnn:
            raise RuntimeError(f"the reloaded weight {name!r} is a {new.dtype} tensor, the model's a {tensor.dtype}")
        tensor.data = new.data


def written_shards(model: nn.Module, weights: list[tuple[str, torch.Tensor]],
                   hf_config: PretrainedConfig) -> dict[str, set]:
    """The parameters (the model's names) `reload_weights` writes for `weights`, and the shards of each it writes
    (None: all of it)."""
    shards: dict[str, set] = {}
    for update in _plan(model, weights, hf_config):
        shards.setdefault(update.slot, set()).add(update.shard)
    return shards


def unwritten_shards(model: nn.Module, written: dict[str, set]) -> dict[str, set]:
    """Of every parameter a load fills, the shards `written` leaves out (only the parameters with some left)."""
    record: LoadRecord = model.load_record
    left = {}
    for name, slot in record.slots.items():
        shards = written.get(name, set())
        if None not in shards and not slot.shards <= shards:
            left[name] = slot.shards - shards
    return left
