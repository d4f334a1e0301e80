"""For the CUDA tests: which attention backends can run on this GPU."""
import pytest
import torch

from nanovllm.kernels.attention import ATTENTION_BACKENDS, Backend, Platform, load_backend, unsupported

BACKENDS = ATTENTION_BACKENDS[1:]


def require_backend(name: str, dtype: torch.dtype, block_size: int, head_dim: int,
                    kv_cache_dtype: torch.dtype | None = None) -> Backend:
    """Backend `name` as the engine would load it on this GPU; skips the test where it cannot run."""
    platform = Platform.probe("cuda")
    reason = unsupported(name, platform, dtype, block_size, head_dim, kv_cache_dtype)
    if reason is not None:
        pytest.skip(f"{name} {reason}")
    try:
        return load_backend(name, platform)
    except ModuleNotFoundError as e:
        pytest.skip(f"{name}: {e}")
