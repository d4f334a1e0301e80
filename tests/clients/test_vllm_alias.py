"""`nanovllm.as_vllm()`, and what clients written for vLLM read and build of its objects (as outlines and lm-eval do,
tested with the libraries themselves beside this file): the import paths, the `vllm` distribution's version, how
`SamplingParams` is rebuilt and copied, `LoRARequest`, the engine arguments clients pass as they are, `get_tokenizer`,
`resolve_chat_template`, `spaces_between_special_tokens`, and what they read off `LLM.llm_engine`."""
import copy
import importlib
import importlib.metadata
import importlib.util
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import nanovllm
from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.engine.detokenizer import IncrementalDetokenizer

CPU = {"device": "cpu", "dtype": "float32", "max_model_len": 256}


@pytest.fixture
def vllm_alias():
    """`import vllm` gives nanovllm for the test, and nothing after it (the rest of the suite sees no vllm)."""
    assert "vllm" not in sys.modules
    alias = nanovllm.as_vllm()
    yield alias
    alias.remove()
    assert "vllm" not in sys.modules and alias not in sys.meta_path


def test_vllm_is_nanovllm_under_its_name(vllm_alias):
    import vllm.sampling_params
    from vllm import LLM as VllmLLM
    from vllm import SamplingParams as VllmSamplingParams
    from vllm import TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.renderers.hf import resolve_chat_template
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.sample.logits_processor import LogitsProcessor

    import nanovllm.lora.request
    import nanovllm.v1.sample.logits_processor
    assert sys.modules["vllm"] is nanovllm and VllmLLM is LLM and VllmSamplingParams is SamplingParams
    assert vllm.sampling_params is nanovllm.sampling_params, "one module object: one SamplingParams class"
    assert vllm.sampling_params.StructuredOutputsParams is StructuredOutputsParams
    assert LoRARequest is nanovllm.lora.request.LoRARequest
    assert LogitsProcessor is nanovllm.v1.sample.logits_processor.LogitsProcessor
    assert callable(resolve_chat_template) and callable(get_tokenizer)
    assert TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}
    assert nanovllm.__spec__.name == "nanovllm" and nanovllm.sampling_params.__spec__.name == "nanovllm.sampling_params"
    assert importlib.util.find_spec("vllm") is not None
    for missing in ("vllm.engine.arg_utils", "vllm.transformers_utils.tokenizer", "vllm.no_such_module"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(missing)
    assert nanovllm.as_vllm() is nanovllm.as_vllm(), "calling it again changes nothing"


def test_the_vllm_distribution_has_the_version_nanovllm_follows(vllm_alias):
    assert importlib.metadata.version("vllm") == nanovllm.vllm_alias.VLLM_VERSION
    assert importlib.metadata.metadata("vllm")["Name"] == "vllm"


def test_a_real_vllm_imported_first_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", type(sys)("vllm"))
    with pytest.raises(RuntimeError, match="vllm is imported already"):
        nanovllm.as_vllm()


def test_sampling_params_rebuild_from_struct_fields():
    """outlines copies a request's params with `{f: getattr(p, f) for f in p.__struct_fields__}` (vLLM's are a msgspec
    struct), then adds a constraint."""
    params = SamplingParams(n=2, temperature=0.5, top_k=0, stop="x", seed=3, logprobs=2, bad_words=["a"],
                            extra_args={"k": [1]}, spaces_between_special_tokens=False)
    fields = params.__struct_fields__
    assert "logits_processors" not in fields and "bad_words_token_ids" not in fields and "max_tokens" in fields
    rebuilt = SamplingParams(**{f: getattr(params, f) for f in fields})
    assert rebuilt == params
    constrained = SamplingParams(**{**{f: getattr(params, f) for f in fields},
                                    "structured_outputs": StructuredOutputsParams(regex="[0-9]+")})
    assert constrained.structured_outputs.regex == "[0-9]+" and constrained.temperature == 0.5
    clone = params.clone()
    assert clone == params and clone.extra_args is not params.extra_args
    assert copy.deepcopy(params) == params
    with pytest.raises(ValueError, match="spaces_between_special_tokens must be True or False"):
        SamplingParams(spaces_between_special_tokens=None)


def test_lora_requests_need_enable_lora(tied_model):
    from nanovllm.lora.request import LoRARequest

    request = LoRARequest("adapter", 1, "/adapters/a")
    assert request == LoRARequest("adapter", 2, "/elsewhere") and request.adapter_id == 1
    with pytest.raises(ValueError, match="id must be > 0"):
        LoRARequest("adapter", 0, "/adapters/a")
    with LLM(tied_model, **CPU) as llm:
        params = SamplingParams(temperature=0, max_tokens=2)
        assert llm.generate([[1, 2]], params, use_tqdm=False, lora_request=[None])[0].outputs[0].token_ids
        with pytest.raises(ValueError, match="LoRA adapter 'adapter': LoRA is off; create the LLM with enable_lora"):
            llm.generate([[1, 2]], params, lora_request=request)
        with pytest.raises(ValueError, match="enable_lora=True"):
            llm.add_request([1, 2], params, lora_request=request)
        assert llm.is_finished()


def test_vllm_engine_arguments_clients_pass_as_they_are(tied_model):
    """lm-eval hands `LLM` every one of these, in vLLM's defaults; values that would ask for something nanovllm
    does not do are refused."""
    inert = {"revision": None, "tokenizer_revision": None, "tokenizer_mode": "auto", "trust_remote_code": False,
             "enable_lora": False, "max_lora_rank": 16, "max_num_seqs": None, "max_num_batched_tokens": None}
    with LLM(tied_model, **CPU, **inert) as llm:
        assert llm.config.max_num_seqs == 512 and llm.config.max_num_batched_tokens == 16384
        engine = llm.llm_engine
        assert engine is llm.engine and llm.model_config is engine.model_config
        assert engine.model_config.max_model_len == 256 == engine.vllm_config.scheduler_config.max_model_len
        assert engine.model_config.hf_config.vocab_size == 384 and engine.tokenizer is llm.get_tokenizer()
    for name, value in [("revision", "main"), ("tokenizer_mode", "mistral"), ("enable_lora", 1),
                        ("max_lora_rank", 0), ("trust_remote_code", 1)]:
        with pytest.raises(ValueError, match=name):
            LLM(tied_model, **CPU, **{name: value})


def test_get_tokenizer_loads_as_vllm_does(tied_model):
    from nanovllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(tied_model, tokenizer_mode="auto", trust_remote_code=False, revision=None)
    reference = AutoTokenizer.from_pretrained(tied_model)
    assert tokenizer.encode("Hello, my name is Ada") == reference.encode("Hello, my name is Ada")
    assert tokenizer.truncation_side == "left", "vLLM's default for a generating model"
    assert get_tokenizer(tied_model, truncation_side="right").truncation_side == "right"
    with pytest.raises(ValueError, match="tokenizer_mode"):
        get_tokenizer(tied_model, tokenizer_mode="mistral")


def test_resolve_chat_template(tied_model):
    from nanovllm.renderers.hf import resolve_chat_template

    tokenizer = AutoTokenizer.from_pretrained(tied_model)
    assert resolve_chat_template(tokenizer, None, None, model_config=None) is None, "a base model has none"
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert resolve_chat_template(tokenizer, None, None, model_config=None) == tokenizer.chat_template
    assert resolve_chat_template(tokenizer, "{{ 'given' }}", None, model_config=None) == "{{ 'given' }}"


def _wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    """A decoder that puts a space before every token (BERT's WordPiece), and two added special tokens."""
    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens(["<s1>", "<s2>"])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


@pytest.mark.parametrize("spaces, expected", [(True, " <s1> <s2> b <s1>"), (False, " <s1><s2> b <s1>")])
def test_spaces_between_special_tokens(spaces, expected):
    """As vLLM's fast detokenizer: without spaces, an added token that follows another is its bare text (lm-eval
    asks for that in every generate_until)."""
    tokenizer = _wordpiece_tokenizer()
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
    detokenizer = IncrementalDetokenizer(tokenizer, [0], params)
    text = "".join(detokenizer.update([token]).text for token in [3, 4, 1]) + detokenizer.update([3], True).text
    assert text == expected
    batched = IncrementalDetokenizer(tokenizer, [0], params)
    assert batched.update([3, 4, 1, 3], True).text == expected, "several tokens at once (speculative steps)"
    skipped = IncrementalDetokenizer(tokenizer, [0], SamplingParams(spaces_between_special_tokens=spaces))
    assert skipped.update([3, 4, 1, 3], True).text == " b"
