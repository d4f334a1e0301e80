import torch.distributed as dist


def tp_rank_and_size() -> tuple[int, int]:
    """This process's tensor-parallel rank and the group size; (0, 1) when not distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
