"""Tensors made the way the engine needs them: host data on the device without blocking, and zeros that cost host
memory only where they are written."""
import math
import mmap

import torch


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`; on CUDA through pinned memory, so the copy does not block the host."""
    return torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros on `device`. On the CPU they live in an anonymous memory map, whose pages read as zeros and take memory
    only once written: a KV cache sized for the worst case costs the blocks actually used (torch.zeros writes every
    page up front). The map is released with the tensor."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=dtype).view(shape)
