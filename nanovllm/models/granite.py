from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions
from nanovllm.models.hf_config import activation


class GraniteForCausalLM(DecoderForCausalLM):
    """IBM Granite (3.x dense): Llama's layers with multipliers on the embeddings, the residual branches and the
    attention scores, and logits divided by `logits_scaling`."""

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=attention_bias, o_bias=attention_bias,
                              mlp_bias=bool(getattr(config, "mlp_bias", False)), activation=activation(config),
                              embedding_multiplier=float(config.embedding_multiplier),
                              residual_multiplier=float(config.residual_multiplier),
                              attention_scale=float(config.attention_multiplier),
                              logits_divisor=float(config.logits_scaling))
