"""lm-eval (EleutherAI's evaluation harness) on nanovllm through its vLLM model, `lm_eval.models.vllm_causallms.VLLM`
(model type "vllm"), with `vllm` aliased to nanovllm (`nanovllm.as_vllm()`) and nothing else. lm-eval builds the `LLM`
itself from `pretrained=` and vLLM's engine arguments, loads the tokenizer through `vllm.tokenizers.get_tokenizer`,
resolves the chat template through `vllm.renderers.hf`, reads `llm_engine.model_config.max_model_len`, and gets its
numbers from `prompt_logprobs`. Requests are made by hand (no dataset): loglikelihood and rolling loglikelihood equal
transformers' float32 log-softmax summed over the continuation on the same weights, `is_greedy` its argmax, and
generate_until nanovllm's own output cut at the first stop string."""
import shutil

import pytest
import torch
from checkpoints import hf_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

import nanovllm
from nanovllm import SamplingParams

lm_eval = pytest.importorskip("lm_eval")

MAX_LENGTH = 64  # short enough that a rolling loglikelihood takes several windows
CONTEXTS = ["Hello, my name is", "The quick brown fox", "Paged attention stores keys", "List all primes below",
            "Continuous batching admits", "Hello"]
CONTINUATIONS = [" Ada and I like", " jumps over the lazy dog", " and values", " 50: 2, 3", " new requests", ","]
# prompts whose greedy texts have printable characters past their first third (the random model writes odd bytes)
GENERATE = ["The quick brown fox", "Paged attention stores keys", "List all primes below", "Hello", "List all",
            "Continuous batching"]
TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def build(pretrained: str, **args):
    """lm-eval's vLLM model, as `lm_eval --model vllm --model_args pretrained=...,dtype=float32` builds it. lm-eval
    drops a `device` argument (vLLM picks its platform), so the engine's "auto" device is kept on the CPU here the way
    CUDA_VISIBLE_DEVICES="" would, for a machine with a GPU (or mocked ones)."""
    from lm_eval.api.registry import get_model

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        return get_model("vllm")(pretrained=pretrained, dtype="float32", max_model_len=MAX_LENGTH, batch_size=4,
                                 **args)


@pytest.fixture(scope="module")
def lm(tied_model):
    alias = nanovllm.as_vllm()
    try:
        model = build(tied_model)
        yield model
        model.model.exit()
    finally:
        alias.remove()


@pytest.fixture(scope="module")
def hf_model(tied_model):
    return AutoModelForCausalLM.from_pretrained(tied_model, dtype=torch.float32).eval()


def instance(kind: str, arguments: tuple, index: int = 0):
    from lm_eval.api.instance import Instance

    return Instance(kind, {}, arguments, index)


def hf_score(hf_model, tokens: list[int], start: int) -> tuple[float, bool]:
    """transformers' log-probability of `tokens[start:]` after `tokens[:start]`, and whether each is the argmax."""
    with torch.no_grad():
        logprobs = hf_model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
    rows, targets = logprobs[start - 1:-1], torch.tensor(tokens[start:])
    return rows.gather(1, targets[:, None]).sum().item(), bool((rows.argmax(-1) == targets).all())


def test_it_reads_the_engine_as_vllm(lm):
    assert type(lm.model) is nanovllm.LLM
    assert lm.max_length == MAX_LENGTH == lm.model.llm_engine.model_config.max_model_len
    assert lm.tokenizer.truncation_side == "left" and lm.eot_token_id == 0 == lm.prefix_token_id
    assert lm.hf_chat_template is None, "the test model's tokenizer has no chat template"
    assert lm.model.config.max_num_seqs == 512 and lm.model.config.seed == 1234, "lm-eval's engine arguments"


def test_loglikelihood_equals_transformers(lm, hf_model):
    results = lm.loglikelihood([instance("loglikelihood", pair, i)
                                for i, pair in enumerate(zip(CONTEXTS, CONTINUATIONS))])
    for (context, continuation), (logprob, is_greedy) in zip(zip(CONTEXTS, CONTINUATIONS), results):
        tokens, start = lm.tok_encode(context + continuation), len(lm.tok_encode(context))
        expected, greedy = hf_score(hf_model, tokens, start)
        assert logprob == pytest.approx(expected, rel=1e-5, abs=1e-4) and is_greedy == greedy
        assert len(tokens) > start and logprob < 0


def test_is_greedy_for_the_models_own_continuation(lm, hf_model):
    """Continuations of one token that transformers' argmax picks (those whose text tokenizes back to it)."""
    requests = []
    for context in CONTEXTS:
        ids = lm.tok_encode(context)
        for token in hf_greedy(hf_model, [ids], 1)[0]:
            text = lm.tokenizer.decode([token])
            if text and lm.tok_encode(context + text) == ids + [token]:
                requests.append((context, text))
    assert len(requests) >= 2, "the test needs some such continuations"
    results = lm.loglikelihood([instance("loglikelihood", pair, i) for i, pair in enumerate(requests)])
    for (context, text), (logprob, is_greedy) in zip(requests, results):
        expected, _ = hf_score(hf_model, lm.tok_encode(context + text), len(lm.tok_encode(context)))
        assert is_greedy and logprob == pytest.approx(expected, rel=1e-5, abs=1e-4)


def test_loglikelihood_rolling_equals_transformers(lm, hf_model):
    """A text longer than the model's window is scored in disjoint windows, each token once, after the prefix token."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    texts = [" ".join(CONTEXTS + CONTINUATIONS) * 2, CONTEXTS[0]]
    results = lm.loglikelihood_rolling([instance("loglikelihood_rolling", (text,), i) for i, text in enumerate(texts)])
    for text, total in zip(texts, results):
        tokens = lm.tok_encode(text)
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, lm.prefix_token_id,
                                                                               MAX_LENGTH - 2, 1)]
        assert (len(windows) > 1) == (text is texts[0])
        expected = sum(hf_score(hf_model, context + continuation, len(context))[0]
                       for context, continuation in windows)
        assert sum(len(continuation) for _, continuation in windows) == len(tokens)
        assert total == pytest.approx(expected, rel=1e-5, abs=1e-3)


def stop_string(text: str) -> str:
    """Two printable characters from past the first third of a greedy text."""
    for i in range(len(text) // 3, len(text) - 1):
        if text[i:i + 2].isprintable() and "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip():
            return text[i:i + 2]
    raise AssertionError(f"no stop string in {text!r}")


def test_generate_until_equals_nanovllms_greedy_output_cut_at_the_stop(lm, tied_model):
    prompts = [lm.tok_encode(context) for context in GENERATE]
    params = SamplingParams(temperature=0, max_tokens=24)
    outputs = lm.model.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    full = [output.outputs[0].text for output in outputs]
    assert [list(o.outputs[0].token_ids) for o in outputs if o.outputs[0].finish_reason == "length"] == [
        tokens for tokens, o in zip(hf_greedy(tied_model, prompts, 24), outputs)
        if o.outputs[0].finish_reason == "length"]
    stops = [stop_string(text) for text in full]
    greedy = {"max_gen_toks": 24, "do_sample": False}
    requests = [instance("generate_until", (context, {"until": [stop], **greedy}), i)
                for i, (context, stop) in enumerate(zip(GENERATE, stops))]
    requests.append(instance("generate_until", (GENERATE[0], {"until": ["\n\n\n\n"], **greedy}), 99))
    results = lm.generate_until(requests)
    assert results[:-1] == [text[:text.index(stop)] for text, stop in zip(full, stops)]
    assert results[-1] == full[0] and all(results[:-1]), "no stop: max_gen_toks tokens"


def test_generate_until_with_sampling_arguments(lm):
    """lm-eval hands the task's generation arguments to SamplingParams as they are (a seed here, so that the
    sample is nanovllm's own for the same request)."""
    kwargs = {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "seed": 11}
    results = lm.generate_until([instance("generate_until", (CONTEXTS[1], {"until": ["\n\n\n\n"], "max_gen_toks": 12,
                                                                           **kwargs}))])
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12, skip_special_tokens=False,
                            spaces_between_special_tokens=False)
    expected = lm.model.generate({"prompt_token_ids": lm.tok_encode(CONTEXTS[1])}, params, use_tqdm=False)
    assert results == [expected[0].outputs[0].text]


def test_chat_template(lm, tied_model, tmp_path):
    """A model with a chat template: lm-eval finds it through `vllm.renderers.hf.resolve_chat_template` and renders
    requests with it."""
    path = shutil.copytree(tied_model, tmp_path / "chat-model")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    chat = build(str(path))
    try:
        assert chat.hf_chat_template == TEMPLATE
        text = chat.apply_chat_template([{"role": "user", "content": "Hello, my name is"}])
        assert text == "<|endoftext|>user: Hello, my name is\nassistant:"
        result = chat.generate_until([instance("generate_until", (text, {"until": ["\n\n\n\n"], "max_gen_toks": 8,
                                                          "do_sample": False}))])
        expected = chat.model.generate({"prompt_token_ids": chat.tok_encode(text)},
                                       SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert result == [expected[0].outputs[0].text]
    finally:
        chat.model.exit()
