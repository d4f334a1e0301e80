"""nanovllm.ray on a local Ray cluster: the processor's rows equal LLM.generate's, and a killed actor is retried."""
import json
import os
import shutil

import pytest

ray = pytest.importorskip("ray", reason="needs the [ray] extra: pip install -e '.[ray]'")

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.ray import LLMProcessor, build_processor  # noqa: E402

pytestmark = pytest.mark.ray

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kvcache_block_size=16)
PARAMS = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
ROWS = [{"prompt": "Hello, my name is"}, {"prompt": [5, 6, 7, 8]},
        {"prompt": "The quick brown fox", "sampling_params": {"max_tokens": 3}},
        {"prompt": [9, 10, 11], "sampling_params": {"temperature": 0.8, "seed": 4}}] * 3
ROWS = [{"id": i, **row} for i, row in enumerate(ROWS)]
CHATS = [{"id": i, "messages": [{"role": "user", "content": text}]} for i, text in enumerate(["Hi", "Bye there"])]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def expected(tied_model) -> list:
    with LLM(tied_model, **ENGINE) as llm:
        params = [SamplingParams(**{**PARAMS, **row.get("sampling_params", {})}) for row in ROWS]
        return llm.generate([row["prompt"] for row in ROWS], params, use_tqdm=False)


def run(model: str, items: list[dict], processor: type[LLMProcessor] = LLMProcessor) -> list[dict]:
    process = build_processor(model, concurrency=2, batch_size=3, num_cpus=1, engine_kwargs=ENGINE,
                              sampling_params=PARAMS, processor=processor)
    return sorted(process(ray.data.from_items(items, override_num_blocks=4)).take_all(), key=lambda row: row["id"])


def assert_rows_equal(results: list[dict], expected: list) -> None:
    assert [row["id"] for row in results] == list(range(len(expected)))
    for row, out in zip(results, expected):
        completion = out.outputs[0]
        assert list(row["generated_tokens"]) == completion.token_ids
        assert row["generated_text"] == completion.text and row["finish_reason"] == completion.finish_reason
        assert row["num_input_tokens"] == len(out.prompt_token_ids)
        assert row["num_generated_tokens"] == len(completion.token_ids)


@pytest.fixture(scope="module")
def chat_model(tied_model, tmp_path_factory) -> str:
    """The tiny checkpoint with a chat template."""
    path = shutil.copytree(tied_model, tmp_path_factory.mktemp("chat") / "model")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def test_the_processor_equals_generate_on_the_same_rows(cluster, tied_model, chat_model, expected):
    assert_rows_equal(run(tied_model, ROWS), expected)
    with LLM(chat_model, **ENGINE) as llm:
        replies = llm.chat([row["messages"] for row in CHATS], SamplingParams(**PARAMS), use_tqdm=False)
    assert_rows_equal(run(chat_model, CHATS), replies)


def test_a_killed_actor_is_restarted_and_its_batch_retried(cluster, tied_model, expected, tmp_path):
    marker = str(tmp_path / "killed")

    class DiesOnce(LLMProcessor):  # defined here, so Ray ships it by value
        def __call__(self, batch):
            if not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)  # the actor's process dies mid-batch, as on a lost machine
            return super().__call__(batch)

    assert_rows_equal(run(tied_model, ROWS, DiesOnce), expected)
    assert os.path.exists(marker), "an actor was killed"
