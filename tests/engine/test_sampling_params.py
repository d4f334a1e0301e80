"""SamplingParams: vLLM's defaults, and a ValueError naming the field, the value and the valid range for bad input;
the input errors vLLM's offline tests match, in vLLM's words; RequestOutput's dict access."""
import re
from dataclasses import asdict

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.outputs import CompletionOutput, RequestOutput

VLLM_DEFAULTS = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": None, "stop": [],
                 "stop_token_ids": [], "include_stop_str_in_output": False, "max_tokens": 16, "min_tokens": 0,
                 "ignore_eos": False, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                 "logprobs": None, "skip_special_tokens": True, "spaces_between_special_tokens": True,
                 "prompt_logprobs": None, "flat_logprobs": False, "detokenize": True,
                 "allowed_token_ids": None, "bad_words": None, "structured_outputs": None, "best_of": None,
                 "extra_args": None}


def test_defaults_are_vllms():
    fields = asdict(SamplingParams())
    assert fields.pop("bad_words_token_ids") == []  # filled in by the engine
    assert fields == VLLM_DEFAULTS


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 0}, r"n must be an integer >= 1, got 0"),
    ({"n": True}, r"n must be an integer"),
    ({"temperature": -0.5}, r"temperature must be a number >= 0 \(0 is greedy\), got -0.5"),
    ({"temperature": float("inf")}, r"temperature must be a number"),
    ({"top_p": 0}, r"top_p must be a number in \(0, 1\], got 0"),
    ({"top_p": 1.01}, r"top_p must be a number in \(0, 1\], got 1.01"),
    ({"top_p": float("nan")}, r"top_p must be"),
    ({"top_k": -2}, r"top_k must be an integer >= 1, or -1 or 0 for all tokens, got -2"),
    ({"top_k": 2.0}, r"top_k must be an integer"),
    ({"top_k": True}, r"top_k must be an integer"),
    ({"min_p": 1.5}, r"min_p must be a number in \[0, 1\], got 1.5"),
    ({"min_p": -0.1}, r"min_p must be a number in \[0, 1\]"),
    ({"seed": 1.5}, r"seed must be an integer in \[-2\*\*63, 2\*\*64\), or None, got 1.5"),
    ({"seed": False}, r"seed must be an integer"),
    ({"seed": 2**64}, r"seed must be an integer"),
    ({"stop": ["ok", 3]}, r"stop must be a non-empty string or a list of non-empty strings, got \['ok', 3\]"),
    ({"stop": ""}, r"stop must be a non-empty string"),
    ({"stop": ["a", ""]}, r"stop must be a non-empty string"),
    ({"stop": 5}, r"stop must be"),
    ({"stop_token_ids": [1, -2]}, r"stop_token_ids must be a list of token ids \(integers >= 0\), got \[1, -2\]"),
    ({"max_tokens": 0}, r"max_tokens must be an integer >= 1, or None \(up to max_model_len\), got 0"),
    ({"logprobs": -2}, r"logprobs must be an integer >= 0, -1 for the whole vocabulary, or None, got -2"),
    ({"prompt_logprobs": 1.5}, r"prompt_logprobs must be an integer"),
    ({"detokenize": 1}, r"detokenize must be True or False"),
    ({"detokenize": False, "stop": "x"}, r"stop strings need the text: they cannot be used with detokenize=False"),
    ({"allowed_token_ids": []}, r"allowed_token_ids must not be empty"),
    ({"allowed_token_ids": [1, "a"]}, r"allowed_token_ids must be a list of token ids"),
    ({"bad_words": "word"}, r"bad_words must be a list of non-empty strings, got 'word'"),
    ({"stop_token_ids": 7}, r"stop_token_ids must be a list"),
    ({"stop_token_ids": [True]}, r"stop_token_ids must be a list"),
    ({"include_stop_str_in_output": 1}, r"include_stop_str_in_output must be True or False, got 1"),
    ({"min_tokens": -1}, r"min_tokens must be an integer >= 0, got -1"),
    ({"min_tokens": 20}, r"min_tokens must be at most max_tokens, got min_tokens=20 and max_tokens=16"),
    ({"ignore_eos": "no"}, r"ignore_eos must be True or False"),
    ({"repetition_penalty": 0}, r"repetition_penalty must be a number > 0 \(1 is off\), got 0"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\], got 2.5"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be a number in \[-2, 2\], got -3"),
    ({"logprobs": True}, r"logprobs must be an integer"),
    ({"skip_special_tokens": None}, r"skip_special_tokens must be True or False"),
    ({"best_of": 0}, r"best_of must be an integer >= 1, or None, got 0"),
    ({"best_of": 2.0}, r"best_of must be an integer"),
    ({"n": 3, "best_of": 2}, r"best_of must be greater than or equal to n, got n=3 and best_of=2\."),  # vLLM's words
])
def test_bad_values_name_the_field_and_the_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_normalized_values():
    params = SamplingParams(temperature=1, top_k=0, stop="###", stop_token_ids=(3, 4), seed=-1, max_tokens=5,
                            min_tokens=5, logprobs=0)
    assert (params.temperature, params.top_k, params.stop, params.stop_token_ids) == (1.0, -1, ["###"], [3, 4])
    assert isinstance(params.temperature, float)
    with pytest.warns(UserWarning, match="temperature 0.001 is below 0.01"):
        assert SamplingParams(temperature=0.001).temperature == 0.01


def test_each_of_n_samples_gets_its_own_seed():
    params = SamplingParams(n=3, seed=10, temperature=0.5, stop=["x"])
    children = [params.for_sample(i) for i in range(3)]
    assert [(c.n, c.seed, c.temperature, c.stop) for c in children] == [(1, 10, 0.5, ["x"]), (1, 11, 0.5, ["x"]),
                                                                        (1, 12, 0.5, ["x"])]
    assert SamplingParams(n=2).for_sample(1).seed is None and params.n == 3


def test_check_vocab():
    SamplingParams(stop_token_ids=[99], logprobs=100, prompt_logprobs=-1).check_vocab(100, max_logprobs=-1)
    with pytest.raises(ValueError, match=r"stop_token_ids has token id 100 outside the vocabulary \[0, 100\)"):
        SamplingParams(stop_token_ids=[5, 100]).check_vocab(100, 20)
    with pytest.raises(ValueError, match=r"allowed_token_ids has token id 100 outside the vocabulary"):
        SamplingParams(allowed_token_ids=[100]).check_vocab(100, 20)
    with pytest.raises(ValueError, match="logprobs must be at most the vocabulary size 100, got 101"):
        SamplingParams(logprobs=101).check_vocab(100, -1)
    with pytest.raises(ValueError, match=r"prompt_logprobs=-1 asks for 100 log-probabilities per token, more than the "
                                         r"engine's max_logprobs=20; create the LLM with a larger max_logprobs"):
        SamplingParams(prompt_logprobs=-1).check_vocab(100, 20)


def test_best_of_is_checked_as_vllm_and_refused_at_submission_as_in_v1():
    params = SamplingParams(n=2, best_of=3)  # vLLM builds it (its tests build it outside pytest.raises)...
    assert (params.n, params.best_of) == (2, 3)
    with pytest.raises(ValueError, match=r"vLLM V1 does not yet support best_of.* ask for n=3 with logprobs=0"):
        params.check_vocab(100, 20)  # ...and V1's input processor refuses it
    SamplingParams(best_of=1).check_vocab(100, 20)  # which V1 serves
    SamplingParams(n=2, best_of=2).for_sample(1)


def test_logprobs_beyond_the_limit_in_vllms_words():
    with pytest.raises(ValueError, match=r"^Requested sample logprobs of 21, which is greater than max allowed: 20 "):
        SamplingParams(logprobs=21).check_vocab(100, 20)
    with pytest.raises(ValueError, match=r"^Requested prompt logprobs of 100, which is greater than max allowed: 20 "):
        SamplingParams(prompt_logprobs=-1).check_vocab(100, 20)
    with pytest.raises(ValueError, match=r"^Requested sample logprobs of 101, which is greater than max allowed: 100 "):
        SamplingParams(logprobs=101).check_vocab(100, -1)


@pytest.fixture(scope="module")
def llm(tied_model):
    with LLM(tied_model, device="cpu", dtype="float32", max_model_len=64) as engine:
        yield engine


@pytest.mark.parametrize("prompt, params, vllm_regex, hint", [
    # vLLM's tests/entrypoints/llm/test_prompt_validation.py, with their regexes
    ([""], None, "decoder prompt cannot be empty", "prompt 0 is empty"),
    ({"prompt_token_ids": [999999]}, None, "out of vocabulary",
     r"prompt 0: token id 999999 is out of vocabulary \[0, 384\)"),
    # vLLM's input processor; its tests match "longer than the maximum model length"
    ({"prompt_token_ids": [1] * 65}, None, "longer than the maximum model length",
     r"^prompt 0 \(length 65\) is longer than the maximum model length of 64 \(max_model_len\); "),
    # vLLM's tests/v1/sample/test_sampling_params_e2e.py::test_best_of (any ValueError); V1's message
    ("Hello", SamplingParams(n=2, best_of=3), "does not yet support best_of", "best_of=3"),
    ("Hello", SamplingParams(logprobs=21), "greater than max allowed: 20", "max_logprobs=20"),
])
def test_vllms_input_errors_in_vllms_words_and_nanovllms_hint(llm, prompt, params, vllm_regex, hint):
    with pytest.raises(ValueError, match=vllm_regex) as error:
        llm.generate(prompt, params, use_tqdm=False)
    assert re.search(hint, str(error.value)), str(error.value)


def test_request_output_keeps_nano_vllm_dict_access():
    out = RequestOutput("0", "Hi", [1, 2], [CompletionOutput(0, " there", [3, 4], finish_reason="length"),
                                            CompletionOutput(1, " you", [5], finish_reason="stop", stop_reason="!")],
                        finished=True)
    assert (out["text"], out["token_ids"]) == (" there", [3, 4])
    assert out.outputs[1].finished() and out.outputs[1].stop_reason == "!"
    with pytest.raises(KeyError, match=r"'prompt'.*only by \('text', 'token_ids'\)"):
        out["prompt"]
