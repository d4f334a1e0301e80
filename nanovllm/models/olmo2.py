from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions
from nanovllm.models.hf_config import activation


class Olmo2ForCausalLM(DecoderForCausalLM):
    """OLMo 2: norms after attention and after the MLP (none before), RMSNorm over the whole q and k projections."""

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=attention_bias, o_bias=attention_bias, activation=activation(config),
                              qk_norm_full=True, norm_placement="post")
