"""Host data on the device without blocking the host."""
import torch


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`; on CUDA through pinned memory, so the copy does not block the host."""
    return torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)
