"""vLLM V1's custom logits processors, the interface: what a processor class implements (`LogitsProcessor`), what it
is told before each step (`BatchUpdate`), vLLM's helpers for writing one (`process_dict_updates`,
`AdapterLogitsProcessor` for per-request callables), and the loading of the classes `LLM(logits_processors=[...])`
names. Pure Python: the sampler keeps the batch the processors see and calls them
(`nanovllm.execution.logits_processors`); `nanovllm.v1.sample.logits_processor` gives these names under vLLM's module
path, so code written for vLLM runs with `vllm` replaced by `nanovllm` in its imports.

A processor's `apply(logits)` gets float32 logits `[batch_size, vocab]` whose row i is the request at index i of the
batch, as `update_state` last described it. Every step, before its logits are processed, each processor's
`update_state` is called: with a `BatchUpdate` when the batch changed (requests removed, added, moved between
indices), else with None. Apply a `BatchUpdate` in this order: `removed`, then `added`, then `moved`; an added or
moved request may take an index that held another request, which is then gone (`process_dict_updates` does all of
it for a dict from index to per-request state)."""
import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from functools import lru_cache, partial
from typing import TYPE_CHECKING, TypeVar

from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from nanovllm.config import VllmConfig


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # the request at index a moves to index b; a is left empty
    SWAP = auto()  # the requests at a and b trade places


RemovedRequest = int
"""The index of a request that left the batch."""
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
"""(index, params, prompt token ids, output token ids) of a request that joined the batch. The output token ids are
the request's own list, which grows as its tokens arrive: a processor may keep it and read it at any later step."""
MovedRequest = tuple[int, int, MoveDirectionality]
"""(index a, index b, how) of a request moved within the batch."""


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the previous step: its size now (its indices are 0 to `batch_size` - 1), and the
    requests removed (in descending order), added and moved, to be applied in that order."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """vLLM V1's batch-level logits processor. One instance per engine, built on the device that samples as
    `cls(vllm_config, device, is_pin_memory)` (`vllm_config`: `nanovllm.config.VllmConfig`). Processors that can
    change which token is the most likely (`is_argmax_invariant()` False) run on every row before penalties and
    sampling; argmax-invariant ones run only in steps that sample at temperature > 0, after temperature and min-p, on
    the rows' scaled logits (a greedy row's token is the argmax before them)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise a ValueError for sampling params (`extra_args`, say) this processor cannot serve; called for every
        request when it is submitted, before any work."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: "VllmConfig", device: "torch.device", is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: "torch.Tensor") -> "torch.Tensor":
        """The processed logits: `logits` changed in place, or a new tensor of the same shape."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when `apply` never changes a row's most likely token (then greedy rows skip it)."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called once per step before `apply`, with how the batch changed (None: it did not)."""
        raise NotImplementedError


RequestLogitsProcessor = (Callable[[list[int], "torch.Tensor"], "torch.Tensor"]
                          | Callable[[list[int], list[int], "torch.Tensor"], "torch.Tensor"])
"""A per-request logits processor (vLLM's `vllm.logits_process.LogitsProcessor`): called with the request's output
token ids (or its prompt token ids and output token ids) and its row of logits `[vocab]`; returns the row."""

T = TypeVar("T")


def process_dict_updates(req_entries: dict[int, T], batch_update: BatchUpdate | None,
                         new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None]) -> bool:
    """Apply `batch_update` to `req_entries`, a processor's per-request state by batch index: an added request gets
    `new_state(params, prompt_token_ids, output_token_ids)` (None: the processor leaves it alone), removed ones are
    dropped, moved ones follow their request. Returns whether `req_entries` changed."""
    if not batch_update:
        return False
    updated = False
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[index] = state
            updated = True
        elif req_entries.pop(index, None) is not None:
            updated = True
    if not req_entries:
        return updated
    for index in batch_update.removed:
        if req_entries.pop(index, None) is not None:
            updated = True
    for a, b, how in batch_update.moved:
        entry_a, entry_b = req_entries.pop(a, None), req_entries.pop(b, None)
        if entry_a is not None:
            req_entries[b] = entry_a
            updated = True
        if entry_b is not None:
            updated = True
            if how == MoveDirectionality.SWAP:
                req_entries[a] = entry_b
    return updated


class AdapterLogitsProcessor(LogitsProcessor):
    """A batch-level processor made of per-request ones (vLLM's adapter): a subclass implements
    `is_argmax_invariant()` and `new_req_logits_processor(params)`, which returns a request's
    `RequestLogitsProcessor` (None: the request is left alone). Each step the request's callable gets its output
    token ids so far (and its prompt token ids, when it takes three arguments) and its row of logits. A subclass that
    overrides `__init__` calls `super().__init__(vllm_config, device, is_pin_memory)`."""

    def __init__(self, vllm_config: "VllmConfig", device: "torch.device", is_pin_memory: bool):
        # batch index -> the request's callable, its token lists bound (the live output list: it sees each new token)
        self.req_info: dict[int, partial] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The request's per-request logits processor, or None to leave it alone."""
        raise NotImplementedError

    def _new_state(self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> partial | None:
        processor = self.new_req_logits_processor(params)
        if processor is None:
            return None
        takes_prompt = len(inspect.signature(processor).parameters) == 3
        return partial(processor, prompt_ids, output_ids) if takes_prompt else partial(processor, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: "torch.Tensor") -> "torch.Tensor":
        for index, processor in self.req_info.items():
            row = logits[index]
            new_row = processor(row)
            if new_row is not row:
                logits[index] = new_row
        return logits


def load_logits_processor_classes(entries: Sequence | None) -> tuple[type[LogitsProcessor], ...]:
    """The classes `LLM(logits_processors=...)` names, in order: each entry a `LogitsProcessor` subclass, or its
    "module:Class" name (imported here; "module:Outer.Inner" for a nested class). A ValueError names an entry that
    cannot be loaded or is not such a class."""
    return _load_classes(tuple(entries or ()))


@lru_cache(maxsize=None)
def _load_classes(entries: tuple) -> tuple[type[LogitsProcessor], ...]:
    classes = []
    for i, entry in enumerate(entries):
        found = entry
        if isinstance(entry, str):
            module_name, _, qualname = entry.partition(":")
            try:
                found = importlib.import_module(module_name)
                for name in qualname.split("."):
                    found = getattr(found, name)
            except Exception as e:
                raise ValueError(f"logits_processors[{i}] {entry!r} cannot be loaded ({type(e).__name__}: {e}); a "
                                 "name is 'module:Class', the module importable") from e
        if not (isinstance(found, type) and issubclass(found, LogitsProcessor)):
            raise ValueError(f"logits_processors[{i}] ({entry!r}) must be a subclass of LogitsProcessor (from "
                             f"nanovllm.v1.sample.logits_processor import LogitsProcessor), got {found!r}")
        classes.append(found)
    return tuple(classes)


def validate_logits_processors_parameters(entries: Sequence | None, params: SamplingParams) -> None:
    """Every custom logits processor's `validate_params(params)`, at a request's submission: a ValueError refuses
    it."""
    for cls in load_logits_processor_classes(entries):
        cls.validate_params(params)
