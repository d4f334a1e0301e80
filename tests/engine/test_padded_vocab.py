"""A vocabulary padded past the tokenizer (as Qwen2/Qwen3 checkpoints have it): the ids the tokenizer does not know
decode to empty text, in prompts and samples, and never take down a batch."""
import pytest
from checkpoints import make_checkpoint
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("padded")), vocab_size=512, initializer_range=0.02)


def test_unknown_ids_sampled_or_prompted_decode_to_empty_text(padded_model):
    tokenizer = AutoTokenizer.from_pretrained(padded_model)
    known = len(tokenizer)
    assert known < 512
    prompts = ["Hello, my name is", [5, 6, 7, known + 3, 8], [known, known + 1]]
    params = SamplingParams(temperature=1.0, max_tokens=48, seed=7, ignore_eos=True, logprobs=2)
    with LLM(padded_model, device="cpu", dtype="float32", max_model_len=128) as llm:
        outputs = llm.generate(prompts * 3, params, use_tqdm=False)
        streamed = {}
        for delta in llm.stream(prompts, params):
            streamed[delta.request_id] = streamed.get(delta.request_id, "") + delta.outputs[0].text
        stats = llm.stats()
    sampled = [t for o in outputs for t in o.outputs[0].token_ids]
    assert any(t >= known for t in sampled), "no padded id was sampled; raise max_tokens"
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "length" and len(completion.token_ids) == 48
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        for token_id, step in zip(completion.token_ids, completion.logprobs):
            if token_id >= known:
                assert step[token_id].decoded_token == ""
            elif not tokenizer.decode([token_id]).endswith("\ufffd"):  # a byte of a character: vLLM's rule
                assert step[token_id].decoded_token == tokenizer.decode([token_id])  # (tests/engine/test_detokenizer)
    assert list(streamed.values()) == [o.outputs[0].text for o in outputs[:3]]
    assert stats["num_free_blocks"] == stats["num_blocks"]
