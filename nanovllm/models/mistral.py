from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions
from nanovllm.models.hf_config import activation, layer_windows


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral: Llama's layers with a sliding window over every layer when `sliding_window` is set."""

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(activation=activation(config), layer_windows=layer_windows(config))
