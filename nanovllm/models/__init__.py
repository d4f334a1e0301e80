"""Model families, looked up by the `architectures` entry of config.json."""
from transformers import PretrainedConfig

from nanovllm.models.bert import BERT_ARCHITECTURES, BertForPooling, EncoderForPooling
from nanovllm.models.decoder import DecoderForCausalLM
from nanovllm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaForCausalLM
from nanovllm.models.gpt_neox import GPTNeoXForCausalLM, StableLmForCausalLM
from nanovllm.models.granite import GraniteForCausalLM
from nanovllm.models.hf_config import layer_types, rope_scaling
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.mistral import MistralForCausalLM
from nanovllm.models.mixtral import MixtralForCausalLM
from nanovllm.models.modernbert import MODERNBERT_ARCHITECTURES, ModernBertForPooling
from nanovllm.models.olmo2 import Olmo2ForCausalLM
from nanovllm.models.phi3 import Phi3ForCausalLM
from nanovllm.models.qwen2 import Qwen2ForCausalLM
from nanovllm.models.qwen2_moe import Qwen2MoeForCausalLM
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {cls.__name__: cls for cls in (
    LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, GemmaForCausalLM, Gemma2ForCausalLM,
    Gemma3ForCausalLM, Phi3ForCausalLM, Olmo2ForCausalLM, GraniteForCausalLM, GPTNeoXForCausalLM,
    StableLmForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM)}

ENCODERS: dict[str, type[EncoderForPooling]] = {**dict.fromkeys(BERT_ARCHITECTURES, BertForPooling),
                                                **dict.fromkeys(MODERNBERT_ARCHITECTURES, ModernBertForPooling)}
"""Encoder-only architectures (config.json's `architectures` entries), run by the pooling runner, and their models."""

POOLING_SUFFIXES = ("ForSequenceClassification", "Model")
"""Architectures without an LM head, run by the pooling runner: a family's classifier, and its base model (what
sentence-transformers saves; e5-mistral's `MistralModel`)."""


def causal_name(architecture: str) -> str:
    """The family's `*ForCausalLM` name for one of its pooling architectures (`Qwen2ForSequenceClassification`,
    `Qwen3Model`, Gemma 3's `Gemma3TextModel`); other names as they are."""
    for suffix in POOLING_SUFFIXES:
        if architecture.endswith(suffix):
            return architecture.removesuffix(suffix).removesuffix("Text") + "ForCausalLM"
    return architecture


def has_lm_head(config: PretrainedConfig) -> bool:
    """Whether the config's architecture is a family's `*ForCausalLM` (what the generate runner needs)."""
    return any(name in MODEL_REGISTRY for name in getattr(config, "architectures", None) or [])


def model_class(config: PretrainedConfig) -> type[DecoderForCausalLM] | type[EncoderForPooling]:
    """The family that runs `config` (the engine's setup asks once and keeps its name in `Config.architecture`); a
    ValueError naming the supported ones when none does, or when the family cannot run this particular config
    (activation, rope scaling, sliding window). Gives `config` the attributes the engine reads under Llama's names
    (`normalize_config`)."""
    names = getattr(config, "architectures", None) or []
    cls = next((ENCODERS[name] for name in names if name in ENCODERS), None) or \
        next((MODEL_REGISTRY[causal_name(name)] for name in names if causal_name(name) in MODEL_REGISTRY), None)
    if cls is None:
        found = f"architectures {names}" if names else "no 'architectures' entry"
        raise ValueError(f"unsupported model: config.json has {found}; nanovllm supports {sorted(MODEL_REGISTRY)}, "
                         f"and for pooling each family's *ForSequenceClassification and *Model, and "
                         f"{list(ENCODERS)}")
    cls.normalize_config(config)
    for kind in set(layer_types(config)):
        rope_scaling(config, kind)
    cls.options(config)
    return cls


def kv_sliding_window(family: type[DecoderForCausalLM], config: PretrainedConfig) -> int:
    """The window outside which no layer of `family` reads K/V (so its blocks can be released), 0 when some layer
    attends to everything (Gemma 2/3 alternate local and global layers: nothing can be released)."""
    windows = family.options(config).layer_windows
    return max(windows) if windows and all(windows) else 0


def build_model(architecture: str, config: PretrainedConfig) -> DecoderForCausalLM:
    """The model of family `architecture` (as `model_class` named it) for `config`, its weights not yet loaded."""
    return MODEL_REGISTRY[architecture](config)
