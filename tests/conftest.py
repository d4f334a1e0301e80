import pytest

from checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def tied_model(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen3-tied")), tie_word_embeddings=True, seed=0)


@pytest.fixture(scope="session")
def untied_model(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen3-untied")), tie_word_embeddings=False, seed=1,
                           hub_style=False, rope_theta=5e5, max_shard_size="100KB")
