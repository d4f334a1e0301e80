from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions
from nanovllm.models.hf_config import activation


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3: RMSNorm on every query and key head; `attention_bias` on all four attention projections."""

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qk_norm=True, qkv_bias=bias, o_bias=bias, activation=activation(config))
