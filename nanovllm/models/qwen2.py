from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions
from nanovllm.models.hf_config import activation


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 and Qwen2.5: a bias on the q, k and v projections only; full attention in every layer."""

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("this Qwen2 config sets use_sliding_window=true; nanovllm runs full attention only")
        return DecoderOptions(qkv_bias=True, activation=activation(config))
