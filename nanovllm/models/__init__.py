"""Model families, looked up by the `architectures` entry of config.json."""
from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderForCausalLM
from nanovllm.models.hf_config import rope_scaling
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.mixtral import MixtralForCausalLM
from nanovllm.models.qwen2 import Qwen2ForCausalLM
from nanovllm.models.qwen2_moe import Qwen2MoeForCausalLM
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(config: PretrainedConfig) -> type[DecoderForCausalLM]:
    """The family that runs `config`; a ValueError naming the supported ones when none does, or when the
    family cannot run this particular config (activation, rope scaling, sliding window)."""
    names = getattr(config, "architectures", None) or []
    cls = next((MODEL_REGISTRY[name] for name in names if name in MODEL_REGISTRY), None)
    if cls is None:
        found = f"architectures {names}" if names else "no 'architectures' entry"
        raise ValueError(f"unsupported model: config.json has {found}; nanovllm supports {sorted(MODEL_REGISTRY)}")
    if config.hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r} in the model config; nanovllm supports 'silu'")
    rope_scaling(config)
    cls.options(config)
    return cls


def build_model(config: PretrainedConfig) -> DecoderForCausalLM:
    return model_class(config)(config)
