"""The engine's LoRA adapters: read on first use into an LRU of `max_cpu_loras` (pinned ones never leave), and each
step's tokens mapped to their adapters for the adapted layers (`nanovllm.layers.lora`). How many adapters one step runs
(`max_loras`) is the scheduler's rule; an adapter the LRU dropped while its requests waited is read again when they
run."""
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.distributed.process_group import tp_rank_and_size
from nanovllm.kernels.cpu import cpu_kernels
from nanovllm.layers.lora import STACKED_ROWS, LoRALayer, LoRAStep, LoRAWeights, clear_lora_step, set_lora_step
from nanovllm.lora.gguf_adapter import gguf_adapter_file, read_gguf_adapter
from nanovllm.lora.peft import PeftAdapter, read_peft_adapter
from nanovllm.lora.request import LoRARequest
from nanovllm.lora.targets import adapter_weights, attach_lora_layers


def describe(request: LoRARequest) -> str:
    return f"{request.lora_name!r} (lora_int_id={request.lora_int_id}, lora_path={request.lora_path!r})"


class LoRAManager:
    """Adapters for `model` (of `hf_config`; its projections given `LoRALayer`s here), at most `max_cpu_loras` kept
    loaded, ranks up to `max_lora_rank`, weights in `dtype` on `device` (this tensor-parallel rank's share). An adapter
    id names one adapter path for the engine's life (the prefix cache keys K/V by the id)."""

    def __init__(self, model: nn.Module, hf_config: PretrainedConfig, max_cpu_loras: int, max_lora_rank: int,
                 dtype: torch.dtype, device: torch.device, max_loras: int = 1, graph_rows: int = 0):
        """`max_loras`: the most adapters a step has; on CUDA the layers add their deltas with Triton (`use_triton`,
        `graph_rows`: the largest CUDA graph's rows)."""
        self.model, self.hf_config = model, hf_config
        self.kernel = device.type == "cpu" and cpu_kernels() is not None
        self.layers = attach_lora_layers(model, self.kernel)
        self.capacity, self.max_rank, self.dtype, self.device = max_cpu_loras, max_lora_rank, dtype, device
        self.max_loras = max_loras
        self.triton = False
        self.graph_rows = torch.empty(0, dtype=torch.int64)
        if device.type == "cuda":
            self.use_triton(graph_rows)
        self.requests: dict[int, LoRARequest] = {}
        self.loaded: OrderedDict[int, dict[LoRALayer, LoRAWeights]] = OrderedDict()  # least recently used first
        self.pinned: set[int] = set()
        self.num_loads = 0
        self.tp_rank, self.tp_size = tp_rank_and_size()

    def use_triton(self, graph_rows: int) -> None:
        """Add the deltas with the Triton kernels (`LoRALayer.bind_slots`: room for `max_loras` adapters), the slots
        of the rows of a step of up to `graph_rows` rows (a CUDA graph's) in one buffer (`capturing`). On CUDA; the
        tests call it on the CPU too, under Triton's interpreter."""
        try:
            for layer in self.layers.values():
                layer.bind_slots(self.max_loras, self.max_rank, self.dtype, self.device)
        except ImportError:
            raise ValueError("LoRA on CUDA adds its deltas with Triton, which does not import here; install it "
                             "(pip install triton)") from None
        self.triton = True
        self.graph_rows = torch.full((graph_rows,), self.max_loras, dtype=torch.int64, device=self.device)

    def add(self, request: LoRARequest) -> bool:
        """Make sure `request`'s adapter is loaded (read now unless it is); whether it was read. A ValueError or
        FileNotFoundError naming the adapter when it cannot run: not a LoRARequest, an id already given to another
        path, a missing path, a rank above `max_lora_rank`, projections this model lacks or shaped for another
        model."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a nanovllm.lora.request.LoRARequest (or None), got "
                             f"{type(request).__name__}")
        known = self.requests.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            raise ValueError(f"LoRA adapter {describe(request)}: lora_int_id {request.lora_int_id} already names "
                             f"{describe(known)}; give each adapter its own lora_int_id")
        if request.lora_int_id in self.loaded:
            self.loaded.move_to_end(request.lora_int_id)
            return False
        self._load(request, keep=())
        self.requests[request.lora_int_id] = request
        return True

    def _load(self, request: LoRARequest, keep: set[int] | tuple) -> None:
        label = describe(request)
        weights = adapter_weights(self._read(request.lora_path, label), self.model, self.layers, label,
                                  self.max_rank, self.dtype, self.device, self.tp_rank, self.tp_size)
        if self.triton:
            for layer, layer_weights in weights.items():
                if (overflow := layer.overflow(layer_weights)) is not None:
                    raise ValueError(f"LoRA adapter {label}: {overflow} (adapt each projection once: q_proj, k_proj "
                                     "and v_proj, or qkv_proj)")
        for layer, layer_weights in weights.items():
            layer.add_adapter(request.lora_int_id, layer_weights)
        self.loaded[request.lora_int_id] = weights
        self.num_loads += 1
        self._evict(keep)

    def _read(self, path: str, label: str) -> PeftAdapter:
        """The adapter at `path`: a llama.cpp LoRA GGUF file (or a directory holding one and no adapter_config.json),
        else a PEFT directory."""
        gguf_file = gguf_adapter_file(path, label)
        return read_peft_adapter(path, label, self.model.checkpoint_weights) if gguf_file is None else \
            read_gguf_adapter(gguf_file, label, self.hf_config)

    def _evict(self, keep: set[int] | tuple) -> None:
        """Unload the least recently used adapters past the capacity, never a pinned one nor one in `keep`."""
        while len(self.loaded) > self.capacity:
            victim = next((i for i in self.loaded if i not in self.pinned and i not in keep), None)
            if victim is None:
                return
            self._unload(victim)

    def _unload(self, lora_id: int) -> None:
        for layer in self.loaded.pop(lora_id):
            layer.remove_adapter(lora_id)

    def remove(self, lora_id: int) -> bool:
        """Unload an adapter (its requests, if any, read it again when they run); whether it was loaded."""
        self.pinned.discard(lora_id)
        if lora_id not in self.loaded:
            return False
        self._unload(lora_id)
        return True

    def pin(self, lora_id: int) -> bool:
        """Keep a loaded adapter loaded whatever the LRU says (vLLM's `pin_lora`)."""
        if lora_id not in self.loaded:
            raise ValueError(f"pin_lora: LoRA adapter {lora_id} is not loaded; add_lora() it (or run a request with "
                             "it) first")
        self.pinned.add(lora_id)
        return True

    def loaded_ids(self) -> set[int]:
        """The ids of the adapters loaded now."""
        return set(self.loaded)

    def start_step(self, rows: list[tuple[int, int]]) -> None:
        """Map the step's rows to adapters (`nanovllm.layers.lora.LoRAStep`: by slot for the CPU kernel and Triton,
        else stacked or grouped by the step's size): `rows` is each sequence's (adapter id, 0 for the base; its row
        count), in the order its rows are packed. The step's adapters are loaded first (read again if the LRU dropped
        them), and for Triton put in the layers' slots."""
        ids = {lora_id for lora_id, _ in rows if lora_id}
        for lora_id in ids & self.loaded.keys():
            self.loaded.move_to_end(lora_id)
        for lora_id in ids - self.loaded.keys():
            self._load(self.requests[lora_id], keep=ids)
        adapters = tuple(sorted(ids))
        total = sum(count for _, count in rows)
        if self.triton:
            for layer in self.layers.values():
                layer.load_slots(adapters)
        if not adapters:
            step = LoRAStep()
        elif self.kernel or self.triton or total <= STACKED_ROWS:
            position = {lora_id: i for i, lora_id in enumerate(adapters)}
            index = torch.tensor([position.get(lora_id, len(adapters)) for lora_id, count in rows
                                  for _ in range(count)], dtype=torch.int64)
            if self.triton and total <= self.graph_rows.numel():
                self.graph_rows[:total].copy_(index)
                self.graph_rows[total:] = self.max_loras
                index = self.graph_rows
            step = LoRAStep(adapters, index.to(self.device))
        else:
            groups: dict[int, list[int]] = {}
            first = 0
            for lora_id, count in rows:
                if lora_id:
                    groups.setdefault(lora_id, []).extend(range(first, first + count))
                first += count
            step = LoRAStep(groups=[(lora_id, None if len(indices) == total else
                                     torch.tensor(indices, dtype=torch.int64, device=self.device))
                                    for lora_id, indices in groups.items()])
        set_lora_step(step)

    def end_step(self) -> None:
        clear_lora_step()

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """While CUDA graphs are captured: the layers' kernels read each row's slot from the buffer that `start_step`
        fills for steps of up to `graph_rows` rows (a step without adapters empties the layers' slots instead)."""
        set_lora_step(LoRAStep(token_index=self.graph_rows))
        try:
            yield
        finally:
            clear_lora_step()
