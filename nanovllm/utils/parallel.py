"""The tensor-parallel group this process belongs to.

Layers shard themselves by `tp_rank_and_size()`, which reflects only a group joined through
`join_tp_group`: a process group the user initialized for other purposes (under torchrun, say)
never makes a single-process engine shard its layers.
"""
from datetime import timedelta

import torch
import torch.distributed as dist

_rank, _size = 0, 1


def join_tp_group(backend: str, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> None:
    global _rank, _size
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    _rank, _size = rank, world_size


def leave_tp_group() -> None:
    global _rank, _size
    if _size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _rank, _size = 0, 1


def tp_rank_and_size() -> tuple[int, int]:
    """This process's tensor-parallel rank and the group size; (0, 1) outside a tensor-parallel group."""
    return _rank, _size


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest `value` across the tensor-parallel group (e.g. KV blocks every rank can hold)."""
    if _size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
