import torch
import torch.distributed as dist


def tp_rank_and_size() -> tuple[int, int]:
    """This process's tensor-parallel rank and the group size; (0, 1) when not distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest `value` across the tensor-parallel group (e.g. KV blocks every rank can hold)."""
    if tp_rank_and_size()[1] == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
