import pytest

from checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def tied_model(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen3-tied")), tie_word_embeddings=True, seed=0)


@pytest.fixture(scope="session")
def untied_model(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen3-untied")), tie_word_embeddings=False, seed=1,
                           hub_style=False, rope_theta=5e5, max_shard_size="100KB")


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `cuda` need a GPU: skip them cleanly where none is visible."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
