import os
from pathlib import Path

import pytest
from checkpoints import LLAMA3_ROPE, make_checkpoint

MOCK_CUDA = "NANOVLLM_TEST_CUDA_DEVICES"
"""Set to N on a machine without a GPU to run the suite as a machine with N GPUs would see it, CUDA itself aside:
torch reports N devices, and the tests that need a real GPU (marked `cuda`) are skipped. No other test may depend on
how many GPUs there are: each pins its device or says what it needs."""


def pytest_configure(config) -> None:
    count = os.environ.get(MOCK_CUDA)
    if count is None:
        return
    import torch

    if torch.cuda.is_available():
        raise pytest.UsageError(f"{MOCK_CUDA} mocks GPUs on a machine without one; this one has a GPU")
    torch.cuda.is_available = lambda: int(count) > 0
    torch.cuda.device_count = lambda: int(count)
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_name = lambda device=None: f"mocked GPU ({MOCK_CUDA}={count})"


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    """`NANOVLLM_CACHE` in the test's own folder, for the metadata of the files it makes, sharing the built CPU kernels
    through a link: a process started there (a tensor-parallel worker) would otherwise build them again (~20 s)."""
    from nanovllm.cache import cache_dir

    shared = cache_dir() / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    private = tmp_path / "cache"
    private.mkdir(exist_ok=True)
    (private / "kernels").symlink_to(shared, target_is_directory=True)
    monkeypatch.setenv("NANOVLLM_CACHE", str(private))
    return private


@pytest.fixture(scope="session")
def tied_model(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen3-tied")), tie_word_embeddings=True, seed=0)


@pytest.fixture(scope="session")
def untied_model(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen3-untied")), tie_word_embeddings=False, seed=1,
                           hub_style=False, rope_theta=5e5, max_shard_size="100KB")


@pytest.fixture(scope="session")
def llama_tied_model(tmp_path_factory) -> str:
    """Llama 3.1 style: llama3 rope scaling (within the tests' prompt lengths), hub-style config."""
    return make_checkpoint(str(tmp_path_factory.mktemp("llama-tied")), family="llama", tie_word_embeddings=True,
                           seed=2, rope_theta=5e5, rope_scaling=LLAMA3_ROPE)


@pytest.fixture(scope="session")
def llama_untied_model(tmp_path_factory) -> str:
    """Llama with every optional bias (attention and MLP), untied head, transformers-5 style config."""
    return make_checkpoint(str(tmp_path_factory.mktemp("llama-untied")), family="llama", tie_word_embeddings=False,
                           seed=3, hub_style=False, attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="session")
def qwen2_model(tmp_path_factory) -> str:
    """Qwen2/2.5: q/k/v biases, no q/k norm, untied head."""
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen2")), family="qwen2", tie_word_embeddings=False, seed=4)


@pytest.fixture(scope="session")
def gpu_model(tmp_path_factory) -> str:
    """For the CUDA tests: head_dim 64 suits every attention backend (flash-attn needs a multiple of 8)."""
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen3-gpu")), hidden_size=128, num_heads=4, num_kv_heads=2,
                           head_dim=64, intermediate_size=256, max_position_embeddings=1024, seed=3)


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `cuda` need a GPU: skip them cleanly where none is visible (or where GPUs are mocked)."""
    import torch

    if torch.cuda.is_available() and MOCK_CUDA not in os.environ:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False, or GPUs are mocked)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
