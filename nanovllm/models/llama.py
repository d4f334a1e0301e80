from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions
from nanovllm.models.hf_config import activation


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 2 and 3, SmolLM2, TinyLlama: optional `attention_bias` and `mlp_bias` (rope scaling is read for every
    family)."""

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=attention_bias, o_bias=attention_bias,
                              mlp_bias=bool(getattr(config, "mlp_bias", False)), activation=activation(config))
