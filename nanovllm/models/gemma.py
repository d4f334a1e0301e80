"""Gemma 1, 2 and 3 (text): GeGLU MLPs, embeddings scaled by sqrt(hidden_size), RMSNorm scaling by (1 + w)."""
from dataclasses import replace

from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions
from nanovllm.models.hf_config import activation, layer_windows


def _gemma(config: PretrainedConfig, act_key: str, **options) -> DecoderOptions:
    return DecoderOptions(activation=activation(config, act_key), norm_weight_offset=1.0,
                          embedding_multiplier=config.hidden_size ** 0.5, **options)


class GemmaForCausalLM(DecoderForCausalLM):
    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return _gemma(config, "hidden_act", qkv_bias=bias, o_bias=bias)


class Gemma2ForCausalLM(DecoderForCausalLM):
    """Gemma 2: norms before and after attention and the MLP, local (sliding) and global layers alternating,
    attention scores and final logits soft-capped, scores scaled by `query_pre_attn_scalar ** -0.5`."""

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return _gemma(config, "hidden_activation", qkv_bias=bias, o_bias=bias, norm_placement="sandwich",
                      layer_windows=layer_windows(config), attention_scale=config.query_pre_attn_scalar ** -0.5,
                      attn_logit_softcap=float(config.attn_logit_softcapping or 0.0),
                      final_logit_softcap=float(config.final_logit_softcapping or 0.0))


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): Gemma 2's layers with RMSNorm on each query/key head and, on local layers, their own rope
    base (`rope_local_base_freq`)."""

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        return replace(super().options(config), qk_norm=True, local_rope=True)
