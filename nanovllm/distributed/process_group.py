"""The tensor-parallel group this process belongs to.

Layers shard themselves by `tp_rank_and_size()`, which reflects only a group joined through
`join_tp_group`: a process group the user initialized for other purposes (under torchrun, say)
never makes a single-process engine shard its layers.

Two timeouts: the group is joined, and the engine started (model loading, KV-cache sizing, warm-up), under a long
start timeout, since a worker may take seconds just to import torch on a busy machine; `finish_start` then meets
every rank once more and sets the timeout a collective may wait for a peer that stopped answering.

A collective whose peer died or froze ends one of two ways: gloo fails it as soon as the peer's connection closes;
NCCL waits on the device until the timeout, then torch's own watchdog tears the whole process down (its default,
`TORCH_NCCL_ASYNC_ERROR_HANDLING=3`): rank 0 is the user's process, so the supervisor aborts the group first
(`abort_tp_group`).
"""
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

_rank, _size = 0, 1
_lock = threading.Lock()  # leaving and aborting the group come from different threads (a step's error, a watchdog)


def join_tp_group(backend: str, store: dist.Store, rank: int, world_size: int, start_timeout: timedelta) -> None:
    global _rank, _size
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=start_timeout)
    _rank, _size = rank, world_size


def finish_start(collective_timeout: timedelta) -> None:
    """Wait until every rank has started (under the start timeout), then bound later collectives by
    `collective_timeout`."""
    if _size > 1:
        dist.barrier()
        dist.group.WORLD.set_timeout(collective_timeout)


def leave_tp_group() -> None:
    global _rank, _size
    with _lock:
        if _size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        _rank, _size = 0, 1


def abort_tp_group() -> bool:
    """End this rank's pending collectives now, once its peers are gone (killed by the supervisor): on NCCL by
    aborting the communicators (torch's `_abort_process_group`), whose kernels then return with whatever their
    buffers hold, so the step that ran them must be failed by its caller (`leave_tp_group` then has nothing to
    destroy). Gloo has failed them already: nothing to do. Returns whether it aborted."""
    with _lock:
        if _size == 1 or not dist.is_initialized() or dist.get_backend() != "nccl":
            return False
        dist.distributed_c10d._abort_process_group()
        return True


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
