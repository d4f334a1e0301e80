from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions
from nanovllm.models.hf_config import activation, layer_windows


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 and Qwen2.5: a bias on the q, k and v projections only; with `use_sliding_window`, a sliding window on
    the layers from `max_window_layers` on (transformers' `layer_types`)."""

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True, activation=activation(config), layer_windows=layer_windows(config))
